"""The KV of the running requests computed ahead under prepared weights (``Scheduler.prefill_ahead``): the load
that swaps them in puts it in the prefix cache, so the requests its pause retracted prefill only what they
generated since (a request admitted while the KV is computed too), and every token after the swap is exactly
what the new weights give over the whole sequence."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_request, perturbed_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_server.engine.request import Request
from rollout_server.engine.scheduler import Scheduler

WAIT_S = 60.0


@pytest.fixture
def scheduler(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Scheduler]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = Scheduler(model, AutoTokenizer.from_pretrained(tiny_model_dir), model_path=str(tiny_model_dir),
                       prefix_cache_tokens=getattr(request, "param", 16384), prefill_tokens=64)
    engine.start()
    try:
        yield engine
    finally:
        engine.close()


def running(scheduler: Scheduler, prompts: list[list[int]], n: int) -> list[Request]:
    """Requests of ``n`` tokens each, submitted and waited for until every one has decoded a few."""
    reqs = [greedy_request(f"r{i}", p, n) for i, p in enumerate(prompts)]
    scheduler.submit(reqs)
    deadline = time.monotonic() + WAIT_S
    while min(len(r.output_ids) for r in reqs) < 3:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.001)
    return reqs


def on_engine(scheduler: Scheduler, fn: Callable[[], object]) -> object:
    return scheduler.call(fn).result(timeout=WAIT_S)


def assert_continued_from_the_kv_ahead(reqs: list[Request], snapshot: set[tuple[int, ...]], new_dir: Path) -> None:
    """Each request, retracted once, prefilled only what it generated since its KV was computed ahead, and every
    token after the swap is what the new weights give (greedy) over the whole sequence."""
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    for r in reqs:
        ahead = next(t for t in snapshot if list(t) == r.tokens[: len(t)])
        # its re-prefill ran only the rest (all of the computed KV but the last token, if it decoded none since)
        assert r.num_retractions == 1 and len(ahead) - 1 <= r.cached_tokens <= len(ahead)
        start = next(s["start"] for s in r.spans if s["version"] == "1")
        with torch.no_grad():
            logits = new_model(input_ids=torch.tensor([r.tokens])).logits[0]
        lp = torch.log_softmax(logits[len(r.input_ids) - 1 : -1], -1)[start:]
        assert r.output_ids[start:] == lp.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(r.logprobs[start:]), lp.max(-1).values, atol=1e-4, rtol=1e-4)


def swap(scheduler: Scheduler, new_dir: Path) -> None:
    """The receiver's commit: pause (retract), load the prepared version 1, continue."""
    on_engine(scheduler, lambda: scheduler.pause("retract"))
    on_engine(scheduler, lambda: scheduler.load_weights(scheduler.memory.take_prepared("v1"), require_all=True,
                                                        model_path=str(new_dir), version="1"))
    on_engine(scheduler, scheduler.resume)


def test_a_retracted_request_prefills_only_what_it_generated_since_and_continues_on_the_new_weights(
    scheduler: Scheduler, tiny_model_dir: Path, tmp_path: Path
) -> None:
    new_dir = perturbed_model(tiny_model_dir, tmp_path / "v1", seed=1)
    tensors = load_file(new_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (21, 40, 33, 60)]
    reqs = running(scheduler, prompts, n=900)

    prepared = scheduler.memory.prepare("v1", tensors)
    job = scheduler.prefill_ahead(prepared)
    late = greedy_request("late", torch.randint(5, 200, (30,), generator=gen).tolist(), 900)
    scheduler.submit([late])  # admitted after the job took its requests: its last sweep takes this one
    reqs.append(late)
    computed = job.result(timeout=WAIT_S)
    snapshot = {tuple(tokens) for tokens, _ in prepared.ahead}
    # every request running is computed, in chunks of at most prefill_tokens (64) per forward
    assert len(prepared.ahead) == 5 and computed == sum(len(t) for t in snapshot) > sum(map(len, prompts)) + 30
    assert scheduler.metrics.ahead_tokens._value.get() == computed
    swap(scheduler, new_dir)
    for r in reqs:
        r.future.result(timeout=WAIT_S)

    assert_continued_from_the_kv_ahead(reqs, snapshot, new_dir)


def test_a_prompt_the_running_requests_share_is_computed_ahead_once_under_the_new_weights(
    scheduler: Scheduler, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A group's samples share their prompt: computed ahead, it runs once for all of them (as a re-prefill after
    the swap would run it), and under the new weights, never from the old weights' KV the prefix cache holds."""
    new_dir = perturbed_model(tiny_model_dir, tmp_path / "v1", seed=1)
    tensors = load_file(new_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 200, (400,), generator=gen).tolist()  # 3 x 400 saved: over SHARED_PREFIX_MIN_SAVED
    scheduler.prefill_tokens = 4096  # the whole group in one chunk, as at the default 8192
    reqs = running(scheduler, [[*prompt, 5 + i] for i in range(4)], n=600)  # within the model's 1024 positions
    shared = scheduler.metrics.shared_tokens._value.get()
    prepared = scheduler.memory.prepare("v1", tensors)
    computed = scheduler.prefill_ahead(prepared).result(timeout=WAIT_S)
    snapshot = {tuple(tokens) for tokens, _ in prepared.ahead}
    assert len(snapshot) == 4 and computed == sum(map(len, snapshot))
    assert scheduler.metrics.shared_tokens._value.get() - shared >= 3 * len(prompt)
    swap(scheduler, new_dir)
    for r in reqs:
        r.future.result(timeout=WAIT_S)
    assert_continued_from_the_kv_ahead(reqs, snapshot, new_dir)


def test_nothing_is_computed_ahead_when_it_cannot_be_used(scheduler: Scheduler, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    tensors = load_file(perturbed_model(tiny_model_dir, tmp_path / "v1", seed=1) / "model.safetensors")
    assert scheduler.prefill_ahead(scheduler.memory.prepare("idle", tensors)).result(timeout=WAIT_S) == 0
    reqs = running(scheduler, [[5, 6, 7, 8]], n=400)
    prepared = scheduler.memory.prepare("v1", tensors)
    scheduler.memory.prepare("v2", tensors)  # v1 is no longer the set the next load would swap in
    assert scheduler.prefill_ahead(prepared).result(timeout=WAIT_S) == 0 and not prepared.ahead
    on_engine(scheduler, lambda: scheduler.abort(None))
    reqs[0].future.result(timeout=WAIT_S)


@pytest.mark.parametrize("scheduler", [0], indirect=True)
def test_an_engine_without_a_prefix_cache_computes_nothing_ahead(scheduler: Scheduler, tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    tensors = load_file(perturbed_model(tiny_model_dir, tmp_path / "v1", seed=1) / "model.safetensors")
    reqs = running(scheduler, [[5, 6, 7, 8]], n=400)
    assert scheduler.prefill_ahead(scheduler.memory.prepare("v1", tensors)).result(timeout=WAIT_S) == 0
    on_engine(scheduler, lambda: scheduler.abort(None))
    reqs[0].future.result(timeout=WAIT_S)
