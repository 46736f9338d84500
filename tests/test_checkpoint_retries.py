"""``checkpoint.retries``: a Stage broken by the network is tried again, as many more times as the key says.

A real receiver (on a background event loop, as in a rollout server) in front of a real embedded engine; the
pusher reaches its gRPC port and its stage port through TCP proxies that cut one connection in the middle of a
Stage's bytes, as a network fault would: the stage port's connection (``checkpoint.stage_transport: tcp``) or
the Stage stream itself (``grpc``). The retry reconnects and sends again; without a retry left the push fails
at stage ``stage``.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from net_helpers import LoopbackProxy
from transformers import AutoModelForCausalLM, PreTrainedModel

from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import CheckpointPusher, PushResult

TOKEN = secrets.token_urlsafe(32)
WAIT_S = 60.0
CUT_AFTER = 256 << 10  # bytes towards the receiver: far past Prove and Status, well inside a 2.4 MB Stage


class CuttingProxy(LoopbackProxy):
    """A loopback TCP proxy to ``upstream`` that resets the next ``arm()``ed connection once it has carried
    ``CUT_AFTER`` bytes towards the receiver; every other connection passes untouched."""

    def __init__(self, upstream: tuple[str, int]):
        self.cuts = 0
        self._armed = 0
        self._carried: dict[tuple[socket.socket, socket.socket], int] = {}  # an armed connection: bytes sent on
        super().__init__(upstream, WAIT_S)

    def arm(self) -> None:
        with self.lock:
            self._armed += 1

    def opened(self, pair: tuple[socket.socket, socket.socket]) -> None:
        with self.lock:
            if self._armed > 0:
                self._armed -= 1
                self._carried[pair] = 0

    def passes(self, pair: tuple[socket.socket, socket.socket], to_upstream: bool, data: bytes) -> bool:
        with self.lock:
            if not to_upstream or pair not in self._carried:
                return True
            self._carried[pair] += len(data)
            if self._carried[pair] <= CUT_AFTER:
                return True
            self.cuts += 1
            del self._carried[pair]
        for sock in pair:  # a reset both ways, as a dropped link
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        return False


class ProxiedServer:
    """An engine process and its checkpoint receiver, reached through a ``CuttingProxy``. The receiver proves the
    address the pusher dials (the proxy's), as a server behind a forwarded port is registered under that one."""

    def __init__(self, model_dir: Path, stage_dir: Path, log_dir: Path):
        self.config = CheckpointConfig(token=TOKEN, stage_dir=stage_dir, chunk_bytes=64 << 10, connect_timeout_s=5.0)
        self.engine = EngineProcess(model_dir, log_path=log_dir / "engine.log").start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = EngineClient(self.engine.url)
        self.receiver = CheckpointReceiver(self.config, model_dir, self.client, self.engine.url, "server0")
        self._run(self.receiver.start())
        self.proxy = CuttingProxy((self.receiver.host, self.receiver.port))
        self.receiver.service.address = self.proxy.address
        self.stage_proxy = CuttingProxy((self.receiver.host, self.receiver.stage_port))
        stage_port = self.receiver.service.stage_port
        assert stage_port is not None
        stage_port.port = int(self.stage_proxy.address.rsplit(":", 1)[1])  # what Status tells the pusher

    def _run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)  # type: ignore[arg-type]

    def push(self, model: PreTrainedModel, version: int, retries: int, transport: str) -> PushResult:
        """One push with ``checkpoint.retries=retries`` whose first connection carrying the Stage's bytes (over
        ``transport``) a proxy cuts."""
        (self.stage_proxy if transport == "tcp" else self.proxy).arm()
        update = {"retries": retries, "stage_transport": transport}
        pusher = CheckpointPusher(self.config.model_copy(update=update), [self.proxy.address])
        try:
            pushed = pusher.push_model(model, version=version)
            assert pushed is not None
            [result] = pushed.wait(WAIT_S).servers
            return result
        finally:
            pusher.close()

    def close(self) -> None:
        async def stop() -> None:
            await self.receiver.stop()
            await self.client.aclose()

        try:
            self.proxy.close()
            self.stage_proxy.close()
            self._run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()
            self.engine.close()


@pytest.fixture
def server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ProxiedServer]:
    proxied = ProxiedServer(tiny_model_dir, tmp_path / "stage", tmp_path)
    try:
        yield proxied
    finally:
        proxied.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_stage_cut_by_the_network_is_retried_only_with_retries_left(server: ProxiedServer, tiny_model_dir: Path,
                                                                      transport: str) -> None:
    """retries=0: the cut Stage fails the push, tried once, and the server keeps its version. retries=1: the same
    cut costs one more Stage attempt on a new connection, and the version is committed. A cut stage port
    connection fails the push with the receiver's cause (reason ``stream``, the bytes it had), which the receiver
    sends as soon as its side of the connection closes; a cut stream is the pusher's own ``unavailable``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cutter = server.stage_proxy if transport == "tcp" else server.proxy
    none = server.push(model, version=1, retries=0, transport=transport)
    assert (none.ok, none.stage, none.reason, none.stage_attempts, none.commit_attempts) == (
        False, "stage", "stream" if transport == "tcp" else "unavailable", 1, 0), none
    assert transport == "grpc" or ("UNAVAILABLE: data connection from 127.0.0.1:" in none.error
                                   and " bytes" in none.error), none.error
    assert cutter.cuts == 1 and server.receiver.version == 0
    once = server.push(model, version=1, retries=1, transport=transport)
    assert (once.ok, once.stage_attempts, once.commit_attempts) == (True, 2, 1), once
    assert cutter.cuts == 2 and server.receiver.version == 1
    assert server.proxy.cuts + server.stage_proxy.cuts == 2  # the other transport's proxy cut nothing
