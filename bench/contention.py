"""What a trainer on the other CPU costs the engine's decoding, in one run: the CPU analogue of two jobs sharing
a memory bus.

The tiny model decodes a batch on the first usable CPU (one torch thread, a DynamicCache, greedy) while the last
CPU either idles or runs a training loop of the same model (forward, backward, AdamW; one thread). The two
sides alternate ``--rounds`` times (alone, beside, beside, alone, ...); each figure is its median. Async RL
runs generation and training at once, sync never does, so this slowdown is part of what separates their
generation speed in ``bench/e2e.py``. Last line: ``decode_beside_training_vs_alone ratio <median tok/s beside /
alone>``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# bench/buffer.py sits beside this file: put the repository first so `import buffer` finds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.tiny_model import build_tiny_model  # noqa: E402
from core.transformers_compat import CACHE_ARG  # noqa: E402


def train(model_dir: Path, cpu: int, started, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(5, 200, (8, 256), generator=torch.Generator().manual_seed(1))
    while not stop.is_set():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        started.set()


def decode_rate(model: torch.nn.Module, batch: int, prompt: int, steps: int) -> float:
    """Tokens per second of a greedy batched decode after one prefill."""
    ids = torch.randint(5, 200, (batch, prompt), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=token, use_cache=True, **{CACHE_ARG: out[CACHE_ARG]})
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="measurements of each side, alternating")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--prompt", type=int, default=150)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two usable CPUs")
    os.sched_setaffinity(0, {cpus[0]})
    torch.set_num_threads(1)
    rates: dict[str, list[float]] = {"alone": [], "beside": []}
    with tempfile.TemporaryDirectory(prefix="rollwave-contention-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        decode_rate(model, args.batch, args.prompt, 5)  # warm up
        ctx = mp.get_context("spawn")
        for i in range(args.rounds):
            for side in ("alone", "beside") if i % 2 == 0 else ("beside", "alone"):
                trainer = None
                if side == "beside":
                    started, stop = ctx.Event(), ctx.Event()
                    trainer = ctx.Process(target=train, args=(model_dir, cpus[-1], started, stop))
                    trainer.start()
                    if not started.wait(120):
                        raise SystemExit("the training loop did not start in 120 s")
                rates[side].append(decode_rate(model, args.batch, args.prompt, args.steps))
                if trainer is not None:
                    stop.set()
                    trainer.join(30)
                print(f"{side:>6} #{len(rates[side])}: {rates[side][-1]:.0f} tokens/s", flush=True)
    alone, beside = (statistics.median(rates[k]) for k in ("alone", "beside"))
    print(f"median: alone {alone:.0f} tokens/s, beside training {beside:.0f} tokens/s")
    print(f"decode_beside_training_vs_alone ratio {beside / alone:.3f}")


if __name__ == "__main__":
    main()
