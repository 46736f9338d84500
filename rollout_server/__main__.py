"""``python -m rollout_server -c cfg.yaml [key=value ...]``: one rollout server.

Connects to Redis (``REDIS_URL`` / ``redis.url``, else an embedded redis-server), uses the engines in
``engine.urls`` or starts the embedded engine as a child process, and runs the worker until SIGTERM
or SIGINT, then shuts down gracefully (see ``rollout_server.worker``).

Every engine call carries ``engine.api_key``; an embedded engine started here without one gets a key made
for it, so no other process on the host can drive it. Engines stay off the network: their metrics are
served, with the key, on this server's metrics port under ``/engine/<i>/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import uvloop

from buffer.colocation import DeviceTurns
from buffer.keys import Keys
from buffer.redis_server import configured_url, connect
from core.config import (
    SECRETS,
    Config,
    ConfigError,
    EngineConfig,
    LoraConfig,
    RolloutConfig,
    load_config_or_exit,
    require_secret,
)
from core.metrics import serve_metrics
from core.model_dir import ensure_model
from core.net import is_loopback, listen_socket
from core.placement import check_cpus, pin
from core.process import die_with_parent, forget_environment, prepare_component
from core.rewards import load_reward_fn
from rollout_server.agent_loop import parse_version
from rollout_server.agent_runner import check_entrypoints
from rollout_server.checkpoint_receiver import CheckpointMetrics, ReceiverThread
from rollout_server.colocation import EngineTurns
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient, EngineError, EngineGroup
from rollout_server.metrics import RolloutMetrics
from rollout_server.tools import ToolConfigError, ToolRegistry
from rollout_server.worker import RolloutWorker

log = logging.getLogger("rollout_server")

ENGINE_METRICS_TIMEOUT_S = 10.0
HIDDEN_FROM_AGENTS = (*SECRETS.values(), "REDIS_URL")  # this server's secrets and Redis's address
REFUSAL_KEYS = {401: "engine.api_key", 403: "engine.api_key", 404: "engine.urls"}  # the key an engine's refusal names


def check_engines(cfg: EngineConfig) -> None:
    """Engines to use, not start, are named: ``engine.backend=sglang`` needs ``engine.urls``. An engine reached over
    the network must want a key: refuse ``engine.urls`` off loopback without one."""
    if cfg.backend != "embedded" and not cfg.urls:
        raise ConfigError(f"engine.urls: engine.backend={cfg.backend} needs the URLs of running servers")
    remote = [url for url in cfg.urls if not is_loopback(urlsplit(url).hostname or "")]
    if remote and cfg.api_key is None:
        raise ConfigError(f"engine.urls: {', '.join(remote)} is not loopback: set engine.api_key "
                          "(env ROLLWAVE_ENGINE_API_KEY) and start the engine with it")


async def engine_urls(cfg: EngineConfig, model: Path, stack: AsyncExitStack) -> tuple[list[str], str | None]:
    """``engine.urls`` and ``engine.api_key``, or the URL and key of an embedded engine started here
    (stopped with ``stack``)."""
    key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
    if cfg.urls:
        return cfg.urls, key
    engine = EngineProcess.from_config(model, cfg, key or secrets.token_urlsafe(32)).launch()  # on the loop's thread
    stack.callback(engine.close)
    await asyncio.to_thread(engine.wait_ready, cfg.ready_timeout_s)
    return [engine.url], engine.api_key


def engine_metrics(http: httpx.Client, url: str) -> Callable[[], tuple[str, bytes]]:
    """Fetches an engine's ``/metrics`` for the metrics server to pass on, through ``http``, the server's one
    client (with the engine's key): a client made per scrape builds a TLS context each time, ~10 ms of CPU taken
    from the engine's core."""

    def fetch() -> tuple[str, bytes]:
        target = url.rstrip("/") + "/metrics"
        try:
            reply = http.get(target)
            reply.raise_for_status()
        except httpx.HTTPError as exc:  # a timeout's own text is only "timed out": name the engine
            raise RuntimeError(f"engine metrics from {target}: {type(exc).__name__}: {exc}") from exc
        return reply.headers.get("content-type", "text/plain"), reply.content

    return fetch


async def serve(cfg: Config, tools: ToolRegistry) -> None:
    async with AsyncExitStack() as stack:
        client, redis_server = connect(cfg.redis, cfg.run.path)
        stack.callback(client.close)
        if redis_server is not None:
            stack.callback(redis_server.stop)
        model = await asyncio.to_thread(ensure_model, cfg.model)
        urls, key = await engine_urls(cfg.engine, model, stack)
        engines = [EngineClient(url, timeout_s=cfg.engine.request_timeout_s, api_key=key) for url in urls]
        for engine in engines:
            stack.push_async_callback(engine.aclose)
            try:
                await engine.wait_ready(cfg.engine.ready_timeout_s)
            except EngineError as exc:
                raise ConfigError(f"{REFUSAL_KEYS.get(exc.status or 0, 'engine.ready_timeout_s')}: {exc}") from None
            try:
                parse_version(await engine.weight_version())
            except EngineError as exc:  # SGLang answers /health without the key: a wrong one shows here
                raise ConfigError(f"{REFUSAL_KEYS.get(exc.status or 0, 'engine.urls')}: {engine.base_url}: {exc}"
                                  ) from None
            except ValueError as exc:
                raise ConfigError(f"engine.urls: {engine.base_url}: {exc}") from None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        metrics = RolloutMetrics()
        worker = RolloutWorker(client, cfg.run.name, cfg.rollout, cfg.buffer, engines,
                                tokenizer, tools, metrics, agent_cpus=cfg.placement.agent_cpus)
        turns = None
        if cfg.placement.mode == "colocated":  # weights come as local pushes: no receiver
            if not cfg.engine.urls:  # started here, it holds all its memory: a record an earlier engine at its URL
                # left (a fixed engine.port, a server that died released) would have it taken for released
                await asyncio.to_thread(DeviceTurns(client, Keys(cfg.run.name)).record_engines, urls, [])
            turns = EngineTurns(DeviceTurns(client, Keys(cfg.run.name)), EngineGroup(engines), worker.consumer,
                                lambda: worker.info.version, partial(setattr, worker.info, "version"),
                                asyncio.to_thread, metrics, cfg.placement.colocated_timeout_s,
                                swap_pause=cfg.checkpoint.swap_pause)
        else:
            receiver = ReceiverThread(
                cfg.checkpoint, model, urls, worker.consumer, cfg.rollout.grpc_host, cfg.rollout.grpc_port,
                CheckpointMetrics(metrics.registry), cfg.engine.request_timeout_s, engine_api_key=key,
                adapter_name=cfg.model.lora.name if cfg.model.lora else LoraConfig().name,
                on_adapter=partial(name_adapter, engines), on_commit=partial(setattr, worker.info, "version"),
                stage_port=cfg.rollout.stage_port,
            )
            worker.info.grpc_address = await asyncio.to_thread(receiver.start)
            stack.callback(receiver.stop)
        worker.info.openai_url = await stack.enter_async_context(
            worker.episodes.serving(cfg.rollout.openai_host, cfg.rollout.openai_port)
        )
        rc = cfg.rollout
        if rc.metrics_port is not None:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            http = stack.enter_context(httpx.Client(headers=headers, timeout=ENGINE_METRICS_TIMEOUT_S))
            proxies = {f"/engine/{i}/metrics": engine_metrics(http, url) for i, url in enumerate(urls)}
            server = await asyncio.to_thread(serve_metrics, metrics.registry, "rollout", rc.metrics_host,
                                             rc.metrics_port, proxies)
            stack.callback(server.shutdown)
            worker.info.metrics_address = f"{rc.metrics_host}:{server.server_port}"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        if turns is None:
            await worker.run()
        else:
            hand_over = asyncio.create_task(turns.run(), name="device turns")
            hand_over.add_done_callback(lambda task: task.cancelled() or worker.stop())
            try:
                await worker.run()
            finally:
                hand_over.cancel()
                await asyncio.gather(hand_over, return_exceptions=True)
            if not hand_over.cancelled() and hand_over.exception() is not None:
                raise hand_over.exception()
        if worker.engine_down is not None:
            raise EngineDown(worker.engine_down)


class EngineDown(RuntimeError):
    """An engine of this server stopped answering (``RolloutWorker.engine_down``): the server exits 1."""


def name_adapter(engines: list[EngineClient], name: str | None) -> None:
    """From the commit that loaded an adapter on, every request names it (None: full weights, the base)."""
    for engine in engines:
        engine.lora_path = name


def _start(cfg: Config) -> ToolRegistry:
    """What a rollout server needs before it starts: the checkpoint token, usable engines, addresses to listen on, its
    CPUs (which the embedded engine it starts inherits, with one torch thread per CPU unless ``engine.threads`` says)
    and its agents' (checked while it may still use them all), the code its config names and its tools, so a typo
    stops it here, as a config its launcher hears refused, rather than failing every task later."""
    if cfg.placement.mode == "decoupled":
        require_secret(cfg, "checkpoint.token")
    check_engines(cfg.engine)
    check_hosts(cfg)
    check_cpus(cfg.placement.agent_cpus, "placement.agent_cpus")  # the agents pin themselves: checked before this
    cfg.engine.threads = pin(cfg.placement.rollout_cpus, "placement.rollout_cpus", cfg.engine.threads)
    check_code(cfg.rollout)
    return load_tools(cfg.rollout)


def check_hosts(cfg: Config) -> None:
    """Each address this server (and the embedded engine it starts) listens on is one of this host's: a typo stopped
    it only once it bound, with a traceback, and its supervisor started it again, to fail again."""
    hosts = {"rollout.openai_host": cfg.rollout.openai_host}
    if cfg.rollout.metrics_port is not None:
        hosts["rollout.metrics_host"] = cfg.rollout.metrics_host
    if cfg.placement.mode == "decoupled":  # the checkpoint receiver
        hosts["rollout.grpc_host"] = cfg.rollout.grpc_host
    if not cfg.engine.urls:
        hosts["engine.host"] = cfg.engine.host
    for key, host in hosts.items():
        try:
            listen_socket(host, 0, key).close()  # as the servers bind it, on any free port
        except OSError as exc:
            raise ConfigError(f"{key}: cannot listen on {host!r}: {exc.strerror or exc} (give an address of this "
                              "host: 127.0.0.1, or 0.0.0.0 for all of them)") from None


def load_tools(cfg: RolloutConfig) -> ToolRegistry:
    """The tools ``rollout.tools`` names, built once (the python tool probes its sandbox): a bad file stops the
    server here rather than failing every task later."""
    try:
        return ToolRegistry.from_file(cfg.tools)
    except ToolConfigError as exc:
        raise ConfigError(f"rollout.tools: {exc}") from None


def check_code(cfg: RolloutConfig) -> None:
    """Every reward function of ``rollout.reward_allowlist`` imports (the worker imports them here too), and every
    ``rollout.agent_allowlist`` entry is a function an agent's process can call (checked in a process of its own,
    without this server's secrets: agents are imported only outside it)."""
    for name in cfg.reward_allowlist:
        try:
            load_reward_fn(name, cfg.reward_allowlist)
        except ValueError as exc:
            raise ConfigError(f"rollout.reward_allowlist.{name}: {exc}") from None
    if not cfg.agent_allowlist:
        return
    env = {name: value for name, value in os.environ.items() if name not in HIDDEN_FROM_AGENTS}
    try:
        refused = check_entrypoints(cfg.agent_allowlist, cfg.agent_timeout_s, env)
    except ValueError as exc:
        raise ConfigError(f"rollout.agent_allowlist: {exc}") from None
    if refused:
        raise ConfigError("rollout.agent_allowlist: " + "; ".join(f"{entry}: {why}" for entry, why in refused.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_server", description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    prepare_component()
    die_with_parent()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("httpx", "httpx2"):  # an INFO line per request otherwise (metrics proxy, the agents' openai client)
        logging.getLogger(name).setLevel(logging.WARNING)
    started: list[ToolRegistry] = []  # the start check builds the tools: a bad tool config is a config refused
    cfg = load_config_or_exit(args.config, args.overrides, check=lambda cfg: started.append(_start(cfg)))
    try:
        cfg.redis.url = configured_url(cfg.redis)  # read now: the agents run by this server must not inherit
        forget_environment(HIDDEN_FROM_AGENTS)  # its secrets or Redis's address
        uvloop.run(serve(cfg, started[0]))  # an engine round trip costs half the client CPU (bench/http_loop.py)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineDown as exc:  # its supervisor restarts it, and with it an embedded engine
        print(f"error: {exc}: this server stopped, its tasks handed back", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
