"""Prefilling requests that share a prefix: computed once for all of them against once per request.

After a ``recompute`` swap (``checkpoint.kv_on_swap``, the default) the engine prefills every retracted request
again, and the prefix cache, flushed by the load, holds none of them: a group's samples share their prompt, and
every episode the system prompt and tool schema. The embedded engine computes such a shared prefix once for the
requests prefilled together (``prefix_cache.shared_prefixes``). Here 32 requests, as a swap retracts them: 4
prompts of 180 tokens (the first 120 common to all), 8 samples each with 1-39 tokens of their own so far, are
admitted together and each samples one token; ``--layers`` sizes the model (9: ~102M parameters, as
``bench/checkpoint.py``; the demo's tiny model has too little compute per token for this to show). The two
sides alternate (A, B, B, A, ...) on one engine; each prints its median.
Last line: ``per_request_vs_shared ratio <median per-request time / median shared time>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# bench/buffer.py sits beside this file: put the repository first so `import buffer` finds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint import build_model_dir  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rollout_server.engine.request import Request  # noqa: E402
from rollout_server.engine.sampling import SamplingParams  # noqa: E402
from rollout_server.engine.scheduler import SHARED_PREFIX_MIN_SAVED, Scheduler  # noqa: E402

WAIT_S = 600.0


def retracted(gen: torch.Generator, vocab: int, system: list[int], groups: int, samples: int) -> list[Request]:
    """A swap's retracted requests: ``groups`` prompts after ``system``, ``samples`` continuations of each."""
    reqs = []
    for g in range(groups):
        prompt = system + torch.randint(5, vocab - 1, (60,), generator=gen).tolist()
        for s in range(samples):
            own = torch.randint(5, vocab - 1, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
            params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
            reqs.append(Request(rid=f"{g}-{s}-{time.monotonic_ns()}", input_ids=prompt + own.tolist(), params=params,
                                return_logprob=False, stop_ids=frozenset(), stop_window=1))
    return reqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9, help="9: ~102M parameters")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = build_model_dir(Path(tmp) / "model", args.layers)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        system = torch.randint(5, vocab - 1, (120,), generator=gen).tolist()
        engine = Scheduler(model, AutoTokenizer.from_pretrained(model_dir), model_path=str(model_dir),
                           prefix_cache_tokens=0)  # nothing cached: only what the chunk shares
        engine.start()
        times: dict[str, list[float]] = {"shared": [], "per_request": []}
        try:
            for i in range(args.rounds):
                for side in ("shared", "per_request") if i % 2 == 0 else ("per_request", "shared"):
                    engine.shared_prefix_min_saved = SHARED_PREFIX_MIN_SAVED if side == "shared" else 10**9
                    reqs = retracted(gen, vocab, system, groups=4, samples=8)
                    engine.call(lambda: engine.pause("retract")).result(timeout=WAIT_S)
                    engine.submit(reqs)  # admitted together at continue, as after a swap
                    start = time.perf_counter()
                    engine.call(engine.resume).result(timeout=WAIT_S)
                    for r in reqs:
                        r.future.result(timeout=WAIT_S)
                    times[side].append(time.perf_counter() - start)
                    print(f"round {i} {side}: {times[side][-1] * 1e3:.0f} ms", flush=True)
            shared_tokens = engine.metrics.shared_tokens._value.get()
        finally:
            engine.close()
    median = {side: statistics.median(t) for side, t in times.items()}
    print(f"{params / 1e6:.1f}M parameters, {args.threads} torch thread(s); 32 requests (4 prompts of 180 tokens, 120 "
          f"common to all; 8 samples each with 1-39 own tokens), one token each; {shared_tokens:.0f} prompt tokens "
          f"shared in {args.rounds} shared rounds")
    for side, t in median.items():
        print(f"{side:12s} median {t * 1e3:8.0f} ms")
    print(f"per_request_vs_shared ratio {median['per_request'] / median['shared']:.2f}")


if __name__ == "__main__":
    main()
