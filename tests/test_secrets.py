"""A component that needs a secret and has none refuses to start, with one line saying where to put it.

Each runs as users start it (``python -m ...``), with no ``ROLLWAVE_*`` variable in its environment.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HINT = "(generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"


def start(module: str, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    return subprocess.run([sys.executable, "-m", module, *overrides], cwd=ROOT, env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["trainer", "rollout_server"])
def test_the_checkpoint_plane_needs_its_token(module: str) -> None:
    proc = start(module, "redis.url=redis://127.0.0.1:1/0")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: checkpoint.token is not set: give it in ROLLWAVE_CHECKPOINT_TOKEN or "
                                   f"checkpoint.token_file {HINT}")


@pytest.mark.parametrize("module", ["trainer", "rollout_server"])
def test_colocated_components_push_no_weights_and_need_no_checkpoint_token(module: str) -> None:
    proc = start(module, "placement.mode=colocated", "redis.url=redis://127.0.0.1:1/0")
    assert proc.returncode != 0 and "checkpoint.token" not in proc.stderr
    assert "model.path: runs/model holds no model" in proc.stderr  # past the secrets, stopped at the next check


def test_an_api_off_loopback_needs_its_token() -> None:
    proc = start("services.api", "api.host=0.0.0.0", "redis.url=redis://127.0.0.1:1/0")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: api.token is not set and api.host=0.0.0.0 is not loopback"), proc.stderr
    # the checkpoint token is no API token: separate secrets
    proc = start("services.api", "api.host=0.0.0.0", env={"ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)})
    assert proc.returncode == 2 and "api.token is not set" in proc.stderr


def test_a_remote_engine_needs_a_key() -> None:
    proc = start("rollout_server", "engine.backend=sglang", "engine.urls=[http://10.0.0.7:30000]",
                 env={"ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: engine.urls: http://10.0.0.7:30000 is not loopback: set engine.api_key")


def test_a_short_or_masked_token_is_refused_without_echoing_it(tmp_path: Path) -> None:
    proc = start("trainer", env={"ROLLWAVE_CHECKPOINT_TOKEN": "short-token"})
    assert proc.returncode == 2 and "checkpoint.token: must be at least 32 characters" in proc.stderr
    assert "short-token" not in proc.stderr
    masked = tmp_path / "run.yaml"
    masked.write_text("checkpoint:\n  token: '**********'\n")
    proc = start("rollout_server", "-c", str(masked))
    assert proc.returncode == 2
    assert "checkpoint.token: the config holds a masked secret; give it in ROLLWAVE_CHECKPOINT_TOKEN" in proc.stderr


def test_launchers_hand_each_component_only_its_own_secrets(tmp_path: Path) -> None:
    """The Redis password goes to every component, the checkpoint token to the trainer and rollout servers,
    the API token to the API only; never on a command line."""
    from core.config import load_config
    from services.launcher import components

    given = {"api.token": "a" * 40, "checkpoint.token": "c" * 40, "redis.password": "r" * 40}
    cfg = load_config(None, [f"{k}={v}" for k, v in given.items()], env={})
    specs = {s.name: s for s in components(cfg, tmp_path / "c.yaml", "redis://127.0.0.1:1/0")}
    assert specs["api"].env == {"ROLLWAVE_API_TOKEN": "a" * 40, "ROLLWAVE_REDIS_PASSWORD": "r" * 40}
    for name in ("trainer-0", "rollout-0"):
        own = {k: v for k, v in specs[name].env.items() if k.startswith("ROLLWAVE_")}
        assert own == {"ROLLWAVE_CHECKPOINT_TOKEN": "c" * 40, "ROLLWAVE_REDIS_PASSWORD": "r" * 40}, name
    assert not [a for s in specs.values() for a in s.argv if any(v in a for v in given.values())]
