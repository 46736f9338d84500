"""Tools: exact calculator, GSM8K answer tool, YAML registry, and the python sandbox.

The sandbox tests are escape attempts run in the real bubblewrap sandbox, each of which must be contained:
reading /etc/passwd, the model dir or a host file, writing outside the working directory, reaching a real
Redis on 127.0.0.1, a fork bomb, a 4 GB allocation, an endless loop, 100 MB of output, reading the
environment and /proc of its parent, killing its parent, a session-leading child started through
``_posixsubprocess.fork_exec`` that should outlive the timeout, ptracing the sandbox's pid 1 to run past the limits
and the kill, filling /dev/shm, files made in a loop, a nested user namespace, reading a key of the rollout
server's session keyring, and System V shared memory or memfds that hold memory past the limits; and the snippet's own
exit status or signal, which must never read as a limit. Where the tool's path as root and as another user differ,
both run (``_py_as``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from core.tasks.arith import CALCULATOR_SCHEMA
from rollout_server.tools import Tool, ToolConfigError, ToolRegistry, ToolResult
from rollout_server.tools.calculator import CalculatorError, CalculatorTool, evaluate, format_number
from rollout_server.tools.check_answer import CheckAnswerTool
from rollout_server.tools.python_tool import PythonTool
from rollout_server.tools.registry import tool_requirements


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("(12+3)*4", "60"),
        ("258*33-629", "7885"),
        ("0.1 + 0.2", "0.3"),
        ("7/2", "3.5"),
        ("7/3", "7/3"),
        ("-2**3 + 17 // 5 + 17 % 5", "-3"),
        ("2**-2", "0.25"),
        ("3 × 4 ÷ 6", "2"),
        ("1e3", "1000"),
    ],
)
def test_calculator_is_exact(expression: str, expected: str) -> None:
    assert format_number(evaluate(expression)) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("2 ^ 3", r"use \*\* for powers"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2**10000", "beyond"),
        ("(10**900)**4", "too large"),
        ("2**0.5", "integer exponents"),
        ("1 +", "cannot parse"),
        ("", "non-empty"),
        ("1" * 600, "longer than"),
    ],
)
def test_calculator_refuses(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)


def test_calculator_tool_results_and_schema() -> None:
    tool = CalculatorTool()
    assert tool.schema == CALCULATOR_SCHEMA  # the prompts and SFT demonstrations use this schema
    assert run(tool.execute("i", {"expression": "6*7"})) == ToolResult("42")
    bad = run(tool.execute("i", {"expression": "6*"}))
    assert not bad.ok and bad.text.startswith("Error: cannot parse")
    missing = run(tool.execute("i", {}))
    assert not missing.ok and "non-empty string" in missing.error
    assert tool.check_arguments({}) == "calculator: missing required argument(s) expression"


def test_check_answer_scores_against_ground_truth() -> None:
    async def episode() -> list[ToolResult]:
        tool = CheckAnswerTool()
        await tool.create("a", ground_truth="1,600")
        out = [await tool.execute("a", {"answer": a}) for a in ("1599", "1600", "#### 1,600", 1600)]
        await tool.release("a")
        out.append(await tool.execute("a", {"answer": "1600"}))
        return out

    wrong, right, hashes, number, released = run(episode())
    assert (wrong.reward, right.reward, hashes.reward, number.reward) == (0.0, 1.0, 1.0, 1.0)
    assert wrong.text == "Answer 1599 is incorrect." and right.text == "Answer 1600 is correct."
    assert not released.ok and "create was not called" in released.error
    with pytest.raises(ValueError, match="ground_truth"):
        run(CheckAnswerTool().create("b"))
    assert (
        CheckAnswerTool().check_arguments({"answer": "1", "why": "x"})
        == "check_answer: unknown argument(s) why"
    )


class EchoTool(Tool):
    """A custom tool, loaded by import path from YAML."""

    default_name = "echo"
    default_schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}

    def __init__(self, name: str | None = None, schema: dict | None = None, prefix: str = "") -> None:
        super().__init__(name, schema)
        self.prefix = prefix

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(self.prefix + str(arguments.get("text", "")), reward=0.5)


def test_registry_builtin_and_yaml(tmp_path: Path) -> None:
    assert sorted(ToolRegistry.from_file(None).tools) == ["calculator", "check_answer", "python"]
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(
        f"tools:\n"
        f"  - name: shout\n"
        f"    class: {__name__}:EchoTool\n"
        f"    kwargs: {{prefix: '>> '}}\n"
        f"  - name: calculator\n"
        f"  - name: py\n"
        f"    class: rollout_server.tools.python_tool.PythonTool\n"
        f"    kwargs: {{timeout_s: 2}}\n"
    )
    reg = ToolRegistry.from_file(cfg)
    assert sorted(reg.tools) == ["calculator", "py", "shout"]
    assert reg.schemas(["shout"])[0]["function"]["name"] == "shout"
    assert reg.get("py").timeout_s == 2
    assert run(reg.get("shout").execute("i", {"text": "hi"})) == ToolResult(">> hi", reward=0.5)
    with pytest.raises(KeyError, match="unknown tool 'nope'"):
        reg.get("nope")


class GoldEchoTool(EchoTool):
    """A custom tool that cannot start an episode without a gold answer."""

    create_requires = ("gold",)


class StrRequiresTool(EchoTool):
    create_requires = ("gold")  # noqa: UP034 (the mistake under test: a str, not a tuple)


def test_declared_create_requirements_are_what_create_refuses_without(tmp_path: Path) -> None:
    """What the API reads (``tool_requirements``, no tool built) and what ``create`` refuses without are one list:
    a job the API accepts starts its tools, and one whose tasks lack a required key is refused at submit."""
    requires = tool_requirements(None)
    assert requires == {"calculator": (), "python": (), "check_answer": ("ground_truth",)}
    for name, tool in ToolRegistry.from_file(None).tools.items():
        run(tool.create("full", **dict.fromkeys(requires[name], "1")))
        for key in requires[name]:
            with pytest.raises(ValueError, match=f"{name}: create_kwargs need {key} "):
                run(tool.create("short", **{k: "1" for k in requires[name] if k != key}))
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(f"- name: calculator\n- name: judge\n  class: {__name__}:GoldEchoTool\n")
    assert tool_requirements(cfg) == {"calculator": (), "judge": ("gold",)}
    with pytest.raises(ValueError, match="judge: create_kwargs need gold"):
        run(ToolRegistry.from_file(cfg).get("judge").create("i", answer="1"))
    cfg.write_text(f"- name: calculator\n- name: judge\n  class: {__name__}:StrRequiresTool\n")
    with pytest.raises(ToolConfigError, match=r"tools\.yaml:2: tools\[1\] \(judge\): .*create_requires must be "
                                              "a tuple of str, got 'gold'"):
        ToolRegistry.from_file(cfg)
    assert tool_requirements(cfg) == {"calculator": (), "judge": None}  # the servers refuse it; the API knows its name


def test_a_tool_the_api_host_cannot_import_keeps_its_name_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The API reads the tools where they do not run: a module that fails to import there (any error: a GPU or a
    variable it needs is missing) leaves the tool's name known and what it requires unknown, with a warning."""
    (tmp_path / "needs_gpu_tool.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "tools.yaml"
    cfg.write_text("- name: calculator\n- name: judge\n  class: needs_gpu_tool:Judge\n")
    assert tool_requirements(cfg) == {"calculator": (), "judge": None}
    assert "tools[1] (judge): cannot import class 'needs_gpu_tool:Judge': importing needs_gpu_tool raised " \
        "RuntimeError: no GPU here" in caplog.text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("- name: x\n  class: no.such.module:Tool\n", r"tools\[0\] \(x\): cannot import class"),
        ("- name: calculator\n- name: y\n  class: json:dumps\n", r"bad\.yaml:2: tools\[1\] \(y\): .*not a subclass"),
        ("tools:\n  - name: calculator\n\n  - name: w\n    class: json:dumps\n",
         r"bad\.yaml:4: tools\[1\] \(w\): .*not a subclass"),
        ("- name: z\n", r"tools\[0\] \(z\): 'class' .* is required"),
        ("- name: calculator\n  colour: red\n", r"tools\[0\]: unknown key\(s\) colour"),
        ("- name: my tool\n  class: rollout_server.tools.calculator:CalculatorTool\n",
         r"tools\[0\]: 'name' must be an OpenAI function name, 1-64 letters, digits, _ or -, got 'my tool'"),
        (f"- name: {'t' * 65}\n  class: rollout_server.tools.calculator:CalculatorTool\n", "an OpenAI function name"),
        ("- name: 7\n", r"tools\[0\]: 'name' must be an OpenAI function name, .* got 7$"),
        (
            "- name: py\n  class: rollout_server.tools.python_tool:PythonTool\n  kwargs: {speed: 1}\n",
            "cannot construct",
        ),
        ("- name: calculator\n- name: calculator\n", "two tools are named 'calculator'"),
        ("tools: 3\n", "expected a list"),
        ("- [\n", "not valid YAML"),
        ("- name: calculator\n  schema: {type: function, function: {parameters: x}}\n",
         r"tools\[0\] \(calculator\): schema.function.parameters: Input should be a valid dictionary"),
        ("- name: calculator\n  schema: {type: function, function: {parameters: {type: object, required: e}}}\n",
         r"tools\[0\] \(calculator\): schema.function.parameters.required: Input should be a valid list"),
        ("- name: calculator\n  schema: {type: tool, function: {}}\n", r"schema.type: Input should be 'function'"),
        ("- name: calculator\n  schema: {type: function}\n", r"schema.function: Field required"),
    ],
)
def test_registry_errors_name_file_and_entry(tmp_path: Path, body: str, message: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(body)
    with pytest.raises(ToolConfigError, match=message) as info:
        ToolRegistry.from_file(cfg)
    assert str(cfg) in str(info.value)


def _py(code: str, **kwargs: Any) -> ToolResult:
    return run(PythonTool(**kwargs).execute("i", {"code": code}))


def _running(marker: str) -> list[str]:
    """Host processes whose command line holds ``marker``."""
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in path.read_bytes():
                found.append(path.parent.name)
        except OSError:  # gone meanwhile
            continue
    return found


def test_python_runs_code_with_imports_and_its_own_files() -> None:
    code = "import json, numpy as np\nopen('a.txt', 'w').write('hi')\n"
    out = _py(code + "print(json.dumps(int(np.arange(4).sum())), open('a.txt').read())")
    assert out.ok and out.text == "6 hi\n"
    err = _py("1/0")
    assert not err.ok and "ZeroDivisionError" in err.text and err.error == "exited with status 1"
    not_code = run(PythonTool().execute("i", {"code": 5}))
    assert not not_code.ok and not_code.error == "python: code must be a string"


def test_the_sandbox_is_a_separate_user_in_its_own_namespaces() -> None:
    out = _py("import os, socket\n"
              "print(os.getuid(), os.getgid(), os.getgroups(), socket.gethostname(), os.getcwd())\n"
              "print(sorted(os.listdir('/')))\n"
              "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
              "print([l.split()[0] for l in open('/proc/net/dev').read().splitlines()[2:]])")
    assert out.ok, out.text
    ids, root, pids, interfaces = out.text.splitlines()
    assert ids == "65534 65534 [] sandbox /sandbox"
    assert not {"etc", "home", "var", "run", "srv", "opt", "mnt"} & set(eval(root))
    assert eval(pids) == ["1", "2"]  # the bootstrap (the sandbox's init) and the snippet: nothing of the host
    assert eval(interfaces) == ["lo:"]  # down, and nothing else


def test_reading_host_files_fails(tmp_path: Path, tiny_model_dir: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    for code in (
        "print(open('/etc/passwd').read())",
        "print(open('/etc/hostname').read())",
        f"print(open({str(secret)!r}).read())",
        f"import os; print(os.listdir({str(tiny_model_dir)!r}))",
        f"print(open({str(tiny_model_dir / 'config.json')!r}).read())",
        "print(open('../../../../etc/passwd').read())",
    ):
        out = _py(code)
        assert not out.ok and "FileNotFoundError" in out.text, (code, out.text)
        assert "top secret" not in out.text and "root:" not in out.text


def test_writing_outside_its_directory_fails(tmp_path: Path) -> None:
    target = tmp_path / "planted.txt"
    for code, error in (
        (f"open({str(target)!r}, 'w').write('x')", "FileNotFoundError"),
        (f"open({sys.prefix + '/planted.txt'!r}, 'w').write('x')", "Read-only file system"),
        ("open('/usr/lib/planted.txt', 'w').write('x')", "Read-only file system"),
        ("open('/planted.txt', 'w').write('x')", "Read-only file system"),
        ("import os; os.mkdir('/proc/x')", "Error"),
    ):
        out = _py(code)
        assert not out.ok and error in out.text, (code, out.text)
    assert not target.exists() and not Path(sys.prefix, "planted.txt").exists()
    assert _py("open('/tmp/t', 'w').write('x'); open('w', 'w').write('y'); print('ok')").ok  # its own space


def test_no_network_not_even_a_redis_on_loopback(redis_server: Any) -> None:
    client = redis.Redis.from_url(redis_server.url)
    before = client.info("stats")["total_connections_received"]
    host, port = "127.0.0.1", redis_server.url.rsplit(":", 1)[1].split("/")[0]
    for code in (
        f"import socket\nsocket.create_connection(({host!r}, {port}), timeout=2)\nprint('connected')",
        f"import redis\nprint(redis.Redis(host={host!r}, port={port}, socket_timeout=2).ping())",
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')",
    ):
        out = _py(code, timeout_s=30)  # importing redis in the sandbox of a loaded machine may take over 5 s
        assert not out.ok and "connected" not in out.text and "True" not in out.text, out.text
        assert "Error" in out.text and ("refused" in out.text or "unreachable" in out.text), out.text
    assert client.info("stats")["total_connections_received"] == before
    client.close()


def test_the_environment_and_the_parent_stay_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cret-" + "x" * 32
    monkeypatch.setenv("ROLLWAVE_CHECKPOINT_TOKEN", secret)
    code = (
        "import os\n"
        "print(dict(os.environ))\n"
        f"for pid in (os.getppid(), {os.getpid()}, 1):\n"
        "    for name in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            print(pid, name, open(f'/proc/{pid}/{name}', 'rb').read())\n"
        "        except OSError as exc:\n"
        "            print(pid, name, type(exc).__name__)\n"
    )
    out = _py(code, max_output_bytes=1 << 20)
    assert out.ok and secret not in out.text, out.text
    assert f"{os.getpid()} environ FileNotFoundError" in out.text  # the host's processes are not there
    assert "1 environ PermissionError" in out.text  # the sandbox's init is not dumpable


def test_killing_its_parent_or_anything_else_fails() -> None:
    for code in (
        "import os, signal; os.kill(os.getppid(), signal.SIGKILL); print('sent')",
        "import os, signal; os.kill(-1, signal.SIGKILL); print('sent')",
        f"import os, signal; os.kill({os.getpid()}, signal.SIGKILL); print('sent')",
    ):
        out = _py(code)
        assert not out.ok and "sent" not in out.text and ("PermissionError" in out.text or "ProcessLookupError"
                                                          in out.text), out.text


def test_a_fork_bomb_is_contained() -> None:
    code = (
        "import os\n"
        "failed = 0\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        failed += 1\n"
        "        if failed == 1:\n"
        "            print('fork refused', flush=True)\n"
    )
    memory_mb = 300 + os.getpid() % 97  # its processes' command lines carry this number: find leftovers by it
    started = time.monotonic()
    out = _py(code, timeout_s=3, max_processes=8, memory_mb=memory_mb)
    assert time.monotonic() - started < 10
    assert not out.ok and out.error == "timed out after 3s and was killed" and "fork refused" in out.text
    assert _running(f"\0{memory_mb << 20}\0") == []


def test_a_session_leader_started_through_fork_exec_dies_with_the_sandbox() -> None:
    """The audit-hook sandbox missed ``_posixsubprocess.fork_exec`` and a child in a new session outlived
    its kill; here the child runs in the same sandbox and goes with its pid namespace."""
    marker = f"rollwave-escape-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        "import _posixsubprocess, subprocess, sys\n"
        "spawned = []\n"
        "def spy(*args):  # subprocess hands fork_exec its arguments; call the real one with them\n"
        "    spawned.append(_posixsubprocess.fork_exec(*args))\n"
        "    return spawned[-1]\n"
        "subprocess._fork_exec = spy\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import os, time; print(os.getuid(), flush=True); '\n"
        f"                          'time.sleep(600)  # {marker}'], start_new_session=True)\n"
        "print('fork_exec', len(spawned), flush=True)\n"
        "child.wait()\n"
    )
    out = _py(code, timeout_s=3)
    assert out.error == "timed out after 3s and was killed"
    assert "fork_exec 1" in out.text and "65534" in out.text, out.text
    assert _running(marker) == []


def test_allocating_4_gb_is_stopped() -> None:
    out = _py("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", memory_mb=256)
    assert not out.ok and out.error == "memory limit of 256 MiB exceeded" and "allocated" not in out.text


def test_an_endless_loop_is_stopped(caplog: pytest.LogCaptureFixture) -> None:
    """A timeout was counted as any error (``outcome="error"``) and not logged: it is logged, naming the limit, and
    counted as ``sandbox_timeout`` (apart from the rollout's ``timeout``, rollout.tool_timeout_s)."""
    out = _py("while True:\n    pass", cpu_s=1, timeout_s=30)
    assert not out.ok and out.error == "CPU limit of 1s exceeded and was killed" and out.outcome is None
    with caplog.at_level(logging.WARNING, logger="rollout_server.tools.python_tool"):
        out = _py("import time\nprint('start', flush=True)\ntime.sleep(60)", timeout_s=1.0)
    assert not out.ok and out.error == "timed out after 1s and was killed" and out.text.startswith("start\n")
    assert out.outcome == "sandbox_timeout", out
    assert "python: stopped a call of i at its timeout_s: timed out after 1s and was killed" in caplog.text


def test_100_mb_of_output_is_cut_and_the_sandbox_stopped(caplog: pytest.LogCaptureFixture) -> None:
    """Killed at the output cap, the call was counted as any error and not logged: it is logged, naming the limit,
    and counted as ``output_limit``."""
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rollout_server.tools.python_tool"):
        out = _py("print('x' * 100_000_000)", max_output_bytes=100, timeout_s=20)
    assert time.monotonic() - started < 10
    assert not out.ok and out.error == "printed more than 100 bytes and was killed"
    assert out.text == "x" * 100 + f"\n[output truncated at 100 bytes]\nError: {out.error}"
    assert out.outcome == "output_limit", out
    assert "python: stopped a call of i at its max_output_bytes: printed more than 100 bytes and was killed" \
        in caplog.text


_AS_USER = """
import asyncio, dataclasses, json, sys
from rollout_server.tools.python_tool import PythonTool
tool = PythonTool(**json.loads(sys.argv[1]))
print(json.dumps(dataclasses.asdict(asyncio.run(tool.execute("i", {"code": sys.argv[2]})))))
"""


def _py_as(who: str, code: str, **kwargs: Any) -> ToolResult:
    """``code`` run by a tool whose process is root (this one, if it is) or a user: there a user namespace maps
    this process's uid to 1000, so the tool takes the path of a rollout server that is not root."""
    if who == "root":
        if os.geteuid() != 0:
            pytest.skip("the tool's root path needs the tests to run as root")
        return _py(code, **kwargs)
    done = subprocess.run(["unshare", "--user", "--map-user=1000", "--map-group=1000", "--", sys.executable, "-c",
                           _AS_USER, json.dumps(kwargs), code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return ToolResult(**json.loads(done.stdout))


def _kill(marker: str) -> None:
    """SIGKILL what a failed containment left running (host processes whose command line holds ``marker``)."""
    for pid in _running(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.parametrize("who", ["root", "user"])
def test_a_snippets_own_exit_status_is_not_read_as_a_limit(who: str) -> None:
    """pid 1 said "memory limit" and "file limit" by exit statuses 97 and 96, which the snippet can exit with too
    (and 137, SIGKILL's, read as the CPU limit): a snippet's own status is told as it is, and a limit only where pid 1
    saw it hit."""
    for code, error in (
        ("import sys; sys.exit(97)", "exited with status 97"),
        ("import os; os._exit(96)", "exited with status 96"),
        ("raise SystemExit(137)", "exited with status 137"),
        ("x = bytearray(4 * 1024 ** 3)", "memory limit of 256 MiB exceeded"),
        ("import os\nif os.fork() == 0:\n    x = bytearray(4 * 1024 ** 3)\nos.wait()\nraise SystemExit(3)",
         "memory limit of 256 MiB exceeded"),  # a process of the snippet's ended on the limit, then the snippet failed
    ):
        out = _py_as(who, code, memory_mb=256)
        assert not out.ok and out.error == error, (code, out.text)


@pytest.mark.parametrize("who", ["root", "user"])
def test_a_signal_the_snippet_sent_itself_is_not_read_as_the_cpu_limit(who: str) -> None:
    """A snippet that killed itself with SIGKILL (or SIGSEGV) was told it hit the CPU (or memory) limit: the signal is
    told as it is, and the CPU limit only where the snippet's CPU time reached it (SIGXCPU at cpu_s; SIGKILL a second
    later, for one that ignores SIGXCPU)."""
    burn = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.5:\n    pass\n"
    for code, error in (
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9 (Killed)"),
        (burn + "import os, signal; os.kill(os.getpid(), signal.SIGXCPU)", "killed by signal 24 (CPU time limit "
                                                                          "exceeded)"),
        ("import ctypes; ctypes.string_at(0)", "killed by signal 11 (Segmentation fault)"),
        ("while True:\n    pass", "CPU limit of 1s exceeded and was killed"),
        ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
         "CPU limit of 1s exceeded and was killed"),
    ):
        out = _py_as(who, code, cpu_s=1, timeout_s=30)
        assert not out.ok and out.error == error, (code, out.text)


@pytest.mark.parametrize("who", ["root", "user"])
def test_no_process_in_the_sandbox_is_unlimited_or_attachable(who: str) -> None:
    """bwrap's own pid 1 ran as the sandbox uid with no rlimit: a snippet could PTRACE_ATTACH it and run code
    in it past every limit. Every process the snippet sees must be limited, and none attachable."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for pid in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
        "    limits = [line[26:].split()[0] for line in open(f'/proc/{pid}/limits')\n"
        "              if line.startswith(('Max processes', 'Max address space', 'Max cpu time'))]\n"
        "    if pid == os.getpid():\n"
        "        attach = 'self'\n"
        "    elif libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH\n"
        "        attach = 'attached'\n"
        "    else:\n"
        "        attach = os.strerror(ctypes.get_errno())\n"
        "    print(pid, attach, *limits, sep='|')\n"
    )
    out = _py_as(who, code)
    assert out.ok, out.text
    lines = [line.split("|") for line in out.text.splitlines()]
    assert [line[:2] for line in lines] == [["1", "Operation not permitted"], ["2", "self"]], out.text
    assert all(len(line) == 5 and "unlimited" not in line for line in lines), out.text


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the injection below sets x86-64 registers")
@pytest.mark.parametrize("who", ["root", "user"])
def test_a_snippet_leaves_no_process_running_even_through_ptrace(who: str) -> None:
    """The reviewer's escape: attach to every other process of the sandbox and make it call
    prctl(PR_SET_PDEATHSIG, 0), so that killing bwrap no longer kills the sandbox; then start a child and
    outlive the timeout. The call must come back with every process of the sandbox gone."""
    marker = f"rollwave-ptrace-{os.getpid()}-{time.monotonic_ns()}"
    memory_mb = 400 + os.getpid() % 97  # the sandbox's command lines carry this number: find leftovers by it
    code = (
        "import ctypes, os, subprocess, sys, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.ptrace.restype = ctypes.c_long\n"
        "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
        "def disarm(pid):  # run prctl(PR_SET_PDEATHSIG, 0) in pid, stopped in a system call by the attach\n"
        "    if libc.ptrace(16, pid, None, None) != 0:\n"
        "        return 'attach ' + os.strerror(ctypes.get_errno())\n"
        "    os.waitpid(pid, 0)\n"
        "    regs, saved = (ctypes.c_ulonglong * 27)(), (ctypes.c_ulonglong * 27)()\n"
        "    libc.ptrace(12, pid, None, saved)  # PTRACE_GETREGS\n"
        "    ctypes.memmove(regs, saved, ctypes.sizeof(regs))\n"
        "    regs[10], regs[14], regs[13], regs[15] = 157, 1, 0, 2 ** 64 - 1  # rax=prctl, rdi, rsi, orig_rax\n"
        "    regs[16] = saved[16] - 2  # rip back on its syscall instruction\n"
        "    libc.ptrace(13, pid, None, regs)  # PTRACE_SETREGS\n"
        "    libc.ptrace(9, pid, None, None)  # PTRACE_SINGLESTEP\n"
        "    os.waitpid(pid, 0)\n"
        "    libc.ptrace(12, pid, None, regs)\n"
        "    libc.ptrace(13, pid, None, saved)\n"
        "    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH\n"
        "    return f'prctl returned {ctypes.c_longlong(regs[10]).value}'\n"
        "for pid in sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()):\n"
        "    print(pid, disarm(pid), flush=True)\n"
        "libc.prctl(1, 0, 0, 0, 0)\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {marker}'],\n"
        "                 start_new_session=True)\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    try:
        out = _py_as(who, code, timeout_s=3, memory_mb=memory_mb)
        assert out.error == "timed out after 3s and was killed" and "started" in out.text, out.text
        assert "prctl returned" not in out.text, out.text
        assert _running(marker) == [] and _running(f"\0{memory_mb << 20}\0") == []
    finally:
        _kill(marker)
        _kill(f"\0{memory_mb << 20}\0")


@pytest.mark.parametrize("who", ["root", "user"])
def test_dev_is_read_only_and_dev_shm_is_capped(who: str) -> None:
    """Not root, bwrap's /dev was a tmpfs of the sandbox uid with no size: 3000 MiB went into /dev/shm."""
    code = (
        "try:\n"
        "    open('/dev/planted', 'w')\n"
        "except OSError as exc:\n"
        "    print('dev:', exc.strerror)\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'/dev/shm/{i}', 'wb') as f:\n"
        "            f.write(b'x' * (1 << 20))\n"
        "        written += 1\n"
        "except OSError as exc:\n"
        "    print('shm:', exc.strerror)\n"
        "print('written:', written)\n"
    )
    out = _py_as(who, code, max_file_mb=4)
    assert out.ok and "dev: Read-only file system" in out.text, out.text
    assert "shm: No space left on device" in out.text, out.text
    assert int(out.text.split("written:")[1]) <= 4, out.text


@pytest.mark.parametrize("who", ["root", "user"])
def test_files_in_a_loop_are_stopped_at_max_files(who: str) -> None:
    """Empty files cost no bytes of a tmpfs's size but an inode each (kernel memory): a loop making them ran until the
    timeout, without bound. Each of /tmp, /dev/shm and the working directory holds at most max_files (its root
    counts), and a snippet that fails on that is told the limit."""
    code = (
        "import os\n"
        "for d in ('/tmp', '/dev/shm'):\n"
        "    n = 0\n"
        "    try:\n"
        "        while True:\n"
        "            os.mkdir(f'{d}/{n}') if n % 2 else open(f'{d}/{n}', 'w').close()\n"
        "            n += 1\n"
        "    except OSError as exc:\n"
        "        print(d, n, exc.strerror, flush=True)\n"
        "n = 0\n"
        "while True:\n"
        "    open(str(n), 'w').close()\n"
        "    n += 1\n"
    )
    out = _py_as(who, code, max_files=100)
    assert out.error == "file limit of 100 files (max_files) exceeded", out.text
    tmp, shm = out.text.splitlines()[:2]
    # /tmp's root counts, and the directories an interpreter living under /tmp is bound on (a clone in /tmp/ci)
    assert re.fullmatch(r"/tmp (9\d) No space left on device", tmp), out.text
    assert shm == "/dev/shm 99 No space left on device", out.text
    assert "OSError: [Errno 28] No space left on device: '99'" in out.text, out.text


@pytest.mark.parametrize("who", ["root", "user"])
def test_no_process_of_the_sandbox_keeps_cap_sys_admin(who: str) -> None:
    """pid 1 gets CAP_SYS_ADMIN to mount the private tmpfs; it must be gone before the snippet runs, or the snippet
    (or pid 1, were it attached) could mount a tmpfs of no limit, or unmount the capped ones."""
    code = (
        "import ctypes, os\n"
        "for pid in (1, os.getpid()):\n"
        "    caps = dict(line.split(':') for line in open(f'/proc/{pid}/status') if line.startswith('Cap'))\n"
        "    print(pid, [name for name in ('CapInh', 'CapPrm', 'CapEff', 'CapAmb') if int(caps[name], 16) >> 21 & 1])\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x20000), os.strerror(ctypes.get_errno()))\n"
        "print(libc.umount2(b'/tmp', 2), os.strerror(ctypes.get_errno()))\n"
    )
    out = _py_as(who, code)
    assert out.ok, out.text
    assert out.text.splitlines() == ["1 []", "2 []", "-1 Operation not permitted", "-1 Operation not permitted"], \
        out.text


@pytest.mark.parametrize("who", ["root", "user"])
def test_no_nested_user_namespace(who: str) -> None:
    """As root, a snippet made a user namespace, mounted a tmpfs of no size in it and filled it."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for flags in (0x10000000, 0x10000000 | 0x20000):  # CLONE_NEWUSER, and with CLONE_NEWNS\n"
        "    print(libc.unshare(flags), os.strerror(ctypes.get_errno()) if ctypes.get_errno() else '')\n"
        "print(os.getuid(), open('/proc/self/uid_map').read().split())\n"
    )
    out = _py_as(who, code)
    assert out.ok, out.text
    *calls, ids = out.text.splitlines()
    assert calls == ["-1 No space left on device"] * 2, out.text
    if who == "root":  # the sandbox uid is itself on the host, not root
        assert ids == "65534 ['0', '0', '1', '65534', '65534', '1']", out.text


@pytest.mark.parametrize("who", ["root", "user"])
def test_no_system_v_ipc_or_memfd_holds_memory_past_the_limits(who: str) -> None:
    """Detached System V shared memory counts in no process's address space, and nothing bounds it in the sandbox's
    ipc namespace: one snippet held 3 GiB past a memory_mb of 256 in 4 s (message queues and semaphore sets are
    kernel memory the same way, a memfd is outside every tmpfs). None of them can be made."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, args in (('shmget', (0, 1 << 20, 0o1600)), ('semget', (0, 1, 0o1600)), ('msgget', (0, 0o1600))):\n"
        "    print(name, getattr(libc, name)(*args), os.strerror(ctypes.get_errno()))\n"
        "try:\n"
        "    os.memfd_create('held')\n"
        "except OSError as exc:\n"
        "    print('memfd_create', -1, exc.strerror)\n"
    )
    out = _py_as(who, code)
    assert out.ok, out.text
    names = ("shmget", "semget", "msgget", "memfd_create")
    assert out.text.splitlines() == [f"{name} -1 Function not implemented" for name in names], out.text


_WITH_A_KEY = """
import asyncio, ctypes, dataclasses, json, platform, sys
from rollout_server.tools.python_tool import KEYCTL_SYSCALLS, PythonTool
libc = ctypes.CDLL(None, use_errno=True)
keyctl = KEYCTL_SYSCALLS[platform.machine()]
assert libc.syscall(keyctl, 1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING: a new one, not the test's
add_key = {"x86_64": 248, "aarch64": 217, "riscv64": 217}[platform.machine()]
key = libc.syscall(add_key, b"user", b"rollwave-test", sys.argv[1].encode(), len(sys.argv[1]), -3)  # to @s
assert key > 0, ctypes.get_errno()
code = sys.argv[2].replace("KEYCTL", str(keyctl)).replace("KEY", str(key))
print(json.dumps(dataclasses.asdict(asyncio.run(PythonTool().execute("i", {"code": code})))))
"""


@pytest.mark.parametrize("who", ["root", "user"])
def test_a_key_of_the_rollout_servers_session_keyring_stays_out_of_reach(who: str) -> None:
    """Keyrings are not namespaced: the snippet inherited its rollout server's session keyring, and so possessed,
    and read, every key in it (a login's or a service manager's session holds credentials there)."""
    secret = "s3cret-" + "k" * 32
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "buf = ctypes.create_string_buffer(4096)\n"
        "for key in (KEY, -3):  # the key, and the session keyring (the ids of the keys in it)\n"
        "    n = libc.syscall(KEYCTL, 11, key, buf, 4096)  # KEYCTL_READ\n"
        "    print(key, n, buf.raw[:max(n, 0)] if n >= 0 else ctypes.get_errno())\n"
    )
    prefix = [] if who == "root" else ["unshare", "--user", "--map-user=1000", "--map-group=1000", "--"]
    done = subprocess.run([*prefix, sys.executable, "-c", _WITH_A_KEY, secret, code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    out = ToolResult(**json.loads(done.stdout))
    assert out.ok and secret not in out.text, out.text
    key_line, session_line = out.text.splitlines()
    assert key_line.endswith(" -1 13"), out.text  # EACCES: the key is not the snippet's
    assert session_line == "-3 0 b''", out.text  # its session keyring is a new, empty one


def test_concurrent_snippets_each_have_their_own_process_limit() -> None:
    """As root, concurrent snippets shared their uid's RLIMIT_NPROC (one's processes kept another from forking);
    each sandbox's user namespace now counts its own."""
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "time.sleep(3)\n"
        "print('forked')\n"
    )

    async def scenario() -> list[ToolResult]:
        tool = PythonTool(max_processes=5, timeout_s=30)  # pid 1 counts where it runs as the sandbox uid
        return await asyncio.gather(*(tool.execute("i", {"code": code}) for _ in range(3)))

    assert [out.text for out in run(scenario())] == ["forked\n"] * 3


def test_past_max_concurrent_a_call_waits_then_is_refused() -> None:
    """Every call started a sandbox at once: a burst of calls started hundreds. With max_concurrent 1, a second call
    waits for the first (both run), and one that waits past max_wait_s is refused, naming both limits."""

    async def scenario() -> tuple[list[ToolResult], ToolResult]:
        tool = PythonTool(max_concurrent=1, max_wait_s=60)
        waited = await asyncio.gather(*(tool.execute(str(i), {"code": f"print({i})"}) for i in range(2)))
        tool = PythonTool(max_concurrent=1, max_wait_s=0.2, timeout_s=60)
        first = asyncio.create_task(tool.execute("a", {"code": "import time; time.sleep(60)"}))
        await asyncio.sleep(0)  # the first takes the one sandbox
        refused = await tool.execute("b", {"code": "print('ran')"})
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return waited, refused

    waited, refused = run(scenario())
    assert [out.text for out in waited] == ["0\n", "1\n"]
    assert not refused.ok and refused.outcome == "busy", refused
    assert refused.error == "busy: max_concurrent (1) sandboxes ran for all of the 0.2s this call waited " \
        "(max_wait_s); try again later"


def test_without_a_sandbox_the_tool_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap here
    tool = PythonTool()
    ran = tmp_path / "ran"
    out = run(tool.execute("i", {"code": f"open({str(ran)!r}, 'w')"}))
    assert not out.ok and out.outcome == "refused"
    assert out.error == "sandbox unavailable: bwrap not found: install the Debian package bubblewrap"
    assert not ran.exists()


def test_python_does_not_block_the_event_loop() -> None:
    async def scenario() -> int:
        ticks = 0
        tool = PythonTool()
        task = asyncio.create_task(tool.execute("i", {"code": "import time; time.sleep(1.5)"}))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.05)
        assert (await task).ok
        return ticks

    assert run(scenario()) >= 5


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"- name: calcul\xe9\n", ":1: not valid UTF-8 (byte 0xe9 at column 15)"),
        (b"tools:\n  - name: calculator\n    name: python\n", ":3: duplicate key 'name' (first on line 2)"),
        (b"tools: [{name: calculator}]\ntools: [{name: python}]\n", ":2: duplicate key 'tools' (first on line 1)"),
        (b"- [\n", ":2: not valid YAML: "),
    ],
    ids=["not utf-8", "key twice in an entry", "tools twice", "not yaml"],
)
def test_a_tool_config_that_is_not_utf8_or_names_a_key_twice_names_file_and_line(
    tmp_path: Path, body: bytes, message: str
) -> None:
    cfg = tmp_path / "tools.yaml"
    cfg.write_bytes(body)
    with pytest.raises(ToolConfigError) as info:
        ToolRegistry.from_file(cfg)
    assert str(info.value).startswith(f"{cfg}{message}")
    cfg.write_bytes(b"\xef\xbb\xbf- name: calculator\n")  # a byte order mark is allowed
    assert list(ToolRegistry.from_file(cfg).tools) == ["calculator"]


def test_a_schema_without_a_function_name_takes_the_tools(tmp_path: Path) -> None:
    """The name the model must call is the tool's, whether the configured schema names one or not."""
    cfg = tmp_path / "tools.yaml"
    cfg.write_text("- name: calculator\n  schema: {type: function, function: {description: adds,\n"
                   "    parameters: {type: object, properties: {expression: {type: string}},\n"
                   "    required: [expression]}}}\n")
    [schema] = ToolRegistry.from_file(cfg).schemas(["calculator"])
    assert schema["function"]["name"] == "calculator" and schema["function"]["description"] == "adds"
