"""``python``: run a snippet in a bubblewrap sandbox and return its output.

The boundary is the kernel's, set up by bubblewrap (``bwrap``, Debian package ``bubblewrap``):

- **Namespaces**: pid, network, mount, ipc, uts and cgroup (where the kernel has it) are new. There is no
  network at all, not even loopback; the snippet sees only its own processes (a fresh ``/proc``).
- **Files**: a new root holding, read-only, only the interpreter (``sys.base_prefix``, ``sys.prefix``) and
  the shared libraries (``/usr/lib``, ``/usr/lib64``, ``/lib``, ``/lib64``); no ``/etc``, home, model or run
  directory. The working directory (``/sandbox``) and ``/tmp`` are private tmpfs of ``max_file_mb`` each,
  gone when the snippet ends; ``/dev`` is minimal.
- **User**: a separate uid (``sandbox_uid``, 65534). Run as root, bwrap leaves the user namespace alone and
  the snippet switches to that uid before anything else (root is exempt from ``RLIMIT_NPROC``, so it must
  not stay root); run as any other user, a new user namespace maps it to that uid, and no further user
  namespaces can be made inside. The environment is empty but for PATH, HOME, LANG and thread counts.
- **Processes**: ``--die-with-parent`` and ``--new-session``; rlimits NPROC, AS (memory), CPU, FSIZE,
  NOFILE and CORE are set before the snippet runs and cannot be raised by it. A wall-clock timeout or
  output beyond ``max_output_bytes`` kills the sandbox (its pid namespace, so every process in it).

The snippet arrives on stdin, never in a file or argv. When the sandbox cannot be set up (no bwrap, no
namespaces allowed here), every call is refused with an error saying why (``ToolResult.refused``, counted
as ``outcome="refused"`` in ``rollwave_rollout_tool_calls_total``): code never runs outside the sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import PurePosixPath
from typing import Any

from rollout_server.tools.base import Tool, ToolResult, function_schema

log = logging.getLogger(__name__)
MEMORY_ERROR_EXIT = 97
WORKDIR = "/sandbox"
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")
PROBE_TIMEOUT_S = 30.0
KILL_WAIT_S = 10.0

# Runs in the sandbox before the snippet: drop root, set the limits, then run what stdin holds.
_BOOTSTRAP = r"""
import os, resource, sys, traceback
_uid, _mem, _cpu, _fsize, _nproc, _nofile, _memory_exit = (int(a) for a in sys.argv[1:8])
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(_uid)
    os.setuid(_uid)
for _limit, _value in ((resource.RLIMIT_AS, _mem), (resource.RLIMIT_FSIZE, _fsize), (resource.RLIMIT_NPROC, _nproc),
                       (resource.RLIMIT_NOFILE, _nofile), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(_limit, (_value, _value))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
_source = sys.stdin.read()
sys.stdin.close()
del _limit, _value
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


def _read_only_binds() -> list[str]:
    """What the sandbox's root holds, read-only: the interpreter and the shared libraries it loads."""
    paths = {os.path.abspath(sys.base_prefix), os.path.abspath(sys.prefix)}
    paths.update(d for d in LIBRARY_DIRS if os.path.isdir(d) and not os.path.islink(d))
    ordered = sorted(paths)
    return [p for p in ordered if not any(p.startswith(q + "/") for q in ordered)]


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
        max_processes: int = 16,
        max_open_files: int = 64,
        sandbox_uid: int = 65534,
    ) -> None:
        super().__init__(name, schema)
        limits = (timeout_s, cpu_s, memory_mb, max_file_mb, max_output_bytes, max_processes, max_open_files)
        if min(limits) <= 0:
            raise ValueError(f"{self.name}: every limit (timeout_s, cpu_s, memory_mb, ...) must be > 0")
        if sandbox_uid <= 0:
            raise ValueError(f"{self.name}: sandbox_uid must be an unprivileged uid, got {sandbox_uid}")
        self.timeout_s = timeout_s
        self.cpu_s = cpu_s
        self.memory_bytes = memory_mb << 20
        self.max_file_bytes = max_file_mb << 20
        self.max_output_bytes = max_output_bytes
        self.max_processes = max_processes
        self.max_open_files = max_open_files
        self.sandbox_uid = sandbox_uid
        self.unavailable = self._probe()
        if self.unavailable is not None:
            log.warning("%s: refusing every call: %s", self.name, self.unavailable)

    def command(self) -> list[str]:
        """The bwrap command line that runs the bootstrap (the snippet comes on its stdin)."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise FileNotFoundError("bwrap not found: install the Debian package bubblewrap")
        argv = [
            bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox",
        ]  # fmt: skip
        if os.geteuid() == 0:  # no user namespace: the bootstrap drops to sandbox_uid (needs these two only)
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-user", "--disable-userns", "--uid", str(self.sandbox_uid), "--gid",
                     str(self.sandbox_uid)]
        argv += ["--clearenv"]
        for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", WORKDIR), ("LANG", "C.UTF-8"),
                           ("OMP_NUM_THREADS", "1"), ("OPENBLAS_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1")):
            argv += ["--setenv", key, value]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for path, mode in (("/tmp", "1777"), (WORKDIR, "0777")):
            argv += ["--size", str(self.max_file_bytes), "--perms", mode, "--tmpfs", path]
        binds = _read_only_binds()
        for directory in sorted({str(p) for b in binds for p in PurePosixPath(b).parents if str(p) != "/"}):
            argv += ["--perms", "0755", "--dir", directory]  # traversable by the sandbox uid
        for path in binds:
            argv += ["--ro-bind", path, path]
        for link in LIBRARY_DIRS:
            if os.path.islink(link):
                argv += ["--symlink", os.readlink(link), link]
        limits = (self.sandbox_uid, self.memory_bytes, self.cpu_s, self.max_file_bytes, self.max_processes,
                  self.max_open_files, MEMORY_ERROR_EXIT)
        return [*argv, "--remount-ro", "/", "--chdir", WORKDIR, "--", sys.executable, "-I", "-B", "-c", _BOOTSTRAP,
                *map(str, limits)]

    def _probe(self) -> str | None:
        """Why the sandbox cannot run here (None when a trivial snippet runs in it as the sandbox uid)."""
        try:
            done = subprocess.run(self.command(), input=b"import os; print(os.getuid())", capture_output=True,
                                  env={}, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"sandbox unavailable: {exc}"
        if done.returncode != 0 or done.stdout.strip() != str(self.sandbox_uid).encode():
            last = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return f"sandbox unavailable: {last}"
        return None

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult.failure(f"{self.name}: code must be a string")
        if self.unavailable is not None:
            log.warning("%s: refused a call: %s", self.name, self.unavailable)
            return ToolResult(f"Error: {self.unavailable}", ok=False, error=self.unavailable, refused=True)
        return await self._run(code.encode("utf-8", errors="surrogatepass"))

    async def _run(self, code: bytes) -> ToolResult:
        proc = await asyncio.create_subprocess_exec(
            *self.command(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={},
            start_new_session=True,
        )
        output = bytearray()
        stopped = None
        try:
            await asyncio.wait_for(self._talk(proc, code, output), timeout=self.timeout_s)
            if len(output) > self.max_output_bytes:
                stopped = f"printed more than {self.max_output_bytes} bytes and was killed"
        except TimeoutError:
            stopped = f"timed out after {self.timeout_s:g}s and was killed"
        finally:
            if proc.returncode is None:
                _kill_group(proc.pid)  # bwrap goes, and with it (--die-with-parent) the sandbox's pid namespace
            await self._drain(proc)
        return self._result(proc.returncode, bytes(output), stopped)

    async def _drain(self, proc: asyncio.subprocess.Process) -> None:
        """Read to EOF, which comes once no process of the sandbox holds its output; then reap bwrap."""
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(KILL_WAIT_S):
                while await proc.stdout.read(65536):
                    pass
                await proc.wait()
        except TimeoutError:
            raise RuntimeError(f"{self.name}: sandbox {proc.pid} still writes {KILL_WAIT_S:g}s after SIGKILL") from None

    async def _talk(self, proc: asyncio.subprocess.Process, code: bytes, output: bytearray) -> None:
        """Hand over the snippet, then keep the first ``max_output_bytes`` (+1 to know there was more)."""
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(code)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it ended before reading everything; its output says why
        while chunk := await proc.stdout.read(65536):
            output += chunk[: self.max_output_bytes + 1 - len(output)]
            if len(output) > self.max_output_bytes:
                return
        await proc.wait()

    def _result(self, returncode: int, raw: bytes, stopped: str | None) -> ToolResult:
        text = raw[: self.max_output_bytes].decode("utf-8", errors="replace")
        if len(raw) > self.max_output_bytes:
            text += f"\n[output truncated at {self.max_output_bytes} bytes]"
        if stopped is not None:
            error = stopped
        elif returncode in (MEMORY_ERROR_EXIT, 128 + signal.SIGSEGV):  # bwrap exits 128 + the signal that ended it
            error = f"memory limit of {self.memory_bytes >> 20} MiB exceeded"
        elif returncode in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
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
