"""Stages the receiver must refuse by name, count and clean up: a staging area that cannot take the version (its
file system says no), and an adapter whose rank would size the staged file beyond any adapter the trainer makes.

The receiver and the pusher are real, on 127.0.0.1; a Stage never reaches the engine, so the receiver's engine
client points at a port that refuses connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from net_helpers import refused_port
from pydantic import SecretStr
from receiver_helpers import started_receiver
from transformers import AutoModelForCausalLM

from core.checkpoint_format import GRPC_OPTIONS, REASON_KEY, SERVICE, StagedFile, served_tensor_specs
from core.config import CheckpointConfig
from core.lora import PREFIX
from proto import checkpoint_pb2 as pb
from rollout_server.checkpoint_receiver import CheckpointReceiver
from trainer.checkpoint_pusher import CheckpointPusher
from trainer.snapshot import TensorMeta, build_manifest

WAIT_S = 60.0


def config(tmp_path: Path) -> CheckpointConfig:
    return CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                            connect_timeout_s=5.0, retries=0)


@contextlib.asynccontextmanager
async def receiver(cfg: CheckpointConfig, model_dir: Path) -> AsyncIterator[CheckpointReceiver]:
    with refused_port() as port:
        async with started_receiver(cfg, model_dir, f"http://127.0.0.1:{port}") as rec:
            yield rec


def failures(rec: CheckpointReceiver, reason: str) -> float:
    return rec.metrics.registry.get_sample_value("rollwave_rollout_stage_failures_total", {"reason": reason}) or 0.0


def open_files_under(root: Path) -> list[str]:
    """This process's open file descriptors on files under ``root``."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [p for p in paths if p.startswith(str(root))]


@contextlib.contextmanager
def max_file_bytes(limit: int) -> Iterator[None]:
    """Files of this process cannot grow past ``limit`` bytes (EFBIG, as a full tmpfs gives ENOSPC)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_write_the_file_system_cuts_short_is_an_error_not_a_hole(tmp_path: Path) -> None:
    """A staged file whose writes stop taking bytes part way (a size limit reached after the file was sized, as
    a tmpfs filling up) raises on the write that cannot finish: before, the bytes past the cut were dropped while
    the digests, computed from the bytes received, still matched the trailer."""
    meta = TensorMeta("w", torch.float32, (1 << 18,))  # 1 MiB
    staged = StagedFile(tmp_path / "model.safetensors", build_manifest(1, [meta]))
    try:
        with max_file_bytes(staged.base + meta.nbytes // 2), pytest.raises(OSError) as err:
            staged.write(0, memoryview(bytes(meta.nbytes)))
        assert err.value.errno == errno.EFBIG
    finally:
        staged.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_staging_area_that_cannot_take_the_version_is_a_named_counted_refusal(
    tiny_model_dir: Path, tmp_path: Path, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The staged weights file cannot be sized (a full tmpfs, a file size limit): the Stage is refused with reason
    ``storage`` naming the staging directory and the OS error (it used to end as gRPC UNKNOWN "Unexpected
    OSError", uncounted, leaving the staged file's descriptor open), logged with the server's id, counted on both
    sides, and nothing is left staged or open."""
    cfg = config(tmp_path).model_copy(update={"stage_transport": transport})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = (tiny_model_dir / "model.safetensors").stat().st_size
    others = max(p.stat().st_size for p in tiny_model_dir.iterdir() if p.suffix != ".safetensors")
    assert others < weights // 2  # the limit below stops the weights file alone

    async def run() -> None:
        async with receiver(cfg, tiny_model_dir) as rec:
            pusher = CheckpointPusher(cfg, [rec.address])
            try:
                with max_file_bytes(weights // 2):
                    pushed = await asyncio.to_thread(lambda: pusher.push_model(model, version=1).wait(WAIT_S))
                (result,) = pushed.servers
                assert not result.ok and (result.stage, result.reason) == ("stage", "storage"), result
                assert "RESOURCE_EXHAUSTED" in result.error and "v1.partial: File too large" in result.error, \
                    result.error
                assert pusher.metrics.registry.get_sample_value(
                    "rollwave_trainer_push_failures_total",
                    {"stage": "stage", "reason": "storage"}) == 1
                assert failures(rec, "storage") == 1
                assert "rollout-0: stage refused (storage)" in caplog.text
                root = rec.service.stage_root
                assert list(root.iterdir()) == [] and open_files_under(root) == []
                status = rec.service._state
                assert (status.current, status.staged) == (0, -1)
            finally:
                await asyncio.to_thread(pusher.close)

    asyncio.run(run())


def stage(address: str, token: str, chunks: list[bytes]) -> grpc.RpcError:
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        call = channel.stream_unary(f"/{SERVICE}/Stage", response_deserializer=pb.StageReply.FromString)
        with pytest.raises(grpc.RpcError) as info:
            call(iter(chunks), metadata=[("authorization", f"Bearer {token}")], timeout=WAIT_S)
    return info.value


@pytest.mark.parametrize("rank", [0, 1025, 1 << 40])
def test_an_adapter_rank_outside_lora_rank_is_refused_before_its_file_is_sized(tiny_model_dir: Path, tmp_path: Path,
                                                                               rank: int) -> None:
    """The adapter's tensors are sized by its config's ``r``, so a manifest consistent with any ``r`` passed the
    checks: r = 2^40 claimed petabytes (and ended as an uncounted OSError), r = 1025 had the receiver allocate a
    staged file for an adapter no trainer makes, r = 0 staged an empty adapter whose scale divides by zero.
    ``r`` must be in ``model.lora.rank``'s range; the refusal names it, before anything is staged."""
    cfg = config(tmp_path)
    served = served_tensor_specs(tiny_model_dir)
    metas = []
    for name, (_dtype, shape) in served.items():
        if name.endswith(".q_proj.weight"):
            module, (out, inp) = name.removesuffix(".weight"), shape
            metas += [TensorMeta(f"{PREFIX}{module}.lora_A.weight", torch.float32, (rank, inp)),
                      TensorMeta(f"{PREFIX}{module}.lora_B.weight", torch.float32, (out, rank))]
    adapter_config = json.dumps({"r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]})
    manifest = pb.Chunk(manifest=build_manifest(1, metas, adapter_config)).SerializeToString()

    async def run() -> None:
        async with receiver(cfg, tiny_model_dir) as rec:
            err = await asyncio.to_thread(stage, rec.address, cfg.token.get_secret_value(), [manifest])
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert f"adapter_config: r={rank}" in err.details() and "(model.lora.rank)" in err.details(), err.details()
            assert dict(err.trailing_metadata() or ())[REASON_KEY] == "manifest"
            assert failures(rec, "manifest") == 1
            assert list(rec.service.stage_root.glob("*")) == []

    asyncio.run(run())
