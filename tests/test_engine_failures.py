"""Failures inside the embedded engine end the requests they hit, name them, and take nothing else down.

Logits that are not finite (a diverged policy: here an adapter whose weights are NaN, applied only to the rows that
name it) fail that request: its call is answered 500 naming it ("NaN happened", SGLang's words), with or without
``return_logprob``, logged and counted. The other requests of a failed request's ``/generate`` call, queued or
running, are aborted at once (their call's reply is already the error), freeing their slots and KV."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_request, metric, post, wait_for
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import LoraConfig
from rollout_server.engine.process import EngineProcess
from rollout_server.engine.scheduler import EngineFailure, Scheduler
from trainer.lora import add_adapter

NAN = 'rollwave_engine_requests_total{finish="nan"}'
ABORTED = 'rollwave_engine_requests_total{finish="abort"}'
LENGTH = 'rollwave_engine_requests_total{finish="length"}'
LONG = {"max_new_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine") / "engine.log"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, engine_log: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """Two requests at a time (a third of one call waits in the queue), serving adapter ``nan``: every lora_B NaN."""
    adapter = tmp_path_factory.mktemp("nan_adapter")
    model = add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoraConfig())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.fill_(float("nan"))
    model.save_pretrained(adapter)
    proc = EngineProcess(tiny_model_dir, max_batch_size=2, threads=1, log_path=engine_log).start()
    try:
        loaded = post(proc.url, "/load_lora_adapter", {"lora_name": "nan", "lora_path": str(adapter)})
        assert loaded.status_code == 200, loaded.text
        yield proc
    finally:
        proc.close()


@pytest.mark.parametrize("logprob", [True, False], ids=["logprob", "no_logprob"])
def test_logits_that_are_not_finite_fail_the_request_naming_it(engine: EngineProcess, engine_log: Path,
                                                                logprob: bool) -> None:
    """Before, with ``return_logprob`` the NaN logprobs broke the JSON reply (a bare 500); without it the request
    sampled garbage tokens and answered 200."""
    url, rid = engine.url, f"diverged-{logprob}"
    before = metric(url, NAN, 0.0)
    reply = post(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}, "rid": rid,
                                    "return_logprob": logprob, "lora_path": "nan"})
    assert reply.status_code == 500, reply.text
    body = reply.json()
    assert (body["object"], body["code"]) == ("error", 500)
    assert f"NaN happened: the logits of request {rid!r} are not finite" in body["message"]
    assert metric(url, NAN, 0.0) == before + 1
    logged = [line for line in engine_log.read_text().splitlines() if "NaN happened" in line]
    assert any(repr(rid) in line for line in logged), logged
    base = post(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8},
                                   "return_logprob": logprob})  # the base model's rows go on
    assert base.status_code == 200, base.text
    assert base.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_a_failed_request_aborts_its_siblings_running_and_queued(engine: EngineProcess) -> None:
    """One call of three prompts on an engine that runs two: the first two are prefilled together, the second
    (adapter ``nan``) fails there, the first is running beside it and the third is queued. Both are aborted at
    once; before, they went on generating to their 1000 tokens after the call had answered 500."""
    url = engine.url
    nan, aborted, length = (metric(url, m, 0.0) for m in (NAN, ABORTED, LENGTH))
    reply = post(url, "/generate", {"input_ids": [[5, 6, 7], [8, 9, 10], [11, 12, 13]], "sampling_params": LONG,
                                    "rid": ["sib-0", "sib-1", "sib-2"], "lora_path": [None, "nan", None]})
    assert reply.status_code == 500 and "request 'sib-1'" in reply.json()["message"], reply.text[:500]
    wait_for(url, ABORTED, aborted + 2)
    wait_for(url, "rollwave_engine_running_requests", 0)
    wait_for(url, "rollwave_engine_waiting_requests", 0)
    assert (metric(url, NAN, 0.0), metric(url, LENGTH, 0.0)) == (nan + 1, length)
    again = post(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "rid": "sib-0"})
    assert again.status_code == 200, again.text  # its rid is free again


def test_a_step_that_raises_aborts_the_queued_siblings_of_its_requests(tiny_model_dir: Path) -> None:
    """A prefill that raises (a token id past the vocabulary) fails its request, counted as a step failure; the two
    others of its call, queued behind it (one request at a time), end aborted in the queue instead of being generated
    after the failure; the engine serves the next call."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = Scheduler(model, AutoTokenizer.from_pretrained(tiny_model_dir), model_path=str(tiny_model_dir),
                       max_batch_size=1)
    engine.start()
    try:
        bad = greedy_request("bad", [5, model.config.vocab_size + 7], 4)
        siblings = [greedy_request(f"sibling-{i}", [5, 6, 7], 4) for i in range(2)]
        engine.submit([bad, *siblings])
        with pytest.raises(EngineFailure, match="index"):
            bad.future.result(timeout=60)
        ends = [s.future.result(timeout=60) for s in siblings]
        assert [(r.finish_reason["type"], r.output_ids) for r in ends] == [("abort", [])] * 2
        assert engine.call(engine.in_flight).result(timeout=60) == 0
        good = greedy_request("good", [5, 6, 7], 4)
        engine.submit([good])
        good.future.result(timeout=60)  # the engine lives on
    finally:
        engine.close()
    value = engine.metrics.registry.get_sample_value
    assert value("rollwave_engine_step_failures_total") == 1  # the step is counted (and logged with its traceback)
    assert value("rollwave_engine_requests_total", {"finish": "error"}) == 1
    assert value("rollwave_engine_requests_total", {"finish": "abort"}) == 2
    assert value("rollwave_engine_requests_total", {"finish": "length"}) == 1
