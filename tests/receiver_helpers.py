"""A checkpoint receiver started in front of an engine URL, for tests that stage and commit against it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient


@contextlib.asynccontextmanager
async def started_receiver(cfg: CheckpointConfig, model_dir: Path, url: str, name: str = "rollout-0",
                           **client: Any) -> AsyncIterator[CheckpointReceiver]:
    """A receiver named ``name`` serving ``model_dir`` for the engine at ``url`` (``client``: EngineClient's
    options), stopped on exit."""
    async with EngineClient(url, **client) as engine:
        rec = CheckpointReceiver(cfg, model_dir, engine, url, name)
        await rec.start()
        try:
            yield rec
        finally:
            await rec.stop()
