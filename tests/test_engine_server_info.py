"""The embedded engine's SGLang info routes over real HTTP with the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollout_server.engine.process import EngineProcess


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir, max_batch_size=4, max_context=256, threads=1) as proc:
        yield proc.url


def test_server_info_answers_on_both_of_sglangs_paths(engine: str, tiny_model_dir: Path) -> None:
    """``/get_server_info`` (SGLang's deprecated alias) and ``/server_info`` answer the server's arguments under
    SGLang's names: the model, the context length and the batch size it was started with."""
    for path in ("/get_server_info", "/server_info"):
        resp = httpx.get(engine + path, timeout=30)
        assert resp.status_code == 200, (path, resp.text)
        info = resp.json()
        assert info["model_path"] == str(tiny_model_dir)
        assert (info["context_length"], info["max_running_requests"]) == (256, 4)
        assert info["weight_version"] == "0" and len(info["internal_states"]) == 1
