"""A trainer fenced by a newer trainer of its run (``ReplayBuffer.fence``) writes no checkpoint, commits no weights and
records neither its start nor its end after that: the newer trainer resumes from the run's latest checkpoint, numbers
its versions from what the servers serve, and owns the run's budget and end. Real Redis, a real receiver in front of a
stub engine, real ranks (gloo), the real ``python -m trainer``."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
import yaml
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from rank_helpers import spawn_ranks
from test_checkpoint_faults import config, eventually, model_of, push
from test_engine_client import serve, sglang_056_stub
from trainer_helpers import reaped, synthetic_groups
from transformers import AutoModelForCausalLM

from buffer.colocation import DeviceTurns
from buffer.keys import Keys
from buffer.metrics import BufferMetrics
from buffer.redis_server import EmbeddedRedis
from buffer.registry import PushRecord, ServerInfo, ServerRegistry
from buffer.replay import ReplayBuffer, TrainerFenced
from buffer.staleness import StalenessControl
from core.config import CONFIG_ERROR_EXIT, BufferConfig, CheckpointConfig, Config, TrainerConfig, load_config
from core.net import free_port_outside_ephemeral
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient
from trainer.__main__ import RunRecord, _connect
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_pusher import CheckpointPusher
from trainer.colocation import LocalPusher
from trainer.metrics import RedisStatus
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed
from trainer.worker import Trainer

GPS = 2
TRAINER = {"micro_batch_tokens": 128, "take_timeout_s": 0.5, "device": "cpu", "checkpoint_every": 1}


def _buffer(url: str, run: str) -> ReplayBuffer:
    buffer = ReplayBuffer(redis.Redis.from_url(url), Keys(run), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    return buffer


def test_a_fenced_trainer_neither_pushes_nor_checkpoints_the_step_it_trained(
    ctx: DistContext, redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The newer trainer starts while the older one trains a step it took before: the step used to be pushed to the
    servers and checkpointed all the same, the checkpoint then the newer trainer's resume point after its next crash.
    Now the older one stops before either, and its run directory holds nothing, not even a half-written checkpoint."""
    old = _buffer(redis_server.url, "fenced-step")
    assert old.put_many(synthetic_groups(0, GPS, run="fenced-step")) == [1] * GPS
    pusher = CheckpointPusher(CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32))), [])
    trainer = Trainer(TrainerConfig(**TRAINER), tiny_model_dir, tmp_path, BufferConfig(groups_per_step=GPS),
                      pusher=pusher, fence=old.check_fence).start(ctx=ctx)
    try:
        groups, _ = trainer.next_batch(old)
        _buffer(redis_server.url, "fenced-step").fence()  # the newer trainer
        with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-step started"):
            trainer.train(groups)
    finally:
        trainer.close()
        pusher.close()
    assert pusher.last_pushed == 0 and not (tmp_path / "checkpoints").exists()


def test_a_checkpoint_a_newer_trainer_started_during_is_not_listed(ctx: DistContext, redis_server: EmbeddedRedis,
                                                                    tmp_path: Path, tiny_model_dir: Path) -> None:
    """The newer trainer starts while the older one's checkpoint is written: it is not renamed into place (the newer
    trainer would resume from it), and the newer trainer's own first checkpoint removes what it left."""
    old, newer = _buffer(redis_server.url, "fenced-save"), _buffer(redis_server.url, "fenced-save")
    old.fence()
    asked: list[int] = []

    def newer_starts_during_the_save() -> None:
        old.check_fence()
        asked.append(1)
        if len(asked) == 1:  # asked before the write: the newer trainer starts while it is written
            newer.fence()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=2)
    with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-save started"):
        checkpoints.save(3, model, optimizer, scheduler, {}, fence=newer_starts_during_the_save)
    assert len(asked) == 1 and checkpoints.list() == []
    saved = checkpoints.save(1, model, optimizer, scheduler, {}, fence=newer.check_fence)
    assert checkpoints.list() == [saved] and sorted(p.name for p in checkpoints.root.iterdir()) == [saved.name]


def test_a_fenced_trainer_s_push_is_refused_before_its_commit_and_its_flush_says_so(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """After the newer trainer started, the older one's push is not committed (the server still serves the older
    one's last version), fails at stage ``fence``, counted, and is not recorded as the server's last push (the newer
    trainer's pushes are); its ``flush`` raises ``TrainerFenced`` in the trainer's thread. The newer trainer's push of
    the next version then stages and commits its own weights: the older one's commit used to land under that number,
    and the newer push found it served and sent nothing."""
    cfg = config(tmp_path, retries=0)
    client, keys = redis.Redis.from_url(redis_server.url), Keys("fenced-push")
    registry = ServerRegistry(client, keys)
    old, newer = _buffer(redis_server.url, keys.run), _buffer(redis_server.url, keys.run)
    old.fence()
    model = model_of(tiny_model_dir)

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            receiver = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "stub")
            address = await receiver.start()
            older = CheckpointPusher(cfg, [address], fence=old.check_fence, record=registry.record_push)
            newest = CheckpointPusher(cfg, [address], fence=newer.check_fence, record=registry.record_push)
            try:
                assert (await push(older, model, 1)).ok and receiver.version == 1
                newer.fence()
                [refused] = (await push(older, model, 2)).servers
                assert (refused.ok, refused.stage, refused.reason) == (False, "fence", "fenced"), refused
                assert "a newer trainer of run fenced-push started" in refused.error
                assert receiver.version == 1
                assert older.metrics.registry.get_sample_value(
                    "rollwave_trainer_push_failures_total", {"stage": "fence", "reason": "fenced"}) == 1
                assert (registry.pushes()[address].version, registry.pushes()[address].ok) == (1, True)
                with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-push started"):
                    await asyncio.to_thread(older.flush, 10.0)
                [committed] = (await push(newest, model, 2)).servers
                assert committed.ok and committed.bytes > 0 and receiver.version == 2, committed
            finally:
                await asyncio.to_thread(older.close)
                await asyncio.to_thread(newest.close)
                await receiver.stop()

    asyncio.run(run())


def _fenced_ranks(rank: int, world: int, port: int, redis_url: str, model_dir: Path, run_dir: Path,
                  where: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed("cpu", timeout_s=60)
    outcome = "trained"
    try:
        fence, old = None, None
        if rank == 0:
            old = _buffer(redis_url, "fenced-ranks")
            old.fence()
            if where == "status":  # groups for a step, and the newer trainer only once it is trained
                for group in synthetic_groups(0, GPS, run="fenced-ranks"):
                    old.put(group)
            else:
                _buffer(redis_url, "fenced-ranks").fence()  # the newer trainer
            fence = old.check_fence
        trainer = Trainer(TrainerConfig(**TRAINER), model_dir, run_dir, BufferConfig(groups_per_step=GPS),
                          fence=fence).start(ctx=ctx)

        def published(record: dict) -> None:  # as python -m trainer's: rank 0 publishes each step's status
            if rank == 0:
                _buffer(redis_url, "fenced-ranks").fence()  # the newer trainer, as the step ends
                RedisStatus(old.redis, old.keys, fence=old).publish(record, 1, 0)

        try:
            if where == "take":  # rank 0's take is refused; the others wait in its broadcast
                trainer.next_batch(old)
            elif where == "status":  # rank 0's step status is refused; every rank stops at the next take
                trainer.run(old, published)
            else:
                trainer.train(synthetic_groups(0, GPS))  # every rank trains the batch rank 0 shares
        except TrainerFenced as exc:
            outcome = f"fenced: {exc}"
        finally:
            trainer.close()
        (run_dir / f"rank{rank}").write_text(outcome)
    finally:
        close_distributed()
    exit_rank()


@pytest.mark.parametrize("where", ["checkpoint", "take", "status"])
def test_every_rank_of_a_fenced_trainer_stops_together(redis_server: EmbeddedRedis, tiny_model_dir: Path,
                                                       tmp_path: Path, where: str) -> None:
    """Rank 0 alone reads the fence (before the checkpoint, in its take, or publishing a step's status); the other ranks
    stop with it, before the checkpoint's collectives or out of the read's broadcast, rather than waiting in them for a
    rank that left (a refused status used to end rank 0's run while the others waited in its next take)."""
    args = (2, free_port_outside_ephemeral(), redis_server.url, tiny_model_dir, tmp_path, where)
    spawn_ranks(_fenced_ranks, args=args, nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text().startswith(
            "fenced: rw:fenced-ranks:trainer:epoch is 2: a newer trainer of run fenced-ranks started"), rank
    # the step whose status was refused was checkpointed before the newer trainer started; none after it
    assert [p.name for p in Checkpointer(tmp_path / "checkpoints", 1).list()] == (
        ["step_00000001"] if where == "status" else [])


def test_a_fenced_trainer_records_neither_its_start_nor_its_end(redis_server: EmbeddedRedis) -> None:
    """A trainer fenced after its last take or ack wrote its start (the run's budget, where its metrics are served, an
    earlier end cleared) and its end (the budget closed at what it trained, where and why it stopped) over the newer
    trainer's: the newer one's admission shut, its run stalled, and the API pointed at the older one's metrics. Both
    are refused now (logged, counted); the newer trainer's record stays, and its own end is written."""
    keys, cfg = Keys("fenced-record"), BufferConfig(groups_per_step=GPS)
    r = redis.Redis.from_url(redis_server.url)
    old = _buffer(redis_server.url, keys.run)
    old.fence()
    newer = RunRecord(_buffer(redis_server.url, keys.run), cfg)
    newer.started(4 * GPS, "127.0.0.1:9401")
    older = RunRecord(old, cfg)
    with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-record started"):
        older.started(2 * GPS, "127.0.0.1:9400")
    with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-record started"):
        older.ended(1, "trainer.total_steps", 1, 1)
    staleness = StalenessControl(r, keys, cfg)
    assert staleness.budget() == 4 * GPS and r.hget(keys.trainer, "finished_reason") is None
    assert r.hget(keys.trainer, "metrics_address") == b"127.0.0.1:9401"
    assert old.metrics.registry.get_sample_value("rollwave_buffer_fenced_refusals_total") == 2
    newer.ended(4, "trainer.total_steps", 2, 2)
    assert staleness.budget() == 0 and r.hget(keys.trainer, "finished_reason") == b"trainer.total_steps"


def _run_config(redis_url: str, run: str, model_dir: Path, tmp_path: Path, *overrides: str) -> Config:
    """A run's config as a user sets it, for ``_connect``: the trainer's parts as ``python -m trainer`` makes them."""
    return load_config(None, [f"run.name={run}", f"redis.url={redis_url}", f"run.dir={tmp_path}",
                              f"model.path={model_dir}", f"checkpoint.stage_dir={tmp_path}/stage", *overrides], env={})


def _step(step: int) -> dict[str, float]:
    return {"step": step, "reward_mean": 0.5, "loss": 0.25, "tokens_per_s": 100.0}


def test_a_fenced_colocated_trainer_neither_hands_the_device_over_nor_publishes_its_steps(
    ctx: DistContext, redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The parts ``_connect`` makes for a colocated trainer. The newer trainer starts while the older one trains a step
    it took the device for: the older one used to hand the engines its weights after it (the turn, the published
    version), write its step over the newer trainer's status, and take the device for another step, which the engines
    released for while the newer trainer waited for the groups they no longer generated. Each is refused now (logged,
    counted): the turn, the version and the status stay as they were."""
    # a lease renewed every 200 s: none falls between the newer trainer's start and the stack's close (a fenced
    # renewal is refused and counted too)
    cfg = _run_config(redis_server.url, "fenced-colocated", tiny_model_dir, tmp_path, "placement.mode=colocated",
                      "buffer.claim_idle_ms=600000")
    keys, r = Keys(cfg.run.name), redis.Redis.from_url(redis_server.url)
    metrics = CollectorRegistry()
    model = model_of(tiny_model_dir)
    with contextlib.ExitStack() as stack:
        _, pusher, status, _ = _connect(cfg, ctx, stack, metrics, BufferMetrics(metrics))
        assert isinstance(pusher, LocalPusher) and status is not None
        pusher.push_model(model)
        pusher.give_device(0)
        pusher.take_device(1)  # no live server: the device is taken at once
        pusher.push_model(model, unacked=1)
        pusher.give_device(1)
        status.publish(_step(1), 1, 1)
        pusher.take_device(2)
        pusher.push_model(model, unacked=2)
        _buffer(redis_server.url, keys.run).fence()  # the newer trainer
        with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-colocated started"):
            pusher.give_device(2)
        with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-colocated started"):
            status.publish(_step(2), 2, 2)
        with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-colocated started"):
            pusher.take_device(3)
    turn = DeviceTurns(r, keys).turn()
    assert turn is not None and (turn.holder, turn.step) == ("trainer", 2)  # its step 2's, taken before the newer start
    assert StalenessControl(r, keys, cfg.buffer).version() == 1 and pusher.published == 1
    assert r.hget(keys.trainer, "step") == b"1" and r.xlen(keys.steps) == 1
    assert metrics.get_sample_value("rollwave_buffer_fenced_refusals_total") == 3


def _fenced_hand_over(rank: int, world: int, port: int, redis_url: str, model_dir: Path, root: Path,
                      where: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=60)
    outcome = "handed over"
    try:
        pusher = LocalPusher(root, model_dir)  # the other ranks': no turns
        if rank == 0:
            old, keys = _buffer(redis_url, "fenced-turns"), Keys("fenced-turns")
            client = redis.Redis.from_url(redis_url)
            pusher = LocalPusher(root, model_dir, DeviceTurns(client, keys, fence=old), ServerRegistry(client, keys),
                                 StalenessControl(client, keys, BufferConfig(), fence=old))
            old.fence()
            _buffer(redis_url, "fenced-turns").fence()  # the newer trainer
        pusher.push_model(model_of(model_dir))
        try:
            if where == "take":
                pusher.take_device(1)
            else:
                pusher.give_device(0)
        except TrainerFenced as exc:
            outcome = f"fenced: {exc}"
        (root / f"rank{rank}").write_text(outcome)
    finally:
        close_distributed()
    exit_rank()


@pytest.mark.parametrize("where", ["take", "give"])
def test_every_rank_of_a_fenced_colocated_trainer_stops_at_the_hand_over(redis_server: EmbeddedRedis,
                                                                          tiny_model_dir: Path, tmp_path: Path,
                                                                          where: str) -> None:
    """Rank 0 alone writes the turn, and is refused; the other ranks stop with it where they meet it, rather than go
    on to the step's collectives and wait in them for a rank that left."""
    args = (2, free_port_outside_ephemeral(), redis_server.url, tiny_model_dir, tmp_path, where)
    spawn_ranks(_fenced_hand_over, args=args, nprocs=2, join=True)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text().startswith(
            "fenced: rw:fenced-turns:trainer:epoch is 2: a newer trainer of run fenced-turns started"), rank
    assert DeviceTurns(redis.Redis.from_url(redis_server.url), Keys("fenced-turns")).turn() is None


def test_a_fenced_trainer_s_pusher_publishes_no_version_and_records_no_push_after_the_newer_one_started(
    ctx: DistContext, redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    """The pusher ``_connect`` makes. A version the older trainer's servers committed before the newer trainer started
    reached its quorum only after (a dead server left the live set): the watcher published it over the newer trainer's
    version. And a push that failed after the newer trainer started was recorded over the newer trainer's record of
    that server. Both are refused now (logged, counted, raised by ``flush``); the version and the record stay."""
    cfg = _run_config(redis_server.url, "fenced-publish", tiny_model_dir, tmp_path,
                      f"checkpoint.token={secrets.token_urlsafe(32)}", "checkpoint.retries=0",
                      "checkpoint.connect_timeout_s=1")
    keys, r = Keys(cfg.run.name), redis.Redis.from_url(redis_server.url)
    servers = ServerRegistry(r, keys, ttl_s=600)  # live for the whole test without heartbeats
    dead = ServerInfo("srv-dead", engine_url="http://127.0.0.1:1",
                      grpc_address=f"127.0.0.1:{free_port_outside_ephemeral()}")
    staleness = StalenessControl(r, keys, cfg.buffer)
    metrics = CollectorRegistry()
    model = model_of(tiny_model_dir)

    def refused(what: str) -> bool:
        return any(f"(refused: {what})" in r.getMessage() for r in caplog.records if r.name == "buffer.replay")

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            receiver = CheckpointReceiver(cfg.checkpoint, tiny_model_dir, engine, url, "stub")
            servers.register(ServerInfo("stub", engine_url=url, grpc_address=await receiver.start()))
            servers.register(dead)
            stack = contextlib.ExitStack()
            try:
                _, pusher, _, _ = _connect(cfg, ctx, stack, metrics, BufferMetrics(metrics))
                assert isinstance(pusher, CheckpointPusher)
                first = await push(pusher, model, 1)
                assert sorted((s.server_id, s.ok) for s in first.servers) == [("srv-dead", False), ("stub", True)]
                assert staleness.version() == 0  # no quorum of the two live servers
                newer = _buffer(redis_server.url, keys.run)
                newer.fence()
                servers.deregister(dead.server_id)  # the live set's quorum is now 1: version 1 has it
                await eventually(lambda: staleness.version() > 0 or refused("publishing a policy version"),
                                 "the watcher to publish version 1")
                assert staleness.version() == 0 and int(r.get(keys.version_trained) or 0) == 0
                servers.register(dead)
                RunRecord(newer, cfg.buffer).pushed(dead.server_id, PushRecord(2, ok=True, serves=2))
                second = await push(pusher, model, 2)
                assert sorted((s.server_id, s.stage) for s in second.servers) == [
                    ("srv-dead", "connect"), ("stub", "fence")]
                assert refused("a push's result in the registry")
                pushes = servers.pushes()
                assert (pushes["stub"].version, pushes["stub"].ok) == (1, True)
                assert (pushes["srv-dead"].version, pushes["srv-dead"].ok) == (2, True)  # the newer trainer's
                assert metrics.get_sample_value("rollwave_buffer_fenced_refusals_total") >= 3  # and the commit's
                with pytest.raises(TrainerFenced, match="a newer trainer of run fenced-publish started"):
                    await asyncio.to_thread(pusher.flush, 10.0)
            finally:
                await asyncio.to_thread(stack.close)
                await receiver.stop()

    asyncio.run(run())


def _trainer_with_bad_tls(redis_url: str, run: str, model_dir: Path, tmp_path: Path, key: Path) -> subprocess.Popen:
    """``python -m trainer`` whose checkpoint TLS certificate and CA are not PEM (``key``: the key file): it connects,
    takes its fence, then fails as it makes its pusher (``ssl.SSLError``)."""
    cert, ca = tmp_path / "cert.pem", tmp_path / "ca.pem"
    for path in (cert, ca):
        path.write_text("not PEM\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": run, "dir": str(tmp_path)},
        "model": {"path": str(model_dir), "init_if_missing": False},
        "redis": {"url": redis_url},
        "buffer": {"groups_per_step": GPS},
        "checkpoint": {"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(ca)},
        "trainer": {"total_steps": 4, "device": "cpu"},
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)}
    env.pop("REDIS_URL", None)
    return subprocess.Popen([sys.executable, "-m", "trainer", "-c", str(config)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_trainer_that_crashes_making_its_pusher_records_its_end(redis_server: EmbeddedRedis, tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """``python -m trainer`` takes its fence, then fails to load its TLS files as it makes its pusher (in ``_connect``,
    before the start-up that records a crash): it used to record nothing, so a train job read ``running`` while a
    launcher restarted it again and again. It records ``crashed: ...`` at step 0 and closes admission, as a crash
    later in its start-up does, and fails."""
    keys = Keys("pusher-crash")
    key = tmp_path / "key.pem"
    key.write_text("not PEM\n")
    proc = _trainer_with_bad_tls(redis_server.url, keys.run, tiny_model_dir, tmp_path, key)
    with reaped(proc):
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "SSLError" in err, err[-3000:]
    r = redis.Redis.from_url(redis_server.url)
    status = {k.decode(): v.decode() for k, v in r.hgetall(keys.trainer).items()}
    assert status["finished_step"] == "0" and status["finished_reason"].startswith("crashed: SSLError: "), status
    staleness = StalenessControl(r, keys, BufferConfig(groups_per_step=GPS))
    assert staleness.budget() == staleness.trained() == 0


def test_a_trainer_fenced_before_it_crashed_leaves_the_run_s_end_to_the_newer_one(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The newer trainer starts while the older one, past its fence, reads its TLS key (a FIFO here, which holds it
    there until the test writes it), which then fails: the crash is not recorded over the newer trainer's start (its
    budget stays, no end appears), the log says why, and it exits with the status no launcher restarts (a restart
    would fence the newer trainer in turn)."""
    keys = Keys("fenced-crash")
    key = tmp_path / "key.pem"
    os.mkfifo(key)
    r = redis.Redis.from_url(redis_server.url)
    proc = _trainer_with_bad_tls(redis_server.url, keys.run, tiny_model_dir, tmp_path, key)
    with reaped(proc):
        deadline = time.monotonic() + 120
        while r.get(keys.trainer_epoch) != b"1":  # past its fence: it waits for the key
            assert proc.poll() is None and time.monotonic() < deadline, f"trainer never fenced: {proc.poll()}"
            time.sleep(0.05)
        RunRecord(_buffer(redis_server.url, keys.run), BufferConfig(groups_per_step=GPS)).started(4 * GPS, None)
        while True:  # a FIFO opens for writing once its reader is there: the trainer, reading the key
            try:
                fd = os.open(key, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:
                assert exc.errno == errno.ENXIO, exc
                assert proc.poll() is None and time.monotonic() < deadline, f"trainer never read its key: {proc.poll()}"
                time.sleep(0.05)
        os.write(fd, b"not PEM\n")
        os.close(fd)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == CONFIG_ERROR_EXIT, err[-3000:]
    assert "SSLError" in err and "refused: its end in the run's status" in err, err[-3000:]
    assert f"{keys.trainer_epoch} is 2: a newer trainer of run fenced-crash started" in err
    assert StalenessControl(r, keys, BufferConfig()).budget() == 4 * GPS
    assert r.hget(keys.trainer, "finished_reason") is None
