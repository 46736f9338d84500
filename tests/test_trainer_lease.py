"""The trainer's lease (``Keys.trainer_alive``, ``trainer.metrics.TrainerLease``): a cancelled job whose group a trainer
holds is refused its delete while the trainer lives, and goes once a trainer killed without recording its end (SIGKILL:
the OOM killer, a lost node) let its lease lapse, where it used to wait for a trainer to start again (a 409 meanwhile,
for a trainer long dead). A trainer that lived on past its lapsed lease (frozen) acks its step after the delete
without counting anything twice or bringing the job back. Real Redis, the real API over HTTP, the real
``python -m trainer``."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml
from net_helpers import LoopbackProxy
from prometheus_client import CollectorRegistry

from buffer.keys import TRAINER_FINISHED_FIELDS, TRAINER_GROUP, Keys
from buffer.metrics import BufferMetrics
from buffer.redis_server import client_for
from buffer.replay import ReplayBuffer, TrainerFenced
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskEntry
from core.config import BufferConfig, RedisConfig, load_config
from core.net import free_port_outside_ephemeral
from core.process import stop_process
from services.client_cmd import _status_table
from tests.test_job_delete import TRAIN, Run
from trainer.__main__ import _connect
from trainer.metrics import TrainerLease
from trainer.parallel import DistContext

TOKEN = secrets.token_urlsafe(32)  # the checkpoint token of every trainer the tests start
LEASE_MS = 3000  # the trainer's buffer.claim_idle_ms: its lease's TTL (30 s by default), renewed every second
ONE = {**TRAIN, "source": {"kind": "arith", "limit": 1}}


@pytest.fixture
def run(redis_url: str, tokenizer: Any, request: pytest.FixtureRequest) -> Iterator[Run]:
    with Run.serving(redis_url, tokenizer, f"lease-{request.node.name}") as parts:
        yield parts


class Partition(LoopbackProxy):
    """A proxy in front of Redis that drops every connection while ``cut`` is set: a network partition."""

    def __init__(self, redis_url: str) -> None:
        self.cut = threading.Event()
        super().__init__(("127.0.0.1", urlsplit(redis_url).port or 6379), wait_s=10)
        self.url = f"redis://{self.address}/0"

    def passes(self, pair: tuple[socket.socket, socket.socket], to_upstream: bool, data: bytes) -> bool:
        return not self.cut.is_set()


def _trainer(run: Run, redis_url: str, model: Path, tmp_path: Path, rank: int = 0,
             pool: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m trainer`` of the run: steps of 2 groups, one step in all, its lease's TTL ``LEASE_MS``; rank
    ``rank`` of the pool ``pool`` (its rendezvous variables) where one is given, logging to ``trainer<rank>.log``."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": run.keys.run, "dir": str(tmp_path)},
        "model": {"path": str(model), "init_if_missing": False},
        "redis": {"url": redis_url},
        "buffer": {"groups_per_step": 2, "claim_idle_ms": LEASE_MS},
        "trainer": {"micro_batch_tokens": 128, "take_timeout_s": 0.5, "device": "cpu", "total_steps": 1,
                    "dist_timeout_s": 600},
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLWAVE_CHECKPOINT_TOKEN": TOKEN, **(pool or {}),
           **({"RANK": str(rank), "LOCAL_RANK": str(rank)} if pool else {})}
    env.pop("REDIS_URL", None)
    with open(tmp_path / ("trainer.log" if pool is None else f"trainer{rank}.log"), "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "trainer", "-c", str(config)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def _until(done: Callable[[], bool], what: str, timeout_s: float, proc: subprocess.Popen | None = None,
           log: Path | None = None) -> None:
    """Poll ``done`` until it holds; fails naming ``what`` after ``timeout_s``, or once ``proc`` exited."""
    deadline = time.monotonic() + timeout_s
    while not done():
        tail = log.read_text(errors="replace")[-3000:] if log is not None else ""
        assert proc is None or proc.poll() is None, f"the trainer exited {proc.returncode} before {what}: {tail}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: {tail}"
        time.sleep(0.1)


def _holding(run: Run, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """A trainer that holds the one group in the buffer (pending for it) while it waits for the second of its step;
    returns it and its lease (pid, host and epoch)."""
    proc = _trainer(run, redis_url, tiny_model_dir, tmp_path)
    mine = f"pid {proc.pid} on {socket.gethostname()}, epoch "

    def holds() -> bool:
        lease = run.redis.get(run.keys.trainer_alive)
        pending = run.redis.xpending(run.keys.groups, TRAINER_GROUP)["pending"]
        return lease is not None and lease.decode().startswith(mine) and pending == 1

    _until(holds, "group held by the trainer under its lease", 240, proc, tmp_path / "trainer.log")
    return proc, run.redis.get(run.keys.trainer_alive).decode()


def _one_group_written_and_a_job_waiting(run: Run) -> tuple[str, TaskEntry, str, StalenessControl]:
    """A train job whose one group is admitted and written, its task's entry, and a second one waiting for it."""
    job_id = run.submit(ONE)
    staleness = StalenessControl(run.redis, run.keys, BufferConfig())
    [entry] = run.read(1)
    assert staleness.try_admit(entry.group_id)
    run.put(entry)
    return job_id, entry, run.submit(ONE), staleness


def _stalled_by_and_deleted(run: Run, waiting: str, job_id: str, staleness: StalenessControl, end: str) -> None:
    """The train job ``waiting`` reads stalled by the trainer's recorded ``end``; the cancelled job ``job_id``, whose
    group the trainer held, is deleted with its group and its admission slot."""
    job = run.api.get(f"/v1/jobs/{waiting}").json()
    assert job["state"] == "stalled" and job["reason"].startswith(
        f"the trainer crashed at step 0 ({end}); 1 of this job's 1 groups wait for a trainer"), job
    reply = run.api.delete(f"/v1/jobs/{job_id}")
    assert reply.status_code == 200, reply.text
    assert run.depths()["groups"] == {"length": 0, "pending": 0} and staleness.admitted() == 0


def _only_the_other_job_trained(run: Run, staleness: StalenessControl, cancelled: str, other: str) -> None:
    """The step trained a group of each job, ``cancelled``'s removed by its delete meanwhile: ``other``'s alone is
    counted trained, its admission slot kept, and nothing of the deleted job, or of either group, is left."""
    assert run.redis.get(run.keys.trained) == b"1" and staleness.admitted() == 1
    job = run.api.get(f"/v1/jobs/{other}").json()
    assert (job["state"], job["progress"]["trained"]) == ("done", 1), job
    assert run.keys_of(cancelled) == set() and run.listed() == [other]
    assert run.depths()["groups"] == {"length": 0, "pending": 0}
    assert not run.redis.keys(f"{run.keys.prefix}payload:*")


def test_a_killed_trainers_group_of_a_cancelled_job_is_deleted_once_its_lease_lapsed(
        run: Run, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """While the trainer lives (its lease renewed, TTL ``buffer.claim_idle_ms``) the delete is a 409 naming it, and the
    status says it is alive. SIGKILLed, it records no end: the delete used to be refused until a trainer started again;
    now it goes once the lease lapsed, with the group, its payload key and its admission slot. Another train job, left
    to train, read ``running`` for ever (a wait on it never ended): it reads ``stalled`` by a crashed trainer, and
    ``rollwave status`` says the trainer is not running."""
    job_id, entry, waiting, staleness = _one_group_written_and_a_job_waiting(run)
    proc, lease = _holding(run, redis_url, tiny_model_dir, tmp_path)
    try:
        assert run.api.get(f"/v1/jobs/{waiting}").json()["state"] == "running"
        assert 0 < run.redis.pttl(run.keys.trainer_alive) <= LEASE_MS  # the trainer's claim_idle_ms, not 30 s
        assert run.api.get("/v1/status").json()["trainer"]["alive"] is True
        assert run.api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        reply = run.api.delete(f"/v1/jobs/{job_id}")
        assert reply.status_code == 409, reply.text
        assert f"1 of its groups are held by the trainer ({lease}) for its current step" in reply.json()["detail"]
        assert run.depths()["groups"] == {"length": 1, "pending": 1}
    finally:
        proc.kill()
        proc.wait(30)
    assert run.redis.hmget(run.keys.trainer, *TRAINER_FINISHED_FIELDS) == [None] * 3  # killed: no end recorded

    _until(lambda: not run.redis.exists(run.keys.trainer_alive), "lapse of the killed trainer's lease", 30)
    status = run.api.get("/v1/status").json()
    assert status["trainer"]["alive"] is False
    assert "  NOT RUNNING: its lease lapsed with no end recorded (killed?)" in _status_table(status).splitlines()[1]
    _stalled_by_and_deleted(run, waiting, job_id, staleness, "its lease lapsed with no end recorded: killed by "
                            "SIGKILL, the OOM killer or a lost node, or cut off from Redis past buffer.claim_idle_ms")
    assert run.keys_of(job_id) == set() and not run.redis.keys(f"{run.keys.prefix}payload:*")
    assert run.redis.hget(run.keys.group_state, entry.group_id) == b"t"


def test_a_trainer_stopped_by_sigterm_records_the_stop_and_gives_up_its_lease_at_once(
        run: Run, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (a supervisor's or an operator's stop) killed the trainer on the spot: nothing recorded, its lease left
    to lapse, and the API then called it killed by SIGKILL or the OOM killer. It unwinds: exits 143, records the stop
    as its end (a crash a restart clears: the waiting train job reads stalled, saying so), and deletes its lease, so
    the cancelled job whose group it held is deleted at once."""
    job_id, _, waiting, staleness = _one_group_written_and_a_job_waiting(run)
    proc, _ = _holding(run, redis_url, tiny_model_dir, tmp_path)
    try:
        assert run.api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        stop_process(proc, 30, name="trainer")
    assert not run.redis.exists(run.keys.trainer_alive)  # deleted, not left to lapse
    _stalled_by_and_deleted(run, waiting, job_id, staleness,
                            "stopped by SIGTERM before its end (a supervisor's or an operator's stop)")


def test_a_rank_stopped_by_sigterm_leaves_its_pool_at_once(
        run: Run, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 0 of a pool of 2 gets a SIGTERM (the other does not) while both wait for groups: it records the stop and
    exits 143, and rank 1 ends too, well within trainer.dist_timeout_s (600 s here). (A rank stopped while the other
    waits in a collective it never joins: ``test_trainer_interrupts``.)"""
    port = free_port_outside_ephemeral("127.0.0.1")
    pool = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [_trainer(run, redis_url, tiny_model_dir, tmp_path, rank, pool) for rank in (0, 1)]
    try:
        log = tmp_path / "trainer0.log"
        _until(lambda: "rank 0/2 training from step 0" in log.read_text(errors="replace"), "rank 0's training", 240,
               ranks[0], log)
        ranks[0].send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert ranks[0].wait(120) == 128 + signal.SIGTERM, log.read_text(errors="replace")[-3000:]
        assert ranks[1].wait(120) != 0
        assert time.monotonic() - started < 120  # not the 600 s of trainer.dist_timeout_s
    finally:
        for proc in ranks:
            stop_process(proc, 30, name="trainer")
    assert run.redis.hget(run.keys.trainer, "finished_reason").decode().startswith("crashed: stopped by SIGTERM")


def test_a_trainer_frozen_past_its_lease_acks_its_step_after_the_delete_counting_nothing_twice(
        run: Run, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer holds a group of a job and is frozen (SIGSTOP: as a long pause, or a trainer cut off from Redis, its
    lease lapses while it lives); the job is cancelled and deleted, its group with it. Woken, the trainer takes another
    job's group, trains its step on both (it holds the removed one in memory), checkpoints and acks: the ack acks and
    counts the other group alone (the removed one's id is consumed), so ``trained`` is 1, the admission slots add up
    (the removed group's given back once, the trained one's kept), and no key of the deleted job comes back. The
    trainer ends as usual, its end recorded and its lease deleted."""
    cancelled, other = run.submit(ONE), run.submit(ONE)
    staleness = StalenessControl(run.redis, run.keys, BufferConfig())
    first, second = run.read(2)
    assert (first.job_id, second.job_id) == (cancelled, other)
    for entry in (first, second):
        assert staleness.try_admit(entry.group_id)
    run.put(first)
    proc, _ = _holding(run, redis_url, tiny_model_dir, tmp_path)
    log = tmp_path / "trainer.log"
    try:
        proc.send_signal(signal.SIGSTOP)
        run.api.post(f"/v1/jobs/{cancelled}/cancel")
        _until(lambda: not run.redis.exists(run.keys.trainer_alive), "lapse of the frozen trainer's lease", 30)
        reply = run.api.delete(f"/v1/jobs/{cancelled}")
        assert reply.status_code == 200, reply.text
        assert staleness.admitted() == 1 and run.depths()["groups"] == {"length": 0, "pending": 0}
        run.put(second)
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(240) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_process(proc, 30, name="trainer")
    status = run.api.get("/v1/status").json()["trainer"]
    assert (status["step"], status["finished_reason"], status["alive"]) == ("1", "trainer.total_steps", False), status
    _only_the_other_job_trained(run, staleness, cancelled, other)
    assert run.redis.hmget(run.keys.group_state, [first.group_id, second.group_id]) == [b"t", b"t"]


def test_a_fenced_trainers_lease_is_not_renewed_and_its_stop_leaves_the_newer_ones(redis_url: str) -> None:
    """Once a newer trainer of the run started, the older one's renewal is refused (logged and counted as the fence's
    refusals are), so its lease no longer keeps the newer trainer's groups (same consumer) from a delete after the newer
    one died; and its stop deletes nothing of the newer trainer's lease."""
    client, keys = redis.Redis.from_url(redis_url), Keys("lease-fenced")
    old, newer = (ReplayBuffer(client, keys, BufferConfig()) for _ in range(2))
    old_lease = TrainerLease(client, keys, old, 60_000).start()
    newer_lease = TrainerLease(client, keys, newer, 60_000).start()
    try:
        assert client.get(keys.trainer_alive).decode() == newer_lease.value != old_lease.value
        with pytest.raises(TrainerFenced, match="a newer trainer of run lease-fenced started"):
            old_lease.renew()
        assert old.metrics.registry.get_sample_value("rollwave_buffer_fenced_refusals_total") == 1
        old_lease.stop()
        assert client.get(keys.trainer_alive).decode() == newer_lease.value
    finally:
        old_lease.stop()
        newer_lease.stop()
    assert not client.exists(keys.trainer_alive)


def test_a_trainer_cut_off_from_redis_past_its_lease_loses_the_cancelled_jobs_group_and_its_ack_counts_nothing(
        run: Run, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The trainer holds a group of each of two jobs for its step, its lease renewed over its own connection (the
    production client, retrying for its outage time). The network between it and Redis goes: its renewals fail (logged
    once, counted) and the lease lapses while it lives, so the cancelled job's delete, refused before, removes the
    group it holds. The network back, the lease is renewed again, and the trainer's ack of its step acks and counts the
    other job's group alone: ``trained`` is 1, each admission slot was given back (the removed group's, by the delete)
    or kept by the trained group once, and no key of the deleted job comes back."""
    caplog.set_level(logging.INFO, logger="trainer.metrics")
    cancelled, other = run.submit(ONE), run.submit(ONE)
    staleness = StalenessControl(run.redis, run.keys, BufferConfig())
    for entry in run.read(2):
        assert staleness.try_admit(entry.group_id)
        run.put(entry)
    proxy = Partition(redis_url)
    client = client_for(proxy.url, RedisConfig(), outage_s=1)
    trainer = ReplayBuffer(client, run.keys, BufferConfig(), consumer="trainer")
    registry = CollectorRegistry()
    lease = TrainerLease(client, run.keys, trainer, 6000, registry).start()  # renewed every 2 s
    failures = "rollwave_trainer_lease_renew_failures_total"
    try:
        taken = trainer.take(2, 5.0)
        assert sorted(g.job_id for _, g in taken) == sorted([cancelled, other])
        run.api.post(f"/v1/jobs/{cancelled}/cancel")
        assert run.api.delete(f"/v1/jobs/{cancelled}").status_code == 409
        proxy.cut.set()
        _until(lambda: not run.redis.exists(run.keys.trainer_alive) and registry.get_sample_value(failures) > 0,
               "failed renewal and lapse of the lease", 30)
        reply = run.api.delete(f"/v1/jobs/{cancelled}")
        assert reply.status_code == 200, reply.text
        assert run.api.get("/v1/status").json()["trainer"] == {"leased": "1", "alive": False}
        assert run.api.get(f"/v1/jobs/{other}").json()["state"] == "stalled"  # its trainer taken for dead meanwhile
        proxy.cut.clear()
        _until(lambda: run.redis.get(run.keys.trainer_alive) == lease.value.encode(), "renewed lease", 30)
        assert run.api.get("/v1/status").json()["trainer"] == {"leased": "1", "alive": True}
        assert run.api.get(f"/v1/jobs/{other}").json()["state"] == "done"  # rolled out, and its trainer back
        assert trainer.ack([e for e, _ in taken], [g.group_id for _, g in taken]) == 1
    finally:
        lease.stop()
        client.close()
        proxy.close()
    _only_the_other_job_trained(run, staleness, cancelled, other)
    logged = [r.getMessage() for r in caplog.records if r.name == "trainer.metrics"]
    assert sum("renewing the trainer's lease failed" in m for m in logged) == 1, logged
    assert any("renewed again" in m for m in logged), logged


def test_a_trainer_cut_off_from_redis_exits_without_waiting_for_its_lease(redis_url: str) -> None:
    """The network to Redis goes while the trainer stops: a renewal in flight rides out the outage (the client retries
    for its outage time, a minute by default), and the trainer's exit used to wait for it, then retry the release as
    long: past a supervisor's grace period. Its stop now leaves the lease to lapse after ``STOP_WAIT_S``."""
    proxy = Partition(redis_url)
    client = client_for(proxy.url, RedisConfig(), outage_s=120)
    keys = Keys("lease-exit")
    registry = CollectorRegistry()
    lease = TrainerLease(client, keys, ReplayBuffer(client, keys, BufferConfig()), 600, registry).start()
    try:
        proxy.cut.set()
        direct = redis.Redis.from_url(redis_url)
        _until(lambda: not direct.exists(keys.trainer_alive), "lapse of the lease, its renewal stuck", 30)
        started = time.monotonic()
        lease.stop()
        assert time.monotonic() - started < 60  # not the client's outage time of 120 s
    finally:
        proxy.cut.clear()
        client.close()
        proxy.close()


def test_a_lease_the_trainer_cannot_take_is_recorded_as_its_crash(
        ctx: DistContext, redis_url: str, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis fails the lease's first renewal (an outage past the client's retries) as the trainer connects, past its
    fence: the trainer fails, its crash recorded as the run's end (it was taken outside the start-up that records one,
    and a train job read ``running`` while a launcher restarted the trainer)."""
    def unreachable(self: TrainerLease) -> None:
        raise redis.ConnectionError("Redis at 127.0.0.1:6379: connection refused (retried for 60 s)")

    monkeypatch.setattr(TrainerLease, "renew", unreachable)
    keys = Keys("lease-refused")
    cfg = load_config(None, [f"run.name={keys.run}", f"redis.url={redis_url}", f"run.dir={tmp_path}",
                             f"model.path={tiny_model_dir}", f"checkpoint.stage_dir={tmp_path}/stage"], env={})
    metrics = CollectorRegistry()
    with pytest.raises(redis.ConnectionError, match="connection refused"), contextlib.ExitStack() as stack:
        _connect(cfg, ctx, stack, metrics, BufferMetrics(metrics))
    status = redis.Redis.from_url(redis_url).hgetall(keys.trainer)
    assert status[b"finished_reason"] == b"crashed: ConnectionError: Redis at 127.0.0.1:6379: connection refused " \
        b"(retried for 60 s)", status


def test_a_renewal_failing_with_an_error_other_than_redis_is_counted_and_the_lease_renewed_after_it(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A renewal that raises something other than a Redis error (a bug, a client in a bad state) is logged with its
    traceback and counted, and the thread goes on renewing: it used to end the thread, silently, and the lease to lapse
    under a live trainer, whose cancelled jobs' groups a delete then took from it."""
    client, keys = redis.Redis.from_url(redis_url), Keys("lease-odd-error")
    registry = CollectorRegistry()
    lease = TrainerLease(client, keys, ReplayBuffer(client, keys, BufferConfig()), 600, registry)
    renew, calls = lease.renew, []

    def odd_once() -> None:
        calls.append(None)
        if len(calls) == 2:  # the first renewal of the thread (the first call is start's)
            raise RuntimeError("odd")
        renew()

    lease.renew = odd_once  # type: ignore[method-assign]
    lease.start()
    try:
        _until(lambda: len(calls) >= 4, "renewals after the odd error", 30)
        assert registry.get_sample_value("rollwave_trainer_lease_renew_failures_total") == 1
        assert client.pttl(keys.trainer_alive) > 0
    finally:
        lease.stop()
    failed = [r for r in caplog.records if "renewing the trainer's lease failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None, failed
