"""Per-request sampling over a batch of logits, with the behaviour logprobs an RL trainer needs.

Semantics follow SGLang's sampling parameters and sampler:
temperature below 1e-6 is greedy (then temperature counts as 1); the returned logprob is
``log_softmax(logits / temperature)`` of the chosen token, taken before top-k/top-p/min-p truncation.
Sampling draws one uniform number per row and inverts the CDF of the truncated distribution (in token-id
order), so a request with ``sampling_seed`` owns a ``torch.Generator`` and its draws do not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.config import GREEDY_TEMPERATURE, TOP_K_ALL


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings of one request, normalised (SGLang defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class BatchSampler:
    """Samples one token per row of ``[B, V]`` logits for a fixed list of requests.

    Built once per batch membership (the tensors below follow the rows), used every step.
    ``generators[i]`` is the request's own generator, or None to draw from ``shared``.
    """

    def __init__(
        self, params: list[SamplingParams], generators: list[torch.Generator | None], shared: torch.Generator
    ) -> None:
        self._greedy = torch.tensor([p.greedy for p in params])
        self._all_greedy = bool(self._greedy.all())
        temps = [1.0 if p.greedy else p.temperature for p in params]
        self._temps = None if all(t == 1.0 for t in temps) else torch.tensor(temps)[:, None]
        self._top_k = torch.tensor([p.top_k if p.top_k > 0 else TOP_K_ALL for p in params])[:, None]
        self._top_p = torch.tensor([p.top_p for p in params])[:, None]
        self._min_p = torch.tensor([p.min_p for p in params])[:, None]
        self._truncate = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params if not p.greedy)
        self._seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
        self._shared = shared
        self._size = len(params)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(tokens [B] int64, logprobs [B] float32)``."""
        logits = logits.float()
        scaled = logits if self._temps is None else logits / self._temps
        logprobs = torch.log_softmax(scaled, dim=-1)
        if self._all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._draw(logprobs.exp())
            if self._greedy.any():
                tokens = torch.where(self._greedy, logits.argmax(dim=-1), tokens)
        return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        # 1 - U(0,1) lies in (0, 1]: the searched point is above zero, so a zero-probability token is never hit.
        u = 1.0 - torch.rand(self._size, generator=self._shared)
        for i, gen in self._seeded:
            u[i] = 1.0 - torch.rand(1, generator=gen)
        if self._truncate:
            probs = probs.masked_fill(self._dropped(probs), 0.0)
        # the CDF runs in token-id order, never in sorted order: two tokens of (nearly) equal probability that float
        # noise of another batch shape ranks the other way round would swap places in a sorted CDF, and a seeded
        # request would then sample the other one
        return _search(probs.cumsum(dim=-1), u).clamp_(max=probs.shape[-1] - 1)

    def _dropped(self, probs: torch.Tensor) -> torch.Tensor:
        """Where top-k, top-p and min-p (SGLang's order and rules, over the sorted probabilities) drop a token."""
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1])[None, :]
        cum = sorted_p.cumsum(dim=-1)
        drop = (rank >= self._top_k) | ((cum - sorted_p) > self._top_p) | (sorted_p < self._min_p * sorted_p[:, :1])
        return torch.empty_like(drop).scatter_(1, order, drop)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first CDF entry reaching ``u`` times the row total (rows need not be normalised)."""
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1)
