"""The prefix-tree prefill a swap's ``prefill_ahead`` runs: every token of every sequence gets the keys and values
a prefill of that sequence alone gives it, while each distinct token runs through the model once, whatever the
sequences share (all of a prefix, one another whole, nothing) and however many rows they are packed into."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_server.engine.kv import KVBatch
from rollout_server.engine.tree_prefill import tree_prefill


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(tiny_model_dir: Path, request: pytest.FixtureRequest) -> torch.nn.Module:
    """The engine serves the checkpoint's dtype or ``engine.dtype``; bf16 rounds differently in a wider row."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=request.param).eval()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = tokens(0, 40)  # what every episode starts with
PROMPTS = [SYSTEM + tokens(1, 30), SYSTEM + tokens(2, 25)]  # two groups' prompts
SEQS = [
    *(PROMPTS[0] + tokens(10 + i, 5 + 9 * i) for i in range(4)),  # a group's samples, each generated its own
    *(PROMPTS[1] + tokens(20 + i, 12 + 3 * i) for i in range(3)),
    PROMPTS[0] + tokens(10, 5),  # the same as a sample
    PROMPTS[1],  # a prefix of other sequences, whole
    SYSTEM + tokens(3, 60),  # a third task
]


def distinct_tokens(seqs: list[list[int]]) -> int:
    """Nodes of the sequences' prefix tree: tokens that differ in what comes before them."""
    return len({tuple(seq[: i + 1]) for seq in seqs for i in range(len(seq))})


def assert_alone(model: torch.nn.Module, seqs: list[list[int]], layers: list) -> None:
    assert len(layers) == len(seqs)
    tol = 1e-5 if model.dtype == torch.float32 else 3e-2  # bf16: a few units of its last place; a wrong mask: ~1
    for seq, got in zip(seqs, layers, strict=True):
        batch, _, _ = KVBatch.prefill(model, [seq])
        for (k, v), (want_k, want_v) in zip(got, batch.row(0), strict=True):
            assert k.shape == want_k.shape == (2, len(seq), want_k.shape[-1]) and k.dtype == model.dtype
            torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)
            torch.testing.assert_close(v, want_v, atol=tol, rtol=tol)


@torch.inference_mode()
@pytest.mark.parametrize("row_tokens", [4096, 64, 7])
def test_each_sequence_gets_its_own_keys_and_values(model: torch.nn.Module, row_tokens: int) -> None:
    """One row for the whole tree, rows that split a group, and rows narrower than a sample's own tokens."""
    layers, computed = tree_prefill(model, SEQS, row_tokens)
    assert_alone(model, SEQS, layers)
    if row_tokens >= distinct_tokens(SEQS):
        assert computed == distinct_tokens(SEQS)
    else:  # a row that starts inside a group runs the group's prompt again
        assert distinct_tokens(SEQS) < computed < sum(map(len, SEQS))


@torch.inference_mode()
@pytest.mark.parametrize("seqs", [
    pytest.param([tokens(4, 30), tokens(5, 20)], id="nothing-shared"),
    pytest.param([tokens(6, 30)], id="one"),
    pytest.param([tokens(6, 30), tokens(6, 30)], id="the-same-twice"),
    pytest.param([tokens(6, 30), tokens(6, 30)[:12]], id="one-the-other's-prefix"),
])
def test_sequences_that_share_little_or_everything(model: torch.nn.Module, seqs: list[list[int]]) -> None:
    layers, computed = tree_prefill(model, seqs)
    assert_alone(model, seqs, layers)
    assert computed == distinct_tokens(seqs)
