"""``rollwave up`` / ``rollwave down``: the stack of ``services.launcher.components`` as Ray actors.

Each component runs in a detached ``ComponentActor`` that owns its process; when the process dies
the actor exits and Ray restarts it (``max_restarts=-1``), which starts the process again: a
rollout server rejoins the registry and is re-synced by the trainer's next push, a trainer rank
resumes from its last checkpoint. Actors are placed in one placement group. Without
``RAY_ADDRESS`` a local Ray head is started (and stopped by ``down``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from buffer.redis_server import EmbeddedRedis
from services.config import Config, ConfigError, dump_config, load_config
from services.launcher import ComponentSpec, components, free_port

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Child side of fork: get SIGTERM when the actor process dies, so no component outlives its actor."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@ray.remote(max_restarts=-1, max_task_retries=-1)
class ComponentActor:
    """Owns one component process; exits (and so is restarted by Ray) when the process fails."""

    def __init__(self, spec: ComponentSpec, log_dir: str) -> None:
        self.spec = spec
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        out = open(Path(log_dir) / f"{spec.name}.log", "ab")  # noqa: SIM115 - handed to the child
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(spec.argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        out.close()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        rc = self.proc.wait()
        if rc != 0:
            os._exit(1)

    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@ray.remote(max_restarts=-1)
class RedisActor:
    """The embedded Redis in an actor: AOF on, in the run directory, so a restart loses nothing."""

    def __init__(self, data_dir: str, port: int, aof: bool) -> None:
        self.server = EmbeddedRedis(Path(data_dir), aof=aof, port=port, host="127.0.0.1").start()

    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def _state_path(cfg: Config) -> Path:
    return cfg.run.path / "ray.json"


def _connect(cfg: Config, start_head: bool) -> bool:
    """Connect to ``RAY_ADDRESS``, or to a local head started here; returns whether we started it."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=f"rollwave-{cfg.run.name}", log_to_driver=False)
        return False
    started = False
    if start_head:
        cmd = ["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
               "--include-dashboard=false", "--disable-usage-stats"]
        subprocess.run([str(Path(sys.executable).parent / cmd[0]), *cmd[1:]], check=True, capture_output=True)
        started = True
    ray.init(address="auto", namespace=f"rollwave-{cfg.run.name}", log_to_driver=False)
    return started


def up(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    run_dir = cfg.run.path.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    if _state_path(cfg).exists():
        print(f"error: {_state_path(cfg)} exists: the run is up; `rollwave down -c ...` first", file=sys.stderr)
        return 2
    started_head = _connect(cfg, start_head=not args.foreground)
    names: list[str] = []
    redis_url = os.environ.get("REDIS_URL") or cfg.redis.url
    if not redis_url:
        redis_actor = RedisActor.options(name="redis", lifetime="detached").remote(
            str(cfg.redis.data_dir or run_dir / "redis"), cfg.redis.port or free_port(), cfg.redis.aof
        )
        redis_url = ray.get(redis_actor.url.remote())
        names.append("redis")
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(cfg))
    specs = components(cfg, config_path, redis_url, rollout_servers=args.rollout_servers,
                       trainer_ranks=args.trainer_ranks)
    bundles = [{"CPU": s.num_cpus, **({"GPU": s.num_gpus} if s.num_gpus else {})} for s in specs]
    pg = placement_group(bundles, strategy="PACK", name=f"rollwave-{cfg.run.name}", lifetime="detached")
    ray.get(pg.ready(), timeout=120)
    for i, spec in enumerate(specs):
        ComponentActor.options(
            name=spec.name, lifetime="detached", num_cpus=0, num_gpus=spec.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(spec, str(run_dir / "logs"))
        names.append(spec.name)
    _state_path(cfg).write_text(json.dumps({
        "namespace": f"rollwave-{cfg.run.name}", "actors": names, "started_head": started_head,
        "redis_url": redis_url, "placement_group": f"rollwave-{cfg.run.name}",
    }))
    print(f"rollwave up: run {cfg.run.name}: {', '.join(names)}; redis {redis_url}; "
          f"API http://{cfg.api.host}:{cfg.api.port}; logs {run_dir / 'logs'}")
    if args.foreground:
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            return down(args)
    return 0


def down(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = _state_path(cfg)
    if not path.exists():
        print(f"nothing to stop: {path} does not exist", file=sys.stderr)
        return 0
    state = json.loads(path.read_text())
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace=state["namespace"], log_to_driver=False)
    for name in reversed(state["actors"]):
        try:
            actor = ray.get_actor(name)
        except ValueError:
            continue
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("%s did not stop cleanly: %s", name, exc)
        ray.kill(actor, no_restart=True)
    try:
        remove_placement_group(ray.util.get_placement_group(state["placement_group"]))
    except ValueError:
        log.warning("placement group %s was already gone", state["placement_group"])
    ray.shutdown()
    if state["started_head"]:
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], check=False, capture_output=True)
    path.unlink()
    print(f"rollwave down: stopped {', '.join(state['actors'])}")
    return 0
