"""Trajectory-group encoding: exact round trip, and clear errors for damaged input."""

import msgpack
import numpy as np
import pytest

from buffer.schema import (
    SCHEMA_VERSION,
    NewerSchema,
    Sample,
    SchemaError,
    ToolCallRecord,
    TrajectoryGroup,
    decode_group,
    encode_group,
)


def make_group(n: int = 3, length: int = 20, prompt_len: int = 6) -> TrajectoryGroup:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        mask = np.zeros(length, dtype=np.uint8)
        mask[prompt_len:] = 1
        mask[prompt_len + 5 : prompt_len + 8] = 0  # a tool turn
        samples.append(
            Sample(
                sample_index=i,
                token_ids=rng.integers(0, 1000, length),
                prompt_len=prompt_len,
                loss_mask=mask,
                behaviour_logprobs=np.where(mask, -rng.random(length), 0.0),
                token_versions=np.where(mask, 3 + (np.arange(length) > 12), -1),
                reward=float(i % 2),
                reward_info={"extracted": "42"},
                finish_reason="stop",
                num_turns=2,
                tool_calls=[ToolCallRecord("calculator", True, None, 0.01)],
                messages=[{"role": "user", "content": "q"}],
                queued=1.0,
                started=2.0,
                finished=3.0,
            )
        )
    return TrajectoryGroup(run="r", job_id="j", task_id="t-1", samples=samples, temperature=0.7)


def test_round_trip_is_exact() -> None:
    group = make_group()
    back = decode_group(encode_group(group))
    assert back.group_id == "t-1" and back.run == "r" and back.job_id == "j" and back.temperature == 0.7
    for a, b in zip(group.samples, back.samples, strict=True):
        for name in ("token_ids", "loss_mask", "behaviour_logprobs", "token_versions"):
            got, want = getattr(b, name), getattr(a, name)
            assert got.dtype == want.dtype and np.array_equal(got, want)
        assert b.tool_calls == a.tool_calls
        for name in ("reward", "reward_info", "messages", "prompt_len"):
            assert getattr(b, name) == getattr(a, name)
    assert back.oldest_version() == 3


def test_truncated_bytes() -> None:
    data = encode_group(make_group())
    with pytest.raises(SchemaError, match="trajectory group"):
        decode_group(data[: len(data) // 2])


@pytest.mark.parametrize("version", [0, -1, "3", None])
def test_wrong_schema_version(version: object) -> None:
    wire = msgpack.unpackb(encode_group(make_group()))
    wire["schema_version"] = version
    with pytest.raises(SchemaError, match=rf"schema_version {version!r} is not supported \(want 1, 2, 3\)$") as err:
        decode_group(msgpack.packb(wire))
    assert type(err.value) is SchemaError  # malformed, not newer


def test_a_newer_schema_version_is_told_apart_from_a_broken_group() -> None:
    """A newer producer's group (a rolling upgrade upgrades producers first) is not malformed: the trainer keeps it
    for a trainer that reads its version, which ``NewerSchema`` carries."""
    wire = msgpack.unpackb(encode_group(make_group()))
    wire["schema_version"] = SCHEMA_VERSION + 1
    newer = r"schema_version 4 is not supported \(want 1, 2, 3\): written by a newer producer"
    with pytest.raises(NewerSchema, match=newer) as err:
        decode_group(msgpack.packb(wire))
    assert err.value.version == 4 and isinstance(err.value, SchemaError)


def test_version_1_groups_decode_without_a_temperature() -> None:
    """A group written before the temperature was recorded: the trainer uses its own default for it."""
    wire = msgpack.unpackb(encode_group(make_group()))
    wire["schema_version"] = 1
    for sample in wire["samples"]:
        del sample["versions_approximate"]
    with pytest.raises(SchemaError, match=r"unknown field\(s\) temperature"):
        decode_group(msgpack.packb(wire))
    del wire["temperature"]
    assert decode_group(msgpack.packb(wire)).temperature is None
    wire["schema_version"] = SCHEMA_VERSION
    wire["temperature"] = -1.0
    with pytest.raises(SchemaError, match=r"group t-1\.temperature: -1\.0 is not a number >= 0"):
        decode_group(msgpack.packb(wire))


def test_version_2_groups_decode_without_approximate_versions() -> None:
    group = make_group()
    group.samples[0].versions_approximate = True
    assert decode_group(encode_group(group)).samples[0].versions_approximate
    wire = msgpack.unpackb(encode_group(make_group()))
    wire["schema_version"] = 2
    with pytest.raises(SchemaError, match=r"unknown field\(s\) versions_approximate"):
        decode_group(msgpack.packb(wire))
    for sample in wire["samples"]:
        del sample["versions_approximate"]
    assert not any(s.versions_approximate for s in decode_group(msgpack.packb(wire)).samples)


@pytest.mark.parametrize("field", ["token_ids", "prompt_len", "loss_mask"])
def test_missing_sample_field(field: str) -> None:
    wire = msgpack.unpackb(encode_group(make_group()))
    del wire["samples"][1][field]
    with pytest.raises(SchemaError, match=rf"samples\[1\]: missing field\(s\) {field}"):
        decode_group(msgpack.packb(wire))


def test_missing_group_field_and_unknown_field() -> None:
    wire = msgpack.unpackb(encode_group(make_group()))
    del wire["task_id"]
    with pytest.raises(SchemaError, match="missing field\\(s\\) task_id"):
        decode_group(msgpack.packb(wire))
    wire = msgpack.unpackb(encode_group(make_group()))
    wire["samples"][0]["extra"] = 1
    with pytest.raises(SchemaError, match="unknown field\\(s\\) extra"):
        decode_group(msgpack.packb(wire))


def test_inconsistent_arrays_are_rejected() -> None:
    group = make_group()
    group.samples[2].behaviour_logprobs = group.samples[2].behaviour_logprobs[:-1]
    with pytest.raises(SchemaError, match=r"samples\[2\]\.behaviour_logprobs: shape"):
        encode_group(group)
    group = make_group()
    group.samples[0].loss_mask[0] = 1
    with pytest.raises(SchemaError, match="loss_mask: is 1 inside the prompt"):
        encode_group(group)
    wire = msgpack.unpackb(encode_group(make_group()))
    wire["samples"][0]["token_ids"] = b"\x00\x01\x02"
    with pytest.raises(SchemaError, match=r"token_ids: not a int32 buffer"):
        decode_group(msgpack.packb(wire))


def test_not_a_map() -> None:
    with pytest.raises(SchemaError, match="expected a map"):
        decode_group(msgpack.packb([1, 2]))


def test_arrays_assigned_after_construction_travel_in_the_schema_dtype() -> None:
    """A float64 or strided array set on a sample later is written as the schema's dtype, not its own bytes."""
    group = make_group()
    sample = group.samples[0]
    sample.behaviour_logprobs = sample.behaviour_logprobs.astype(np.float64)
    sample.token_ids = np.repeat(sample.token_ids.astype(np.int64), 2)[::2]
    back = decode_group(encode_group(group)).samples[0]
    assert back.behaviour_logprobs.dtype == np.dtype("<f4") and back.token_ids.dtype == np.dtype("<i4")
    assert np.array_equal(back.behaviour_logprobs, sample.behaviour_logprobs.astype(np.float32))
    assert np.array_equal(back.token_ids, sample.token_ids)


NAN = float("nan")


@pytest.mark.parametrize(
    ("path", "value", "error"),
    [
        (("run",), 1, r"group t-1\.run: expected a str, got int"),
        (("job_id",), None, r"group t-1\.job_id: expected a str, got NoneType"),
        (("task_id",), 7, r"trajectory group\.task_id: expected a str, got int"),
        (("samples",), {"0": 1}, r"group t-1\.samples: expected a list, got dict"),
        (("kind",), b"train", r"group t-1\.kind: expected a str, got bytes"),
        (("created",), "now", r"group t-1\.created: expected a number, got str"),
        (("temperature",), "0.7", r"group t-1\.temperature: expected a finite number or nil, got str"),
        (("temperature",), NAN, r"group t-1\.temperature: expected a finite number or nil, got nan"),
        (("samples", 1), 5, r"group t-1\.samples\[1\]: expected a map, got int"),
        (("samples", 1, "sample_index"), 1.0, r"samples\[1\]\.sample_index: expected an int, got float"),
        (("samples", 0, "prompt_len"), "8", r"group t-1\.samples\[0\]\.prompt_len: expected an int, got str"),
        (("samples", 0, "prompt_len"), True, r"samples\[0\]\.prompt_len: expected an int, got bool"),
        (("samples", 0, "reward"), "abc", r"samples\[0\]\.reward: expected a finite number, got str"),
        (("samples", 0, "reward"), NAN, r"samples\[0\]\.reward: expected a finite number, got nan"),
        (("samples", 0, "reward"), float("-inf"), r"samples\[0\]\.reward: expected a finite number, got -inf"),
        (("samples", 0, "reward_info"), [1], r"samples\[0\]\.reward_info: expected a map, got list"),
        (("samples", 0, "finish_reason"), 5, r"samples\[0\]\.finish_reason: expected a str, got int"),
        (("samples", 0, "num_turns"), None, r"samples\[0\]\.num_turns: expected an int, got NoneType"),
        (("samples", 0, "tool_calls"), "calc", r"samples\[0\]\.tool_calls: expected a list, got str"),
        (("samples", 0, "messages"), 5, r"samples\[0\]\.messages: expected a list, got int"),
        (("samples", 0, "messages", 0), "hi", r"samples\[0\]\.messages\[0\]: expected a map, got str"),
        (("samples", 0, "queued"), "1", r"samples\[0\]\.queued: expected a number, got str"),
        (("samples", 0, "started"), [], r"samples\[0\]\.started: expected a number, got list"),
        (("samples", 0, "finished"), {}, r"samples\[0\]\.finished: expected a number, got dict"),
        (("samples", 0, "versions_approximate"), 1, r"samples\[0\]\.versions_approximate: expected a bool, got int"),
        (("samples", 2, "tool_calls", 0), "calc", r"samples\[2\]\.tool_calls\[0\]: expected a map, got str"),
        (("samples", 2, "tool_calls", 0, "name"), 3, r"samples\[2\]\.tool_calls\[0\]\.name: expected a str, got int"),
        (("samples", 2, "tool_calls", 0, "ok"), "yes", r"tool_calls\[0\]\.ok: expected a bool, got str"),
        (("samples", 2, "tool_calls", 0, "error"), 1, r"tool_calls\[0\]\.error: expected a str or nil, got int"),
        (("samples", 2, "tool_calls", 0, "latency_s"), "1", r"tool_calls\[0\]\.latency_s: expected a number, got str"),
        (("samples", 2, "tool_calls", 0, "extra"), 1, r"tool_calls\[0\]: unknown field\(s\) extra"),
    ],
)
def test_wrong_field_type_names_the_field(path: tuple, value: object, error: str) -> None:
    """A producer bug must fail decoding, naming the field, not reach the trainer as a str or NaN."""
    wire = msgpack.unpackb(encode_group(make_group()))
    *parents, last = path
    node = wire
    for key in parents:
        node = node[key]
    node[last] = value
    with pytest.raises(SchemaError, match=error):
        decode_group(msgpack.packb(wire))


def test_tool_call_without_a_required_field_names_it() -> None:
    wire = msgpack.unpackb(encode_group(make_group()))
    del wire["samples"][1]["tool_calls"][0]["ok"]
    with pytest.raises(SchemaError, match=r"samples\[1\]\.tool_calls\[0\]: missing field\(s\) ok"):
        decode_group(msgpack.packb(wire))


def test_whole_numbers_decode_where_floats_are_expected() -> None:
    """msgpack keeps 1 and 1.0 apart; a producer writing an int reward or timestamp is still valid."""
    wire = msgpack.unpackb(encode_group(make_group()))
    wire["temperature"] = 1
    wire["samples"][0].update(reward=1, queued=5)
    wire["samples"][0]["tool_calls"][0]["latency_s"] = 0
    group = decode_group(msgpack.packb(wire))
    assert group.temperature == 1 and group.rewards.tolist() == [1.0, 1.0, 0.0]
