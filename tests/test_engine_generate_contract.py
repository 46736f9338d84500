"""``/generate`` of the embedded engine against SGLang's contract, in process with the tiny model: a field SGLang
would honour is honoured or refused (400 naming it, counted), never silently ignored, and replies carry the keys
RL clients read from SGLang's."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.scheduler import Scheduler
from rollout_server.engine.server import create_app
from rollout_server.engine.weights import load_model

CONTEXT = 64
PROMPT = [5, 17, 42, 99, 7, 300, 12]


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    model, tokenizer, eos = load_model(tiny_model_dir)
    engine = Scheduler(model, tokenizer, model_path=str(tiny_model_dir), weight_version="0", max_batch_size=4,
                       max_context=CONTEXT)
    spec = GenerateSpec(tokenizer, model.config.vocab_size, CONTEXT, eos)
    with TestClient(create_app(engine, spec), base_url="http://127.0.0.1") as c:
        yield c


def refused(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('rollwave_engine_http_refused_total{status="400"}'):
            return float(line.split()[1])
    return 0.0


def generate(client: TestClient, **body: Any) -> Any:
    return client.post("/generate", json={"input_ids": PROMPT, **body})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("custom_logit_processor", '{"callable": "x"}'),
        ("input_embeds", [[0.1, 0.2]]),
        ("image_data", "http://127.0.0.1/cat.png"),
        ("audio_data", ["a.wav"]),
        ("video_data", "v.mp4"),
        ("session_params", {"id": "s1"}),
        ("return_hidden_states", True),
        ("return_routed_experts", True),
        ("return_entropy", True),
        ("return_sampling_mask", [True]),
        ("max_thinking_tokens", 16),
        ("require_reasoning", True),
    ],
)
def test_a_field_sglang_honours_and_this_engine_does_not_is_refused_naming_it(
    client: TestClient, field: str, value: Any
) -> None:
    """SGLang changes the prompt, the sampling or the reply for these; ignoring them would give a client other
    tokens (off-policy data) or a reply without what it asked for, without a word."""
    before = refused(client)
    resp = generate(client, sampling_params={"max_new_tokens": 2}, **{field: value})
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["error"]["message"]
    assert refused(client) == before + 1


def test_those_fields_at_their_defaults_are_accepted(client: TestClient) -> None:
    defaults = {"custom_logit_processor": None, "image_data": None, "session_params": None,
                "return_hidden_states": False, "return_entropy": False, "return_sampling_mask": [False],
                "max_thinking_tokens": None, "require_reasoning": False, "priority": 3, "extra_key": "k"}
    resp = generate(client, sampling_params={"max_new_tokens": 2}, **defaults)
    assert resp.status_code == 200, resp.text


def test_logprob_replies_carry_output_token_logprobs_length(client: TestClient) -> None:
    """SGLang's ``add_logprob_to_meta_info`` sets it; slime's and miles' SGLang readers require it."""
    out = generate(client, sampling_params={"max_new_tokens": 5, "ignore_eos": True}, return_logprob=True).json()
    meta = out["meta_info"]
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    zero = generate(client, sampling_params={"max_new_tokens": 0}, return_logprob=True).json()["meta_info"]
    assert zero["output_token_logprobs"] == [] and zero["output_token_logprobs_length"] == 0


@pytest.mark.parametrize("params", [{}, {"max_new_tokens": 0}, {"max_new_tokens": None}])
def test_a_prompt_of_the_context_length_is_refused_as_sglang_does(client: TestClient, params: dict) -> None:
    """SGLang refuses an input of ``context_len`` tokens or more whatever ``max_new_tokens`` says; here one of
    exactly the context length answered 200 with nothing generated."""
    resp = client.post("/generate", json={"input_ids": [5] * CONTEXT, "sampling_params": params})
    assert resp.status_code == 400, resp.text
    assert f"The input ({CONTEXT} tokens) is longer than the model's context length" in resp.json()["error"]["message"]
    fits = client.post("/generate", json={"input_ids": [5] * (CONTEXT - 1), "sampling_params": {"max_new_tokens": None,
                                                                                                "ignore_eos": True}})
    assert fits.status_code == 200 and fits.json()["meta_info"]["completion_tokens"] == 1


@pytest.mark.parametrize("value", ["Infinity", "NaN"])
def test_a_temperature_that_is_not_finite_is_refused(client: TestClient, value: str) -> None:
    """Python's JSON reads ``Infinity`` and ``NaN``; SGLang's ``verify`` refuses a temperature that is not finite
    (an infinite one sampled uniformly here)."""
    body = f'{{"input_ids": {PROMPT}, "sampling_params": {{"temperature": {value}, "max_new_tokens": 2}}}}'
    resp = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "temperature" in resp.json()["error"]["message"]


def test_an_empty_text_prompt_is_refused_naming_text(client: TestClient) -> None:
    resp = client.post("/generate", json={"text": ["hi", ""]})
    assert resp.status_code == 400
    assert "text[1] is empty" in resp.json()["error"]["message"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_callers_of_an_engine_whose_scheduler_thread_ended_get_an_error_not_a_hang(tiny_model_dir: Path) -> None:
    """Nothing settles a request or a call once the scheduler thread is gone: each wait on it must end with an
    error, not hold its caller (a rollout worker, a checkpoint receiver) forever."""
    model, tokenizer, eos = load_model(tiny_model_dir)
    engine = Scheduler(model, tokenizer, model_path=str(tiny_model_dir), max_context=CONTEXT)
    spec = GenerateSpec(tokenizer, model.config.vocab_size, CONTEXT, eos)

    def end_thread() -> None:
        raise SystemExit  # not an Exception: it ends the thread, as any bug outside a step's handler would

    with TestClient(create_app(engine, spec), base_url="http://127.0.0.1") as c:
        engine.call(end_thread)
        engine._thread.join(10)
        assert not engine.alive
        with ThreadPoolExecutor(2) as pool:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
            replies = [pool.submit(c.post, "/generate", json=body),
                       pool.submit(c.post, "/abort_request", json={"abort_all": True})]
            gen, abort = (f.result(timeout=30) for f in replies)
        assert gen.status_code == 500 and "scheduler thread" in gen.json()["message"]
        assert abort.status_code == 500
