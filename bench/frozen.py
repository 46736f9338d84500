"""Trainer steps/s with one of two rollout servers frozen, against both healthy, measured side by side.

Two embedded engines, each behind its own checkpoint receiver process (``bench/checkpoint.py
--serve-receiver``), and a trainer in this process (``trainer.worker.Trainer``: FSDP2 on a 1-rank gloo group)
that pushes every step through ``CheckpointPusher`` while it trains on synthetic batches. Rounds alternate:
``--steps`` steps with both receivers healthy, then ``--steps`` steps with one receiver frozen by SIGSTOP; it
is continued afterwards and allowed to catch up (it serves the newest version) before the next healthy round.
Medians of steps/s per condition. Last line: ``frozen_vs_healthy ratio`` (frozen over healthy; 1.0 means a
frozen server costs the trainer nothing; a trainer that waited on the frozen server would be near 0).

    python bench/frozen.py [--rounds 3] [--steps 20] [--layers 0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.checkpoint import TOKEN, build_model_dir, child  # noqa: E402
from bench.trainer import make_groups  # noqa: E402
from core.config import BufferConfig, CheckpointConfig, TrainerConfig  # noqa: E402
from core.tiny_model import build_tiny_model  # noqa: E402
from proto import checkpoint_pb2 as pb  # noqa: E402
from proto import checkpoint_pb2_grpc as pb_grpc  # noqa: E402
from rollout_server.engine.process import EngineProcess  # noqa: E402
from trainer.checkpoint_pusher import CheckpointPusher  # noqa: E402
from trainer.parallel import close_distributed  # noqa: E402
from trainer.worker import Trainer  # noqa: E402


def served_version(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.CheckpointEngineStub(channel).Status(
            pb.StatusRequest(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=30).current_version


def steps_per_s(trainer: Trainer, groups: list, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train(groups)
    return steps / (time.perf_counter() - start)


def run(rounds: int, steps: int, layers: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="rollwave-bench-"))
    stage_dir = Path("/dev/shm") / work.name
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    engines, receivers = [], []
    try:
        model_dir = build_model_dir(work / "model", layers)[0] if layers else build_tiny_model(work / "model")
        for i in range(2):
            engines.append(EngineProcess(model_dir, threads=1, log_path=work / f"engine{i}.log").start(300))
            receivers.append(child(["--serve-receiver", str(model_dir), engines[i].url, str(stage_dir / str(i)),
                                    "default"], env))
        addresses = [address for _, address in receivers]
        frozen_pid = receivers[1][0].pid
        pusher = CheckpointPusher(CheckpointConfig(token=TOKEN, stage_dir=stage_dir), addresses)
        cfg = TrainerConfig(device="cpu", lr=1e-5, checkpoint_every=10**6, total_steps=10**6)
        trainer = Trainer(cfg, model_dir, work / "run", BufferConfig(push_every=1), pusher=pusher).start()
        groups = make_groups(4, 4, trainer.model.config.vocab_size)
        steps_per_s(trainer, groups, 3)  # warm-up
        healthy, frozen = [], []
        for _ in range(rounds):
            healthy.append(steps_per_s(trainer, groups, steps))
            os.kill(frozen_pid, signal.SIGSTOP)
            try:
                frozen.append(steps_per_s(trainer, groups, steps))
            finally:
                os.kill(frozen_pid, signal.SIGCONT)
            deadline = time.monotonic() + 120
            while served_version(addresses[1]) < pusher.last_pushed:
                if time.monotonic() > deadline:
                    raise RuntimeError("the frozen receiver did not catch up within 120 s of SIGCONT")
                time.sleep(0.1)
            print(f"round: healthy {healthy[-1]:.2f} steps/s, one server frozen {frozen[-1]:.2f} steps/s, "
                  f"version {pusher.last_pushed} on both after the catch-up", flush=True)
        n_params = sum(p.numel() for p in trainer.model.parameters())
        trainer.close()
        pusher.close()
        close_distributed()
    finally:
        for proc, _ in receivers:
            os.kill(proc.pid, signal.SIGCONT)
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(60)
        for engine in engines:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stage_dir, ignore_errors=True)

    med = statistics.median
    print(f"model {n_params / 1e6:.2f}M parameters, batch 4 groups x 4 samples, push every step, "
          f"{torch.get_num_threads()} torch threads")
    print(f"healthy: {med(healthy):.2f} steps/s (median of {rounds}); one of two servers frozen: "
          f"{med(frozen):.2f} steps/s")
    print(f"frozen_vs_healthy ratio {med(frozen) / med(healthy):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="healthy/frozen rounds to take the median of")
    parser.add_argument("--steps", type=int, default=20, help="trainer steps per round and condition")
    parser.add_argument("--layers", type=int, default=0,
                        help="0: the tiny model; N: bench/checkpoint.py's hidden-1024 Qwen2 with N layers")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.rounds, args.steps, args.layers)


if __name__ == "__main__":
    main()
