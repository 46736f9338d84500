"""``python``: run a snippet in a bubblewrap sandbox and return its output.

The boundary is the kernel's, set up by bubblewrap (``bwrap``, Debian package ``bubblewrap``):

- **Namespaces**: pid, network, mount, ipc, uts and cgroup (where the kernel has it) are new. There is no
  network at all, not even loopback; the snippet sees only its own processes (a fresh ``/proc``).
- **Files**: a new root holding, read-only, only the interpreter (``sys.base_prefix``, ``sys.prefix``) and
  the shared libraries (``/usr/lib``, ``/usr/lib64``, ``/lib``, ``/lib64``); no ``/etc``, home, model or run
  directory. The working directory (``/sandbox``), ``/tmp`` and ``/dev/shm`` are private tmpfs of
  ``max_file_mb`` and ``max_files`` files (inodes: directories, links and empty files too, which no byte limit
  counts) each, gone when the snippet ends; the rest of ``/dev`` is minimal and read-only. bwrap can bound a tmpfs's
  bytes only (``--size``): the bootstrap mounts these three itself, with ``nr_inodes``, in a mount namespace of its
  own (the sandbox's user namespace owns it, so ``CAP_SYS_ADMIN`` there is enough), binds again inside them what
  bwrap bound there (an interpreter under ``/tmp``, still read-only), and drops that capability before the snippet
  exists. A snippet that fails with one of them full of files is reported as past
  ``max_files``.
- **User**: a separate uid (``sandbox_uid``, 65534) in a user namespace in which no further user namespace
  can be made. Run as any other user, bwrap makes it (``--disable-userns``) and maps the uid to that user.
  Run as root, ``_USER_NAMESPACE`` makes it before bwrap, mapping root and the uid each to itself (bwrap's own
  would map the uid to root); bwrap runs in it as its root and the snippet switches to the uid before anything
  else. The environment is empty but for PATH, HOME, LANG and thread counts.
- **Keys**: the kernel's keyrings are not namespaced, and a process possesses (may read) every key of the session
  keyring it inherits: the bootstrap joins a new, empty session keyring before the snippet runs, so no key of the
  rollout server's session (a login's, a service manager's) reaches it. Where the number of the ``keyctl`` system
  call is not known (``KEYCTL_SYSCALLS``), the sandbox counts as unavailable.
- **Memory outside the rlimits**: System V shared memory, message queues and semaphore sets (detached, they count
  in no process's address space and, in the sandbox's new ipc namespace, the kernel's defaults bound them by nothing:
  one snippet held 3 GiB of shared memory past a ``memory_mb`` of 256 in 4 s) and memfds (outside every tmpfs) cannot
  be made: before the snippet exists the bootstrap installs a seccomp filter, which no process of the sandbox can
  remove, under which ``shmget``, ``semget``, ``msgget`` and ``memfd_create`` fail with ENOSYS, as on a kernel without
  them (and every system call of another ABI than the machine's, which could reach them by other numbers). Where
  their numbers are not known (``DENIED_SYSCALLS``), or the filter cannot be installed, the sandbox counts as
  unavailable.
- **Processes**: the bootstrap is the sandbox's pid 1 (``--as-pid-1``: no init of bwrap's, which no rlimit
  would cover) and sets rlimits NPROC, AS (memory), CPU, FSIZE, NOFILE and CORE, which no process of the
  sandbox can raise, before it forks the snippet; it is not dumpable, so the snippet cannot ptrace it even as
  the same uid. When the snippet ends, pid 1 ends and the kernel kills whatever is left in the pid namespace;
  a wall-clock timeout or output beyond ``max_output_bytes`` kills bwrap, and pid 1 with it (its
  ``--die-with-parent`` signal, which the snippet cannot clear), so every process of the sandbox (logged, naming the
  limit, and counted as ``outcome="sandbox_timeout"`` or ``outcome="output_limit"``).
- **Status**: pid 1 reports how the snippet ended through a pipe the snippet does not inherit (it is closed in the
  snippet before it runs, and pid 1's descriptors are out of its reach), so a status of the snippet's own reads as
  what it is: its exit status, or the signal that killed it. A limit is named only where pid 1 saw it hit: killed by
  SIGXCPU or SIGKILL with its CPU time (its ``CPUCLOCK_PROF``, what ``RLIMIT_CPU`` counts, read while it is a zombie)
  at ``cpu_s``; failed after one of its processes ended on a MemoryError (the bootstrap's handler says so through a
  pipe of its own, which claims no more than a ``raise MemoryError`` could); failed with a tmpfs full of files.

The snippet arrives on stdin, never in a file or argv. When the sandbox cannot be set up (no bwrap, no
namespaces allowed here), every call is refused with an error saying why (counted as ``outcome="refused"`` in
``rollwave_rollout_tool_calls_total``): code never runs outside the sandbox. At most ``max_concurrent`` sandboxes
of a tool run at once, and at most ``max_per_episode`` (default: half of ``max_concurrent``) of one episode (a tool
instance); a call past either waits up to ``max_wait_s`` in all (first for one of its episode's own sandboxes, then
for one of the tool's) and is then refused (logged, naming the limit, and counted as ``outcome="busy"``), so a burst of
calls cannot start hundreds of them, and one episode making many parallel calls cannot hold every sandbox for
``max_wait_s`` while the others' calls are refused. Waiting, not refusing at once, is what verl's sandbox tools do
past their concurrency limit: a model's parallel calls all run, a few at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import PurePosixPath
from typing import Any

from rollout_server.tools.base import Tool, ToolResult, function_schema

log = logging.getLogger(__name__)
WORKDIR = "/sandbox"
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64")
PROBE_TIMEOUT_S = 30.0
KILL_WAIT_S = 10.0
KEYCTL_SYSCALLS = {"x86_64": 250, "aarch64": 219, "riscv64": 219}  # the system call's number, by machine
# by machine: the ABI seccomp names (AUDIT_ARCH_*), and the numbers of shmget, semget, msgget and memfd_create
DENIED_SYSCALLS = {"x86_64": (0xC000003E, (29, 64, 68, 319)), "aarch64": (0xC00000B7, (194, 190, 186, 279)),
                   "riscv64": (0xC00000F3, (194, 190, 186, 279))}

# Runs in the sandbox as its pid 1 (the docstring's Processes): limits, not dumpable, a session keyring of its own
# (the docstring's Keys; ENOSYS or EPERM: the kernel has no keys, or a seccomp filter the snippet inherits forbids
# them), the private tmpfs (the docstring's Files; then CAP_SYS_ADMIN goes) and a seccomp filter (the docstring's
# Memory) before the snippet can run, it forks the snippet and reaps until the snippet ends, then reports (the
# docstring's Status) and ends with the snippet's status (128 + a signal that killed it, as bwrap reports one).
_BOOTSTRAP = r"""
import ctypes, errno, os, resource, select, signal, struct, sys, time, traceback
_uid, _mem, _cpu, _fsize, _nproc, _nofile, _report, _keyctl, _files, _arch = map(int, sys.argv[1:11])
_denied = [int(_nr) for _nr in sys.argv[11].split(",")]
_tmpfs = (("/tmp", "1777"), ("/dev/shm", "1777"), (os.getcwd(), "0777"))  # bwrap put it in the working directory
for _limit, _value in ((resource.RLIMIT_AS, _mem), (resource.RLIMIT_FSIZE, _fsize), (resource.RLIMIT_NPROC, _nproc + 1),
                       (resource.RLIMIT_NOFILE, _nofile), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(_limit, (_value, _value))  # NPROC + 1: room for pid 1's fork, where it counts
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
_source = sys.stdin.read()
sys.stdin.close()
del _limit, _value
_libc = ctypes.CDLL(None, use_errno=True)
if _libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0
    sys.exit(f"prctl(PR_SET_DUMPABLE): {os.strerror(ctypes.get_errno())}")
if _libc.syscall(_keyctl, 1, None) < 0 and ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):  # JOIN_SESSION
    sys.exit(f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(ctypes.get_errno())}")
_mounted = [_line.split()[4].replace("\\040", " ") for _line in open("/proc/self/mountinfo")]
if _libc.unshare(0x20000) != 0:  # CLONE_NEWNS
    sys.exit(f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
for _path, _mode in _tmpfs:
    _under = sorted(_m for _m in _mounted if _m.startswith(_path + "/"))  # bwrap's binds in it (a venv under /tmp)
    _under = [_m for _m in _under if not any(_m.startswith(_o + "/") for _o in _under)]
    _old = os.open(_path, os.O_PATH)  # they stay reachable through it once the tmpfs covers them
    _options = f"mode={_mode},size={_fsize},nr_inodes={_files}".encode()
    if _libc.mount(b"tmpfs", _path.encode(), b"tmpfs", 6, _options) != 0:  # MS_NOSUID | MS_NODEV
        sys.exit(f"mount tmpfs on {_path}: {os.strerror(ctypes.get_errno())}")
    for _m in _under:  # bound again in the new tmpfs, read-only as bwrap locked them
        os.makedirs(_m, 0o755)
        _bound = f"/proc/self/fd/{_old}/{os.path.relpath(_m, _path)}".encode()
        if _libc.mount(_bound, _m.encode(), None, 0x5000, None) != 0:  # MS_BIND | MS_REC
            sys.exit(f"bind {_m} again over the tmpfs: {os.strerror(ctypes.get_errno())}")
    os.close(_old)
os.chdir(os.getcwd())  # the new tmpfs, not the directory under it that bwrap entered
# seccomp (the docstring's Memory): another ABI (x32's numbers too) and the denied numbers get ENOSYS, the rest runs
_program = [(0x20, 0, 0, 4), (0x15, 0, len(_denied) + 3, _arch), (0x20, 0, 0, 0), (0x35, len(_denied) + 1, 0, 1 << 30)]
_program += [(0x15, len(_denied) - _i, 0, _nr) for _i, _nr in enumerate(_denied)]  # (code, jump if, jump else, k)
_program += [(0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x50000 | errno.ENOSYS)]  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
_filter = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *_op) for _op in _program))
if (_libc.prctl(38, 1, 0, 0, 0) != 0  # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP SECCOMP_MODE_FILTER
        or _libc.prctl(22, 2, struct.pack("HP", len(_program), ctypes.addressof(_filter)), 0, 0) != 0):
    sys.exit(f"seccomp filter: {os.strerror(ctypes.get_errno())}")
_header, _caps = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # capability sets, version 3
if _libc.capget(_header, _caps) != 0:
    sys.exit(f"capget: {os.strerror(ctypes.get_errno())}")
for _set in range(3):  # effective, permitted, inheritable (ambient follows): CAP_SYS_ADMIN (21) goes
    _caps[_set] &= ~(1 << 21)
if _libc.capset(_header, _caps) != 0:
    sys.exit(f"capset: {os.strerror(ctypes.get_errno())}")
_said, _say = os.pipe()  # the snippet's processes say through it that they ended on a MemoryError (below)
_snippet = os.fork()
if _snippet:  # pid 1: reaps until the snippet ends, then reports how (the docstring's Status) through _report
    os.close(_say)
    while (_pid := os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT).si_pid) != _snippet:
        os.waitpid(_pid, 0)  # an orphan of the snippet's
    _used = time.clock_gettime(~_snippet << 3)  # while it is a zombie, its CPUCLOCK_PROF: what RLIMIT_CPU counts
    _code = os.waitstatus_to_exitcode(os.waitpid(_snippet, 0)[1])
    _limit = ""
    if -_code in (signal.SIGXCPU, signal.SIGKILL) and _used >= _cpu:  # SIGXCPU at _cpu, SIGKILL a second later
        _limit = "cpu"
    elif _code != 0 and select.select([_said], [], [], 0)[0] and os.read(_said, 1):
        _limit = "memory"
    elif _code != 0 and any(os.statvfs(_path).f_ffree == 0 for _path, _ in _tmpfs):
        _limit = "files"
    os.write(_report, f"{_code} {_limit}".encode())
    os._exit(_code if _code >= 0 else 128 - _code)
os.close(_report)
os.close(_said)
if os.getuid() == 0:
    os.setgroups([])
    os.setgid(_uid)
    os.setuid(_uid)
resource.setrlimit(resource.RLIMIT_NPROC, (_nproc, _nproc))
try:
    exec(compile(_source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except MemoryError:
    sys.stderr.write("MemoryError: the memory limit was exceeded\n")
    sys.stderr.flush()
    os.write(_say, b"m")
    os._exit(1)
except SystemExit:
    raise
except BaseException as _exc:
    traceback.print_exception(type(_exc), _exc, _exc.__traceback__.tb_next)
    sys.exit(1)
"""

# Run as root, this execs bwrap in a user namespace it makes (the docstring's User): bwrap's --disable-userns needs
# --unshare-user, which as root maps the sandbox uid to root. user.max_user_namespaces 0 there forbids any further
# one; only CAP_SYS_RESOURCE in it could raise that, and bwrap drops it.
_USER_NAMESPACE = r"""
import ctypes, os, sys
_uid, _parent = sys.argv[1], os.getpid()
_read, _write = os.pipe()
if os.fork() == 0:  # a process outside the new namespace, with CAP_SETUID there, writes its maps
    os.close(_write)
    if os.read(_read, 1):
        for _name in ("uid_map", "gid_map"):
            with open(f"/proc/{_parent}/{_name}", "w") as _file:
                _file.write(f"0 0 1\n{_uid} {_uid} 1\n")
    os._exit(0)
os.close(_read)
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER
    sys.exit(f"unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}")
os.write(_write, b"1")
if os.wait()[1] != 0:
    sys.exit("could not map the sandbox's user namespace")
with open("/proc/sys/user/max_user_namespaces", "w") as _file:
    _file.write("0")
os.execv(sys.argv[2], sys.argv[2:])
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
        max_files: int = 4096,
        max_concurrent: int = 16,
        max_wait_s: float = 30.0,
        max_per_episode: int | None = None,
        sandbox_uid: int = 65534,
    ) -> None:
        super().__init__(name, schema)
        if max_per_episode is None:
            max_per_episode = max(1, max_concurrent // 2)
        limits = (timeout_s, cpu_s, memory_mb, max_file_mb, max_output_bytes, max_processes, max_open_files,
                  max_files, max_concurrent, max_wait_s, max_per_episode)
        if min(limits) <= 0:
            raise ValueError(f"{self.name}: every limit (timeout_s, cpu_s, memory_mb, ...) must be > 0")
        if max_per_episode > max_concurrent:
            raise ValueError(f"{self.name}: max_per_episode ({max_per_episode}) must be at most max_concurrent "
                             f"({max_concurrent})")
        if sandbox_uid <= 0:
            raise ValueError(f"{self.name}: sandbox_uid must be an unprivileged uid, got {sandbox_uid}")
        self.timeout_s = timeout_s
        self.cpu_s = cpu_s
        self.memory_bytes = memory_mb << 20
        self.max_file_bytes = max_file_mb << 20
        self.max_output_bytes = max_output_bytes
        self.max_processes = max_processes
        self.max_open_files = max_open_files
        self.max_files = max_files
        self.max_concurrent = max_concurrent
        self.max_wait_s = max_wait_s
        self._sandboxes = asyncio.Semaphore(max_concurrent)
        self.max_per_episode = max_per_episode
        self._episodes: dict[str, _Episode] = {}  # the episodes with a call running or waiting
        self.sandbox_uid = sandbox_uid
        self.unavailable = self._probe()
        if self.unavailable is not None:
            log.warning("%s: refusing every call: %s", self.name, self.unavailable)

    def command(self, report: int) -> list[str]:
        """The command line (bwrap; as root, through _USER_NAMESPACE) that runs the bootstrap; the snippet is stdin, and
        the bootstrap reports how it ended to the file descriptor ``report`` (the docstring's Status)."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise FileNotFoundError("bwrap not found: install the Debian package bubblewrap")
        keyctl, denied = KEYCTL_SYSCALLS.get(platform.machine()), DENIED_SYSCALLS.get(platform.machine())
        if denied is None:
            raise OSError(f"the system calls the sandbox denies have no known numbers on {platform.machine()} "
                          "(DENIED_SYSCALLS): the snippet could hold memory past every limit")
        if keyctl is None:
            raise OSError(f"the keyctl system call's number on {platform.machine()} is not known (KEYCTL_SYSCALLS): "
                          "the snippet would keep the rollout server's session keyring")
        argv = [
            bwrap, "--unshare-pid", "--as-pid-1", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox",
        ]  # fmt: skip
        user_namespace: list[str] = []
        if os.geteuid() == 0:  # bwrap runs as root in _USER_NAMESPACE's namespace; the snippet drops to sandbox_uid
            user_namespace = [sys.executable, "-I", "-B", "-c", _USER_NAMESPACE, str(self.sandbox_uid)]
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-user", "--disable-userns", "--uid", str(self.sandbox_uid), "--gid",
                     str(self.sandbox_uid)]
        argv += ["--cap-add", "CAP_SYS_ADMIN", "--clearenv"]  # the bootstrap's, to mount the tmpfs; it drops it
        for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", WORKDIR), ("LANG", "C.UTF-8"),
                           ("OMP_NUM_THREADS", "1"), ("OPENBLAS_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1")):
            argv += ["--setenv", key, value]
        argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--dir", "/tmp", "--dir", WORKDIR]
        binds = _read_only_binds()
        for directory in sorted({str(p) for b in binds for p in PurePosixPath(b).parents if str(p) != "/"}):
            argv += ["--perms", "0755", "--dir", directory]  # traversable by the sandbox uid
        for path in binds:
            argv += ["--ro-bind", path, path]
        for link in LIBRARY_DIRS:
            if os.path.islink(link):
                argv += ["--symlink", os.readlink(link), link]
        limits = (self.sandbox_uid, self.memory_bytes, self.cpu_s, self.max_file_bytes, self.max_processes,
                  self.max_open_files, report, keyctl, self.max_files, denied[0])
        return [*user_namespace, *argv, "--remount-ro", "/", "--chdir", WORKDIR, "--", sys.executable, "-I", "-B",
                "-c", _BOOTSTRAP, *map(str, limits), ",".join(map(str, denied[1]))]

    def _probe(self) -> str | None:
        """Why the sandbox cannot run here (None when a trivial snippet runs in it as the sandbox uid, and its pid 1
        reports that it exited 0)."""
        status, report = _status_pipe()
        with status:
            try:
                done = subprocess.run(self.command(report), input=b"import os; print(os.getuid())",
                                      capture_output=True, env={}, timeout=PROBE_TIMEOUT_S, pass_fds=(report,))
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"sandbox unavailable: {exc}"
            finally:
                os.close(report)
            reported = status.read()
        if done.returncode != 0 or done.stdout.strip() != str(self.sandbox_uid).encode():
            last = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return f"sandbox unavailable: {last}"
        if reported != b"0 ":
            return f"sandbox unavailable: its pid 1 reported {reported!r} for a snippet that exited 0, not b'0 '"
        return None

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult.failure(f"{self.name}: code must be a string")
        if self.unavailable is not None:
            log.warning("%s: refused a call: %s", self.name, self.unavailable)
            return ToolResult(f"Error: {self.unavailable}", ok=False, error=self.unavailable, outcome="refused")
        episode = self._episodes.setdefault(instance_id, _Episode(self.max_per_episode))
        episode.calls += 1
        try:
            return await self._within_limits(instance_id, episode, code.encode("utf-8", errors="surrogatepass"))
        finally:
            episode.calls -= 1
            if not episode.calls:
                del self._episodes[instance_id]

    async def _within_limits(self, instance_id: str, episode: _Episode, code: bytes) -> ToolResult:
        """Run ``code`` once the episode holds fewer than ``max_per_episode`` sandboxes and the tool fewer than
        ``max_concurrent``; refuse it (``busy``, naming the limit it waited on) past ``max_wait_s``. The episode's own
        limit is waited on first, so a call over it holds none of the tool's sandboxes while it waits."""
        tool_limit = f"max_concurrent ({self.max_concurrent})"  # as binding as the episode's, where they are equal
        limit = tool_limit if self.max_per_episode == self.max_concurrent else \
            f"this episode's max_per_episode ({self.max_per_episode})"
        async with contextlib.AsyncExitStack() as held:
            try:
                async with asyncio.timeout(self.max_wait_s):
                    await held.enter_async_context(episode.sandboxes)
                    limit = tool_limit
                    await held.enter_async_context(self._sandboxes)
            except TimeoutError:
                busy = (f"busy: {limit} sandboxes ran for all of the {self.max_wait_s:g}s this call waited "
                        "(max_wait_s); try again later")
                log.warning("%s: refused a call of %s: %s", self.name, instance_id, busy)
                return ToolResult(f"Error: {busy}", ok=False, error=busy, outcome="busy")
            return await self._run(instance_id, code)

    async def _run(self, instance_id: str, code: bytes) -> ToolResult:
        status, report = _status_pipe()
        with status:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.command(report),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    env={},
                    start_new_session=True,
                    pass_fds=(report,),
                )
            finally:
                os.close(report)
            output = bytearray()
            stopped = None  # what the model is told, the outcome it is counted as, and the limit that stopped it
            try:
                await asyncio.wait_for(self._talk(proc, code, output), timeout=self.timeout_s)
                if len(output) > self.max_output_bytes:
                    stopped = (f"printed more than {self.max_output_bytes} bytes and was killed", "output_limit",
                               "max_output_bytes")
            except TimeoutError:
                stopped = (f"timed out after {self.timeout_s:g}s and was killed", "sandbox_timeout", "timeout_s")
            finally:
                if proc.returncode is None:
                    _kill_group(proc.pid)  # bwrap goes, and with it (--die-with-parent) the sandbox's pid namespace
                await self._drain(proc)
            reported = status.read()
        if stopped is not None:
            log.warning("%s: stopped a call of %s at its %s: %s", self.name, instance_id, stopped[2], stopped[0])
        return self._result(proc.returncode, (reported or b"").decode(), bytes(output), stopped)

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

    def _result(self, returncode: int, reported: str, raw: bytes, stopped: tuple[str, str, str] | None) -> ToolResult:
        """What the model is told: why the tool stopped the snippet, or how it ended and the limit it hit, as pid 1
        reported them (``"<status> <limit>"``, the docstring's Status); bwrap's status where pid 1 reported nothing."""
        text = raw[: self.max_output_bytes].decode("utf-8", errors="replace")
        if len(raw) > self.max_output_bytes:
            text += f"\n[output truncated at {self.max_output_bytes} bytes]"
        code, _, limit = reported.partition(" ")
        status, outcome = int(code or 0), None
        if stopped is not None:
            error, outcome, _ = stopped
        elif not code:  # pid 1 ended before the snippet did: the sandbox failed, its output says how
            error = f"the sandbox exited with status {returncode} before the snippet ended"
        elif limit == "memory":
            error = f"memory limit of {self.memory_bytes >> 20} MiB exceeded"
        elif limit == "files":
            error = f"file limit of {self.max_files} files (max_files) exceeded"
        elif limit == "cpu":
            error = f"CPU limit of {self.cpu_s}s exceeded and was killed"
        elif status < 0:
            error = f"killed by signal {-status} ({signal.strsignal(-status)})"
        elif status > 0:
            error = f"exited with status {status}"
        else:
            return ToolResult(text)
        return ToolResult(f"{text}\nError: {error}" if text else f"Error: {error}", ok=False, error=error,
                          outcome=outcome)


class _Episode:
    """One episode's share of the sandboxes: ``max_per_episode`` at once, and how many of its calls run or wait
    (when none do, the tool forgets it: an id ``execute`` was called with but never released takes no memory)."""

    def __init__(self, max_per_episode: int) -> None:
        self.sandboxes = asyncio.Semaphore(max_per_episode)
        self.calls = 0


def _status_pipe() -> tuple[io.FileIO, int]:
    """A pipe for the sandbox's pid 1 to report through (the docstring's Status): its read end, which reads what pid 1
    wrote (None while nothing is there: it does not block), and the write end's descriptor, for bwrap to inherit."""
    said, report = os.pipe()
    os.set_blocking(said, False)
    return open(said, "rb", buffering=0), report


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
