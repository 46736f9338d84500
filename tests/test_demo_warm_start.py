"""The demo's ``--warm-start``: RL starts from a given SFT warm start, and a directory without a model is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import load_config
from services.demo import _parser, policy


def test_warm_start_dir_is_the_policy_and_no_sft_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    args = _parser().parse_args(["--warm-start", str(tiny_model_dir), "trainer.total_steps=3"])
    cfg = load_config(args.config, args.overrides)
    assert policy(cfg, tmp_path, args.sft_steps, args.warm_start) == tiny_model_dir.absolute()
    assert list(tmp_path.iterdir()) == []  # no base model built, no SFT written


def test_warm_start_without_a_model_is_refused(tmp_path: Path) -> None:
    cfg = load_config(_parser().parse_args([]).config, [])
    with pytest.raises(SystemExit, match=r"--warm-start .*: no HF model there"):
        policy(cfg, tmp_path, 700, tmp_path)
