"""``python -m rollout_server -c cfg.yaml [key=value ...]``: one rollout server.

Connects to Redis (``REDIS_URL`` / ``redis.url``, else an embedded redis-server), uses the engines in
``engine.urls`` or starts the embedded engine as a child process, and runs the worker until SIGTERM
or SIGINT, then shuts down gracefully (see ``rollout_server.worker``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from contextlib import AsyncExitStack
from pathlib import Path

from buffer.redis_server import connect
from core.config import Config, ConfigError, EngineConfig, load_config_or_exit
from core.metrics import serve_metrics
from core.tiny_model import ensure_model
from rollout_server.agent_loop import parse_version
from rollout_server.checkpoint_receiver import CheckpointMetrics, ReceiverThread
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient, EngineError
from rollout_server.metrics import RolloutMetrics
from rollout_server.tools import ToolRegistry
from rollout_server.worker import RolloutWorker

log = logging.getLogger("rollout_server")



async def engine_urls(cfg: EngineConfig, model: Path, stack: AsyncExitStack) -> list[str]:
    """``engine.urls``, or the URL of an embedded engine started here (stopped with ``stack``)."""
    if cfg.urls:
        return cfg.urls
    if cfg.backend != "embedded":
        raise ConfigError(f"engine.urls: engine.backend={cfg.backend} needs the URLs of running servers")
    engine = EngineProcess(model, host=cfg.host, port=cfg.port, max_batch_size=cfg.max_batch_size,
                           max_context=cfg.max_context, threads=cfg.threads, dtype=cfg.dtype)
    await asyncio.to_thread(engine.start, cfg.ready_timeout_s)
    stack.callback(engine.close)
    return [engine.url]


async def serve(cfg: Config) -> None:
    async with AsyncExitStack() as stack:
        client, redis_server = connect(cfg.redis, cfg.run.path)
        stack.callback(client.close)
        if redis_server is not None:
            stack.callback(redis_server.stop)
        model = await asyncio.to_thread(ensure_model, cfg.model)
        urls = await engine_urls(cfg.engine, model, stack)
        engines = [EngineClient(url, timeout_s=cfg.engine.request_timeout_s) for url in urls]
        for engine in engines:
            stack.push_async_callback(engine.aclose)
            try:
                await engine.wait_ready(cfg.engine.ready_timeout_s)
                parse_version(await engine.weight_version())
            except EngineError as exc:
                raise ConfigError(f"engine.ready_timeout_s: {exc}") from None
            except ValueError as exc:
                raise ConfigError(f"engine.urls: {engine.base_url}: {exc}") from None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        metrics = RolloutMetrics()
        worker = RolloutWorker(client, cfg.run.name, cfg.rollout, cfg.buffer, engines,
                                tokenizer, ToolRegistry.from_file(cfg.rollout.tools), metrics)
        receiver = ReceiverThread(
            cfg.checkpoint, model, urls, worker.consumer, cfg.rollout.grpc_host, cfg.rollout.grpc_port,
            CheckpointMetrics(metrics.registry), cfg.engine.request_timeout_s,
        )
        worker.info.grpc_address = await asyncio.to_thread(receiver.start)
        stack.callback(receiver.stop)
        if cfg.rollout.metrics_port:
            server = serve_metrics(metrics.registry, host=cfg.rollout.metrics_host, port=cfg.rollout.metrics_port)
            stack.callback(server.shutdown)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_server", description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = load_config_or_exit(args.config, args.overrides)
    try:
        asyncio.run(serve(cfg))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
