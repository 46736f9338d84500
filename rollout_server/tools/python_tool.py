"""``python``: run a snippet in a sandboxed subprocess and return its output.

Layers, strongest first (each is checked by tests/test_tools.py):

- **No network**: the child runs in a new network namespace (``unshare --user --map-root-user
  --net``, or ``unshare --net`` as root) where not even loopback is up. Where neither works the
  audit hook below still refuses to create sockets.
- **Resources**: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_FSIZE`` (file size),
  set before the snippet runs and not raisable by it; a wall-clock timeout kills the process group.
- **Files and processes**: ``python -I -B`` (isolated: no env vars, no user site, cwd not on the path)
  with a ``sys.addaudithook`` installed before the snippet runs. It denies opening, listing or
  changing into anything outside the private temp dir (the Python installation's own library dirs
  stay readable, read-only, so imports work), creating sockets, starting processes, ``gc``
  introspection, and native symbol lookups and raw-address access through ``ctypes`` (ctypes still
  imports, numpy needs it; its raw-memory helpers are removed). An audit hook guards against a
  model's mistakes and casual escapes, not against hostile native code; the network namespace and
  the rlimits are the hard limits.

The subprocess runs through ``asyncio.create_subprocess_exec``; output (stdout and stderr merged)
is read incrementally and cut at ``max_output_bytes``, so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from typing import Any

from rollout_server.tools.base import Tool, ToolResult, function_schema

MEMORY_ERROR_EXIT = 97

# Runs in the child before the snippet: limits, then the audit hook, then the snippet in a fresh namespace.
_BOOTSTRAP = r"""
import os, resource, sys, traceback
_root, _readable = sys.argv[1], sys.argv[6:]
_mem, _cpu, _fsize, _memory_exit = (int(a) for a in sys.argv[2:6])
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
os.chdir(_root)
with open("main.py", encoding="utf-8") as _f:
    _source = _f.read()

import ctypes, _ctypes  # numpy needs ctypes; its raw-memory helpers are removed before the snippet runs
_raw = ("memmove", "memset", "string_at", "wstring_at", "cast")
for _mod in (ctypes, _ctypes):
    for _name in _raw + tuple(f"_{n}_addr" for n in _raw):
        _mod.__dict__.pop(_name, None)

def _install(root, readable):
    realpath, sep, fsdecode = os.path.realpath, os.sep, os.fsdecode
    writable_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied = frozenset((
        "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "pty.spawn", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.call_function",
        "resource.setrlimit", "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "os.symlink", "os.link", "os.chroot", "sys._current_frames",
    ))
    listing = frozenset(("os.listdir", "os.scandir"))
    changing = frozenset((
        "os.chdir", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
        "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move",
    ))

    def inside(path, roots):
        if isinstance(path, int):
            return True
        full = realpath(fsdecode(path))
        return any(full == r or full.startswith(r + sep) for r in roots)

    def hook(event, args):
        if event in denied:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            if path is None:
                return
            writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & writable_flags)
            if not inside(path, (root,) if writing else (root, *readable)):
                raise PermissionError(f"sandbox: cannot open {path!r} outside the working directory")
        elif event in listing:
            if not inside(args[0] if args and args[0] is not None else ".", (root, *readable)):
                raise PermissionError(f"sandbox: cannot list {args[0]!r} outside the working directory")
        elif event in changing:
            paths = args[:2] if event in ("os.rename", "shutil.copyfile", "shutil.move") else args[:1]
            if not all(inside(p, (root,)) for p in paths):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    sys.addaudithook(hook)

_install(os.path.realpath(_root), tuple(os.path.realpath(p) for p in _readable))
del _install
try:
    exec(compile(_source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except MemoryError:
    sys.stderr.write("MemoryError: the memory limit was exceeded\n")
    sys.stderr.flush()
    os._exit(_memory_exit)
except SystemExit:
    raise
except BaseException as _exc:
    traceback.print_exception(type(_exc), _exc, _exc.__traceback__.tb_next)
    sys.exit(1)
"""


def _library_dirs() -> list[str]:
    """Directories the snippet may read (imports): the stdlib and site-packages of this Python."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return sorted(d for d in dirs if os.path.isdir(d))


def detect_netns_prefix() -> list[str]:
    """The strongest ``unshare`` wrapper that works here, or ``[]`` (sockets are then refused by the hook)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    for prefix in ([unshare, "--user", "--map-root-user", "--net"], [unshare, "--net"]):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return prefix
    return []


class PythonTool(Tool):
    """Runs ``code`` and returns what it printed; limits come from the tool config's kwargs."""

    default_name = "python"
    default_schema = function_schema(
        "python",
        "Run a Python 3 snippet and return what it prints (stdout and stderr). No network, no files "
        "outside a private working directory.",
        {"code": {"type": "string", "description": "the Python source to run"}},
        ["code"],
    )

    def __init__(
        self,
        name: str | None = None,
        schema: dict[str, Any] | None = None,
        *,
        timeout_s: float = 5.0,
        cpu_s: int = 5,
        memory_mb: int = 512,
        max_file_mb: int = 16,
        max_output_bytes: int = 4096,
        network_isolation: bool = True,
    ) -> None:
        super().__init__(name, schema)
        if timeout_s <= 0 or cpu_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or max_file_mb <= 0:
            raise ValueError(f"{self.name}: every limit (timeout_s, cpu_s, memory_mb, ...) must be > 0")
        self.timeout_s = timeout_s
        self.cpu_s = cpu_s
        self.memory_bytes = memory_mb << 20
        self.max_file_bytes = max_file_mb << 20
        self.max_output_bytes = max_output_bytes
        self.netns_prefix = detect_netns_prefix() if network_isolation else []
        self._readable = _library_dirs()

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult.failure(f"{self.name}: code must be a string")
        with tempfile.TemporaryDirectory(prefix="rollwave-py-") as workdir:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            return await self._run(workdir)

    async def _run(self, workdir: str) -> ToolResult:
        argv = [
            *self.netns_prefix, sys.executable, "-I", "-B", "-c", _BOOTSTRAP, workdir,
            str(self.memory_bytes), str(self.cpu_s), str(self.max_file_bytes), str(MEMORY_ERROR_EXIT),
            *self._readable,
        ]  # fmt: skip
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
        output = bytearray()
        timed_out = False
        try:
            await asyncio.wait_for(self._read(proc, output), timeout=self.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                _kill_group(proc.pid)
            await proc.wait()
        return self._result(proc.returncode, bytes(output), timed_out)

    async def _read(self, proc: asyncio.subprocess.Process, output: bytearray) -> None:
        """Keep the first ``max_output_bytes`` (+1 to know it was cut), drain the rest, wait for exit."""
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            room = self.max_output_bytes + 1 - len(output)
            if room > 0:
                output += chunk[:room]
        await proc.wait()

    def _result(self, returncode: int, raw: bytes, timed_out: bool) -> ToolResult:
        text = raw[: self.max_output_bytes].decode("utf-8", errors="replace")
        if len(raw) > self.max_output_bytes:
            text += f"\n[output truncated at {self.max_output_bytes} bytes]"
        if timed_out:
            error = f"timed out after {self.timeout_s:g}s and was killed"
        elif returncode == MEMORY_ERROR_EXIT or returncode == -signal.SIGSEGV:
            error = f"memory limit of {self.memory_bytes >> 20} MiB exceeded"
        elif returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            error = f"CPU limit of {self.cpu_s}s exceeded and was killed"
        elif returncode != 0:
            error = f"exited with status {returncode}"
        else:
            return ToolResult(text)
        return ToolResult(f"{text}\nError: {error}" if text else f"Error: {error}", ok=False, error=error)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
