"""``rollwave engine sglang``: start SGLang with the flags an RL rollout engine needs.

SGLang runs in its own environment (it pins a CUDA torch and its own transformers), so the Python that
runs it is a flag. The command keeps SGLang on loopback by default, sets the starting
``--weight-version`` (every reply carries it; rollwave's versions are integers, 0 by default, where SGLang's
own default is the string ``default``), parses Qwen2.5 tool calls, and, when the engine shares
GPUs with the trainer (``--colocate``), enables torch_memory_saver so ``/release_memory_occupation``
really frees memory. The tokenizer stays on (no ``--skip-tokenizer-init``): stop strings such as
``</tool_call>`` and the ``text`` of replies need it.
"""

from __future__ import annotations

import argparse
import os
import sys


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
    extra: list[str] | None = None,
) -> list[str]:
    """The ``python -m sglang.launch_server ...`` argv."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if mem_fraction is not None and not 0 < mem_fraction < 1:
        raise ValueError(f"--mem-fraction must be in (0, 1), got {mem_fraction}")
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--tool-call-parser",
        "qwen25",
        "--weight-version",
        str(weight_version),
    ]
    if tp != 1:
        cmd += ["--tp-size", str(tp)]
    if mem_fraction is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction)]
    if colocate:
        cmd += ["--enable-memory-saver"]
    return cmd + list(extra or [])


def command_from_args(args: argparse.Namespace) -> list[str]:
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
        extra=extra,
    )


def cli_sglang(args: argparse.Namespace) -> int:
    """Replace this process with SGLang (signals and exit code are SGLang's own)."""
    cmd = command_from_args(args)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    os.execvp(cmd[0], cmd)
