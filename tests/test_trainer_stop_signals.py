"""A pool's graceful stop holds through the critic's passes and through a second signal.

The critic's passes (its values before the step, its updates after the policy's) had no stop point inside them: a
SIGTERM during a long critic pass waited for the whole pass. They now stop as the policy's do, every
``STOP_EVERY_MICRO_BATCHES`` micro-batches and before each update. A second SIGTERM or SIGINT, once the stop was asked,
found the signals given back to their default action: it killed the rank where it was, in the closing meeting too,
and a peer still in that meeting failed (exit 1). It is now logged, and the stop goes on.

The critic's stop points in one process (its stop asked as a pool's ``request_stop`` asks it); then two real ranks
(gloo) running the trainer's ``main`` (its signal handlers, its run record in real Redis, its checkpoints, its exit
status), each signalling itself with a real signal at a known point: the test waits for them well under the group's
timeout, so a rank left waiting fails it rather than hanging it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import signal
from pathlib import Path

import pytest
import redis
import torch
from rank_helpers import spawn_ranks
from trainer_helpers import join_within, synthetic_groups, trainer_config

from buffer.keys import Keys
from buffer.replay import ReplayBuffer
from core.config import BufferConfig, TrainerConfig
from core.net import free_port_outside_ephemeral
from trainer import __main__ as trainer_main
from trainer import parallel
from trainer.checkpoint import Checkpointer
from trainer.critic import CriticStep
from trainer.parallel import STOP_EVERY_MICRO_BATCHES, DistContext, TrainerStopped, exit_rank, request_stop
from trainer.worker import Trainer

GPS = 4  # 16 rows of at least 10 tokens: one 16-token micro-batch each, in each critic pass
CRITIC = {"advantage": "gae", "micro_batch_tokens": 16, "share_prefix": False, "lr": 1e-3, "device": "cpu"}
GROUP_TIMEOUT_S = 600  # what a rank left in a collective waits
BOUND_S = 120  # what the test waits for the ranks: well under the group's timeout
STOPPED = "stopped by SIGTERM before its end (a supervisor's or an operator's stop)"
STEP_1 = "step_00000001"


@pytest.mark.parametrize(("where", "minibatches", "forwards", "updates"),
                         [("values", 1, STOP_EVERY_MICRO_BATCHES, 0), ("update", 1, STOP_EVERY_MICRO_BATCHES, 0),
                          ("between-updates", 2, 0, 1)])
def test_a_stop_asked_in_a_critic_pass_stops_it_at_its_next_stop_point(
        ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str,
        minibatches: int, forwards: int, updates: int) -> None:
    """Asked at the first of the values pass's 16 micro-batches, or of the first update's, the critic stops
    ``STOP_EVERY_MICRO_BATCHES`` forwards on (it went on to the pass's end); asked after its first of two updates, it
    stops before the second (which ran). No critic update is applied past the one in hand, and the step is not
    counted."""
    monkeypatch.setattr(parallel, "_stop_signal", 0)  # put back after the test
    trainer = Trainer(TrainerConfig(**CRITIC, ppo_minibatches=minibatches), tiny_model_dir, tmp_path).start(ctx=ctx)
    critic, optimizer = trainer.critic
    seen = {"asked": False, "forwards": 0, "updates": 0}  # the critic's forwards from the stop's asking on

    def ask() -> None:
        seen["asked"] = True
        monkeypatch.setattr(parallel, "_stop_signal", signal.SIGTERM)  # as a pool's request_stop

    def forward(*_args: object) -> None:
        if not seen["asked"] and where != "between-updates" and torch.is_grad_enabled() == (where == "update"):
            ask()
        seen["forwards"] += seen["asked"]

    def stepped(*_args: object) -> None:
        seen["updates"] += 1
        if where == "between-updates":
            ask()

    critic.register_forward_pre_hook(forward)
    optimizer.register_step_post_hook(stepped)
    try:
        with pytest.raises(TrainerStopped, match=re.escape(STOPPED)) as stopped:
            trainer.train(synthetic_groups(0, GPS))
    finally:
        trainer.close()
    assert stopped.value.signum == signal.SIGTERM
    assert (seen["forwards"], seen["updates"], trainer.step) == (forwards, updates, 0)


def test_a_signal_once_stopping_is_logged_and_the_stop_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A lone rank raises at its first signal, where it is; a second one, as the stop unwinds, raises nothing."""
    monkeypatch.setattr(parallel, "_stop_signal", 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TrainerStopped, match=re.escape(STOPPED)):
        request_stop(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="trainer.parallel"):
        request_stop(signal.SIGINT)
    assert "SIGINT while stopping for SIGTERM: the stop goes on" in caplog.text


def test_a_run_forgets_the_stop_that_ended_an_earlier_run_in_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run in one process (a notebook's, a test's) starts unstopped: the first run's stop, kept for its
    pool's stop points, stopped every step of the next one at its first stop point. Its own signal still stops it."""
    monkeypatch.setattr(parallel, "_stop_signal", signal.SIGTERM)  # the earlier run's stop
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kept = {s: signal.getsignal(s) for s in parallel.STOP_SIGNALS}
    try:
        parallel.stop_on_signals()
        parallel.stop_point(torch.device("cpu"))
        with pytest.raises(TrainerStopped, match=re.escape(STOPPED)):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


SECOND = {0: signal.SIGTERM, 1: signal.SIGINT}  # each rank's second signal: a supervisor's again, an operator's Ctrl-C


def _signalling_rank(rank: int, port: int, token: str, config: Path, checkpoints: Path, out: Path,
                     peer_ends: bool) -> None:
    """One of two ranks of the trainer's ``main`` (``spawn_ranks``'s target). Once the first step is checkpointed, it
    sends itself a SIGTERM (a supervisor's stop, to every rank) at the first micro-batch of the next critic update, and
    its ``SECOND`` signal as it starts to leave the process group. Writes main's exit status (or what it raised) and the
    critic's forwards of its update from the first signal on."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ROLLWAVE_CHECKPOINT_TOKEN=token)
    os.environ.pop("REDIS_URL", None)
    torch.set_num_threads(1)
    monkeypatch = pytest.MonkeyPatch()
    forwards = []
    values, close = CriticStep._values, trainer_main.close_distributed

    def signalled(self: CriticStep, mb: object) -> object:
        if forwards or (torch.is_grad_enabled() and (checkpoints / STEP_1).is_dir()):
            if not forwards:
                os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, in the main thread, before the forward
            forwards.append(None)
        return values(self, mb)

    def closing(*args: object) -> None:
        if peer_ends and rank == 1:  # ended at once (SIGKILLed past its grace): it never meets rank 0 to close
            os._exit(0)
        os.kill(os.getpid(), SECOND[rank])
        close(*args)

    monkeypatch.setattr(CriticStep, "_values", signalled)
    monkeypatch.setattr(trainer_main, "close_distributed", closing)
    try:
        said: object = trainer_main.main(["-c", str(config)])
    except BaseException as exc:  # noqa: BLE001 - what the rank raised is the test's finding
        said = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps({"exit": said, "forwards": len(forwards)}))
    exit_rank(0)


@pytest.mark.parametrize("peer_ends", [False, True])
def test_a_pool_sigtermed_in_a_critic_update_stops_in_it_a_second_signal_changing_nothing(
        redis_url: str, tiny_model_dir: Path, tmp_path: Path, ctx: DistContext, peer_ends: bool) -> None:
    """SIGTERM to each rank at the first of its 8 micro-batches of the second step's critic update: both stop at the
    update's next stop point (they went on to its end, then pushed and checkpointed the step). As they leave the
    process group, rank 0 gets a second SIGTERM and rank 1 a SIGINT: these used to kill them there (a rank still to
    meet a killed one failed, exit 1); they are logged, and both ranks leave together and exit 143, the first signal's.
    Or (``peer_ends``) rank 1 ends at once instead, never meeting rank 0 to close: rank 0's closing meeting fails, which
    made it exit 1 as a crash; it is logged, and rank 0 exits 143. Rank 0 records the stop at step 1; the stopped step
    is not checkpointed, and the first step's checkpoint resumes, the critic's state with it, and trains on."""
    keys = Keys(f"stop-in-critic-{peer_ends}")
    client = redis.Redis.from_url(redis_url)
    try:
        buffer = ReplayBuffer(client, keys, BufferConfig(), consumer="trainer")
        buffer.ensure_group()
        buffer.put_many(synthetic_groups(0, 3 * GPS, run=keys.run))
        config = trainer_config(tmp_path, keys, redis_url, tiny_model_dir, GPS, total_steps=50, checkpoint_every=1,
                                dist_timeout_s=GROUP_TIMEOUT_S, **CRITIC)
        run_dir = tmp_path / keys.run
        args = (free_port_outside_ephemeral("127.0.0.1"), secrets.token_urlsafe(32), config, run_dir / "checkpoints",
                tmp_path, peer_ends)
        join_within(spawn_ranks(_signalling_rank, args=args, nprocs=2, join=False), BOUND_S, GROUP_TIMEOUT_S)
        said = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
        assert said == [{"exit": 128 + signal.SIGTERM, "forwards": STOP_EVERY_MICRO_BATCHES}] * (1 if peer_ends else 2)
        ended = [client.hget(keys.trainer, k).decode() for k in ("finished_reason", "finished_step")]
        assert ended == [f"crashed: {STOPPED}", "1"]
    finally:
        client.close()
    assert [p.name for p in Checkpointer(run_dir / "checkpoints", keep=2).list()] == [STEP_1]
    resumed = Trainer(TrainerConfig(**CRITIC), tiny_model_dir, run_dir).start(resume=True, ctx=ctx)
    try:
        assert resumed.step == 1
        assert resumed.critic[1].state_dict()["state"], "the critic's optimizer state did not come back"
        assert resumed.train(synthetic_groups(1, GPS))["policy_updates"] == 1
    finally:
        resumed.close()
