"""One policy version frozen for pushing: its bytes in manifest order, shared by every server's Stage stream.

Training goes on while versions stream to the servers, so each version is copied once (a per-parameter
all-gather on FSDP2, cast to the served dtype as it lands: fp32 masters become a bf16 snapshot for a bf16
fleet; a tensor the live servers serve in different dtypes stays in the trainer's) into a host buffer that the
streams read. The buffer goes back to a small pool when the last stream lets go of it: a fresh multi-GiB
buffer would cost its page faults (or a pinned allocation) on the training step's path every push. A stream
to a server that serves another dtype than the snapshot's casts each tensor as it sends it (one tensor at a
time, never a second copy of the model); each stream computes the xxh3 digests of the bytes it sends, which
trail the data.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from core.checkpoint_format import DTYPES, trailer_checksum
from core.lora import adapter_checksum
from proto import checkpoint_pb2 as pb
from trainer.parallel import hf_name


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


def model_metas(model: torch.nn.Module) -> list[TensorMeta]:
    """Manifest entries in ``iter_full_params`` order, in the model's dtypes, from parameter metadata alone (a
    DTensor's ``shape`` is the full, unsharded one), so nothing is gathered to build the manifest."""
    return [TensorMeta(hf_name(name), p.dtype, tuple(p.shape)) for name, p in model.named_parameters()]


def cast_metas(metas: Sequence[TensorMeta], dtypes: Mapping[str, torch.dtype] | None) -> list[TensorMeta]:
    """``metas`` with each floating tensor in the dtype ``dtypes`` gives its name (others unchanged)."""
    out = []
    for m in metas:
        want = (dtypes or {}).get(m.name)
        cast = want is not None and want.is_floating_point and m.dtype.is_floating_point
        out.append(TensorMeta(m.name, want, m.shape) if cast else m)  # type: ignore[arg-type]
    return out


def build_manifest(version: int, metas: Sequence[TensorMeta], adapter_config: str = "") -> pb.Manifest:
    """Tensors packed back to back in manifest order (the layout the receiver requires); ``adapter_config`` marks
    a LoRA adapter's push."""
    manifest = pb.Manifest(version=version, adapter_config=adapter_config)
    offset = 0
    for m in metas:
        manifest.tensors.add(name=m.name, dtype=m.dtype_name, shape=list(m.shape), offset=offset,
                             nbytes=m.nbytes)
        offset += m.nbytes
    manifest.total_bytes = offset
    return manifest


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


class BufferPool:
    """Host buffers for snapshots, reused; ``pin`` allocates page-locked memory (fast GPU -> host copies).

    Only buffers of the size last taken are kept (at most ``keep``): a snapshot's size changes when the servers' dtypes
    do (the first version, taken before any server said what it serves, is in the trainer's fp32, the next ones in the
    fleet's bf16), and a buffer of the old size, kept, held twice the pushed weights in host memory for ever."""

    def __init__(self, pin: bool = False, keep: int = 2):
        self.pin = pin
        self.keep = keep
        self._size = -1  # the bytes of the last buffer taken: the size worth keeping
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._size = nbytes
            self._free = [buf for buf in self._free if buf.numel() == nbytes]
            if self._free:
                return self._free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if buf.numel() == self._size:
                self._free.append(buf)
                del self._free[:-self.keep]


class Snapshot:
    """One version's bytes, read-only, with a reference count: the pusher holds the newest, each server's
    stream holds the one it sends; the buffer returns to the pool when the count reaches zero (without a pool, a
    one-off's, it is freed). A LoRA adapter's snapshot (``adapter_config`` set) also knows the checksum the engine must
    report for it."""

    def __init__(self, version: int, metas: Sequence[TensorMeta], buffer: torch.Tensor, pool: BufferPool | None,
                 adapter_config: str = ""):
        self.version = version
        self.metas = list(metas)
        self.nbytes = buffer.numel()
        self.adapter_config = adapter_config
        self.manifest = pb.Chunk(manifest=build_manifest(version, metas, adapter_config)).SerializeToString()
        self.adapter_checksum = adapter_checksum(self._tensors(buffer)) if adapter_config else ""
        self._buffer: torch.Tensor | None = buffer
        self._pool = pool
        self._refs = 1
        self._lock = threading.Lock()

    def acquire(self) -> Snapshot:
        with self._lock:
            if self._refs == 0:
                raise RuntimeError(f"snapshot of version {self.version} used after its release")
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            buffer = self._buffer if self._refs == 0 else None
            if buffer is not None:
                self._buffer = None
        if buffer is not None and self._pool is not None:
            self._pool.give(buffer)

    def _tensors(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for m in self.metas:
            out[m.name] = buffer[offset:offset + m.nbytes].view(m.dtype).view(m.shape)
            offset += m.nbytes
        return out

    def _tensor(self, meta: TensorMeta, offset: int, out: TensorMeta) -> memoryview:
        """One tensor's bytes as ``out`` wants them: a view of the snapshot, or a cast copy of that tensor."""
        if self._buffer is None:
            raise RuntimeError(f"snapshot of version {self.version} read after its release")
        raw = self._buffer[offset:offset + meta.nbytes]
        if out.dtype != meta.dtype:
            raw = raw.clone().view(meta.dtype).to(out.dtype).view(torch.uint8)
        return memoryview(raw.numpy())

    def manifest_chunk(self, dtypes: Mapping[str, torch.dtype] | None = None, data_ticket: bytes = b"") -> bytes:
        """The Stage stream's first message: the manifest, floating tensors in the dtype ``dtypes`` names; a
        ``data_ticket`` says the bytes follow on the server's stage port."""
        out = cast_metas(self.metas, dtypes)
        if out == self.metas and not data_ticket:
            return self.manifest
        manifest = build_manifest(self.version, out, self.adapter_config)
        manifest.data_ticket = data_ticket
        return pb.Chunk(manifest=manifest).SerializeToString()

    def slices(self, chunk_bytes: int, dtypes: Mapping[str, torch.dtype] | None,
               digests: list[int]) -> Iterator[tuple[int, list[memoryview]]]:
        """The payload as (offset, views) of ``chunk_bytes`` bytes each, in order, floating tensors cast to the
        dtype ``dtypes`` names; each tensor's xxh3 digest is appended to ``digests`` once it has passed."""
        pieces: list[memoryview] = []
        filled = offset = source = 0
        for meta, want in zip(self.metas, cast_metas(self.metas, dtypes), strict=True):
            view = self._tensor(meta, source, want)
            source += meta.nbytes
            digest, pos = xxhash.xxh3_64(), 0
            while pos < view.nbytes:
                take = min(chunk_bytes - filled, view.nbytes - pos)
                pieces.append(view[pos:pos + take])
                digest.update(pieces[-1])  # while the slice is in cache for the copy that sends it
                filled += take
                pos += take
                if filled == chunk_bytes:
                    yield offset, pieces
                    offset += filled
                    pieces, filled = [], 0
            digests.append(digest.intdigest())
        if pieces:
            yield offset, pieces

    def chunks(self, chunk_bytes: int, dtypes: Mapping[str, torch.dtype] | None = None) -> Iterator[bytes]:
        """A whole Stage stream with the data in it: the manifest, ``chunk_bytes`` slices of data, then the
        trailer with the xxh3 digest of each tensor as sent."""
        yield self.manifest_chunk(dtypes)
        digests: list[int] = []
        for offset, pieces in self.slices(chunk_bytes, dtypes, digests):
            yield encode_data_chunk(offset, pieces)
        yield trailer_chunk(digests)


def trailer_chunk(digests: Sequence[int]) -> bytes:
    """The Stage stream's last message: each tensor's xxh3 digest and their checksum."""
    return pb.Chunk(trailer=pb.Trailer(xxh3=digests, checksum=trailer_checksum(digests))).SerializeToString()


def take_snapshot(version: int, metas: Sequence[TensorMeta], tensors: Iterable[tuple[str, torch.Tensor]],
                  pool: BufferPool | None, adapter_config: str = "") -> Snapshot:
    """Copy ``tensors`` (in ``metas`` order) into a pooled buffer, each cast to its manifest dtype on its own
    device first, so the only full copy is the buffer itself. Without a ``pool`` the buffer is a one-off's, freed once
    the snapshot is released (a re-push in another size than the versions': pooled, it stayed beside their buffers)."""
    nbytes = sum(m.nbytes for m in metas)
    buffer = pool.take(nbytes) if pool is not None else torch.empty(nbytes, dtype=torch.uint8)
    offset = 0
    for meta, (name, tensor) in zip(metas, tensors, strict=True):
        if name != meta.name or tuple(tensor.shape) != meta.shape:
            raise ValueError(f"tensor {name} {list(tensor.shape)} arrived where the manifest has "
                             f"{meta.name} {list(meta.shape)}")
        flat = tensor.detach().to(meta.dtype).contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + meta.nbytes].copy_(flat)
        offset += meta.nbytes
    return Snapshot(version, metas, buffer, pool, adapter_config)
