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

The cache holds whole sequences, so it serves a request only from one that it extends. Requests prefilled
together often share a prefix that no entry holds: a group's samples after a swap retracted them (the prompt),
episodes of different tasks (the system prompt and tool schema). ``shared_prefixes`` finds those, so the
prefill computes each once, as a radix cache would.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
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


def past_length(past: Layers | None) -> int:
    """Tokens whose KV ``past`` holds (0: none)."""
    return 0 if past is None else past[0][0].shape[-2]


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def shared_prefixes(seqs: list[tuple[str | None, list[int]]], cached: list[int],
                    min_tokens: int) -> list[tuple[int, list[int]]]:
    """Prefixes worth computing once for several of ``seqs`` ((adapter, tokens) rows, of which ``cached[i]``
    tokens already have KV): (prefix length, its rows), every row left with at least one token of its own to run.

    Rows sorted by tokens sit next to those they share most with; a run of them becomes one prefix while it
    saves more than it loses: with n rows sharing p tokens, a row sharing l joins when n·min(p, l) ≥ (n-1)·p.
    A prefix is kept for its rows that have at least ``min_tokens`` more of it than they have cached, if two do."""
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i][0] is not None, seqs[i][0] or "", seqs[i][1]))
    runs: list[tuple[int, list[int]]] = []
    rows, shared = order[:1], 0
    for prev, row in pairwise(order):
        (lora_a, a), (lora_b, b) = seqs[prev], seqs[row]
        common = min(_common_length(a, b), len(a) - 1, len(b) - 1) if lora_a == lora_b else 0
        n = len(rows)
        if common >= min_tokens if n == 1 else n * min(shared, common) >= (n - 1) * shared:
            shared = common if n == 1 else min(shared, common)
            rows.append(row)
        else:
            runs.append((shared, rows))
            rows, shared = [row], 0
    runs.append((shared, rows))
    out = []
    for length, members in runs:
        gaining = [i for i in members if cached[i] + min_tokens <= length]
        if len(gaining) >= 2:
            out.append((length, gaining))
    return out
