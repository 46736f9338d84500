"""The pusher's failure counter stays bounded: server ids (hostname-pid by default, new at every restart) are in the
log and the recorded push result, never in a label."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import pytest
import torch
from net_helpers import refused_port
from pydantic import SecretStr

from buffer.registry import PushRecord
from core.config import CheckpointConfig
from trainer.checkpoint_pusher import CheckpointPusher, Target
from trainer.snapshot import TensorMeta

WAIT_S = 60.0


def test_failures_of_restarted_servers_share_one_series_and_keep_their_ids_in_the_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two incarnations of one rollout server (two hostname-pid ids) that nobody answers for: one series per stage
    and reason counts both failures, while each recorded result and warning names its server."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=0.5, retries=0)
    recorded: dict[str, PushRecord] = {}
    with refused_port() as first, refused_port() as second:
        targets = [Target("rollout-host-101", f"127.0.0.1:{first}"), Target("rollout-host-202", f"127.0.0.1:{second}")]
        pusher = CheckpointPusher(cfg, lambda: targets, record=lambda sid, rec: recorded.__setitem__(sid, rec))
        try:
            with caplog.at_level(logging.WARNING, logger="trainer.checkpoint_pusher"):
                meta = TensorMeta("w", torch.float32, (2,))
                pusher.push([meta], [("w", torch.zeros(2))], version=1).wait(WAIT_S)
        finally:
            pusher.close()
    registry = pusher.metrics.registry
    assert registry.get_sample_value("rollwave_trainer_push_failures_total",
                                     {"stage": "connect", "reason": "unavailable"}) == 2
    families = {m.name: m for m in registry.collect()}
    assert {frozenset(s.labels) for s in families["rollwave_trainer_push_failures"].samples} == {
        frozenset({"stage", "reason"})}
    assert set(recorded) == {"rollout-host-101", "rollout-host-202"}
    assert all((r.ok, r.stage, r.reason) == (False, "connect", "unavailable") for r in recorded.values())
    for target in targets:
        assert f"server {target.server_id} ({target.address}): connect" in caplog.text
