"""Checkpoint / resume through the real Redis replay buffer, in process and through ``python -m trainer``.

A crash after step 3 (checkpoint at step 2, step 3's groups taken but never acked) followed by a resume
with new objects must give steps 3-4 the losses of an uninterrupted run, bit for bit: the buffer hands
the unacked groups back first, and model, optimizer, LR schedule and policy version come back exactly.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
import torch
import yaml
from rank_helpers import spawn_ranks
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM

from buffer.keys import TRAINER_GROUP, Keys
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from core.config import BufferConfig, CheckpointConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from core.process import stop_process
from core.tiny_model import save_random_qwen2
from trainer.checkpoint import CheckpointMismatch
from trainer.checkpoint_pusher import CheckpointPusher
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed, iter_full_params
from trainer.worker import Trainer

GPS = 2  # groups per step
TRAINER = {
    "total_steps": 4,
    "checkpoint_every": 2,
    "keep_checkpoints": 1,
    "lr": 1e-3,
    "warmup_steps": 1,
    "lr_schedule": "cosine",
    "micro_batch_tokens": 128,
    "take_timeout_s": 1.0,
    "device": "cpu",
}
ETA = 10
BUFFER = BufferConfig(max_staleness=ETA, groups_per_step=GPS)


def _filled_buffer(url: str, run: str, steps: int = 5) -> ReplayBuffer:
    buffer = ReplayBuffer(redis.Redis.from_url(url), Keys(run), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    groups = [g for seed in range(steps) for g in synthetic_groups(seed, GPS, run=run)]
    assert buffer.put_many(groups) == [1] * len(groups)
    return buffer


def _train(trainer: Trainer, buffer: ReplayBuffer, steps: int | None = None) -> list[dict]:
    records = []
    while not trainer.done and (steps is None or len(records) < steps):
        groups, waited = trainer.next_batch(buffer)
        records.append(trainer.train(groups, waited))
    return records


@pytest.fixture(scope="module")
def uninterrupted(ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path_factory) -> dict:
    buffer = _filled_buffer(redis_url, "straight")
    trainer = Trainer(TrainerConfig(**TRAINER), tiny_model_dir, tmp_path_factory.mktemp("straight"), BUFFER)
    records = _train(trainer.start(ctx=ctx), buffer)
    trainer.ack_checkpointed(buffer)
    params = dict(iter_full_params(trainer.model))
    trainer.close()
    return {"records": records, "params": params, "trainer": trainer, "buffer": buffer}


def test_crash_and_resume_repeats_the_uninterrupted_losses(
    ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path: Path, uninterrupted: dict
) -> None:
    want = uninterrupted["records"]
    buffer = _filled_buffer(redis_url, "crash")
    crashed = Trainer(TrainerConfig(**TRAINER), tiny_model_dir, tmp_path, BUFFER).start(ctx=ctx)
    first = _train(crashed, buffer, steps=3)  # checkpoint at 2; step 3 trained, never checkpointed nor acked
    crashed.close()
    assert [r["loss"] for r in first] == [r["loss"] for r in want[:3]]
    del crashed, buffer

    buffer = ReplayBuffer(redis.Redis.from_url(redis_url), Keys("crash"), BufferConfig(), consumer="trainer")
    resumed = Trainer(TrainerConfig(**TRAINER), tiny_model_dir, tmp_path, BUFFER).start(resume=True, ctx=ctx)
    assert (resumed.step, resumed.version) == (2, 2)
    after = _train(resumed, buffer)
    resumed.ack_checkpointed(buffer)
    resumed.close()
    for key in ("loss", "grad_norm", "lr", "is_ratio_mean", "entropy", "group_ids", "step", "policy_version"):
        assert [r[key] for r in after] == [r[key] for r in want[2:]], key
    assert after[0]["group_ids"] == first[2]["group_ids"]  # the unacked groups came back first
    for name, value in iter_full_params(resumed.model):
        assert torch.equal(value, uninterrupted["params"][name]), name

    client = buffer.redis
    keys = Keys("crash")
    assert client.xpending(keys.groups, TRAINER_GROUP)["pending"] == 0  # everything trained is acked
    assert client.xlen(keys.groups) == GPS  # only the fifth step's groups are left
    trained = [g for r in want for g in r["group_ids"]]
    assert set(client.hmget(keys.group_state, trained)) == {b"t"}
    assert [p.name for p in resumed.checkpointer.list()] == ["step_00000004"]  # keep_checkpoints=1


def test_metrics_jsonl_and_prometheus(uninterrupted: dict) -> None:
    trainer = uninterrupted["trainer"]
    lines = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    stamps = [r["time"] for r in lines]  # Unix time at the end of each step's update
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] >= sum(r["step_time_s"] for r in lines[1:])
    assert stamps[-1] <= time.time()
    for key in ("reward_mean", "reward_std", "staleness_hist", "is_ratio_mean", "is_ratio_max", "clip_fraction"):
        assert key in lines[-1]
    for key in ("masked_fraction", "kl", "entropy", "logprob_gap", "tokens_per_s", "wait_s", "stale_dropped"):
        assert key in lines[-1]
    reg = trainer.metrics.registry
    assert reg.get_sample_value("rollwave_trainer_step") == 4
    assert reg.get_sample_value("rollwave_trainer_policy_version") == 4
    samples = sum(r["samples"] for r in lines)
    assert reg.get_sample_value("rollwave_trainer_staleness_count") == samples
    assert reg.get_sample_value("rollwave_trainer_step_duration_seconds_count") == 4
    assert reg.get_sample_value("rollwave_trainer_reward_mean") == pytest.approx(lines[-1]["reward_mean"])
    assert reg.get_sample_value("rollwave_trainer_tokens_per_second") > 0


def test_stale_groups_are_dropped_and_acked(ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path) -> None:
    buffer = ReplayBuffer(redis.Redis.from_url(redis_url), Keys("stale"), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    buffer.put_many(synthetic_groups(0, 4, version=0, run="stale") + synthetic_groups(1, 2, version=1, run="stale"))
    cfg = TrainerConfig(**{**TRAINER, "total_steps": 2, "checkpoint_every": 1})
    trainer = Trainer(cfg, tiny_model_dir, tmp_path, BufferConfig(max_staleness=0, groups_per_step=GPS)).start(ctx=ctx)
    records = _train(trainer, buffer)
    trainer.ack_checkpointed(buffer)
    trainer.close()
    assert [r["stale_dropped"] for r in records] == [0, 2]  # at version 1, version-0 groups are too old
    assert records[1]["group_ids"] == ["s1-g0", "s1-g1"]
    assert trainer.metrics.registry.get_sample_value("rollwave_buffer_stale_dropped_total") == 2
    assert buffer.redis.xlen(Keys("stale").groups) == 0


def _cli(config: Path, *extra: str, code: int = 0) -> str:
    """The trainer's CLI, which must exit ``code``; its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)}
    env.pop("REDIS_URL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "-c", str(config), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stderr


def test_cli_resume_and_hf_export(tiny_model_dir: Path, redis_url: str, tmp_path: Path, uninterrupted: dict) -> None:
    _filled_buffer(redis_url, "cli")
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "cli", "dir": str(tmp_path)},
                "model": {"path": str(tiny_model_dir), "init_if_missing": False},
                "redis": {"url": redis_url},
                "buffer": {"max_staleness": ETA, "groups_per_step": GPS},
                "trainer": {**TRAINER, "total_steps": 2},
            }
        )
    )
    client, keys = redis.Redis.from_url(redis_url), Keys("cli")
    staleness = StalenessControl(client, keys, BufferConfig(max_staleness=ETA, groups_per_step=GPS))
    _cli(config)
    assert staleness.budget() == 2 * GPS  # the run's budget: the rollout admits nothing past the last step
    _cli(config, "--resume", "trainer.total_steps=4")
    assert staleness.budget() == 4 * GPS == staleness.trained()  # the groups trained before, and two more steps'
    lines = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert [r["loss"] for r in lines] == [r["loss"] for r in uninterrupted["records"]]
    assert all(r["push_servers_ok"] == 0 and 0 <= r["idle_fraction"] <= 1 for r in lines)  # no servers here
    status = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer).items()}
    # No server ever committed, so nothing was published; each run pushed at its start and after each step.
    assert (status["step"], status["version"], status["pushed_version"]) == ("4", "0", "3")
    assert [json.loads(f[b"metrics"])["step"] for _, f in client.xrange(keys.steps)] == [1, 2, 3, 4]

    out = tmp_path / "hf"
    _cli(config, "--export-hf", str(out))
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    for name, value in exported.named_parameters():
        torch.testing.assert_close(value, uninterrupted["params"][name], rtol=0, atol=0)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    foreign = tmp_path / "foreign"  # the checkpoint of a model of another shape
    save_random_qwen2(foreign, layers=1, hidden=64, intermediate=128, heads=2, kv_heads=1)
    latest = sorted((tmp_path / "cli" / "checkpoints").glob("step_*"))[-1]
    err = _cli(config, "--export-hf", str(tmp_path / "no"), f"model.path={foreign}", code=2)
    last = err.splitlines()[-1]  # after torch's warning that DCP loads in one process
    assert last.startswith(f"error: --export-hf: {latest}: its model does not load into the model of {foreign}: "
                           "ValueError: Size mismatch"), err
    assert "Traceback" not in err and not (tmp_path / "no").exists(), err


def test_a_fresh_run_pushes_nothing_at_start_and_a_later_start_pushes_its_weights(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The servers of a fresh run serve the weights it starts from as version 0: a start push would number them 1
    and keep admission a batch ahead of training all run long. Any other start pushes what the trainer holds, as
    a version above the one the servers serve."""
    token = CheckpointConfig(token=secrets.token_urlsafe(32))
    fresh, later = CheckpointPusher(token, []), CheckpointPusher(token, [])
    later.published = 3  # e.g. started over (resume off) after another trainer published version 3
    try:
        for name, pusher in (("fresh", fresh), ("later", later)):
            trainer = Trainer(TrainerConfig(**TRAINER), tiny_model_dir, tmp_path / name, BUFFER, pusher=pusher)
            trainer.start(ctx=ctx).close()
    finally:
        fresh.close()
        later.close()
    assert (fresh.last_pushed, fresh.published) == (0, 0)
    assert later.last_pushed == 4


def test_each_push_carries_the_groups_its_weights_were_trained_on(
    ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """Admission's base: the buffer's acked count plus the groups trained but not yet acked (acks wait for a
    checkpoint, every 2 steps here), never one twice. A trainer that dies after step 3 resumes from step 2:
    its start push counts the 4 groups of steps 1-2 (acked at step 3's read), and it trains step 3's again."""
    filled = _filled_buffer(redis_url, "trained", steps=4)
    staleness = StalenessControl(filled.redis, Keys("trained"), BUFFER)
    token = CheckpointConfig(token=secrets.token_urlsafe(32))

    def run(steps: int, resume: bool, buffer: ReplayBuffer) -> tuple[int, list[tuple[int, int]]]:
        """(groups of the start push, 0 if none), then (groups pushed, groups acked) after each step."""
        pusher = CheckpointPusher(token, [], staleness)
        trainer = Trainer(TrainerConfig(**TRAINER), tiny_model_dir, tmp_path, BUFFER, pusher=pusher)
        trainer.start(resume=resume, ctx=ctx, source=buffer)
        try:
            start = pusher._rounds[pusher.last_pushed].trained if pusher.last_pushed else 0
            pushed = []
            for _ in range(steps):
                groups, _ = trainer.next_batch(buffer)
                pushed.append((trainer.train(groups)["pushed_trained"], staleness.trained()))
            return start, pushed
        finally:
            trainer.close()
            pusher.close()

    assert run(3, False, filled) == (0, [(2, 0), (4, 0), (6, 4)])  # acks land at the read after a checkpoint
    restarted = ReplayBuffer(redis.Redis.from_url(redis_url), Keys("trained"), BufferConfig(), consumer="trainer")
    assert run(2, True, restarted) == (4, [(6, 4), (8, 4)])


def test_groups_held_for_a_batch_are_judged_again_after_a_push(
    ctx: DistContext, tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """A group read while the batch fills was judged by the version of its read; a push that a quorum commits
    meanwhile can age it past ``max_staleness``, and the step must not train it."""
    buffer = ReplayBuffer(redis.Redis.from_url(redis_url), Keys("held"), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    pusher = CheckpointPusher(CheckpointConfig(token=secrets.token_urlsafe(32)), [])
    cfg = TrainerConfig(**{**TRAINER, "take_timeout_s": 0.1})
    trainer = Trainer(cfg, tiny_model_dir, tmp_path, BufferConfig(max_staleness=1, groups_per_step=GPS),
                      pusher=pusher).start(ctx=ctx, source=buffer)
    try:
        buffer.put_many(synthetic_groups(0, 1, version=0, run="held"))
        pusher.published = 1
        assert trainer._read(buffer) is None  # held for the batch: one version old is within the bound
        pusher.published = 2  # a push reached its quorum while the batch filled
        buffer.put_many(synthetic_groups(1, 2, version=2, run="held"))
        groups, _ = trainer.next_batch(buffer)
    finally:
        trainer.close()
        pusher.close()
    assert [g.group_id for g in groups] == ["s1-g0", "s1-g1"]
    assert trainer.metrics.registry.get_sample_value("rollwave_buffer_stale_dropped_total") == 1
    assert buffer.redis.hget(Keys("held").job("job"), "stale_dropped") == b"1"


def test_starting_over_where_checkpoints_are_is_refused(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Pruning keeps the highest steps, whoever wrote them: a run started over in the directory of another would
    lose its own first checkpoints at once, and a crash would resume the other run's weights."""
    cfg = TrainerConfig(**{**TRAINER, "checkpoint_every": 1})
    first = Trainer(cfg, tiny_model_dir, tmp_path).start(ctx=ctx)
    first.train(synthetic_groups(0, GPS))
    first.close()
    again = Trainer(cfg, tiny_model_dir, tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"checkpoints holds checkpoints \(latest step_00000001\) and resume "
                                                 r"is off: continue with --resume, or start in a new run directory"):
        again.start(ctx=ctx)
    assert again.start(resume=True, ctx=ctx).step == 1
    again.close()


def _drain_ranks(rank: int, world: int, port: int, model_dir: Path, run_dir: Path, url: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on two cores
    ctx = init_distributed("cpu", timeout_s=120)  # a rank left alone in a collective fails, never hangs
    try:
        source = ReplayBuffer(redis.Redis.from_url(url), Keys("drain"), BufferConfig()) if rank == 0 else None
        cfg = TrainerConfig(**{**TRAINER, "total_steps": 10, "checkpoint_every": 10, "stop_when_drained": True,
                               "take_timeout_s": 0.2})
        trainer = Trainer(cfg, model_dir, run_dir, BUFFER).start(ctx=ctx, source=source)
        trainer.run(source)
        trainer.close()
    finally:
        close_distributed()
    exit_rank()


def test_two_ranks_checkpoint_and_ack_what_they_trained_when_the_data_runs_out(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """The data runs out after 2 steps, between checkpoints: every rank writes the last checkpoint (a collective;
    only rank 0 knows which groups it covers), and rank 0 acks them."""
    buffer = _filled_buffer(redis_url, "drain", steps=2)
    spawn_ranks(_drain_ranks, args=(2, free_port_outside_ephemeral(), tiny_model_dir, tmp_path, redis_url), nprocs=2,
             join=True)
    assert (tmp_path / "checkpoints" / "step_00000002" / "trainer_state.json").is_file()
    assert buffer.redis.xlen(Keys("drain").groups) == 0
    assert buffer.redis.hget(Keys("drain").job("job"), "trained") == b"4"


def test_the_trainer_serves_what_its_buffer_reads_count(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """``python -m trainer`` serves the buffer counters of its own reads with its metrics (a group entry without a
    payload, moved aside as malformed, here): its ReplayBuffer counts into the registry it serves."""
    buffer = _filled_buffer(redis_url, "served", steps=1)
    buffer.redis.xadd(Keys("served").groups, {"gid": "bad", "job": "job"})
    port = free_port_outside_ephemeral()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "served", "dir": str(tmp_path)},
        "model": {"path": str(tiny_model_dir), "init_if_missing": False},
        "redis": {"url": redis_url},
        "buffer": {"max_staleness": ETA, "groups_per_step": GPS},
        "trainer": {**TRAINER, "total_steps": 2, "take_timeout_s": 0.5, "metrics_port": port},  # waits in step 2
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)}
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "-c", str(config)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline, text = time.monotonic() + 240, ""
        while 'rollwave_buffer_malformed_total{stream="groups"} 1.0' not in text:
            assert proc.poll() is None and time.monotonic() < deadline, f"trainer exited {proc.poll()}: {text}"
            time.sleep(0.5)
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                text = ""
        assert "rollwave_trainer_step 1.0" in text
    finally:
        stop_process(proc, 30, name="trainer")
