"""The trajectory group: the buffer's unit, and its msgpack wire encoding.

One record per task holds the n samples of one prompt, so group-relative advantages need no
cross-server join. Arrays travel as raw little-endian buffers with a dtype fixed by the schema.

Schema versions: 2 adds the group's sampling ``temperature``; a version-1 group decodes with
``temperature=None`` (not recorded: the trainer falls back to its configured ``rollout.temperature``).
3 adds ``Sample.versions_approximate``; an older group decodes with ``False``. A group of a version above these
(a newer producer, as during a rolling upgrade that upgrades the producers first) raises ``NewerSchema``, which the
trainer keeps aside for a trainer that reads it rather than as malformed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)

FAILED_FINISH_REASONS = ("error", "abort", "reward_error")  # the episode has no valid outcome
TRUNCATED_FINISH_REASONS = ("length", "max_total_tokens")  # cut off by a token limit (a turn's or the context's)

ARRAY_DTYPES: dict[str, np.dtype] = {
    "token_ids": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "behaviour_logprobs": np.dtype("<f4"),
    "token_versions": np.dtype("<i4"),
}


class SchemaError(ValueError):
    """Bytes or fields that do not form a valid trajectory group; the message names the field."""


class NewerSchema(SchemaError):
    """A group tagged with a schema version above those this code reads: written by a newer producer, not broken.
    ``version`` is its version."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


def reads_version(version: int) -> bool:
    """Whether this code decodes groups of schema ``version`` (the trainer restores the groups it kept aside)."""
    return version in READABLE_VERSIONS


@dataclass
class ToolCallRecord:
    """One tool call of an episode, for metrics and inspection."""

    name: str
    ok: bool
    error: str | None = None
    latency_s: float = 0.0


@dataclass
class Sample:
    """One trajectory: prompt + every turn as token ids, with what the trainer needs per token.

    ``loss_mask`` is 1 only on tokens the policy generated; ``behaviour_logprobs`` and
    ``token_versions`` are defined there (0 and -1 elsewhere). ``versions_approximate``: the engine gave no
    per-token versions (SGLang < 0.5.23), so every token of a turn carries the version current when its
    request started; a weight swap during the request makes that label older than some tokens.
    """

    sample_index: int
    token_ids: np.ndarray
    prompt_len: int
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    finish_reason: str = "stop"
    num_turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    queued: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    versions_approximate: bool = False

    def __post_init__(self) -> None:
        for name, dtype in ARRAY_DTYPES.items():
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))

    @property
    def failed(self) -> bool:
        """The episode failed (engine error, abort, tool setup, reward function): it must not be trained on."""
        return self.finish_reason in FAILED_FINISH_REASONS

    @property
    def truncated(self) -> bool:
        """A token limit cut the episode off: its last turn may be unfinished."""
        return self.finish_reason in TRUNCATED_FINISH_REASONS

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def oldest_version(self) -> int | None:
        """Oldest policy version among generated tokens (None when nothing was generated)."""
        versions = self.token_versions[self.loss_mask.astype(bool)]
        return int(versions.min()) if versions.size else None

    def validate(self, where: str = "sample") -> None:
        n = self.token_ids.shape[0]
        for name in ARRAY_DTYPES:
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != n:
                raise SchemaError(f"{where}.{name}: shape {arr.shape} does not match token_ids length {n}")
        if not 0 <= self.prompt_len <= n:
            raise SchemaError(f"{where}.prompt_len: {self.prompt_len} outside [0, {n}]")
        if self.loss_mask.size and self.loss_mask.max() > 1:
            raise SchemaError(f"{where}.loss_mask: values must be 0 or 1")
        if self.loss_mask[: self.prompt_len].any():
            raise SchemaError(f"{where}.loss_mask: is 1 inside the prompt (first {self.prompt_len} tokens)")


@dataclass
class TrajectoryGroup:
    """The n samples of one task; ``group_id`` (= ``task_id``) is the idempotency key.

    ``temperature`` is the one the samples were drawn at, so the trainer scales the logits of this group by
    it (None: not recorded, the trainer's default)."""

    run: str
    job_id: str
    task_id: str
    samples: list[Sample]
    kind: str = "train"
    created: float = field(default_factory=time.time)
    temperature: float | None = None

    @property
    def group_id(self) -> str:
        return self.task_id

    @property
    def rewards(self) -> np.ndarray:
        return np.array([s.reward for s in self.samples], dtype=np.float64)

    def oldest_version(self) -> int | None:
        versions = [v for s in self.samples if (v := s.oldest_version()) is not None]
        return min(versions) if versions else None

    def validate(self) -> None:
        if not self.samples:
            raise SchemaError(f"group {self.group_id}: has no samples")
        if self.temperature is not None and not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise SchemaError(f"group {self.group_id}.temperature: {self.temperature!r} is not a number >= 0")
        for i, sample in enumerate(self.samples):
            sample.validate(f"group {self.group_id}.samples[{i}]")


_SAMPLE_FIELDS = [f.name for f in fields(Sample)]
_GROUP_FIELDS = [f.name for f in fields(TrajectoryGroup)]
_REQUIRED_SAMPLE = ["sample_index", "token_ids", "prompt_len", "loss_mask", "behaviour_logprobs", "token_versions"]
_REQUIRED_GROUP = ["run", "job_id", "task_id", "samples"]
# schema version -> (group fields, sample fields) a group of that version may carry
_KNOWN_FIELDS = {
    version: (frozenset(f for f in _GROUP_FIELDS if version >= 2 or f != "temperature"),
              frozenset(f for f in _SAMPLE_FIELDS if version >= 3 or f != "versions_approximate"))
    for version in READABLE_VERSIONS
}


def _sample_to_wire(s: Sample) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _SAMPLE_FIELDS:
        value = getattr(s, name)
        if name in ARRAY_DTYPES:  # msgpack reads the array's own buffer: no bytes copy
            value = np.ascontiguousarray(value, dtype=ARRAY_DTYPES[name]).data
        elif name == "tool_calls":
            value = [vars(t) for t in value]
        out[name] = value
    return out


def _check_fields(d: Any, required: list[str], known: frozenset[str], where: str) -> None:
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected a map, got {type(d).__name__}")
    missing = [k for k in required if k not in d]
    if missing:
        raise SchemaError(f"{where}: missing field(s) {', '.join(missing)}")
    if not known.issuperset(d):
        raise SchemaError(f"{where}: unknown field(s) {', '.join(sorted(map(str, set(d) - known)))}")


# Wire types, checked field by field before anything computes with them: msgpack yields exact builtin types,
# so ``type(v) in allowed`` is both fast and strict (a bool is not an int here). (allowed types, what the
# error says is expected, must be finite).
_FieldType = tuple[frozenset[type], str, bool]
_INT: _FieldType = (frozenset({int}), "an int", False)
_NUMBER: _FieldType = (frozenset({int, float}), "a number", False)
_FINITE: _FieldType = (frozenset({int, float}), "a finite number", True)
_OPT_FINITE: _FieldType = (frozenset({int, float, type(None)}), "a finite number or nil", True)
_STR: _FieldType = (frozenset({str}), "a str", False)
_OPT_STR: _FieldType = (frozenset({str, type(None)}), "a str or nil", False)
_BOOL: _FieldType = (frozenset({bool}), "a bool", False)
_MAP: _FieldType = (frozenset({dict}), "a map", False)
_LIST: _FieldType = (frozenset({list}), "a list", False)

_GROUP_TYPES = {"run": _STR, "job_id": _STR, "task_id": _STR, "samples": _LIST, "kind": _STR, "created": _NUMBER,
                "temperature": _OPT_FINITE}
_SAMPLE_TYPES = {"sample_index": _INT, "prompt_len": _INT, "reward": _FINITE, "reward_info": _MAP,
                 "finish_reason": _STR, "num_turns": _INT, "tool_calls": _LIST, "messages": _LIST,
                 "queued": _NUMBER, "started": _NUMBER, "finished": _NUMBER, "versions_approximate": _BOOL}
_TOOL_CALL_TYPES = {"name": _STR, "ok": _BOOL, "error": _OPT_STR, "latency_s": _NUMBER}
_TOOL_CALL_FIELDS = frozenset(f.name for f in fields(ToolCallRecord))
# a field added to the dataclasses without a wire type here would go unchecked
assert set(_GROUP_TYPES) == set(_GROUP_FIELDS) and set(_TOOL_CALL_TYPES) == _TOOL_CALL_FIELDS
assert set(_SAMPLE_TYPES) | set(ARRAY_DTYPES) == set(_SAMPLE_FIELDS)


def _wrong_type(d: dict[str, Any], types: dict[str, _FieldType], where: str) -> SchemaError | None:
    """The error naming the first present field of ``d`` without its wire type, or None."""
    for name, value in d.items():
        spec = types.get(name)
        if spec is None:
            continue
        allowed, expected, finite = spec
        if type(value) not in allowed:
            return SchemaError(f"{where}.{name}: expected {expected}, got {type(value).__name__}")
        if finite and type(value) is float and not math.isfinite(value):
            return SchemaError(f"{where}.{name}: expected {expected}, got {value!r}")
    return None


def _sample_from_wire(d: dict[str, Any], known: frozenset[str], where: str) -> Sample:
    """A sample from its wire map, its arrays viewing the message's bytes; ``TrajectoryGroup.validate`` checks it.

    Types are checked here, before anything computes with them, so a bad producer fails naming the field
    and not later in the trainer."""
    _check_fields(d, _REQUIRED_SAMPLE, known, where)
    if (error := _wrong_type(d, _SAMPLE_TYPES, where)) is not None:
        raise error
    kwargs = dict(d)
    for name, dtype in ARRAY_DTYPES.items():
        raw = kwargs[name]
        if not isinstance(raw, bytes | bytearray) or len(raw) % dtype.itemsize:
            raise SchemaError(f"{where}.{name}: not a {dtype} buffer")
        kwargs[name] = np.frombuffer(raw, dtype=dtype)
    messages = kwargs.get("messages")
    if messages and set(map(type, messages)) != {dict}:
        i, bad = next((i, m) for i, m in enumerate(messages) if type(m) is not dict)
        raise SchemaError(f"{where}.messages[{i}]: expected a map, got {type(bad).__name__}")
    calls = kwargs.get("tool_calls")
    if calls:
        kwargs["tool_calls"] = [_tool_call_from_wire(call, where, i) for i, call in enumerate(calls)]
    return Sample(**kwargs)


def _tool_call_from_wire(d: Any, where: str, i: int) -> ToolCallRecord:
    """Tool call ``i`` of a sample; built first and checked after, as most samples carry a few valid ones."""
    try:  # a TypeError: not a map, or a field missing or unknown; _check_fields names it
        record = ToolCallRecord(**d)
    except TypeError:
        record = None
    where = f"{where}.tool_calls[{i}]"
    if record is None:
        _check_fields(d, ["name", "ok"], _TOOL_CALL_FIELDS, where)
    error = _wrong_type(d, _TOOL_CALL_TYPES, where)
    if error is not None:
        raise error
    assert record is not None  # a map with the known fields and their types builds
    return record


def encode_group(group: TrajectoryGroup) -> bytes:
    """msgpack bytes of a validated group, tagged with the schema version."""
    group.validate()
    wire = {name: getattr(group, name) for name in _GROUP_FIELDS if name != "samples"}
    wire["schema_version"] = SCHEMA_VERSION
    wire["samples"] = [_sample_to_wire(s) for s in group.samples]
    return msgpack.packb(wire, use_bin_type=True)


def decode_group(data: bytes) -> TrajectoryGroup:
    """Inverse of ``encode_group``; any defect raises ``SchemaError`` naming the field, a schema version above those
    this code reads ``NewerSchema``."""
    try:
        wire = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as exc:
        raise SchemaError(f"trajectory group: not valid msgpack ({exc})") from None
    if not isinstance(wire, dict):
        raise SchemaError(f"trajectory group: expected a map, got {type(wire).__name__}")
    version = wire.pop("schema_version", None)
    if type(version) is not int or version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        error = f"trajectory group: schema_version {version!r} is not supported (want {readable})"
        if type(version) is int and version > max(READABLE_VERSIONS):
            raise NewerSchema(f"{error}: written by a newer producer", version)
        raise SchemaError(error)
    group_known, sample_known = _KNOWN_FIELDS[version]
    _check_fields(wire, _REQUIRED_GROUP, group_known, "trajectory group")
    where = f"group {wire['task_id']}" if type(wire["task_id"]) is str else "trajectory group"
    if (error := _wrong_type(wire, _GROUP_TYPES, where)) is not None:
        raise error
    wire["samples"] = [_sample_from_wire(s, sample_known, f"{where}.samples[{i}]")
                       for i, s in enumerate(wire["samples"])]
    group = TrajectoryGroup(**wire)
    group.validate()
    return group
