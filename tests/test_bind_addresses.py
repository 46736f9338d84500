"""Every bind address and port a component reads from the config is the one it serves on and publishes.

Each server is given the host ``localhost`` (not the default ``127.0.0.1``, yet still 127.0.0.1 for an IPv4
socket: tests bind loopback only) and a fixed free port, so a component that ignored the host key would publish
``127.0.0.1``, and one that ignored the port a port of its own choosing. Each also shows, from the kernel's socket
table, that what listens on that port is bound to loopback, never to a wildcard address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from buffer_helpers import client

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from core.config import EngineConfig
from core.net import free_port_outside_ephemeral
from core.process import stop_process
from proto import checkpoint_pb2 as pb
from proto import checkpoint_pb2_grpc as pb_grpc
from rollout_server.__main__ import engine_urls

ROOT = Path(__file__).resolve().parents[1]
HOST = "localhost"  # not the default 127.0.0.1, and loopback
RUN = "bind"
KEYS = Keys(RUN)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports below the ephemeral range (no port-0 bind elsewhere takes them)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port_outside_ephemeral("127.0.0.1"))
    return sorted(ports)


def listening_sockets(tables: dict[str, str]) -> set[tuple[str, int]]:
    """(address, port) of the sockets listening in /proc/net/tcp and tcp6 texts (keys ``tcp``, ``tcp6``)."""
    found = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in tables.get(name, "").splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A":  # LISTEN
                raw = bytes.fromhex(address)  # the kernel prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, words), int(port_hex, 16)))
    return found


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    tables = {name: path.read_text() for name in ("tcp", "tcp6") if (path := Path("/proc/net", name)).exists()}
    return {address for address, p in listening_sockets(tables) if p == port}


def listening_ports_of(pid: int) -> set[int]:
    """The ports of the sockets process ``pid`` itself holds listening (its own file descriptors matched by inode
    against /proc/net/tcp{,6}; a child's, such as an embedded engine's, are not its)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    ports = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net", name)
        for line in (path.read_text().splitlines()[1:] if path.exists() else []):
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, and this process's
                ports.add(int(fields[1].split(":")[1], 16))
    return ports


def loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address."""
    a = ipaddress.ip_address(address)
    return (a.ipv4_mapped if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped else a).is_loopback


def on_loopback_only(port: int) -> bool:
    """Something listens on ``port``, and only on loopback: 127.0.0.1, or for gRPC, which binds every address of
    ``localhost``, ::1 and 127.0.0.1 as ::ffff:127.0.0.1; never a wildcard address."""
    addresses = listening_addresses(port)
    return bool(addresses) and all(loopback(a) for a in addresses)


@contextmanager
def component(module: str, log: Path, *overrides: str, env: dict[str, str] | None = None) -> Iterator[Any]:
    """``python -m module overrides...`` in its own session, its output in ``log``; on exit SIGTERM to the whole
    group, waited for, then SIGKILL of what is left (an engine child included)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_") and k != "REDIS_URL"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, *overrides], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**clean, **(env or {})}, start_new_session=True)
    try:
        yield proc
    finally:
        stop_process(proc, 60, name=module, group=True)


def wait_for(what: str, get: Callable[[], Any], proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> Any:
    """Poll ``get`` until it returns something truthy; fail with the log if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not (value := get()):
        tail = log.read_text(errors="replace")[-4000:]
        assert proc.poll() is None, f"{what}: process exited with {proc.returncode}:\n{tail}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{tail}"
        time.sleep(0.2)
    return value


def test_engine_host_port_and_max_context_are_the_embedded_engines(tiny_model_dir: Path) -> None:
    """``engine_urls`` starts the embedded engine on engine.host:engine.port with engine.max_context; the same
    long prompt that a default engine takes is refused by the 64-token one."""
    [port] = free_ports(1)
    prompt = [5 + i % 300 for i in range(80)]  # 80 tokens: over 64, far under the default 1024
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}

    async def run() -> None:
        async with AsyncExitStack() as stack:
            (small, small_key), (default, default_key) = await asyncio.gather(
                engine_urls(EngineConfig(host=HOST, port=port, max_context=64, threads=1), tiny_model_dir, stack),
                engine_urls(EngineConfig(threads=1), tiny_model_dir, stack),
            )
            assert small == [f"http://{HOST}:{port}"]
            assert default[0].startswith("http://127.0.0.1:") and default[0] != f"http://127.0.0.1:{port}"
            assert on_loopback_only(port)
            async with httpx.AsyncClient(timeout=60) as http:
                auth = {"Authorization": f"Bearer {small_key}"}
                assert (await http.get(small[0] + "/health", headers=auth)).status_code == 200
                refused = await http.post(small[0] + "/generate", json=body, headers=auth)
                assert refused.status_code == 400, refused.text
                assert "context length (64 tokens)" in refused.json()["error"]["message"]
                taken = await http.post(default[0] + "/generate", json=body,
                                        headers={"Authorization": f"Bearer {default_key}"})
                assert taken.status_code == 200, taken.text
                assert taken.json()["meta_info"]["prompt_tokens"] == len(prompt)

    asyncio.run(run())


@pytest.mark.parametrize("serve_metrics", [True, False], ids=["metrics", "metrics_port_null"])
def test_rollout_server_binds_and_publishes_its_configured_addresses(
    tmp_path: Path, redis_server: EmbeddedRedis, tiny_model_dir: Path, serve_metrics: bool
) -> None:
    """``python -m rollout_server`` serves its checkpoint receiver (its gRPC and stage ports), metrics, episode
    endpoint and engine on the configured host and ports, and publishes exactly those in the registry (the stage
    port in the receiver's Status). With ``rollout.metrics_port=null`` it serves no metrics (it listens on the
    other ports alone, where the default, 0, would add one of its choosing) and publishes no metrics address."""
    grpc_port, stage_port, metrics_port, openai_port, engine_port = free_ports(5)
    log = tmp_path / "rollout.log"
    overrides = [
        f"run.name={RUN}", f"run.dir={tmp_path}", f"redis.url={redis_server.url}", f"model.path={tiny_model_dir}",
        f"checkpoint.stage_dir={tmp_path}/stage", "rollout.server_id=srv-bind", "rollout.heartbeat_s=0.2",
        "engine.threads=1", f"engine.host={HOST}", f"engine.port={engine_port}",
        f"rollout.grpc_host={HOST}", f"rollout.grpc_port={grpc_port}", f"rollout.stage_port={stage_port}",
        f"rollout.metrics_host={HOST}", f"rollout.metrics_port={metrics_port if serve_metrics else 'null'}",
        f"rollout.openai_host={HOST}", f"rollout.openai_port={openai_port}",
    ]
    registry = ServerRegistry(client(redis_server), KEYS)
    token = secrets.token_urlsafe(32)
    env = {"ROLLWAVE_CHECKPOINT_TOKEN": token}
    with component("rollout_server", log, *overrides, env=env) as proc:
        [info] = wait_for("the server's registry record", registry.live_servers, proc, log)
        assert info.server_id == "srv-bind"
        assert info.grpc_address == f"{HOST}:{grpc_port}"
        assert info.openai_url == f"http://{HOST}:{openai_port}"
        assert info.engine_url == f"http://{HOST}:{engine_port}"
        # registered only once every server is up: the engine is its child, the others its own sockets
        served = {grpc_port, stage_port, openai_port}
        if serve_metrics:
            assert info.metrics_address == f"{HOST}:{metrics_port}"
            assert "rollwave_rollout_" in httpx.get(f"http://{HOST}:{metrics_port}/metrics", timeout=10).text
            assert listening_ports_of(proc.pid) == served | {metrics_port}
        else:
            assert info.metrics_address == ""
            assert listening_ports_of(proc.pid) == served
            assert not listening_addresses(metrics_port)
        episode = httpx.get(f"http://{HOST}:{openai_port}/episodes/none/v1/models", timeout=10)
        assert episode.status_code == 404 and "episode 'none' does not exist" in episode.text  # the endpoint
        with grpc.insecure_channel(info.grpc_address) as channel:
            status = pb_grpc.CheckpointEngineStub(channel).Status(
                pb.StatusRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10)
        assert status.stage_port == stage_port
        with socket.create_connection((HOST, stage_port), timeout=5):
            pass
        for port in (*served, *([metrics_port] if serve_metrics else []), engine_port):
            assert on_loopback_only(port), port
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text(errors="replace")[-4000:]


@pytest.mark.parametrize("serve_metrics", [True, False], ids=["metrics", "metrics_port_null"])
def test_trainer_serves_metrics_on_its_configured_address(
    tmp_path: Path, redis_server: EmbeddedRedis, tiny_model_dir: Path, serve_metrics: bool
) -> None:
    """``python -m trainer`` (rank 0) serves Prometheus on trainer.metrics_host:trainer.metrics_port and publishes
    that address for the API. With ``trainer.metrics_port=null`` it listens on nothing (the default, 0, would serve
    on a port of its choosing) and publishes no metrics address."""
    [port] = free_ports(1)
    log = tmp_path / "trainer.log"
    overrides = [
        f"run.name={RUN}", f"run.dir={tmp_path}", f"redis.url={redis_server.url}", f"model.path={tiny_model_dir}",
        f"checkpoint.stage_dir={tmp_path}/stage", "trainer.device=cpu", "trainer.threads=1",
        "trainer.take_timeout_s=1", f"trainer.metrics_host={HOST}",
        f"trainer.metrics_port={port if serve_metrics else 'null'}",
    ]
    r = client(redis_server)
    env = {"ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    with component("trainer", log, *overrides, env=env) as proc:
        if serve_metrics:
            address = wait_for("the trainer's metrics address", lambda: r.hget(KEYS.trainer, "metrics_address"),
                               proc, log)
            assert address.decode() == f"{HOST}:{port}"
            assert "rollwave_trainer_" in httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text
            assert on_loopback_only(port)
        else:  # logged once the metrics server would have been started and its address published
            wait_for("the trainer's start", lambda: "training from step" in log.read_text(errors="replace"), proc,
                     log)
            assert not r.hexists(KEYS.trainer, "metrics_address")
            assert not listening_addresses(port)
        # besides the metrics server, only the (lone) gloo group listens, for peers that never come
        ports = listening_ports_of(proc.pid)
        assert len(ports - {port}) == 1 and (port in ports) == serve_metrics, ports
        assert all(on_loopback_only(p) for p in ports), ports


@pytest.mark.parametrize(("host", "expected"), [(HOST, f"http://{HOST}"), ("::1", "http://[::1]")])
def test_api_binds_its_configured_host(tmp_path: Path, redis_server: EmbeddedRedis, host: str, expected: str) -> None:
    """``python -m services.api`` binds api.host (loopback, so no token is needed) and publishes that URL, an IPv6
    address in brackets (``http://::1:8000`` names no port), so a client of the published URL reaches it."""
    [port] = free_ports(1)
    log = tmp_path / "api.log"
    overrides = [f"run.name={RUN}", f"run.dir={tmp_path}", f"redis.url={redis_server.url}", f"api.host={host}",
                 f"api.port={port}"]
    r = client(redis_server)
    with component("services.api", log, *overrides) as proc:
        url = wait_for("the API's published URL", lambda: r.hget(KEYS.api, "url"), proc, log, timeout_s=60)
        assert url.decode() == f"{expected}:{port}"
        assert httpx.get(f"{url.decode()}/healthz", timeout=10).json() == {"status": "ok"}
        assert httpx.get(f"{url.decode()}/readyz", timeout=10).json() == {"status": "ready"}
        assert httpx.get(f"{url.decode()}/v1/jobs", timeout=10).json() == {"jobs": [], "next": None}
        assert on_loopback_only(port)


def test_trainer_rendezvous_listens_on_master_addr_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Rank 0 of a pool hosts the rendezvous store on MASTER_ADDR alone (torch's own store binds every address,
    which would take rendezvous traffic from the network); left waiting for rank 1, it gives up after
    trainer.dist_timeout_s."""
    [port] = free_ports(1)
    log = tmp_path / "trainer.log"
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": HOST, "MASTER_PORT": str(port),
           "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32), "OMP_NUM_THREADS": "1"}
    overrides = [f"run.dir={tmp_path}", f"model.path={tiny_model_dir}", "trainer.device=cpu",
                 "trainer.dist_timeout_s=3"]  # the store listens this long: 15 of this test's 0.2 s polls
    with component("trainer", log, *overrides, env=env) as proc:
        wait_for("the rendezvous store", lambda: listening_addresses(port), proc, log)
        assert on_loopback_only(port), listening_addresses(port)
        assert proc.wait(60) == 1
    assert f"TimeoutError: trainer rendezvous at {HOST}:{port} (rank 0 of 2)" in log.read_text()


POOL_RANK = """
import json, sys, torch, torch.distributed as dist
from trainer.parallel import close_distributed, init_distributed
init_distributed("cpu", 60)
dist.all_reduce(torch.ones(1))  # every pair of ranks is connected: all their sockets are open
if dist.get_rank() == 0:
    print(json.dumps({name: open(f"/proc/net/{name}").read() for name in ("tcp", "tcp6")}))
dist.barrier()
close_distributed()
"""


@pytest.mark.parametrize("world", [2, 1], ids=["pool", "lone_rank"])
def test_a_pool_on_loopback_keeps_its_collectives_on_loopback(tmp_path: Path, world: int) -> None:
    """Gloo binds its sockets to the address the hostname resolves to: on a host whose name resolves to its
    network address (as in most containers), a pool rendezvousing on 127.0.0.1 would take collective traffic,
    which sets weights, from the network. In a network namespace with such an address and such a hosts file,
    two ranks at MASTER_ADDR=127.0.0.1 listen on loopback only; so does a lone rank (``python -m trainer``
    without torchrun: no rendezvous, yet its gloo group listens)."""
    hosts = tmp_path / "hosts"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1")
    rank = f"{sys.executable} -c '{POOL_RANK}'"
    ranks = f"RANK=1 {rank} & RANK=0 {rank}; wait" if world == 2 else f"RANK=0 {rank}"
    script = (
        "set -e; ip link set lo up; ip link add v0 type veth peer name v1; ip addr add 10.77.0.1/24 dev v0; "
        f"ip link set v0 up; printf '10.77.0.1 %s\\n' \"$(hostname)\" > {hosts}; mount --bind {hosts} /etc/hosts; "
        f"getent hosts \"$(hostname)\" >&2; {ranks}"
    )
    proc = subprocess.run(["unshare", "-n", "-m", "bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.startswith("10.77.0.1 "), proc.stderr[-3000:]  # the hostname resolves off loopback
    sockets = listening_sockets(json.loads(proc.stdout.strip().splitlines()[-1]))
    # a pool: the store, and a socket per pair of ranks in each rank; a lone rank: its gloo group's listener
    assert len(sockets) >= (3 if world == 2 else 1), sockets
    assert [s for s in sockets if not loopback(s[0])] == [], sockets
