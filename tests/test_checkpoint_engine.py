"""The gRPC checkpoint engine against two real embedded engine servers generating during pushes.

Each engine runs as its own process; its checkpoint receiver runs in this process on an event loop
in a background thread (as in a rollout server); the pusher streams from a real model.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from net_helpers import refused_port
from pydantic import SecretStr
from transformers import AutoModelForCausalLM, PreTrainedModel

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerInfo, ServerRegistry
from buffer.staleness import StalenessControl
from core.checkpoint_format import GRPC_OPTIONS, SERVICE
from core.config import BufferConfig, CheckpointConfig
from core.net import free_port_outside_ephemeral
from proto import checkpoint_pb2 as pb
from proto import checkpoint_pb2_grpc as pb_grpc
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import (
    CheckpointPusher,
    TensorMeta,
    build_manifest,
    iter_chunks,
    model_metas,
    registered_servers,
)
from trainer.parallel import iter_full_params

TOKEN = secrets.token_urlsafe(32)
PROMPTS = [[5, 17, 99, 4], [300, 2, 41]]
WAIT_S = 60.0


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll until ``predicate()``; fail naming ``what`` if it never holds (a hang guard, not a timing check)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


class Fleet:
    """Two engine processes, each with a checkpoint receiver on this process's background event loop."""

    def __init__(self, model_dir: Path, stage_dir: Path):
        self.model_dir = model_dir
        self.config = CheckpointConfig(token=TOKEN, stage_dir=stage_dir, chunk_bytes=64 << 10, retries=1)
        self.engines = [EngineProcess(model_dir) for _ in range(2)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.clients: list[EngineClient] = []
        self.receivers: list[CheckpointReceiver] = []

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def start(self) -> None:
        self.thread.start()
        for engine in self.engines:
            engine.start()

        async def receivers() -> None:
            for i, engine in enumerate(self.engines):
                client = EngineClient(engine.url)
                receiver = CheckpointReceiver(self.config, self.model_dir, client, engine.url, f"server{i}")
                await receiver.start()
                self.clients.append(client)
                self.receivers.append(receiver)

        self.run(receivers())

    def close(self) -> None:
        async def stop() -> None:
            for receiver in self.receivers:
                await receiver.stop()
            for client in self.clients:
                await client.aclose()

        try:
            self.run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()
            for engine in self.engines:
                engine.close()

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.receivers]

    def pusher(self, **overrides: Any) -> CheckpointPusher:
        return CheckpointPusher(self.config.model_copy(update=overrides), self.addresses)

    def status(self, i: int, token: str = TOKEN) -> pb.StatusReply:
        with grpc.insecure_channel(self.addresses[i]) as channel:
            return pb_grpc.CheckpointEngineStub(channel).Status(
                pb.StatusRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=WAIT_S)

    def version(self) -> int:
        versions = {self.status(i).current_version for i in range(2)}
        assert len(versions) == 1, versions
        return versions.pop()

    def engine_state(self, i: int) -> tuple[str, float]:
        """(weight_version, paused seconds) as the engine itself reports them."""
        url = self.engines[i].url
        version = httpx.get(url + "/model_info", timeout=WAIT_S).json()["weight_version"]
        for line in httpx.get(url + "/metrics", timeout=WAIT_S).text.splitlines():
            if line.startswith("rollwave_engine_paused_seconds_total "):
                return version, float(line.split()[1])
        raise AssertionError("engine /metrics has no rollwave_engine_paused_seconds_total")


def greedy_engine(url: str) -> list[list[int]]:
    body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}}
    return [r["output_ids"] for r in httpx.post(url + "/generate", json=body, timeout=WAIT_S).json()]


@torch.no_grad()
def greedy_reference(model: PreTrainedModel) -> list[list[int]]:
    """Greedy decode with full forwards of the model itself (no engine, no cache)."""
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        for _ in range(12):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def perturbed(model_dir: Path, seed: int, out: Path) -> PreTrainedModel:
    """The tiny model with noise on every weight, saved as an HF dir (a "freshly trained" version)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (p.std() + 0.05))
    model.save_pretrained(out)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    stage_dir = Path("/dev/shm") / f"rollwave-test-{tmp_path_factory.getbasetemp().name}"
    fleet = Fleet(tiny_model_dir, stage_dir)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.close()
        shutil.rmtree(stage_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def base_model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


class Traffic:
    """Sampling requests to every engine in a loop; records (engine, finish time, weight_version)."""

    def __init__(self, urls: list[str]):
        self.done: list[tuple[int, float, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, url), daemon=True) for i, url in enumerate(urls)]

    def _run(self, i: int, url: str) -> None:
        body = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 1.0, "max_new_tokens": 8}}
        with httpx.Client(timeout=WAIT_S) as http:
            while not self._stop.is_set():
                reply = http.post(url + "/generate", json=body)
                if reply.status_code != 200:
                    self.errors.append(reply.text)
                    continue
                self.done.append((i, time.monotonic(), reply.json()["meta_info"]["weight_version"]))

    def finished_after(self, engine: int, t: float) -> list[str]:
        return [v for i, when, v in list(self.done) if i == engine and when > t]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def test_generation_continues_during_stage_and_commit_serves_new_weights(
    fleet: Fleet, tiny_model_dir: Path, tmp_path: Path
) -> None:
    old_version = fleet.version()
    old_engine_version = fleet.engine_state(0)[0]
    version = old_version + 1
    model = perturbed(tiny_model_dir, seed=version, out=tmp_path / "new")
    metas = model_metas(model)
    pusher = fleet.pusher()
    stage_roots = [r.service.stage_root for r in fleet.receivers]
    seen_mid_stage: list[list[str]] = []

    with Traffic([e.url for e in fleet.engines]) as traffic:

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            """Hold the stream open half way until both engines finish requests meanwhile."""
            for i, item in enumerate(iter_full_params(model)):
                if i == len(metas) // 2:
                    wait_for(lambda: all((r / f"v{version}.partial").is_dir() for r in stage_roots),
                             "both servers to be mid-stage")
                    mid = time.monotonic()
                    wait_for(lambda mid=mid: all(traffic.finished_after(e, mid) for e in range(2)),
                             "requests to finish on both engines during the stage")
                    assert all((r / f"v{version}.partial").is_dir() for r in stage_roots)
                    seen_mid_stage.extend(traffic.finished_after(e, mid) for e in range(2))
                yield item

        report = pusher.stage(version, metas, tensors)
        assert [s.error for s in report.servers] == ["", ""]
        assert all(fleet.status(i).staged_version == version for i in range(2))
        pusher.commit(report)
        pusher.close()
        after_commit = time.monotonic()
        wait_for(lambda: all(traffic.finished_after(e, after_commit) for e in range(2)),
                 "requests to finish after the commit")

    assert not traffic.errors
    assert seen_mid_stage and all(v == old_engine_version for vs in seen_mid_stage for v in vs)
    assert all(s.ok and s.pause_seconds > 0 and s.bytes == sum(m.nbytes for m in metas) for s in report.servers)
    expected = greedy_reference(model)
    for i, engine in enumerate(fleet.engines):
        assert fleet.status(i).current_version == version and fleet.status(i).staged_version == -1
        assert fleet.engine_state(i)[0] == str(version)
        assert greedy_engine(engine.url) == expected
        assert sorted(p.name for p in stage_roots[i].iterdir()) == [f"v{version}"]
        registry = fleet.receivers[i].metrics.registry
        assert registry.get_sample_value("rollwave_rollout_policy_version") == version
        assert registry.get_sample_value("rollwave_rollout_pause_duration_seconds_count") >= 1


RANK_SCRIPT = """
import sys
from pathlib import Path
from core.config import CheckpointConfig
from trainer.checkpoint_pusher import CheckpointPusher
from trainer.parallel import close_distributed, init_distributed, load_model

model_dir, version, token, stage_dir, *addresses = sys.argv[1:]
ctx = init_distributed("cpu")
model = load_model(model_dir, ctx)
config = CheckpointConfig(token=token, stage_dir=Path(stage_dir), chunk_bytes=65536)
pusher = CheckpointPusher(config, addresses if ctx.is_main else [])
report = pusher.push_model(model, int(version))
if ctx.is_main:
    print("ok" if report.ok else report, flush=True)
pusher.close()
close_distributed()
"""


def test_fsdp2_ranks_push_gathered_weights(fleet: Fleet, base_model: PreTrainedModel, tmp_path: Path,
                                           tiny_model_dir: Path) -> None:
    """Two gloo ranks shard the model with FSDP2; rank 0 streams each gathered parameter."""
    before = [greedy_engine(e.url) for e in fleet.engines]
    version = fleet.version() + 1
    model = perturbed(tiny_model_dir, seed=100 + version, out=tmp_path / "new")
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_outside_ephemeral())}
    env = {**os.environ, "WORLD_SIZE": "2", **rendezvous}
    args = [sys.executable, "-c", RANK_SCRIPT, str(tmp_path / "new"), str(version), TOKEN,
            str(fleet.config.stage_dir), *fleet.addresses]
    ranks = [subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    outputs = [rank.communicate(timeout=WAIT_S * 2)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert outputs[0].strip().splitlines()[-1] == "ok", outputs[0]
    expected = greedy_reference(model)
    assert expected not in (greedy_reference(base_model), before[0])
    assert [greedy_engine(e.url) for e in fleet.engines] == [expected, expected]
    assert fleet.version() == version


PUSHER_SCRIPT = """
import sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from core.config import CheckpointConfig
from trainer.checkpoint_pusher import CheckpointPusher, model_metas
from trainer.parallel import iter_full_params

model_dir, version, token, stage_dir, *addresses = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
config = CheckpointConfig(token=token, stage_dir=Path(stage_dir), chunk_bytes=4096)

def tensors():
    for i, item in enumerate(iter_full_params(model)):
        if i == 4:
            print("streaming", flush=True)
            time.sleep(3600)
        yield item

CheckpointPusher(config, addresses).push(int(version), model_metas(model), tensors)
"""


def test_killed_pusher_leaves_servers_on_old_version(fleet: Fleet, tmp_path: Path) -> None:
    version = fleet.version()
    before = [greedy_engine(e.url) for e in fleet.engines]
    states = [fleet.engine_state(i) for i in range(2)]
    failures = [r.metrics.registry.get_sample_value("rollwave_rollout_stage_failures_total", {"reason": "stream"})
                or 0.0 for r in fleet.receivers]
    partials = [r.service.stage_root / f"v{version + 1}.partial" for r in fleet.receivers]
    proc = subprocess.Popen([sys.executable, "-c", PUSHER_SCRIPT, str(fleet.model_dir), str(version + 1), TOKEN,
                             str(fleet.config.stage_dir), *fleet.addresses], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "streaming"
        wait_for(lambda: all(p.is_dir() for p in partials), "both servers to be mid-stage")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    wait_for(lambda: not any(p.exists() for p in partials), "the partial stages to be removed")
    for i, receiver in enumerate(fleet.receivers):
        status = fleet.status(i)
        assert (status.current_version, status.staged_version) == (version, -1)
        assert receiver.metrics.registry.get_sample_value(
            "rollwave_rollout_stage_failures_total", {"reason": "stream"}) == failures[i] + 1
        assert fleet.engine_state(i) == states[i]
    assert [greedy_engine(e.url) for e in fleet.engines] == before


def _bad_manifests(model: PreTrainedModel) -> Iterator[tuple[str, list[TensorMeta], dict[str, torch.Tensor]]]:
    """(tensor the error must name, manifest entries, tensors) for each kind of bad manifest."""
    metas = model_metas(model)
    tensors = {m.name: p.detach() for m, p in zip(metas, model.parameters(), strict=True)}
    last = metas[-1].name
    yield last, metas[:-1], tensors
    extra = TensorMeta("model.layers.99.mlp.up_proj.weight", torch.float32, (4, 4))
    yield extra.name, [*metas, extra], {**tensors, extra.name: torch.zeros(4, 4)}
    wrong = TensorMeta(last, torch.float32, (metas[-1].shape[0] + 1,))
    yield last, [*metas[:-1], wrong], {**tensors, last: torch.zeros(wrong.shape)}
    yield metas[0].name, model_metas(model, torch.float16), tensors


def test_bad_manifests_are_rejected_without_a_pause(fleet: Fleet, base_model: PreTrainedModel) -> None:
    states = [fleet.engine_state(i) for i in range(2)]
    version = fleet.version()
    pusher = fleet.pusher()
    for name, metas, tensors in _bad_manifests(base_model):
        report = pusher.push(version + 1, metas, lambda m=metas, t=tensors: ((x.name, t[x.name]) for x in m))
        for server in report.servers:
            assert not server.ok and "INVALID_ARGUMENT" in server.error and f"tensor {name}" in server.error, server
            assert server.stage_attempts == 1
        assert not report.version_written
    pusher.close()
    for i in range(2):
        assert fleet.engine_state(i) == states[i]
        assert (fleet.status(i).current_version, fleet.status(i).staged_version) == (version, -1)
        assert list(fleet.receivers[i].service.stage_root.glob("*.partial")) == []


def _stage_raw(address: str, chunks: list[bytes]) -> grpc.RpcError:
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stage = channel.stream_unary(f"/{SERVICE}/Stage")
        with pytest.raises(grpc.RpcError) as info:
            stage(iter(chunks), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=WAIT_S)
    return info.value


def test_corrupt_data_and_offsets_are_rejected_without_a_pause(fleet: Fleet, base_model: PreTrainedModel) -> None:
    states = [fleet.engine_state(i) for i in range(2)]
    version = fleet.version()
    metas = model_metas(base_model)
    manifest = build_manifest(version + 1, metas)
    crcs: list[int] = []
    data = list(iter_chunks(metas, iter_full_params(base_model), 4096, crcs))
    trailer = pb.Chunk(trailer=pb.Trailer(crc32=crcs, checksum="")).SerializeToString()
    head = pb.Chunk(manifest=manifest).SerializeToString()

    hit = len(data) // 2
    corrupt = pb.Chunk.FromString(data[hit])
    corrupt.data = bytes([corrupt.data[0] ^ 0xFF]) + corrupt.data[1:]
    owner = next(t.name for t in manifest.tensors if t.offset <= corrupt.offset < t.offset + t.nbytes)
    err = _stage_raw(fleet.addresses[0], [head, *data[:hit], corrupt.SerializeToString(), *data[hit + 1:], trailer])
    assert err.code() == grpc.StatusCode.DATA_LOSS and f"tensor {owner}: crc32" in err.details()

    err = _stage_raw(fleet.addresses[1], [head, *data[:hit], *data[hit + 1:], trailer])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected offset" in err.details()

    for i in range(2):
        assert fleet.engine_state(i) == states[i]
        assert (fleet.status(i).current_version, fleet.status(i).staged_version) == (version, -1)
        assert list(fleet.receivers[i].service.stage_root.glob("*.partial")) == []
    assert fleet.receivers[0].metrics.registry.get_sample_value(
        "rollwave_rollout_stage_failures_total", {"reason": "checksum"}) == 1


def test_wrong_or_missing_token_is_unauthenticated(fleet: Fleet, base_model: PreTrainedModel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        fleet.status(0, token="wrong")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(fleet.addresses[0]) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.CheckpointEngineStub(channel).Commit(pb.CommitRequest(version=99), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    report = fleet.pusher(token=SecretStr("wrong")).push_model(base_model, fleet.version() + 1)
    assert report is not None
    assert all("UNAUTHENTICATED" in s.error and s.stage_attempts == 1 for s in report.servers)


def test_versions_only_go_up_newer_stage_supersedes_and_abort(fleet: Fleet, base_model: PreTrainedModel) -> None:
    version = fleet.version()
    pusher = fleet.pusher()
    metas = model_metas(base_model)

    def tensors() -> Iterator[tuple[str, torch.Tensor | None]]:
        return iter_full_params(base_model)

    report = pusher.stage(version, metas, tensors)
    assert all("FAILED_PRECONDITION" in s.error for s in report.servers)
    assert not pusher.stage(version + 1, metas, tensors).servers[0].error
    assert not pusher.stage(version + 2, metas, tensors).servers[0].error
    root = fleet.receivers[0].service.stage_root
    assert fleet.status(0).staged_version == version + 2 and not (root / f"v{version + 1}").exists()
    with grpc.insecure_channel(fleet.addresses[0]) as channel:
        stub = pb_grpc.CheckpointEngineStub(channel)
        auth = [("authorization", f"Bearer {TOKEN}")]
        with pytest.raises(grpc.RpcError) as info:
            stub.Commit(pb.CommitRequest(version=version + 1), metadata=auth, timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert not stub.Abort(pb.AbortRequest(version=version + 1), metadata=auth).dropped
        assert stub.Abort(pb.AbortRequest(version=version + 2), metadata=auth).dropped
    assert fleet.status(0).staged_version == -1 and not (root / f"v{version + 2}").exists()
    assert fleet.status(1).staged_version == version + 2
    assert not pusher.stage(version + 1, metas, tensors).servers[1].error  # the latest stage wins
    assert fleet.status(1).staged_version == version + 1
    pusher.close()


def test_unreachable_server_is_retried_and_reported_while_others_commit(fleet: Fleet,
                                                                       base_model: PreTrainedModel) -> None:
    version = fleet.version() + 1
    with refused_port() as port:
        dead = f"127.0.0.1:{port}"
        pusher = CheckpointPusher(fleet.config, [*fleet.addresses, dead], set_version=lambda v: None)
        report = pusher.push_model(base_model, version)
        pusher.close()
    assert report is not None and not report.ok and report.version_written
    by_address = {s.address: s for s in report.servers}
    assert "UNAVAILABLE" in by_address[dead].error and by_address[dead].stage_attempts == fleet.config.retries + 1
    assert all(by_address[a].ok and by_address[a].stage_attempts == 1 for a in fleet.addresses)
    assert fleet.version() == version


def test_failed_load_continues_on_old_weights_and_reports(fleet: Fleet, base_model: PreTrainedModel) -> None:
    before = [greedy_engine(e.url) for e in fleet.engines]
    version = fleet.version()
    pusher = fleet.pusher()
    report = pusher.stage(version + 1, model_metas(base_model), lambda: iter_full_params(base_model))
    staged = fleet.receivers[0].service.stage_root / f"v{version + 1}"
    (staged / "model.safetensors").unlink()
    pusher.commit(report)
    pusher.close()
    broken, fine = report.servers
    assert not broken.ok and "load failed" in broken.error and broken.commit_attempts == fleet.config.retries + 1
    assert fine.ok
    status = fleet.status(0)
    assert (status.current_version, status.staged_version) == (version, version + 1)
    assert fleet.engine_state(0)[0] == str(version)
    assert greedy_engine(fleet.engines[0].url) == before[0]
    assert fleet.receivers[0].metrics.registry.get_sample_value(
        "rollwave_rollout_commit_failures_total", {"reason": "load"}) == fleet.config.retries + 1
    with grpc.insecure_channel(fleet.addresses[0]) as channel:
        auth = [("authorization", f"Bearer {TOKEN}")]
        assert pb_grpc.CheckpointEngineStub(channel).Abort(pb.AbortRequest(version=version + 1), metadata=auth).dropped
    assert not staged.exists()
    catch_up = CheckpointPusher(fleet.config, fleet.addresses[:1])
    assert catch_up.push_model(base_model, version + 1).ok
    catch_up.close()


def test_push_to_registered_servers_records_the_version(fleet: Fleet, base_model: PreTrainedModel,
                                                         tmp_path: Path) -> None:
    import redis

    server = EmbeddedRedis(tmp_path / "redis", aof=False).start()
    try:
        client = redis.Redis.from_url(server.url)
        keys = Keys("cktest")
        registry = ServerRegistry(client, keys)
        for i, engine in enumerate(fleet.engines):
            registry.register(ServerInfo(f"server{i}", engine.url, grpc_address=fleet.addresses[i]))
        staleness = StalenessControl(client, keys, BufferConfig(max_staleness=1, groups_per_step=1))
        version = fleet.version() + 1
        pusher = CheckpointPusher(fleet.config, registered_servers(registry), staleness.set_version)
        report = pusher.push_model(base_model, version)
        pusher.close()
        assert report is not None and report.ok and report.version_written
        assert sorted(s.address for s in report.servers) == sorted(fleet.addresses)
        assert int(client.get(keys.version)) == version
        client.close()
    finally:
        server.stop()
    assert [greedy_engine(e.url) for e in fleet.engines] == [greedy_reference(base_model)] * 2
