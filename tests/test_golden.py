"""Golden values of one train step: with a fixed model seed and a fixed batch, each objective's loss,
gradient norm and metrics at step 1 must equal ``tests/data/golden_step1.json``, so silent drift in the
losses, advantages, batching or aggregation shows up as a failure.

A deliberate change of the numbers (a fixed bug, a new default) regenerates the file, reviewed in the
diff: ``.venv/bin/python tests/test_golden.py --write`` (see tests/data/README.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import synthetic_groups

from core.config import TrainerConfig
from core.tiny_model import build_tiny_model
from trainer.parallel import DistContext, close_distributed, init_distributed
from trainer.worker import Trainer

GOLDEN = Path(__file__).parent / "data" / "golden_step1.json"
BASE = {"lr": 1e-3, "micro_batch_tokens": 128, "total_steps": 100, "device": "cpu"}
CASES: dict[str, dict[str, Any]] = {
    "decoupled_ppo": {},
    "decoupled_ppo_cap_mask": {"is_cap": 1.2, "is_cap_mode": "mask"},
    "decoupled_ppo_2_minibatches": {"ppo_minibatches": 2, "lr": 0.05, "grad_clip": 100.0},
    "tis": {"loss": "tis", "is_cap": 1.2},
    "icepop": {"loss": "icepop", "is_low": 0.8, "is_high": 1.25},
    "ppo": {"loss": "ppo"},
    "grpo_kl_entropy_seq_mean": {"kl_coef": 0.05, "entropy_coef": 0.01, "loss_agg": "seq-mean-token-mean"},
    "rloo": {"advantage": "rloo"},
    "reinforce_pp": {"advantage": "reinforce_pp"},
}
KEYS = (
    "loss", "pg_loss", "grad_norm", "is_ratio_mean", "is_ratio_max", "clip_fraction", "masked_fraction",
    "logprob_gap", "entropy", "kl", "reward_mean", "reward_std", "samples", "tokens", "loss_tokens",
)


def step_one(model_dir: Path, ctx: DistContext, run_dir: Path) -> dict[str, dict[str, float]]:
    """Every case's step-1 figures on the same batch (3 groups of 4, seed 0), single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order
    out = {}
    try:
        for name, overrides in CASES.items():
            trainer = Trainer(TrainerConfig(**{**BASE, **overrides}), model_dir, run_dir / name).start(ctx=ctx)
            record = trainer.train(synthetic_groups(0, 3))
            trainer.close()
            out[name] = {key: float(record[key]) for key in KEYS}
    finally:
        torch.set_num_threads(threads)
    return out



def test_step_one_matches_the_golden_file(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    want = json.loads(GOLDEN.read_text())
    got = step_one(tiny_model_dir, ctx, tmp_path)
    assert set(got) == set(want), "cases changed: regenerate the golden file (see the module docstring)"
    for case, figures in want.items():
        for key, value in figures.items():
            assert got[case][key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"{case}.{key}"
    assert want["decoupled_ppo"]["clip_fraction"] == 0.0  # one update per step: u = 1, nothing to clip
    assert want["decoupled_ppo_2_minibatches"]["clip_fraction"] > 0.0
    assert want["decoupled_ppo_cap_mask"]["masked_fraction"] > 0.0 and want["decoupled_ppo"]["masked_fraction"] == 0.0
    assert want["grpo_kl_entropy_seq_mean"]["kl"] == 0.0  # the reference is the start model: KL 0 at step 1


def main() -> None:
    parser = argparse.ArgumentParser(description="Print, or with --write store, the golden step-1 figures.")
    parser.add_argument("--write", action="store_true", help=f"overwrite {GOLDEN}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        ctx = init_distributed("cpu")
        try:
            figures = step_one(model_dir, ctx, Path(tmp))
        finally:
            close_distributed()
    text = json.dumps(figures, indent=2, sort_keys=True) + "\n"
    if args.write:
        GOLDEN.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
