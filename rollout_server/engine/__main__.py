"""``python -m rollout_server.engine --model DIR --host 127.0.0.1 --port P``: serve one model over HTTP.

``--fd N`` serves on a listening socket the parent bound (``EngineProcess``) instead of binding one.
The API key comes from the environment (``ROLLWAVE_ENGINE_API_KEY``), never the command line; without one
the engine serves loopback only. Started by a rollout server (``EngineProcess``), it leaves a Ctrl-C at the
terminal to that owner, which stops it once its own groups are drained.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from types import FrameType

import torch
import uvicorn
from safetensors import SafetensorError

from core.config import CONFIG_ERROR_EXIT, MIN_SECRET_CHARS, EngineConfig
from core.net import is_loopback, listen_socket
from core.process import die_with_parent, prepare_component
from rollout_server.engine import ENGINE_KEY_ENV
from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.scheduler import Scheduler
from rollout_server.engine.server import create_app
from rollout_server.engine.weights import load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollout_server.engine", description=__doc__)
    cfg = EngineConfig()  # run alone, the engine serves as a rollout server would start it
    p.add_argument("--model", required=True, help="HF model directory (safetensors + tokenizer)")
    p.add_argument("--host", default=cfg.host)
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (logged); a busy one is retried")
    p.add_argument("--fd", type=int, help="an inherited listening socket to serve on (then --host/--port are unused)")
    p.add_argument("--weight-version", default="default",
                   help="version reported until the first update (SGLang's default; rollwave starts it with 0)")
    p.add_argument("--dtype", default=cfg.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the served weights (auto: the checkpoint's)")
    p.add_argument("--max-batch-size", type=int, default=cfg.max_batch_size, help="requests decoded together")
    p.add_argument("--max-context", type=int, default=cfg.max_context, help="prompt + new tokens per request")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="padded tokens per prefill forward")
    p.add_argument("--prefix-cache-tokens", type=int, default=cfg.prefix_cache_tokens,
                   help="tokens of finished requests' KV kept for requests that extend them (0: off)")
    p.add_argument("--admit-wait-ms", type=float, default=cfg.admit_wait_ms,
                   help="while requests decode, how long a new one may wait to be prefilled with later ones")
    p.add_argument("--threads", type=int, default=cfg.threads, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of draws for requests without sampling_seed")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


class OwnedServer(uvicorn.Server):
    """The server of an engine that its rollout server started. A Ctrl-C at the terminal (SIGINT to the whole
    foreground process group) is the owner's to handle: it drains its groups, which need the engine, then stops
    the engine (SIGTERM). Stopping at the SIGINT would fail the turns in flight."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    prepare_component()
    owned = die_with_parent()
    if owned:  # until the server runs (loading the model), as OwnedServer then
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = parse_args(argv)
    api_key = os.environ.get(ENGINE_KEY_ENV, "").strip() or None  # as the config strips it for the rollout servers
    if api_key is not None and len(api_key) < MIN_SECRET_CHARS:
        print(f"error: {ENGINE_KEY_ENV}: must be at least {MIN_SECRET_CHARS} characters", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    if api_key is None and not is_loopback(args.host):
        print(f"error: --host {args.host} is not loopback: set {ENGINE_KEY_ENV} so callers need the key",
              file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT)
    logging.basicConfig(level=args.log_level.upper())
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer, eos_ids = load_model(args.model, args.dtype)
    except (OSError, ValueError, SafetensorError) as exc:  # the model's files: starting again cannot help
        print(f"error: --model {args.model}: {exc}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    max_context = min(args.max_context, model.config.max_position_embeddings)
    engine = Scheduler(
        model,
        tokenizer,
        model_path=args.model,
        weight_version=args.weight_version,
        max_batch_size=args.max_batch_size,
        max_context=max_context,
        prefill_tokens=args.prefill_tokens,
        prefix_cache_tokens=args.prefix_cache_tokens,
        admit_wait_s=args.admit_wait_ms / 1000,
        seed=args.seed,
    )
    spec = GenerateSpec(tokenizer, model.config.vocab_size, max_context, eos_ids)
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
    else:
        sock = listen_socket(args.host, args.port, "engine")
        logging.getLogger("rollout_server.engine").warning("serving on %s:%d", args.host, sock.getsockname()[1])
    app = create_app(engine, spec, api_key)
    config = uvicorn.Config(app, http=app.state.http_protocol, log_level=args.log_level, access_log=False,
                            server_header=False, timeout_graceful_shutdown=10)
    (OwnedServer if owned else uvicorn.Server)(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
