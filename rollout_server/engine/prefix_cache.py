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

A request also takes the KV of a prefix it shares with an entry without extending it, in whole blocks of
``BLOCK_TOKENS`` (found by chained block hashes, as vLLM's prefix caching and SGLang's paged radix cache do):
a new task's first turn reuses the system prompt and tool schema that every episode begins with, and, after a
load emptied the cache, an episode's next turn reuses the prompt its group's first finished sibling computed
again (async 1.125x faster for it in ``bench/e2e.py``'s runs, bench/RESULTS.md). Requests
prefilled together often share a prefix that no entry holds: a group's samples after a swap retracted them
(the prompt), episodes of different tasks. ``shared_prefixes`` finds those, so the prefill computes each once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, keys and values [heads, tokens, head_dim]
Key = tuple[str | None, tuple[int, ...]]  # an entry's adapter and tokens


BLOCK_TOKENS = 16  # the cache matches prefixes in blocks of this many tokens, as vLLM's prefix caching does


@dataclass(eq=False)
class Prefix:
    """One entry: ``tokens`` and their KV, computed with adapter ``lora`` (None: the base model)."""

    tokens: list[int]
    lora: str | None
    layers: Layers
    key: Key = field(init=False)
    blocks: list[int] = field(default_factory=list)  # the chained hash of each whole block of ``tokens``

    def __post_init__(self) -> None:
        self.key = (self.lora, tuple(self.tokens))

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def head(self, n: int) -> Layers:
        """The KV of the first ``n`` tokens (views)."""
        return [(k[:, :n], v[:, :n]) for k, v in self.layers]


@dataclass
class Hit:
    """What the cache holds of a request's tokens: the first ``tokens`` of ``entry``'s KV are its own."""

    entry: Prefix
    tokens: int

    @property
    def extends(self) -> bool:
        """The request's tokens begin with the whole entry (a multi-turn episode's next turn)."""
        return self.tokens == len(self.entry.tokens)


def _chained_hashes(tokens: list[int], lora: str | None, block: int) -> Iterator[tuple[int, int]]:
    """(end, hash) of each whole block of ``tokens``: each hash covers the adapter and the whole prefix up to end."""
    h = hash(lora)
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, *tokens[start:start + block]))
        yield start + block, h


class PrefixCache:
    """Entries by recency; the scheduler thread owns it (``nbytes`` may be read from any thread)."""

    def __init__(self, max_tokens: int, block: int = BLOCK_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.block = block
        # by recency, the least recent first. A dict, not an OrderedDict: iterating an OrderedDict looks each key up
        # again, and hashing these keys (whole token tuples) made a scan of 70 entries cost ~120 us, not ~5
        self._entries: dict[Key, Prefix] = {}
        self._by_block: dict[int, dict[Key, None]] = {}  # a block's chained hash -> the entries holding it, in order
        self._tokens = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return self._tokens

    def lookup(self, tokens: list[int], lora: str | None) -> Hit | None:
        """What the entries computed with ``lora`` hold of ``tokens``: the longest entry they extend, or, where
        another shares more with them, that one's KV up to the last whole block they share (None: neither)."""
        hit = None
        n = len(tokens)
        for entry in self._entries.values():
            m = len(entry.tokens)
            if (m <= n and entry.lora == lora and (hit is None or m > hit.tokens)
                    and entry.tokens[-1] == tokens[m - 1] and entry.tokens == tokens[:m]):
                hit = Hit(entry, m)
        sharing: dict[Key, None] = {}
        shared = 0
        for end, h in _chained_hashes(tokens, lora, self.block):
            if h not in self._by_block:
                break
            sharing, shared = self._by_block[h], end
        if shared > (0 if hit is None else hit.tokens):
            # the newest entry that shares them (checked: hashes may collide)
            entry = next((e for e in map(self._entries.get, reversed(sharing))
                          if e.lora == lora and e.tokens[:shared] == tokens[:shared]), None)
            if entry is not None:
                hit = Hit(entry, shared)
        if hit is not None:
            self._touch(hit.entry.key)
        return hit

    def insert(self, tokens: list[int], lora: str | None, layers: Layers, replaces: Prefix | None = None) -> None:
        """Keep ``layers`` (copied) as the KV of ``tokens``; ``replaces``, the entry they extend, leaves."""
        if replaces is not None and self._entries.get(replaces.key) is replaces:
            self._drop(replaces)
        key = (lora, tuple(tokens))
        if key in self._entries:  # the same tokens again (a group's samples that agree)
            self._touch(key)
            return
        if not tokens or len(tokens) > self.max_tokens:
            return
        entry = Prefix(list(tokens), lora, [(k.clone(), v.clone()) for k, v in layers])
        entry.blocks = [h for _, h in _chained_hashes(entry.tokens, lora, self.block)]
        self._entries[entry.key] = entry
        for h in entry.blocks:
            self._by_block.setdefault(h, {})[entry.key] = None
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
        self._by_block.clear()
        self._tokens = self.nbytes = 0

    def _touch(self, key: Key) -> None:
        self._entries[key] = self._entries.pop(key)  # the most recent now

    def _drop(self, entry: Prefix) -> None:
        del self._entries[entry.key]
        for h in entry.blocks:
            sharing = self._by_block[h]
            del sharing[entry.key]
            if not sharing:
                del self._by_block[h]
        self._tokens -= len(entry.tokens)
        self.nbytes -= entry.nbytes


def past_length(past: Layers | None) -> int:
    """Tokens whose KV ``past`` holds (0: none)."""
    return 0 if past is None else past[0][0].shape[-2]


def common_length(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
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
        common = min(common_length(a, b), len(a) - 1, len(b) - 1) if lora_a == lora_b else 0
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
