"""`make test-deploy`: deploy/docker-compose.yml (profile cpu) really runs on this host.

Steps, each with a deadline that names it when it passes:
1. Docker: the daemon DOCKER_HOST (or the default socket) names if one answers; else this script starts
   dockerd itself (``--bridge=none --iptables=false``, overlay2, else vfs) with its state under
   ``.deploy-test/`` and stops it at the end. Exit status 3 with the reason when no daemon can run.
2. A base image without any registry: ``debootstrap --variant=minbase bookworm`` with Python 3.11 (a venv
   at /opt/python stands in for python:3.11-slim's ``python``/``pip``), redis-server and prometheus,
   through ``docker import``; kept between runs.
3. The CPU image from deploy/Dockerfile with the build arguments users set for mirrors: BASE_IMAGE, and
   PIP_INDEX_URL / TORCH_INDEX_URL pointing at a PEP 503 index served on 127.0.0.1 from a wheelhouse that
   the host's pip fills (so torch==2.13.0 is the host's CPU wheel). The build uses ``--network host``.
4. The stack with Debian's docker-compose: deploy/docker-compose.yml plus tests/deploy/docker-compose.loopback.yml
   (host networking, every service on 127.0.0.1 at free ports), merged by ``docker-compose config`` with
   the published ports dropped (see ``merged_compose_file``), fresh secrets in the environment.
5. Through the API: a train job and an eval job; the trainer trains steps and a weight version is
   published and served, over mutual TLS (the receiver presents the deployment CA's certificate and refuses
   plaintext); every task of the eval job completes and is scored (as the run's ACL user, like everything
   else); a job on the bundled GSM8K (no path) is taken: the image carries it. Redis refuses its default
   user. Prometheus scrapes every target of its config and they are all up.
6. ``docker-compose down -v``, the index server and (if started here) dockerd are stopped.
The outcome goes to .deploy-test/last.log too; a failure that starts with ``docker:`` means no Docker
daemon could run here (exit status 3), which .ci/run reports instead of failing.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx
import redis
import yaml
from cryptography import x509

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from prometheus_harness import scrape_config  # noqa: E402

from core.net import free_port_outside_ephemeral  # noqa: E402

STATE = ROOT / ".deploy-test"  # dockerd's data root, the rootfs and the wheelhouse (git-ignored)
BASE_IMAGE = "rollwave-deploy-base:bookworm"
IMAGE = "rollwave:deploy-test"
PROJECT = "rollwave-deploy-test"
MIRROR = os.environ.get("ROLLWAVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = "python3,python3-venv,passwd,ca-certificates,redis-server,prometheus"
NO_DOCKER = 3
EVAL_TASKS = 8  # the eval job's tasks, every one of which must complete and be scored
SECRET_VARS = frozenset({"ROLLWAVE_API_TOKEN", "ROLLWAVE_CHECKPOINT_TOKEN", "ROLLWAVE_REDIS_PASSWORD"})
# What the image's Python (Debian's 3.11.2) needs beyond what pip resolves for this interpreter: redis-py
# wants async-timeout below 3.11.3.
IMAGE_PYTHON_EXTRAS = ["async-timeout>=4.0.3"]


class DeployError(RuntimeError):
    """A step failed; the message names it."""


def log(msg: str) -> None:
    print(f"[test-deploy {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(argv: list[str], step: str, timeout_s: float, env: dict[str, str] | None = None,
        quiet: bool = False, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``argv`` to completion within ``timeout_s``; a failure or timeout is a DeployError naming ``step``."""
    try:
        out = subprocess.run(argv, env=env, text=True, timeout=timeout_s, capture_output=quiet, **kw)
    except subprocess.TimeoutExpired:
        raise DeployError(f"{step}: `{' '.join(argv[:4])} ...` did not finish within {timeout_s:.0f} s") from None
    if out.returncode != 0:
        detail = f":\n{out.stdout or ''}{out.stderr or ''}"[-3000:] if quiet else ""
        raise DeployError(f"{step}: `{' '.join(argv[:4])} ...` exited {out.returncode}{detail}")
    return out


def wait_until(what: str, timeout_s: float, check: Any, poll_s: float = 2.0) -> Any:
    """``check()`` until it returns something truthy; DeployError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, redis.RedisError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(poll_s)
    raise DeployError(f"{what}: not within {timeout_s:.0f} s (last: {last!r})")


# ---- 1. Docker ---------------------------------------------------------------------------------------

def docker_answers(env: dict[str, str]) -> bool:
    return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0


@contextlib.contextmanager
def docker_daemon() -> Iterator[dict[str, str]]:
    """The environment for docker and docker-compose: an answering daemon, started here if need be."""
    env = dict(os.environ)
    if shutil.which("docker") is None:
        raise DeployError("docker: no docker client on PATH (Debian package docker.io)")
    if docker_answers(env):
        log(f"using the running Docker daemon ({env.get('DOCKER_HOST', 'default socket')})")
        yield env
        return
    dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/sbin")
    if dockerd is None:
        raise DeployError("docker: no daemon answers and dockerd is not installed (Debian package docker.io)")
    run_dir = Path(f"/tmp/rollwave-dockerd-{os.getpid()}")  # short: unix socket paths are limited
    run_dir.mkdir(mode=0o700)
    env["DOCKER_HOST"] = f"unix://{run_dir}/docker.sock"
    errors = []
    for driver in ("overlay2", "vfs"):
        log_path = STATE / f"dockerd-{driver}.log"
        STATE.mkdir(exist_ok=True)
        argv = [dockerd, "--bridge=none", "--iptables=false", "--ip6tables=false", f"--storage-driver={driver}",
                f"--data-root={STATE / 'docker'}", f"--exec-root={run_dir}/exec", f"--pidfile={run_dir}/docker.pid",
                f"--host={env['DOCKER_HOST']}"]
        with open(log_path, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not docker_answers(env):
            time.sleep(1)
        if proc.poll() is None and docker_answers(env):
            log(f"started dockerd (pid {proc.pid}, storage driver {driver})")
            break
        errors.append(f"{driver}: " + "\n".join(log_path.read_text().splitlines()[-5:]))
        stop_dockerd(proc)
    else:
        unmount_under(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise DeployError("docker: dockerd did not start:\n" + "\n".join(errors))
    try:
        yield env
    finally:
        stop_dockerd(proc)
        unmount_under(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        log("stopped dockerd")


def unmount_under(root: Path) -> None:
    """Unmount what dockerd left mounted under ``root`` (its default network namespace), deepest first."""
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(f"{root}/")]
    for point in sorted(points, key=len, reverse=True):
        run(["umount", point], f"docker: unmount {point}", 60, quiet=True)


def stop_dockerd(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


# ---- 2. base image -----------------------------------------------------------------------------------

def image_exists(env: dict[str, str], image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], env=env, capture_output=True,
                          timeout=60).returncode == 0


def base_image(env: dict[str, str]) -> None:
    if image_exists(env, BASE_IMAGE):
        log(f"base image {BASE_IMAGE}: present")
        return
    debootstrap = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin:/sbin")
    if debootstrap is None:
        raise DeployError("base image: debootstrap is not installed (Debian package debootstrap)")
    rootfs = STATE / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    log(f"base image: debootstrap bookworm from {MIRROR}")
    run([debootstrap, "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs), MIRROR],
        "base image: debootstrap", 1200, quiet=True)
    run(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/python"], "base image: venv", 300, quiet=True)
    shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    path = "/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    run(["docker", "import", "--change", f"ENV PATH={path}", "--change", "CMD [\"bash\"]", "-", BASE_IMAGE],
        "base image: docker import", 600, env=env, stdin=tar.stdout, quiet=True)
    assert tar.stdout is not None
    tar.stdout.close()
    if tar.wait(60) != 0:
        raise DeployError("base image: tar of the rootfs failed")
    shutil.rmtree(rootfs, ignore_errors=True)
    log(f"base image {BASE_IMAGE}: built")


# ---- 3. the CPU image --------------------------------------------------------------------------------

def wheelhouse() -> Path:
    """Every wheel the image installs, fetched by the host's pip (its index and the local torch wheel)."""
    house = STATE / "wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    log("wheelhouse: pip download (torch==2.13.0 CPU, rollwave's dependencies, the build backend)")
    run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(house),
         "-c", str(ROOT / "constraints.txt"), "torch==2.13.0", str(ROOT), "setuptools>=68", "wheel", "pip",
         *IMAGE_PYTHON_EXTRAS],
        "wheelhouse: pip download", 1200, quiet=True)
    for built in house.glob("rollwave-*"):  # the project itself is built in the image from its sources
        built.unlink()
    return house


def simple_index(house: Path) -> Path:
    """A PEP 503 index over ``house``: simple/<project>/index.html linking each file (no hashes needed)."""
    root = STATE / "index"
    shutil.rmtree(root, ignore_errors=True)
    (root / "simple").mkdir(parents=True)
    (root / "files").symlink_to(house)
    projects: dict[str, list[str]] = {}
    for f in sorted(house.iterdir()):
        stem = f.name.split("-")[0] if f.name.endswith(".whl") else f.name.rsplit("-", 1)[0]
        projects.setdefault(re.sub(r"[-_.]+", "-", stem).lower(), []).append(f.name)
    for project, files in projects.items():
        (root / "simple" / project).mkdir()
        links = "".join(f'<a href="../../files/{name}">{name}</a>\n' for name in files)
        (root / "simple" / project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    return root


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[str]:
    """``directory`` over HTTP on 127.0.0.1 (any free port), for the length of the block."""
    handler = partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


def build_context() -> Path:
    """The files deploy/Dockerfile.dockerignore lets through, copied into a directory of their own: the
    classic builder (no BuildKit, no buildx needed) reads only the root .dockerignore."""
    context = STATE / "context"
    shutil.rmtree(context, ignore_errors=True)
    patterns = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    for pattern in (p[1:] for p in patterns if p.startswith("!")):
        tree = pattern.endswith("/**")  # Path.glob's ** matches directories only (before Python 3.13)
        for src in (ROOT / pattern[:-3]).rglob("*") if tree else ROOT.glob(pattern):
            rel = src.relative_to(ROOT)
            if src.is_file() and "__pycache__" not in rel.parts and src.suffix != ".pyc":
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, context / rel)
    (context / "deploy").mkdir(exist_ok=True)
    shutil.copy2(ROOT / "deploy" / "Dockerfile", context / "deploy" / "Dockerfile")
    return context


def build_image(env: dict[str, str], index_url: str) -> None:
    log(f"image {IMAGE}: docker build (deploy/Dockerfile, BASE_IMAGE={BASE_IMAGE}, index {index_url})")
    run(["docker", "build", "--network", "host", "-f", "deploy/Dockerfile", "-t", IMAGE,
         "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", f"PIP_INDEX_URL={index_url}/simple/",
         "--build-arg", f"TORCH_INDEX_URL={index_url}/simple/", "."],
        "image: docker build", 1800, env={**env, "DOCKER_BUILDKIT": "0"}, cwd=build_context(), quiet=True)
    log(f"image {IMAGE}: built")


# ---- 4./5. the stack ---------------------------------------------------------------------------------

def stack_env(env: dict[str, str]) -> dict[str, str]:
    ports = {}
    taken: set[int] = set()
    for name in ("REDIS", "PROMETHEUS", "API", "TRAINER_METRICS", "GRPC", "ROLLOUT_METRICS"):
        port = free_port_outside_ephemeral()
        while port in taken:
            port = free_port_outside_ephemeral()
        taken.add(port)
        ports[f"DEPLOY_{name}_PORT"] = str(port)
    prom = STATE / "prometheus.yml"
    host = "127.0.0.1"
    config = scrape_config({
        "rollwave-api": [f"{host}:{ports['DEPLOY_API_PORT']}"],
        "rollwave-trainer": [f"{host}:{ports['DEPLOY_TRAINER_METRICS_PORT']}"],
        "rollwave-rollout": [f"{host}:{ports['DEPLOY_ROLLOUT_METRICS_PORT']}"],
        "rollwave-engine": [f"{host}:{ports['DEPLOY_ROLLOUT_METRICS_PORT']}"],
        "prometheus": [f"{host}:{ports['DEPLOY_PROMETHEUS_PORT']}"],
    }, interval="5s")
    prom.write_text(yaml.safe_dump(config))
    prom.chmod(0o644)
    return {**env, **ports, "DEPLOY_BASE_IMAGE": BASE_IMAGE, "DEPLOY_PROMETHEUS_CONFIG": str(prom),
            "ROLLWAVE_IMAGE": IMAGE, "COMPOSE_PROJECT_NAME": PROJECT,
            "ROLLWAVE_API_TOKEN": secrets.token_urlsafe(32), "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32),
            "ROLLWAVE_REDIS_PASSWORD": secrets.token_urlsafe(32)}


def merged_compose_file(env: dict[str, str]) -> Path:
    """deploy/docker-compose.yml with the loopback override, as ``docker-compose config`` merges them, less
    the published ports of host-network services: an override cannot remove a key in compose 1.29, and
    docker refuses port bindings with host networking (they would mean nothing there)."""
    files = ["-f", str(ROOT / "deploy" / "docker-compose.yml"),
             "-f", str(ROOT / "tests" / "deploy" / "docker-compose.loopback.yml")]
    merged = yaml.safe_load(run([compose_bin(), *files, "config"], "compose config", 120, env=env, cwd=ROOT,
                                quiet=True).stdout)
    for service in merged["services"].values():
        if service.get("network_mode") == "host":
            service.pop("ports", None)
        for var in set(service.get("environment") or {}) & SECRET_VARS:  # back to references: no secret on disk
            service["environment"][var] = f"${{{var}}}"
    text = yaml.safe_dump(merged, sort_keys=False)
    if any(env[var] in text for var in SECRET_VARS):
        raise DeployError("compose config: a secret's value is left in the merged file")
    path = STATE / "docker-compose.yml"
    path.write_text(text)
    return path


def compose_bin() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        raise DeployError("compose: docker-compose is not installed (Debian package docker-compose)")
    return found


def compose(env: dict[str, str], *args: str, step: str, timeout_s: float = 600, quiet: bool = True
            ) -> subprocess.CompletedProcess[str]:
    files = ["-f", str(STATE / "docker-compose.yml")]
    return run([compose_bin(), *files, "--profile", "cpu", *args], step, timeout_s, env=env, cwd=ROOT, quiet=quiet)


def check_checkpoint_tls(port: int) -> None:
    """The weights that were just served came over TLS: the receiver presents a certificate of the deployment's
    CA for the name the trainer checks, and a plaintext gRPC channel to it never becomes ready."""
    try:
        pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=10)
    except (ssl.SSLError, OSError) as exc:
        raise DeployError(f"checkpoint TLS: no TLS handshake with the receiver at 127.0.0.1:{port}: {exc}") from None
    cert = x509.load_pem_x509_certificate(pem.encode())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    text = f"issuer {cert.issuer.rfc4514_string()}, DNS names {', '.join(names)}"
    if cert.issuer.rfc4514_string() != "CN=rollwave checkpoint CA" or names != ["rollwave-checkpoint-receiver"]:
        raise DeployError(f"checkpoint TLS: the receiver's certificate is not the deployment's: {text}")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=5)
        raise DeployError(f"checkpoint TLS: the receiver at 127.0.0.1:{port} accepted a plaintext gRPC channel")
    except grpc.FutureTimeoutError:
        pass
    finally:
        channel.close()
    log(f"checkpoint plane: mutual TLS ({text}); a plaintext channel is refused")


def check_stack(env: dict[str, str]) -> None:
    api_url = f"http://127.0.0.1:{env['DEPLOY_API_PORT']}"
    auth = {"Authorization": f"Bearer {env['ROLLWAVE_API_TOKEN']}"}
    with httpx.Client(base_url=api_url, headers=auth, timeout=30) as api:
        wait_until("API /readyz", 300, lambda: api.get("/readyz").status_code == 200)
        wait_until("a live rollout server in /v1/status", 600,
                   lambda: any(s["alive"] for s in api.get("/v1/status").json()["servers"]))
        train = api.post("/v1/jobs", json={"kind": "train", "name": "deploy-train",
                                           "source": {"kind": "arith", "split": "train", "limit": 2000}})
        train.raise_for_status()
        log(f"train job {train.json()['job_id']} submitted")

        def trained() -> dict[str, Any] | None:
            status = api.get("/v1/status").json()
            trainer = status["trainer"] or {}
            served = [s["version"] for s in status["servers"] if s["alive"]]
            done = int(trainer.get("step", 0)) >= 2 and status["version"] >= 1 and served and min(served) >= 1
            return status if done else None

        status = wait_until("2 trainer steps and a published weight version served", 1200, trained, poll_s=5)
        log(f"trained: step {status['trainer']['step']}, published version {status['version']}, servers "
            f"{[(s['server_id'], s['version']) for s in status['servers']]}")
        check_checkpoint_tls(int(env["DEPLOY_GRPC_PORT"]))
        evaluation = api.post("/v1/jobs", json={"kind": "eval", "name": "deploy-eval",
                                                "source": {"kind": "arith", "split": "test", "limit": EVAL_TASKS}})
        evaluation.raise_for_status()
        job_id = evaluation.json()["job_id"]
        job = wait_until(f"eval job {job_id} done", 900,
                         lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["state"] == "done" and j, poll_s=3)
        log(f"eval job done: {job['progress']}, accuracy {job.get('accuracy')}")
        if job["progress"]["completed"] != EVAL_TASKS or job.get("accuracy") is None:
            raise DeployError(f"eval job {job_id}: {job['progress']} of {EVAL_TASKS} tasks, "
                              f"accuracy {job.get('accuracy')}: "
                              "every task should complete and be scored")
        api.post(f"/v1/jobs/{train.json()['job_id']}/cancel").raise_for_status()
        bundled = api.post("/v1/jobs", json={"kind": "eval", "name": "deploy-gsm8k",  # the image carries GSM8K
                                             "source": {"kind": "gsm8k", "split": "test", "limit": 1}})
        if bundled.status_code != 201:
            raise DeployError(f"a job on the bundled GSM8K (--source gsm8k): HTTP {bundled.status_code}: "
                              f"{bundled.text[:500]}")
        log(f"a job on the bundled GSM8K was taken: {bundled.json()['job_id']}")
    anonymous = redis.Redis(host="127.0.0.1", port=int(env["DEPLOY_REDIS_PORT"]), socket_timeout=10)
    try:
        anonymous.ping()
    except redis.AuthenticationError as exc:
        log(f"Redis refuses its default user: {exc}")
    else:
        raise DeployError("redis: the default user got in without a password")
    finally:
        anonymous.close()
    prometheus = f"http://127.0.0.1:{env['DEPLOY_PROMETHEUS_PORT']}"

    def all_up() -> list[str] | None:
        targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        up = [f"{t['labels']['job']} {t['scrapeUrl']}" for t in targets if t["health"] == "up"]
        return up if targets and len(up) == len(targets) == 5 else None

    up = wait_until("Prometheus: every target up", 120, all_up)
    log("Prometheus scrapes every target: " + "; ".join(up))


def main() -> int:
    started = time.monotonic()
    try:
        with docker_daemon() as env:
            base_image(env)
            with serve(simple_index(wheelhouse())) as index_url:
                build_image(env, index_url)
            stack = stack_env(env)
            merged_compose_file(stack)
            log("compose up (profile cpu, loopback override)")
            try:
                compose(stack, "up", "-d", "--no-build", step="compose up")
                check_stack(stack)
            except BaseException:
                logs = compose(stack, "logs", "--no-color", "--tail=40", step="compose logs", quiet=True)
                print(logs.stdout[-12000:], file=sys.stderr)
                raise
            finally:
                compose(stack, "down", "-v", "--remove-orphans", step="compose down")
                log("compose down")
    except DeployError as exc:
        outcome = f"test-deploy FAILED: {exc}"
        print(outcome, file=sys.stderr)
        record(outcome)
        return NO_DOCKER if str(exc).startswith("docker:") else 1
    outcome = f"test-deploy passed in {time.monotonic() - started:.0f} s"
    log(outcome)
    record(outcome)
    return 0


def record(outcome: str) -> None:
    """The last run's outcome in .deploy-test/last.log, for .ci/run (make hides the exit status)."""
    STATE.mkdir(exist_ok=True)
    (STATE / "last.log").write_text(outcome + "\n")


if __name__ == "__main__":
    socket.setdefaulttimeout(60)
    sys.exit(main())
