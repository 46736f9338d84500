"""The KV of many sequences that share prefixes, each distinct token computed once (a prefix tree packed into rows).

A swap's ``prefill_ahead`` computes, under the new weights, the KV of every running request: the episodes share a
system prompt, a group's samples their prompt, and what sets them apart is short. A padded batch runs every row as
wide as the longest uncached rest (``KVBatch.prefill``): in the e2e bench's swaps, 12x the tokens that differ.
Here the prefix all sequences share runs once, alone; every other distinct prefix of the sequences, a node of their
prefix tree, is one token of a packed row. A token attends to the shared prefix and to its own ancestors in the
tree (a 4-D attention mask), at its position in its sequence, so its keys and values are those it would have in its
own sequence, up to float noise. Rows hold about ``row_tokens`` tokens each: attention costs each token the length of
its row, so one row holding the whole tree would cost the square of its size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from core.transformers_compat import CACHE_ARG
from rollout_server.engine.prefix_cache import Layers, common_length

ROW_TOKENS = 256  # tokens per packed row: in the e2e bench's swaps twice as many cost the same, half as many 50% more


@dataclass
class _Row:
    ids: list[int] = field(default_factory=list)  # the row's tokens
    positions: list[int] = field(default_factory=list)  # each one's position in its sequences
    paths: dict[int, list[int]] = field(default_factory=dict)  # sequence -> its tokens past the shared prefix


def tree_prefill(
    model: PreTrainedModel, seqs: list[list[int]], row_tokens: int = ROW_TOKENS
) -> tuple[list[Layers], int]:
    """The keys and values of every token of each of ``seqs`` (``[heads, len, dim]`` per layer), and how many
    tokens ran through the model: the distinct ones."""
    order = sorted(range(len(seqs)), key=seqs.__getitem__)
    shared = min([len(seqs[i]) for i in order]
                 + [common_length(seqs[a], seqs[b]) for a, b in zip(order, order[1:], strict=False)])
    past: Layers = []
    if shared:
        cache = DynamicCache()
        model(input_ids=torch.tensor([seqs[order[0]][:shared]]), **{CACHE_ARG: cache}, use_cache=True,
              logits_to_keep=1)
        past = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    rows = _pack(seqs, order, shared, row_tokens)
    result = [past] * len(seqs)  # a sequence that is the shared prefix
    if not rows:
        return result, shared
    width = max(len(row.ids) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    mask = np.zeros((len(rows), width, shared + width), dtype=bool)
    mask[:, :, :shared] = True
    for r, row in enumerate(rows):
        n = len(row.ids)
        ids[r, :n] = torch.tensor(row.ids)
        positions[r, :n] = torch.tensor(row.positions)
        before: list[int] = []
        for path in row.paths.values():  # each token of a path attends to those before it on the path
            known = common_length(before, path)
            mask[r][np.ix_(path[known:], np.asarray(path) + shared)] = np.tri(len(path), dtype=bool)[known:]
            before = path
        mask[r, np.arange(n, width), shared + np.arange(n, width)] = True  # padding sees itself: no NaN
    cache = DynamicCache()
    for index, (keys, values) in enumerate(past):
        cache.update(keys.expand(len(rows), *keys.shape), values.expand(len(rows), *values.shape), index)
    model(input_ids=ids, attention_mask=torch.from_numpy(mask)[:, None], position_ids=positions,
          **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    for r, row in enumerate(rows):
        for i, path in row.paths.items():
            cols = torch.tensor(path) + shared
            own = [(layer.keys[r][:, cols], layer.values[r][:, cols]) for layer in cache.layers]
            if shared:
                own = [(torch.cat([pk, k], 1), torch.cat([pv, v], 1))
                       for (pk, pv), (k, v) in zip(past, own, strict=True)]
            result[i] = own
    return result, shared + sum(len(row.ids) for row in rows)


def _pack(seqs: list[list[int]], order: list[int], shared: int, row_tokens: int) -> list[_Row]:
    """Rows of the prefix tree past ``shared`` tokens, ``seqs`` taken in sorted ``order`` (each next to those it
    shares most with): a sequence adds its tokens past what it shares with the one before it in its row."""
    rows: list[_Row] = []
    last: int | None = None
    for i in order:
        seq = seqs[i]
        if len(seq) == shared:
            continue
        known = shared if last is None else common_length(seqs[last], seq)  # at least ``shared``
        if not rows or len(rows[-1].ids) + len(seq) - known > row_tokens:
            rows.append(_Row())
            known = shared
        row = rows[-1]
        start = len(row.ids)
        row.paths[i] = row.paths[last][: known - shared] if known > shared else []
        row.paths[i] += range(start, start + len(seq) - known)
        row.ids += seq[known:]
        row.positions += range(known, len(seq))
        last = i
    return rows
