"""The trainer's offload between steps in colocated placement (``trainer.offload``), on a CUDA device.

Sides: ``none`` (the trainer keeps its parameters and optimizer state on the device), ``cpu`` (they move to host
memory and back) and ``memory_saver`` (a torch-memory-saver region, paused and resumed). Each run of a side is a
process of its own (a fresh allocator, so no side inherits another's cache), a colocated trainer with a local push
and no engines, trained on the same batches; the sides alternate their order from round to round. Per side:
the device memory the process holds between steps above what it held before the trainer existed
(``cudaMemGetInfo``: what an engine sharing the device finds), the bytes of parameters and optimizer state,
seconds to offload, to onload, and of the step itself; the first step of each run warms up and is left out.

    python bench/offload.py [--layers 24] [--rounds 2] [--steps 4]

Each run starts a process (torch, NCCL, the model): budget about 15 s a run on an H200 host, 90 s at the least.

Last line: the device memory ``memory_saver`` keeps between steps as a fraction of ``none``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIDES = ("none", "cpu", "memory_saver")


def child(side: str, model_dir: Path, steps: int, groups: int, work: Path) -> dict:
    """One run of ``side``: its figures per step after the first."""
    import torch

    from core.config import BufferConfig, TrainerConfig
    from trainer.colocation import LocalPusher
    from trainer.parallel import close_distributed, init_distributed
    from trainer.worker import Trainer

    spec = importlib.util.spec_from_file_location("bench_trainer", ROOT / "bench" / "trainer.py")
    bench_trainer = importlib.util.module_from_spec(spec)  # not `trainer`: that name is the package
    spec.loader.exec_module(bench_trainer)

    ctx = init_distributed("cuda")
    free, total = torch.cuda.mem_get_info()
    before = total - free
    share = LocalPusher(work / "push", model_dir)
    trainer = Trainer(TrainerConfig(total_steps=steps + 1, checkpoint_every=10**6, device="cuda", offload=side,
                                    micro_batch_tokens=16384), model_dir, work / "run",
                      BufferConfig(groups_per_step=groups, push_every=10**6), pusher=share,
                      device_share=share).start(ctx=ctx)
    batch = bench_trainer.make_groups(groups, 8, trainer.model.config.vocab_size)
    rows = []
    for _ in range(steps):
        record = trainer.train(batch)
        free, total = torch.cuda.mem_get_info()
        rows.append({"kept": total - free - before, "held": record["held_bytes"], "offload_s": record["offload_s"],
                     "onload_s": record["onload_s"], "step_s": record["step_time_s"]})
    trainer.close()
    close_distributed()
    return {key: [row[key] for row in rows[1:]] for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers of a hidden-1024 Qwen2 (24: ~280M)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per run, the first a warm-up")
    parser.add_argument("--groups", type=int, default=8, help="groups of 8 per step")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as work:
            print(json.dumps(child(args.child, args.model, args.steps, args.groups, Path(work))))
        return

    from checkpoint import build_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, n_params = build_model_dir(Path(tmp) / "model", args.layers)
        runs: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
        for round_ in range(args.rounds):
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                run = subprocess.run([sys.executable, __file__, "--child", side, "--model", str(model_dir),
                                      "--steps", str(args.steps), "--groups", str(args.groups)],
                                     capture_output=True, text=True, timeout=600)
                if run.returncode:
                    sys.exit(f"the {side} run failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
                line = run.stdout.strip().splitlines()[-1]
                print(f"round {round_} {side}: {line}", flush=True)  # what a cut-off run still shows
                for key, values in json.loads(line).items():
                    runs[side].setdefault(key, []).extend(values)
    median = {side: {key: statistics.median(v) for key, v in figures.items()} for side, figures in runs.items()}
    print(f"{n_params:,} parameters, {args.groups} groups of 8 per step, {args.rounds} rounds of "
          f"{args.steps - 1} timed steps per side")
    for side, m in median.items():
        print(f"{side:>13}: held {m['held'] / 2**30:.2f} GiB, kept between steps {m['kept'] / 2**30:.3f} GiB, "
              f"offload {m['offload_s'] * 1e3:.0f} ms, onload {m['onload_s'] * 1e3:.0f} ms, "
              f"step {m['step_s'] * 1e3:.0f} ms")
    for side in ("cpu", "memory_saver"):
        m = median[side]
        print(f"{side}_offload_and_onload_vs_step ratio {(m['offload_s'] + m['onload_s']) / m['step_s']:.3f}")
    print(f"cpu_kept_vs_none ratio {median['cpu']['kept'] / median['none']['kept']:.4f}")
    print(f"memory_saver_kept_vs_none ratio {median['memory_saver']['kept'] / median['none']['kept']:.4f}")


if __name__ == "__main__":
    main()
