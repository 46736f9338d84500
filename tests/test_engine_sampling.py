"""BatchSampler: per-row truncation, greedy rows, seeded rows, and logprobs taken before truncation."""

from __future__ import annotations

import torch

from rollout_server.engine.sampling import BatchSampler, SamplingParams

LOGITS = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])


def draw(params: SamplingParams, n: int = 400, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    sampler = BatchSampler([params] * n, [None] * n, torch.Generator().manual_seed(seed))
    return sampler.sample(LOGITS.expand(n, -1))


def test_truncation_keeps_only_the_allowed_tokens() -> None:
    probs = torch.softmax(LOGITS[0], -1)
    assert set(draw(SamplingParams(top_k=2))[0].tolist()) == {0, 1}
    # top_p keeps the smallest prefix whose mass reaches p (p0 = 0.63, p0 + p1 = 0.87)
    assert float(probs[0]) < 0.7 < float(probs[:2].sum())
    assert set(draw(SamplingParams(top_p=0.7))[0].tolist()) == {0, 1}
    assert set(draw(SamplingParams(top_p=0.6))[0].tolist()) == {0}
    assert set(draw(SamplingParams(min_p=0.3))[0].tolist()) == {0, 1}  # p1/p0 = e^-1 = 0.37 >= 0.3
    assert set(draw(SamplingParams())[0].tolist()) == set(range(6))


def test_logprobs_are_tempered_and_untruncated() -> None:
    tokens, logprobs = draw(SamplingParams(temperature=0.5, top_k=2), n=50)
    want = torch.log_softmax(LOGITS[0] / 0.5, -1)[tokens]
    assert torch.allclose(logprobs, want)


def test_greedy_and_seeded_rows_in_one_batch() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(sampling_seed=5), SamplingParams(temperature=2.0)]
    logits = LOGITS.expand(3, -1)
    runs = []
    for shared_seed in (1, 2):
        gens = [None, torch.Generator().manual_seed(5), None]
        sampler = BatchSampler(params, gens, torch.Generator().manual_seed(shared_seed))
        runs.append([sampler.sample(logits) for _ in range(30)])
    for (t1, lp1), (t2, _) in zip(*runs, strict=True):
        assert t1[0] == 0 and abs(float(lp1[0]) - float(torch.log_softmax(LOGITS[0], -1)[0])) < 1e-6
        assert t1[1] == t2[1]  # the seeded row ignores the shared generator
    assert [t[2] for t, _ in runs[0]] != [t[2] for t, _ in runs[1]]


def test_frequencies_follow_the_distribution() -> None:
    tokens, _ = draw(SamplingParams(), n=20000, seed=3)
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert (freq - torch.softmax(LOGITS[0], -1)).abs().max() < 0.02
