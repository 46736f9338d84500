"""``rollwave rollout``: run one task group through the agent loop and print it readably.

Starts the embedded engine on a free 127.0.0.1 port (unless ``--engine-url`` names a running one),
rolls out ``--n`` samples of one task, prints every sample's turns, tool calls, loss mask, reward
and finish reason, and stops the engine. It exits 1 when a sample failed (an engine or tool error: no outcome).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from pathlib import Path
from typing import Any

from buffer.schema import Sample, TrajectoryGroup
from core.config import Config, ConfigError, check_engine_url, load_config
from core.model_dir import ensure_model
from core.tasks import Task, load_tasks
from core.trajectory import masked_spans
from rollout_server.tools import ToolRegistry
from services.cli import CliError

_DIM, _GREEN, _RESET = "\033[2m", "\033[32m", "\033[0m"


def _model_dir(cfg: Config, model: str | None) -> Path:
    """``--model`` as given (it must exist), else the config's model, built when missing."""
    if model is None:
        return ensure_model(cfg.model)
    if not Path(model).exists():
        raise ConfigError(f"--model: {model} does not exist")
    return Path(model)


def render_mask(sample: Sample, tokenizer: Any, color: bool) -> str:
    """The completion (everything after the prompt) with policy tokens plain (green on a terminal) and
    tokens the policy did not generate (template, tool output) in ``⟦ ⟧`` (dim on a terminal)."""
    out = []
    for start, end, value in masked_spans(sample.loss_mask[sample.prompt_len :]):
        ids = sample.token_ids[sample.prompt_len + start : sample.prompt_len + end].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if value:
            out.append(f"{_GREEN}{text}{_RESET}" if color else text)
        else:
            out.append(f"{_DIM}⟦{text}⟧{_RESET}" if color else f"⟦{text}⟧")
    return "".join(out)


def _indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line for line in str(text).splitlines() or [""])


def render_group(group: TrajectoryGroup, tokenizer: Any, color: bool = False) -> str:
    """A human-readable dump of a trajectory group."""
    first = group.samples[0]
    question = next((m["content"] for m in first.messages if m.get("role") == "user"), "")
    lines = [f"task {group.task_id}  (n={len(group.samples)}, prompt {first.prompt_len} tokens)"]
    lines.append(_indent(question, "  question: "))
    for s in group.samples:
        versions = sorted({int(v) for v in s.token_versions[s.loss_mask.astype(bool)]})
        lines.append(
            f"\n── sample {s.sample_index}: reward {s.reward:g}  finish {s.finish_reason}  turns {s.num_turns}  "
            f"tokens {s.prompt_len}+{len(s.token_ids) - s.prompt_len} ({s.num_generated} generated)  "
            f"versions {versions}"
        )
        if s.reward_info:
            lines.append(f"   reward_info {s.reward_info}")
        calls = iter(s.tool_calls)
        start = next((i for i, m in enumerate(s.messages) if m["role"] == "assistant"), len(s.messages))
        for m in s.messages[start:]:
            if m["role"] == "assistant":
                lines.append("   [assistant]")
                lines.append(_indent(m["content"]) if m["content"] else "      (no text)")
                for call in m.get("tool_calls", []):
                    fn = call["function"]
                    lines.append(f"      -> {fn['name']}({fn['arguments']})")
            elif m["role"] == "tool":
                rec = next(calls, None)
                status = "" if rec is None else ("ok" if rec.ok else f"error: {rec.error}")
                latency = "" if rec is None else f" {rec.latency_s * 1000:.1f} ms"
                lines.append(f"   [tool {m.get('name', '?')}] {status}{latency}")
                lines.append(_indent(m["content"]))
        lines.append("   loss mask (policy tokens plain, others in ⟦ ⟧):")
        lines.append(_indent(render_mask(s, tokenizer, color)))
    return "\n".join(lines)


async def _rollout(
    args: argparse.Namespace, cfg: Config, task: Task, tools: ToolRegistry, model_dir: Path, url: str,
    api_key: str | None,
) -> TrajectoryGroup:
    from transformers import AutoTokenizer

    from rollout_server.agent_loop import AgentLoop
    from rollout_server.engine_client import EngineClient, EngineError

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    async with EngineClient(url, timeout_s=cfg.engine.request_timeout_s, api_key=api_key) as client:
        try:
            await client.wait_ready(cfg.engine.ready_timeout_s)
        except EngineError as exc:
            raise ConfigError(f"engine.ready_timeout_s: {exc}") from None
        loop = AgentLoop(client, tokenizer, tools, cfg.rollout)
        group = await loop.run_group(task, run=cfg.run.name, job_id="cli", n=args.n)
    print(render_group(group, tokenizer, color=sys.stdout.isatty()))
    return group


def _task(args: argparse.Namespace, cfg: Config) -> Task:
    """The task to roll out, read before anything starts, so a wrong --task, --path or --index fails at once."""
    if args.index < 0:  # named as the user gave it (load_tasks would name its offset)
        raise ConfigError(f"--index must be 0 or more, got {args.index}")
    tasks = load_tasks(args.task, path=args.path, split=args.split, limit=1, seed=cfg.run.seed, offset=args.index,
                       reward=cfg.rollout.reward)
    if not tasks:
        raise ConfigError(f"task source {args.task!r} has no task at index {args.index}")
    return tasks[0]


def _engine_url(args: argparse.Namespace, cfg: Config) -> str | None:
    """``--engine-url`` (checked as ``engine.urls`` are), else the config's first ``engine.urls``, else None (the
    embedded engine)."""
    if not args.engine_url:
        return cfg.engine.urls[0] if cfg.engine.urls else None
    try:
        return check_engine_url(args.engine_url)
    except ValueError as exc:
        raise ConfigError(f"--engine-url: {exc}") from None


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    task = _task(args, cfg)
    url = _engine_url(args, cfg)
    tools = ToolRegistry.from_file(cfg.rollout.tools)
    model_dir = _model_dir(cfg, args.model)
    key = cfg.engine.api_key.get_secret_value() if cfg.engine.api_key is not None else None
    if url is not None:
        group = asyncio.run(_rollout(args, cfg, task, tools, model_dir, url, key))
    else:
        from rollout_server.engine.process import EngineProcess

        print(f"starting the embedded engine on {model_dir}", file=sys.stderr)
        engine = EngineProcess.from_config(model_dir, cfg.engine, key or secrets.token_urlsafe(32), host="127.0.0.1")
        with engine:
            group = asyncio.run(_rollout(args, cfg, task, tools, model_dir, engine.url, engine.api_key))
    failed = [s for s in group.samples if s.failed]
    if failed:  # printed above with their errors; the exit status says so too
        raise CliError(f"{len(failed)} of {len(group.samples)} samples failed; first: "
                       f"{failed[0].reward_info['error']}", 1)
    return 0
