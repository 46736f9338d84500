"""``rollwave engine sglang``: start SGLang with the flags an RL rollout engine needs.

SGLang runs in its own environment (it pins a CUDA torch and its own transformers), so the Python that
runs it is a flag, checked first: it must import sglang. The command keeps SGLang on loopback by default,
sets the starting ``--weight-version`` (every reply carries it; rollwave's versions are integers, 0 by
default, where SGLang's own default is the string ``default``), parses Qwen2.5 tool calls under the
parser name the installed SGLang prefers, and, when the engine shares GPUs with the trainer
(``--colocate``), enables torch_memory_saver so ``/release_memory_occupation`` really frees memory. The
tokenizer stays on (no ``--skip-tokenizer-init``): stop strings such as ``</tool_call>`` and the
``text`` of replies need it.

An API key (``--api-key-file``, or ``ROLLWAVE_ENGINE_API_KEY``) reaches SGLang's ``--api-key`` through the
environment: SGLang reads it from its argv, so a short bootstrap inserts it there inside the interpreter,
and it never shows in the process's command line; nor in SGLang's log, where the bootstrap masks it. Off
loopback a key is required.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

from core.config import MIN_SECRET_CHARS
from core.net import is_loopback
from rollout_server.engine import ENGINE_KEY_ENV

# SGLang 0.5.3.post1 named the Qwen2.5 tool-call parser ``qwen`` and logs ``qwen25`` as deprecated; older
# releases know only ``qwen25``. Every release rollwave supports (>= 0.5.6, pyproject's sglang extra)
# has ``qwen``, so it is the default when the version is unknown.
QWEN_RENAMED_IN = Version("0.5.3.post1")
DEFAULT_TOOL_CALL_PARSER = "qwen"
# ``python -c`` this instead of ``-m sglang.launch_server`` to give SGLang the key from the environment. SGLang
# logs its whole ``ServerArgs`` at start, the key among them: a log record made in its process whose message holds
# the key holds ``REDACTED`` instead (a plain LogRecord still, with its message formatted; SGLang runs in its own
# environment, which need not have rollwave: hence inline).
REDACTED = "<engine api key>"
# SGLang's flags this command sets, each with what to do instead: one among the extra arguments overrode it (SGLang
# takes the last), so a --host there bound SGLang off loopback without the key that --host requires, an --api-key
# showed the key in the command line, and a --weight-version could be one rollwave cannot number
_OWN_FLAGS = {
    "--model-path": "give --model", "--host": "give --host", "--port": "give --port",
    "--weight-version": "give --weight-version", "--tp-size": "give --tp", "--tensor-parallel-size": "give --tp",
    "--mem-fraction-static": "give --mem-fraction", "--enable-memory-saver": "give --colocate",
    "--enable-lora": "give --lora-rank", "--max-lora-rank": "give --lora-rank",
    "--lora-target-modules": "give --lora-target-modules",
    "--api-key": f"give the key in --api-key-file or {ENGINE_KEY_ENV}, never in the command line (every local user "
                 "can read it)",
    "--skip-tokenizer-init": "the tokenizer stays on: stop strings such as </tool_call> need it",
}
LAUNCH_WITH_KEY_FROM_ENV = f"""import logging, os, runpy, sys
key = os.environ.pop({ENGINE_KEY_ENV!r})
sys.argv[1:1] = ['--api-key', key]
make = logging.getLogRecordFactory()
def record(*args, **kwargs):
    r = make(*args, **kwargs)
    try:
        message = r.getMessage()
    except Exception:
        return r
    if key in message:
        r.msg, r.args = message.replace(key, {REDACTED!r}), None
    return r
logging.setLogRecordFactory(record)
runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)
"""


def build_command(
    model: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    weight_version: int = 0,
    tp: int = 1,
    mem_fraction: float | None = None,
    colocate: bool = False,
    python: str = sys.executable,
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
    extra: list[str] | None = None,
    key_from_env: bool = False,
    lora_rank: int | None = None,
    lora_targets: list[str] | None = None,
) -> list[str]:
    """The ``python -m sglang.launch_server ...`` argv; with ``key_from_env`` SGLang's ``--api-key`` is taken
    from ``ROLLWAVE_ENGINE_API_KEY`` when it starts (see ``LAUNCH_WITH_KEY_FROM_ENV``)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if mem_fraction is not None and not 0 < mem_fraction < 1:
        raise ValueError(f"--mem-fraction must be in (0, 1), got {mem_fraction}")
    if lora_targets and lora_rank is None:
        raise ValueError("--lora-target-modules needs --lora-rank (model.lora.rank), which turns SGLang's LoRA on: "
                         "without it the modules would be ignored")
    _check_extra(extra or [])
    cmd = [
        python,
        *(["-c", LAUNCH_WITH_KEY_FROM_ENV] if key_from_env else ["-m", "sglang.launch_server"]),
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--tool-call-parser",
        tool_call_parser,
        "--weight-version",
        str(weight_version),
    ]
    if tp != 1:
        cmd += ["--tp-size", str(tp)]
    if mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction)]
    if colocate:
        cmd += ["--enable-memory-saver"]
    if lora_rank is not None:  # model.lora: the receiver loads each pushed adapter by name
        if lora_rank < 1:
            raise ValueError(f"--lora-rank must be at least 1, got {lora_rank}")
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
        cmd += ["--lora-target-modules", *lora_targets] if lora_targets else []
    return cmd + list(extra or [])


def _check_extra(extra: list[str]) -> None:
    """ValueError for an argument after ``--`` that sets one of SGLang's flags this command sets (``_OWN_FLAGS``),
    naming what to give instead; an abbreviation too (SGLang's argparse takes a unique prefix of a flag)."""
    for arg in extra:
        name = arg.partition("=")[0]  # never the value: it may be a key
        if name.startswith("--") and len(name) > 2:
            own = name if name in _OWN_FLAGS else next((flag for flag in _OWN_FLAGS if flag.startswith(name)), None)
            if own is not None:
                raise ValueError(f"{name} (after --) would override SGLang's {own} as this command sets it; "
                                 f"{_OWN_FLAGS[own]}")


def sglang_version(python: str, timeout_s: float = 120.0) -> str:
    """The version of sglang that ``python`` imports; ValueError saying why not, and to fix ``--python``."""
    fix = "install sglang there, or point --python at the Python of the environment that has it"
    try:
        proc = subprocess.run(
            [python, "-c", "import sglang; print(sglang.__version__)"],
            capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise ValueError(f"--python {python}: no such program ({fix})") from None
    except PermissionError:
        raise ValueError(f"--python {python}: not executable ({fix})") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"--python {python}: importing sglang took over {timeout_s:.0f}s ({fix})") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise ValueError(f"{python} cannot import sglang: {last} ({fix})")
    return (proc.stdout.strip().splitlines() or [""])[-1]  # printed last, after anything the import prints


def tool_call_parser(version: str | None) -> str:
    """SGLang's name for the Qwen2.5 tool-call parser in that release (``None``: not known)."""
    if version is None:
        return DEFAULT_TOOL_CALL_PARSER
    try:
        return "qwen" if Version(version) >= QWEN_RENAMED_IN else "qwen25"
    except InvalidVersion:
        return DEFAULT_TOOL_CALL_PARSER


def api_key(args: argparse.Namespace) -> str | None:
    """The engine's key from ``--api-key-file``, else the environment; ValueError for a non-loopback
    ``--host`` without one (anyone who reaches SGLang could replace its weights)."""
    # stripped, as the config strips it for the rollout servers: a Kubernetes Secret made from a file keeps a newline
    key = (Path(args.api_key_file).read_text() if args.api_key_file else os.environ.get(ENGINE_KEY_ENV, "")).strip()
    if not key and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} is not loopback: give SGLang an API key in {ENGINE_KEY_ENV} or "
                         "--api-key-file (and the rollout servers the same engine.api_key)")
    if key and len(key) < MIN_SECRET_CHARS:
        where = f"--api-key-file {args.api_key_file}" if args.api_key_file else ENGINE_KEY_ENV
        raise ValueError(f"{where}: the key must be at least {MIN_SECRET_CHARS} characters")
    return key or None


def command_from_args(args: argparse.Namespace, parser: str = DEFAULT_TOOL_CALL_PARSER) -> list[str]:
    extra = list(args.extra)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return build_command(
        args.model,
        args.port,
        host=args.host,
        weight_version=args.weight_version,
        tp=args.tp,
        mem_fraction=args.mem_fraction,
        colocate=args.colocate,
        python=args.python,
        tool_call_parser=parser,
        extra=extra,
        key_from_env=api_key(args) is not None,
        lora_rank=args.lora_rank,
        lora_targets=args.lora_target_modules,
    )


def cli_sglang(args: argparse.Namespace) -> int:
    """Replace this process with SGLang (signals and exit code are SGLang's own).

    ``--dry-run`` prints the command even when ``--python`` cannot import sglang (a one-line warning on
    stderr says so, and that the parser name is the default); a real run is then an error (exit 2).
    """
    command_from_args(args)  # flags first: a bad --port is the error to report, not a missing sglang
    try:
        version: str | None = sglang_version(args.python)
    except ValueError as exc:
        if not args.dry_run:
            raise
        print(f"warning: {exc}; --tool-call-parser {DEFAULT_TOOL_CALL_PARSER} assumes sglang >= {QWEN_RENAMED_IN}",
              file=sys.stderr)
        version = None
    cmd = command_from_args(args, tool_call_parser(version))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    key = api_key(args)
    env = {**os.environ, ENGINE_KEY_ENV: key} if key else dict(os.environ)
    os.execvpe(cmd[0], cmd, env)
