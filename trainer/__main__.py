"""``python -m trainer -c cfg.yaml [key=value ...] [--resume]``: one rank of the trainer pool.

Under torchrun every process is one rank (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); alone it is
a pool of one. Rank 0 reads the run's Redis buffer (``REDIS_URL`` or ``redis.url``; with neither it
starts the embedded server) and pushes each new version to the live rollout servers; all ranks train.
``--export-hf OUT`` writes the latest checkpoint (or ``--checkpoint DIR``) as an HF model and exits (a LoRA
run's as its adapter; with ``--merge-lora`` as the merged model, the adapter in ``OUT/adapter``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
from functools import partial
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from buffer.colocation import DeviceTurns
from buffer.keys import TRAINER_CRASHED, Keys
from buffer.metrics import BufferMetrics
from buffer.redis_server import connect
from buffer.registry import ServerRegistry
from buffer.replay import ReplayBuffer, TrainerFenced
from buffer.staleness import StalenessControl
from core.config import CONFIG_ERROR_EXIT, Config, load_config_or_exit, require_secret
from core.metrics import serve_metrics
from core.placement import pin
from core.process import die_with_parent, prepare_component
from core.tiny_model import ensure_model
from trainer.checkpoint import Checkpointer, CheckpointMismatch, export_hf
from trainer.checkpoint_pusher import CheckpointPusher, registered_servers
from trainer.colocation import LocalPusher
from trainer.metrics import RedisStatus
from trainer.parallel import DistContext, close_distributed, exit_rank, init_distributed, resolve_device
from trainer.worker import GroupSource, Trainer

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



def _connect(
    cfg: Config, ctx: DistContext, stack: contextlib.ExitStack, metrics: CollectorRegistry,
    buffer_metrics: BufferMetrics,
) -> tuple[GroupSource | None, CheckpointPusher | LocalPusher, RedisStatus | None, StalenessControl | None]:
    """Rank 0: the replay buffer, a pusher to the live servers (recording each push in the registry; colocated:
    a local pusher that also hands the device over), the status sink for the API and the run's staleness control
    (to publish its budget); other ranks: a pusher that only takes part in the gathers."""
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
    staleness = StalenessControl(client, keys, cfg.buffer)
    registry = ServerRegistry(client, keys)
    if colocated:
        local = LocalPusher(local_root, cfg.model.path, DeviceTurns(client, keys), registry, staleness,
                            cfg.placement.colocated_timeout_s, overlap=cfg.placement.colocated_staleness == 1)
        local.published = staleness.version()
        return buffer, local, RedisStatus(client, keys), staleness
    pusher = CheckpointPusher(cfg.checkpoint, registered_servers(registry), staleness, record=registry.record_push,
                              registry=metrics, pin_memory=ctx.device.type == "cuda", fence=buffer.check_fence)
    pusher.published = staleness.version()  # numbering continues above what this run published before
    stack.callback(pusher.close)
    return buffer, pusher, RedisStatus(client, keys), staleness


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
    connected to Redis: a model that fails to load, a checkpoint that fails to resume) or its training loop (then
    re-raised: the process fails); LocalStack and Ray restart a crashed trainer, and the restart clears that end
    once it trains again, so ``rollwave submit --wait`` waits a while for it (``client_cmd.wait_for_job``), then
    ends with the reason. A ``CheckpointMismatch`` is recorded the same way but exits ``CONFIG_ERROR_EXIT``, which no
    launcher restarts (it would only fail again). A trainer fenced by a newer one of its run (``TrainerFenced``)
    records nothing: the run's end and budget are the newer one's."""
    prepare_component()
    die_with_parent()
    args = _parser().parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides, check=partial(_start, trains=args.export_hf is None))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.export_hf is not None:
        checkpoints = Checkpointer(cfg.run.path / "checkpoints", cfg.trainer.keep_checkpoints)
        ckpt = args.checkpoint or checkpoints.latest()
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint under {cfg.run.path / 'checkpoints'}")
        print(export_hf(ckpt, cfg.model.path, args.export_hf, cfg.model.lora, merge=args.merge_lora))
        return 0
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    ctx = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    with contextlib.ExitStack() as stack:
        stack.callback(close_distributed)
        metrics = CollectorRegistry()
        buffer_metrics = BufferMetrics(metrics)  # the reads' counters (redeliveries, malformed...) and the trainer's
        source, pusher, status, staleness = _connect(cfg, ctx, stack, metrics, buffer_metrics)
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

        def ended(reason: str) -> None:
            if staleness is not None:  # admission closes with the trainer (stop_when_drained stops short of it)
                staleness.set_budget(staleness.trained())
            if status is not None:  # the published version (read at connect) for a trainer that never trained
                status.finished(trainer.step, reason, max(trainer.version, pusher.published), pusher.last_pushed)
                log.info("finished at step %d (%s)", trainer.step, reason)

        def crashed(exc: Exception) -> None:
            try:  # the crash may be Redis's: its own error must not hide the one that stopped the trainer
                ended(crash_reason(exc))
            except Exception:
                log.exception("could not record the crash in Redis")

        try:
            trainer.start(resume=args.resume, ctx=ctx, source=source)
            if staleness is not None:  # after start, which acks what a resumed checkpoint covers: nothing counted twice
                remaining = max(0, tc.total_steps - trainer.step) * cfg.buffer.groups_per_step
                staleness.set_budget(staleness.trained() + remaining)
            if ctx.is_main and tc.metrics_port is not None:
                server = serve_metrics(trainer.metrics.registry, "trainer", tc.metrics_host, tc.metrics_port)
                stack.callback(server.shutdown)
                if status is not None:
                    status.publish_metrics_address(f"{tc.metrics_host}:{server.server_port}")
            if status is not None:  # past its start-up: the API takes train jobs again and the stalled ones run on
                status.started()
            log.info("rank %d/%d training from step %d", ctx.rank, ctx.world_size, trainer.step)
            reason = trainer.run(source, published if status is not None else None)
        except TrainerFenced as exc:  # the newer trainer owns the run's end and budget: record neither
            print(f"error: {exc}", file=sys.stderr)
            return CONFIG_ERROR_EXIT
        except CheckpointMismatch as exc:  # starting again cannot help: recorded, and no launcher restarts it
            crashed(exc)
            print(f"error: {exc}", file=sys.stderr)
            return CONFIG_ERROR_EXIT
        except Exception as exc:
            crashed(exc)
            raise
        ended(reason)
    return 0


if __name__ == "__main__":
    exit_rank(main())
