"""The keys and values of finished requests, kept for the requests that extend them (SGLang's radix cache).

A multi-turn episode sends each turn as its prompt, every earlier turn and the tools' answers. Without a cache
the engine prefills the whole conversation again at every turn. A finished request's KV (its prompt and
output, less the last token, which was sampled but never fed) is kept under its tokens; a request whose tokens
start with an entry's prefills only the rest.

An entry holds what the weights and adapters loaded when it was computed made of its tokens: the scheduler
clears the cache at every load that flushes (SGLang's ``flush_cache``, the default) and keeps no request whose
KV spans one; an adapter loaded again or unloaded takes only its own entries and requests with it. The cache
holds at most ``max_tokens`` tokens (0 turns it off); the least recently used entries leave first, and an entry
leaves when the request that extended it is kept in its place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, keys and values [heads, tokens, head_dim]


@dataclass(eq=False)
class Prefix:
    """One entry: ``tokens`` and their KV, computed with adapter ``lora`` (None: the base model)."""

    tokens: list[int]
    lora: str | None
    layers: Layers
    key: tuple[str | None, tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.lora, tuple(self.tokens))

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def head(self, n: int) -> Layers:
        """The KV of the first ``n`` tokens (views)."""
        return [(k[:, :n], v[:, :n]) for k, v in self.layers]


class PrefixCache:
    """Entries by recency; the scheduler thread owns it (``nbytes`` may be read from any thread)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str | None, tuple[int, ...]], Prefix] = OrderedDict()
        self._tokens = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    def lookup(self, tokens: list[int], lora: str | None) -> Prefix | None:
        """The longest entry whose tokens begin ``tokens`` (or equal them), computed with ``lora``."""
        best: Prefix | None = None
        n = len(tokens)
        for entry in self._entries.values():
            m = len(entry.tokens)
            if (m <= n and entry.lora == lora and (best is None or m > len(best.tokens))
                    and entry.tokens[-1] == tokens[m - 1] and entry.tokens == tokens[:m]):
                best = entry
        if best is not None:
            self._entries.move_to_end(best.key)
        return best

    def insert(self, tokens: list[int], lora: str | None, layers: Layers, replaces: Prefix | None = None) -> None:
        """Keep ``layers`` (copied) as the KV of ``tokens``; ``replaces``, the entry they extend, leaves."""
        if replaces is not None and self._entries.get(replaces.key) is replaces:
            self._drop(replaces)
        key = (lora, tuple(tokens))
        if key in self._entries:  # the same tokens again (a group's samples that agree)
            self._entries.move_to_end(key)
            return
        if not tokens or len(tokens) > self.max_tokens:
            return
        entry = Prefix(list(tokens), lora, [(k.clone(), v.clone()) for k, v in layers])
        self._entries[entry.key] = entry
        self._tokens += len(entry.tokens)
        self.nbytes += entry.nbytes
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries.values())))

    def drop_adapter(self, lora: str) -> None:
        """Drop the entries adapter ``lora`` computed."""
        for entry in [e for e in self._entries.values() if e.lora == lora]:
            self._drop(entry)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = self.nbytes = 0

    def _drop(self, entry: Prefix) -> None:
        del self._entries[entry.key]
        self._tokens -= len(entry.tokens)
        self.nbytes -= entry.nbytes
