"""``rollwave up`` / ``rollwave down``: the stack of ``services.launcher.components`` as Ray actors.

Each component runs in a detached ``ComponentActor`` that owns its process (in a process group of
its own); when the process fails the actor kills what it left behind (a rollout server's engine) and
starts it again after ``LocalStack``'s backoff (``RestartBackoff``: one that fails at start-up is not respawned
in a tight loop): a rollout server rejoins the registry and is re-synced by the trainer's next push, a trainer
rank resumes from its last checkpoint. Ray restarts an actor whose worker dies (``max_restarts=-1``), which starts
the process again. A component that refused its config (``CONFIG_ERROR_EXIT``) is not restarted, and ``up``
waits for every component's config check and fails naming one that refused. One that fails at every start is given
up by its actor (``launcher.max_restarts``), which stops the run's other components; ``up --foreground`` then stops
the run and exits 1 naming it. The trainer ranks share a node
(their rendezvous is on loopback); the rest is packed over the cluster's nodes, and the embedded Redis runs on
the node ``up`` runs on. A rollout server's receiver and the API listen on their node's address (loopback on a
local head), which on a cluster needs the API's token, and the embedded Redis gets a password made for the run.

Without ``RAY_ADDRESS`` a local Ray head is started as ``ray start --head --block`` in a session of
its own, with its own short temp dir, advertising 127.0.0.1, requiring a token made for it (Ray's token
authentication) and with as many logical CPUs as the stack asks for; ``down`` stops it by its process id
(never ``ray stop``, which would end every Ray on the machine). ``<run dir>/ray.json`` records what ``up``
started, for ``down``, as it starts it (the head as soon as its process exists), so an ``up`` killed mid-launch
leaves nothing ``down`` cannot find. An ``up`` or ``down`` holds ``<run dir>/ray.lock`` (``flock``) while it works,
so a second one of the same run fails at once naming the first; the kernel drops the lock when its holder dies,
and an ``up`` that died mid-launch is named by its ``ray.json`` (``launched`` false) instead.

The checkpoint plane is mutual TLS unless ``checkpoint.tls_*`` are set: ``up`` makes a private CA and the
receivers' and trainers' certificates once for the run, in ``<run dir>/checkpoint-tls``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis, client_for, configured_url
from core.checkpoint_pki import RECEIVER_NAME, ensure_checkpoint_pki
from core.config import CONFIG_ACCEPTED_FD_ENV, CONFIG_ERROR_EXIT, Config, ConfigError, dump_config, load_config
from core.model_dir import ensure_model
from core.net import free_port_outside_ephemeral, is_loopback
from core.process import kill_group, stop_process
from services.api.app import check_api_config
from services.cli import LOOPBACK_RAY_ENV, CliError
from services.launcher import (
    ComponentSpec,
    RestartBackoff,
    components,
    ensure_checkpoint_token,
    published_api_url,
    refusal,
    spawn,
)

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
FORWARDED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE")
REDIS_ACTOR = "redis"
START_TIMEOUT_S = 120.0  # how long an actor waits for its component's config check
WATCHER_JOIN_S = 10.0  # a stop's wait for the watcher, which ends once the process it waits for has
# ``down``'s wait for an actor's stop past its component's grace: the wait after its SIGKILL (``KILL_WAIT_S``), the
# watcher (``WATCHER_JOIN_S``), Ray's call
STOP_MARGIN_S = 30.0
# ``down``'s wait for an actor whose grace ``ray.json`` does not record: the Redis actor's (``EmbeddedRedis.stop``), a
# component of a run an earlier version started
UNRECORDED_STOP_S = 60.0


class ComponentProcess:
    """Owns one component process (as ``ComponentActor``): when the process fails the actor starts it again after
    ``RestartBackoff``'s delay, as ``LocalStack`` does; one that ended (exit 0 where its spec ``ends``), or refused its
    config (``CONFIG_ERROR_EXIT``: it would only refuse again, for ever), is left stopped, as ``LocalStack`` leaves
    it. One that fails at every start is given up (the spec's ``max_restarts``, unless ``backoff`` says), and the
    actors of ``peers`` (the run's other components) are stopped, as ``LocalStack`` stops the rest: ``given_up`` says
    why.

    The constructor returns once the component got past its config check (every component's
    ``load_config_or_exit`` writes to a pipe it is given) or exited, so that ``up`` can name one that refused.
    Ray caps a worker's threads (``OMP_NUM_THREADS=1``); the component gets the driver's setting instead
    (``spec.env``), since it is a process with its own thread settings, not a Ray task.
    """

    def __init__(self, spec: ComponentSpec, log_dir: str, start_timeout_s: float = START_TIMEOUT_S,
                 backoff: RestartBackoff | None = None, peers: tuple[str, ...] = ()) -> None:
        if spec.node_overrides:  # it listens where peers on other nodes reach it
            address = ray.util.get_node_ip_address()
            spec = dataclasses.replace(spec, argv=[*spec.argv, *(o.replace("{address}", address)
                                                                 for o in spec.node_overrides)])
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.backoff = backoff or RestartBackoff(spec.name, max_restarts=spec.max_restarts,
                                                 window_s=spec.restart_window_s)
        self.peers = peers
        self._given_up: str | None = None
        self._lock = threading.Lock()  # a restart and ``stop``: none begins once ``stop`` has
        self._stopping = threading.Event()
        self._settled = threading.Event()
        self._env = {k: v for k, v in os.environ.items()  # a component talks to no Ray: it gets no Ray token
                     if k != "OMP_NUM_THREADS" and not k.startswith("RAY_AUTH_")}
        accepted, writer = os.pipe()
        with open(accepted, "rb", buffering=0) as pipe:
            try:
                self.proc = spawn(spec, self.log_dir, {**self._env, CONFIG_ACCEPTED_FD_ENV: str(writer)}, (writer,))
            finally:
                os.close(writer)  # the component holds the only writer: the pipe ends when it does
            self.backoff.started()
            self._watcher = threading.Thread(target=self._watch, name=f"watch-{spec.name}", daemon=True)
            self._watcher.start()
            self.confirmed = bool(select.select([pipe], [], [], start_timeout_s)[0])  # accepted, or exited
            if self.confirmed and not pipe.read(1):
                self._settled.wait(start_timeout_s)  # it exited first: the watcher says what that means
        if not self.confirmed:
            print(f"{spec.name}: no word from its config check within {start_timeout_s:g} s (see "
                  f"{self.log_dir / f'{spec.name}.log'}); left running", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        """Wait for the process, and start it again while it fails, until ``stop``. Restarts come from this thread,
        which lives as long as the process it started: the kernel's parent-death signal
        (``core.process.die_with_parent``) follows the thread that started a process."""
        while True:
            proc = self.proc
            rc = proc.wait()
            kill_group(proc.pid)  # what it left (a rollout server's engine) would run beside the new one
            if self._stopping.is_set() or (rc == 0 and self.spec.ends):
                delay = None
            elif rc == CONFIG_ERROR_EXIT:
                print(f"{refusal(self.spec.name, rc, self.log_dir)}; not restarting it", file=sys.stderr, flush=True)
                delay = None
            elif (delay := self.backoff.died(rc)) is None:
                self._given_up = self.backoff.gave_up(rc, self.log_dir)
                self._stop_peers()
            self._settled.set()  # the constructor waits for this verdict on a component that exits at once
            if delay is None or not self._respawn(delay):
                return

    def _respawn(self, delay: float) -> bool:
        """Start the process again after ``delay``, and after each further delay while it cannot be started; False
        once ``stop`` has begun (it cuts the wait short)."""
        while not self._stopping.wait(delay):
            with self._lock:
                if self._stopping.is_set():
                    break
                try:
                    self.proc = spawn(self.spec, self.log_dir, self._env)
                except OSError as exc:
                    delay = self.backoff.not_restarted(exc)
                    continue
                self.backoff.started()
                return True
        return False

    def _stop_peers(self) -> None:
        """Ask each of the run's other components' actors to stop it (not waiting: one may be asking this one)."""
        for name in self.peers:
            try:
                ray.get_actor(name).stop.remote()
            except ValueError:  # gone already (`rollwave down`)
                continue

    def given_up(self) -> str | None:
        """Why this component was given up (it failed at every start), or None."""
        return self._given_up

    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        return self.proc.poll()

    def restarts(self) -> int:
        return self.backoff.restarts

    def config_checked(self) -> bool:
        """Whether the component got past its config check (or exited) before the constructor returned."""
        return self.confirmed

    def stop(self, timeout_s: float | None = None) -> int:
        """SIGTERM (components shut down gracefully), then, past ``timeout_s`` (its spec's ``stop_grace_s`` unless
        given: a trainer rank's ``launcher.trainer_stop_grace_s``), SIGKILL to whatever is left of its group, named in
        the log, whatever the component is doing: running, waiting out its backoff (no restart follows), being
        restarted (the new process is the one stopped). Returns its exit code once the watcher is done, so nothing
        starts after."""
        with self._lock:  # a restart under way ends first; none begins once this is set
            self._stopping.set()
        grace = self.spec.stop_grace_s if timeout_s is None else timeout_s
        rc = stop_process(self.proc, grace, name=self.spec.name, group=True)
        self._watcher.join(WATCHER_JOIN_S)
        if self._watcher.is_alive():
            print(f"{self.spec.name}: its watcher did not end within {WATCHER_JOIN_S:g} s of its process",
                  file=sys.stderr, flush=True)
        return rc


ComponentActor = ray.remote(max_restarts=-1, max_task_retries=-1)(ComponentProcess)


@ray.remote(max_restarts=-1)
class RedisActor:
    """The embedded Redis in an actor: AOF on, in the run directory, so a restart loses nothing. It listens on
    its node's address (loopback on a local head), which ``up`` gives a password on a cluster.

    Port 0 takes a free port; the components are given the URL, so a restarted actor comes back on the
    port it had (recorded in the data directory), waiting for it if it is busy, and for the killed worker's
    redis-server, which its guard stops, to let go of the data directory (``EmbeddedRedis``).
    """

    def __init__(self, data_dir: str, port: int, aof: bool, appendfsync: str, password: str | None) -> None:
        record = Path(data_dir) / "port"
        if ray.get_runtime_context().was_current_actor_reconstructed:
            port = int(record.read_text())
        host = ray.util.get_node_ip_address()
        if password is None and not is_loopback(host):
            raise RuntimeError(f"the embedded Redis would listen on {host} without a password")
        self.server = EmbeddedRedis(Path(data_dir), aof=aof, port=port, host=host, password=password,
                                    appendfsync=appendfsync).start()
        record.write_text(str(self.server.port))

    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def _state_path(cfg: Config) -> Path:
    return cfg.run.path.absolute() / "ray.json"


def _write_state(path: Path, state: dict[str, Any]) -> None:
    """Replace ``ray.json`` whole (a new file renamed over it): an ``up`` killed while writing leaves the last one."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(state))
    partial.replace(path)


@contextlib.contextmanager
def _run_lock(run_dir: Path, command: str) -> Iterator[None]:
    """Hold ``<run dir>/ray.lock`` while ``command`` (``up``'s launch, ``down``) works on the run, so that two of
    them never start or stop the same run at once; the other fails at once naming this one. The kernel releases
    an ``flock`` when its holder dies, however it dies: a killed ``up`` leaves no stale lock."""
    fd = os.open(run_dir / "ray.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another `rollwave up` or `down`"
            raise CliError(f"{run_dir}: {holder} is starting or stopping this run (it holds {run_dir / 'ray.lock'});"
                           " let it finish or Ctrl-C it, then try again", exit_code=1) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"`rollwave {command}` (pid {os.getpid()})".encode(), 0)
        yield
    finally:
        os.close(fd)


def absolute_paths(section: BaseModel) -> None:
    """Components run in Ray workers, whose working directory is not the caller's: pin every path of the config, in
    every section (a list of them by hand missed redis.password_file, trainer.critic.path and checkpoint.stage_dir)."""
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, Path):
            setattr(section, name, value.absolute())
        elif isinstance(value, BaseModel):
            absolute_paths(value)


def start_head(num_cpus: int, log_path: Path, started: Callable[[dict[str, Any]], None],
               timeout_s: float = 120.0) -> dict[str, Any]:
    """``ray start --head --block`` on 127.0.0.1 in its own session, with Ray's token authentication and a token
    made for it (Ray binds some of its ports on every interface: without the token they refuse); returns its
    address, pid, temp dir and token file, which ``started`` is given first, as soon as the process exists (to
    record it). The head is stopped if it does not come up or the wait for it is interrupted (Ctrl-C): being in a
    session of its own, it would not get the terminal's SIGINT."""
    temp_dir = tempfile.mkdtemp(prefix="rwray-")  # short: Ray's socket paths must stay under 108 bytes
    token = Path(temp_dir) / "auth_token"  # the directory is the user's only (mkdtemp), the file too
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    port, client_port = free_port_outside_ephemeral(HOST), free_port_outside_ephemeral(HOST)
    while client_port == port:
        client_port = free_port_outside_ephemeral(HOST)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--node-ip-address={HOST}",
           f"--port={port}", f"--ray-client-server-port={client_port}", "--include-dashboard=false",
           "--disable-usage-stats", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        ours = out.tell()  # the log may hold an earlier head's lines: this one's start here
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **ray_auth_env(str(token)), **LOOPBACK_RAY_ENV},
                                start_new_session=True)
    head = {"address": f"{HOST}:{port}", "head_pid": proc.pid, "temp_dir": temp_dir, "auth_token": str(token)}
    try:
        started(head)
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in (text := log_path.read_bytes()[ours:].decode(errors="replace")):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(text.splitlines()[-20:])
                raise RuntimeError(f"ray start --head did not come up (see {log_path}):\n{tail}")
            time.sleep(0.2)
    except BaseException:
        stop_head(head)
        raise
    return head


def stop_head(head: dict[str, Any], timeout_s: float = 60.0) -> None:
    """SIGTERM to ``ray start --block`` alone (it drains the node through the GCS, then stops its processes: a GCS
    signalled with it cannot be drained through, and ``ray start`` waits 30 s for it), then SIGKILL its group."""
    pid = head["head_pid"]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    kill_group(pid)
    shutil.rmtree(head["temp_dir"], ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ray_auth_env(token_path: str) -> dict[str, str]:
    """The environment that makes a Ray process require (a head) or present (a driver) the token in the file; a
    driver's Ray reads the mode when it is imported (``services.cli`` sets it before), the file when it connects."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}


def _connect(state: dict[str, Any]) -> None:
    if state.get("auth_token"):  # the head `up` started; a cluster's own settings are the environment's
        os.environ.update(ray_auth_env(state["auth_token"]))
    address = state.get("address") or os.environ.get("RAY_ADDRESS")
    extra = {"_node_ip_address": HOST} if state.get("head_pid") else {}
    ray.init(address=address, namespace=state["namespace"], log_to_driver=False, **extra)


def _stop_all(state: dict[str, Any]) -> None:
    """Stop what ``state`` records: every component's actor at once (``_stop_actors``), then the Redis actor, which
    they use to the end (a rollout server hands its tasks back to it); a part already gone (or recorded but never
    started: ``up`` records each before starting it) is skipped. The head ``up`` started is stopped even if its
    actors could not be (a head killed mid-start may take no driver)."""
    head_gone = bool(state.get("head_pid")) and not _alive(state["head_pid"])  # its actors went with it
    try:
        if (state.get("actors") or state.get("placement_groups")) and not head_gone:
            if not ray.is_initialized():
                _connect(state)
            actors = state.get("actors", [])
            graces = state.get("stop_grace_s", {})
            _stop_actors([name for name in actors if name != REDIS_ACTOR], graces)
            _stop_actors([name for name in actors if name == REDIS_ACTOR], graces)
            for name in state.get("placement_groups", []):
                try:
                    remove_placement_group(ray.util.get_placement_group(name))
                except ValueError:
                    log.warning("placement group %s was already gone", name)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if state.get("head_pid"):
            stop_head(state)


def _stop_actors(names: list[str], graces: dict[str, float]) -> None:
    """Ask every named actor to stop at once, then wait for them together, each within its grace (``ray.json``'s
    ``stop_grace_s``, ``ComponentSpec.stop_grace_s``: the actor kills its component past it) and ``STOP_MARGIN_S``
    (``UNRECORDED_STOP_S`` where none is recorded), and kill each actor. A trainer rank gets its SIGTERM with the
    others, not after them, and the stop lasts as long as the longest grace, not their sum; a hung actor is named
    and killed at its own bound."""
    handles = {}
    for name in names:
        with contextlib.suppress(ValueError):  # gone already
            handles[name] = ray.get_actor(name)
    calls = {name: actor.stop.remote() for name, actor in handles.items()}
    sent = time.monotonic()
    for name, call in calls.items():
        bound = graces[name] + STOP_MARGIN_S if name in graces else UNRECORDED_STOP_S
        try:
            ray.get(call, timeout=max(0.0, sent + bound - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            log.warning("%s did not stop within %g s; killing its actor", name, bound)
        except ray.exceptions.RayError as exc:
            log.warning("%s did not stop cleanly: %s", name, exc)
        ray.kill(handles[name], no_restart=True)


def _checkpoint_tls(cfg: Config, run_dir: Path) -> tuple[str, ...]:
    """Unless ``checkpoint.tls_*`` are set, mutual TLS with a PKI made once for the run: ``cfg`` gets the
    receivers' certificate; returns the trainers' overrides for theirs."""
    if cfg.checkpoint.tls_ca is not None:
        return ()
    pki, made = ensure_checkpoint_pki(run_dir / "checkpoint-tls", RECEIVER_NAME)
    log.info("checkpoint plane: mutual TLS with the run's certificates in %s (%s)", pki.dir,
             "made now" if made else "made before")
    cfg.checkpoint = cfg.checkpoint.model_copy(update={  # all four at once: the section takes TLS whole or not
        "tls_ca": pki.ca, "tls_cert": pki.cert("receiver"), "tls_key": pki.key("receiver"),
        "tls_server_name": RECEIVER_NAME,
    })
    return f"checkpoint.tls_cert={pki.cert('trainer')}", f"checkpoint.tls_key={pki.key('trainer')}"


def _launch(cfg: Config, args: argparse.Namespace, state: dict[str, Any], run_dir: Path,
            trainer_overrides: tuple[str, ...], record: Callable[[], None]) -> str:
    """The embedded Redis (unless external) on this node, then the components in their placement groups; returns
    the Redis URL. Each part goes into ``state``, and ``record`` is called, before it is started."""
    def stack() -> list[ComponentSpec]:
        return components(cfg, run_dir / "config.yaml", None,  # Redis comes through REDIS_URL, set below
                          rollout_servers=args.rollout_servers, trainer_ranks=args.trainer_ranks,
                          trainer_args=("--resume", *trainer_overrides))

    if not os.environ.get("RAY_ADDRESS"):
        wanted = math.ceil(sum(s.num_cpus for s in stack())) + 1  # + the Redis actor
        start_head(max(wanted, os.cpu_count() or 1), run_dir / "logs" / "ray-head.log",
                   lambda head: (state.update(head), record()))
    _connect(state)
    if not is_loopback(ray.util.get_node_ip_address()):
        _secure_for_cluster(cfg)
    specs = stack()
    redis_url = configured_url(cfg.redis)
    if not redis_url:
        state["actors"].append(REDIS_ACTOR)
        record()
        actor = RedisActor.options(
            name=REDIS_ACTOR, lifetime="detached", num_cpus=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(
            str(cfg.redis.data_dir or run_dir / "redis"), cfg.redis.port, cfg.redis.aof, cfg.redis.appendfsync,
            cfg.redis.password.get_secret_value() if cfg.redis.password is not None else None,
        )
        try:
            redis_url = ray.get(actor.url.remote(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError("the Redis actor did not report its URL within 120 s (see `ray status` and "
                               f"{run_dir / 'logs'})") from None
    with client_for(redis_url, cfg.redis) as client:  # the API publishes its address afresh
        client.delete(Keys(cfg.run.name).api)
    forwarded = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    for spec in specs:
        spec.env = {**forwarded, **spec.env, "REDIS_URL": redis_url}
    for spec, (pg, index) in zip(specs, _place(specs, state, record), strict=True):
        state["actors"].append(spec.name)
        state.setdefault("stop_grace_s", {})[spec.name] = spec.stop_grace_s  # for ``down``'s wait
        record()
        ComponentActor.options(
            name=spec.name, lifetime="detached", num_cpus=0, num_gpus=spec.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        ).remote(spec, str(run_dir / "logs"), peers=tuple(s.name for s in specs if s is not spec))
    return redis_url


def _secure_for_cluster(cfg: Config) -> None:
    """On a cluster the parts listen on their nodes' addresses: the embedded Redis gets a password made for the run
    (the components get it in their environment) unless one is set, and the API must have its token."""
    if cfg.api.token is None:
        raise CliError("api.token is not set: on a Ray cluster the API listens on its node's address, where anyone "
                       "who reaches it could submit jobs; set ROLLWAVE_API_TOKEN or api.token_file")
    if cfg.redis.password is None and not configured_url(cfg.redis):
        cfg.redis.password = secrets.token_urlsafe(32)
        log.info("redis.password is not set: made one for this run (its components get it in their environment)")


def _place(specs: list[ComponentSpec], state: dict[str, Any],
           record: Callable[[], None]) -> list[tuple[PlacementGroup, int]]:
    """Each component's placement group and bundle: those marked ``one_node`` (the trainer ranks, whose
    rendezvous is on loopback) in a STRICT_PACK group, the rest in a PACK group, over as many nodes as they need."""
    where: dict[int, tuple[PlacementGroup, int]] = {}
    for together, strategy in ((True, "STRICT_PACK"), (False, "PACK")):
        members = [i for i, s in enumerate(specs) if s.one_node == together]
        if not members:
            continue
        bundles = [{"CPU": specs[i].num_cpus, **({"GPU": specs[i].num_gpus} if specs[i].num_gpus else {})}
                   for i in members]
        name = f"{state['namespace']}-{'one-node' if together else 'packed'}"
        state["placement_groups"].append(name)
        record()
        pg = placement_group(bundles, strategy=strategy, name=name, lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            names = ", ".join(specs[i].name for i in members)
            raise RuntimeError(f"the cluster cannot place {names} ({strategy}, bundles {bundles}; see `ray status`)"
                               ) from None
        where.update((i, (pg, index)) for index, i in enumerate(members))
    return [where[i] for i in range(len(specs))]


def _config_checks(names: list[str]) -> tuple[list[str], list[str]]:
    """(the components that refused their config as they started, those not heard from): each actor's
    constructor returns once its component got past its config check or exited, or after ``START_TIMEOUT_S``
    without a word (an actor Ray has not started by a minute after that is not heard from either)."""
    calls = {name: (ray.get_actor(name).returncode.remote(), ray.get_actor(name).config_checked.remote())
             for name in names}
    done, _ = ray.wait([c for pair in calls.values() for c in pair], num_returns=2 * len(calls),
                       timeout=START_TIMEOUT_S + 60)
    answered = {name: ray.get(list(pair)) for name, pair in calls.items() if all(c in done for c in pair)}
    refused = [name for name, (rc, _) in answered.items() if rc == CONFIG_ERROR_EXIT]
    silent = [name for name in names if name not in answered or not answered[name][1]]
    return refused, silent


@contextlib.contextmanager
def _ctrl_c_remembered() -> Iterator[threading.Event]:
    """Ctrl-C raises KeyboardInterrupt as by default, and sets the event: Python drops one raised inside a finalizer
    (a collected client's ``__del__``: "Exception ignored in"), and an ``up`` told to stop must not go on to report
    a clean start or stay. A SIGINT that is ignored (a background job) or someone else's stays as it was."""
    pressed = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield pressed
        return

    def interrupt(signum: int, frame: object) -> None:
        pressed.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def _raise_if_pressed(pressed: threading.Event) -> None:
    """Raise the Ctrl-C that a finalizer swallowed (``_ctrl_c_remembered``)."""
    if pressed.is_set():
        raise KeyboardInterrupt


def up(args: argparse.Namespace) -> int:
    """Start the run under its lock (``_run_lock``), recording each part in ``ray.json`` before starting it; what a
    failed or interrupted launch started is stopped. Then wait for the components' config checks and the API."""
    if os.environ.get("RAY_ADDRESS", "").startswith("ray://"):
        raise CliError(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}: `rollwave up` runs the embedded Redis on the node "
                       "it runs on and talks to it, and a Ray Client (ray://) driver is no node; run it on a node "
                       "of the cluster, with RAY_ADDRESS=auto or the head's host:port")
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    absolute_paths(cfg)
    run_dir = cfg.run.path
    run_dir.mkdir(parents=True, exist_ok=True)
    path = _state_path(cfg)
    state: dict[str, Any] = {"namespace": f"rollwave-{cfg.run.name}", "actors": [], "placement_groups": [],
                             "up_pid": os.getpid(), "launched": False}
    try:
        with _ctrl_c_remembered() as pressed:
            with _run_lock(run_dir, "up"):
                if path.exists():
                    _refuse_started(path, args)
                check_api_config(cfg)
                if cfg.redis.unix_socket and not configured_url(cfg.redis):
                    raise ConfigError("redis.unix_socket: `rollwave up` runs the embedded Redis in a Ray actor, "
                                      "which the components reach over TCP from any node; unset it, or give "
                                      "redis.url")
                ensure_checkpoint_token(cfg)
                trainer_overrides = _checkpoint_tls(cfg, run_dir)
                ensure_model(cfg.model)  # once here, not raced by every component
                # secrets masked; components get theirs as env
                (run_dir / "config.yaml").write_text(dump_config(cfg))
                try:
                    redis_url = _launch(cfg, args, state, run_dir, trainer_overrides,
                                        lambda: _write_state(path, state))
                    _raise_if_pressed(pressed)  # one a finalizer swallowed: stop what it started
                except BaseException:
                    _stop_all(state)  # if this fails too, ray.json stays, for `down`
                    path.unlink(missing_ok=True)
                    raise
                state["launched"] = True
                _write_state(path, state)
            return _await_start(cfg, args, state, redis_url, pressed)
    except KeyboardInterrupt:
        if not state["launched"]:  # what it started is stopped
            raise
        raise CliError(f"interrupted; left running: {_started(state)} (run {cfg.run.name}, {path}); "
                       f"`{_down_command(args)}` stops it", exit_code=130) from None


def _refuse_started(path: Path, args: argparse.Namespace) -> None:
    """CliError for an ``up`` of a run that has a ``ray.json``: the run is up, or the ``up`` that started it died
    mid-launch (it held the lock that is free now) and left what it recorded."""
    state = json.loads(path.read_text())
    if state.get("launched", True):
        raise CliError(f"{path} exists: the run is up; stop it with `{_down_command(args)}` first")
    raise CliError(f"{path}: the `rollwave up` that started this run (pid {state.get('up_pid')}) ended mid-launch, "
                   f"leaving what it had started: {_started(state)}; stop it with `{_down_command(args)}` first")


def _started(state: dict[str, Any]) -> str:
    """What ``state`` records as started (each part is recorded just before it starts)."""
    head = [f"the Ray head (pid {state['head_pid']}, {state['temp_dir']})"] if state.get("head_pid") else []
    return ", ".join([*state.get("actors", []), *head]) or "nothing"


def _await_start(cfg: Config, args: argparse.Namespace, state: dict[str, Any], redis_url: str,
                 pressed: threading.Event) -> int:
    """Wait for every component's config check and the API's address; with ``--foreground``, stay (``_stay``).
    ``pressed``: a Ctrl-C came (``_ctrl_c_remembered``)."""
    run_dir = cfg.run.path
    actors = [name for name in state["actors"] if name != REDIS_ACTOR]
    refused, silent = _config_checks(actors)
    ray.shutdown()
    if refused:  # exit 2 as for the CLI's other config errors: fix the input
        names = "; ".join(refusal(name, CONFIG_ERROR_EXIT, run_dir / "logs") for name in refused)
        print(f"error: {names}; not restarted, the rest is up: fix the config, stop the run with "
              f"`{_down_command(args)}`, then `rollwave up` again", file=sys.stderr)
        return 2
    if silent:
        print(f"error: {', '.join(silent)}: no word from the config check within {START_TIMEOUT_S:g} s of the "
              f"start (see {run_dir / 'logs'}); the rest is up: `{_down_command(args)}` stops it",
              file=sys.stderr)
        return 1
    try:
        with client_for(redis_url, cfg.redis) as client:
            api = published_api_url(client, Keys(cfg.run.name))
    except TimeoutError as exc:
        print(f"error: {exc} (see {run_dir / 'logs' / 'api.log'}); the rest is up: `{_down_command(args)}` stops it",
              file=sys.stderr)
        return 1
    _raise_if_pressed(pressed)
    print(f"rollwave up: run {cfg.run.name}: {', '.join(state['actors'])}; redis {redis_url}; "
          f"API {api}; logs {run_dir / 'logs'}")
    return _stay(args, state, actors, pressed) if args.foreground else 0


def _stay(args: argparse.Namespace, state: dict[str, Any], names: list[str], pressed: threading.Event) -> int:
    """``up --foreground``: stay until Ctrl-C, then stop the run; or until an actor gives its component up (having
    stopped the others): then stop the run too, and return 1 naming it."""
    _connect(state)
    try:
        while not (given_up := _given_up(names)):
            _raise_if_pressed(pressed)
            time.sleep(1)
    except KeyboardInterrupt:
        return down(args)
    print(f"error: {'; '.join(given_up)}; stopping the run", file=sys.stderr, flush=True)
    down(args)
    return 1


def _given_up(names: list[str]) -> list[str]:
    """Why each of the actors of ``names`` that gave its component up did so; one busy for 10 s (stopping its
    component, as a peer's give-up asked) is asked again next time."""
    calls = [ray.get_actor(name).given_up.remote() for name in names]
    done, _ = ray.wait(calls, num_returns=len(calls), timeout=10)
    return [message for message in ray.get(done) if message]


def _down_command(args: argparse.Namespace) -> str:
    """The ``rollwave down`` of this run: its overrides too (``run.name`` may be one of them)."""
    return shlex.join(["rollwave", "down", "-c", str(args.config), *args.overrides])


def down(args: argparse.Namespace) -> int:
    """Stop what the run's ``ray.json`` records, under the run's lock (not while an ``up`` is launching it)."""
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    path = _state_path(cfg)
    if not path.exists():
        print(f"nothing to stop: {path} does not exist", file=sys.stderr)
        return 0
    with _run_lock(path.parent, "down"):
        state = json.loads(path.read_text())
        _stop_all(state)
        path.unlink()
    print(f"rollwave down: stopped {_started(state)}")
    return 0
