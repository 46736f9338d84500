"""The demo's ``--warm-start``: RL starts from a given SFT warm start, and a directory without a model is refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.demo import DEMO_CONFIG, _parser, main, policy, run_redis


def test_warm_start_dir_is_the_policy_and_no_sft_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    args = _parser().parse_args(["--warm-start", str(tiny_model_dir), "trainer.total_steps=3"])
    cfg = load_config(args.config, args.overrides)
    assert policy(cfg, tmp_path, args.sft_steps, args.warm_start) == tiny_model_dir.absolute()
    assert list(tmp_path.iterdir()) == []  # no base model built, no SFT written


def test_warm_start_without_a_model_is_refused(tmp_path: Path) -> None:
    cfg = load_config(_parser().parse_args([]).config, [])
    with pytest.raises(SystemExit, match=r"--warm-start .*: no HF model there"):
        policy(cfg, tmp_path, 700, tmp_path)


def test_a_component_that_refuses_its_config_ends_the_demo_at_once_naming_it(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The stack leaves a component that refused its config stopped: the demo says which and why (its log's last
    line) and exits 2, rather than waiting out its timeouts (180 s for a rollout server) and a traceback."""
    started = time.monotonic()
    rc = main(["--warm-start", str(tiny_model_dir), "--eval-tasks", "2", f"run.dir={tmp_path}",
               f"checkpoint.stage_dir={tmp_path / 'stage'}", "placement.rollout_cpus=[4095]"])
    assert rc == 2
    assert time.monotonic() - started < 90
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: rollout-0 refused its config (exit 2; "), err
    assert "placement.rollout_cpus" in err and "4095" in err, err


def test_a_model_path_given_to_the_demo_is_refused_naming_what_it_starts_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo sets the model it trains itself (its SFT warm start, or ``--warm-start``): a ``model.path`` given to
    it was dropped without a word, and the run trained the tiny model."""
    assert main([f"run.dir={tmp_path}", "model.path=/models/mine"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.path: the demo starts RL from an SFT warm start") and "--warm-start" in err
    assert not any(tmp_path.iterdir())  # nothing started
    run_yaml = tmp_path.parent / f"{tmp_path.name}.yaml"  # the file's model.path was dropped the same way
    run_yaml.write_text("model:\n  path: /models/mine\n")
    assert main(["-c", str(run_yaml), f"run.dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {run_yaml}: model.path: the demo starts RL from")
    assert not any(tmp_path.iterdir())
    copy = tmp_path.parent / f"{tmp_path.name}-copy.yaml"  # the demo config's own model.path, as a copy keeps it
    copy.write_text(DEMO_CONFIG.read_text().replace("lr:", "lr: 2.0e-4 #"))
    with pytest.raises(SystemExit, match="no HF model there"):  # past the check: the run's first step refuses
        main(["-c", str(copy), f"run.dir={tmp_path}", "--warm-start", str(tmp_path / "none")])


def test_the_demo_starts_its_redis_with_the_redis_keys_or_uses_the_one_given(
    tmp_path: Path, redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo started its embedded Redis with AOF and the password only: ``redis.appendfsync=always`` (nothing
    acknowledged lost) was everysec, and ``redis.url`` / ``REDIS_URL`` were ignored for a Redis of its own."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    cfg = load_config(None, [f"run.dir={tmp_path}", "redis.appendfsync=always"], env={})
    with run_redis(cfg, tmp_path / "run") as url, redis.Redis.from_url(url) as client:
        assert client.config_get("appendfsync")["appendfsync"] == "always"
        assert Path(client.config_get("dir")["dir"]) == tmp_path / "run" / "redis"
    with pytest.raises(redis.ConnectionError), redis.Redis.from_url(url, socket_connect_timeout=1) as gone:
        gone.ping()  # stopped with the demo
    given = load_config(None, [f"run.dir={tmp_path}", f"redis.url={redis_server.url}"], env={})
    with run_redis(given, tmp_path / "other") as url:
        assert url == redis_server.url and not (tmp_path / "other").exists()
