"""A decode step of the engine's padded running batch: the padding mask handed to transformers as the 4-D boolean
mask attention takes (``KVBatch.decode``), against the 2-D one it builds that mask from at every step (what the
engine passed before).

Two KV batches of the tiny model (the demo's shape), prefilled alike with ragged rows as a running batch holds
them; each round decodes ``--steps`` steps on each, one torch thread, alternating which goes first, and times
the thread's CPU. Both sides compute the same logits. Last line: ``mask2d_vs_mask4d_cpu_per_step ratio`` (CPU
per step with the 2-D mask over with the 4-D; measured, no goal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.tiny_model import build_model, build_tokenizer  # noqa: E402
from core.transformers_compat import CACHE_ARG  # noqa: E402
from rollout_server.engine.kv import KVBatch  # noqa: E402


def decode_2d(batch: KVBatch, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The step as the engine ran it before: the 2-D padding mask, from which transformers builds the 4-D one."""
    batch.mask = F.pad(batch.mask, (0, 1), value=1)
    out = model(input_ids=tokens[:, None], attention_mask=batch.mask, position_ids=batch.lengths[:, None],
                **{CACHE_ARG: batch.cache}, use_cache=True)
    batch.lengths = batch.lengths + 1
    return out.logits[:, -1, :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 29],
                        help="running requests (the e2e bench's async decode steps average ~29)")
    parser.add_argument("--min-len", type=int, default=90)
    parser.add_argument("--max-len", type=int, default=340)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="decode steps per side per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, 0)
    gen = torch.Generator().manual_seed(0)
    sides = {"mask2d": lambda b, t: decode_2d(b, model, t), "mask4d": lambda b, t: b.decode(model, t)}
    ratios = []
    for rows in args.rows:
        lengths = torch.randint(args.min_len, args.max_len + 1, (rows,), generator=gen).tolist()
        seqs = [torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() for n in lengths]
        times: dict[str, list[float]] = {side: [] for side in sides}
        with torch.inference_mode():
            batches = {side: KVBatch.prefill(model, seqs) for side in sides}
            tokens = {side: logits.argmax(-1) for side, (_, logits, _) in batches.items()}
            for r in range(args.rounds):
                for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                    batch = batches[side][0]
                    start = time.thread_time()
                    for _ in range(args.steps):
                        logits = sides[side](batch, tokens[side])
                        tokens[side] = logits.argmax(-1)
                    times[side].append((time.thread_time() - start) / args.steps)
            if not torch.equal(tokens["mask2d"], tokens["mask4d"]):
                raise SystemExit("the two masks decoded different tokens")
        median = {side: statistics.median(t) for side, t in times.items()}
        ratios.append(median["mask2d"] / median["mask4d"])
        print(f"{rows} rows of {min(lengths)}-{max(lengths)} tokens, median of {args.rounds} rounds of {args.steps} "
              f"steps: " + ", ".join(f"{side} {s * 1e3:.3f} ms" for side, s in median.items())
              + f" CPU per step, ratio {ratios[-1]:.3f}")
    print(f"mask2d_vs_mask4d_cpu_per_step ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
