"""``rollwave rollout``: one arith task group rolled out on the embedded engine and printed readably."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import load_config
from core.tasks import load_tasks
from services.cli import build_parser, main
from services.rollout_cmd import _task


def test_rollout_prints_turns_masks_and_rewards(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["rollout", "--task", "arith", "--n", "2", "--model", str(tiny_model_dir), "rollout.max_new_tokens=8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("── sample ") == 2
    assert "[assistant]" in out and "loss mask (policy tokens plain, others in ⟦ ⟧):" in out
    assert "── sample 0: reward " in out and "finish " in out and "prompt " in out


def test_rollout_names_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout", "--task", "arith", "--model", str(tmp_path / "nope")]) == 2
    assert "--model" in capsys.readouterr().err


def test_run_seed_picks_the_task_the_rollout_command_rolls_out() -> None:
    """``run.seed`` seeds the generated task stream: ``rollwave rollout --task arith`` with run.seed=5 rolls out
    the seed-5 problem, not the default seed's (read before any engine starts)."""
    questions = {}
    for seed in (0, 5):
        args = build_parser().parse_args(["rollout", "--task", "arith", "--index", "2", f"run.seed={seed}"])
        task = _task(args, load_config(args.config, args.overrides, env={}))
        [want] = load_tasks("arith", split="test", limit=1, seed=seed, offset=2)
        assert (task.task_id, task.messages) == (want.task_id, want.messages)
        questions[seed] = task.messages[-1]["content"]
    assert questions[5] != questions[0]
