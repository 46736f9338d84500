"""Edges of the embedded engine: a client that goes away has its requests aborted, as SGLang does (uvicorn never
cancels a handler whose client closed the connection, so nothing else would free their slots); a malformed field
gets a 400 that names it."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest
from engine_helpers import metric, post, wait_for
from transformers import PreTrainedTokenizerBase

from rollout_server.engine.protocol import GenerateSpec, build_requests

LONG = {"max_new_tokens": 1000, "ignore_eos": True}
WAIT_S = 30.0


def send_generate(url: str, body: dict) -> socket.socket:
    """A connection that has sent ``body`` to /generate and reads nothing: closing it is the client going away."""
    where = urlsplit(url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((where.hostname, where.port), timeout=WAIT_S)
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {where.hostname}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.mark.parametrize("where", ["running", "queued"])
def test_a_request_whose_client_went_away_is_aborted_and_leaves_the_batch(engine_url: str, where: str) -> None:
    """Paused (so it can never finish by itself), a request whose client closed the connection is aborted: running,
    its row and KV leave the batch; queued, it leaves the queue."""
    aborted = 'rollwave_engine_requests_total{finish="abort"}'
    before = metric(engine_url, aborted, 0.0)
    body = {"input_ids": [5, 17, 42], "sampling_params": LONG, "rid": f"gone-{where}"}
    try:
        if where == "queued":
            assert post(engine_url, "/pause_generation", {"mode": "in_place"}).status_code == 200
        with send_generate(engine_url, body):
            wait_for(engine_url, f"rollwave_engine_{where.replace('queued', 'waiting')}_requests", 1)
            if where == "running":
                assert post(engine_url, "/pause_generation", {"mode": "in_place"}).status_code == 200
        wait_for(engine_url, aborted, before + 1)
        wait_for(engine_url, "rollwave_engine_running_requests", 0)
        wait_for(engine_url, "rollwave_engine_waiting_requests", 0)
    finally:
        assert post(engine_url, "/continue_generation", {}).status_code == 200


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1, 10**30])
def test_a_sampling_seed_no_generator_takes_is_refused_naming_the_field(tokenizer: PreTrainedTokenizerBase,
                                                                        seed: int) -> None:
    spec = GenerateSpec(tokenizer, len(tokenizer), 1024, frozenset())
    with pytest.raises(ValueError, match="sampling_params.sampling_seed"):
        build_requests({"input_ids": [5, 6], "sampling_params": {"sampling_seed": seed}}, spec)


@pytest.mark.parametrize("seed", [(1 << 64) - 1, -(1 << 63), 0])
def test_a_sampling_seed_at_the_ends_of_the_range_is_taken(tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    spec = GenerateSpec(tokenizer, len(tokenizer), 1024, frozenset())
    (req,), _ = build_requests({"input_ids": [5, 6], "sampling_params": {"sampling_seed": seed}}, spec)
    assert req.generator is not None
