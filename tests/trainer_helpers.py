"""Deterministic trajectory groups and process-group helpers shared by the trainer tests."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp
import yaml

from buffer.keys import Keys
from buffer.schema import Sample, TrajectoryGroup
from core.net import free_port_outside_ephemeral


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


def trainer_pool(tmp_path: Path, keys: Keys, redis_url: str, model: Path, groups_per_step: int,
                 **trainer: object) -> list[subprocess.Popen]:
    """Two ranks of ``python -m trainer`` (gloo, one thread each) training the run's groups with ``trainer_config``,
    a checkpoint every step; rank r logs to ``trainer<r>.log``. The caller reaps them (``reaped``)."""
    config = trainer_config(tmp_path, keys, redis_url, model, groups_per_step, total_steps=50, checkpoint_every=1,
                            dist_timeout_s=600, **trainer)
    pool = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port_outside_ephemeral("127.0.0.1")), "OMP_NUM_THREADS": "1",
            "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)}
    ranks = []
    for rank in (0, 1):
        env = {**os.environ, **pool, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env.pop("REDIS_URL", None)
        with open(tmp_path / f"trainer{rank}.log", "wb") as out:
            ranks.append(subprocess.Popen([sys.executable, "-m", "trainer", "-c", str(config)], env=env, stdout=out,
                                          stderr=subprocess.STDOUT))
    return ranks


def join_within(ranks: mp.ProcessContext, bound_s: float, group_timeout_s: float) -> None:
    """Wait for every rank of a spawned pool, but not until its process group's timeout (``group_timeout_s``): a rank
    alive after ``bound_s`` is one left waiting in a collective, and fails the test. Every rank is stopped on the way
    out."""
    deadline = time.monotonic() + bound_s
    try:
        while not ranks.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                left = [r for r, p in enumerate(ranks.processes) if p.is_alive()]
                pytest.fail(f"ranks {left} still running after {bound_s} s (the group's timeout: {group_timeout_s} s)")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
                process.join()


def signal_pool_when(ranks: list[subprocess.Popen], tmp_path: Path, ready: Callable[[], bool], signum: int,
                     bound_s: float, poll_s: float = 0.001) -> tuple[list[int | None], list[str]]:
    """Once ``ready()`` (within 240 s, every rank still running), ``signum`` to every rank of a ``trainer_pool``; their
    exit codes after at most ``bound_s`` (None: still running) and the tails of their logs."""
    logs = [tmp_path / f"trainer{rank}.log" for rank in range(len(ranks))]
    deadline = time.monotonic() + 240
    while not ready():
        assert all(p.poll() is None for p in ranks), [p.returncode for p in ranks]
        assert time.monotonic() < deadline, logs[0].read_text(errors="replace")[-3000:]
        time.sleep(poll_s)
    for proc in ranks:
        proc.send_signal(signum)
    deadline = time.monotonic() + bound_s
    while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p.poll() for p in ranks], [log.read_text(errors="replace")[-3000:] for log in logs]
