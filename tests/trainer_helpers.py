"""Deterministic trajectory groups and process-group helpers shared by the trainer tests."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml

from buffer.keys import Keys
from buffer.schema import Sample, TrajectoryGroup


def synthetic_groups(
    seed: int, n_groups: int, group_size: int = 4, vocab: int = 600, version: int = 0, run: str = "test"
) -> list[TrajectoryGroup]:
    """Random prompts and completions (ids in [3, vocab)), a tool-output span masked out of the loss,
    behaviour logprobs near a tiny random model's (≈ -log vocab) and binary rewards."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt_len = int(rng.integers(4, 10))
        prompt = rng.integers(3, vocab, prompt_len)
        samples = []
        for i in range(group_size):
            first, tool, second = (int(x) for x in rng.integers(2, 12, 3))
            ids = np.concatenate([prompt, rng.integers(3, vocab, first + tool + second)])
            mask = np.r_[np.zeros(prompt_len), np.ones(first), np.zeros(tool), np.ones(second)]
            behav = np.where(mask > 0, -np.log(vocab) + rng.normal(0, 0.3, ids.size), 0.0)
            samples.append(
                Sample(
                    sample_index=i,
                    token_ids=ids,
                    prompt_len=prompt_len,
                    loss_mask=mask,
                    behaviour_logprobs=behav,
                    token_versions=np.where(mask > 0, version, -1),
                    reward=float(rng.integers(0, 2)),
                )
            )
        groups.append(TrajectoryGroup(run=run, job_id="job", task_id=f"s{seed}-g{g}", samples=samples))
    return groups


@contextlib.contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc`` (a ``python -m trainer`` a test started), killed and reaped if the test leaves before it ended."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def trainer_config(tmp_path: Path, keys: Keys, redis_url: str, model: Path, groups_per_step: int,
                   **trainer: object) -> Path:
    """A run config for ``python -m trainer`` on the CPU with the tiny model, run directory under ``tmp_path``."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": keys.run, "dir": str(tmp_path)},
        "model": {"path": str(model), "init_if_missing": False},
        "redis": {"url": redis_url},
        "buffer": {"groups_per_step": groups_per_step},
        "trainer": {"micro_batch_tokens": 128, "take_timeout_s": 0.5, "device": "cpu", **trainer},
    }))
    return config
