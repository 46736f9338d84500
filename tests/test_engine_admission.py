"""``engine.admit_wait_ms``: while requests decode, a newcomer waits for company before its prefill (each prefill
forward holds every running request up), unless the waiting ones would fill the batch or nothing runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import greedy_request
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import EngineConfig, load_config
from rollout_server.__main__ import engine_urls
from rollout_server.engine.__main__ import parse_args
from rollout_server.engine.request import Request
from rollout_server.engine.scheduler import Scheduler
from rollout_server.engine_client import EngineClient

WAIT_S = 60.0


@pytest.fixture
def make(tiny_model_dir: Path) -> Iterator[Callable[[float], Scheduler]]:
    started: list[Scheduler] = []

    def start(admit_wait_s: float) -> Scheduler:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        started.append(Scheduler(model, AutoTokenizer.from_pretrained(tiny_model_dir), model_path=str(tiny_model_dir),
                                 max_batch_size=3, admit_wait_s=admit_wait_s))
        started[-1].start()
        return started[-1]

    yield start
    for engine in started:
        engine.close()


def decoding(engine: Scheduler, rid: str, n: int = 900) -> Request:
    request = greedy_request(rid, [5 + len(rid), 6, 7, 8], n)
    engine.submit([request])
    return request


def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_newcomer_waits_for_company_while_requests_decode(make: Callable[[float], Scheduler]) -> None:
    engine = make(30.0)  # far longer than the test: only company or an idle engine admits
    first = decoding(engine, "first")
    until(lambda: len(first.output_ids) >= 3, "a lone request is admitted at once")
    second = decoding(engine, "second")
    seen = len(first.output_ids)
    until(lambda: len(first.output_ids) >= seen + 20, "the first request goes on decoding")
    assert not second.output_ids  # still waiting: one newcomer would not fill the batch of 3
    third = decoding(engine, "third")  # two waiting fill the two free places: both are admitted now
    until(lambda: bool(second.output_ids and third.output_ids), "the waiting requests that fill the batch start")


def test_without_a_wait_a_newcomer_is_admitted_at_the_next_step(make: Callable[[float], Scheduler]) -> None:
    engine = make(0.0)
    first = decoding(engine, "first")
    until(lambda: len(first.output_ids) >= 3, "a lone request is admitted at once")
    second = decoding(engine, "second")
    until(lambda: bool(second.output_ids), "the newcomer starts while the first decodes")
    assert first.finish_reason is None  # it joined the running batch


def test_the_config_key_reaches_the_embedded_engine(tiny_model_dir: Path) -> None:
    """``engine.admit_wait_ms=10000``, through the rollout server's engine start: a newcomer that arrives while a long
    request decodes alone is still waiting 0.3 s later, three times the default wait (100 ms), after which the
    default would have admitted it; it starts as soon as the long one is aborted (nothing left to wait with). (This
    test once waited 50 decoded tokens, about 70 ms: less than the default's wait, so an engine that kept its own
    default passed it.)"""
    window_s = 3 * EngineConfig().admit_wait_ms / 1000

    async def run() -> None:
        cfg = load_config(None, ["engine.admit_wait_ms=10000", "engine.max_batch_size=3"], env={})
        async with AsyncExitStack() as stack:
            [url], key = await engine_urls(cfg.engine, tiny_model_dir, stack)
            client = await stack.enter_async_context(EngineClient(url, api_key=key))
            http = await stack.enter_async_context(httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}))
            # the whole context (about 1.4 s of decoding here), so it still runs when the window ends
            long = asyncio.create_task(client.generate([5, 6, 7, 8], {"temperature": 0.0, "max_new_tokens": 1000,
                                                                      "ignore_eos": True}, rid="long"))
            deadline = time.monotonic() + WAIT_S
            while "rollwave_engine_generated_tokens_total 0.0" in (await http.get(url + "/metrics")).text:
                assert time.monotonic() < deadline, "the long request never started"
                await asyncio.sleep(0.01)
            short = asyncio.create_task(client.generate([9, 10, 11], {"temperature": 0.0, "max_new_tokens": 2}))
            submitted = time.monotonic()
            while time.monotonic() - submitted < window_s and not short.done():
                await asyncio.sleep(0.01)
            assert not long.done(), "the long request ended within the window: nothing ran for the newcomer to wait by"
            assert not short.done(), f"a newcomer was admitted within {window_s:g} s: the engine did not get " \
                "admit_wait_ms=10000"
            await client.abort("long")
            reply = await asyncio.wait_for(short, WAIT_S)
            assert len(reply["output_ids"]) == 2
            await asyncio.gather(long, return_exceptions=True)

    asyncio.run(run())


def test_the_engine_run_alone_admits_as_a_rollout_server_starts_it() -> None:
    """``python -m rollout_server.engine`` (README, "Running the parts alone") takes ``engine.*``'s defaults:
    the admission wait, batch, context, prefix cache, threads, dtype and bind address of an engine a rollout
    server starts."""
    args = parse_args(["--model", "m"])
    cfg = EngineConfig()
    assert args.admit_wait_ms == cfg.admit_wait_ms > 0
    assert (args.max_batch_size, args.max_context, args.prefix_cache_tokens, args.threads, args.dtype, args.host) == (
        cfg.max_batch_size, cfg.max_context, cfg.prefix_cache_tokens, cfg.threads, cfg.dtype, cfg.host)
