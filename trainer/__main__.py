"""``python -m trainer -c cfg.yaml [key=value ...] [--resume]``: one rank of the trainer pool.

Under torchrun every process is one rank (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); alone it is
a pool of one. Rank 0 reads the run's Redis buffer (``REDIS_URL`` or ``redis.url``; with neither it
starts the embedded server) and pushes each new version to the live rollout servers; all ranks train.
``--export-hf OUT`` writes the latest checkpoint (or ``--checkpoint DIR``) as an HF model and exits (a LoRA
run's as its adapter; with ``--merge-lora`` as the merged model, the adapter in ``OUT/adapter``); one that cannot
(no checkpoint, a damaged one, one of another model, an OUT it cannot write) says why in one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from buffer.colocation import DeviceTurns
from buffer.keys import TRAINER_CRASHED, Keys
from buffer.metrics import BufferMetrics
from buffer.redis_server import connect
from buffer.registry import PushRecord, ServerRegistry
from buffer.replay import ReplayBuffer, TrainerFenced
from buffer.staleness import StalenessControl
from core.config import CONFIG_ERROR_EXIT, BufferConfig, Config, ConfigError, load_config_or_exit, require_secret
from core.metrics import serve_metrics
from core.model_dir import ensure_model
from core.placement import pin
from core.process import die_with_parent, prepare_component
from trainer.checkpoint import Checkpointer, CheckpointMismatch, export_hf
from trainer.checkpoint_pusher import CheckpointPusher, registered_servers
from trainer.colocation import LocalPusher
from trainer.metrics import RedisStatus, TrainerLease
from trainer.parallel import (
    DistContext,
    TrainerStopped,
    close_distributed,
    exit_rank,
    init_distributed,
    resolve_device,
    stop_on_signals,
)
from trainer.worker import Trainer

log = logging.getLogger("trainer")
CRASH_REASON_CHARS = 300  # a crash's ``finished_reason``: the exception's type and the start of its message


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description="One rank of the rollwave trainer pool.")
    p.add_argument("-c", "--config", help="run config YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-5")
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.add_argument("--export-hf", metavar="OUT", type=Path, help="export a checkpoint as an HF model, then exit")
    p.add_argument("--checkpoint", type=Path, help="with --export-hf: this checkpoint instead of the latest")
    p.add_argument("--merge-lora", action="store_true",
                   help="with --export-hf and model.lora: write the merged model, the adapter beside it")
    return p


class RunRecord:
    """Rank 0's record of the trainer in the run's state, beside the buffer's scripts: its start (the run's budget of
    train groups, where its metrics are served, an earlier trainer's end cleared) and its end (where and why it
    stopped, ``RedisStatus.finished``; the budget closed at what was trained), and each push's result in the
    registry. Each is one MULTI run only while this trainer is the run's newest (``ReplayBuffer.fenced_write``): a
    trainer fenced by then wrote them over the newer trainer's, whose admission its budget then shut (or opened past
    the newer one's steps), whose end it cleared or replaced, and whose last push to a server it replaced. The
    versions its pushers publish (``staleness``) are fenced the same way."""

    def __init__(self, buffer: ReplayBuffer, cfg: BufferConfig) -> None:
        self.buffer = buffer
        self.cfg = cfg
        self.staleness = StalenessControl(buffer.redis, buffer.keys, cfg, fence=buffer)

    def _write(self, refused: str, write: Callable[[RedisStatus, StalenessControl], None]) -> None:
        """``write`` the status and the admission budget, queued on one MULTI that only the newest trainer runs."""
        keys = self.buffer.keys
        self.buffer.fenced_write(lambda pipe: write(RedisStatus(pipe, keys), StalenessControl(pipe, keys, self.cfg)),
                                 refused)

    def started(self, remaining: int, metrics_address: str | None) -> None:
        """Past its start-up: the run trains ``remaining`` more groups than were trained (admission stops there), its
        metrics are served at ``metrics_address``, and the end an earlier trainer recorded no longer holds (the API
        takes train jobs again and the stalled ones run on)."""
        budget = self.staleness.trained() + remaining

        def write(status: RedisStatus, staleness: StalenessControl) -> None:
            staleness.set_budget(budget)
            if metrics_address is not None:
                status.publish_metrics_address(metrics_address)
            status.started()

        self._write("its start in the run's status", write)

    def ended(self, step: int, reason: str, version: int | None = None, pushed: int = 0) -> None:
        """The trainer stopped at ``step`` because of ``reason``, with its ``version`` (None: the published one, for a
        trainer that never made its pusher) and the newest ``pushed``: admission closes at what was trained (with the
        trainer: ``stop_when_drained`` stops short of the budget)."""
        trained = self.staleness.trained()
        version = self.staleness.version() if version is None else version

        def write(status: RedisStatus, staleness: StalenessControl) -> None:
            staleness.set_budget(trained)
            status.finished(step, reason, version, pushed)

        self._write("its end in the run's status", write)
        log.info("finished at step %d (%s)", step, reason)

    def crashed(self, exc: Exception, step: int = 0, version: int | None = None, pushed: int = 0) -> None:
        """Record ``exc`` as the end (``crash_reason``). Raises ``TrainerFenced`` when a newer trainer of the run
        started, whose end it is (a launcher must not restart this one: it would fence the newer one in turn)."""
        try:  # the crash may be Redis's: its own error must not hide the one that stopped the trainer
            self.ended(step, crash_reason(exc), version, pushed)
        except TrainerFenced:
            log.error("the trainer crashed after a newer trainer of the run started; the run's end is that one's",
                      exc_info=exc)
            raise
        except Exception:
            log.exception("could not record the crash in Redis")

    def pushed(self, server_id: str, push: PushRecord) -> None:
        """The result of a push to ``server_id``, its last push as ``rollwave status`` and the API show it."""
        keys = self.buffer.keys
        self.buffer.fenced_write(lambda pipe: ServerRegistry(pipe, keys).record_push(server_id, push),
                                 "a push's result in the registry")


def _connect(
    cfg: Config, ctx: DistContext, stack: contextlib.ExitStack, metrics: CollectorRegistry,
    buffer_metrics: BufferMetrics,
) -> tuple[ReplayBuffer | None, CheckpointPusher | LocalPusher, RedisStatus | None, RunRecord | None]:
    """Rank 0: the replay buffer, a pusher to the live servers (recording each push in the registry; colocated:
    a local pusher that also hands the device over), the status sink for the API and the record of the trainer's
    start and end (the run's budget among them), each writing to the run only while this trainer is its newest (the
    buffer's fence), and the trainer's lease (``TrainerLease``, kept until the stack unwinds); other ranks: a pusher
    that only takes part in the gathers. Rank 0 records a crash past its fence as the run's end, as one later in its
    start-up (a bad TLS file: a launcher restarts it, and a train job would read ``running`` meanwhile)."""
    colocated = cfg.placement.mode == "colocated"
    local_root = cfg.checkpoint.stage_dir / cfg.run.name / "local_push"
    if not ctx.is_main:
        if colocated:
            overlap = cfg.placement.colocated_staleness == 1  # as rank 0's: every rank offloads or none does
            return None, LocalPusher(local_root, cfg.model.path, overlap=overlap), None, None
        pusher = CheckpointPusher(cfg.checkpoint, [])
        stack.callback(pusher.close)
        return None, pusher, None, None
    client, server = connect(cfg.redis, cfg.run.path)
    stack.callback(client.close)
    if server is not None:
        stack.callback(server.stop)
    keys = Keys(cfg.run.name)
    buffer = ReplayBuffer(client, keys, cfg.buffer, consumer="trainer", metrics=buffer_metrics)  # served
    buffer.ensure_group()
    buffer.fence()  # at once: a trainer of the run still running stops taking groups this one will not see
    stack.callback(buffer.close)
    record = RunRecord(buffer, cfg.buffer)
    staleness = record.staleness
    status = RedisStatus(client, keys, fence=buffer)
    try:
        # deleted as the stack unwinds, the end recorded before; a trainer killed lets it lapse (a delete then takes
        # the cancelled jobs' groups it held, and the API reads the trainer as crashed)
        stack.callback(TrainerLease(client, keys, buffer, cfg.buffer.claim_idle_ms, metrics).start().stop)
        registry = ServerRegistry(client, keys)
        if colocated:
            local = LocalPusher(local_root, cfg.model.path, DeviceTurns(client, keys, fence=buffer), registry,
                                staleness, cfg.placement.colocated_timeout_s,
                                overlap=cfg.placement.colocated_staleness == 1)
            local.published = staleness.version()
            return buffer, local, status, record
        pusher = CheckpointPusher(cfg.checkpoint, registered_servers(registry), staleness, record=record.pushed,
                                  registry=metrics, pin_memory=ctx.device.type == "cuda", fence=buffer.check_fence)
        pusher.published = staleness.version()  # numbering continues above what this run published before
        stack.callback(pusher.close)
        return buffer, pusher, status, record
    except Exception as exc:
        record.crashed(exc)
        raise


def _start(cfg: Config, trains: bool) -> None:
    """What a trainer process needs before it starts: its CPUs; to train, the checkpoint token (when it pushes),
    its device and a model (built here if ``model.init_if_missing``). What it lacks is one line naming the key."""
    cfg.trainer.threads = pin(cfg.placement.trainer_cpus, "placement.trainer_cpus", cfg.trainer.threads,
                              sharers=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if trains:
        if cfg.placement.mode == "decoupled":
            require_secret(cfg, "checkpoint.token")
        resolve_device(cfg.trainer.device)
        ensure_model(cfg.model)


def crash_reason(exc: Exception) -> str:
    """The ``finished_reason`` of a trainer that crashed: ``crashed: <type>: <message>`` on one line, bounded, so the
    API can say why a train job is not trained without a log to read."""
    return textwrap.shorten(f"{TRAINER_CRASHED}{type(exc).__name__}: {exc}", CRASH_REASON_CHARS, placeholder=" ...")


def main(argv: list[str] | None = None) -> int:
    """Rank 0 clears the previous trainer's end only once this one is past its start-up (config, model load,
    resume), so a trainer killed during it leaves the previous end, and its reason, in place. It records its own end
    as it stops: the config key that stopped it, or ``crashed: ...`` for an exception out of its start-up (once it
    connected to Redis and took its fence: a bad TLS file, a model that fails to load, a checkpoint that fails to
    resume) or its training loop (then re-raised: the process fails); LocalStack and Ray restart a crashed trainer,
    and the restart clears that end once it trains again, so ``rollwave submit --wait`` waits a while for it
    (``client_cmd.wait_for_job``), then ends with the reason. A ``CheckpointMismatch`` (a checkpoint that does not fit
    the run, or is damaged) or a ``ConfigError`` out of the start (a model directory whose weights do not fit its
    config.json, a LoRA target the engines cannot serve) is recorded the same way but exits ``CONFIG_ERROR_EXIT``,
    which no launcher restarts (it would only fail again). A trainer fenced by a newer one
    of its run (``TrainerFenced``) records nothing, its start, its end and a crash included (``RunRecord``): the run's
    end and budget are the newer one's; it exits ``CONFIG_ERROR_EXIT`` too (a restart would fence the newer one). A
    SIGTERM or SIGINT (``TrainerStopped``) is recorded as a crash and exits 143 or 130; a pool's ranks stop together
    at their next stop point (``stop_point``: before a buffer read, an optimizer update, or every few micro-batches; a
    step stopped within is neither pushed nor checkpointed), and leave the process group together
    (``close_distributed``)."""
    prepare_component()
    die_with_parent()
    args = _parser().parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides, check=partial(_start, trains=args.export_hf is None))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.export_hf is not None:
        try:
            print(_export(cfg, args))
        except (CheckpointMismatch, OSError) as exc:  # no checkpoint, a damaged or foreign one, an unwritable OUT
            print(f"error: --export-hf: {exc}", file=sys.stderr)
            return CONFIG_ERROR_EXIT
        return 0
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    stop_on_signals()
    try:
        return _train(cfg, args.resume)
    except TrainerFenced as exc:  # the newer trainer owns the run's end and budget: record neither
        print(f"error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except TrainerStopped as exc:
        log.warning("%s", exc)
        return 128 + exc.signum


def _export(cfg: Config, args: argparse.Namespace) -> Path:
    """``--export-hf``: the checkpoint given, else the run's latest, written as an HF model (``export_hf``)."""
    checkpoints = cfg.run.path / "checkpoints"
    ckpt = args.checkpoint or Checkpointer(checkpoints, cfg.trainer.keep_checkpoints).latest()
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint under {checkpoints}: train first, or name one with --checkpoint")
    return export_hf(ckpt, cfg.model.path, args.export_hf, cfg.model.lora, merge=args.merge_lora)


def _leave_group(_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> bool:
    """``close_distributed`` as ``_train``'s stack unwinds. Once a pool agreed to stop, a peer that ended before the
    closing meeting (SIGKILLed past its grace, the OOM killer) fails it: that is logged, and the stop goes on to its
    exit status, 128 + the signal (it raised out of the stop, and the rank exited 1 as if it had crashed)."""
    try:
        close_distributed()
    except Exception as error:
        if not isinstance(exc, TrainerStopped):
            raise
        log.warning("leaving the process group after the stop failed (%s: %s): a peer ended first; the stop goes on",
                    type(error).__name__, error)
    return False


def _train(cfg: Config, resume: bool) -> int:
    """Connect, start and train (``main``); raises ``TrainerFenced`` once a newer trainer of the run started."""
    ctx = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    with contextlib.ExitStack() as stack:
        # every rank leaves the process group together as the stack unwinds, a stopped one too: a pool's ranks stop at
        # the same collective (``stop_point``), so none is left in one, and its gloo or NCCL group is not left to exit
        stack.push(_leave_group)
        metrics = CollectorRegistry()
        buffer_metrics = BufferMetrics(metrics)  # the reads' counters (redeliveries, malformed...) and the trainer's
        source, pusher, status, run_record = _connect(cfg, ctx, stack, metrics, buffer_metrics)
        trainer = Trainer(
            cfg.trainer,
            cfg.model.path,
            cfg.run.path,
            cfg.buffer,
            temperature=cfg.rollout.temperature,
            pusher=pusher,
            registry=metrics,
            buffer_metrics=buffer_metrics,
            lora=cfg.model.lora,
            device_share=pusher if isinstance(pusher, LocalPusher) else None,
            fence=None if source is None else source.check_fence,
        )
        stack.callback(trainer.close)
        tc = cfg.trainer

        def published(record: dict[str, Any]) -> None:
            assert status is not None
            status.publish(record, trainer.version, pusher.last_pushed)
            log.info("step %d: loss %.4f reward %.3f", record["step"], record["loss"], record["reward_mean"])

        def versions() -> tuple[int, int]:
            """The published version (read at connect, for a trainer that never trained) and the newest pushed."""
            return max(trainer.version, pusher.published), pusher.last_pushed

        try:
            trainer.start(resume=resume, ctx=ctx, source=source)
            address = None
            if ctx.is_main and tc.metrics_port is not None:
                server = serve_metrics(trainer.metrics.registry, "trainer", tc.metrics_host, tc.metrics_port)
                stack.callback(server.shutdown)
                address = f"{tc.metrics_host}:{server.server_port}"
            if run_record is not None:  # after start, which acks what a resumed checkpoint covers: none counted twice
                run_record.started(max(0, tc.total_steps - trainer.step) * cfg.buffer.groups_per_step, address)
            log.info("rank %d/%d training from step %d", ctx.rank, ctx.world_size, trainer.step)
            reason = trainer.run(source, published if status is not None else None)
        except TrainerFenced:  # no crash: main says why it stops (the run's end is the newer trainer's)
            raise
        except (CheckpointMismatch, ConfigError) as exc:  # starting again cannot help: recorded, not restarted
            if run_record is not None:
                run_record.crashed(exc, trainer.step, *versions())
            print(f"error: {exc}", file=sys.stderr)
            return CONFIG_ERROR_EXIT
        except Exception as exc:
            if run_record is not None:
                run_record.crashed(exc, trainer.step, *versions())
            raise
        except TrainerStopped as exc:
            if run_record is not None:
                run_record.ended(trainer.step, f"{TRAINER_CRASHED}{exc}", *versions())
            raise
        if run_record is not None:
            run_record.ended(trainer.step, reason, *versions())
    return 0


if __name__ == "__main__":
    exit_rank(main())
