"""The embedded engine over real HTTP with the tiny model: SGLang's shapes, continuous batching, sampling."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import metric, post, teacher_forced, until
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import ConfigError, EngineConfig
from rollout_server.engine.process import EngineProcess
from rollout_server.engine.protocol import ContractError, GenerateSpec, build_requests
from rollout_server.engine.routes import generate, info, weights
from rollout_server.engine_client import EngineClient
from tests.test_bad_http import NOT_HTTP, TOO_BIG_HEAD, counted, send_raw

PROMPT = [5, 17, 42, 99, 7, 300, 12]
LONG = {"max_new_tokens": 900, "temperature": 1.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 30, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[str]:
    with EngineProcess(tiny_model_dir, max_batch_size=16, threads=1) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def gen(url: str, input_ids: Any, params: dict | None = None, **extra: Any) -> Any:
    resp = post(url, "/generate", {"input_ids": input_ids, "sampling_params": params or {}, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_single_reply_has_sglang_shape(engine: str) -> None:
    out = gen(engine, PROMPT, {"max_new_tokens": 6, "temperature": 0}, return_logprob=True, rid="shape-1")
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["cached_tokens"] == 0 and meta["num_retractions"] == 0
    assert meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(e[0], float) and e[0] <= 0 and e[2] is None for e in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"] == [] and meta["e2e_latency"] > 0
    steps = metric(engine, "rollwave_engine_decode_step_seconds_count")
    without = gen(engine, PROMPT, {"max_new_tokens": 2})
    assert "output_token_logprobs" not in without["meta_info"]
    assert metric(engine, "rollwave_engine_decode_step_seconds_count") == steps + 1  # the first came from prefill


def test_replies_do_not_name_the_server_software(engine: str) -> None:
    """The engine's replies carry no ``server`` header (uvicorn's, naming it and so its known flaws, by default)."""
    resp = post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 200 and "server" not in resp.headers, resp.headers


def test_batch_is_a_list_in_input_order_with_suffixed_rids(engine: str) -> None:
    prompts = [PROMPT, PROMPT[:3], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    greedy = {"max_new_tokens": 8, "temperature": 0}
    alone = [gen(engine, p, greedy)["output_ids"] for p in prompts]
    out = gen(engine, prompts, greedy, rid="b")
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1", "b_2"]
    assert [o["output_ids"] for o in out] == alone
    listed = gen(engine, prompts[:2], [greedy, {"max_new_tokens": 3}], rid=["x", "y"])
    assert [o["meta_info"]["id"] for o in listed] == ["x", "y"]
    assert [o["meta_info"]["completion_tokens"] for o in listed] == [8, 3]


def test_greedy_tokens_do_not_depend_on_the_batch(engine: str) -> None:
    greedy = {"max_new_tokens": 40, "temperature": 0}
    alone = gen(engine, PROMPT, greedy)["output_ids"]

    async def crowded() -> dict:
        async with httpx.AsyncClient(base_url=engine, timeout=60.0) as client:
            others = [
                client.post(
                    "/generate",
                    json={"input_ids": [3 + i] * (2 + 5 * i), "sampling_params": LONG | {"max_new_tokens": 60}},
                )
                for i in range(6)
            ]
            ours = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": greedy})
            replies = await asyncio.gather(*others, ours)
        return replies[-1].json()

    assert asyncio.run(crowded())["output_ids"] == alone


def test_short_request_finishes_while_a_long_one_runs(engine: str) -> None:
    async def run() -> tuple[bool, dict, dict]:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as client:
            start = metric(engine, "rollwave_engine_generated_tokens_total")
            long = asyncio.create_task(client.post("/generate", json={"input_ids": PROMPT, "sampling_params": LONG}))
            await until(engine, "rollwave_engine_generated_tokens_total", start + 1)
            params = {"max_new_tokens": 8, "ignore_eos": True}
            short = (await client.post("/generate", json={"input_ids": PROMPT[:4], "sampling_params": params})).json()
            long_running = not long.done()
            return long_running, short, (await long).json()

    long_running, short, long = asyncio.run(run())
    assert long_running, "the short request had to wait for the long one"
    assert short["meta_info"]["finish_reason"]["type"] == "length"
    assert long["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 0.0},
        {"temperature": 1.3, "top_k": 20, "top_p": 0.9},
        {"temperature": 0.8, "min_p": 0.05},
    ],
)
def test_logprobs_equal_a_teacher_forced_forward(engine: str, model: torch.nn.Module, params: dict) -> None:
    prompts = [PROMPT, PROMPT[2:], [9] * 13]  # ragged: the batch is left-padded
    out = gen(engine, prompts, params | {"max_new_tokens": 24, "ignore_eos": True}, return_logprob=True)
    temperature = params["temperature"] or 1.0
    for prompt, item in zip(prompts, out, strict=True):
        got = [e[0] for e in item["meta_info"]["output_token_logprobs"]]
        want = teacher_forced(model, prompt, item["output_ids"], temperature).tolist()
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4


def test_sampling_seed_gives_the_same_output(engine: str) -> None:
    params = {"max_new_tokens": 32, "temperature": 1.0, "ignore_eos": True}
    a = gen(engine, PROMPT, params | {"sampling_seed": 1234})
    b = gen(engine, PROMPT, params | {"sampling_seed": 1234})
    c = gen(engine, PROMPT, params | {"sampling_seed": 4321})
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]


def test_stop_token_ids_end_the_request_and_are_kept_in_output_ids(engine: str, tokenizer) -> None:
    """As SGLang's ``Req.check_finished``: the length is checked first, so a stop token that is the last one
    allowed finishes as ``length``; ``ignore_eos`` ignores ``stop_token_ids`` too."""
    base = gen(engine, PROMPT, SEEDED)["output_ids"]
    k = next(i for i in range(3, len(base)) if base[i] not in base[:i])
    stopping = SEEDED | {"ignore_eos": False, "stop_token_ids": [base[k]]}
    out = gen(engine, PROMPT, stopping)
    assert out["output_ids"] == base[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": base[k]}
    assert out["text"] == tokenizer.decode(base[:k], skip_special_tokens=True)
    last = gen(engine, PROMPT, stopping | {"max_new_tokens": k + 1})
    assert last["output_ids"] == base[: k + 1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": k + 1}
    ignored = gen(engine, PROMPT, SEEDED | {"stop_token_ids": [base[k]]})
    assert ignored["output_ids"] == base and ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings_trim_the_text_unless_no_stop_trim(engine: str, tokenizer) -> None:
    base = gen(engine, PROMPT, SEEDED)["output_ids"]
    full = tokenizer.decode(base)
    stop = next(full[i : i + 3] for i in range(6, len(full)) if full[i : i + 3].isascii() and full[i : i + 3].strip())
    n = next(i for i in range(1, len(base) + 1) if stop in tokenizer.decode(base[:i]))
    out = gen(engine, PROMPT, SEEDED | {"stop": [stop]})
    assert out["output_ids"] == base[:n]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    text = tokenizer.decode(base[:n], skip_special_tokens=True)
    assert out["text"] == text[: text.find(stop)]
    kept = gen(engine, PROMPT, SEEDED | {"stop": stop, "no_stop_trim": True})
    assert kept["text"] == text


def test_eos_stops_unless_ignored(tiny_model_dir: Path, tokenizer) -> None:
    spec = GenerateSpec(tokenizer, len(tokenizer), 1024, frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")}))
    (req,), _ = build_requests({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [7]}}, spec)
    assert req.stop_ids == {7} | spec.eos_ids
    (req,), _ = build_requests({"input_ids": PROMPT, "sampling_params": {"ignore_eos": True, "stop_token_ids": [7]}},
                               spec)
    assert req.stop_ids == frozenset()
    with pytest.raises(ContractError, match="unknown field `seed`"):
        build_requests({"input_ids": PROMPT, "sampling_params": {"seed": 1}}, spec)


def test_a_text_prompt_gets_the_tokenizers_special_tokens_as_sglang_gives_them(tiny_model_dir: Path) -> None:
    """SGLang encodes ``text`` with the tokenizer's defaults, so a tokenizer that adds a BOS (Llama's) adds it."""
    bos_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    bos = bos_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    bos_tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    spec = GenerateSpec(bos_tokenizer, len(bos_tokenizer), 1024, frozenset())
    (req,), _ = build_requests({"text": "What is 6 times 7?"}, spec)
    assert req.input_ids == bos_tokenizer.encode("What is 6 times 7?") and req.input_ids[0] == bos


@pytest.mark.parametrize(
    ("body", "shape", "needle"),
    [
        ({"input_ids": PROMPT, "sampling_params": {"seed": 1}}, "gate", "unknown field `seed`"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16.0}}, "gate", "max_new_tokens"),
        ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": 3}}, "gate", "stop_token_ids"),
        ({"input_ids": "abc"}, "gate", "input_ids"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1020}}, "value", "maximum context length"),
        ({"input_ids": []}, "value", "empty"),
        ({"input_ids": [1, 5000]}, "value", "outside the vocabulary"),
        ({"input_ids": [PROMPT, PROMPT], "rid": ["a"]}, "value", "rid"),
        ({"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 0.5}}, "value", "frequency_penalty"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "value", "top_p"),
        ({"sampling_params": {}}, "value", "input_ids"),
    ],
)
def test_generate_errors_use_sglang_shapes(engine: str, body: dict, shape: str, needle: str) -> None:
    resp = post(engine, "/generate", body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    message = err if shape == "gate" else err["message"]
    assert isinstance(message, str) and needle in message


def test_control_endpoints_need_a_valid_json_body(engine: str) -> None:
    for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk", "/abort_request"):
        resp = httpx.post(engine + path)
        assert resp.status_code == 400
        body = resp.json()
        assert body["object"] == "error" and body["code"] == 400 and "Field required" in body["message"]
    bad = post(engine, "/pause_generation", {"mode": "bogus"})
    assert bad.status_code == 400 and bad.json()["type"] == "Bad Request"
    assert httpx.get(engine + "/no_such_route").json() == {"detail": "Not Found"}
    metrics = httpx.get(engine + "/metrics").text
    assert 'rollwave_engine_http_refused_total{status="404"} 1.0' in metrics  # the 400s: other tests count them too


def test_duplicate_rid_in_flight_is_rejected_and_abort_matches_prefixes(engine: str) -> None:
    async def run() -> tuple[httpx.Response, dict]:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as client:
            first = asyncio.create_task(
                client.post(
                    "/generate",
                    json={"input_ids": PROMPT, "sampling_params": LONG, "rid": "dup-1", "return_logprob": True},
                )
            )
            await until(engine, "rollwave_engine_running_requests", 1)
            second = await client.post("/generate", json={"input_ids": PROMPT, "rid": "dup-1"})
            assert (await client.post("/abort_request", json={"rid": "dup"})).status_code == 200
            return second, (await first).json()

    second, first = asyncio.run(run())
    assert second.status_code == 400
    assert second.json() == {"error": {"message": "Duplicate request ID detected"}}
    meta = first["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert 0 < meta["completion_tokens"] < LONG["max_new_tokens"]
    assert len(meta["output_token_logprobs"]) == len(first["output_ids"]) == meta["completion_tokens"]
    assert post(engine, "/abort_request", {}).status_code == 200


def test_pause_abort_returns_partial_output_and_new_requests_wait(engine: str) -> None:
    async def run() -> tuple[list[dict], dict, bool]:
        async with httpx.AsyncClient(base_url=engine, timeout=120.0) as client:
            running = [
                asyncio.create_task(
                    client.post("/generate", json={"input_ids": PROMPT[: 3 + i], "sampling_params": LONG})
                )
                for i in range(3)
            ]
            await until(engine, "rollwave_engine_running_requests", 3)
            assert (await client.post("/pause_generation", json={"mode": "abort"})).json()["status"] == "ok"
            aborted = [(await t).json() for t in running]
            params = {"max_new_tokens": 4, "ignore_eos": True}
            later = asyncio.create_task(client.post("/generate", json={"input_ids": PROMPT, "sampling_params": params}))
            await until(engine, "rollwave_engine_waiting_requests", 1)
            waited = not later.done()
            assert (await client.get("/ready")).status_code == 503
            await client.post("/continue_generation", json={})
            return aborted, (await later).json(), waited

    aborted, later, waited = asyncio.run(run())
    for out in aborted:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
    assert waited and later["meta_info"]["finish_reason"]["type"] == "length"
    assert metric(engine, "rollwave_engine_paused_seconds_total") > 0


def test_info_health_flush_and_metrics(engine: str) -> None:
    info = httpx.get(engine + "/model_info").json()
    assert info["weight_version"] == "0" and info["is_generation"] is True
    assert info["dtype"] == "float32"  # --dtype auto: the checkpoint's
    assert httpx.get(engine + "/get_model_info").json() == info
    assert httpx.get(engine + "/health").status_code == 200 and httpx.get(engine + "/health").content == b""
    assert httpx.get(engine + "/health_generate").status_code == 200
    flushed = post(engine, "/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    text = httpx.get(engine + "/metrics").text
    for name in (
        "rollwave_engine_generated_tokens_total",
        "rollwave_engine_running_requests",
        "rollwave_engine_waiting_requests",
        "rollwave_engine_paused_seconds_total",
        'rollwave_engine_weight_version_info{version="0"} 1.0',
    ):
        assert name in text


def test_bf16_weights_served_on_cpu(tiny_model_dir: Path) -> None:
    """``--dtype bfloat16`` (``engine.dtype``) serves an fp32 checkpoint in bf16; a pushed fp32 or bf16 version
    loads into the bf16 weights."""
    with EngineProcess(tiny_model_dir, threads=1, dtype="bfloat16") as proc:
        assert httpx.get(proc.url + "/model_info").json()["dtype"] == "bfloat16"
        out = gen(proc.url, PROMPT, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True)
        assert len(out["output_ids"]) == 4 and all(lp <= 0 for lp, _, _ in out["meta_info"]["output_token_logprobs"])
        reply = post(proc.url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "1"})
        assert reply.json()["success"], reply.text
        assert gen(proc.url, PROMPT, {"max_new_tokens": 4, "temperature": 0})["output_ids"] == out["output_ids"]


def test_an_engine_started_from_its_config_section_serves_as_it_says(tiny_model_dir: Path) -> None:
    """``EngineProcess.from_config``, as the rollout server and ``rollwave rollout`` start theirs: the section's
    dtype, batch and context limits reach the engine, on a free loopback port when ``host`` is given."""
    cfg = EngineConfig(dtype="bfloat16", max_batch_size=7, max_context=300, threads=1, port=1)
    with EngineProcess.from_config(tiny_model_dir, cfg, secrets.token_urlsafe(32), host="127.0.0.1") as proc:
        info = httpx.get(proc.url + "/model_info", headers={"Authorization": f"Bearer {proc.api_key}"}).json()
    assert (info["dtype"], info["max_batch_size"], info["max_context"]) == ("bfloat16", 7, 300)
    assert proc.port != 1


def test_with_a_key_every_route_needs_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SGLang's ``--api-key`` behaviour, on every route (SGLang exempts /health and /metrics; not here)."""
    key = secrets.token_urlsafe(32)
    routes = [(path, method) for module in (generate, info, weights) for route in module.router.routes
              for path, methods in [(route.path, route.methods)] for method in sorted(methods)]
    assert {"/update_weights_from_disk", "/generate", "/pause_generation", "/health", "/metrics"} <= {
        p for p, _ in routes}
    planted = tmp_path / "planted"  # what an attacker would load: refused before it is even looked at
    log = tmp_path / "engine.log"
    with EngineProcess(tiny_model_dir, threads=1, api_key=key, log_path=log) as proc:
        for path, method in routes:
            body = {"model_path": str(planted)} if method in ("POST", "PUT") else None
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                reply = httpx.request(method, proc.url + path, json=body, headers=headers, timeout=30)
                assert (reply.status_code, reply.json()) == (401, {"error": "Unauthorized"}), (path, method, headers)
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(proc.url + "/health", headers=auth).status_code == 200
        metrics = httpx.get(proc.url + "/metrics", headers=auth).text
        assert "rollwave_engine_generated_tokens_total" in metrics
        assert f'rollwave_engine_http_refused_total{{status="401"}} {3.0 * len(routes)}' in metrics
        assert log.read_text().count('(401): {"error":"Unauthorized"}') == 3 * len(routes)

        async def through_the_client() -> tuple[str, dict]:
            async with EngineClient(proc.url, api_key=key) as client:
                return await client.weight_version(), await client.generate(PROMPT, {"max_new_tokens": 2})

        version, reply = asyncio.run(through_the_client())
        assert version == "0" and len(reply["output_ids"]) == 2
        cmdlines = []
        for path in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                cmdlines.append(path.read_bytes())
            except OSError:  # gone meanwhile
                continue
        assert any(b"rollout_server.engine" in c for c in cmdlines)
        assert not any(key.encode() in c for c in cmdlines)  # handed over in the environment


def test_off_loopback_the_engine_needs_a_key(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROLLWAVE_ENGINE_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "rollout_server.engine", "--model", str(tiny_model_dir),
                           "--host", "0.0.0.0", "--port", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: --host 0.0.0.0 is not loopback: set ROLLWAVE_ENGINE_API_KEY" in proc.stderr
    for short in ("k" * 31, "k" * 31 + "\n"):  # the key is stripped, as the config strips the rollout servers'
        proc = subprocess.run([sys.executable, "-m", "rollout_server.engine", "--model", str(tiny_model_dir)],
                              env={**env, "ROLLWAVE_ENGINE_API_KEY": short}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, (short, proc.stderr)
        assert "error: ROLLWAVE_ENGINE_API_KEY: must be at least 32 characters" in proc.stderr


def test_a_keyless_engine_answers_only_loopback_host_names(engine: str) -> None:
    """Without a key the engine is on loopback, and a web page that rebinds its own name to 127.0.0.1 must not
    reach its routes (a weight load among them): any Host but a loopback name is 400, logged and counted."""
    port = engine.rsplit(":", 1)[1]
    evil = {"Host": f"rebind.attacker.example:{port}"}
    before = httpx.get(engine + "/metrics").text
    assert httpx.post(engine + "/update_weights_from_disk", json={"model_path": "/x"}, headers=evil).status_code == 400
    assert httpx.get(engine + "/health", headers=evil).status_code == 400
    assert httpx.get(engine + "/health", headers={"Host": f"localhost:{port}"}).status_code == 200
    metrics = httpx.get(engine + "/metrics").text

    def refused_400(text: str) -> float:
        line = next((x for x in text.splitlines() if x.startswith('rollwave_engine_http_refused_total{status="400"}')),
                    "0 0")
        return float(line.split()[-1])

    assert refused_400(metrics) == refused_400(before) + 2


def test_a_model_without_a_tokenizer_is_refused_and_the_engine_says_why(
    tiny_model_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Without tokenizer files transformers would give a one-token vocabulary that encodes every prompt as
    nothing; the engine refuses the directory as a start it cannot make (exit 2, a ConfigError to its owner, which is
    not started again), and its error reaches its parent's log (no log file given)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(ConfigError, match=r"engine: the embedded engine refused to start \(its error is above"):
        EngineProcess(bare, threads=1).start(60)
    said = capfd.readouterr().out
    assert f"error: --model {bare}: {bare} has no tokenizer (none of tokenizer.json, tokenizer_config.json" in said


def test_an_engine_its_owner_started_leaves_a_ctrl_c_to_the_owner(tiny_model_dir: Path) -> None:
    """A Ctrl-C at the terminal reaches the rollout server's whole process group, its engine too: the engine keeps
    serving (the server's groups in flight need it while the server drains) until the server stops it (SIGTERM)."""
    with EngineProcess(tiny_model_dir, max_batch_size=4, threads=1) as proc, ThreadPoolExecutor(1) as pool:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        running = pool.submit(post, proc.url, "/generate", body)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGINT)
        assert running.result(timeout=120).status_code == 200
        time.sleep(0.5)
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200


def test_a_request_that_is_not_http_is_counted_as_refused(engine: str) -> None:
    """Bytes that are not HTTP, and a request head over 64 KiB, get a 400 before the engine's app sees them: still
    counted in ``rollwave_engine_http_refused_total{status="400"}``."""
    name, labels = "rollwave_engine_http_refused_total", {"status": "400"}
    before = counted(engine + "/metrics", name, **labels)
    assert send_raw(engine, NOT_HTTP["garbage"]).startswith(b"HTTP/1.1 400 ")
    assert send_raw(engine, TOO_BIG_HEAD).startswith(b"HTTP/1.1 400 ")
    assert counted(engine + "/metrics", name, **labels) == before + 2
