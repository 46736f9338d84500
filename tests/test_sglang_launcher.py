"""``rollwave engine sglang``: the SGLang command line (SGLang itself is never run here)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
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
    assert "--enable-lora" not in build_command("m", 1)


def test_lora_flags_let_the_server_load_pushed_adapters() -> None:
    cmd = build_command("m", 1, lora_rank=16, lora_targets=["q_proj", "v_proj"], extra=["--log-level", "info"])
    i = cmd.index("--enable-lora")
    assert cmd[i:i + 6] == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj"]
    args = build_parser().parse_args(["engine", "sglang", "--model", "m", "--port", "1", "--python", "py",
                                      "--lora-rank", "8", "--lora-target-modules", "o_proj"])
    assert command_from_args(args) == build_command("m", 1, python="py", lora_rank=8, lora_targets=["o_proj"])


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"tp": 0}, "--tp"), ({"mem_fraction": 1.5}, "--mem-fraction"), ({"port": 0}, "--port"),
     ({"port": 65536}, "--port"), ({"lora_rank": 0}, "--lora-rank")],
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


def _fake_sglang(root: Path) -> None:
    """A ``sglang`` package whose launch_server prints what SGLang would see: its argv, and the process's; and logs
    its arguments as SGLang does at start (``logger.info(f"{server_args=}")``), after setting up its logging."""
    (root / "sglang").mkdir()
    (root / "sglang" / "__init__.py").write_text("__version__ = '0.5.23'\n")
    (root / "sglang" / "launch_server.py").write_text(
        "import json, logging, os, sys\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv[1:], 'cmdline': open('/proc/self/cmdline').read(),\n"
        "                      'env': 'ROLLWAVE_ENGINE_API_KEY' in os.environ}))\n"
        "    logging.basicConfig(level=logging.INFO, force=True)\n"
        "    logging.getLogger('sglang.srt.entrypoints.engine').info('server_args=ServerArgs(argv=%r)', sys.argv[1:])\n"
    )


def _sglang(root: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "ROLLWAVE_ENGINE_API_KEY"}
    return subprocess.run(
        [str(Path(sysconfig.get_path("scripts")) / "rollwave"), "engine", "sglang", "--model", "m", "--port", "30000",
         "--python", sys.executable, *args],
        env={**clean, "PYTHONPATH": str(root), **env}, capture_output=True, text=True, timeout=120,
    )


def test_the_api_key_reaches_sglang_through_the_environment_not_argv(tmp_path: Path) -> None:
    _fake_sglang(tmp_path)
    key = secrets.token_urlsafe(32)
    proc = _sglang(tmp_path, "--host", "10.0.0.5", env={"ROLLWAVE_ENGINE_API_KEY": key})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["argv"][:2] == ["--api-key", key] and seen["argv"][seen["argv"].index("--host") + 1] == "10.0.0.5"
    assert key not in seen["cmdline"] and not seen["env"]  # and SGLang's own children do not inherit it
    assert "server_args=ServerArgs(argv=['--api-key', '<engine api key>'" in proc.stderr and key not in proc.stderr
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    proc = _sglang(tmp_path, "--host", "0.0.0.0", "--api-key-file", str(key_file), env={})
    assert proc.returncode == 0 and json.loads(proc.stdout)["argv"][:2] == ["--api-key", key], proc.stderr
    with_newline = _sglang(tmp_path, "--host", "10.0.0.5", env={"ROLLWAVE_ENGINE_API_KEY": f"{key}\n"})
    assert json.loads(with_newline.stdout)["argv"][:2] == ["--api-key", key], with_newline.stderr  # as the config's
    dry = _sglang(tmp_path, "--dry-run", env={"ROLLWAVE_ENGINE_API_KEY": key})
    assert dry.returncode == 0 and key not in dry.stdout and "--api-key" in dry.stdout


def test_off_loopback_sglang_needs_a_key(tmp_path: Path) -> None:
    _fake_sglang(tmp_path)
    proc = _sglang(tmp_path, "--host", "0.0.0.0", env={})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --host 0.0.0.0 is not loopback: give SGLang an API key"), proc.stderr
    on_loopback = _sglang(tmp_path, env={})
    assert on_loopback.returncode == 0 and "--api-key" not in json.loads(on_loopback.stdout)["argv"]
    short = _sglang(tmp_path, "--host", "0.0.0.0", env={"ROLLWAVE_ENGINE_API_KEY": "k" * 31})
    assert short.returncode == 2 and short.stdout == ""
    assert short.stderr.startswith("error: ROLLWAVE_ENGINE_API_KEY: the key must be at least 32 characters")
