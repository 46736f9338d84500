"""The stage port under connections that are not a pusher's, and a data connection that fails mid-Stage.

The receiver, the pusher and the PKI are real (on 127.0.0.1); the engine is an HTTP stub of SGLang's shapes
(``test_engine_client.sglang_056_stub``), as a Stage and a Commit need only its weight routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from receiver_helpers import started_receiver
from test_checkpoint_engine import make_pki, read_to_close, snapshot_of
from test_checkpoint_refusals import max_file_bytes
from test_engine_client import serve, sglang_056_stub
from transformers import AutoModelForCausalLM

from core.checkpoint_format import GRPC_OPTIONS, REASON_KEY, SERVICE
from core.config import CheckpointConfig
from proto import checkpoint_pb2 as pb
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.stage_port import MAX_UNCLAIMED
from trainer.checkpoint_pusher import CheckpointPusher

WAIT_S = 60.0
TOKEN = secrets.token_urlsafe(32)


def config(tmp_path: Path, **overrides: object) -> CheckpointConfig:
    return CheckpointConfig(token=TOKEN, stage_dir=tmp_path / "stage", retries=0,  # type: ignore[arg-type]
                            **overrides)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def stub_receiver(cfg: CheckpointConfig, model_dir: Path) -> AsyncIterator[CheckpointReceiver]:
    app, _, _ = sglang_056_stub()
    async with serve(app) as url, started_receiver(cfg, model_dir, url, backoff_s=0.05) as rec:
        yield rec


def refused(rec: CheckpointReceiver, reason: str) -> float:
    return rec.metrics.registry.get_sample_value("rollwave_rollout_checkpoint_refused_total",
                                                 {"reason": reason}) or 0.0


async def eventually(predicate: object, what: str) -> None:
    """Poll until ``predicate()``; a hang guard, not a timing check."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)


def test_idle_connections_beyond_the_slots_do_not_keep_a_pusher_out(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who reaches the stage port used to take one of its ``MAX_UNCLAIMED`` slots before the TLS handshake
    and hold it for ``connect_timeout_s`` by sending nothing: that many idle connections refused every push. Now
    the handshake and the ticket come first, for all connections at once, so a push over mutual TLS stages and
    commits while twice the slots sit idle; those are closed once ``connect_timeout_s`` passes, each logged and
    counted as ``handshake_timeout``."""
    pki = make_pki(tmp_path / "pki", "rollwave")
    tls = {"tls_ca": pki.ca, "tls_client_name": "trainer"}
    cfg = config(tmp_path, connect_timeout_s=3.0, tls_cert=pki.server_cert, tls_key=pki.server_key, **tls)
    pushing = cfg.model_copy(update={"tls_cert": pki.client_cert, "tls_key": pki.client_key,
                                     "connect_timeout_s": 10.0})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    idle_count = 2 * MAX_UNCLAIMED + 1

    async def run() -> None:
        async with stub_receiver(cfg, tiny_model_dir) as rec:
            with contextlib.ExitStack() as stack:
                idle = [stack.enter_context(socket.create_connection(("127.0.0.1", rec.stage_port), timeout=WAIT_S))
                        for _ in range(idle_count)]  # accepted before the pusher's connection, in this order
                pusher = CheckpointPusher(pushing, [rec.address])
                try:
                    pushed = await asyncio.to_thread(lambda: pusher.push_model(model, version=1).wait(WAIT_S))
                finally:
                    await asyncio.to_thread(pusher.close)
                assert pushed.ok, pushed.servers
                assert rec.version == 1
                assert rec.metrics.registry.get_sample_value("rollwave_rollout_stage_bytes_total",
                                                             {"transport": "port"}) > 0
                for sock in idle:
                    await asyncio.to_thread(read_to_close, sock)
            assert refused(rec, "handshake_timeout") == idle_count
            assert refused(rec, "busy") == refused(rec, "ticket") == 0
            port = rec.service.stage_port
            assert port is not None
            await eventually(lambda: port.connections == 0, "the stage port to hold no connection")
            assert "refused (handshake_timeout): no TLS handshake within 3 s (checkpoint.connect_timeout_s)" \
                in caplog.text

    asyncio.run(run())


@contextlib.contextmanager
def stage_call(address: str, manifest: bytes) -> Iterator[grpc.Future]:
    """A Stage call that sends ``manifest`` and then holds its stream open (no trailer) until the block ends, as a
    pusher whose data connection failed does while it waits for the call to say why."""
    release = threading.Event()

    def chunks() -> Iterator[bytes]:
        yield manifest
        release.wait(WAIT_S)

    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stage = channel.stream_unary(f"/{SERVICE}/Stage", response_deserializer=pb.StageReply.FromString)
        call = stage.future(chunks(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=20.0)
        try:
            yield call
        finally:
            release.set()
            call.cancel()


@pytest.mark.parametrize("fault", ["cut", "storage"])
def test_a_failed_data_connection_ends_the_stage_with_its_cause(
    tiny_model_dir: Path, tmp_path: Path, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The data connection fails before the pusher can send the trailer: it is cut after 1000 bytes, or the
    staged file can take no more bytes (a file size limit past half the payload; a full staging area). The
    receiver waited for a trailer that never came, so the pusher's call said nothing until it gave up, and the
    receiver counted a cancelled stream. Now the call ends at once with the connection's cause (reason, code and
    message), logged and counted as such, and nothing is staged."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    snapshot = snapshot_of(model, 1)
    ticket = secrets.token_bytes(32)
    cfg = config(tmp_path, connect_timeout_s=10.0)
    payload = bytes(snapshot.nbytes)

    async def run() -> None:
        async with stub_receiver(cfg, tiny_model_dir) as rec:
            staged = rec.service.stage_root / "v1.partial" / "model.safetensors"

            def send(data: socket.socket, call: grpc.Future, nbytes: int) -> grpc.RpcError:
                with contextlib.suppress(OSError):  # the receiver stops reading at a failed write
                    data.sendall(ticket + payload[:nbytes])
                    data.shutdown(socket.SHUT_WR)
                err = call.exception(timeout=WAIT_S)
                assert isinstance(err, grpc.RpcError)
                return err

            with stage_call(rec.address, snapshot.manifest_chunk(None, ticket)) as call, \
                    socket.create_connection(("127.0.0.1", rec.stage_port), timeout=WAIT_S) as data:
                if fault == "cut":
                    err = await asyncio.to_thread(send, data, call, 1000)
                else:
                    await eventually(lambda: staged.exists() and staged.stat().st_size > snapshot.nbytes,
                                     "the staged file to be sized")
                    with max_file_bytes(staged.stat().st_size - snapshot.nbytes // 2):
                        err = await asyncio.to_thread(send, data, call, snapshot.nbytes)
            reason = "stream" if fault == "cut" else "storage"
            code = grpc.StatusCode.UNAVAILABLE if fault == "cut" else grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (err.code(), dict(err.trailing_metadata() or ())[REASON_KEY]) == (code, reason), err
            detail = "closed after 1000 of" if fault == "cut" else "the staged file takes no more after"
            assert "data connection from 127.0.0.1:" in err.details() or "data from 127.0.0.1:" in err.details()
            assert detail in err.details(), err.details()
            assert rec.metrics.registry.get_sample_value("rollwave_rollout_stage_failures_total",
                                                         {"reason": reason}) == 1
            assert f"rollout-0: stage refused ({reason}): " in caplog.text and "cancelled" not in caplog.text
            assert list(rec.service.stage_root.iterdir()) == [] and rec.service._state.staged == -1

    asyncio.run(run())
