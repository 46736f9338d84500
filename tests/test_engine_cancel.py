"""A waiter that gives up (its HTTP handler cancelled: the client went away, the server shuts down) leaves the
embedded engine serving: what it waited for does not run, and the scheduler thread never sets a cancelled
future (``InvalidStateError`` there ended the thread, and with it every request in flight)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_request
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_server.engine.scheduler import Scheduler

WAIT_S = 60.0


@pytest.fixture
def scheduler(tiny_model_dir: Path) -> Iterator[Scheduler]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = Scheduler(model, AutoTokenizer.from_pretrained(tiny_model_dir), model_path=str(tiny_model_dir))
    engine.start()
    try:
        yield engine
    finally:
        engine.close()


def serves(engine: Scheduler, rid: str) -> None:
    """A new request runs to its end: the scheduler thread is alive and stepping."""
    request = greedy_request(rid, [5, 6, 7], 4)
    engine.submit([request])
    assert request.future.result(timeout=WAIT_S).finish_reason["type"] == "length"
    assert engine.alive


def blocked(engine: Scheduler) -> threading.Event:
    """Hold the scheduler thread in a call until the returned event is set, so what is queued meanwhile waits."""
    release, entered = threading.Event(), threading.Event()
    engine.call(lambda: (entered.set(), release.wait(WAIT_S)))
    assert entered.wait(WAIT_S)
    return release


def test_a_weight_load_whose_waiter_gave_up_does_not_run_nor_end_the_engine(scheduler: Scheduler) -> None:
    running = greedy_request("long", [5, 6, 7, 8], 40)
    scheduler.submit([running])
    loaded = threading.Event()
    load = scheduler.call_when_idle(loaded.set)  # a barrier: it waits for the running request to end
    assert load.cancel()  # the /update_weights_from_disk handler was cancelled meanwhile
    assert running.future.result(timeout=WAIT_S).finish_reason["type"] == "length"
    serves(scheduler, "after")
    assert not loaded.is_set()


def test_a_call_whose_waiter_gave_up_does_not_run(scheduler: Scheduler) -> None:
    release = blocked(scheduler)
    ran = threading.Event()
    call = scheduler.call(ran.set)
    assert call.cancel()
    release.set()
    serves(scheduler, "after")
    assert not ran.is_set()


def test_a_request_whose_handler_was_cancelled_before_it_was_queued_is_not_generated(scheduler: Scheduler) -> None:
    release = blocked(scheduler)
    gone = greedy_request("gone", [5, 6, 7], 40)
    scheduler.submit([gone])
    assert gone.future.cancel()  # /generate cancelled before the scheduler took the request
    release.set()
    serves(scheduler, "after")  # had it been queued, it would be decoding still (40 tokens against 4)
    assert gone.output_ids == [] and scheduler.in_flight() == 0
    serves(scheduler, "gone")  # its rid is free again


def test_a_prefill_ahead_whose_waiter_gave_up_leaves_the_engine_serving(scheduler: Scheduler) -> None:
    release = blocked(scheduler)
    ahead = scheduler.prefill_ahead(None)
    assert ahead.cancel()
    release.set()
    serves(scheduler, "after")
