"""``rollwave rollout``: one arith task group rolled out on the embedded engine and printed readably."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from http_harness import serve_app
from net_helpers import refused_port

from core.config import load_config
from core.tasks import load_tasks
from services.cli import build_parser, main
from services.rollout_cmd import _task


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


def test_run_seed_picks_the_task_the_rollout_command_rolls_out() -> None:
    """``run.seed`` seeds the generated task stream: ``rollwave rollout --task arith`` with run.seed=5 rolls out
    the seed-5 problem, not the default seed's (read before any engine starts)."""
    questions = {}
    for seed in (0, 5):
        args = build_parser().parse_args(["rollout", "--task", "arith", "--index", "2", f"run.seed={seed}"])
        task = _task(args, load_config(args.config, args.overrides, env={}))
        [want] = load_tasks("arith", split="test", limit=1, seed=seed, offset=2)
        assert (task.task_id, task.messages) == (want.task_id, want.messages)
        questions[seed] = task.messages[-1]["content"]
    assert questions[5] != questions[0]


def test_rollout_waits_for_an_engine_only_engine_ready_timeout_s(tiny_model_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An engine URL nothing answers on fails after ``engine.ready_timeout_s``, naming the key and the URL,
    not after the default hour."""
    with refused_port() as port:
        start = time.monotonic()
        code = main(["rollout", "--task", "arith", "--model", str(tiny_model_dir), "--engine-url",
                     f"http://127.0.0.1:{port}", "engine.ready_timeout_s=1"])
    assert code == 2 and time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert f"engine.ready_timeout_s: http://127.0.0.1:{port}/health: not healthy after 1s" in err


def test_an_engine_call_without_an_answer_fails_after_engine_request_timeout_s(
        tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A healthy engine whose ``/generate`` never answers: each sample fails after ``engine.request_timeout_s``
    with an error naming the engine and the call."""
    released = threading.Event()
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(None)

    @app.post("/generate")
    async def generate() -> dict:
        while not released.is_set():  # hangs until the test ends
            await asyncio.sleep(0.05)
        return {}

    with serve_app(app) as url:
        try:
            start = time.monotonic()
            code = main(["rollout", "--task", "arith", "--n", "2", "--model", str(tiny_model_dir), "--engine-url",
                         url, "engine.request_timeout_s=0.5"])
            elapsed = time.monotonic() - start
        finally:
            released.set()
    assert code == 1 and elapsed < 30
    out = capsys.readouterr()
    error = f"/generate: {url}: no answer within 0.5 s"
    assert out.out.count(f"reward_info {{'error': 'engine: EngineError: {error}'}}") == 2
    assert out.err.strip() == f"error: 2 of 2 samples failed; first: engine: EngineError: {error}"
