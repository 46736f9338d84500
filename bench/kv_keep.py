"""Finished requests leaving the engine's running batch: the last rows moved into their places, in place, against
the batch copied whole (what the scheduler did before: the rows kept in their order, ``KVBatch.keep`` then copies
every kept row into a new buffer).

One KV batch of the tiny model (the demo's shape) per trial, prefilled with ragged rows as a running batch holds
them; each trial drops one row in the middle, one way or the other, alternating. Last line:
``keep_whole_copy_vs_in_place ratio`` (time of a whole copy over time in place; measured, no goal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.tiny_model import build_model, build_tokenizer  # noqa: E402
from rollout_server.engine.kv import KVBatch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=28, help="running requests (the e2e bench's async runs ~27)")
    parser.add_argument("--min-len", type=int, default=150)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, 0)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.rows,), generator=gen).tolist()
    seqs = [torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() for n in lengths]
    n, gone = args.rows, args.rows // 2
    orders = {
        "whole copy": [i for i in range(n) if i != gone],
        "in place": [n - 1 if i == gone else i for i in range(n - 1)],
    }
    times: dict[str, list[float]] = {side: [] for side in orders}
    with torch.inference_mode():
        for trial in range(args.trials):
            for side in (list(orders) if trial % 2 == 0 else list(reversed(orders))):
                batch, _, _ = KVBatch.prefill(model, seqs)
                start = time.perf_counter()
                batch.keep(orders[side])
                times[side].append(time.perf_counter() - start)
        width, nbytes = batch.mask.shape[1], batch.nbytes
    median = {side: statistics.median(t) for side, t in times.items()}
    print(f"{n} rows of {min(lengths)}-{max(lengths)} tokens ({width} columns kept, cache {nbytes / 2**20:.1f} MiB); "
          f"one row leaves; median of {args.trials} trials each, alternating")
    for side, seconds in median.items():
        print(f"{side:10s} {seconds * 1e3:7.3f} ms")
    print(f"keep_whole_copy_vs_in_place ratio {median['whole copy'] / median['in place']:.3f}")


if __name__ == "__main__":
    main()
