"""``rollwave engine sglang``: the SGLang command line (SGLang itself is never run here)."""

from __future__ import annotations

import pytest

from rollout_server.sglang_launcher import build_command, command_from_args
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
        "qwen25",
        "--weight-version",
        "0",
    ]


def test_rl_flags_and_extra_args() -> None:
    cmd = build_command(
        "m",
        1,
        host="10.0.0.5",
        weight_version=3,
        tp=4,
        mem_fraction=0.6,
        colocate=True,
        python="py",
        extra=["--log-level", "debug"],
    )
    assert cmd[cmd.index("--host") + 1] == "10.0.0.5"
    assert cmd[cmd.index("--weight-version") + 1] == "3"
    assert cmd[cmd.index("--tp-size") + 1] == "4"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.6"
    assert "--enable-memory-saver" in cmd and "--skip-tokenizer-init" not in cmd
    assert cmd[-2:] == ["--log-level", "debug"]
    assert "--enable-memory-saver" not in build_command("m", 1)


@pytest.mark.parametrize(("kw", "needle"), [({"tp": 0}, "--tp"), ({"mem_fraction": 1.5}, "--mem-fraction")])
def test_bad_values_are_named(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_command("m", 1, **kw)


def test_cli_builds_the_same_command(capsys: pytest.CaptureFixture) -> None:
    argv = [
        "engine",
        "sglang",
        "--model",
        "m",
        "--port",
        "30000",
        "--weight-version",
        "1",
        "--colocate",
        "--python",
        "py",
        "--",
        "--context-length",
        "4096",
    ]
    args = build_parser().parse_args(argv)
    assert command_from_args(args) == build_command(
        "m", 30000, weight_version=1, colocate=True, python="py", extra=["--context-length", "4096"]
    )
    assert main([*argv[:-3], "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == build_command("m", 30000, weight_version=1, colocate=True, python="py")


def test_a_non_integer_weight_version_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["engine", "sglang", "--model", "m", "--port", "1", "--weight-version", "step0", "--dry-run"])
    assert exit_.value.code == 2
    assert "weight version 'step0' is not an integer" in capsys.readouterr().err
