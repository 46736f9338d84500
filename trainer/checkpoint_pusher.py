"""Checkpoint pusher: streams one policy version to every rollout server, then commits everywhere.

The manifest (names, dtypes, shapes, packed offsets) comes from parameter metadata, so each
tensor is gathered once: its bytes go out in ~1 MiB chunks to all servers concurrently (one
stream per server fed from the same serialized chunks) and its crc32 travels in the trailer.
Rank 0 holds one parameter (plus a few queued chunks per server) at a time, never the model.
"""

from __future__ import annotations

import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from buffer.registry import ServerRegistry
from core.checkpoint_format import DTYPES, GRPC_OPTIONS, SERVICE, trailer_checksum
from core.config import CheckpointConfig
from proto import checkpoint_pb2 as pb
from proto import checkpoint_pb2_grpc as pb_grpc
from trainer.parallel import hf_name, iter_full_params

_STAGE_METHOD = f"/{SERVICE}/Stage"
_QUEUE_DEPTH = 8
# Stage failures that another attempt cannot fix (a bad manifest, an old version, a wrong token).
_FINAL = {None, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
          grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
Agree = Callable[[list[str]], list[str]]


def _alone(addresses: list[str]) -> list[str]:
    return addresses


@dataclass(frozen=True)
class TensorMeta:
    """What the manifest needs of one parameter, known without gathering it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        if self.dtype_name not in DTYPES:
            raise ValueError(f"tensor {self.name}: dtype {self.dtype_name} cannot be pushed "
                             f"(supported: {', '.join(DTYPES)})")
        return DTYPES[self.dtype_name][1] * int(torch.Size(self.shape).numel())


@dataclass
class ServerPush:
    """Outcome of one push on one server."""

    address: str
    ok: bool = False
    error: str = ""
    bytes: int = 0
    stage_seconds: float = 0.0
    pause_seconds: float = 0.0
    load_seconds: float = 0.0
    stage_attempts: int = 0
    commit_attempts: int = 0
    retry: bool = field(default=False, repr=False)


@dataclass
class PushReport:
    version: int
    servers: list[ServerPush] = field(default_factory=list)
    seconds: float = 0.0
    version_written: bool = False

    @property
    def ok(self) -> bool:
        return bool(self.servers) and all(s.ok for s in self.servers)


def model_metas(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """Manifest entries in ``iter_full_params`` order, from parameter metadata alone (a DTensor's
    ``shape`` is the full, unsharded one), so nothing is gathered to build the manifest."""
    return [TensorMeta(hf_name(name), _cast_dtype(p.dtype, dtype), tuple(p.shape))
            for name, p in model.named_parameters()]


def registered_servers(registry: ServerRegistry) -> Callable[[], list[str]]:
    """The gRPC addresses of the registry's live rollout servers, read again at every push."""
    return lambda: [s.grpc_address for s in registry.live_servers() if s.grpc_address]


def _broadcast_from_rank0(addresses: list[str]) -> list[str]:
    box = [addresses]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def build_manifest(version: int, metas: Sequence[TensorMeta]) -> pb.Manifest:
    """Tensors packed back to back in manifest order (the layout the receiver requires)."""
    manifest = pb.Manifest(version=version)
    offset = 0
    for m in metas:
        manifest.tensors.add(name=m.name, dtype=m.dtype_name, shape=list(m.shape), offset=offset,
                             nbytes=m.nbytes)
        offset += m.nbytes
    manifest.total_bytes = offset
    return manifest


def _cast_dtype(have: torch.dtype, want: torch.dtype | None) -> torch.dtype:
    return want if want is not None and have.is_floating_point else have


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_data_chunk(offset: int, pieces: Sequence[memoryview]) -> bytes:
    """A serialized ``Chunk{offset, data}`` built with one copy of the payload.

    Protobuf wire format: field 3 (offset, varint) then field 2 (data, length-delimited);
    ``Chunk.SerializeToString`` would need the joined bytes first, a second copy per chunk.
    """
    size = sum(p.nbytes for p in pieces)
    return b"".join([b"\x18", _varint(offset), b"\x12", _varint(size), *pieces])


def iter_chunks(metas: Sequence[TensorMeta], tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int,
                crcs: list[int]) -> Iterator[bytes]:
    """Serialized data chunks of ``chunk_bytes`` (the last may be short), filling ``crcs`` as it goes."""
    pieces: list[memoryview] = []
    filled = offset = 0
    count = 0
    for meta, (name, tensor) in zip(metas, tensors, strict=True):
        if name != meta.name or tuple(tensor.shape) != meta.shape:
            raise ValueError(f"tensor {name} {list(tensor.shape)} arrived where the manifest has "
                             f"{meta.name} {list(meta.shape)}")
        flat = tensor.detach().to("cpu", meta.dtype).contiguous().reshape(-1)
        view = memoryview(flat.view(torch.uint8).numpy())
        crcs.append(zlib.crc32(view))
        count += 1
        pos = 0
        while pos < view.nbytes:
            take = min(chunk_bytes - filled, view.nbytes - pos)
            pieces.append(view[pos:pos + take])
            filled += take
            pos += take
            if filled == chunk_bytes:
                yield encode_data_chunk(offset, pieces)
                offset += filled
                pieces, filled = [], 0
    if pieces:
        yield encode_data_chunk(offset, pieces)
    if count != len(metas):
        raise ValueError(f"{count} tensors arrived for a manifest of {len(metas)}")


class _StageStream:
    """One server's Stage call, fed from a bounded queue by the producer thread."""

    def __init__(self, address: str, channel: grpc.Channel, metadata: list[tuple[str, str]], timeout: float):
        self.address = address
        self.reply: pb.StageReply | None = None
        self.code: grpc.StatusCode | None = None
        self.error = ""
        self._queue: queue.Queue[bytes | None] = queue.Queue(_QUEUE_DEPTH)
        self._done = threading.Event()
        self._call = channel.stream_unary(_STAGE_METHOD, request_serializer=None,
                                          response_deserializer=pb.StageReply.FromString)
        self._thread = threading.Thread(target=self._run, args=(metadata, timeout), daemon=True,
                                        name=f"stage-{address}")
        self._thread.start()

    def _requests(self) -> Iterator[bytes]:
        while not self._done.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item

    def _run(self, metadata: list[tuple[str, str]], timeout: float) -> None:
        try:
            self.reply = self._call(self._requests(), metadata=metadata, timeout=timeout)
        except grpc.RpcError as exc:
            self.code = exc.code()
            self.error = f"Stage: {exc.code().name}: {exc.details()}"
        finally:
            self._done.set()

    def send(self, item: bytes | None) -> None:
        """Queue one serialized chunk (None ends the stream); a no-op once the call has ended."""
        while not self._done.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        self.send(None)
        self._thread.join()


class CheckpointPusher:
    """Pushes versions to the servers ``servers()`` lists (gRPC ``host:port``), then records the version.

    ``set_version(v)`` runs once at least one server committed ``v`` (writes ``rw:<run>:version``).
    """

    def __init__(self, config: CheckpointConfig, servers: Sequence[str] | Callable[[], Sequence[str]],
                 set_version: Callable[[int], None] | None = None):
        self.config = config
        self._servers = servers if callable(servers) else (lambda: list(servers))
        self._set_version = set_version
        self._metadata = [("authorization", f"Bearer {config.token.get_secret_value()}")]
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        return self._channels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def push_model(self, model: torch.nn.Module, version: int,
                   dtype: torch.dtype | None = None) -> PushReport | None:
        """Push ``model`` (FSDP2-sharded or plain) as ``version``; every rank calls this.

        Rank 0 streams and returns the report; the other ranks only take part in the per-parameter
        all-gathers of each stage pass (rank 0 broadcasts which servers need another pass) and return None.
        ``dtype`` casts floating tensors to the served model's dtype (e.g. bf16 weights from fp32 masters).
        """
        metas = model_metas(model, dtype)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            return iter_full_params(model)  # type: ignore[return-value]  # never None on rank 0

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.push(version, metas, tensors)
        if dist.get_rank() == 0:
            return self.push(version, metas, tensors, _broadcast_from_rank0)
        pending = _broadcast_from_rank0([])
        for _ in range(self.config.retries + 1):
            if not pending:
                break
            for _name_and_none in iter_full_params(model):
                pass
            pending = _broadcast_from_rank0([])
        return None

    def push(self, version: int, metas: Sequence[TensorMeta],
             tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], agree: Agree = _alone) -> PushReport:
        """Stage on every server, commit on those that staged, then record the version.

        ``tensors()`` yields the full tensors in ``metas`` order; it is called once per stage pass.
        ``agree`` makes every rank see rank 0's list of servers to re-stream (identity when unsharded).
        """
        start = time.monotonic()
        report = self.stage(version, metas, tensors, agree)
        self.commit(report)
        if self._set_version is not None and any(s.ok for s in report.servers):
            self._set_version(version)
            report.version_written = True
        report.seconds = time.monotonic() - start
        return report

    def stage(self, version: int, metas: Sequence[TensorMeta],
              tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], agree: Agree = _alone) -> PushReport:
        """Stream the version to every server; a server that failed with a transient error is
        re-streamed (all of them in one more pass) up to ``retries`` times."""
        report = PushReport(version, [ServerPush(a) for a in self._servers()])
        by_address = {s.address: s for s in report.servers}
        manifest = pb.Chunk(manifest=build_manifest(version, metas)).SerializeToString()
        pending = agree(list(by_address))
        for _ in range(self.config.retries + 1):
            if not pending:
                break
            for address in pending:
                by_address[address].stage_attempts += 1
            self._stage_pass(manifest, metas, tensors(), [by_address[a] for a in pending])
            pending = agree([a for a in pending if by_address[a].retry])
        return report

    def commit(self, report: PushReport) -> None:
        """Commit concurrently on every server that staged ``report.version``."""
        staged = [s for s in report.servers if not s.error]
        with ThreadPoolExecutor(max(1, len(staged))) as pool:
            list(pool.map(lambda s: self._commit(s, report.version), staged))

    def _stage_pass(self, manifest: bytes, metas: Sequence[TensorMeta],
                    tensors: Iterable[tuple[str, torch.Tensor]], targets: list[ServerPush]) -> None:
        streams = [_StageStream(t.address, self._channel(t.address), self._metadata, self.config.timeout_s)
                   for t in targets]
        crcs: list[int] = []
        try:  # every tensor is iterated even when all streams failed: other ranks gather in step
            for s in streams:
                s.send(manifest)
            for chunk in iter_chunks(metas, tensors, self.config.chunk_bytes, crcs):
                for s in streams:
                    s.send(chunk)
            trailer = pb.Chunk(trailer=pb.Trailer(crc32=crcs, checksum=trailer_checksum(crcs)))
            for s in streams:
                s.send(trailer.SerializeToString())
        finally:
            for s in streams:
                s.finish()
        for target, s in zip(targets, streams, strict=True):
            target.error, target.retry = s.error, s.code not in _FINAL
            if s.reply is not None:
                target.bytes, target.stage_seconds = s.reply.bytes_received, s.reply.seconds

    def _commit(self, server: ServerPush, version: int) -> None:
        """Commit with retries (backing off); a failed load stays staged on the server, so a retry can work."""
        stub = pb_grpc.CheckpointEngineStub(self._channel(server.address))
        for attempt in range(self.config.retries + 1):
            if attempt:
                time.sleep(min(0.2 * 2**attempt, 5.0))
            server.commit_attempts += 1
            try:
                reply = stub.Commit(pb.CommitRequest(version=version), metadata=self._metadata,
                                    timeout=self.config.timeout_s)
            except grpc.RpcError as exc:
                server.error = f"Commit: {exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and self._committed(stub, version):
                    server.ok, server.error = True, ""
                    return
                if exc.code() in _FINAL:
                    return
                continue
            server.ok, server.error = True, ""
            server.pause_seconds, server.load_seconds = reply.pause_seconds, reply.load_seconds
            return

    def _committed(self, stub: pb_grpc.CheckpointEngineStub, version: int) -> bool:
        """A retried Commit whose first try landed finds the version already current."""
        try:
            status = stub.Status(pb.StatusRequest(), metadata=self._metadata, timeout=self.config.timeout_s)
        except grpc.RpcError:
            return False
        return status.current_version == version
