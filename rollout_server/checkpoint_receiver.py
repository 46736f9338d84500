"""Checkpoint receiver: the gRPC ``CheckpointEngine`` of one rollout server.

Stage writes a pushed version as an HF model directory on tmpfs while the engine keeps
generating; Commit pauses the engine only for ``update_weights_from_disk`` of that directory.
The manifest is checked against the served model before any byte is accepted, and a stage
that fails (bad manifest, checksum, offsets, cut stream) is deleted: the server keeps its version.
The server is ``grpc.aio`` on the rollout server's event loop, so Commit awaits the same async
engine client the agent loop uses.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import shutil
import struct
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto import checkpoint_pb2 as pb
from rollout_server.engine_client import EngineError
from services.config import CheckpointConfig

# torch dtype name (the manifest's spelling) -> (safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1),
    "uint8": ("U8", 1), "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8), "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
}
_FROM_SAFETENSORS = {st: name for name, (st, _) in DTYPES.items()}
SERVICE = pb.DESCRIPTOR.services_by_name["CheckpointEngine"].full_name
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def trailer_checksum(crcs: Sequence[int]) -> str:
    """The stream checksum: crc32 of the per-tensor crc32s as little-endian u32 words, 8 hex digits."""
    return f"{zlib.crc32(struct.pack(f'<{len(crcs)}I', *crcs)):08x}"


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (names -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def served_tensor_specs(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (torch dtype name, shape) of every tensor in ``model_dir``'s safetensors files."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors file to check pushed weights against")
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        for name, meta in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _FROM_SAFETENSORS:
                raise ValueError(f"{path}: tensor {name} has dtype {meta['dtype']}, which pushes do not support")
            specs[name] = (_FROM_SAFETENSORS[meta["dtype"]], tuple(meta["shape"]))
    return specs


_PAYLOADS = {1: "manifest", 2: "data", 4: "trailer"}


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view):
            raise StageError("stream", "truncated Stage message")
        byte = view[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def parse_chunk(message: bytes) -> tuple[str, int, memoryview]:
    """(payload kind, offset, payload) of a serialized ``Chunk``; the payload is a view, not a copy.

    Protobuf's parser would copy every 1 MiB data slice once more before it reaches the file.
    """
    view = memoryview(message)
    kind, offset, payload, pos = "", 0, view[:0], 0
    while pos < len(view):
        key, pos = _varint(view, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(view, pos)
            offset = value if field == 3 else offset
        elif wire == 2:
            size, pos = _varint(view, pos)
            if pos + size > len(view):
                raise StageError("stream", "truncated Stage message")
            if field in _PAYLOADS:
                kind, payload = _PAYLOADS[field], view[pos:pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise StageError("stream", f"Stage message: field {field} has wire type {wire}")
    return kind, offset, payload


class StageError(Exception):
    """A rejected stage; ``reason`` labels the failure metric, the message names the tensor."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.reason = reason
        self.code = code


def check_manifest(manifest: pb.Manifest, served: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Raise StageError unless the manifest has exactly the served tensors, packed in order."""
    names = [t.name for t in manifest.tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise StageError("manifest", f"tensor {dup}: listed twice in the manifest")
    missing = sorted(set(served) - set(names))
    if missing:
        raise StageError("manifest", f"tensor {missing[0]}: missing from the manifest "
                                     f"({len(missing)} missing)")
    extra = sorted(set(names) - set(served))
    if extra:
        raise StageError("manifest", f"tensor {extra[0]}: not in the served model ({len(extra)} extra)")
    offset = 0
    for t in manifest.tensors:
        dtype, shape = served[t.name]
        if t.dtype != dtype:
            raise StageError("manifest", f"tensor {t.name}: dtype {t.dtype}, served model has {dtype}")
        if tuple(t.shape) != shape:
            raise StageError("manifest", f"tensor {t.name}: shape {list(t.shape)}, "
                                         f"served model has {list(shape)}")
        nbytes = DTYPES[dtype][1] * _numel(shape)
        if t.nbytes != nbytes or t.offset != offset:
            raise StageError("offsets", f"tensor {t.name}: offset {t.offset} nbytes {t.nbytes}, expected "
                                        f"offset {offset} nbytes {nbytes} (packed in manifest order)")
        offset += nbytes
    if manifest.total_bytes != offset:
        raise StageError("offsets", f"manifest total_bytes {manifest.total_bytes}, "
                                    f"tensors add up to {offset}")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class StagedFile:
    """Writes ``model.safetensors`` straight from chunks: header from the manifest, bytes at their offsets."""

    def __init__(self, path: Path, manifest: pb.Manifest):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for t in manifest.tensors:
            header[t.name] = {"dtype": DTYPES[t.dtype][0], "shape": list(t.shape),
                              "data_offsets": [t.offset, t.offset + t.nbytes]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.tensors = list(manifest.tensors)
        self.total = manifest.total_bytes
        self.base = 8 + len(raw)
        self.received = 0
        self.crcs = [0] * len(self.tensors)
        self._index = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, struct.pack("<Q", len(raw)) + raw)
        # Allocating the tmpfs pages in one call is ~10x cheaper than faulting them in chunk by chunk.
        os.posix_fallocate(self._fd, 0, self.base + self.total)

    def write(self, offset: int, data: memoryview) -> None:
        """Append one slice; chunks must arrive in offset order (the crc32s are computed on the fly)."""
        if offset != self.received or offset + len(data) > self.total:
            raise StageError("offsets", f"chunk at offset {offset} with {len(data)} bytes; expected offset "
                                        f"{self.received}, payload is {self.total} bytes")
        os.pwrite(self._fd, data, self.base + offset)
        view, pos = data, 0
        while pos < len(view):
            t = self.tensors[self._index]
            end = t.offset + t.nbytes - (offset + pos)
            if end <= 0:
                self._index += 1
                continue
            self.crcs[self._index] = zlib.crc32(view[pos:pos + end], self.crcs[self._index])
            pos += end
        self.received += len(data)

    def finish(self, trailer: pb.Trailer) -> None:
        """Check the byte count and every tensor's crc32 against the trailer."""
        if self.received != self.total:
            raise StageError("stream", f"stream ended after {self.received} of {self.total} bytes")
        if len(trailer.crc32) != len(self.tensors):
            raise StageError("checksum", f"trailer has {len(trailer.crc32)} crc32s for "
                                         f"{len(self.tensors)} tensors")
        for t, got, want in zip(self.tensors, self.crcs, trailer.crc32, strict=True):
            if got != want:
                raise StageError("checksum", f"tensor {t.name}: crc32 {got:08x} of received bytes, "
                                             f"pusher sent {want:08x}", grpc.StatusCode.DATA_LOSS)
        expected = trailer_checksum(self.crcs)
        if trailer.checksum != expected:
            raise StageError("checksum", f"stream checksum {trailer.checksum}, expected {expected}",
                             grpc.StatusCode.DATA_LOSS)

    def close(self) -> None:
        os.close(self._fd)


class WeightEngine(Protocol):
    """What Commit needs from the engine client (``rollout_server.engine_client.EngineClient``)."""

    async def pause(self, mode: str = ...) -> Any: ...
    async def resume(self) -> Any: ...
    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = ...,
                                       flush_cache: bool = ...) -> Any: ...


class CheckpointMetrics:
    """Checkpoint metrics of one rollout server, in its own (or a given) registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.stage_seconds = Histogram("rollwave_rollout_stage_duration_seconds", "Stage stream duration",
                                       registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.stage_bytes = Counter("rollwave_rollout_stage_bytes", "bytes staged", registry=r)
        self.pause_seconds = Histogram("rollwave_rollout_pause_duration_seconds", "pause per Commit",
                                       registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.paused_seconds = Counter("rollwave_rollout_paused_seconds", "time paused for weight loads",
                                      registry=r)
        self.version = Gauge("rollwave_rollout_policy_version", "committed policy version", registry=r)
        self.stage_failures = Counter("rollwave_rollout_stage_failures", "rejected or failed stages",
                                      ["reason"], registry=r)
        self.commit_failures = Counter("rollwave_rollout_commit_failures", "failed commits", ["reason"],
                                       registry=r)


@dataclass
class _Swap:
    """One Commit's pause: durations, whether the engine took the weights, and what went wrong."""

    pause_s: float = 0.0
    load_s: float = 0.0
    loaded: bool = False
    error: str = ""
    reason: str = ""


@dataclass
class _State:
    current: int
    current_dir: Path
    staged: int = -1
    staged_dir: Path | None = None
    committing: int = -1


class CheckpointService:
    """Stage/Commit/Abort/Status over one served model directory and one engine."""

    def __init__(self, model_dir: Path, stage_root: Path, engine: WeightEngine, engine_url: str,
                 version: int, metrics: CheckpointMetrics):
        self.model_dir = Path(model_dir)
        self.stage_root = Path(stage_root)
        self.engine = engine
        self.engine_url = engine_url
        self.metrics = metrics
        self.served = served_tensor_specs(self.model_dir)
        self._state = _State(current=version, current_dir=self.model_dir)
        self._stage_lock = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        metrics.version.set(version)

    @property
    def current_version(self) -> int:
        return self._state.current

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; Stage takes raw bytes so ``parse_chunk`` can avoid copies."""
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Stage": grpc.stream_unary_rpc_method_handler(
                self.Stage, response_serializer=pb.StageReply.SerializeToString),
            "Commit": unary(self.Commit, pb.CommitRequest.FromString, pb.CommitReply.SerializeToString),
            "Abort": unary(self.Abort, pb.AbortRequest.FromString, pb.AbortReply.SerializeToString),
            "Status": unary(self.Status, pb.StatusRequest.FromString, pb.StatusReply.SerializeToString),
        })

    async def Stage(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.StageReply:
        """Receives serialized chunks (see ``parse_chunk``) and stages the version they carry."""
        async with self._stage_lock:
            start = time.monotonic()
            try:
                version, received = await self._stage(request_iterator)
            except StageError as exc:
                self.metrics.stage_failures.labels(exc.reason).inc()
                await context.abort(exc.code, str(exc))
            except asyncio.CancelledError:
                self.metrics.stage_failures.labels("stream").inc()
                raise
            seconds = time.monotonic() - start
            self.metrics.stage_seconds.observe(seconds)
            self.metrics.stage_bytes.inc(received)
            return pb.StageReply(version=version, bytes_received=received, seconds=seconds)

    async def _stage(self, chunks: AsyncIterator[bytes]) -> tuple[int, int]:
        first = await anext(chunks, None)
        kind, _, payload = parse_chunk(first or b"")
        if kind != "manifest":
            raise StageError("manifest", "the first chunk of a Stage stream must carry the manifest")
        manifest = pb.Manifest.FromString(payload)
        version = manifest.version
        self._check_newer(version)
        check_manifest(manifest, self.served)
        final = self.stage_root / f"v{version}"
        partial = self.stage_root / f"v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            self._copy_model_files(partial)
            staged = StagedFile(partial / "model.safetensors", manifest)
            try:
                await self._receive(chunks, staged)
            finally:
                staged.close()
            self._publish_stage(version, partial, final)
        except grpc.RpcError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise StageError("stream", f"stream of version {version} broke: {exc}") from exc
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return version, staged.received

    async def _receive(self, chunks: AsyncIterator[bytes], staged: StagedFile) -> None:
        async for chunk in chunks:
            kind, offset, payload = parse_chunk(chunk)
            if kind == "data":
                staged.write(offset, payload)
            elif kind == "trailer":
                staged.finish(pb.Trailer.FromString(payload))
                if await anext(chunks, None) is not None:
                    raise StageError("stream", "data after the trailer")
                return
            else:
                raise StageError("manifest", f"a {kind or 'empty'} chunk after the manifest")
        raise StageError("stream", f"stream ended after {staged.received} of {staged.total} bytes "
                                   "without a trailer")

    def _copy_model_files(self, dest: Path) -> None:
        for src in self.model_dir.iterdir():
            if src.is_file() and not src.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(src, dest / src.name)

    def _check_newer(self, version: int) -> None:
        """Versions only go up past the one served (or being committed); the staged slot holds the
        latest finished Stage, so a stale staged version never blocks a restarted trainer."""
        floor = max(self._state.current, self._state.committing)
        if version <= floor:
            raise StageError("version", f"version {version} is not newer than the served version {floor}",
                             grpc.StatusCode.FAILED_PRECONDITION)

    def _publish_stage(self, version: int, partial: Path, final: Path) -> None:
        """Make the finished stage the staged version, dropping the one staged before."""
        self._check_newer(version)
        old = self._state.staged_dir
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        self._state.staged, self._state.staged_dir = version, final
        if old is not None and old != final:
            shutil.rmtree(old, ignore_errors=True)

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitReply:
        async with self._commit_lock:
            state = self._state
            if request.version != state.staged or state.staged_dir is None:
                self.metrics.commit_failures.labels("version").inc()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"version {request.version} is not staged (staged {state.staged}, "
                                    f"current {state.current})")
            path = state.staged_dir
            state.staged, state.staged_dir, state.committing = -1, None, request.version
            swap = await self._swap(path, request.version)
            state.committing = -1
            if swap.loaded:
                old = state.current_dir
                state.current, state.current_dir = request.version, path
                self.metrics.version.set(request.version)
            elif state.staged_dir is None:  # keep it staged so the pusher can retry the Commit
                old, state.staged, state.staged_dir = None, request.version, path
            else:  # a newer version was staged meanwhile
                old = path
            if old is not None and old.parent == self.stage_root:
                shutil.rmtree(old, ignore_errors=True)
            if swap.error:
                self.metrics.commit_failures.labels(swap.reason).inc()
                await context.abort(grpc.StatusCode.INTERNAL, f"version {request.version}: {swap.error}")
            return pb.CommitReply(version=request.version, pause_seconds=swap.pause_s, load_seconds=swap.load_s)

    async def _swap(self, path: Path, version: int) -> _Swap:
        """pause(retract) -> update_weights_from_disk -> continue; continue even when the load fails."""
        start = time.monotonic()
        try:
            await self.engine.pause("retract")
        except EngineError as exc:
            return _Swap(error=f"pause failed, still serving the old weights: {exc}", reason="pause")
        swap = _Swap()
        load_start = time.monotonic()
        try:
            await self.engine.update_weights_from_disk(str(path), weight_version=str(version))
            swap.loaded = True
        except EngineError as exc:
            swap.error, swap.reason = f"load failed, continuing on the old weights: {exc}", "load"
        swap.load_s = time.monotonic() - load_start
        try:
            await self.engine.resume()
        except EngineError as exc:
            swap.error, swap.reason = f"{swap.error}; continue_generation failed: {exc}".lstrip("; "), "resume"
        swap.pause_s = time.monotonic() - start
        self.metrics.pause_seconds.observe(swap.pause_s)
        self.metrics.paused_seconds.inc(swap.pause_s)
        return swap

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        state = self._state
        if request.version != state.staged or state.staged_dir is None:
            return pb.AbortReply(dropped=False)
        path = state.staged_dir
        state.staged, state.staged_dir = -1, None
        shutil.rmtree(path, ignore_errors=True)
        return pb.AbortReply(dropped=True)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return pb.StatusReply(current_version=self._state.current, staged_version=self._state.staged,
                              engine_url=self.engine_url)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose ``authorization`` metadata is not ``Bearer <token>`` with UNAUTHENTICATED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong checkpoint token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        got = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(got).encode(), self._expected):
            return await continuation(handler_call_details)
        return self._deny_stream if handler_call_details.method.endswith("/Stage") else self._deny_unary


class CheckpointReceiver:
    """The gRPC server of one rollout server, on the caller's event loop: ``await start()``, ``await stop()``.

    Staged versions live in ``config.stage_dir/<server_name>/v<version>/``; only the current and
    the staged version are kept. ``version`` is the version the engine serves at start.
    """

    def __init__(self, config: CheckpointConfig, model_dir: Path, engine: WeightEngine, engine_url: str,
                 server_name: str, host: str = "127.0.0.1", port: int = 0, version: int = 0,
                 metrics: CheckpointMetrics | None = None):
        self.config = config
        self.host = host
        self.port = port
        self.metrics = metrics or CheckpointMetrics()
        stage_root = Path(config.stage_dir) / server_name
        shutil.rmtree(stage_root, ignore_errors=True)
        self.service = CheckpointService(model_dir, stage_root, engine, engine_url, version, self.metrics)
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def version(self) -> int:
        """The policy version the engine serves (for the registry heartbeat)."""
        return self.service.current_version

    async def start(self) -> str:
        """Serve and return ``host:port``."""
        server = grpc.aio.server(interceptors=[TokenInterceptor(self.config.token)], options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((self.service.handlers(),))
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        if self.port == 0:
            raise OSError(f"cannot bind the checkpoint receiver to {self.host}")
        await server.start()
        self._server = server
        return self.address

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving and delete this server's staging area (the served model dir is never touched)."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        shutil.rmtree(self.service.stage_root, ignore_errors=True)
