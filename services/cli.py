"""The ``rollwave`` command, and the one place that turns a failure into a line a person can act on.

Every failure is one ``error:`` line on stderr that says what is wrong and what to do, with exit code 2
for a mistake in the input (a flag, a file, a config key) and 1 when something failed at run time;
``--debug`` (or ``ROLLWAVE_DEBUG=1``) prints the traceback as well. Handlers raise (``CliError`` for
their own wording, or the usual exceptions, which ``_explain`` words); none prints its own error.
Handlers are imported lazily, so ``rollwave --help`` stays fast and needs no torch.
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

DEFAULT_API = "http://127.0.0.1:8000"
DESCRIPTION = """\
rollwave trains LLM agents with reinforcement learning, fully asynchronously: rollout servers run
tool-using conversations on an inference engine while the trainer learns from the finished ones and
pushes new weights back; a REST API takes jobs and reports progress.

Errors are one line on stderr; exit code 2 means fix the input, 1 means something failed at run time."""
_PATH_HINTS = {  # errors that mean the user gave a bad path (exit 2), and what to do about it
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path",
    errno.EISDIR: "give a file, not a directory",
    errno.EEXIST: "remove it or pick another path",
    errno.EACCES: "check its permissions or pick another path",
    errno.EPERM: "check its permissions or pick another path",
    errno.EROFS: "pick a writable path",
}


class CliError(Exception):
    """A problem the user can fix, worded as what is wrong and what to do; exit 2 (input) or 1 (runtime)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2) and examples laid out as written."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _handler(path: str, env: Callable[[], dict[str, str]] = dict):
    """``module:function`` resolved only when the subcommand runs, with ``env()`` set before the import."""

    def run(args: argparse.Namespace) -> int:
        os.environ.update(env())
        module, _, func = path.partition(":")
        return getattr(importlib.import_module(module), func)(args) or 0

    return run


# On Linux Ray replaces a node address of 127.0.0.1 by the host's routable one (``resolve_ip_for_localhost``): the
# head `up` starts, its workers and the driver then listened beyond loopback, and `up` refused to run without an API
# token. Ray's switch for one-machine clusters (meant for Windows and macOS) keeps them all on loopback.
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _local_ray_env() -> dict[str, str]:
    """The head `up` starts without RAY_ADDRESS requires a token and stays on loopback; Ray reads both settings when
    it is imported, so they are set before (the token's file, made with the head, is named when connecting)."""
    return {} if os.environ.get("RAY_ADDRESS") else {"RAY_AUTH_MODE": "token", **LOOPBACK_RAY_ENV}


def _weight_version(text: str) -> int:
    from rollout_server.agent_loop import parse_version

    try:
        return parse_version(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def failed_request(exc: BaseException) -> str:
    """The call an httpx error came from (``GET http://host/v1/status``), or "a request" when it carries none: a
    timeout's own text is only "timed out"."""
    try:
        request = exc.request  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # not an httpx error, or one raised outside a request
        return "a request"
    return f"{request.method} {request.url}"


def _explain(exc: BaseException, args: argparse.Namespace) -> tuple[str, int]:
    """What went wrong and what to do (one line), and the exit code, for an exception a handler raised."""
    import httpx

    if isinstance(exc, CliError):
        return str(exc), exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    api = getattr(args, "api", None)
    if isinstance(exc, httpx.ConnectError) and api is not None:
        return f"cannot reach the API at {api}: {exc} (is it running? start it with rollwave up, " \
               "or set --api / ROLLWAVE_API)", 1
    if isinstance(exc, httpx.TimeoutException) and api is not None:
        return f"the API at {api} did not answer {failed_request(exc)} in time ({type(exc).__name__}); is it " \
               "stuck? see runs/<run>/logs", 1
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL) and api is not None:
        return f"--api {api}: {exc} (e.g. --api {DEFAULT_API})", 2
    if isinstance(exc, httpx.TransportError) and api is not None:  # a reset, a close, a reply that is no HTTP
        return f"the API at {api} broke off {failed_request(exc)}: {exc} ({type(exc).__name__}); is --api the " \
               "rollwave API? see runs/<run>/logs", 1
    if isinstance(exc, OSError) and exc.filename is not None:
        hint = _PATH_HINTS.get(exc.errno or 0)
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else exc.filename
        return f"{where}: {exc.strerror}" + (f" ({hint})" if hint else ""), 2 if hint else 1
    if isinstance(exc, FileNotFoundError | PermissionError | ValueError):  # input errors (ConfigError included)
        return str(exc) or type(exc).__name__, 2
    return f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1


def _one_line(message: str) -> str:
    """A multi-line message (a config's list of bad keys) as one line: ``a:\n  b\n  c`` -> ``a: b; c``."""
    out = ""
    for line in filter(None, (part.strip() for part in message.splitlines())):
        out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def _number(convert: Callable[[str], Any], above_zero: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``convert``'s value, refused (named by argparse, exit 2) unless it is finite (``float`` reads
    "nan", which no comparison passes and JSON cannot carry, and "inf", which ``time.sleep`` refuses) and, with
    ``above_zero``, above 0. It keeps ``convert``'s name, which argparse's error for a value that is no number names
    ("invalid int value")."""
    @functools.wraps(convert)
    def parse(text: str) -> Any:
        value = convert(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number{' above 0' if above_zero else ''}, got {text}")
        if above_zero and value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse


def _config_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("-c", "--config", required=required, help="run config YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-5")


def _api_args(p: argparse.ArgumentParser, parent_has_them: bool = False) -> None:
    """``--api`` and ``--token-file``; in an action of a command that has them too (``parent_has_them``) with no
    default of their own, which would override the command's (``rollwave jobs --api URL delete JOB``)."""
    api_default = argparse.SUPPRESS if parent_has_them else os.environ.get("ROLLWAVE_API", DEFAULT_API)
    p.add_argument("--api", default=api_default, help="API base URL (env ROLLWAVE_API)")
    p.add_argument("--token-file", default=argparse.SUPPRESS if parent_has_them else None,
                   help="file holding the API's bearer token (default: env ROLLWAVE_API_TOKEN)")


def _command(sub, name: str, summary: str, example: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose help says what it does for the user and shows one example."""
    p = sub.add_parser(name, help=summary, description=description or summary[0].upper() + summary[1:] + ".",
                       epilog=f"example:\n  {example}")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="on error, show the traceback")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rollwave",
        description=DESCRIPTION,
        epilog="examples:\n"
        "  rollwave up -c configs/demo.yaml                  # start the service\n"
        "  rollwave submit --source arith --limit 64 --wait  # give it work and watch it\n"
        "  rollwave status --watch                           # servers, versions, trainer, buffer\n"
        "  rollwave down -c configs/demo.yaml\n\n"
        "`rollwave COMMAND --help` explains each command.",
    )
    parser.add_argument("--debug", action="store_true", help="on error, show the traceback (env ROLLWAVE_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(sub, "config", "check run config files", "rollwave config check -c configs/demo.yaml")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    c = _command(csub, "check", "print the resolved run config as YAML, or the error naming the key (exit 2)",
                 "rollwave config check -c configs/demo.yaml trainer.lr=1e-5")
    _config_args(c, required=True)
    c.set_defaults(func=_handler("services.config_cmd:check"))

    p = _command(sub, "model", "build the tiny model that tests and the demo train",
                 "rollwave model init --out runs/model")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    m = _command(msub, "init", "build the tiny Qwen2 model and its tokenizer, byte-identical for a seed",
                 "rollwave model init --out runs/model --seed 0")
    m.add_argument("--out", required=True, help="output directory")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_handler("core.tiny_model:cli_init"))

    p = _command(sub, "engine", "start an inference engine for the rollout servers",
                 "rollwave engine sglang --model Qwen/Qwen2.5-1.5B-Instruct --port 30000")
    esub = p.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    e = _command(
        esub, "sglang", "start an SGLang server with the flags RL rollouts need",
        "rollwave engine sglang --python /opt/sglang/bin/python --model Qwen/Qwen2.5-7B-Instruct --port 30000",
        description="Start an SGLang server with the flags RL rollouts need: loopback by default (off loopback an\n"
        "API key, handed over in the environment), a starting weight version, the Qwen tool-call parser the\n"
        "installed SGLang prefers, and --enable-memory-saver when it shares GPUs with the trainer. It first\n"
        "checks that --python can import sglang.",
    )
    e.add_argument("--model", required=True, help="HF model directory or hub id (on the GPU host)")
    e.add_argument("--port", type=int, required=True, help="port to serve on (1..65535)")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--weight-version", type=_weight_version, default=0,
                   help="version reported until the first weight update (an integer, default 0)")
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    e.add_argument("--mem-fraction", type=float, help="SGLang's --mem-fraction-static")
    e.add_argument("--colocate", action="store_true", help="shares GPUs with the trainer: --enable-memory-saver")
    e.add_argument("--python", default=sys.executable, help="the Python of the environment that has sglang")
    e.add_argument("--lora-rank", type=int, help="model.lora.rank of the run: --enable-lora --max-lora-rank R, so "
                   "the rollout server can load each pushed adapter")
    e.add_argument("--lora-target-modules", nargs="+", metavar="NAME", help="with --lora-rank: model.lora."
                   "target_modules (SGLang's --lora-target-modules)")
    e.add_argument("--api-key-file", help="file holding SGLang's --api-key (default: env ROLLWAVE_ENGINE_API_KEY); "
                   "needed off loopback")
    e.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    e.add_argument("extra", nargs=argparse.REMAINDER, help="after --: passed to sglang.launch_server as is")
    e.set_defaults(func=_handler("rollout_server.sglang_launcher:cli_sglang"))

    p = _command(
        sub, "rollout", "roll out one task group and print its turns, tool calls, loss masks and rewards",
        "rollwave rollout --task arith --n 2",
        description="Roll out one task group on the embedded engine (or --engine-url) and print every sample's\n"
        "turns, tool calls, loss mask and reward: a quick look at what the trainer will learn from.",
    )
    p.add_argument("--task", required=True, help="task source: arith | gsm8k | jsonl")
    p.add_argument("--path", help="task file or directory (gsm8k, jsonl)")
    p.add_argument("--split", default="test")
    p.add_argument("--index", type=int, default=0, help="which task of the source")
    p.add_argument("--n", type=_number(int, above_zero=True), default=4, help="samples in the group")
    p.add_argument("--model", help="HF model directory (default: the config's model.path)")
    p.add_argument("--engine-url", help="use a running engine instead of starting the embedded one")
    _config_args(p)
    p.set_defaults(func=_handler("services.rollout_cmd:run"))

    p = _command(sub, "up", "start the service (Redis, rollout servers, trainer, API) as Ray actors",
                 "rollwave up -c configs/demo.yaml --rollout-servers 2")
    p.add_argument("--rollout-servers", type=_number(int, above_zero=True), default=1, metavar="R",
                   help="rollout servers, each with its engine (default 1)")
    p.add_argument("--trainer-ranks", type=_number(int, above_zero=True), default=1, metavar="W",
                   help="trainer ranks, on one node (default 1)")
    p.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops everything")
    _config_args(p, required=True)
    p.set_defaults(func=_handler("services.ray_launcher:up", _local_ray_env))

    p = _command(sub, "down", "stop everything `rollwave up` started for a run", "rollwave down -c configs/demo.yaml")
    _config_args(p, required=True)
    p.set_defaults(func=_handler("services.ray_launcher:down", _local_ray_env))

    p = _command(sub, "submit", "give the service a training or evaluation job (from flags or a YAML file)",
                 "rollwave submit --kind eval --source arith --split test --limit 100 --wait")
    p.add_argument("-f", "--file", help="job YAML (the body of POST /v1/jobs)")
    p.add_argument("--kind", choices=["train", "eval"])
    p.add_argument("--source", choices=["arith", "gsm8k", "jsonl"])
    p.add_argument("--path", help="task file or directory, relative to the API's api.data_root (gsm8k, jsonl)")
    p.add_argument("--split")
    p.add_argument("--limit", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--n", type=int, help="samples per task")
    p.add_argument("--temperature", type=_number(float))
    p.add_argument("--max-turns", type=int)
    p.add_argument("--tools", type=lambda names: names.split(","), help="comma-separated tool names")
    p.add_argument("--reward", help="a built-in (gsm8k, tool, tool_last) or a rollout.reward_allowlist name")
    p.add_argument("--wait", action="store_true", help="show progress until the job is done (exit 1 at once if "
                   "it is stalled: the trainer finished with groups of it left; after a trainer crash, once no "
                   "restart took it up within 300 s; exit 1 too once it is cancelled or deleted meanwhile)")
    p.add_argument("--timeout", type=_number(float, above_zero=True), metavar="S", help="with --wait: fail (exit 1) "
                   "if the job is not done after S seconds (default: wait as long as it runs)")
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:submit"))

    p = _command(sub, "status", "show the service: rollout servers, policy versions, trainer step, buffer depths",
                 "rollwave status --watch")
    p.add_argument("--watch", action="store_true", help="refresh as a live table")
    p.add_argument("--interval", type=_number(float, above_zero=True), default=2.0,
                   help="with --watch: seconds between refreshes")
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:status"))

    p = _command(sub, "jobs", "list jobs with their progress, reward and accuracy; `jobs cancel JOB` cancels one, "
                 "`jobs delete JOB` deletes one",
                 "rollwave jobs --api http://head:8000")
    p.add_argument("--limit", type=int, default=50, help="jobs per page, newest first")
    p.add_argument("--all", action="store_true", help="follow every page")
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:jobs"))
    jsub = p.add_subparsers(dest="jobs_command", metavar="ACTION")
    for action, summary, description in (
        ("cancel", "cancel a running job: what is left of it is acked away untrained",
         "Cancel a running (or stalled) job: the rollout servers ack its tasks not rolled out yet\n"
         "away, the trainer its groups not trained yet; a job that is done is refused (409). Then\n"
         "`rollwave jobs delete JOB` deletes it. A lost reply or a 503 is sent again, as a submit is."),
        ("delete", "delete a finished or cancelled job and all the run keeps of it",
         "Delete a finished or cancelled job and all the run keeps of it: its trajectories, its\n"
         "eval results, its dead letters, its submit's idempotency key, and a cancelled job's tasks and\n"
         "groups still queued. A job is finished once every task of it is rolled out (and, for a train job,\n"
         "every group trained or dropped); the API refuses (409) one that is neither, saying why: cancel it\n"
         "first (`rollwave jobs cancel JOB`). A lost reply or a 503 is sent again, as a submit is."),
    ):
        j = _command(jsub, action, summary, f"rollwave jobs {action} 3f2a9c1b7d4e", description=description)
        j.add_argument("job", help="job id, as `rollwave submit` or `rollwave jobs` print it")
        _api_args(j, parent_has_them=True)
        j.set_defaults(func=_handler(f"services.client_cmd:{action}_job"))

    p = _command(sub, "trajectories", "print a job's trajectories (conversations and rewards) page by page",
                 "rollwave trajectories 3f2a9c1b7d4e --all --json")
    p.add_argument("job", help="job id, as `rollwave submit` or `rollwave jobs` print it")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--all", action="store_true", help="follow every page")
    p.add_argument("--json", action="store_true")
    _api_args(p)
    p.set_defaults(func=_handler("services.client_cmd:trajectories"))

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from core.config import refuse_secret_overrides  # (imported here: --help stays quick)

        refuse_secret_overrides(getattr(args, "overrides", None) or [])  # before any command reads its config
        return args.func(args)
    except (Exception, KeyboardInterrupt) as exc:  # every failure ends as one line; --debug adds the traceback
        message, code = _explain(exc, args)
        if args.debug or os.environ.get("ROLLWAVE_DEBUG", "") not in ("", "0"):
            traceback.print_exception(exc)
    print(f"error: {_one_line(message)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    # Run as python -m, this file is __main__, and its CliError not the class the handlers import and raise
    # (services.cli.CliError), so each would end as exit 1: run the imported module's main instead.
    from services.cli import main as installed_main

    sys.exit(installed_main())
