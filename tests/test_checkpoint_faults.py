"""The checkpoint receiver's swap when its engines fail, and the pusher's catch-up of a restarted server.

Engines are stubs of SGLang's HTTP shapes (``test_engine_client.sglang_056_stub``) that fail the calls a test
picks; the receiver (with a real ``EngineGroup`` of ``EngineClient``s), the pusher and the registry are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import SecretStr
from test_checkpoint_engine import snapshot_of
from test_engine_client import serve, sglang_056_stub
from transformers import AutoModelForCausalLM, PreTrainedModel

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerInfo, ServerRegistry
from core.checkpoint_format import GRPC_OPTIONS, SERVICE
from core.config import CheckpointConfig
from proto import checkpoint_pb2 as pb
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient, EngineGroup
from trainer.checkpoint_pusher import CheckpointPusher, PushResult, PushRound, registered_servers

WAIT_S = 60.0


def config(tmp_path: Path, **overrides: object) -> CheckpointConfig:
    return CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                            connect_timeout_s=5.0, **overrides)  # type: ignore[arg-type]


def model_of(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


async def push(pusher: CheckpointPusher, model: PreTrainedModel, version: int) -> PushRound:
    return await asyncio.to_thread(lambda: pusher.push_model(model, version=version).wait(WAIT_S))


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Poll until ``predicate()``; fail naming ``what`` if it never holds (a hang guard, not a timing check)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def receiver_and_pusher(cfg: CheckpointConfig, model_dir: Path, engine: EngineClient | EngineGroup,
                              url: str) -> AsyncIterator[tuple[CheckpointReceiver, CheckpointPusher]]:
    """A receiver swapping ``engine`` and a pusher to it, both stopped on the way out."""
    receiver = CheckpointReceiver(cfg, model_dir, engine, url, "stub")
    pusher = CheckpointPusher(cfg, [await receiver.start()])
    try:
        yield receiver, pusher
    finally:
        await asyncio.to_thread(pusher.close)
        await receiver.stop()


@contextlib.asynccontextmanager
async def on_stub(cfg: CheckpointConfig, model_dir: Path,
                  app: FastAPI) -> AsyncIterator[tuple[str, CheckpointReceiver, CheckpointPusher]]:
    """The stub engine ``app`` served on 127.0.0.1, with a receiver swapping it and a pusher to that: (its URL, the
    receiver, the pusher), all stopped on the way out."""
    async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
        async with receiver_and_pusher(cfg, model_dir, engine, url) as (receiver, pusher):
            yield url, receiver, pusher


def sample(receiver: CheckpointReceiver, name: str, reason: str) -> float:
    return receiver.metrics.registry.get_sample_value(name, {"reason": reason}) or 0.0


@pytest.mark.parametrize("late", [False, True], ids=["at-once", "after-the-deadline"])
def test_a_failed_pause_leaves_no_engine_of_the_group_paused(tiny_model_dir: Path, tmp_path: Path,
                                                             late: bool) -> None:
    """Of a server's two engines, b refuses the pause (at once, or after the receiver's pause deadline) while a
    pauses: the Commit fails naming the stage (and b, when it answered in time), and both are continued before
    any other swap, so every pause of a is followed by its continue; once b pauses again the next version loads
    on both and neither stays paused. (The pusher's watcher offers the failed version again meanwhile.)"""
    cfg = config(tmp_path, retries=0, pause_timeout_s=0.5)
    refusing = True

    async def refuse_pause(path: str) -> bool:
        if path != "/pause_generation" or not refusing:
            return False
        if late:
            await asyncio.sleep(1.5)
        return True

    async def run() -> None:
        nonlocal refusing
        app_a, seen_a, _ = sglang_056_stub()
        app_b, seen_b, _ = sglang_056_stub(fault=refuse_pause)
        async with serve(app_a) as url_a, serve(app_b) as url_b, EngineClient(url_a, backoff_s=0.05) as a, \
                EngineClient(url_b, backoff_s=0.05) as b:
            async with receiver_and_pusher(cfg, tiny_model_dir, EngineGroup([a, b]), url_a) as (receiver, pusher):
                [failed] = (await push(pusher, model_of(tiny_model_dir), 1)).servers
                assert (failed.stage, failed.reason) == ("commit", "pause_timeout" if late else "pause"), failed
                await eventually(lambda: "/continue_generation" in seen_b, "the engines to be continued")
                assert late or url_b in failed.error, failed.error  # the group names the engine that refused
                refusing = False
                assert (await push(pusher, model_of(tiny_model_dir), 2)).ok
            swaps = [path for path in seen_a if path in ("/pause_generation", "/continue_generation")]
            assert swaps == ["/pause_generation", "/continue_generation"] * (len(swaps) // 2), swaps
            assert receiver.version == 2 and not app_a.state.paused and not app_b.state.paused
            # a late pause that then fails is a fallback (the engines are continued all the same), counted
            assert sample(receiver, "rollwave_rollout_swap_fallbacks_total", "late_pause") == (1 if late else 0)

    asyncio.run(run())


def test_a_failed_continue_is_tried_until_the_engine_continues(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The engine refuses continue_generation twice after a load: the receiver tries again (each failure
    counted) and answers the Commit once the engine generates, so the one Commit succeeds and nothing is left
    paused (a retried Commit used to find the version served and count it delivered, the engine paused)."""
    cfg = config(tmp_path)
    refusals = 2

    async def refuse_continue(path: str) -> bool:
        nonlocal refusals
        if path != "/continue_generation" or not refusals:
            return False
        refusals -= 1
        return True

    async def run() -> None:
        app, seen, _ = sglang_056_stub(fault=refuse_continue)
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            async with receiver_and_pusher(cfg, tiny_model_dir, engine, url) as (receiver, pusher):
                pushed = await push(pusher, model_of(tiny_model_dir), 1)
            assert not app.state.paused and seen.count("/continue_generation") == 3
            [result] = pushed.servers
            assert pushed.ok and result.commit_attempts == 1, result
            assert sample(receiver, "rollwave_rollout_resume_failures_total", "resume") == 2
            assert receiver.version == 1

    asyncio.run(run())


@pytest.mark.parametrize("prefill_ahead", [True, False])
def test_a_failed_prepare_is_a_counted_fallback_and_the_load_reads_the_files(
    tiny_model_dir: Path, tmp_path: Path, prefill_ahead: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine fails ``/prepare_weights_from_disk`` (HTTP 500): the Commit still loads the version, reading its
    files in the pause, as it did; the fallback used to be only logged, and is now also counted
    (``swap_fallbacks{reason="prepare"}``), the log naming the server, the engine, the staged directory, whether
    the KV was to be computed ahead, and the engine's error. An engine without the route (SGLang: 404) is no
    failure and counts nothing."""
    cfg = config(tmp_path, retries=0, prefill_ahead=prefill_ahead, kv_on_swap="recompute")

    async def refuse_prepare(path: str) -> bool:
        return path == "/prepare_weights_from_disk"

    async def run() -> None:
        app, seen, _ = sglang_056_stub(fault=refuse_prepare)
        async with on_stub(cfg, tiny_model_dir, app) as (url, receiver, pusher):
            assert (await push(pusher, model_of(tiny_model_dir), 1)).ok
            assert receiver.version == 1 and "/update_weights_from_disk" in seen
            assert sample(receiver, "rollwave_rollout_swap_fallbacks_total", "prepare") == 1
            staged = receiver.service.stage_root / "v1"
            assert f"stub: engine {url}: prepare_weights_from_disk of {staged} (prefill_running " \
                   f"{prefill_ahead}) failed (/prepare_weights_from_disk: HTTP 500: " in caplog.text
            assert ("no KV computed ahead" in caplog.text) == prefill_ahead

            app_ok, _, _ = sglang_056_stub()  # answers the prepare 404, as SGLang does
            async with serve(app_ok) as url_ok, EngineClient(url_ok, backoff_s=0.05) as engine_ok:
                receiver.service.engine = engine_ok
                assert (await push(pusher, model_of(tiny_model_dir), 2)).ok
            assert sample(receiver, "rollwave_rollout_swap_fallbacks_total", "prepare") == 1

    asyncio.run(run())


def test_abort_of_a_staged_version_is_logged_and_counted(tiny_model_dir: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A pusher's Abort drops the version staged; one naming another version drops nothing. Both used to pass
    silently: now each is logged with the version and the caller, and counted by outcome."""
    caplog.set_level(logging.INFO, logger="rollout_server.checkpoint_receiver")
    cfg = config(tmp_path)
    snapshot = snapshot_of(model_of(tiny_model_dir), 1)
    auth = [("authorization", f"Bearer {cfg.token.get_secret_value()}")]

    def stage_then_abort(address: str) -> list[bool]:
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            stage = channel.stream_unary(f"/{SERVICE}/Stage", response_deserializer=pb.StageReply.FromString)
            stage(snapshot.chunks(1 << 20, None), metadata=auth, timeout=WAIT_S)
            abort = channel.unary_unary(f"/{SERVICE}/Abort", request_serializer=pb.AbortRequest.SerializeToString,
                                        response_deserializer=pb.AbortReply.FromString)
            return [abort(pb.AbortRequest(version=v), metadata=auth, timeout=WAIT_S).dropped for v in (2, 1)]

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with on_stub(cfg, tiny_model_dir, app) as (url, receiver, _):
            assert await asyncio.to_thread(stage_then_abort, receiver.address) == [False, True]
            assert receiver.service._state.staged == -1 and receiver.version == 0
            for outcome in ("not_staged", "dropped"):
                assert receiver.metrics.registry.get_sample_value("rollwave_rollout_stage_aborts_total",
                                                                  {"outcome": outcome}) == 1
            assert "stub: Abort of version 2 from ipv4:127.0.0.1:" in caplog.text
            assert "stub: Abort of version 1 from ipv4:127.0.0.1:" in caplog.text
            assert "dropped the staged version; still serving version 0" in caplog.text

    asyncio.run(run())


def test_a_continue_that_keeps_failing_holds_the_commit_until_the_receiver_stops(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """An engine that never continues: the Commit does not answer (the pusher's deadline passes, reason
    timeout) and the version is not recorded while the receiver keeps trying; a flush of the next push names the
    server it could not finish; the receiver's stop ends the tries, and the Commit then fails as a failed
    continue."""
    cfg = config(tmp_path, commit_timeout_s=2.0)

    async def refuse_continue(path: str) -> bool:
        return path == "/continue_generation"

    async def run() -> None:
        app, _, _ = sglang_056_stub(fault=refuse_continue)
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            async with receiver_and_pusher(cfg, tiny_model_dir, engine, url) as (receiver, pusher):
                [result] = (await push(pusher, model_of(tiny_model_dir), 1)).servers
                assert (result.stage, result.reason) == ("commit", "timeout"), result
                assert receiver.version == 0 and app.state.paused
                assert sample(receiver, "rollwave_rollout_resume_failures_total", "resume") >= 2
                pusher.push_model(model_of(tiny_model_dir), version=2)  # in flight: its Commit cannot answer
                assert await asyncio.to_thread(pusher.flush, 1.0) == [f"{receiver.address} ({receiver.address})"]
            await eventually(lambda: sample(receiver, "rollwave_rollout_commit_failures_total", "resume") == 1,
                             "the Commit to give up once the receiver stopped")

    asyncio.run(run())


def test_a_load_answered_with_a_page_not_json_fails_the_commit_and_the_engine_continues(tiny_model_dir: Path,
                                                                                       tmp_path: Path) -> None:
    """An engine behind a proxy answers the load 200 with a page, not SGLang's JSON: the Commit fails at the
    load, naming the reply, and the engine is continued (a reply that was not JSON escaped the swap and left
    the engine paused, the failure neither logged by the receiver nor counted)."""
    cfg = config(tmp_path, retries=0)

    async def run() -> None:
        app, seen, _ = sglang_056_stub()

        @app.middleware("http")
        async def proxy_page(request: Request, call_next):  # type: ignore[no-untyped-def]
            if request.url.path == "/update_weights_from_disk":
                return PlainTextResponse("<html>OK</html>")
            return await call_next(request)

        async with on_stub(cfg, tiny_model_dir, app) as (url, receiver, pusher):
            [failed] = (await push(pusher, model_of(tiny_model_dir), 1)).servers
            assert (failed.stage, failed.reason) == ("commit", "load"), failed
            assert "not a JSON object" in failed.error and "<html>OK</html>" in failed.error, failed.error
            assert seen[-1] == "/continue_generation" and not app.state.paused
            assert receiver.version == 0
            assert sample(receiver, "rollwave_rollout_commit_failures_total", "load") == 1

    asyncio.run(run())


def test_a_stage_without_a_deadline_that_stalls_ends_by_stage_timeout_and_frees_the_stage(tiny_model_dir: Path,
                                                                                          tmp_path: Path) -> None:
    """A caller that sets no deadline sends the manifest and then nothing: the receiver ends the Stage by its own
    deadline (``stage_timeout_s`` and the bytes over ``min_throughput_mib_s``), naming the caller (it used to wait
    forever, holding the stage lock, so every later push waited behind it), counts it, and the next push stages
    and commits."""
    cfg = config(tmp_path, stage_timeout_s=1.0, min_throughput_mib_s=2.0)
    model = model_of(tiny_model_dir)
    snapshot = snapshot_of(model, 1)
    limit = 1.0 + snapshot.nbytes / (2.0 * 2**20)  # as a pusher's deadline: it grows with the bytes
    stalled = threading.Event()

    def stall() -> Iterator[bytes]:
        yield snapshot.manifest_chunk()
        stalled.wait(WAIT_S)  # the stream stays open, sending nothing

    def stage_without_deadline(address: str) -> grpc.RpcError:
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
            stage = channel.stream_unary(f"/{SERVICE}/Stage", response_deserializer=pb.StageReply.FromString)
            with pytest.raises(grpc.RpcError) as err:
                stage(stall(), metadata=[("authorization", f"Bearer {cfg.token.get_secret_value()}")])
            return err.value

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with on_stub(cfg, tiny_model_dir, app) as (url, receiver, pusher):
            call = asyncio.to_thread(stage_without_deadline, receiver.address)
            try:
                err = await asyncio.wait_for(call, WAIT_S)
            finally:
                stalled.set()
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            assert f"not done within {limit:.3g} s" in err.details() and "127.0.0.1" in err.details(), \
                err.details()
            assert sample(receiver, "rollwave_rollout_stage_failures_total", "timeout") == 1
            assert (await push(pusher, model, 1)).ok and receiver.version == 1

    asyncio.run(run())


def test_a_server_restarted_under_its_id_and_address_is_caught_up(tiny_model_dir: Path, tmp_path: Path,
                                                                  redis_server: EmbeddedRedis) -> None:
    """A registered server commits version 1; while its heartbeat still says 0 the watcher offers nothing more.
    It then restarts on its base weights, under the same id and address, within the registry's TTL: the
    watcher sees a new registration and offers version 1 again, which the new receiver commits."""
    cfg = config(tmp_path)
    client = redis.Redis.from_url(redis_server.url)
    registry = ServerRegistry(client, Keys("restart"), ttl_s=WAIT_S)

    def results(pusher: CheckpointPusher) -> list[PushResult]:
        return [r for r in pusher.take_results() if not r.skipped]

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            receiver = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "rollout-0")
            address = await receiver.start()
            registry.register(ServerInfo("rollout-0", url, grpc_address=address, version=0))
            pusher = CheckpointPusher(cfg, registered_servers(registry))
            try:
                assert (await push(pusher, model_of(tiny_model_dir), 1)).ok
                assert [r.version for r in results(pusher)] == [1]
                await asyncio.sleep(3.0)  # three watcher rounds with the heartbeat lagging the commit
                assert results(pusher) == []
                await receiver.stop()
                receiver = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "rollout-0",
                                              port=int(address.rsplit(":", 1)[1]))
                assert await receiver.start() == address
                registry.register(ServerInfo("rollout-0", url, grpc_address=address, version=0))
                await eventually(lambda: receiver.version == 1, "the restarted server to be caught up")
            finally:
                await asyncio.to_thread(pusher.close)
                await receiver.stop()

    try:
        asyncio.run(run())
    finally:
        client.close()
