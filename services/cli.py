"""The ``rollwave`` command: a thin dispatcher; each subcommand's work lives in its own module.

Handlers are imported lazily so ``rollwave --help`` stays fast and needs no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _handler(path: str):
    """``module:function`` resolved only when the subcommand runs."""

    def run(args: argparse.Namespace) -> int:
        module, _, func = path.partition(":")
        return getattr(importlib.import_module(module), func)(args) or 0

    return run


def _config_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("-c", "--config", required=required, help="run config YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-5")


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
    m.set_defaults(func=_handler("services.tiny_model:cli_init"))

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
