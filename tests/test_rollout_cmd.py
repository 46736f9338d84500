"""``rollwave rollout``: one arith task group rolled out on the embedded engine and printed readably."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main


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
