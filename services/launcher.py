"""What a run consists of, and a local supervisor that keeps it running as plain processes.

``components(...)`` is the one description of a stack (Redis aside): R rollout servers, W trainer
ranks and the API, each a ``python -m`` command. ``LocalStack`` runs it as child processes and
restarts one that dies, after a delay that doubles while it keeps dying soon after its start (``RestartBackoff``;
the demo, the end-to-end tests), and gives up on one that keeps dying (``launcher.max_restarts`` within
``launcher.restart_window_s``), stopping the whole stack; ``services.ray_launcher`` places the same commands in Ray
actors, which restart their process, and give it up, by the same policy.

No component is handed a port: each binds what its config says (0 by default: any free port) and
publishes what it bound in Redis (the registry, the trainer status, ``Keys.api``), so a restarted one
never waits for its old port. The trainer ranks' rendezvous port is the exception: every rank must know
it before any starts.
Secrets reach each component in its environment, and only those it needs (the config file it reads has them
masked): the trainer and the rollout servers the checkpoint token (and the engine key), the API its token,
every component the Redis password.

Each component has a grace to stop in after its SIGTERM (``ComponentSpec.stop_grace_s``), then is SIGKILLed, its name
logged: a trainer rank ``launcher.trainer_stop_grace_s`` (120 s: a pool's ranks finish a checkpoint or a push in flight
first, as the chart and compose allow them), a rollout server ``rollout.shutdown_grace_s`` for its groups in flight and
``HAND_BACK_S`` to hand the rest back, the API ``STOP_GRACE_S``. Each stops as soon as it can: the grace bounds a slow
or hung one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import redis

from buffer.keys import Keys
from core.config import CONFIG_ERROR_EXIT, SECRETS, Config, ConfigError, LauncherConfig, secret_env
from core.net import free_port_outside_ephemeral
from core.placement import cpu_share, idle_threads_env
from core.process import PARENT_PID_ENV, kill_group, stop_process

log = logging.getLogger(__name__)
SECRET_VARS = frozenset(SECRETS.values())
LIMITS = LauncherConfig()  # the restart limit a spec has unless ``components`` gives it the config's
STOP_GRACE_S = 30.0  # the API's stop: its requests are bounded by redis.timeout_s and api.body_timeout_s
HAND_BACK_S = 15.0  # a rollout server's stop past rollout.shutdown_grace_s: the hand-back, its engine's stop
SUPERVISOR_JOIN_S = 30.0  # ``close``'s wait for the supervisor, which sees the stop at its next poll


def ensure_checkpoint_token(cfg: Config) -> None:
    """A launcher starts both ends of the checkpoint plane, so with no token configured it makes one for the run."""
    if cfg.checkpoint.token is None:
        cfg.checkpoint.token = secrets.token_urlsafe(32)
        log.info("checkpoint.token is not set: made one for this run (its components get it in their environment)")


@dataclass
class ComponentSpec:
    """One process of the stack: its command line, environment and the resources it asks for."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    restart: bool = True
    # exits 0 once its work is done (a trainer rank at its last step), and is left stopped then; any other component
    # runs until it is stopped, so its exit 0 (a rollout server's at a SIGTERM the launcher did not send) is a failure
    # to restart, as the trainer's 143 is
    ends: bool = False
    max_restarts: int = LIMITS.max_restarts  # given up after this many restarts within restart_window_s (0: never)
    restart_window_s: float = LIMITS.restart_window_s
    # overrides given where it runs on Ray, ``{address}`` being its node's address: peers on other nodes reach it
    node_overrides: tuple[str, ...] = ()
    one_node: bool = False  # placed on one node with the others so marked (the trainer ranks' rendezvous)
    stop_grace_s: float = STOP_GRACE_S  # its time to stop after the SIGTERM, before the SIGKILL


def components(
    cfg: Config,
    config_path: Path,
    redis_url: str | None,
    *,
    rollout_servers: int = 1,
    trainer_ranks: int = 1,
    api: bool = True,
    host: str = "127.0.0.1",
    trainer_args: tuple[str, ...] = ("--resume",),
) -> list[ComponentSpec]:
    """The processes of a run; ``redis_url`` None leaves Redis to ``REDIS_URL`` in their environment."""
    py = sys.executable
    common = [f"redis.url={redis_url}"] if redis_url else []
    redis_env = secret_env(cfg, "redis.password")
    checkpoint_env = {**redis_env, **secret_env(cfg, "checkpoint.token")}
    specs: list[ComponentSpec] = []
    limits = {"max_restarts": cfg.launcher.max_restarts, "restart_window_s": cfg.launcher.restart_window_s}
    gpu = 1.0 if cfg.trainer.device == "cuda" else 0.0
    pool = {"WORLD_SIZE": str(trainer_ranks), "LOCAL_WORLD_SIZE": str(trainer_ranks)}
    if trainer_ranks > 1:  # a pool of one needs no rendezvous
        pool.update(MASTER_ADDR=host, MASTER_PORT=str(free_port_outside_ephemeral(host)))
    for rank in range(trainer_ranks):
        env = {**checkpoint_env, **pool, "RANK": str(rank), "LOCAL_RANK": str(rank),
               **idle_threads_env(cfg.placement.trainer_cpus)}
        argv = [py, "-m", "trainer", "-c", str(config_path), *trainer_args, *common]
        specs.append(ComponentSpec(f"trainer-{rank}", argv, env, num_gpus=gpu, one_node=True, ends=True,
                                   stop_grace_s=cfg.launcher.trainer_stop_grace_s, **limits))
    # the servers share placement.rollout_cpus: unless engine.threads says, their engines split its CPUs, as the
    # trainer's ranks split theirs, rather than each running one thread per CPU of the set
    share = ([f"engine.threads={cpu_share(cfg.placement.rollout_cpus, rollout_servers)}"]
             if cfg.placement.rollout_cpus and not cfg.engine.threads else [])
    for i in range(rollout_servers):
        argv = [py, "-m", "rollout_server", "-c", str(config_path), *common, f"rollout.server_id=rollout-{i}",
                *share]
        env = {**checkpoint_env, **secret_env(cfg, "engine.api_key"), **idle_threads_env(cfg.placement.rollout_cpus)}
        specs.append(ComponentSpec(f"rollout-{i}", argv, env, node_overrides=("rollout.grpc_host={address}",),
                                   stop_grace_s=cfg.rollout.shutdown_grace_s + HAND_BACK_S, **limits))
    if api:
        argv = [py, "-m", "services.api", "-c", str(config_path), *common]
        hosts = json.dumps([*cfg.api.allowed_hosts, "{address}"])  # requests name the node's address too
        specs.append(ComponentSpec("api", argv, {**redis_env, **secret_env(cfg, "api.token")}, num_cpus=0.5,
                                   node_overrides=("api.host={address}", f"api.allowed_hosts={hosts}"), **limits))
    return specs


def published_api_url(client: redis.Redis, keys: Keys, timeout_s: float = 120.0,
                      check: Callable[[], None] | None = None) -> str:
    """The URL the run's API published once it had bound its port (``api.port=0`` takes any free one).

    A caller that starts the API on a run that had one before deletes ``keys.api`` first. ``check`` is called at each
    poll and raises to end the wait (``LocalStack.check_refused``: an API that refused its config or was given up
    publishes nothing, and the wait used to last its whole timeout, then fail without naming why).
    """
    deadline = time.monotonic() + timeout_s
    while (url := client.hget(keys.api, "url")) is None:
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the API of run {keys.run} published no address within {timeout_s:.0f} s")
        time.sleep(0.2)
    return url.decode()


def spawn(spec: ComponentSpec, log_dir: Path, base_env: Mapping[str, str],
          pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start one component in its own process group, logging to ``log_dir/<name>.log``; it dies with this
    process (``core.process.die_with_parent``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    inherited = {k: v for k, v in base_env.items() if k not in SECRET_VARS}  # a component gets only its own
    with open(log_dir / f"{spec.name}.log", "ab") as out:
        return subprocess.Popen(
            spec.argv, env={**inherited, **spec.env, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())},
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            pass_fds=pass_fds,
        )


def refusal(name: str, rc: int, log_dir: Path) -> str:
    """How a launcher names a component that exited on a config error (``CONFIG_ERROR_EXIT``), which it leaves
    stopped: restarted, it would only refuse again."""
    return f"{name} refused its config (exit {rc}; the reason is the last line of {log_dir / f'{name}.log'})"


class ComponentGivenUp(RuntimeError):
    """A component kept failing and the launcher gave it up, stopping the run (``RestartBackoff.gave_up``)."""


class RestartBackoff:
    """When a launcher restarts one component that failed; ``LocalStack`` and the Ray launcher's actors share it.

    It is restarted after ``backoff_s``, doubled for each further death within ``stable_s`` of its start, up to
    ``max_backoff_s``: one that cannot start (a port taken, a peer missing) is not respawned, and its log grown,
    twice a second for as long as the run lasts. One that stayed up ``stable_s`` starts again from ``backoff_s``. A
    restart that could not be made (``spawn`` failed: a process or file limit) waits the next delay. Each delay is
    logged, and ``restarts`` counts the restarts made.

    Nor is one that keeps failing restarted for as long as the run lasts: the death that would be restart
    ``max_restarts + 1`` within ``window_s`` gives it up (``died`` returns None; ``launcher.max_restarts``, 0:
    never), however long each run stayed up (as systemd's ``StartLimitBurst`` counts), so one that dies a while
    after each start, past ``stable_s``, is given up too. A restart that could not be made does not count: the
    launcher's host failed it, not the component.
    """

    BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 0.5, 30.0, 60.0

    def __init__(self, name: str, backoff_s: float = BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S,
                 stable_s: float = STABLE_S, max_restarts: int = LIMITS.max_restarts,
                 window_s: float = LIMITS.restart_window_s) -> None:
        self.name = name
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.max_restarts, self.window_s = max_restarts, window_s
        self._starts = 0
        self._started = 0.0  # when it was last started (monotonic)
        self._next_s = min(max_backoff_s, backoff_s)  # the next delay: doubled, not 2**deaths (a float overflows)
        self._deaths: deque[float] = deque()  # its deaths within window_s (monotonic)

    @property
    def restarts(self) -> int:
        """Every start after the first."""
        return max(0, self._starts - 1)

    def started(self) -> None:
        """The component was started (again)."""
        self._starts += 1
        self._started = time.monotonic()

    def died(self, rc: int) -> float | None:
        """The delay before restarting the component, which exited with ``rc`` after its last ``started``; None
        when it is given up (``gave_up`` says so)."""
        now = time.monotonic()
        up_s = now - self._started
        if up_s >= self.stable_s:  # it had settled: its restart is not delayed by the deaths before
            self._next_s = min(self.max_backoff_s, self.backoff_s)
        self._deaths.append(now)
        while self._deaths[0] < now - self.window_s:
            self._deaths.popleft()
        if self.max_restarts and len(self._deaths) > self.max_restarts:
            return None
        delay = self._take()
        log.warning("%s exited with %s after %.1f s up; restarting it in %g s", self.name, rc, up_s, delay)
        return delay

    def gave_up(self, rc: int, log_dir: Path) -> str:
        """Log (an error) the give-up ``died`` returned None for; returns what it logged, which names the component,
        its last exit code and its log. Not a metric: the run it stops serves none after, and exits failing."""
        message = (f"{self.name} keeps failing and is given up: it died {len(self._deaths)} times within "
                   f"{self.window_s:g} s (launcher.max_restarts={self.max_restarts}); its last exit {rc}, its log "
                   f"{log_dir / f'{self.name}.log'}")
        log.error("%s; stopping the run", message)
        return message

    def not_restarted(self, exc: OSError) -> float:
        """The delay before trying again to restart the component, whose restart failed with ``exc``."""
        delay = self._take()
        log.error("%s could not be restarted (%s); trying again in %g s", self.name, exc, delay)
        return delay

    def _take(self) -> float:
        delay, self._next_s = self._next_s, min(self.max_backoff_s, self._next_s * 2)
        return delay


class LocalStack:
    """Runs component specs as child processes, restarts any that fails (``RestartBackoff``), and stops them all on
    close, whatever each is doing then: running, waiting out its backoff, being restarted; each within its spec's
    ``stop_grace_s``. One that fails at every start is given up (its spec's ``max_restarts``): the stack stops them all
    then, and ``check_refused`` raises.
    """

    def __init__(self, specs: list[ComponentSpec], log_dir: Path, poll_s: float = 0.5,
                 backoff_s: float = RestartBackoff.BACKOFF_S, max_backoff_s: float = RestartBackoff.MAX_BACKOFF_S,
                 stable_s: float = RestartBackoff.STABLE_S) -> None:
        self.specs = {s.name: s for s in specs}
        self.log_dir = log_dir
        self.poll_s = poll_s
        self.backoff = {name: RestartBackoff(name, backoff_s, max_backoff_s, stable_s, spec.max_restarts,
                                             spec.restart_window_s) for name, spec in self.specs.items()}
        self.given_up: str | None = None  # why the stack stopped itself: a component kept failing
        self.procs: dict[str, subprocess.Popen] = {}
        self._due: dict[str, float] = {}  # died: when its restart is due (monotonic)
        self.refused: set[str] = set()  # exited on a config error: not restarted (it would only fail again)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def restarts(self) -> dict[str, int]:
        """The restarts made of each component."""
        return {name: backoff.restarts for name, backoff in self.backoff.items()}

    def _spawn(self, spec: ComponentSpec) -> subprocess.Popen:
        proc = spawn(spec, self.log_dir, os.environ)
        self.backoff[spec.name].started()
        log.info("started %s (pid %d)", spec.name, proc.pid)
        return proc

    def start(self) -> LocalStack:
        """Start every component; one that cannot be started stops those started before it (a ``with`` block
        that raises on entry never closes) and is named in the RuntimeError."""
        try:
            with self._lock:
                for spec in self.specs.values():
                    try:
                        self.procs[spec.name] = self._spawn(spec)
                    except OSError as exc:
                        raise RuntimeError(f"{spec.name}: cannot start it: {exc}") from exc
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._supervise, name="local-stack", daemon=True)
        self._thread.start()
        return self

    def _supervise(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if self._stop.is_set():  # close() set it under this lock: no restart begins after it
                    return
                for name, proc in list(self.procs.items()):
                    if name in self._due:  # waiting out its backoff
                        if time.monotonic() >= self._due[name]:
                            self._restart(name)
                        continue
                    rc = proc.poll()
                    if rc is None:
                        continue
                    spec = self.specs[name]
                    if (rc == 0 and spec.ends) or not spec.restart or name in self.refused:
                        continue
                    if rc == CONFIG_ERROR_EXIT:
                        log.error("%s; not restarting it", refusal(name, rc, self.log_dir))
                        self.refused.add(name)
                        continue
                    kill_group(proc.pid)  # what it left (a rollout server's engine) would run beside the new one
                    if (delay := self.backoff[name].died(rc)) is None:
                        message = self.backoff[name].gave_up(rc, self.log_dir)
                        self._stop.set()
                        self._stop_components()
                        self.given_up = message  # once every component is stopped
                        return
                    self._due[name] = time.monotonic() + delay

    def _restart(self, name: str) -> None:
        """Start ``name`` again, its backoff waited out; one that cannot be started now (a process or file limit) is
        tried again after the next delay, rather than end the supervision of every component."""
        try:
            self.procs[name] = self._spawn(self.specs[name])
        except OSError as exc:
            self._due[name] = time.monotonic() + self.backoff[name].not_restarted(exc)
        else:
            del self._due[name]

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> bool:
        """Fault injection: signal one component's process group (the supervisor restarts it); whether it was
        running. One that is not (it died and waits out its backoff, or it ended) has no process to signal."""
        with self._lock:
            proc = self.procs[name]
            if name in self._due or proc.poll() is not None:
                log.info("%s is not running: not signalled", name)
                return False
            os.killpg(proc.pid, sig)  # not reaped (only a poll under this lock reaps it): its group is there
            return True

    def check_refused(self) -> None:
        """ConfigError naming a component that refused its config, with the line its log ends on (the reason):
        the stack leaves it stopped, so whatever waits on it would only wait out its timeout. ``ComponentGivenUp``
        naming the component the stack gave up on (``given_up``), having stopped every component."""
        for name in sorted(self.refused):
            log_file = self.log_dir / f"{name}.log"
            lines = log_file.read_text(errors="replace").strip().splitlines() if log_file.exists() else []
            raise ConfigError(f"{refusal(name, CONFIG_ERROR_EXIT, self.log_dir)}: {lines[-1] if lines else ''}")
        if self.given_up is not None:
            raise ComponentGivenUp(f"the stack stopped: {self.given_up}")

    def finished(self, name: str) -> bool:
        proc = self.procs[name]
        return proc.poll() == 0

    def close(self) -> None:
        """Stop every component (``_stop_components``). No restart begins once this has begun, and one waiting out
        its backoff has no process left (its group was killed as it died)."""
        with self._lock:  # the supervisor restarts only under this lock, where it sees the stop first
            self._stop.set()
        if self._thread is not None:
            self._thread.join(SUPERVISOR_JOIN_S)
            if self._thread.is_alive():
                log.error("the supervisor did not end within %g s of close; stopping the components anyway",
                          SUPERVISOR_JOIN_S)
        with self._lock:
            self._stop_components()

    def _stop_components(self) -> None:
        """SIGTERM to every component's group at once; each that has not exited within its spec's ``stop_grace_s``
        is SIGKILLed, named in the log (``stop_process``), as is what is left of its group; under the lock. A trainer
        rank's long grace holds back no other's kill, and the stop ends as soon as every component has."""
        running = {name: proc for name, proc in self.procs.items() if name not in self._due}
        with ThreadPoolExecutor(max(1, len(running)), thread_name_prefix="stop") as pool:
            list(pool.map(lambda name: stop_process(running[name], self.specs[name].stop_grace_s, name=name,
                                                    group=True), running))

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
