"""Config layering and validation: errors name the full dotted key."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from core.config import ConfigError, load_config
from core.jobs import JobSpec
from core.tiny_model import ensure_model
from services.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_demo_config_loads() -> None:
    cfg = load_config(ROOT / "configs/demo.yaml")
    assert cfg.run.name == "demo"
    assert cfg.trainer.loss == "decoupled_ppo"


def test_layering_defaults_file_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.5\n  total_steps: 7\n")
    cfg = load_config(path, ["trainer.lr=1e-5", "rollout.n_samples=3", "engine.urls=[http://a:1]"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.trainer.total_steps == 7
    assert cfg.rollout.n_samples == 3
    assert cfg.engine.urls == ["http://a:1"]
    assert cfg.buffer.max_staleness == 2


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.lrr=1"], "trainer.lrr: unknown key"),
        (["trainer.lr=fast"], "trainer.lr:"),
        (["trainer.lr=-1"], "trainer.lr:"),
        (["rollout.mode=sometimes"], "rollout.mode:"),
        (["nosuch.section=1"], "nosuch: unknown key"),
        (["trainer.is_low=3", "trainer.is_high=2"], "trainer:"),
        (["trainer"], "expected dotted.key=value"),
        (["checkpoint.quorum=0"], "checkpoint: Value error, quorum must be majority, all or a number >= 1"),
        (["rollout.top_k=0"], "rollout: Value error, top_k must be -1 (disable), or at least 1, got 0"),
        (["rollout.top_p=0"], "rollout.top_p:"),
        (["engine.dtype=int8"], "engine.dtype:"),
        (["engine.ready_timeout_s=0"], "engine.ready_timeout_s:"),
        (["checkpoint.pause_timeout_s=-1"], "checkpoint.pause_timeout_s:"),
        (["checkpoint.quorum=most"], "checkpoint.quorum"),
        (["checkpoint.min_throughput_mib_s=0"], "checkpoint.min_throughput_mib_s:"),
        (["checkpoint.connect_timeout_s=0"], "checkpoint.connect_timeout_s:"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_bad_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+"):
        load_config(path)


def test_cli_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", "-c", str(ROOT / "configs/demo.yaml"), "trainer.lr=2e-5"]) == 0
    out = capsys.readouterr().out
    assert "lr: 2.0e-05" in out
    with pytest.raises(SystemExit) as exited:  # exit 2, as argparse exits on a usage error
        main(["config", "check", "-c", str(ROOT / "configs/demo.yaml"), "api.port=http"])
    assert exited.value.code == 2
    assert "api.port" in capsys.readouterr().err


def test_a_missing_model_is_an_error_naming_model_path(tmp_path: Path) -> None:
    cfg = load_config(None, [f"model.path={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match=f"model.path: {tmp_path / 'none'} holds no model"):
        ensure_model(cfg.model)
    assert not (tmp_path / "none").exists()
    built = ensure_model(load_config(None, [f"model.path={tmp_path / 'tiny'}", "model.init_if_missing=true"]).model)
    assert (built / "config.json").is_file()
    assert load_config(ROOT / "configs/demo.yaml").model.init_if_missing


def test_a_job_refuses_what_sglang_would() -> None:
    source = {"kind": "arith", "limit": 1}
    with pytest.raises(ValidationError, match="top_k must be -1"):
        JobSpec.model_validate({"source": source, "sampling": {"top_k": 0}})
    assert JobSpec.model_validate({"source": source, "sampling": {"top_k": 5}}).sampling.top_k == 5


def test_sync_mode_is_async_with_zero_staleness() -> None:
    assert load_config(None, ["rollout.mode=sync", "buffer.max_staleness=3"]).buffer.max_staleness == 0
    assert load_config(None, ["buffer.max_staleness=3"]).buffer.max_staleness == 3
