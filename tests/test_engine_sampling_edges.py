"""The embedded engine's sampling and stop strings: a seeded request's draws must not depend on the float
noise of its batch, and a stop string outside ASCII (one token per byte) must end the request."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from rollout_server.engine.protocol import GenerateSpec, build_requests
from rollout_server.engine.sampling import BatchSampler, SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 1.0, 0.5, 0.0, -1.0])


def one_ulp_higher(token: int) -> torch.Tensor:
    """``LOGITS`` as one row, ``token``'s logit one float step higher: the noise a different batch shape gives."""
    logits = LOGITS.clone()
    logits[token] = torch.nextafter(logits[token], torch.tensor(float("inf")))
    return logits[None]


def test_a_seeded_draw_does_not_depend_on_how_float_noise_ranks_near_tied_tokens() -> None:
    """Tokens 1 and 2 tie up to one ulp; each row ranks them the other way round. The distribution is the same to
    1e-7, so with truncation (top_k) the same seed must draw the same token from either row."""
    params = SamplingParams(top_k=4, sampling_seed=0)
    differ = []
    for seed in range(100):
        drawn = [
            int(BatchSampler([params], [torch.Generator().manual_seed(seed)], torch.Generator())
                .sample(one_ulp_higher(token))[0])
            for token in (1, 2)
        ]
        if drawn[0] != drawn[1]:
            differ.append((seed, drawn))
    assert differ == []


def test_a_stop_string_of_characters_outside_ascii_ends_the_request(tiny_model_dir: Path) -> None:
    """A byte-level tokenizer spells 😀 (one character) in four tokens: the stop check must look back that far."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = GenerateSpec(tokenizer, len(tokenizer), 1024, frozenset())
    for stop in ("😀", "。"):
        assert len(tokenizer.encode(stop, add_special_tokens=False)) > len(stop) + 1
        (req,), _ = build_requests({"input_ids": [5, 6], "sampling_params": {"stop": stop}}, spec)
        output = tokenizer.encode(f"ok {stop} more", add_special_tokens=False)
        ends = next((i for i, token in enumerate(output) if req.append(token, 0.0, "0", tokenizer)), None)
        assert ends == len(tokenizer.encode(f"ok {stop}", add_special_tokens=False)) - 1
        assert req.finish_reason == {"type": "stop", "matched": stop}
        assert req.reply(tokenizer)["text"] == "ok "
