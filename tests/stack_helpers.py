"""What the end-to-end tests share: waiting on a running stack, a feeder that keeps a job's tasks coming, and the
CPU sets a process tree runs on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from buffer.keys import ROLLOUT_GROUP, Keys
from buffer.task_queue import TaskQueue
from core.config import Config, dump_config, load_config
from core.jobs import JobSpec, TaskSource
from services.launcher import LocalStack, ensure_checkpoint_token

# What the end-to-end fault tests run: short two-turn episodes, small groups, one thread each, staleness 1.
SMALL_STACK = (
    "rollout.n_samples=2", "rollout.max_turns=2", "rollout.max_new_tokens=12", "rollout.max_concurrent_groups=4",
    "rollout.shutdown_grace_s=5", "buffer.claim_idle_ms=3000", "buffer.max_staleness=1", "buffer.groups_per_step=4",
    "trainer.stop_when_drained=true", "trainer.take_timeout_s=1", "trainer.threads=1", "engine.threads=1",
    "engine.max_batch_size=16",
)


def stack_config(tmp_path: Path, name: str, model: Path, *overrides: str) -> tuple[Config, Path]:
    """``SMALL_STACK`` with ``overrides`` on top, a checkpoint token, dumped (secrets masked) to a config file."""
    cfg = load_config(None, [
        f"run.name={name}", f"run.dir={tmp_path}", f"model.path={model}", f"checkpoint.stage_dir={tmp_path}/stage",
        *SMALL_STACK, *overrides,
    ])
    ensure_checkpoint_token(cfg)
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    return cfg, path


def log_tails(stack: LocalStack, names: list[str] | None = None, chars: int = 3000) -> str:
    """The end of each component's log (every incarnation appends to it), for a failing assertion's message."""
    paths = sorted(stack.log_dir.glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                     for p in paths if names is None or p.stem in names)


def wait_for(what: str, cond: Callable[[], bool], stack: LocalStack, timeout_s: float = 240.0) -> None:
    """Poll ``cond``; on timeout fail with the tail of every component's log."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{log_tails(stack)}")
        time.sleep(0.25)


class Feeder:
    """Keeps ``queued`` arith tasks of job ``job_id`` waiting for a rollout server until stopped, so a run
    lasts as long as a test needs it to, whatever the machine's speed; ``submitted`` counts them all."""

    def __init__(self, client: redis.Redis, keys: Keys, queue: TaskQueue, job_id: str, queued: int = 16):
        self.client, self.keys, self.queue, self.job_id, self.queued = client, keys, queue, job_id, queued
        self.spec = JobSpec(source=TaskSource(kind="arith", split="train", limit=queued, seed=3))
        self.tasks = [t.model_dump() for t in self.spec.source.load()]
        self.submitted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="feeder")

    def _run(self) -> None:
        stream = self.keys.tasks("train")
        while not self._stop.wait(0.2):
            waiting = self.client.xlen(stream) - self.client.xpending(stream, ROLLOUT_GROUP)["pending"]
            if waiting < self.queued:
                self.submitted += len(self.queue.submit(self.job_id, self.tasks[: self.queued - waiting], "train",
                                                        self.spec.model_dump_json()))

    def __enter__(self) -> Feeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def trained_group_ids(run_dir: Path) -> list[str]:
    """Group ids of every step in ``metrics.jsonl``, in step order (a step redone after a resume replaces the
    lost one)."""
    steps: dict[int, list[str]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["group_ids"]
    return [g for s in sorted(steps) for g in steps[s]]


def affinities(pid: int) -> dict[int, str]:
    """``Cpus_allowed_list`` of every thread of ``pid`` and of its children's threads."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        out[int(task.name)] = next(line.split(":")[1].strip() for line in status.splitlines()
                                   if line.startswith("Cpus_allowed_list"))
        for child in (task / "children").read_text().split():
            out.update(affinities(int(child)))
    return out
