"""``python -m rollout_server.engine --model DIR --host 127.0.0.1 --port P``: serve one model over HTTP."""

from __future__ import annotations

import argparse
import logging

import torch
import uvicorn

from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.scheduler import Scheduler
from rollout_server.engine.server import create_app
from rollout_server.engine.weights import load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollout_server.engine", description=__doc__)
    p.add_argument("--model", required=True, help="HF model directory (safetensors + tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default",
                   help="version reported until the first update (SGLang's default; rollwave starts it with 0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the served weights (auto: the checkpoint's)")
    p.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together")
    p.add_argument("--max-context", type=int, default=1024, help="prompt + new tokens per request")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="padded tokens per prefill forward")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of draws for requests without sampling_seed")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, tokenizer, eos_ids = load_model(args.model, args.dtype)
    max_context = min(args.max_context, model.config.max_position_embeddings)
    engine = Scheduler(
        model,
        tokenizer,
        model_path=args.model,
        weight_version=args.weight_version,
        max_batch_size=args.max_batch_size,
        max_context=max_context,
        prefill_tokens=args.prefill_tokens,
        seed=args.seed,
    )
    spec = GenerateSpec(tokenizer, model.config.vocab_size, max_context, eos_ids)
    uvicorn.run(
        create_app(engine, spec),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    main()
