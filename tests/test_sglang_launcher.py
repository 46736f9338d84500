"""``rollwave engine sglang``: the SGLang command line (SGLang itself is never run here)."""

from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

from rollout_server.sglang_launcher import build_command, command_from_args, tool_call_parser
from services.cli import build_parser, main


def test_defaults_bind_loopback_and_parse_qwen_tool_calls() -> None:
    cmd = build_command("/models/qwen", 30001, python="/opt/sglang/bin/python")
    assert cmd == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tool-call-parser",
        "qwen",
    ]


def test_rl_flags_and_extra_args() -> None:
    cmd = build_command(
        "m",
        1,
        host="10.0.0.5",
        weight_version="step3",
        tp=4,
        mem_fraction=0.6,
        colocate=True,
        python="py",
        extra=["--log-level", "debug"],
    )
    assert cmd[cmd.index("--host") + 1] == "10.0.0.5"
    assert cmd[cmd.index("--weight-version") + 1] == "step3"
    assert cmd[cmd.index("--tp-size") + 1] == "4"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.6"
    assert "--enable-memory-saver" in cmd and "--skip-tokenizer-init" not in cmd
    assert cmd[-2:] == ["--log-level", "debug"]
    assert "--enable-memory-saver" not in build_command("m", 1)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"tp": 0}, "--tp"), ({"mem_fraction": 1.5}, "--mem-fraction"), ({"port": 0}, "--port"),
     ({"port": 65536}, "--port")],
)
def test_bad_values_are_named(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_command("m", **{"port": 1, **kw})


@pytest.mark.parametrize(
    ("version", "parser"),
    [("0.4.10.post2", "qwen25"), ("0.5.3", "qwen25"), ("0.5.3.post1", "qwen"), ("0.5.6", "qwen"), ("0.5.23", "qwen"),
     (None, "qwen"), ("not-a-version", "qwen")],
)
def test_tool_call_parser_is_the_name_that_release_prefers(version: str | None, parser: str) -> None:
    assert tool_call_parser(version) == parser


@pytest.mark.parametrize(("version", "parser"), [("0.5.2", "qwen25"), ("0.5.23", "qwen")])
def test_dry_run_asks_the_python_it_will_run(version: str, parser: str, tmp_path: Path) -> None:
    """The version comes from ``--python``'s own ``import sglang`` (here a package that only has a version)."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    proc = subprocess.run(
        [str(Path(sysconfig.get_path("scripts")) / "rollwave"), "engine", "sglang", "--model", "m", "--port", "30000",
         "--dry-run"],
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == ""
    cmd = proc.stdout.split()
    assert cmd[cmd.index("--tool-call-parser") + 1] == parser


def test_cli_builds_the_same_command(capsys: pytest.CaptureFixture) -> None:
    argv = [
        "engine",
        "sglang",
        "--model",
        "m",
        "--port",
        "30000",
        "--weight-version",
        "v1",
        "--colocate",
        "--python",
        "py",
        "--",
        "--context-length",
        "4096",
    ]
    args = build_parser().parse_args(argv)
    assert command_from_args(args) == build_command(
        "m", 30000, weight_version="v1", colocate=True, python="py", extra=["--context-length", "4096"]
    )
    assert main([*argv[:-3], "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == build_command("m", 30000, weight_version="v1", colocate=True, python="py")
