"""Runs one sample of an ``agent`` job: the job's ``module:function`` in its own process, with limits.

The entrypoint is ``fn(task, base_url, api_key)`` (sync or async): ``task`` is the task's ``task_id``,
``messages`` and ``tools`` (never its reward spec, which may hold the answer), ``base_url`` and
``api_key`` are for the ``openai`` client. It returns a finite float reward, or None to leave the reward to
the job's reward function.

Each run is a fresh process forked from a multiprocessing fork server that has already imported
``openai`` and the allowed agents' modules and run the ``openai`` client once (``start_fork_server``), so a
sample starts in milliseconds instead of paying a Python start, those imports (about 1 s of CPU here) and the
client's first call (``agent_warmup``). The child leads its own session, pins itself to
``placement.agent_cpus`` when set, and becomes a child subreaper: it forks the agent's process, which sets its own
address-space limit (``RLIMIT_AS``) before calling the agent and sends its result back over a pipe, as JSON: the
rollout server never unpickles what the agent's process sends (a reward's ``__reduce__`` would run the agent's code
in the server, which holds the secrets its config read, and a class the server cannot import would raise there).
Every process the agent starts stays below the child, even one in a session of its own whose parent has exited
(orphans come to the subreaper, not to init), so when the agent's process exits, or the parent closes its end of
a second pipe (at the time limit, on cancellation, or because the rollout server died), the child SIGKILLs and
reaps all of them, leaving neither a process nor a zombie. The parent SIGKILLs the child's process group if the
child has not ended ``KILL_WAIT_S`` after that.
The agent's process and every process it starts are at most ``max_processes`` (``rollout.agent_max_processes``;
threads count too) at once: a fork past that fails with EAGAIN, so a fork bomb in agent code fills its own quota,
not the host's process table; an agent that fails while a fork fails so is reported as having failed at its limit
(``limit`` ``process_limit``). The mechanism is ``RLIMIT_NPROC``, which counts the processes of a real uid, all of
them: set in the server's own user namespace it would count the rollout server's processes, its engine's and every
other agent's (one agent could starve the rest, and a limit above that count bounds nothing). Since Linux 5.14 the
kernel counts it per user namespace (and charges each parent namespace as well, bounded there by the limit its
creator had), so the agent's process first makes a user namespace of its own (``unshare(CLONE_NEWUSER)``; the child,
in the parent namespace, writes its uid and gid maps) and sets the limit there: the count is this agent's processes
only. A pids cgroup would do it too, but a rollout server has no cgroup of its own to divide (none in a container
without delegation, nor in this project's images), and bubblewrap's ``--unshare-pid`` limits nothing by itself. Root
is never held to ``RLIMIT_NPROC``, so run as root the agent's process keeps uid 0 as its effective uid (its files
are root's, as before) but takes ``NPROC_UID`` as its real uid, the one the kernel counts; code that sets its real
uid back to 0 escapes the count (it runs as root: it could stop the server anyway), a fork bomb does not; what it
executes runs as a set-user-ID program would (``AT_SECURE``: glibc drops ``LD_*`` and ``TMPDIR``). Where user
namespaces are not allowed (Docker's and Kubernetes' RuntimeDefault seccomp profiles), the run fails, saying so: set
``rollout.agent_max_processes`` to null to run agents without the limit there.
What the agent and the processes it starts print (stdout and stderr) goes to a pipe the rollout server reads as it
comes, keeping only the last ``OUTPUT_TAIL`` bytes, which it logs when the run ends with the number of bytes dropped
before them: an agent printing in a loop costs neither the server's memory nor its log more than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import json
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import os
import reprlib
import resource
import select
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from core.imports import import_object

ERROR_TAIL = 2000
RESULT_MAX_BYTES = 64 << 10  # a result's JSON, at most: the agent's process sends it before the parent reads (a pipe)
OUTPUT_TAIL = 16 << 10  # bytes of what an agent printed that are kept and logged: the last ones
KILL_WAIT_S = 10.0
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWUSER = 0x10000000
NPROC_UID = 65534  # run as root: the agent's real uid, counted against its process limit (root never is)
_FORK_SERVER = multiprocessing.get_context("forkserver")
log = logging.getLogger(__name__)
AGENT_ARGS = ("task", "base_url", "api_key")  # what an agent is called with
_CHECK = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from rollout_server.agent_runner import entrypoint_error; "
          "print('\\n' + json.dumps({e: entrypoint_error(e) for e in sys.argv[2:]}))")


@dataclass
class AgentOutcome:
    """A finished run: the agent's reward (None: use the reward function), or why the sample failed."""

    reward: float | None = None
    failure: str | None = None  # finish_reason: agent_error | agent_timeout
    error: str = ""
    limit: str | None = None  # process_limit: the agent failed at its max_processes


class _Output:
    """What an agent prints, read as it comes (unread, a full pipe would block the agent): only the last ``limit``
    bytes are kept, and those before them counted."""

    def __init__(self, fd: int, limit: int) -> None:
        os.set_blocking(fd, False)
        self.fd, self.limit, self.kept, self.dropped, self.ended = fd, limit, bytearray(), 0, False

    def read(self) -> bool:
        """Read one chunk; whether there was one (none yet, or none ever: ``ended``, every writer gone)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return False
        self.ended = not chunk
        self.kept += chunk
        if (excess := len(self.kept) - self.limit) > 0:
            self.dropped += excess
            del self.kept[:excess]
        return bool(chunk)

    def log(self, entrypoint: str, task_id: str) -> None:
        if not self.kept:
            return
        dropped = f"; the first {self.dropped} bytes dropped" if self.dropped else ""
        log.info("agent %s, task %s, printed %d bytes%s:\n%s", entrypoint, task_id, self.dropped + len(self.kept),
                 dropped, self.kept.decode(errors="replace"))


def agent_task(task: Any) -> dict[str, Any]:
    return {"task_id": task.task_id, "messages": task.messages, "tools": task.tools}


def entrypoint_error(entrypoint: str) -> str | None:
    """Why ``entrypoint`` cannot run as an agent, or None. Imports its module, the operator's code: call it in a
    process of its own (``check_entrypoints``)."""
    try:
        fn = import_object(entrypoint)
    except ModuleNotFoundError:
        return f"no module {entrypoint.partition(':')[0]!r} on this server's path"
    except ImportError as exc:
        return str(exc)
    if not callable(fn):
        return f"{reprlib.repr(fn)} is not callable; an agent is a function"
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        return "is a generator function; an agent returns its reward (a float or None)"
    try:
        signature = inspect.signature(fn)
    except ValueError:  # none to read (a builtin): the call will tell
        return None
    try:
        signature.bind(*AGENT_ARGS)
    except TypeError as exc:
        return f"takes {signature} ({exc}); an agent is called as fn({', '.join(AGENT_ARGS)})"
    return None


def check_entrypoints(entrypoints: list[str], timeout_s: float, env: dict[str, str]) -> dict[str, str]:
    """Why each of ``entrypoints`` that cannot run as an agent cannot (``entrypoint_error``), found in a process of
    its own with ``env``, the agents' environment: their modules are the operator's code, and one that raised as the
    fork server imported it would end that server, and every agent run with it. ValueError when that process takes
    over ``timeout_s`` or dies."""
    try:
        proc = subprocess.run([sys.executable, "-c", _CHECK, json.dumps(sys.path), *entrypoints], env=env,
                              capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ValueError(f"importing the agents' modules took over {timeout_s:g}s (rollout.agent_timeout_s)") from None
    printed = proc.stdout.strip().splitlines()  # the last line: what a module printed as it was imported comes first
    # (on lines of its own: the verdict starts a line, even after a print that ended none)
    if proc.returncode != 0 or not printed:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise ValueError(f"importing the agents' modules ended the process that checked them: {last}")
    return {entry: why for entry, why in json.loads(printed[-1]).items() if why is not None}


async def start_fork_server(entrypoints: list[str]) -> None:
    """Start the fork server with ``openai`` warmed up and the modules of ``entrypoints`` imported (a module that
    fails to import there is imported again, and fails loudly, in the sample's own process)."""
    modules = dict.fromkeys(["rollout_server.agent_runner", "rollout_server.agent_warmup",
                             *(e.partition(":")[0] for e in entrypoints)])
    _FORK_SERVER.set_forkserver_preload(list(modules))
    await asyncio.to_thread(multiprocessing.forkserver.ensure_running)


async def run_agent(entrypoint: str, task: Any, base_url: str, api_key: str, *, timeout_s: float,
                    memory_mb: int, max_processes: int | None, cpus: list[int] | None = None) -> AgentOutcome:
    """Run ``entrypoint`` for one sample in a child process, pinned to ``cpus`` if given, its processes at most
    ``max_processes`` (None: unlimited); never raises for the agent's faults, and returns (or raises) only once the
    child and every process the agent started are gone."""
    payload = {"entrypoint": entrypoint, "task": agent_task(task), "base_url": base_url, "api_key": api_key,
               "memory_mb": memory_mb, "cpus": cpus or [], "max_processes": max_processes}
    receive, send = _FORK_SERVER.Pipe(duplex=False)
    watch, keep = _FORK_SERVER.Pipe(duplex=False)  # the child ends the agent once ``keep`` is closed
    printed, prints = _FORK_SERVER.Pipe(duplex=False)  # the agent's stdout and stderr
    proc = _FORK_SERVER.Process(target=_child, args=(payload, send, watch, prints), name=f"agent {task.task_id}",
                                daemon=True)
    output = _Output(printed.fileno(), OUTPUT_TAIL)
    loop = asyncio.get_running_loop()

    def read_output() -> None:
        if not output.read() and output.ended:
            loop.remove_reader(output.fd)

    loop.add_reader(output.fd, read_output)
    try:
        await asyncio.to_thread(proc.start)
        send.close()
        watch.close()
        prints.close()
        try:
            await asyncio.wait_for(_exited(proc.sentinel), timeout_s)
        except TimeoutError:
            return AgentOutcome(failure="agent_timeout", error=f"agent {entrypoint} ran past {timeout_s:g}s")
        result = _received(receive)
    finally:
        keep.close()
        receive.close()
        prints.close()
        if proc.pid is not None:
            await _end(proc)
        loop.remove_reader(output.fd)
        while output.read():  # the rest, once every process that could print is gone
            pass
        printed.close()
        output.log(entrypoint, task.task_id)
    if "process_limit" in result:
        return AgentOutcome(failure="agent_error", limit="process_limit",
                            error=f"agent {entrypoint} failed at its limit of {max_processes} processes "
                                  f"(rollout.agent_max_processes): {result['process_limit']}")
    if "error" in result:
        return AgentOutcome(failure="agent_error", error=f"agent {entrypoint} failed: {result['error']}")
    if "invalid" in result:
        return AgentOutcome(failure="agent_error",
                            error=f"agent {entrypoint} returned {result['invalid']}; want a finite float or None")
    if proc.exitcode != 0 or "reward" not in result:
        return AgentOutcome(failure="agent_error", error=f"agent {entrypoint} exited {proc.exitcode} with no result")
    reward = result["reward"]
    return AgentOutcome(reward=None if reward is None else float(reward))


def _received(receive: Connection) -> dict[str, Any]:
    """The result the agent's process sent, read as JSON and checked (a message that is not one the runner sends is
    an ``error``); ``{}`` when it sent none."""
    if not receive.poll():
        return {}
    try:
        message = json.loads(receive.recv_bytes(RESULT_MAX_BYTES))
    except EOFError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:  # past RESULT_MAX_BYTES, not JSON
        return {"error": f"its process sent a result that cannot be read: {exc}"}
    if isinstance(message, dict) and len(message) == 1:
        [(key, value)] = message.items()
        if (key == "reward" and _is_reward(value)) or (key in ("error", "invalid", "process_limit")
                                                        and isinstance(value, str)):
            return message
    return {"error": f"its process sent {reprlib.repr(message)}, not a result"}


def _is_reward(value: Any) -> bool:
    """Whether ``value`` can be a sample's reward: None, or a finite int or float (not a bool)."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range
        return False


async def _exited(sentinel: int) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(sentinel, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(sentinel)


async def _end(proc: multiprocessing.process.BaseProcess) -> None:
    """Wait for the child, which ends the agent and all it started once ``keep`` is closed; SIGKILL its process
    group (the child itself if it has not led one yet) if it has not ended within ``KILL_WAIT_S``."""
    try:
        await asyncio.wait_for(_exited(proc.sentinel), KILL_WAIT_S)
    except TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            proc.kill()
    proc.join()


def _child(payload: dict[str, Any], result: Connection, watch: Connection, prints: Connection) -> None:
    """The subreaper above the agent's process: returns (exits) with the agent's exit code once the agent has
    exited or ``watch`` has closed, and every process below it is killed and reaped."""
    os.setsid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    if payload["cpus"]:  # the rollout server checked them at start (placement.agent_cpus)
        os.sched_setaffinity(0, payload["cpus"])
    unshared, mapped = os.pipe(), os.pipe()  # the agent's process made its user namespace; this one mapped it
    agent = os.fork()
    if agent == 0:
        watch.close()
        os.dup2(prints.fileno(), 1)
        os.dup2(prints.fileno(), 2)
        prints.close()
        os.close(unshared[0])
        os.close(mapped[1])
        code = 1
        try:
            code = _agent(payload, result, unshared[1], mapped[0])
        finally:
            sys.stderr.flush()
            os._exit(code)
    result.close()
    prints.close()
    os.close(unshared[1])
    os.close(mapped[0])
    if os.read(unshared[0], 1):  # nothing: it made none (no limit), or failed to and says why
        _map_user_namespace(agent, mapped[1])
    os.close(unshared[0])
    os.close(mapped[1])
    try:
        select.select([watch, os.pidfd_open(agent)], [], [])  # the pidfd is closed as this process exits
    finally:
        code = _kill_descendants(agent)
    raise SystemExit(code)


def _kill_descendants(agent: int) -> int:
    """SIGKILL and reap every process below this one, a subreaper (what a killed process leaves comes to it);
    returns the agent's exit code."""
    code, killed = 1, False
    while True:
        try:  # blocks only while a child it killed has still to die, not on one that came since, unkilled
            pid, status = os.waitpid(-1, 0 if killed else os.WNOHANG)
        except ChildProcessError:
            return code
        if pid == agent:
            code = os.waitstatus_to_exitcode(status)
        killed = False
        if pid == 0:  # a child runs: kill every child there is now
            for child in _children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
                killed = True


def _children() -> list[int]:
    """This process's children, read from ``/proc`` (``/proc/<pid>/task/<tid>/children`` needs a kernel built with
    CONFIG_PROC_CHILDREN)."""
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])  # the name before ")" may hold anything
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
        if parent == me:
            found.append(int(entry.name))
    return found


def _map_user_namespace(agent: int, mapped: int) -> None:
    """Map the user namespace the agent's process made (the module's docstring): its uid and gid to themselves, and
    as root ``NPROC_UID`` too, for it to take as its real uid; then tell it so through ``mapped``. A map that cannot
    be written is left unwritten: the agent's process then fails, saying so."""
    uid, gid = os.getuid(), os.getgid()
    maps = {"uid_map": f"{uid} {uid} 1\n", "gid_map": f"{gid} {gid} 1\n"}
    if uid == 0:
        maps["uid_map"] += f"{NPROC_UID} {NPROC_UID} 1\n"
    else:  # as another user, the kernel takes a gid map only once setgroups is denied
        maps = {"setgroups": "deny", **maps}
    try:
        for name, lines in maps.items():
            with open(f"/proc/{agent}/{name}", "w") as file:
                file.write(lines)
    except OSError:
        return
    os.write(mapped, b"1")


def _limit_processes(limit: int, unshared: int, mapped: int) -> None:
    """Hold this process and all it starts to ``limit`` processes (the module's docstring): a user namespace of its
    own, mapped by the child above it, then ``RLIMIT_NPROC`` (as root, on the real uid ``NPROC_UID``)."""
    root = os.getuid() == 0
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot hold the agent to rollout.agent_max_processes: unshare(CLONE_NEWUSER): "
                             f"{os.strerror(error)}; allow user namespaces here, or set rollout.agent_max_processes "
                             "to null to run agents without the limit")
    os.write(unshared, b"1")
    if os.read(mapped, 1) != b"1":
        raise OSError("cannot hold the agent to rollout.agent_max_processes: its user namespace could not be mapped")
    if root:
        os.setresuid(NPROC_UID, -1, -1)
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def _agent(payload: dict[str, Any], result: Connection, unshared: int, mapped: int) -> int:
    """Call the agent in this process, under its memory and process limits; send back its result and return the exit
    code."""
    limit = payload["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.stdout = sys.stderr  # line-buffered, flushed as the process exits, and in order with the rest
    try:
        if payload["max_processes"] is not None:
            _limit_processes(payload["max_processes"], unshared, mapped)
        os.close(unshared)
        os.close(mapped)
        fn = import_object(payload["entrypoint"])
        reward = fn(payload["task"], payload["base_url"], payload["api_key"])
        if inspect.isawaitable(reward):
            reward = asyncio.run(reward)
        # checked here, so only a number or a short repr crosses the pipe: the parent reads it only once this
        # process has exited, so a result larger than the pipe's buffer would block it until the time limit;
        # a NaN or infinite reward would poison its group's advantages
        message = {"reward": reward} if _is_reward(reward) else {"invalid": reprlib.repr(reward)}
    except BaseException as exc:  # noqa: BLE001 - whatever the agent raised is the sample's failure
        key = "process_limit" if payload["max_processes"] is not None and _at_process_limit() else "error"
        result.send_bytes(json.dumps({key: "".join(traceback.format_exception(exc))[-ERROR_TAIL:]}).encode())
        return 1
    result.send_bytes(json.dumps(message).encode())  # a float or int subclass as the number it is
    return 0


def _at_process_limit() -> bool:
    """Whether a fork fails here with EAGAIN, as it does at the process limit (in a user namespace of the agent's own,
    nothing else fails it so): asked once the agent has failed, while what it started still runs."""
    try:
        pid = os.fork()
    except BlockingIOError:
        return True
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return False
