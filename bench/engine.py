"""Embedded engine vs a bare batched decode loop, same tiny model, same machine, same run.

The engine serves N concurrent ``/generate`` requests over HTTP (temperature 1, ``ignore_eos`` so each
runs to ``max_new_tokens``); the bare loop decodes the same N x T tokens in one batch with a
DynamicCache, computing the same logprobs. Both use the same torch thread count; the two alternate
``--repeats`` times (the engine idles while the loop runs) and each figure is its best run.
Last line: ``engine_vs_bare_loop ratio <engine tok/s / bare tok/s>`` (goal >= 0.7).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.tiny_model import build_tiny_model  # noqa: E402
from core.transformers_compat import CACHE_ARG  # noqa: E402
from rollout_server.engine.process import EngineProcess  # noqa: E402
from rollout_server.engine.weights import load_model  # noqa: E402
from rollout_server.engine_client import EngineClient  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


async def engine_tokens_per_s(url: str, batch: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    async with EngineClient(url) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.generate(p, params) for p in batch))
        elapsed = time.perf_counter() - start
    tokens = sum(r["meta_info"]["completion_tokens"] for r in replies)
    assert tokens == len(batch) * new_tokens, f"expected every request to run to length, got {tokens} tokens"
    return tokens / elapsed


@torch.inference_mode()
def bare_tokens_per_s(model: torch.nn.Module, batch: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch)
    start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_ARG: cache}).logits[:, -1]
    for step in range(new_tokens):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token = torch.multinomial(logprobs.exp(), 1)
        logprobs.gather(1, token)
        if step + 1 < new_tokens:
            logits = model(input_ids=token, use_cache=True, **{CACHE_ARG: cache}).logits[:, -1]
    return ids.shape[0] * new_tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads, for the engine and the bare loop")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        model, _, _ = load_model(model_dir)
        batch = prompts(args.requests, args.prompt_len, model.config.vocab_size)
        bare_tokens_per_s(model, batch, 8)  # warm-up
        engine_runs, bare_runs = [], []
        with EngineProcess(model_dir, max_batch_size=args.requests, threads=args.threads) as engine:
            asyncio.run(engine_tokens_per_s(engine.url, batch, 8))  # warm-up
            for _ in range(args.repeats):  # interleaved, so both see the same load on a shared machine
                engine_runs.append(asyncio.run(engine_tokens_per_s(engine.url, batch, args.new_tokens)))
                bare_runs.append(bare_tokens_per_s(model, batch, args.new_tokens))
        engine_tps, bare_tps = max(engine_runs), max(bare_runs)
    print(f"runs (tok/s): engine {[round(r) for r in engine_runs]}, bare loop {[round(r) for r in bare_runs]}")
    print(f"requests {args.requests} x {args.new_tokens} new tokens, prompt {args.prompt_len}, threads {args.threads}")
    print(f"engine over HTTP     {engine_tps:9.0f} tok/s")
    print(f"bare batched loop    {bare_tps:9.0f} tok/s")
    print(f"engine_vs_bare_loop ratio {engine_tps / bare_tps:.3f}")


if __name__ == "__main__":
    main()
