"""Shared fixtures: the tiny model is built once per session, never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture
def redis_server(tmp_path: Path):
    """A real redis-server (the embedded one) with AOF fsynced on every write; stopped after the test."""
    from buffer.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "redis", aof=True, appendfsync="always") as server:
        yield server
