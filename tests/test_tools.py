"""Tools: exact calculator, GSM8K answer tool, YAML registry, and the python sandbox's limits.

The sandbox tests run real subprocesses: reading outside the private dir, opening a socket to a
real server on 127.0.0.1, running too long, spinning the CPU and allocating too much must all fail.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.tasks.arith import CALCULATOR_SCHEMA
from rollout_server.tools import Tool, ToolConfigError, ToolRegistry, ToolResult
from rollout_server.tools.calculator import CalculatorError, CalculatorTool, evaluate, format_number
from rollout_server.tools.check_answer import CheckAnswerTool
from rollout_server.tools.python_tool import PythonTool, detect_netns_prefix


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


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("- name: x\n  class: no.such.module:Tool\n", r"tools\[0\] \(x\): cannot import class"),
        ("- name: calculator\n- name: y\n  class: json:dumps\n", r"tools\[1\] \(y\): .*not a subclass"),
        ("- name: z\n", r"tools\[0\] \(z\): 'class' .* is required"),
        ("- name: calculator\n  colour: red\n", r"tools\[0\]: unknown key\(s\) colour"),
        (
            "- name: py\n  class: rollout_server.tools.python_tool:PythonTool\n  kwargs: {speed: 1}\n",
            "cannot construct",
        ),
        ("- name: calculator\n- name: calculator\n", "two tools are named 'calculator'"),
        ("tools: 3\n", "expected a list"),
        ("- [\n", "not valid YAML"),
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


def test_python_runs_code_with_imports_and_its_own_files() -> None:
    code = "import json, numpy as np\nopen('a.txt', 'w').write('hi')\n"
    out = _py(code + "print(json.dumps(int(np.arange(4).sum())), open('a.txt').read())")
    assert out.ok and out.text == "6 hi\n"
    err = _py("1/0")
    assert not err.ok and "ZeroDivisionError" in err.text and err.error == "exited with status 1"
    not_code = run(PythonTool().execute("i", {"code": 5}))
    assert not not_code.ok and not_code.error == "python: code must be a string"


def test_python_cannot_read_outside_its_directory(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    for code in (
        f"print(open({str(secret)!r}).read())",
        "print(open('/etc/hostname').read())",
        "print(open('../../../../etc/hostname').read())",
        f"import pathlib; print(pathlib.Path({str(secret)!r}).read_text())",
        f"import os; print(os.listdir({str(tmp_path)!r}))",
        "import os; os.chdir('/'); print(os.listdir('.'))",
        "import subprocess; print(subprocess.run(['cat', '/etc/hostname'], capture_output=True).stdout)",
        "import os; os.system('cat /etc/hostname')",
        "import ctypes; print(ctypes.CDLL(None).open)",
        f"import site, importlib; open({str(tmp_path / 'w.txt')!r}, 'w').write('x')",
    ):
        out = _py(code)
        assert not out.ok and "PermissionError: sandbox" in out.text, code
        assert "top secret" not in out.text
    assert not (tmp_path / "w.txt").exists()


def test_python_cannot_open_a_socket() -> None:
    async def scenario() -> tuple[list[ToolResult], int]:
        connections = 0

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        snippets = [
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
            f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
        ]
        try:
            outs = [await PythonTool().execute("i", {"code": code}) for code in snippets]
        finally:
            server.close()
            await server.wait_closed()
        return outs, connections

    outs, connections = run(scenario())
    for out in outs:
        assert not out.ok and "PermissionError: sandbox: socket." in out.text and "connected" not in out.text
    assert connections == 0


def test_network_namespace_has_no_network() -> None:
    """The namespace layer alone (no audit hook): where ``unshare`` works here, loopback is down."""
    prefix = detect_netns_prefix()
    if not prefix:  # no namespaces on this machine: the audit hook above is the only guard
        return
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print(type(exc).__name__)\n"
        )
        inside = subprocess.run(
            [*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=30
        )
        outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert outside.stdout.strip() == "connected"
    assert inside.returncode == 0 and inside.stdout.strip() in {"OSError", "ConnectionRefusedError"}, inside


def test_python_is_killed_when_it_runs_too_long() -> None:
    out = _py("import time\nprint('start', flush=True)\ntime.sleep(60)", timeout_s=1.0)
    assert not out.ok and out.error == "timed out after 1s and was killed"
    assert out.text.startswith("start\n")


def test_python_is_killed_when_it_burns_cpu() -> None:
    out = _py("while True:\n    pass", cpu_s=1, timeout_s=30)
    assert not out.ok and out.error == "CPU limit of 1s exceeded and was killed"


def test_python_is_stopped_when_it_allocates_too_much() -> None:
    out = _py("x = bytearray(1024 ** 3)\nprint('allocated')", memory_mb=256)
    assert not out.ok and out.error == "memory limit of 256 MiB exceeded"
    assert "allocated" not in out.text


def test_python_output_is_truncated() -> None:
    out = _py("print('x' * 100000)", max_output_bytes=100)
    assert out.ok and out.text == "x" * 100 + "\n[output truncated at 100 bytes]"


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
