"""The demo's ``--warm-start``: RL starts from a given SFT warm start, and a directory without a model is refused."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
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


def test_an_api_given_up_ends_the_demo_naming_it(tmp_path: Path, tiny_model_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An API that fails at every start (here: an address of no interface of this host) is given up
    (``launcher.max_restarts``) and publishes no address: the demo waited out the 120 s for it, the stack long
    stopped, and ended in a traceback saying only that no address came."""
    rc = main(["--warm-start", str(tiny_model_dir), "--eval-tasks", "2", f"run.dir={tmp_path}",
               f"checkpoint.stage_dir={tmp_path / 'stage'}", "api.host=192.0.2.1", "launcher.max_restarts=1"])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the stack stopped: api keeps failing and is given up"), err


def test_a_trainer_the_demo_restarts_resumes_from_its_checkpoint(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The demo started its trainer without ``--resume``: one its stack restarted (a crash, a SIGKILL, a SIGTERM it did
    not send) trained again from the warm start at step 0, its RL steps lost, and the run took more steps than asked."""
    def kill_the_trainer_at_step_4() -> None:
        while not (records := list(tmp_path.glob("*/metrics.jsonl"))) or len(records[0].read_text().splitlines()) < 4:
            time.sleep(0.05)
        found = subprocess.run(["pgrep", "-f", f"python -m trainer -c {tmp_path}/"], capture_output=True, text=True)
        (pid,) = found.stdout.split()
        os.kill(int(pid), signal.SIGKILL)  # its last checkpoint is step 4's

    killer = threading.Thread(target=kill_the_trainer_at_step_4, daemon=True)
    killer.start()
    assert main(["--warm-start", str(tiny_model_dir), "--eval-tasks", "2", f"run.dir={tmp_path}",
                 f"checkpoint.stage_dir={tmp_path / 'stage'}", "trainer.total_steps=12",
                 "trainer.checkpoint_every=2"]) == 0
    assert not killer.is_alive()
    (log,) = tmp_path.glob("*/logs/trainer-0.log")
    starts = [int(step) for step in re.findall(r"training from step (\d+)", log.read_text())]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 4, starts
