"""One rank of the trainer pool: takes batches, trains, records metrics, pushes versions, checkpoints.

Rank 0 alone talks to the buffer; it shares each batch with the other ranks. A batch's stream entries
are acked only after a checkpoint that covers the step which used them, so a crash never loses a group:
its entries stay pending and come back first (``ReplayBuffer.take`` reclaims this consumer's own pending
entries). The checkpoint records those entries, and a resumed trainer acks them again before reading,
so a group trained before the checkpoint is not trained twice.

Versions: with a pusher, ``version`` is the newest version a quorum of rollout servers committed (the
pusher publishes it in the background; rank 0 reads it before each batch and shares it with the batch),
so staleness is measured against weights that really serve. The trainer pushes its weights when it
starts (every server then serves them, a resumed trainer's included) and every ``push_every`` steps, or ahead of
that while it waits for data and servers restarted in another dtype are stranded from the newest version
(``_repush_stranded``); it never waits for a push. Without a pusher (tests that sample from the trainer's own
model) the version counts the trainer's own updates.

Once a newer trainer of the run started (``ReplayBuffer.fence``), this one stops (``TrainerFenced``) at its next
take or ack, and before its next push or checkpoint: the newer one owns the servers' weights and the resume point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from prometheus_client import CollectorRegistry
from torch import nn

from buffer.metrics import BufferMetrics
from buffer.replay import TrainerFenced
from buffer.schema import TrajectoryGroup
from buffer.staleness import split_stale
from core.config import BufferConfig, LoraConfig, TrainerConfig
from trainer.batching import check_group
from trainer.checkpoint import Checkpointer, CheckpointMismatch
from trainer.checkpoint_pusher import CheckpointPusher, PushResult, PushRound
from trainer.colocation import held_bytes
from trainer.critic import build_critic_optimizer, load_critic
from trainer.lora import add_adapter
from trainer.metrics import MetricsLog, TrainerMetrics
from trainer.offload import device_offload
from trainer.optim import apply_settings, build_optimizer, build_scheduler
from trainer.parallel import DistContext, from_rank0, init_distributed, load_model, stop_point
from trainer.shaping import is_degenerate
from trainer.step import TrainStep

log = logging.getLogger(__name__)


class GroupSource(Protocol):
    """The trainer side of the replay buffer (``buffer.replay.ReplayBuffer``)."""

    def take(self, max_groups: int, timeout_s: float) -> list[tuple[str, TrajectoryGroup]]: ...

    def ack(
        self,
        entry_ids: Sequence[str],
        group_ids: Sequence[str],
        stale_group_ids: Sequence[str] = (),
        degenerate_group_ids: Sequence[str] = (),
    ) -> int: ...

    def drained(self) -> bool: ...

    def reject(self, entry_id: str, error: str) -> None: ...

    def check_fence(self) -> None: ...


class Pusher(Protocol):
    """Hands new policy versions to the rollout servers in the background
    (``trainer.checkpoint_pusher.CheckpointPusher``). Every rank calls ``push_model`` (gathering full parameters
    is a collective); rank 0 gets the round. ``published`` is the newest version a quorum of servers committed."""

    published: int

    def push_model(self, model: nn.Module, *, unacked: int = 0) -> PushRound | None: ...

    def take_results(self) -> list[PushResult]: ...

    def flush(self, timeout_s: float | None = None) -> list[str]: ...


class DeviceShare(Protocol):
    """Turns on a device the trainer shares with the engines (``trainer.colocation.LocalPusher``): every rank calls
    ``take_device`` before a step (it returns once the engines released their memory) and ``give_device`` after
    it, once the step's push (if due) is written. With ``overlap`` the engines keep their memory while it trains."""

    overlap: bool

    def take_device(self, step: int) -> float: ...

    def give_device(self, step: int) -> None: ...


def critic_unused(cfg: TrainerConfig) -> bool:
    """Whether ``trainer.critic`` says something (differs from its defaults: a launcher's config dump names every
    default) that the advantage estimator ignores (only ``gae`` has a critic)."""
    return cfg.advantage != "gae" and cfg.critic != type(cfg.critic)()


class Trainer:
    """Owns the model, optimizer, scheduler, checkpoints and metrics of this rank."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model_path: Path,
        run_dir: Path,
        buffer: BufferConfig | None = None,
        *,
        temperature: float = 1.0,
        pusher: Pusher | None = None,
        registry: CollectorRegistry | None = None,
        buffer_metrics: BufferMetrics | None = None,
        lora: LoraConfig | None = None,
        device_share: DeviceShare | None = None,
        fence: Callable[[], None] | None = None,
    ) -> None:
        """``fence`` (rank 0's; ``ReplayBuffer.check_fence``) raises ``TrainerFenced`` once a newer trainer of the run
        started: asked before each push and each checkpoint, so that one's servers and resume point get nothing from
        this trainer after that."""
        self.cfg = cfg
        self.device_share = device_share
        self.fence = fence
        self.lora = lora
        self.model_path = Path(model_path)
        self.run_dir = Path(run_dir)
        self.buffer = buffer or BufferConfig()
        self.temperature = temperature
        self.pusher = pusher
        self.metrics = TrainerMetrics(registry)
        # the source's own (ReplayBuffer(metrics=...)), so what its reads count is served with the trainer's metrics
        self.buffer_metrics = buffer_metrics or BufferMetrics(self.metrics.registry)
        self.step = 0
        self.version = 0
        self._saved_step = 0  # the step of the last checkpoint this trainer saved or resumed from (every rank)
        self._pushed_step: int | None = None  # the step whose weights this trainer pushed last (every rank)
        self._unacked: list[tuple[str, str]] = []  # (entry id, group id) trained since the last checkpoint
        self._covered: list[tuple[str, str]] = []  # in a checkpoint, not yet acked
        self._partial: list[tuple[str, TrajectoryGroup]] = []  # read, waiting for the rest of the batch
        self._stale_dropped = 0
        self._degenerate_dropped = 0
        self._drained = False
        self._log: MetricsLog | None = None

    def start(self, resume: bool = False, ctx: DistContext | None = None, source: GroupSource | None = None
              ) -> Trainer:
        """Join the process group, load and shard the model, and restore the latest checkpoint if asked. Rank 0's
        ``source`` acks the groups the checkpoint covers before the start push, which counts what its weights
        were trained on (without it, covered groups that were acked before are counted again).

        Refuses to start over (``resume`` off) in a run directory that holds checkpoints: pruning keeps the highest
        steps, whoever wrote them, so the new run's first checkpoints would go at once, and a crash would resume
        the old run's weights with the new run's groups acked as trained."""
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", self.cfg.keep_checkpoints)
        if not resume and (latest := self.checkpointer.latest()) is not None:
            raise CheckpointMismatch(f"{self.checkpointer.root} holds checkpoints (latest {latest.name}) and resume is "
                                  "off: continue with --resume, or start in a new run directory")
        self.ctx = ctx or init_distributed(self.cfg.device, self.cfg.dist_timeout_s)
        shared = self.device_share is not None and not self.device_share.overlap
        self.offload = device_offload(self.cfg.offload, self.ctx.device, shared)
        adapter = partial(add_adapter, lora=self.lora, base_model=str(self.model_path)) if self.lora else None
        ref = None
        self.critic: tuple[nn.Module, torch.optim.Optimizer] | None = None
        with self.offload.region():
            self.model = load_model(self.model_path, self.ctx, prepare=adapter)
            if self.cfg.kl_coef > 0:
                ref = load_model(self.model_path, self.ctx).requires_grad_(False)
            if self.cfg.advantage == "gae":
                critic = load_critic(self.cfg.critic.path or self.model_path, self.ctx)
                self.critic = (critic, build_critic_optimizer(critic, self.cfg))
        self.optimizer = build_optimizer(self.model, self.cfg)
        self.scheduler = build_scheduler(self.optimizer, self.cfg)
        critic_model, critic_optimizer = self.critic or (None, None)
        self._resident = [m for m in (self.model, ref, critic_model) if m is not None]  # what offload moves
        self._optimizers = [o for o in (self.optimizer, critic_optimizer) if o is not None]
        for optimizer in self._optimizers:
            self.offload.attach(optimizer)
        self._offloaded = False
        if critic_unused(self.cfg):
            log.warning("trainer.critic is set but trainer.advantage is %s: no critic is used", self.cfg.advantage)
        pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        self.train_step = TrainStep(
            self.model,
            self.optimizer,
            self.scheduler,
            self.cfg,
            self.ctx,
            temperature=self.temperature,
            ref_model=ref,
            pad_id=pad_id,
            critic=self.critic,
        )
        if resume:
            self.restore()
            if source is not None and self.ctx.is_main:
                self.ack_checkpointed(source)
        if self.ctx.is_main:
            self._log = MetricsLog(self.run_dir / "metrics.jsonl").start()
            self.metrics.step.set(self.step)
            self.metrics.version.set(self.version)
        if self.pusher is not None:  # rank 0 read it from Redis: every rank decides by it
            pusher = self.pusher
            pusher.published = from_rank0(lambda: max(pusher.published, self.version), "the version published")
            # A fresh run's servers already serve the weights it starts from, as version 0: pushing them again
            # would be a whole push for nothing. A colocated run writes them all the same (its local push numbers
            # them 0 then), and the device is handed over with them. Any other start pushes what it resumed from,
            # trained on the groups its checkpoint covers (acked above), so admission opens nothing for it.
            if self.step > 0 or self.pusher.published > 0 or self.device_share is not None:
                self._push()
        if self.device_share is not None:  # the servers serve what this trainer resumes from
            self._offload()
            self.device_share.give_device(self.step)
        return self

    def restore(self, path: Path | None = None) -> bool:
        """Load ``path`` (default: the latest checkpoint); False when there is none to load."""
        path = path or self.checkpointer.latest()
        if path is None:
            log.warning("resume: no checkpoint in %s; starting from %s", self.checkpointer.root, self.model_path)
            return False
        with self.offload.region():  # the optimizer state it loads is allocated anew
            state = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler, self.critic,
                                           self._settings())
        apply_settings(self.optimizer, self.cfg.lr, self.cfg, self.scheduler)
        if self.critic is not None:
            apply_settings(self.critic[1], self.cfg.critic.lr, self.cfg)
        self.step, self.version = state["step"], state["policy_version"]
        self._saved_step = self.step
        self._covered = [(e, g) for e, g in state["buffer"]["unacked"]]
        self._unacked = []
        log.info("resumed from %s at step %d, policy version %d", path, self.step, self.version)
        return True

    def _settings(self) -> dict[str, Any]:
        """The settings a checkpoint's tensors were trained under, which a resume must keep: the adapter's shape
        and scale (a change of ``model.lora.dropout`` or ``name`` changes neither)."""
        lora = None if self.lora is None else {"rank": self.lora.rank, "alpha": self.lora.alpha,
                                               "target_modules": sorted(self.lora.target_modules)}
        return {"model.lora": lora}

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def done(self) -> bool:
        """``total_steps`` reached, or (``stop_when_drained``) the data ran out."""
        return self.step >= self.cfg.total_steps or self._drained

    def next_batch(self, source: GroupSource | None) -> tuple[list[TrajectoryGroup], float]:
        """(groups of the next step, seconds waited for them), on every rank.

        Rank 0 reads ``source`` (ignored elsewhere) and drops stale groups. After every read, full batch
        or not, it broadcasts, so the other ranks never sit in one collective longer than a read
        (``take_timeout_s``) however long the buffer stays empty (NCCL would time out). A read refused because a
        newer trainer started (``TrainerFenced``), or one that failed, is broadcast too (``from_rank0``): every rank
        stops, none waits for rank 0. Before each read the ranks stop together if any was asked to (a SIGTERM's
        ``TrainerStopped``, ``stop_point``), and reach the servers the newest version is stranded from
        (``_repush_stranded``: that version again, or a new one when steps were trained since).
        """
        if self.ctx.is_main and source is None:
            raise ValueError("rank 0 needs a GroupSource to read batches from")
        start = last = time.perf_counter()
        while True:
            stop_point(self.ctx.device)
            self._repush_stranded()
            read = from_rank0(lambda: self._read(source), "the buffer read", (TrainerFenced,))
            now = time.perf_counter()
            self.metrics.idle.inc(now - last)  # read by read: a trainer starved of data shows idle while it waits
            last = now
            if read is not None:
                groups, self._drained, self.version = read
                return groups, now - start

    def _repush_stranded(self) -> None:
        """Reach the servers the newest version could not be sent to (restarted in another dtype than its snapshot was
        cast to: ``CheckpointPusher.repush_due``): with no step trained since it was pushed (the masters are exactly its
        weights), push it again in the trainer's precision to them alone; with steps trained since (``push_every``
        above 1), push the present weights as a new version, ahead of schedule (keeping the pushed version's masters to
        push them again would hold a second full copy). A fleet that restarted so used to stay on its base weights, its
        groups too stale to train, until the next scheduled push, which a trainer waiting for data never reached. Rank 0
        decides, every rank gathers."""
        pusher = self.pusher
        if not isinstance(pusher, CheckpointPusher) or self._pushed_step is None:
            return
        version = from_rank0(pusher.repush_due, "the stranded servers' check")
        if not version:
            return
        if self._pushed_step == self.step:
            pusher.repush_model(self.model, version)
            return
        if self.ctx.is_main:
            log.warning("servers are stranded from version %d (restarted in another dtype than it was cast to) and %d "
                        "step(s) were trained since it: pushing the present weights as a new version, ahead of "
                        "buffer.push_every (%d)", version, self.step - self._pushed_step, self.buffer.push_every)
        self._push()

    def _read(self, source: GroupSource) -> tuple[list[TrajectoryGroup], bool, int] | None:
        """One buffer read into the pending batch; (the batch, drained, version) once it holds
        ``groups_per_step`` groups, or (with ``stop_when_drained``) whatever it holds once nothing more can
        arrive. The version is read after the take, so a group is never judged by an older version than
        the one it was admitted under."""
        self.ack_checkpointed(source)
        want = self.buffer.groups_per_step
        items = source.take(want - len(self._partial), self.cfg.take_timeout_s)
        if self.pusher is not None:
            self.version = max(self.version, self.pusher.published)
        # the groups held for this batch were judged by the version of their read: a push since may have aged them
        self._partial, stale = split_stale(self._partial, self.version, self.buffer.max_staleness, self.buffer_metrics)
        # untrainable first: a group whose versions are no policy's is malformed, not stale
        fresh, stale_now = split_stale(self._reject_untrainable(source, items), self.version,
                                       self.buffer.max_staleness, self.buffer_metrics)
        stale += stale_now
        if stale:
            ids = [g.group_id for _, g in stale]
            source.ack([e for e, _ in stale], ids, stale_group_ids=ids)
            self._stale_dropped += len(stale)
        if self.buffer.filter_degenerate_groups:
            fresh = self._drop_degenerate(source, fresh)
        self._partial += fresh
        drained = not items and self.cfg.stop_when_drained and source.drained()
        if len(self._partial) < want and not drained:
            return None
        batch, self._partial = self._partial, []
        self._unacked += [(e, g.group_id) for e, g in batch]
        return [g for _, g in batch], drained, self.version

    def _reject_untrainable(
        self, source: GroupSource, items: list[tuple[str, TrajectoryGroup]]
    ) -> list[tuple[str, TrajectoryGroup]]:
        """Move aside (``GroupSource.reject``) the groups this model cannot train on (``check_group``: a token
        outside its vocabulary, a greedy temperature, ...) before they reach a step, which would fail on them
        again after every restart; returns the others."""
        step = self.train_step
        kept = []
        for entry_id, group in items:
            try:
                check_group(group, step.vocab_size, step.temperature)
            except ValueError as exc:
                log.error("group %s cannot be trained on: %s; moved aside", group.group_id, exc)
                source.reject(entry_id, str(exc))
            else:
                kept.append((entry_id, group))
        return kept

    def _drop_degenerate(
        self, source: GroupSource, items: list[tuple[str, TrajectoryGroup]]
    ) -> list[tuple[str, TrajectoryGroup]]:
        """DAPO's dynamic sampling: ack away the groups whose rewards (as the advantages see them) are all equal,
        giving their admission slots back, so the rollout makes up for them; returns the informative ones."""
        kept, dropped = [], []
        for item in items:
            (dropped if is_degenerate(item[1], self.cfg.overlong) else kept).append(item)
        if dropped:
            ids = [g.group_id for _, g in dropped]
            source.ack([e for e, _ in dropped], ids, degenerate_group_ids=ids)
            self.buffer_metrics.degenerate_dropped.inc(len(dropped))
            log.info("dropped %d group(s) whose rewards are all equal (buffer.filter_degenerate_groups): %s",
                     len(dropped), ", ".join(ids))
            self._degenerate_dropped += len(dropped)
        return kept

    def train(self, groups: list[TrajectoryGroup], wait_s: float = 0.0) -> dict[str, Any]:
        """One step on ``groups`` (every rank, same groups); then push and checkpoint as due, and record. With a
        shared device the step, its push and its checkpoint run between taking the device from the engines (the
        trainer's memory comes back, ``trainer.offload``) and giving it back (the memory leaves again)."""
        device_wait_s = self._take_device(self.step + 1) if self.device_share is not None else 0.0
        onload_s = self._onload()
        record = self.train_step(groups, self.version, self.step)
        record.update(step=self.step + 1, policy_version=self.version, wait_s=wait_s, time=time.time())
        record.update(idle_fraction=wait_s / (wait_s + record["step_time_s"]), stale_dropped=self._stale_dropped,
                      degenerate_dropped=self._degenerate_dropped)
        record["group_ids"] = [g.group_id for g in groups]
        self._stale_dropped = self._degenerate_dropped = 0
        self.step += 1
        if self.step % self.buffer.push_every == 0:
            record.update(self._push())
        if self.step % self.cfg.checkpoint_every == 0 or self.done:
            self.save_checkpoint()
        record.update(device_wait_s=device_wait_s, held_bytes=held_bytes(self._resident, self._optimizers))
        if self.device_share is not None:
            record.update(onload_s=onload_s, offload_s=self._offload())
            self.device_share.give_device(self.step)
        if self.ctx.is_main:
            record.update(self._push_outcomes())
            self.metrics.observe_step(record)
            self.metrics.version.set(self.version)
            assert self._log is not None
            self._log.write(record)
        return record

    def _take_device(self, step: int) -> float:
        """``DeviceShare.take_device``; servers that did not release the device in time (rank 0's TimeoutError, which
        names them) are logged and counted before the error stops the trainer."""
        assert self.device_share is not None
        try:
            return self.device_share.take_device(step)
        except TimeoutError as exc:
            self.metrics.handover_failures.labels(stage="release").inc()
            log.error("the device's hand-over failed: %s", exc)
            raise

    def _offload(self) -> float:
        """Free the device for the engines (``trainer.offload``); the seconds it took."""
        start = time.perf_counter()
        self.offload.offload(self._resident, self._optimizers)
        self._offloaded = True
        return time.perf_counter() - start

    def _onload(self) -> float:
        """Take the offloaded memory back for the trainer's turn; the seconds it took."""
        start = time.perf_counter()
        if self._offloaded:
            self.offload.onload(self._resident, self._optimizers)
            self._offloaded = False
        return time.perf_counter() - start

    def _check_fence(self) -> None:
        """Raise ``TrainerFenced`` on every rank once a newer trainer of the run started: rank 0 asks (``fence``, one
        round trip) and tells the others, so all of them stop before the same collective (a push's gathers, a
        checkpoint's writes) instead of waiting in it for a rank that left."""
        fence = self.fence
        from_rank0(lambda: fence() if fence is not None else None, "the fence check", (TrainerFenced,))

    def _push(self) -> dict[str, Any]:
        """Hand the new weights to the pusher (every rank), unless a newer trainer of the run started (``fence``);
        rank 0's figures for the step's record."""
        if self.pusher is None:
            self.version += 1
            return {}
        self._check_fence()
        pushed = self.pusher.push_model(self.model, unacked=len(self._unacked) + len(self._covered))
        self._pushed_step = self.step
        if pushed is None:
            return {}
        return {"pushed_version": pushed.version, "pushed_trained": pushed.trained,
                "push_snapshot_s": pushed.snapshot_seconds}

    def _push_outcomes(self) -> dict[str, Any]:
        """Pushes that finished since the last step: their commit pauses and failures."""
        if self.pusher is None:
            return {}
        results = [r for r in self.pusher.take_results() if not r.skipped]
        return {
            "push_servers_ok": sum(r.ok for r in results),
            "push_failures": sum(not r.ok for r in results),
            "push_pause_ms": [r.pause_seconds * 1000 for r in results if r.ok],
        }

    def save_checkpoint(self) -> Path:
        """Checkpoint every rank's state; the entries trained so far become ready to ack."""
        state = {"policy_version": self.version, "buffer": {"unacked": self._unacked}, "settings": self._settings()}
        offloaded = self._offloaded
        self._onload()  # after the last step (finish): memory_saver's paused memory cannot be read
        path = self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler, state, self.critic,
                                      fence=self._check_fence)
        if offloaded:
            self._offload()
        self._saved_step = self.step
        self._covered += self._unacked
        self._unacked = []
        return path

    def run(self, source: GroupSource | None, after_step: Callable[[dict[str, Any]], None] | None = None) -> str:
        """Train until ``total_steps`` or (``stop_when_drained``) the data runs out, calling ``after_step`` with each
        step's record (rank 0's, refused by the fence, stops every rank at the next take), then ``finish`` (every rank;
        rank 0 reads ``source``). Returns why it stopped, as the config
        key that stopped it (``trainer.total_steps`` or ``trainer.stop_when_drained``), for the run's status."""
        while not self.done:
            groups, waited = self.next_batch(source)
            if not groups:
                break
            record = self.train(groups, waited)
            if after_step is not None:
                try:
                    after_step(record)
                except TrainerFenced:  # rank 0's status refused (logged, counted): its next take or the last
                    continue  # checkpoint stops every rank together, where raising here left the others in a broadcast
        self.finish(source)
        return "trainer.total_steps" if self.step >= self.cfg.total_steps else "trainer.stop_when_drained"

    def finish(self, source: GroupSource | None) -> None:
        """Checkpoint what was trained since the last checkpoint, then (rank 0) ack it all and let the last
        pushes land (each within its deadlines). Every rank decides by the step, which they share (only rank 0
        knows the groups), since the checkpoint is a collective."""
        if self.step > self._saved_step:
            self._final_checkpoint()
        if source is not None:
            self.ack_checkpointed(source)
        if self.pusher is not None and self.ctx.is_main:
            if unfinished := self.pusher.flush():
                log.warning("the last push to %s did not end within its deadlines and is cut short; a commit in "
                            "flight may still land on those servers, else they serve the version they had until a "
                            "trainer pushes again", ", ".join(unfinished))
            self.version = max(self.version, self.pusher.published)

    def _final_checkpoint(self) -> None:
        """The checkpoint of the steps trained since the last one; with a shared device, in a turn of the trainer's
        own (the one after its last step's), as a step's is: the last step gave the device back, and the checkpoint
        takes the trainer's memory onto it. The engines get the device back with the weights they served."""
        if self.device_share is None:
            self.save_checkpoint()
            return
        self._take_device(self.step + 1)
        self.save_checkpoint()
        self.device_share.give_device(self.step)

    def ack_checkpointed(self, source: GroupSource) -> None:
        """Ack the entries of groups a checkpoint covers (rank 0; idempotent)."""
        if self._covered:
            source.ack([e for e, _ in self._covered], [g for _, g in self._covered])
            self._covered = []
