"""A left-padded batch of sequences that share one KV cache, so ragged requests decode in one forward.

Row ``i`` holds its ``lengths[i]`` real tokens at the right end of the cache; the columns to their left
are padding, masked out of attention. Positions (RoPE) count real tokens only, so a row's keys and
values are the same as if it ran alone, up to fp32 noise. Rows join by ``merge`` (the shorter cache is
padded on the left) and leave by ``keep`` (columns that became all padding are dropped).

Each layer's keys and values live in a buffer with spare capacity (``_GrowingLayer``), so a decode step
writes one column instead of concatenating the whole cache as transformers' ``DynamicLayer`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from core.transformers_compat import CACHE_ARG
from rollout_server.engine.prefix_cache import Layers, past_length


class KVBatch:
    """The KV cache, attention mask and per-row lengths of the running sequences."""

    def __init__(self, cache: Cache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        self._set(cache, mask, lengths)

    def _set(self, cache: Cache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # [B, L] int64, 1 on real tokens
        self.lengths = lengths  # [B] int64, real tokens in the cache per row
        self._padded = bool((lengths < mask.shape[1]).any())

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes the cache buffers hold (spare capacity included)."""
        return sum(layer.nbytes for layer in self.cache.layers)

    @classmethod
    def prefill(
        cls, model: PreTrainedModel, seqs: list[list[int]], past: list[Layers | None] | None = None
    ) -> tuple[KVBatch, torch.Tensor, list[int]]:
        """Run ``seqs`` through the model; returns the batch, the next-token logits ``[B, V]`` and how many
        tokens of each row came from ``past``.

        ``past[i]``, when given, is the KV of a prefix of ``seqs[i]`` shorter than it (a prefix cache's entry).
        The forward runs the same number of columns for every row, the longest uncached rest, so a row takes
        from its past what lies before those columns and runs the rest again.
        """
        lengths = [len(s) for s in seqs]
        cached = [past_length(p) for p in past or [None] * len(seqs)]
        width = max(lengths)
        span = max(n - c for n, c in zip(lengths, cached, strict=True))  # columns the forward runs
        reused = [max(0, n - span) for n in lengths]
        ids = torch.zeros(len(seqs), span, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, (seq, r) in enumerate(zip(seqs, reused, strict=True)):
            ids[i, span - len(seq) + r :] = torch.tensor(seq[r:], dtype=torch.long)
            mask[i, width - len(seq) :] = 1
        padded = any(n < width for n in lengths)
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, width - span :]
        cache = Cache(layers=[_GrowingLayer() for _ in range(model.config.num_hidden_layers)])
        if width > span:
            first = next(p for p, r in zip(past, reused, strict=True) if r)
            for index, layer in enumerate(cache.layers):
                k0 = first[index][0]
                keys = k0.new_zeros(len(seqs), k0.shape[0], width - span, k0.shape[-1])
                values = keys.clone()
                for i, r in enumerate(reused):
                    if r:
                        keys[i, :, width - span - r :] = past[i][index][0][:, :r]
                        values[i, :, width - span - r :] = past[i][index][1][:, :r]
                layer.load(keys, values, room=span + 64)
        out = model(
            input_ids=ids,
            attention_mask=mask if padded else None,
            position_ids=positions,
            **{CACHE_ARG: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return cls(cache, mask, torch.tensor(lengths)), out.logits[:, -1, :], reused

    def row(self, i: int) -> Layers:
        """Row ``i``'s keys and values over its real tokens (views into the batch's buffers)."""
        n = int(self.lengths[i])
        return [(layer.keys[i, :, -n:], layer.values[i, :, -n:]) for layer in self.cache.layers]

    def decode(self, model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``[B]``); returns the next-token logits ``[B, V]``.

        The padding mask goes in as the 4-D boolean one attention takes (``[B, 1, 1, L]``, true where a row attends),
        which transformers passes through as it is: built by transformers from the 2-D mask at every step, it cost
        0.3-0.5 ms of CPU a step (``bench/decode_mask.py``: 8 rows 2.76 ms against 2.29, 29 rows 4.15 against 3.83)."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        out = model(
            input_ids=tokens[:, None],
            attention_mask=self.mask.bool()[:, None, None, :] if self._padded else None,
            position_ids=self.lengths[:, None],
            **{CACHE_ARG: self.cache},
            use_cache=True,
        )
        self.lengths = self.lengths + 1
        return out.logits[:, -1, :]

    def merge(self, other: KVBatch) -> None:
        """Append ``other``'s rows after ours (one copy of each into a new buffer, the shorter left-padded)."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        layers = [_GrowingLayer().stack(a, b, width) for a, b in zip(self.cache.layers, other.cache.layers,
                                                                     strict=True)]
        mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self._set(Cache(layers=layers), mask, torch.cat([self.lengths, other.lengths]))

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and drop the columns that are padding in all of them.

        Where each row stays where it is or comes from beyond the kept ones (rows leaving, the last ones filling
        their places), only the rows that move are copied, in place, as long as the rows kept are at least half
        those the buffers hold (the rows that left never hold more memory than the live ones); otherwise every
        kept row is copied once, into buffers of their size."""
        index = torch.tensor(rows, dtype=torch.long)
        lengths = self.lengths[index]
        start = self.mask.shape[1] - int(lengths.max())
        moved = [(to, row) for to, row in enumerate(rows) if row != to]
        if all(row >= len(rows) for _, row in moved) and 2 * len(rows) >= self.cache.layers[0].rows_held:
            for layer in self.cache.layers:
                layer.compact(moved, len(rows), start)
            cache = self.cache
        else:
            cache = Cache(layers=[_GrowingLayer().gather(layer, index, start) for layer in self.cache.layers])
        self._set(cache, self.mask[index, start:], lengths)


class _GrowingLayer(DynamicLayer):
    """A full-attention cache layer over a buffer with spare capacity along the sequence dim.

    ``keys``/``values`` are views of the first ``n`` columns; an update copies only the new columns and
    reallocates (doubling) when the buffer is full. Built by ``Cache(layers=...)``, transformers' hook for
    custom cache layers.
    """

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._n = 0

    @property
    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in (self._kbuf, self._vbuf) if b is not None)

    @property
    def rows_held(self) -> int:
        """Rows the buffers hold, those ``compact`` left behind included."""
        assert self._kbuf is not None
        return self._kbuf.untyped_storage().nbytes() // (self._kbuf.stride(0) * self._kbuf.element_size())

    def load(self, keys: torch.Tensor, values: torch.Tensor, room: int = 64) -> _GrowingLayer:
        """Start from ``[B, H, L, D]`` tensors (copied, with room for ``room`` more columns)."""
        self.lazy_initialization(keys, values)
        self._kbuf = self._vbuf = None
        self._n = 0
        self._write(keys, values, extra=room)
        return self

    def gather(self, source: _GrowingLayer, index: torch.Tensor, start: int, room: int = 64) -> _GrowingLayer:
        """Start from rows ``index`` of ``source``'s columns from ``start`` on, copied once into the new buffer."""
        keys, values = source.keys[:, :, start:], source.values[:, :, start:]
        self._allocate(keys, len(index), keys.shape[-2], room)
        n = self._n
        with torch.no_grad():  # a cache never carries gradients (and out= refuses tensors that might)
            torch.index_select(keys, 0, index, out=self._kbuf[:, :, :n])
            torch.index_select(values, 0, index, out=self._vbuf[:, :, :n])
        return self

    def compact(self, moved: list[tuple[int, int]], rows: int, start: int) -> None:
        """In place: copy row ``src`` onto row ``dst`` for each ``(dst, src)`` of ``moved`` (every ``src`` at or
        beyond ``rows``), then keep the first ``rows`` rows from column ``start`` on (views of the same buffers)."""
        assert self._kbuf is not None and self._vbuf is not None
        n = self._n
        with torch.no_grad():
            for buf in (self._kbuf, self._vbuf):
                for dst, src in moved:
                    buf[dst, :, start:n] = buf[src, :, start:n]
        self._kbuf, self._vbuf, self._n = self._kbuf[:rows, :, start:], self._vbuf[:rows, :, start:], n - start
        self.keys = self._kbuf[:, :, : self._n]
        self.values = self._vbuf[:, :, : self._n]

    def stack(self, first: _GrowingLayer, second: _GrowingLayer, width: int, room: int = 64) -> _GrowingLayer:
        """Start from ``first``'s rows then ``second``'s, each left-padded with zeros to ``width`` columns."""
        self._allocate(first.keys, first.keys.shape[0] + second.keys.shape[0], width, room)
        at = 0
        with torch.no_grad():
            for layer in (first, second):
                rows, n = layer.keys.shape[0], layer.keys.shape[-2]
                for buf, part in ((self._kbuf, layer.keys), (self._vbuf, layer.values)):
                    buf[at : at + rows, :, : width - n].zero_()  # padding: masked out, but never NaN
                    buf[at : at + rows, :, width - n : width] = part
                at += rows
        return self

    def _allocate(self, like: torch.Tensor, rows: int, n: int, room: int) -> None:
        self.lazy_initialization(like, like)
        shape = (rows, like.shape[1], n + room, like.shape[3])
        self._kbuf, self._vbuf, self._n = like.new_empty(shape), like.new_empty(shape), n
        self.keys = self._kbuf[:, :, :n]
        self.values = self._vbuf[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._write(key_states, value_states, extra=self._n + 64)
        return self.keys, self.values

    def _write(self, k: torch.Tensor, v: torch.Tensor, extra: int) -> None:
        n, q = self._n, k.shape[-2]
        if self._kbuf is None or n + q > self._kbuf.shape[-2]:
            kbuf = k.new_empty(k.shape[0], k.shape[1], n + q + extra, k.shape[3])
            vbuf = v.new_empty(v.shape[0], v.shape[1], n + q + extra, v.shape[3])
            if n:
                kbuf[:, :, :n] = self._kbuf[:, :, :n]
                vbuf[:, :, :n] = self._vbuf[:, :, :n]
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[:, :, n : n + q] = k
        self._vbuf[:, :, n : n + q] = v
        self._n = n + q
        self.keys = self._kbuf[:, :, : self._n]
        self.values = self._vbuf[:, :, : self._n]
