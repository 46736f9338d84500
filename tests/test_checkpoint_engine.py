"""The gRPC checkpoint engine against two real embedded engine servers generating during pushes.

Each engine runs as its own process; its checkpoint receiver runs in this process on an event loop
in a background thread (as in a rollout server); the pusher streams from a real model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest
import torch
from engine_helpers import metric
from net_helpers import refused_port
from pydantic import SecretStr
from transformers import AutoModelForCausalLM, PreTrainedModel

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerInfo, ServerRegistry
from buffer.staleness import StalenessControl
from core.checkpoint_auth import NONCE_BYTES, proof
from core.checkpoint_format import GRPC_OPTIONS, SERVICE, StageError, check_manifest
from core.config import TRAINER_CERT_NAME, BufferConfig, CheckpointConfig
from core.net import free_port_outside_ephemeral
from proto import checkpoint_pb2 as pb
from proto import checkpoint_pb2_grpc as pb_grpc
from rollout_server import checkpoint_receiver
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import CheckpointPusher, PushRound, registered_servers
from trainer.parallel import iter_full_params
from trainer.snapshot import BufferPool, Snapshot, TensorMeta, model_metas, take_snapshot

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
    """``size`` engine processes (two by default), each with a checkpoint receiver on this process's background
    event loop; ``config`` overrides the receivers' checkpoint settings."""

    def __init__(self, model_dir: Path, stage_dir: Path, log_dir: Path, size: int = 2, **config: Any):
        self.model_dir = model_dir
        self.config = CheckpointConfig(token=TOKEN, stage_dir=stage_dir, chunk_bytes=64 << 10, retries=1,
                                       connect_timeout_s=5.0, **config)
        self.engines = [EngineProcess(model_dir, log_path=log_dir / f"engine{i}.log") for i in range(size)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.clients: list[EngineClient] = []
        self.receivers: list[CheckpointReceiver] = []
        self.committed: list[list[int]] = [[] for _ in range(size)]  # each receiver's on_commit calls

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def start(self) -> None:
        self.thread.start()
        for engine in self.engines:
            engine.start()

        async def receivers() -> None:
            for i, engine in enumerate(self.engines):
                client = EngineClient(engine.url)
                receiver = CheckpointReceiver(self.config, self.model_dir, client, engine.url, f"server{i}",
                                              on_commit=self.committed[i].append)
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
        return status_of(self.addresses[i], token)

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


AUTH = [("authorization", f"Bearer {TOKEN}")]


def status_of(address: str, token: str = TOKEN) -> pb.StatusReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.CheckpointEngineStub(channel).Status(
            pb.StatusRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=WAIT_S)


def push_once(config: CheckpointConfig, addresses: list[str], model: PreTrainedModel, version: int) -> PushRound:
    """One push of ``model`` as ``version`` by a pusher of its own, waited for; the pusher is closed."""
    pusher = CheckpointPusher(config, addresses)
    try:
        pushed = pusher.push_model(model, version=version)
        assert pushed is not None
        pushed.wait(WAIT_S)
        return pushed
    finally:
        pusher.close()


def snapshot_of(model: torch.nn.Module, version: int) -> Snapshot:
    return take_snapshot(version, model_metas(model), iter_full_params(model), BufferPool())  # type: ignore[arg-type]


def stage_raw(address: str, chunks: Iterator[bytes]) -> pb.StageReply:
    """One Stage call with the given serialized chunks (no pusher): raises grpc.RpcError when refused."""
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stage = channel.stream_unary(f"/{SERVICE}/Stage", response_deserializer=pb.StageReply.FromString)
        return stage(chunks, metadata=AUTH, timeout=WAIT_S)


def commit_raw(address: str, version: int) -> pb.CommitReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.CheckpointEngineStub(channel).Commit(pb.CommitRequest(version=version), metadata=AUTH,
                                                            timeout=WAIT_S)


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
    fleet = Fleet(tiny_model_dir, stage_dir, tmp_path_factory.mktemp("fleet"))
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
    snapshot = snapshot_of(model, version)
    stage_roots = [r.service.stage_root for r in fleet.receivers]
    seen_mid_stage: list[list[str]] = []
    half = threading.Barrier(3)

    with Traffic([e.url for e in fleet.engines]) as traffic:

        def held(chunks: Iterator[bytes]) -> Iterator[bytes]:
            """Hold the stream open half way until both engines finish requests meanwhile."""
            for i, chunk in enumerate(chunks):
                if i == snapshot.nbytes // (2 * 4096):
                    half.wait(WAIT_S)
                    half.wait(WAIT_S)
                yield chunk

        replies: dict[int, pb.StageReply] = {}
        streams = [threading.Thread(target=lambda i=i: replies.update({i: stage_raw(
            fleet.addresses[i], held(snapshot.chunks(4096)))})) for i in range(2)]
        for t in streams:
            t.start()
        half.wait(WAIT_S)
        wait_for(lambda: all((r / f"v{version}.partial").is_dir() for r in stage_roots), "both servers mid-stage")
        mid = time.monotonic()
        wait_for(lambda: all(traffic.finished_after(e, mid) for e in range(2)),
                 "requests to finish on both engines during the stage")
        assert all((r / f"v{version}.partial").is_dir() for r in stage_roots)
        seen_mid_stage.extend(traffic.finished_after(e, mid) for e in range(2))
        half.wait(WAIT_S)
        for t in streams:
            t.join()
        assert [replies[i].bytes_received for i in range(2)] == [snapshot.nbytes] * 2
        assert all(fleet.status(i).staged_version == version for i in range(2))
        commits = [commit_raw(a, version) for a in fleet.addresses]
        after_commit = time.monotonic()
        wait_for(lambda: all(traffic.finished_after(e, after_commit) for e in range(2)),
                 "requests to finish after the commit")

    assert not traffic.errors
    assert seen_mid_stage and all(v == old_engine_version for vs in seen_mid_stage for v in vs)
    assert all(c.pause_seconds > 0 for c in commits)
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
from trainer.parallel import close_distributed, exit_rank, init_distributed, load_model

model_dir, version, token, stage_dir, *addresses = sys.argv[1:]
ctx = init_distributed("cpu")
model = load_model(model_dir, ctx)
config = CheckpointConfig(token=token, stage_dir=Path(stage_dir), chunk_bytes=65536)
pusher = CheckpointPusher(config, addresses if ctx.is_main else [])
pushed = pusher.push_model(model, version=int(version))
if ctx.is_main:
    pushed.wait(60)
    print("ok" if pushed.ok else [s.error for s in pushed.servers], flush=True)
pusher.close()
close_distributed()
exit_rank()
"""


def test_fsdp2_ranks_push_gathered_weights(fleet: Fleet, base_model: PreTrainedModel, tmp_path: Path,
                                           tiny_model_dir: Path) -> None:
    """Two gloo ranks shard the model with FSDP2; rank 0 snapshots each gathered parameter and pushes."""
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


STREAM_SCRIPT = """
import sys, threading, time
from pathlib import Path
import grpc, torch
from transformers import AutoModelForCausalLM
from core.checkpoint_auth import NONCE_BYTES, proof
from core.checkpoint_format import GRPC_OPTIONS, SERVICE, StageError, check_manifest
from trainer.parallel import iter_full_params
from trainer.snapshot import BufferPool, model_metas, take_snapshot

model_dir, version, token, *addresses = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
snapshot = take_snapshot(int(version), model_metas(model), iter_full_params(model), BufferPool())

def cut(chunks, started):
    for i, chunk in enumerate(chunks):
        if i == 4:
            started.release()
            time.sleep(3600)
        yield chunk

started = threading.Semaphore(0)
for address in addresses:
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    stage = channel.stream_unary(f"/{SERVICE}/Stage")
    threading.Thread(target=stage, args=(cut(snapshot.chunks(4096), started),),
                     kwargs={"metadata": [("authorization", f"Bearer {token}")]}, daemon=True).start()
for _ in addresses:
    started.acquire()
print("streaming", flush=True)
time.sleep(3600)
"""


def test_killed_pusher_leaves_servers_on_old_version(fleet: Fleet, tmp_path: Path) -> None:
    version = fleet.version()
    before = [greedy_engine(e.url) for e in fleet.engines]
    states = [fleet.engine_state(i) for i in range(2)]
    failures = [r.metrics.registry.get_sample_value("rollwave_rollout_stage_failures_total", {"reason": "stream"})
                or 0.0 for r in fleet.receivers]
    partials = [r.service.stage_root / f"v{version + 1}.partial" for r in fleet.receivers]
    proc = subprocess.Popen([sys.executable, "-c", STREAM_SCRIPT, str(fleet.model_dir), str(version + 1), TOKEN,
                             *fleet.addresses], stdout=subprocess.PIPE, text=True)
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


def test_bad_manifests_are_rejected_without_a_pause(fleet: Fleet, base_model: PreTrainedModel) -> None:
    states = [fleet.engine_state(i) for i in range(2)]
    version = fleet.version()
    pusher = fleet.pusher()
    for name, metas, tensors in _bad_manifests(base_model):
        pushed = pusher.push(metas, ((m.name, tensors[m.name]) for m in metas), version=version + 1).wait(WAIT_S)
        for server in pushed.servers:
            assert not server.ok and (server.stage, server.reason) == ("stage", "manifest"), server
            assert "INVALID_ARGUMENT" in server.error and f"tensor {name}" in server.error, server
            assert server.stage_attempts == 1
        assert not pushed.published
    assert pusher.published == 0
    pusher.close()
    for i in range(2):
        assert fleet.engine_state(i) == states[i]
        assert (fleet.status(i).current_version, fleet.status(i).staged_version) == (version, -1)
        assert list(fleet.receivers[i].service.stage_root.glob("*.partial")) == []


def _refused(address: str, chunks: list[bytes]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stage_raw(address, iter(chunks))
    return info.value


def test_corrupt_data_and_offsets_are_rejected_without_a_pause(fleet: Fleet, base_model: PreTrainedModel) -> None:
    states = [fleet.engine_state(i) for i in range(2)]
    version = fleet.version()
    head, *data, trailer = snapshot_of(base_model, version + 1).chunks(4096)
    manifest = pb.Chunk.FromString(head).manifest

    hit = len(data) // 2
    corrupt = pb.Chunk.FromString(data[hit])
    corrupt.data = bytes([corrupt.data[0] ^ 0xFF]) + corrupt.data[1:]
    owner = next(t.name for t in manifest.tensors if t.offset <= corrupt.offset < t.offset + t.nbytes)
    err = _refused(fleet.addresses[0], [head, *data[:hit], corrupt.SerializeToString(), *data[hit + 1:], trailer])
    assert err.code() == grpc.StatusCode.DATA_LOSS and f"tensor {owner}: xxh3" in err.details()
    assert dict(err.trailing_metadata())["rollwave-reason"] == "checksum"

    err = _refused(fleet.addresses[1], [head, *data[:hit], *data[hit + 1:], trailer])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected offset" in err.details()

    def manifest_failures() -> float:
        return fleet.receivers[0].metrics.registry.get_sample_value(
            "rollwave_rollout_stage_failures_total", {"reason": "manifest"}) or 0.0

    before = manifest_failures()
    field = pb.Chunk.DESCRIPTOR.fields_by_name["manifest"].number
    garbage = bytes([field << 3 | 2, 3]) + b"\xff\xff\xff"  # a manifest field whose bytes are no Manifest
    err = _refused(fleet.addresses[0], [garbage, *data, trailer])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "the Manifest does not parse" in err.details()
    assert manifest_failures() == before + 1

    half = {t.name: torch.float16 for t in manifest.tensors}  # a pusher that ignored the served dtypes
    err = _refused(fleet.addresses[1], list(snapshot_of(base_model, version + 1).chunks(4096, half)))
    first = manifest.tensors[0].name
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tensor {first}: dtype float16, served model has float32" in err.details()

    for i in range(2):
        assert fleet.engine_state(i) == states[i]
        assert (fleet.status(i).current_version, fleet.status(i).staged_version) == (version, -1)
        assert list(fleet.receivers[i].service.stage_root.glob("*.partial")) == []
    assert fleet.receivers[0].metrics.registry.get_sample_value(
        "rollwave_rollout_stage_failures_total", {"reason": "checksum"}) == 1


def test_wrong_or_missing_token_is_unauthenticated(
    fleet: Fleet, base_model: PreTrainedModel, caplog: pytest.LogCaptureFixture
) -> None:
    def refused() -> float:
        return fleet.receivers[0].metrics.registry.get_sample_value(
            "rollwave_rollout_checkpoint_refused_total", {"reason": "unauthenticated"}) or 0.0

    before = refused()
    with pytest.raises(grpc.RpcError) as info:
        fleet.status(0, token="wrong")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(fleet.addresses[0]) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.CheckpointEngineStub(channel).Commit(pb.CommitRequest(version=99), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert refused() == before + 2
    assert caplog.text.count("refused: missing or wrong checkpoint token") == 2
    pushed = push_once(fleet.config.model_copy(update={"token": SecretStr("wrong")}), fleet.addresses, base_model,
                       fleet.version() + 1)
    # the servers' proofs do not check under the pusher's token, so it never sends that token
    assert all((s.stage, s.reason) == ("prove", "unproven") for s in pushed.servers)


def test_versions_only_go_up_newer_stage_supersedes_and_abort(fleet: Fleet, base_model: PreTrainedModel) -> None:
    version = fleet.version()
    address = fleet.addresses[0]
    err = _refused(address, list(snapshot_of(base_model, version).chunks(4096)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    stage_raw(address, snapshot_of(base_model, version + 1).chunks(4096))
    stage_raw(address, snapshot_of(base_model, version + 2).chunks(4096))
    root = fleet.receivers[0].service.stage_root
    assert fleet.status(0).staged_version == version + 2 and not (root / f"v{version + 1}").exists()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CheckpointEngineStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Commit(pb.CommitRequest(version=version + 1), metadata=AUTH, timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(info.value.trailing_metadata())["rollwave-reason"] == "version"
        assert not stub.Abort(pb.AbortRequest(version=version + 1), metadata=AUTH).dropped
        assert stub.Abort(pb.AbortRequest(version=version + 2), metadata=AUTH).dropped
    assert fleet.status(0).staged_version == -1 and not (root / f"v{version + 2}").exists()
    stage_raw(address, snapshot_of(base_model, version + 2).chunks(4096))
    stage_raw(address, snapshot_of(base_model, version + 1).chunks(4096))  # the latest stage wins
    assert fleet.status(0).staged_version == version + 1
    with grpc.insecure_channel(address) as channel:
        assert pb_grpc.CheckpointEngineStub(channel).Abort(pb.AbortRequest(version=version + 1), metadata=AUTH).dropped


@pytest.mark.parametrize("quorum,published", [("majority", True), ("all", False), (2, True), (3, False)])
def test_quorum_publishes_without_an_unreachable_server(
    fleet: Fleet, base_model: PreTrainedModel, quorum: str | int, published: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Two live servers and one nobody answers at: the version is published once the quorum committed;
    otherwise the error names every server that failed, with its stage and reason (here why the channel to it
    never came up)."""
    version = fleet.version() + 1
    with refused_port() as port:
        dead = f"127.0.0.1:{port}"
        config = fleet.config.model_copy(update={"quorum": quorum, "connect_timeout_s": 1.0})
        pusher = CheckpointPusher(config, [*fleet.addresses, dead])
        pushed = pusher.push_model(base_model, version=version)
        assert pushed is not None
        pushed.wait(WAIT_S)
        pusher.close()
    by_address = {s.address: s for s in pushed.servers}
    assert (by_address[dead].stage, by_address[dead].reason) == ("connect", "unavailable")
    why = f"server {dead} ({dead}): connect: not connected within its 1 s deadline: failed to connect"
    assert why in by_address[dead].error and "Connection refused" in by_address[dead].error, by_address[dead].error
    assert all(by_address[a].ok and by_address[a].stage_attempts == 1 for a in fleet.addresses)
    assert fleet.version() == version
    assert pushed.published == published and pusher.published == (version if published else 0)
    failures = pusher.metrics.registry.get_sample_value(
        "rollwave_trainer_push_failures_total", {"stage": "connect", "reason": "unavailable"})
    assert failures == 1
    unpublished = pusher.metrics.registry.get_sample_value("rollwave_trainer_push_unpublished_total")
    assert unpublished == (0 if published else 1)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    if published:
        assert not errors
    else:
        assert errors == [f"version {version} not published: committed on 2 of 3 servers, quorum 3. "
                          f"{by_address[dead].error}"]


def test_the_next_stage_overwrites_the_served_file_in_place(fleet: Fleet, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """A stage reuses the served version's weights file (its tmpfs pages), and the engines serve the new bytes;
    a stage that fails after taking the file leaves the served weights alone, and the next one starts afresh."""
    first, second = perturbed(tiny_model_dir, 11, tmp_path / "a"), perturbed(tiny_model_dir, 12, tmp_path / "b")
    version = fleet.version()
    root = fleet.receivers[0].service.stage_root
    pusher = fleet.pusher()
    assert pusher.push_model(first, version=version + 1).wait(WAIT_S).ok
    served = (root / f"v{version + 1}" / "model.safetensors").stat()
    assert pusher.push_model(second, version=version + 2).wait(WAIT_S).ok
    staged = (root / f"v{version + 2}" / "model.safetensors").stat()
    assert (staged.st_ino, staged.st_size) == (served.st_ino, served.st_size)
    assert not (root / f"v{version + 1}").exists()
    assert all(greedy_engine(e.url) == greedy_reference(second) for e in fleet.engines)

    head, *data, trailer = snapshot_of(first, version + 3).chunks(4096)
    corrupt = pb.Chunk.FromString(data[-1])
    corrupt.data = bytes([corrupt.data[0] ^ 0xFF]) + corrupt.data[1:]
    err = _refused(fleet.addresses[0], [head, *data[:-1], corrupt.SerializeToString(), trailer])
    assert err.code() == grpc.StatusCode.DATA_LOSS
    assert fleet.status(0).current_version == version + 2
    assert greedy_engine(fleet.engines[0].url) == greedy_reference(second)
    assert pusher.push_model(first, version=version + 3).wait(WAIT_S).ok
    assert all(greedy_engine(e.url) == greedy_reference(first) for e in fleet.engines)
    pusher.close()


@pytest.mark.parametrize(("prepare", "kv_on_swap", "ahead"),
                         [(True, "recompute", True), (False, "recompute", True), (True, "keep", True),
                          (True, "recompute", False)])
def test_a_prepared_version_is_swapped_in_and_unprepared_is_copied(tiny_model_dir: Path, tmp_path: Path,
                                                                  prepare: bool, kv_on_swap: str, ahead: bool) -> None:
    """With ``checkpoint.prepare_weights`` (the default) the engine holds a spare copy of its weights after a
    commit (what it served before the swap); without, the load copies in the pause and nothing more is held.
    Prepared under ``kv_on_swap: recompute`` (the default) with ``checkpoint.prefill_ahead`` (the default), the
    engine also computes the KV of the request running through each commit under the new weights before the
    pause. Either way the engine serves the pushed weights and the pause is timed."""
    stage_dir = Path("/dev/shm") / f"rollwave-prepare-{tmp_path.name}"
    fleet = Fleet(tiny_model_dir, stage_dir, tmp_path, size=1, prepare_weights=prepare, kv_on_swap=kv_on_swap,
                  prefill_ahead=ahead)
    sampling = {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}
    long = {"input_ids": PROMPTS[0], "sampling_params": sampling}
    try:
        fleet.start()
        [engine] = fleet.engines
        pusher = fleet.pusher()
        with ThreadPoolExecutor(1) as pool:
            for version, seed in ((1, 21), (2, 22)):
                model = perturbed(tiny_model_dir, seed, tmp_path / f"v{version}")
                started = metric(engine.url, "rollwave_engine_generated_tokens_total")
                running = pool.submit(httpx.post, engine.url + "/generate", json=long, timeout=WAIT_S)
                wait_for(lambda started=started: metric(engine.url, "rollwave_engine_generated_tokens_total")
                         > started + 5, "the long request to start")
                [server] = pusher.push_model(model, version=version).wait(WAIT_S).servers
                assert server.ok and server.pause_seconds > 0, server
                assert running.result().json()["meta_info"]["weight_version"] == str(version)  # it spanned the swap
                assert greedy_engine(engine.url) == greedy_reference(model)
        pusher.close()
        weights, spare = (metric(engine.url, f'rollwave_engine_memory_bytes{{kind="{kind}"}}')
                          for kind in ("weights", "spare_weights"))
        assert weights > 0 and spare == (weights if prepare else 0)
        computed = metric(engine.url, "rollwave_engine_ahead_tokens_total")
        assert (computed >= 2 * len(PROMPTS[0])) == (prepare and kv_on_swap == "recompute" and ahead), computed
    finally:
        fleet.close()
        shutil.rmtree(stage_dir, ignore_errors=True)


def test_failed_load_continues_on_old_weights_and_reports(fleet: Fleet, base_model: PreTrainedModel) -> None:
    before = [greedy_engine(e.url) for e in fleet.engines]
    version = fleet.version()
    address = fleet.addresses[0]
    committed = len(fleet.committed[0])
    stage_raw(address, snapshot_of(base_model, version + 1).chunks(4096))
    staged = fleet.receivers[0].service.stage_root / f"v{version + 1}"
    (staged / "model.safetensors").unlink()
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as info:
            commit_raw(address, version + 1)
        assert info.value.code() == grpc.StatusCode.INTERNAL and "load failed" in info.value.details()
        assert dict(info.value.trailing_metadata())["rollwave-reason"] == "load"
        status = fleet.status(0)  # still staged, so a retried Commit can work
        assert (status.current_version, status.staged_version) == (version, version + 1)
    assert fleet.engine_state(0)[0] == str(version)
    assert greedy_engine(fleet.engines[0].url) == before[0]
    assert fleet.receivers[0].metrics.registry.get_sample_value(
        "rollwave_rollout_commit_failures_total", {"reason": "load"}) == 2
    with grpc.insecure_channel(address) as channel:
        assert pb_grpc.CheckpointEngineStub(channel).Abort(pb.AbortRequest(version=version + 1), metadata=AUTH).dropped
    assert not staged.exists()
    catch_up = CheckpointPusher(fleet.config, fleet.addresses[:1])
    assert catch_up.push_model(base_model, version=version + 1).wait(WAIT_S).ok
    catch_up.close()
    assert fleet.status(0).current_version == version + 1
    assert fleet.pusher().push_model(base_model, version=version + 2).wait(WAIT_S).ok  # both level again
    assert fleet.committed[0][committed:] == [version + 1, version + 2]  # the worker hears of loads, not failures


def test_push_to_registered_servers_records_the_version(fleet: Fleet, base_model: PreTrainedModel,
                                                         tmp_path: Path) -> None:
    import redis

    server = EmbeddedRedis(tmp_path / "redis", aof=False).start()
    try:
        client = redis.Redis.from_url(server.url)
        keys = Keys("cktest")
        registry = ServerRegistry(client, keys)
        version = fleet.version()
        for i, engine in enumerate(fleet.engines):
            registry.register(ServerInfo(f"server{i}", engine.url, grpc_address=fleet.addresses[i], version=version))
        staleness = StalenessControl(client, keys, BufferConfig(max_staleness=1, groups_per_step=1))
        pusher = CheckpointPusher(fleet.config, registered_servers(registry), staleness, record=registry.record_push)
        pushed = pusher.push_model(base_model, unacked=3)  # numbered above the versions the servers report serving
        assert pushed is not None and pushed.version == version + 1
        pushed.wait(WAIT_S)
        pusher.close()
        assert pushed.ok and pushed.published and pusher.published == version + 1
        assert sorted(s.server_id for s in pushed.servers) == ["server0", "server1"]
        assert int(client.get(keys.version)) == version + 1
        assert int(client.get(keys.version_trained)) == 3  # the groups its weights were trained on, not yet acked
        assert staleness.capacity() == 3 + (1 + 1) * 1  # trained + (η + 1) × groups per version
        records = registry.pushes()
        assert sorted(records) == ["server0", "server1"]
        assert all(r.ok and not r.straggler and r.version == r.serves == version + 1 for r in records.values())
        client.close()
    finally:
        server.stop()
    assert [greedy_engine(e.url) for e in fleet.engines] == [greedy_reference(base_model)] * 2


def test_stage_deadline_grows_with_bytes_over_min_throughput(fleet: Fleet, base_model: PreTrainedModel,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Stage's deadline is ``stage_timeout_s`` + bytes / ``min_throughput_mib_s``: a server slower than that
    minimum misses it (here every server: the deadline is about a millisecond), and commits with the defaults.
    The server tells its data connection the same deadline, so under load its refusal can arrive first. The
    Stages that ended leave no error behind in the servers' logs (asyncio's "never retrieved" of their data
    connection's end)."""
    version = fleet.version() + 1
    strict = CheckpointPusher(fleet.config.model_copy(update={"stage_timeout_s": 1e-3, "min_throughput_mib_s": 1e6}),
                              fleet.addresses)
    missed = strict.push_model(base_model, version=version)
    assert missed is not None
    missed.wait(WAIT_S)
    strict.close()
    assert all((s.stage, s.reason) == ("stage", "timeout") and s.stage_attempts == 1 for s in missed.servers), \
        missed.servers
    # whichever side's clock ends it first: the pusher's call deadline, or the server's own for the data connection
    assert all("stage: no answer within its 0.00" in s.error or "bytes by the Stage's deadline" in s.error
               for s in missed.servers), missed.servers
    assert fleet.version() == version - 1 and not missed.published
    pusher = fleet.pusher()
    assert pusher.push_model(base_model, version=version).wait(WAIT_S).ok
    pusher.close()
    assert fleet.version() == version
    gc.collect()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    cancelled = [r.getMessage() for r in caplog.records if "cancelled (its deadline" in r.getMessage()]
    # the peer, taken before gRPC forgets it; or, where the call ended before it began, that
    assert all(m.startswith(("server0: Stage from ipv4:127.0.0.1:", "server1: Stage from ipv4:127.0.0.1:"))
               or "Stage from a caller gone before the call began cancelled" in m for m in cancelled), cancelled


def received(fleet: Fleet, i: int, name: str, **labels: str) -> float:
    """A sample of receiver ``i``'s metrics (0 before the first)."""
    return fleet.receivers[i].metrics.registry.get_sample_value(name, labels) or 0.0


def read_to_close(sock: socket.socket) -> None:
    """Read until the server closes the connection: what it sends first (a TLS alert) is not weights."""
    sock.settimeout(WAIT_S)
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(4096):
            pass


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_stage_transport_carries_the_bytes_on_the_port_or_in_the_call(
    fleet: Fleet, base_model: PreTrainedModel, transport: str
) -> None:
    """``checkpoint.stage_transport``: tcp (the default) sends a push's bytes on each server's stage port, which
    ``Status`` tells; grpc sends them in the Stage call itself. Either way every byte arrives and commits."""
    version = fleet.version() + 1
    nbytes = sum(m.nbytes for m in model_metas(base_model))
    came = {"tcp": "port", "grpc": "stream"}[transport]
    before = {(i, t): received(fleet, i, "rollwave_rollout_stage_bytes_total", transport=t)
              for i in range(2) for t in ("port", "stream")}
    assert [fleet.status(i).stage_port for i in range(2)] == [r.stage_port for r in fleet.receivers]
    assert all(r.stage_port not in (0, r.port) for r in fleet.receivers)
    pusher = fleet.pusher(stage_transport=transport)
    pushed = pusher.push_model(base_model, version=version).wait(WAIT_S)
    pusher.close()
    assert pushed.ok, pushed.servers
    assert fleet.version() == version
    for (i, t), was in before.items():
        got = received(fleet, i, "rollwave_rollout_stage_bytes_total", transport=t) - was
        assert got == (nbytes if t == came else 0), (i, t, got)


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_chunk_bytes_is_the_size_of_the_pieces_a_stage_is_sent_in(
    fleet: Fleet, base_model: PreTrainedModel, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checkpoint.chunk_bytes``: a push's bytes leave the pusher in slices of that many bytes (the last holds the
    rest), sent each on the stage port (tcp) or as one Stage message (grpc: the receiver gets one data message per
    slice, of that size). 64 KiB and the default 1 MiB give different numbers of pieces, ceil(bytes / chunk_bytes)."""
    sent: list[list[int]] = []  # the pusher: each Stage's slices' sizes, in order
    got: list[int] = []  # the receivers: the sizes of the Stage data messages they parsed
    slices, parse = Snapshot.slices, checkpoint_receiver.parse_chunk

    def spy_slices(self: Snapshot, *args: Any) -> Iterator[tuple[int, list[memoryview]]]:
        sizes: list[int] = []
        sent.append(sizes)
        for offset, pieces in slices(self, *args):
            assert offset == sum(sizes)
            sizes.append(sum(p.nbytes for p in pieces))
            yield offset, pieces

    def spy_parse(message: bytes) -> tuple[str, int, memoryview]:
        kind, offset, payload = parse(message)
        if kind == "data":
            got.append(len(payload))
        return kind, offset, payload

    monkeypatch.setattr(Snapshot, "slices", spy_slices)
    monkeypatch.setattr(checkpoint_receiver, "parse_chunk", spy_parse)
    counts = {}
    for chunk_bytes in (64 << 10, CheckpointConfig().chunk_bytes):
        sent.clear()
        got.clear()
        version = fleet.version() + 1
        pusher = fleet.pusher(stage_transport=transport, chunk_bytes=chunk_bytes)
        pushed = pusher.push_model(base_model, version=version).wait(WAIT_S)
        pusher.close()
        assert pushed.ok, pushed.servers
        [nbytes] = {s.bytes for s in pushed.servers}
        n = -(-nbytes // chunk_bytes)
        expected = [chunk_bytes] * (n - 1) + [nbytes - (n - 1) * chunk_bytes]
        assert sent == [expected] * 2  # one Stage per server
        assert sorted(got) == (sorted(expected * 2) if transport == "grpc" else [])
        counts[chunk_bytes] = n
    assert counts[64 << 10] > counts[1 << 20] > 1, counts


def test_stage_port_refuses_connections_without_a_stage_ticket(fleet: Fleet, base_model: PreTrainedModel) -> None:
    """A stage port connection whose ticket no Stage holds, and one that sends no ticket, are closed after
    ``connect_timeout_s`` with nothing written, logged and counted (reasons ``ticket`` and ``handshake_timeout``);
    a push meanwhile is not disturbed."""
    port, stage_port = fleet.receivers[0].stage_port, fleet.receivers[0].service.stage_port
    assert stage_port is not None
    wait_for(lambda: not stage_port.connections, "connections of earlier pushes to be settled")
    reasons = ("ticket", "handshake_timeout")
    before = [received(fleet, 0, "rollwave_rollout_checkpoint_refused_total", reason=r) for r in reasons]
    version = fleet.version() + 1
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as forged, \
            socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as silent:
        forged.sendall(secrets.token_bytes(32))
        pusher = fleet.pusher()
        assert pusher.push_model(base_model, version=version).wait(WAIT_S).ok
        pusher.close()
        for sock in (forged, silent):
            read_to_close(sock)
    assert [received(fleet, 0, "rollwave_rollout_checkpoint_refused_total", reason=r) for r in reasons] == \
        [n + 1 for n in before]
    assert fleet.version() == version
    wait_for(lambda: not stage_port.connections, "the refused connections' threads to end")


def test_a_stalled_stage_port_transfer_ends_with_its_stage_and_frees_the_port(
    fleet: Fleet, base_model: PreTrainedModel
) -> None:
    """A Stage whose data connection stops half way fails by the call's deadline: the server drops the partial
    stage, keeps its version, closes the connection and its thread ends; the next push commits."""
    version = fleet.version() + 1
    snapshot = snapshot_of(base_model, version)
    ticket = secrets.token_bytes(32)
    receiver = fleet.receivers[0]
    failures = received(fleet, 0, "rollwave_rollout_stage_failures_total", reason="timeout") + \
        received(fleet, 0, "rollwave_rollout_stage_failures_total", reason="stream")
    with socket.create_connection(("127.0.0.1", receiver.stage_port), timeout=WAIT_S) as data:
        data.sendall(ticket + bytes(1000))
        with grpc.insecure_channel(receiver.address, options=GRPC_OPTIONS) as channel:
            stage = channel.stream_unary(f"/{SERVICE}/Stage", response_deserializer=pb.StageReply.FromString)
            last = pb.Chunk(trailer=pb.Trailer()).SerializeToString()
            with pytest.raises(grpc.RpcError) as err:
                stage(iter([snapshot.manifest_chunk(None, ticket), last]), metadata=AUTH, timeout=2.0)
        assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT)
        read_to_close(data)
    wait_for(lambda: not receiver.service.stage_port.connections, "the stage port's connection thread to end")
    wait_for(lambda: received(fleet, 0, "rollwave_rollout_stage_failures_total", reason="timeout")
             + received(fleet, 0, "rollwave_rollout_stage_failures_total", reason="stream") == failures + 1,
             "the failed stage to be counted")
    assert not any(receiver.service.stage_root.glob("*.partial"))
    assert fleet.status(0).current_version == version - 1 and fleet.status(0).staged_version != version
    pusher = fleet.pusher()
    assert pusher.push_model(base_model, version=version).wait(WAIT_S).ok
    pusher.close()


RECEIVER_SCRIPT = """
import asyncio, sys
from pathlib import Path
from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient

async def main(model, engine_url, stage_dir, token, pause_timeout_s):
    async with EngineClient(engine_url) as client:
        config = CheckpointConfig(token=token, stage_dir=Path(stage_dir), pause_timeout_s=float(pause_timeout_s))
        receiver = CheckpointReceiver(config, Path(model), client, engine_url, "frozen")
        print(await receiver.start(), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await receiver.stop()

asyncio.run(main(*sys.argv[1:]))
"""


@contextlib.contextmanager
def lone_server(model_dir: Path, stage_dir: Path, pause_timeout_s: float = 60.0
                ) -> Iterator[tuple[EngineProcess, subprocess.Popen, str]]:
    """A third server, outside the fleet: its own engine, and its receiver in a process of its own (so either
    can be frozen). Yields the engine, the receiver process and its address; both are continued and stopped."""
    engine = EngineProcess(model_dir).start()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER_SCRIPT, str(model_dir), engine.url, str(stage_dir), TOKEN,
                             str(pause_timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield engine, proc, proc.stdout.readline().strip()
    finally:
        for pid in (proc.pid, engine.pid):
            os.kill(pid, signal.SIGCONT)
        proc.communicate(timeout=WAIT_S)
        engine.close()


def test_frozen_server_misses_its_deadline_then_gets_only_the_newest_version(
    fleet: Fleet, base_model: PreTrainedModel, tiny_model_dir: Path
) -> None:
    """A third server's receiver is frozen with SIGSTOP: it misses its deadline while the others commit and the
    version is published; versions pushed meanwhile are not replayed to it after SIGCONT: the watcher brings it
    the newest one."""
    with lone_server(tiny_model_dir, fleet.config.stage_dir) as (_, proc, frozen):
        pusher = CheckpointPusher(fleet.config.model_copy(update={"connect_timeout_s": 2.0}),
                                  [*fleet.addresses, frozen])
        version = fleet.version() + 1
        rounds: list[PushRound] = []

        def push() -> PushRound:
            pushed = pusher.push_model(base_model, version=version + len(rounds))
            assert pushed is not None
            rounds.append(pushed)
            return pushed

        assert push().wait(WAIT_S).ok  # every channel is connected before the freeze
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            stalled = push().wait(WAIT_S)
            by_address = {s.address: s for s in stalled.servers}
            assert (by_address[frozen].stage, by_address[frozen].reason) == ("connect", "timeout")
            assert "connect: no answer within its 2 s deadline" in by_address[frozen].error
            assert stalled.published and pusher.published == stalled.version == fleet.version()
            for _ in range(3):  # pushed faster than the frozen server fails them: one at least waits and is replaced
                push()
            for pushed in rounds:
                pushed.wait(WAIT_S)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        newest = rounds[-1].version
        wait_for(lambda: status_of(frozen).current_version == newest, "the frozen server to catch up")
        pusher.close()
        results = [r for r in pusher.take_results() if r.address == frozen]
        assert sorted(r.version for r in results if r.ok) == [version, newest]
        skipped = [r.version for r in results if r.skipped]
        failed = [r.version for r in results if not (r.ok or r.skipped)]
        assert skipped and newest not in skipped and sorted(skipped + failed) == list(range(version + 1, newest + 1))
        assert pusher.metrics.registry.get_sample_value(
            "rollwave_trainer_push_failures_total", {"stage": "connect", "reason": "timeout"}
        ) == len(failed)


def test_commit_deadline_then_the_late_commit_lands(base_model: PreTrainedModel, tiny_model_dir: Path,
                                                   fleet: Fleet) -> None:
    """The engine (not the receiver) is frozen: Stage succeeds, Commit misses ``commit_timeout_s``. The swap
    runs on, shielded from the abandoned call: after SIGCONT the version serves and the engine generates."""
    with lone_server(tiny_model_dir, fleet.config.stage_dir) as (engine, _, address):
        pusher = CheckpointPusher(fleet.config.model_copy(update={"commit_timeout_s": 1.0}), [address])
        assert pusher.push_model(base_model, version=1).wait(WAIT_S).ok
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            late = pusher.push_model(base_model, version=2)
            assert late is not None
            [result] = late.wait(WAIT_S).servers
            assert (result.stage, result.reason) == ("commit", "timeout"), result
            assert "commit: no answer within its 1 s deadline" in result.error
            assert status_of(address).current_version == 1
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        wait_for(lambda: status_of(address).current_version == 2, "the late commit to land")
        assert httpx.get(engine.url + "/model_info", timeout=WAIT_S).json()["weight_version"] == "2"
        assert greedy_engine(engine.url) == greedy_reference(base_model)  # not left paused
        assert pusher.push_model(base_model, version=3).wait(WAIT_S).ok
        pusher.close()


def test_pause_deadline_names_the_stage_and_the_engine_is_continued_after(
    base_model: PreTrainedModel, tiny_model_dir: Path, fleet: Fleet
) -> None:
    """``checkpoint.pause_timeout_s`` on the receiver: an engine that does not pause in time fails the Commit
    at once (not after the pusher's Commit deadline), naming the server and the stage; the late pause is then
    followed by its continue, so the engine generates again and takes the next version."""
    with lone_server(tiny_model_dir, fleet.config.stage_dir, pause_timeout_s=1.0) as (engine, _, address):
        pusher = CheckpointPusher(fleet.config.model_copy(update={"commit_timeout_s": 300.0}), [address])
        assert pusher.push_model(base_model, version=1).wait(WAIT_S).ok
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            late = pusher.push_model(base_model, version=2)
            assert late is not None
            [result] = late.wait(WAIT_S).servers
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        assert (result.stage, result.reason, result.commit_attempts) == ("commit", "pause_timeout", 1), result
        assert f"server {address} ({address}): commit: DEADLINE_EXCEEDED: version 2: pause: no answer from the " \
               "engine within 1 s" in result.error
        assert greedy_engine(engine.url) == greedy_reference(base_model)  # continued after its late pause
        assert pusher.push_model(base_model, version=3).wait(WAIT_S).ok
        assert status_of(address).current_version == 3
        pusher.close()


class Impostor:
    """A gRPC server speaking the checkpoint protocol without the token, as a fake registration in Redis would:
    it records every call it gets (method, metadata, bytes). ``answer(nonce)`` is its reply to the challenge."""

    def __init__(self, answer: Callable[[bytes], pb.ProveReply]):
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.staged_bytes = 0

        def record(method: str, context: grpc.ServicerContext) -> None:
            self.calls.append((method, {k: str(v) for k, v in context.invocation_metadata()}))

        def prove(request: pb.ProveRequest, context: grpc.ServicerContext) -> pb.ProveReply:
            record("Prove", context)
            return answer(request.nonce)

        def status(request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
            record("Status", context)
            return pb.StatusReply(current_version=0, staged_version=-1)

        def stage(chunks: Iterator[pb.Chunk], context: grpc.ServicerContext) -> pb.StageReply:
            record("Stage", context)
            self.staged_bytes += sum(len(c.data) for c in chunks)
            return pb.StageReply()

        def commit(request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitReply:
            record("Commit", context)
            return pb.CommitReply(version=request.version)

        unary = grpc.unary_unary_rpc_method_handler
        self.server = grpc.server(ThreadPoolExecutor(4), options=GRPC_OPTIONS)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Prove": unary(prove, pb.ProveRequest.FromString, pb.ProveReply.SerializeToString),
            "Status": unary(status, pb.StatusRequest.FromString, pb.StatusReply.SerializeToString),
            "Stage": grpc.stream_unary_rpc_method_handler(stage, pb.Chunk.FromString, pb.StageReply.SerializeToString),
            "Commit": unary(commit, pb.CommitRequest.FromString, pb.CommitReply.SerializeToString),
        }),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None).wait(WAIT_S)


def test_servers_that_cannot_prove_the_token_get_no_token_and_no_weights(
    fleet: Fleet, base_model: PreTrainedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three fake servers registered in Redis beside the real ones: one answers the challenge with random
    bytes, one relays it to a real server, one relays it and claims to be that server. None is sent the token
    (no metadata at all) or a byte of weights; each push to them is refused at stage prove, logged and
    counted, and the real servers commit the version."""
    import redis

    def relay(nonce: bytes, server_id: str) -> pb.ProveReply:
        with grpc.insecure_channel(fleet.addresses[0]) as channel:
            real = pb_grpc.CheckpointEngineStub(channel).Prove(pb.ProveRequest(nonce=nonce), timeout=WAIT_S)
        return pb.ProveReply(server_id=server_id, proof=real.proof)

    fakes = {"forger": Impostor(lambda nonce: pb.ProveReply(server_id="forger", proof=secrets.token_bytes(32))),
             "relay": Impostor(lambda nonce: relay(nonce, "relay")),
             "liar": Impostor(lambda nonce: relay(nonce, "server0"))}
    why = {"forger": "could not prove it holds the checkpoint token", "relay": "could not prove it holds the "
           "checkpoint token", "liar": "the server at this address says it is 'server0', not the registered one"}
    server = EmbeddedRedis(tmp_path / "redis", aof=False).start()
    try:
        client = redis.Redis.from_url(server.url)
        registry = ServerRegistry(client, Keys("impostors"))
        version = fleet.version()
        for i, engine in enumerate(fleet.engines):
            registry.register(ServerInfo(f"server{i}", engine.url, grpc_address=fleet.addresses[i], version=version))
        for name, fake in fakes.items():
            registry.register(ServerInfo(name, "http://127.0.0.1:9", grpc_address=fake.address, version=version))
        pusher = CheckpointPusher(fleet.config, registered_servers(registry), record=registry.record_push)
        pushed = pusher.push_model(base_model, version=version + 1)
        assert pushed is not None
        pushed.wait(WAIT_S)
        pusher.close()
        by_id = {s.server_id: s for s in pushed.servers}
        assert by_id["server0"].ok and by_id["server1"].ok and fleet.version() == version + 1
        for name, fake in fakes.items():
            assert (by_id[name].stage, by_id[name].reason) == ("prove", "unproven"), by_id[name]
            assert why[name] in by_id[name].error and "sent it no token and no weights" in by_id[name].error
            assert [method for method, _ in fake.calls] == ["Prove"], fake.calls
            assert not any("authorization" in metadata for _, metadata in fake.calls)
            assert fake.staged_bytes == 0
            assert registry.pushes()[name].stage == "prove"
            assert any(f"server {name} ({fake.address}): prove:" in r.getMessage() for r in caplog.records
                       if r.levelname == "WARNING")
        assert pusher.metrics.registry.get_sample_value(
            "rollwave_trainer_push_failures_total", {"stage": "prove", "reason": "unproven"}) == len(fakes)
        client.close()
    finally:
        server.stop()
        for fake in fakes.values():
            fake.stop()


def test_a_proof_binds_the_address_and_the_server_id(fleet: Fleet) -> None:
    """A real receiver's answer checks only for its own id and the address it is reached at."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    refused = fleet.receivers[1].metrics.registry.get_sample_value(
        "rollwave_rollout_checkpoint_refused_total", {"reason": "nonce"}) or 0.0
    with grpc.insecure_channel(fleet.addresses[1]) as channel:
        stub = pb_grpc.CheckpointEngineStub(channel)
        reply = stub.Prove(pb.ProveRequest(nonce=nonce), timeout=WAIT_S)  # no token needed
        with pytest.raises(grpc.RpcError) as info:
            stub.Prove(pb.ProveRequest(nonce=b"short"), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fleet.receivers[1].metrics.registry.get_sample_value(
        "rollwave_rollout_checkpoint_refused_total", {"reason": "nonce"}) == refused + 1
    assert reply.server_id == "server1"
    assert reply.proof == proof(TOKEN, nonce, "server1", fleet.addresses[1])
    assert reply.proof != proof(TOKEN, nonce, "server1", fleet.addresses[0])
    assert reply.proof != proof(TOKEN, nonce, "server0", fleet.addresses[1])
    assert reply.proof != proof(secrets.token_urlsafe(32), nonce, "server1", fleet.addresses[1])


def test_a_version_far_above_the_served_one_is_refused(fleet: Fleet, base_model: PreTrainedModel) -> None:
    """A token holder cannot stage 2^63-1 (``checkpoint.max_version_jump``, default 10^6): the trainer keeps
    versions to push."""
    version = fleet.version()
    err = _refused(fleet.addresses[0], list(snapshot_of(base_model, 2**63 - 1).chunks(4096)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "max_version_jump=1000000" in err.details()
    assert dict(err.trailing_metadata())["rollwave-reason"] == "version"
    assert fleet.status(0).staged_version == -1
    pusher = fleet.pusher()
    assert pusher.push_model(base_model, version=version + 1_000_000).wait(WAIT_S).ok  # at the ceiling: taken
    pusher.close()
    assert fleet.version() == version + 1_000_000


class CountingName(str):
    """A tensor name that counts the equality comparisons made on it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountingName.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_duplicate_manifest_names_are_found_in_linear_time() -> None:
    """n tensors with the repeat last: the check compares names O(n) times, not O(n^2)."""
    n = 3000
    names = [CountingName(f"model.layers.{i}.weight") for i in range(n)]
    tensors = [SimpleNamespace(name=name) for name in [*names, names[-1]]]
    served = {str(name): ("float32", (1,)) for name in names}
    CountingName.compared = 0
    with pytest.raises(StageError, match=rf"tensor model.layers.{n - 1}.weight: listed twice"):
        check_manifest(SimpleNamespace(tensors=tensors, total_bytes=0, adapter_config=""), served)  # type: ignore[arg-type]
    assert CountingName.compared <= n


def make_pki(out: Path, name: str, server_san: str = "IP:127.0.0.1") -> SimpleNamespace:
    """A throwaway CA (openssl CLI) and two certificates it signs: a server's (for 127.0.0.1), a client's."""
    openssl = shutil.which("openssl")
    assert openssl, "the TLS tests need the openssl command (Debian package openssl)"
    out.mkdir(parents=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=out, timeout=WAIT_S)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", f"/CN={name}-ca")
    for leaf, san in (("server", server_san), ("client", "DNS:trainer")):
        run("req", *key, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", f"/CN={name}-{leaf}",
            "-addext", f"subjectAltName={san}")
        run("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{leaf}.pem", "-days", "1", "-copy_extensions", "copy")
    files = {f"{leaf}_{part}": out / f"{leaf}.{ext}" for leaf in ("server", "client")
             for part, ext in (("cert", "pem"), ("key", "key"))}
    return SimpleNamespace(ca=out / "ca.pem", **files)


def test_checkpoint_plane_over_mutual_tls(tiny_model_dir: Path, base_model: PreTrainedModel, tmp_path: Path) -> None:
    """``checkpoint.tls_cert/tls_key/tls_ca``: the receiver serves TLS and wants a client certificate from its
    CA that names ``tls_client_name`` (here ``trainer``); a pusher with one pushes; a plaintext pusher, a pusher
    with another CA's certificate, one that does not trust the server's CA, and one presenting a certificate of
    the right CA with another name (the receiver's own: these allow any use) all fail to connect and leave the
    version as it was; the last is counted as refused for its certificate. The receiver also has
    ``max_version_jump`` 5: a jump of 6 is refused, 5 is taken. The stage port is TLS too: the push's bytes came
    there, and a plaintext connection to it is refused (reason ``tls``)."""
    pki, other = make_pki(tmp_path / "pki", "rollwave"), make_pki(tmp_path / "other", "other")
    stage_dir = Path("/dev/shm") / f"rollwave-tls-{tmp_path.name}"
    tls = Fleet(tiny_model_dir, stage_dir, tmp_path, size=1, tls_cert=pki.server_cert, tls_key=pki.server_key,
                tls_ca=pki.ca, tls_client_name="trainer", max_version_jump=5)
    try:
        tls.start()
        [address], [receiver] = tls.addresses, tls.receivers
        assert receiver.version == 0

        def push(version: int, **client: Any) -> PushRound:
            return push_once(tls.config.model_copy(update=client), [address], base_model, version)

        mine = {"tls_cert": pki.client_cert, "tls_key": pki.client_key, "tls_ca": pki.ca}
        assert push(1, **mine).ok and receiver.version == 1
        assert received(tls, 0, "rollwave_rollout_stage_bytes_total", transport="port") > 0  # TLS on the port too
        with socket.create_connection(("127.0.0.1", receiver.stage_port), timeout=WAIT_S) as plaintext:
            plaintext.sendall(secrets.token_bytes(32))
            read_to_close(plaintext)
        wait_for(lambda: received(tls, 0, "rollwave_rollout_checkpoint_refused_total", reason="tls") == 1,
                 "the plaintext connection to be counted (the failed handshake closes it first)")
        handshake_fails = {"connect_timeout_s": 1.0}  # the handshake never completes: the connect times out
        refused = [
            push(2, tls_cert=None, tls_key=None, tls_ca=None, **handshake_fails),  # plaintext
            push(2, tls_cert=other.client_cert, tls_key=other.client_key, tls_ca=pki.ca,  # a stranger's certificate
                 **handshake_fails),
            push(2, tls_cert=pki.client_cert, tls_key=pki.client_key, tls_ca=other.ca,  # does not trust the server
                 **handshake_fails),
            push(2, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_ca=pki.ca),  # not named tls_client_name
        ]
        for pushed in refused:
            [result] = pushed.servers
            assert not result.ok and result.stage == "connect", result
        for pushed in refused[:3]:  # why the channel never came up, not "no answer"
            [result] = pushed.servers
            assert "connect: not connected within its 1 s deadline: failed to connect" in result.error, result
        [distrusted] = refused[2].servers  # the pusher's own check of the server's certificate
        assert distrusted.reason == "tls" and "CERTIFICATE_VERIFY_FAILED" in distrusted.error, distrusted
        assert "refused by checkpoint.tls_client_name: its certificate names 127.0.0.1, rollwave-server, " \
               "not trainer" in refused[-1].servers[0].error
        assert receiver.metrics.registry.get_sample_value("rollwave_rollout_checkpoint_refused_total",
                                                          {"reason": "certificate"}) >= 1
        assert receiver.version == 1
        [jump] = push(1 + 6, **mine).servers
        assert (jump.stage, jump.reason) == ("stage", "version") and "max_version_jump=5" in jump.error
        assert push(1 + 5, **mine).ok and receiver.version == 6
    finally:
        tls.close()
        shutil.rmtree(stage_dir, ignore_errors=True)


def test_tls_server_name_is_checked_instead_of_the_dialled_host(
    tiny_model_dir: Path, base_model: PreTrainedModel, tmp_path: Path
) -> None:
    """A receiver advertised by IP (as a pod is) whose certificate names only ``rollwave-receiver``: a pusher
    with ``checkpoint.tls_server_name: rollwave-receiver`` pushes; one that checks the IP it dials, or another
    name, fails to connect and leaves the version as it was."""
    pki = make_pki(tmp_path / "pki", "rollwave", server_san="DNS:rollwave-receiver")
    stage_dir = Path("/dev/shm") / f"rollwave-tls-name-{tmp_path.name}"
    fleet = Fleet(tiny_model_dir, stage_dir, tmp_path, size=1, tls_cert=pki.server_cert, tls_key=pki.server_key,
                  tls_ca=pki.ca, tls_client_name="trainer")
    try:
        fleet.start()
        [address], [receiver] = fleet.addresses, fleet.receivers
        client = {"tls_cert": pki.client_cert, "tls_key": pki.client_key, "tls_ca": pki.ca}

        def push(version: int, name: str | None, **config: Any) -> PushRound:
            config = fleet.config.model_copy(update={**client, "tls_server_name": name, **config})
            return push_once(config, [address], base_model, version)

        for name in (None, "other-name"):  # the handshake never completes: the connect times out
            [result] = push(1, name, connect_timeout_s=1.0).servers
            assert (result.ok, result.stage, result.reason) == (False, "connect", "tls"), result.error
        assert receiver.version == 0
        assert push(1, "rollwave-receiver").ok and receiver.version == 1
    finally:
        fleet.close()
        shutil.rmtree(stage_dir, ignore_errors=True)


def test_tls_client_name_null_accepts_any_certificate_of_the_ca(
    tiny_model_dir: Path, base_model: PreTrainedModel, tmp_path: Path
) -> None:
    """``checkpoint.tls_client_name: null``: a pusher whose certificate the CA signed for another name (the
    receivers' own, naming ``rollwave-server``) pushes and commits; a receiver beside it with the default name check
    refuses that same certificate (counted as refused for it) and keeps its version. The CA is still checked: a
    certificate another CA signed is refused under null too."""
    pki, other = make_pki(tmp_path / "pki", "rollwave"), make_pki(tmp_path / "other", "other")
    stage_dir = Path("/dev/shm") / f"rollwave-tls-any-{tmp_path.name}"
    tls = {"tls_cert": pki.server_cert, "tls_key": pki.server_key, "tls_ca": pki.ca}
    fleet = Fleet(tiny_model_dir, stage_dir, tmp_path, size=1, tls_client_name=None, **tls)
    named_config = CheckpointConfig(token=TOKEN, stage_dir=stage_dir, connect_timeout_s=5.0, retries=0, **tls)
    assert named_config.tls_client_name == TRAINER_CERT_NAME  # the default
    named: list[CheckpointReceiver] = []
    try:
        fleet.start()
        [anyone] = fleet.receivers

        async def start_named() -> None:
            named.append(CheckpointReceiver(named_config, tiny_model_dir, fleet.clients[0], fleet.engines[0].url,
                                            "named"))
            await named[0].start()

        fleet.run(start_named())

        def push(receiver: CheckpointReceiver, version: int, **client: Any) -> PushRound:
            config = named_config.model_copy(update={"tls_cert": pki.server_cert, "tls_key": pki.server_key, **client})
            return push_once(config, [receiver.address], base_model, version)

        def refused(receiver: CheckpointReceiver) -> float:
            return receiver.metrics.registry.get_sample_value("rollwave_rollout_checkpoint_refused_total",
                                                              {"reason": "certificate"}) or 0.0

        [result] = push(named[0], 1).servers
        assert not result.ok and result.stage == "connect", result
        assert "refused by checkpoint.tls_client_name: its certificate names 127.0.0.1, rollwave-server, " \
               f"not {TRAINER_CERT_NAME}" in result.error
        assert refused(named[0]) >= 1 and named[0].version == 0

        assert push(anyone, 1).ok and anyone.version == 1
        assert refused(anyone) == 0
        [stranger] = push(anyone, 2, tls_cert=other.client_cert, tls_key=other.client_key,
                          connect_timeout_s=1.0).servers
        assert not stranger.ok and stranger.stage == "connect", stranger
        assert anyone.version == 1
    finally:
        if named:
            fleet.run(named[0].stop())
        fleet.close()
        shutil.rmtree(stage_dir, ignore_errors=True)
