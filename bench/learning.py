"""Does the off-policy correction work? Three arms from one SFT warm start, side by side in one run.

- ``async``: the demo's setup, ``rollout.mode=async`` with η = ``buffer.max_staleness`` (default 2) and
  decoupled PPO, whose behaviour importance weight corrects the staleness;
- ``sync``: ``rollout.mode=sync`` (η = 0), everything else the same;
- ``sft``: SFT continuation of the warm start on the same demonstrations, scored at each RL arm's wall time
  (one run, saved when it reaches each), so each RL arm is compared with SFT given the same wall time.

The RL arms run the real pipeline as processes (embedded Redis, a rollout server with the embedded
engine, the trainer pushing every step) for the same number of steps, so they train the same number of
groups (steps × groups_per_step). Every arm is scored the same way: a greedy eval job on the same
held-out ``arith`` problems, served by a fresh rollout server with the arm's final weights; its gain is
that accuracy minus the warm start's. The arms run one after another in this process tree, for each seed.

Last two lines: ``rl_gain_minus_sft <RL gain - SFT gain at the same wall time>`` (mean over both RL arms and
the seeds) and ``async_gain_minus_sync ratio <async gain - sync gain>`` (mean over the seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, before bench/ (bench/buffer.py)

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.task_queue import TaskQueue
from core.config import Config, dump_config, load_config
from core.jobs import JobSpec, TaskSource
from core.tasks import load_tasks
from core.tiny_model import build_tiny_model
from services.launcher import LocalStack, components, ensure_checkpoint_token
from trainer.checkpoint import Checkpointer, export_hf
from trainer.sft import warm_start

ROOT = Path(__file__).resolve().parents[1]
EVAL_SEED = 3
SFT_TASKS = {"split": "train", "limit": 4000, "seed": 1}  # the demo's warm-start demonstrations


def _config(root: Path, name: str, model: Path, overrides: list[str]) -> tuple[Config, Path]:
    cfg = load_config(ROOT / "configs/demo.yaml", [
        f"run.name={name}", f"run.dir={root}", f"model.path={model}", "model.init_if_missing=false",
        "trainer.checkpoint_every=100000", *overrides,
    ])
    ensure_checkpoint_token(cfg)
    cfg.run.path.mkdir(parents=True)
    path = cfg.run.path / "config.yaml"
    path.write_text(dump_config(cfg))
    return cfg, path


def _wait(what: str, cond: Any, stack: LocalStack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done in {timeout_s:.0f} s (logs in {stack.log_dir})")
        time.sleep(0.5)


def evaluate(model: Path, root: Path, name: str, n_tasks: int, timeout_s: float) -> float:
    """Greedy held-out accuracy of ``model``: an eval job on a rollout server of its own."""
    cfg, path = _config(root, name, model, [])
    spec = JobSpec(kind="eval", source=TaskSource(kind="arith", split="test", limit=n_tasks, seed=EVAL_SEED))
    with EmbeddedRedis(cfg.run.path / "redis", aof=False) as server:
        client, keys = redis.Redis.from_url(server.url), Keys(cfg.run.name)
        queue = TaskQueue(client, keys, cfg.buffer)
        queue.ensure_groups()
        specs = components(cfg, path, server.url, trainer_ranks=0, api=False)
        with LocalStack(specs, cfg.run.path / "logs") as stack:
            queue.submit("eval", [t.model_dump() for t in spec.source.load()], "eval", spec.model_dump_json())
            _wait(f"eval of {model}", lambda: queue.job("eval")["state"] == "done", stack, timeout_s)
        job = queue.job("eval")
    return float(job["reward_sum"]) / int(job["samples"])


def train_rl(mode: str, model: Path, root: Path, seed: int, steps: int, overrides: list[str],
             timeout_s: float) -> dict[str, Any]:
    """One RL arm: the pipeline until the trainer has done ``steps`` steps; its final weights as an HF model."""
    cfg, path = _config(root, f"{mode}-{seed}", model, [
        f"rollout.mode={mode}", f"trainer.total_steps={steps}", f"run.seed={seed}", *overrides,
    ])
    spec = JobSpec(source=TaskSource(kind="arith", split="train", limit=steps * cfg.buffer.groups_per_step * 3,
                                     seed=100 + seed))
    with EmbeddedRedis(cfg.run.path / "redis", aof=False) as server:
        client, keys = redis.Redis.from_url(server.url), Keys(cfg.run.name)
        queue = TaskQueue(client, keys, cfg.buffer)
        queue.ensure_groups()
        specs = components(cfg, path, server.url, api=False, trainer_args=())
        with LocalStack(specs, cfg.run.path / "logs") as stack:
            registry = ServerRegistry(client, keys)
            _wait("a rollout server", registry.live_servers, stack, 300)
            started = time.monotonic()
            queue.submit("rl", [t.model_dump() for t in spec.source.load()], "train", spec.model_dump_json())
            _wait(f"{mode} RL", lambda: stack.finished("trainer-0"), stack, timeout_s)
            wall = time.monotonic() - started
    records = [json.loads(x) for x in (cfg.run.path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    final = export_hf(Checkpointer(cfg.run.path / "checkpoints", 1).latest(), model, cfg.run.path / "final")
    lags = [(int(lag), n) for r in records for lag, n in r["staleness_hist"].items()]
    return {
        "model": final,
        "wall_s": wall,
        "groups": sum(r["groups"] for r in records),
        "staleness_mean": sum(lag * n for lag, n in lags) / max(1, sum(n for _, n in lags)),
        "is_ratio_mean": statistics.fmean(r["is_ratio_mean"] for r in records),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="trainer steps of each RL arm")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=700, help="the shared warm start")
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--timeout-min", type=float, default=30.0, help="per RL arm")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="for both RL arms, e.g. buffer.max_staleness=4")
    args = p.parse_args()
    timeout_s = args.timeout_min * 60
    sft_tasks = load_tasks("arith", **SFT_TASKS)
    with tempfile.TemporaryDirectory(prefix="rollwave-learning-") as tmp:
        root = Path(tmp)
        start = warm_start(build_tiny_model(root / "base"), root / "sft", sft_tasks, steps=args.sft_steps)
        before = evaluate(start, root, "eval-start", args.eval_tasks, timeout_s)
        print(f"warm start: held-out accuracy {before:.3f} ({args.eval_tasks} problems)", flush=True)
        gains: dict[str, list[float]] = {"async": [], "sync": [], "sft-async": [], "sft-sync": []}
        for seed in range(args.seeds):
            arms = {mode: train_rl(mode, start, root, seed, args.steps, args.overrides, timeout_s)
                    for mode in ("async", "sync")}
            walls = [arm["wall_s"] for arm in arms.values()]
            sft_run = warm_start(start, root / f"sft-{seed}", sft_tasks, steps=10**9, seed=100 + seed,
                                 max_seconds=max(walls), save_at_seconds=walls)
            for i, (mode, arm) in enumerate(list(arms.items())):
                arms[f"sft-{mode}"] = {"model": sft_run / f"at-{i}", "wall_s": arm["wall_s"]}
            for mode, arm in arms.items():
                gain = evaluate(arm["model"], root, f"eval-{mode}-{seed}", args.eval_tasks, timeout_s) - before
                gains[mode].append(gain)
                extra = (f"groups {arm['groups']}  staleness {arm['staleness_mean']:.2f}  "
                         f"is_ratio {arm['is_ratio_mean']:.3f}" if "groups" in arm
                         else (arm["model"] / "sft.txt").read_text().split()[0])
                print(f"seed {seed} {mode:>9}: held-out gain {gain:+.3f}  wall {arm['wall_s']:.0f} s  {extra}",
                      flush=True)
    for mode, values in gains.items():
        print(f"{mode:>9}: mean held-out gain {statistics.fmean(values):+.3f}  "
              f"({', '.join(f'{v:+.3f}' for v in values)})")
    mean = {mode: statistics.fmean(values) for mode, values in gains.items()}
    print(f"rl_gain_minus_sft {statistics.fmean(mean[m] - mean[f'sft-{m}'] for m in ('async', 'sync')):.3f}")
    print(f"async_gain_minus_sync ratio {mean['async'] - mean['sync']:.3f}")


if __name__ == "__main__":
    main()
