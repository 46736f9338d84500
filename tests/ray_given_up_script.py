"""A component that fails at every start, on a real local Ray: its actor gives it up and stops the run's other
component through Ray, and ``rollwave up --foreground``'s wait (``_stay``) names it, stops the run and returns 1.

Run by ``tests/test_ray_given_up.py`` inside a network namespace that has only loopback, as
``python tests/ray_given_up_script.py RUN_DIR``. It starts a Ray head as ``up`` does (``start_head``, recorded in
``ray.json``) and the two components' actors as ``up`` places them (named, detached, each naming the other as its
peer), then calls ``_stay``, whose ``rollwave down`` stops them and the head. It prints one JSON object (the last
line of stdout) that the test asserts on; it asserts nothing itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

os.environ["RAY_AUTH_MODE"] = "token"  # the head requires its token; Ray reads this on import

import ray  # noqa: E402
import yaml  # noqa: E402
from ray_stack_script import alive_in  # noqa: E402

from services.launcher import ComponentSpec  # noqa: E402
from services.ray_launcher import ComponentActor, _connect, _stay, _write_state, start_head  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ACCEPTS = ("import time; from core.config import load_config_or_exit; load_config_or_exit(None); "
           "time.sleep(300)")


def main() -> int:
    run_root = Path(sys.argv[1])
    config = run_root / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"name": "givenup", "dir": str(run_root)}}))
    run_dir = run_root / "givenup"
    run_dir.mkdir(parents=True)
    logs = run_dir / "logs"
    state: dict[str, Any] = {"namespace": "rollwave-givenup", "actors": [], "placement_groups": [],
                             "up_pid": os.getpid(), "launched": False}
    result: dict[str, Any] = {}
    try:
        start_head(2, logs / "ray-head.log", lambda head: (state.update(head), _write_state(run_dir / "ray.json",
                                                                                             state)))
        result["head"] = {k: state[k] for k in ("head_pid", "temp_dir")}
        _connect(state)
        lives = ComponentSpec("lives", [sys.executable, "-c", ACCEPTS], {"PYTHONPATH": str(ROOT)})
        dies = ComponentSpec("dies", ["sh", "-c", "echo starting; exit 3"], max_restarts=1)
        actors = {}
        for spec, peer in ((lives, "dies"), (dies, "lives")):  # lives first: dies may give up at once
            state["actors"].append(spec.name)
            _write_state(run_dir / "ray.json", state)
            actors[spec.name] = ComponentActor.options(name=spec.name, lifetime="detached", num_cpus=0).remote(
                spec, str(logs), peers=(peer,))
            ray.get(actors[spec.name].pid.remote(), timeout=120)  # its constructor returned
        state["launched"] = True
        _write_state(run_dir / "ray.json", state)
        result["lives_pid"] = ray.get(actors["lives"].pid.remote(), timeout=60)
        deadline = time.monotonic() + 120
        while (rc := ray.get(actors["lives"].returncode.remote(), timeout=60)) is None:  # none but dies stops it
            if time.monotonic() > deadline:
                raise TimeoutError("lives was not stopped within 120 s")
            time.sleep(0.1)
        result["lives_rc"] = rc
        result["dies_restarts"] = ray.get(actors["dies"].restarts.remote(), timeout=60)
        ray.shutdown()
        result["stay_rc"] = _stay(argparse.Namespace(config=str(config), overrides=[]), state, ["lives", "dies"],
                                   threading.Event())
        result["starts_logged"] = (logs / "dies.log").read_text().count("starting")
    except Exception:  # reported in the JSON; the test fails on it
        result["error"] = traceback.format_exc()[-3000:]
    finally:
        if ray.is_initialized():
            ray.shutdown()
    head = result.get("head") or {}
    result["left"] = alive_in({head["head_pid"]} if head else set(), head.get("temp_dir") or "")
    result["lives_left"] = bool(result.get("lives_pid")) and Path(f"/proc/{result['lives_pid']}").exists()
    result["state_file_left"] = (run_dir / "ray.json").exists()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
