"""The ``rollwave`` command: a thin dispatcher; each subcommand's work lives in its own module.

Handlers are imported lazily so ``rollwave --help`` stays fast and needs no torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def _handler(path: str):
    """``module:function`` resolved only when the subcommand runs."""

    def run(args: argparse.Namespace) -> int:
        module, _, func = path.partition(":")
        return getattr(importlib.import_module(module), func)(args) or 0

    return run


def _weight_version(text: str) -> int:
    from rollout_server.agent_loop import parse_version

    try:
        return parse_version(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("-c", "--config", required=required, help="run config YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-5")


def _api_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api", default=os.environ.get("ROLLWAVE_API", "http://127.0.0.1:8000"), help="API base URL")
    p.add_argument("--token", default=os.environ.get("ROLLWAVE_TOKEN"), help="bearer token (env ROLLWAVE_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollwave", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("config", help="inspect run configs")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    c = csub.add_parser("check", help="print the resolved config as YAML, or the error (exit 2)")
    _config_args(c, required=True)
    c.set_defaults(func=_handler("services.config_cmd:check"))

    p = sub.add_parser("model", help="build models")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    m = msub.add_parser("init", help="build the tiny Qwen2 model and its tokenizer, deterministically")
    m.add_argument("--out", required=True, help="output directory")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_handler("core.tiny_model:cli_init"))

    p = sub.add_parser("engine", help="run an inference engine")
    esub = p.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    e = esub.add_parser("sglang", help="exec `python -m sglang.launch_server` with the flags RL rollouts need")
    e.add_argument("--model", required=True, help="HF model directory or hub id (on the GPU host)")
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--weight-version", type=_weight_version, default=0,
                   help="version reported until the first weight update (an integer, default 0)")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    e.add_argument("--mem-fraction", type=float, help="SGLang's --mem-fraction-static")
    e.add_argument("--colocate", action="store_true", help="shares GPUs with the trainer: --enable-memory-saver")
    e.add_argument("--python", default=sys.executable, help="the Python of the environment that has sglang")
    e.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    e.add_argument("extra", nargs=argparse.REMAINDER, help="after --: passed to sglang.launch_server as is")
    e.set_defaults(func=_handler("rollout_server.sglang_launcher:cli_sglang"))

    p = sub.add_parser("rollout", help="roll out one task group and print its turns, tool calls, masks, rewards")
    p.add_argument("--task", required=True, help="task source: arith | gsm8k | jsonl")
    p.add_argument("--path", help="task file or directory (gsm8k, jsonl)")
    p.add_argument("--split", default="test")
    p.add_argument("--index", type=int, default=0, help="which task of the source")
    p.add_argument("--n", type=int, default=4, help="samples in the group")
    p.add_argument("--model", help="HF model directory (default: the config's model.path)")
    p.add_argument("--engine-url", help="use a running engine instead of starting the embedded one")
    _config_args(p)
    p.set_defaults(func=_handler("services.rollout_cmd:run"))

    p = sub.add_parser("up", help="start the service (Redis, rollout servers, trainer, API) as Ray actors")
    p.add_argument("--rollout-servers", type=int, default=1, metavar="R")
    p.add_argument("--trainer-ranks", type=int, default=1, metavar="W")
    p.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops everything")
    _config_args(p, required=True)
    p.set_defaults(func=_handler("services.ray_launcher:up"))

    p = sub.add_parser("down", help="stop everything `rollwave up` started for a run")
    _config_args(p, required=True)
    p.set_defaults(func=_handler("services.ray_launcher:down"))

    p = sub.add_parser("submit", help="submit a rollout job (from flags or a YAML file)")
    p.add_argument("-f", "--file", help="job YAML (the body of POST /v1/jobs)")
    p.add_argument("--kind", choices=["train", "eval"])
    p.add_argument("--source", choices=["arith", "gsm8k", "jsonl"])
    p.add_argument("--path")
    p.add_argument("--split")
    p.add_argument("--limit", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--n", type=int, help="samples per task")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-turns", type=int)
    p.add_argument("--tools", help="comma-separated tool names")
    p.add_argument("--reward", help="gsm8k | tool | module:function")
    p.add_argument("--wait", action="store_true", help="show progress until the job is done")
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:submit"))

    p = sub.add_parser("status", help="cluster status: servers, versions, trainer, buffer")
    p.add_argument("--watch", action="store_true", help="refresh as a live table")
    p.add_argument("--interval", type=float, default=2.0)
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:status"))

    p = sub.add_parser("jobs", help="list jobs with their progress")
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:jobs"))

    p = sub.add_parser("trajectories", help="print a job's trajectories page by page")
    p.add_argument("job")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--all", action="store_true", help="follow every page")
    p.add_argument("--json", action="store_true")
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:trajectories"))

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
