"""The Stage stream's wire format, shared by the receiver and the pusher: dtypes, chunk parsing,
manifest checks against the served model, checksums, and the staging file written in place."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import xxhash
from pydantic import ValidationError
from transformers import AutoConfig

from core.config import LoraConfig
from core.lora import PREFIX as LORA_PREFIX
from proto import checkpoint_pb2 as pb

# torch dtype name (the manifest's spelling) -> (safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1),
    "uint8": ("U8", 1), "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8), "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
}
_FROM_SAFETENSORS = {st: name for name, (st, _) in DTYPES.items()}
_FLOATING = ("float32", "bfloat16", "float16")
SERVICE = pb.DESCRIPTOR.services_by_name["CheckpointEngine"].full_name
REASON_KEY = "rollwave-reason"  # trailing metadata of a refused call: why, in one word (the metrics' reason label)
MODEL_WEIGHTS = "model.safetensors"  # the one weights file of a staged full-model version
TICKET_BYTES = 32  # a manifest's data_ticket: the pusher's random bytes that admit its stage port connection
DATA_RECEIVED = b"\x06"  # the stage port's one reply: every byte of the payload arrived (the pusher waits for it)
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
# Buffers older checkpoints saved that are computed from the config, never trained: a push never carries them, and
# the engine keeps its own (SGLang's loaders skip them too).
DERIVED_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
TIED_HEAD = "lm_head.weight"  # the output embedding, the input embedding's tensor when the config ties them


def trailer_checksum(digests: Sequence[int]) -> str:
    """The stream checksum: xxh3_64 of the per-tensor digests as little-endian u64 words, 16 hex digits."""
    return f"{xxhash.xxh3_64_intdigest(struct.pack(f'<{len(digests)}Q', *digests)):016x}"


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (names -> dtype, shape, data_offsets)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def ties_word_embeddings(model_dir: Path) -> bool:
    """Whether ``model_dir``'s config ties the output embedding to the input one (the model class's default when
    config.json does not say); False for a config transformers cannot read, so the head stays required."""
    try:
        return bool(AutoConfig.from_pretrained(model_dir, local_files_only=True).tie_word_embeddings)
    except (OSError, ValueError):
        return False


def served_tensor_specs(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (torch dtype name, shape) of every tensor in ``model_dir``'s safetensors files that a full push
    replaces: not the ``DERIVED_BUFFERS``, nor a tied ``TIED_HEAD`` saved beside the input embedding (the trainer's
    model has it as no parameter of its own; the engine's follows the embedding it shares)."""
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
            if not name.endswith(DERIVED_BUFFERS):
                specs[name] = (_FROM_SAFETENSORS[meta["dtype"]], tuple(meta["shape"]))
    head = specs.get(TIED_HEAD)
    if head is not None and any(n != TIED_HEAD and s == head for n, s in specs.items()) \
            and ties_word_embeddings(model_dir):
        del specs[TIED_HEAD]
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
    """A rejected Stage or Commit; ``reason`` labels the failure metrics (both sides), the message names the
    tensor or what failed."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.reason = reason
        self.code = code


TensorSpecs = dict[str, tuple[str | None, tuple[int, ...]]]  # name -> (dtype, None: any floating one; shape)


def adapter_specs(adapter_config: str, served: dict[str, tuple[str, tuple[int, ...]]]) -> TensorSpecs:
    """The tensors a LoRA adapter of the served model must have, by peft's saved names: for every served
    ``<module>.weight`` [out, in] whose module ``adapter_config``'s ``target_modules`` names (the whole name or
    its last parts), ``lora_A`` [r, in] and ``lora_B`` [out, r], in any floating dtype. ``r`` sizes the staged
    file, so it must be in the range the trainer allows (``model.lora.rank``), whatever a manifest claims."""
    try:
        config = json.loads(adapter_config)
        r, targets = config["r"], config["target_modules"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StageError("manifest", f"adapter_config: not a peft LoRA config ({exc!r})") from None
    try:
        rank = LoraConfig(rank=r).rank
    except ValidationError as exc:
        raise StageError("manifest", f"adapter_config: r={r!r}: {exc.errors()[0]['msg']} (model.lora.rank)") from None
    if isinstance(targets, str):
        targets = [targets]
    specs: TensorSpecs = {}
    for name, (_dtype, shape) in served.items():
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or not any(module == t or module.endswith(f".{t}") for t in targets):
            continue
        specs[f"{LORA_PREFIX}{module}.lora_A.weight"] = (None, (rank, shape[1]))
        specs[f"{LORA_PREFIX}{module}.lora_B.weight"] = (None, (shape[0], rank))
    if not specs:
        raise StageError("manifest", f"adapter_config: target_modules {targets} name no Linear weight of the "
                                     "served model")
    return specs


def check_manifest(manifest: pb.Manifest, served: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Raise StageError unless the manifest has exactly the served tensors (or, for an adapter, exactly the
    adapter's tensors; ``adapter_specs``), packed in order."""
    expected: TensorSpecs = adapter_specs(manifest.adapter_config, served) if manifest.adapter_config else served
    names: set[str] = set()
    for t in manifest.tensors:  # one pass over a set: a manifest of n tensors costs O(n), duplicates or not
        if t.name in names:
            raise StageError("manifest", f"tensor {t.name}: listed twice in the manifest")
        names.add(t.name)
    missing = sorted(expected.keys() - names)
    if missing:
        raise StageError("manifest", f"tensor {missing[0]}: missing from the manifest "
                                     f"({len(missing)} missing)")
    extra = sorted(names - expected.keys())
    if extra:
        raise StageError("manifest", f"tensor {extra[0]}: not in the served model ({len(extra)} extra)")
    offset = 0
    for t in manifest.tensors:
        dtype, shape = expected[t.name]
        if dtype is None and t.dtype in _FLOATING:
            dtype = t.dtype
        if t.dtype != dtype:
            want = dtype or f"one of {', '.join(_FLOATING)}"
            raise StageError("manifest", f"tensor {t.name}: dtype {t.dtype}, served model has {want}")
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
    """Writes a staged weights file straight from chunks: header from the manifest, bytes at their offsets."""

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
        self.digests = [xxhash.xxh3_64() for _ in self.tensors]
        self._index = 0
        # An existing file at ``path`` is overwritten in place: its tmpfs pages are reused, not zeroed again.
        size = self.base + self.total
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(self._fd, size)
            os.write(self._fd, struct.pack("<Q", len(raw)) + raw)
            # Allocating the tmpfs pages in one call is ~10x cheaper than faulting them in chunk by chunk; a file
            # with every page allocated is left alone (fallocate would still walk its pages, 13 ms per 390 MiB).
            if os.fstat(self._fd).st_blocks * 512 < size:
                os.posix_fallocate(self._fd, 0, size)
        except BaseException:  # a file system that cannot take it: the caller never gets the file to close
            os.close(self._fd)
            raise

    def write(self, offset: int, data: memoryview) -> None:
        """Append one slice; chunks must arrive in offset order (the digests are computed on the fly)."""
        if offset != self.received or offset + len(data) > self.total:
            raise StageError("offsets", f"chunk at offset {offset} with {len(data)} bytes; expected offset "
                                        f"{self.received}, payload is {self.total} bytes")
        written = 0
        while written < len(data):  # a write the file system cut short goes on, and raises what stopped it
            written += os.pwrite(self._fd, data[written:], self.base + offset + written)
        view, pos = data, 0
        while pos < len(view):
            t = self.tensors[self._index]
            end = t.offset + t.nbytes - (offset + pos)
            if end <= 0:
                self._index += 1
                continue
            self.digests[self._index].update(view[pos:pos + end])
            pos += end
        self.received += len(data)

    def finish(self, trailer: pb.Trailer) -> None:
        """Check the byte count and every tensor's xxh3 digest against the trailer."""
        if self.received != self.total:
            raise StageError("stream", f"stream ended after {self.received} of {self.total} bytes")
        if len(trailer.xxh3) != len(self.tensors):
            raise StageError("checksum", f"trailer has {len(trailer.xxh3)} xxh3 digests for "
                                         f"{len(self.tensors)} tensors")
        digests = [d.intdigest() for d in self.digests]
        for t, got, want in zip(self.tensors, digests, trailer.xxh3, strict=True):
            if got != want:
                raise StageError("checksum", f"tensor {t.name}: xxh3 {got:016x} of received bytes, "
                                             f"pusher sent {want:016x}", grpc.StatusCode.DATA_LOSS)
        expected = trailer_checksum(digests)
        if trailer.checksum != expected:
            raise StageError("checksum", f"stream checksum {trailer.checksum}, expected {expected}",
                             grpc.StatusCode.DATA_LOSS)

    def close(self) -> None:
        os.close(self._fd)
