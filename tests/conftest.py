"""Shared fixtures: the tiny model is built once per session, never downloaded."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.placement import idle_threads_env

# Every process a test starts dumps its threads' Python stacks if it aborts, the scripts that are not a
# component's main too (a trainer rank's rare abort at teardown, "terminate called without an active
# exception", left no other trace).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# The test workers (two on two cores) and the processes they start are unpinned, each with torch's own thread
# count: their idle OpenMP threads sleep at once, as the launcher has an unpinned component's do. With libgomp's
# spin the unit tests took 8 min 35 s against 7 min 39 s (the SFT test 26 s against 10). libgomp reads the
# variable as torch loads, so it is set before any test module imports torch.
assert "torch" not in sys.modules, "torch was imported before tests/conftest.py could set OMP_WAIT_POLICY"
os.environ.update(idle_threads_env([]))


def pytest_itemcollected(item: pytest.Item) -> None:
    """The end-to-end tests (marker slow) make one xdist group: under ``--dist loadgroup`` (``make test``) one worker
    runs them one at a time, never two stacks at once, while the other workers run the rest. They used to run after
    the rest, alone, each leaving a core idle for most of its time (the machine 66% busy over them). Marked as each is
    collected, before pytest-xdist's ``pytest_collection_modifyitems`` reads the groups."""
    if item.get_closest_marker("slow"):
        item.add_marker(pytest.mark.xdist_group("e2e"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end tests first, so that their worker starts on them at once: they take about ten minutes."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt, as in a shell, here and in the processes a test starts: a
    pytest-xdist worker ignores it, and so does a pytest started in the background (``&``), and its children
    inherit that."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session", autouse=True)
def rank_fork_server() -> Iterator[None]:
    """Stops the trainer ranks' fork server (``rank_helpers``) at the end of the session, where a test started it."""
    yield
    if "rank_helpers" in sys.modules:
        sys.modules["rank_helpers"].stop_server()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from core.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's tokenizer, loaded once per session (a test that changes it loads its own, or undoes its
    change with monkeypatch)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server (the embedded one, no AOF) for the tests of one module, each on a run of its own."""
    from buffer.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), aof=False) as server:
        yield server.url


@pytest.fixture
def redis_server(tmp_path: Path):
    """A real redis-server (the embedded one) with AOF fsynced on every write; stopped after the test."""
    from buffer.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "redis", aof=True, appendfsync="always") as server:
        yield server


@pytest.fixture(scope="module")
def ctx() -> Iterator:
    """A one-process CPU ``DistContext`` for a module's trainer tests, on one thread: much faster on a loaded
    2-core machine, and the summation order the CLI runs (OMP_NUM_THREADS=1) also have."""
    import torch

    from trainer.parallel import close_distributed, init_distributed

    assert "RANK" not in os.environ, "RANK is set; these tests need a lone process"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    context = init_distributed("cpu")
    yield context
    close_distributed()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """The embedded engine with the tiny model, 8 requests at a time on one thread, for one module's tests (a module
    that wants another shape defines its own)."""
    from rollout_server.engine.process import EngineProcess  # not at the top: torch loads after the settings above

    with EngineProcess(tiny_model_dir, max_batch_size=8, max_context=1024, threads=1) as engine:
        yield engine.url
