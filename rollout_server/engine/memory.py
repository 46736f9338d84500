"""Giving the device back between rollouts (SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation``), so a colocated trainer can use the memory the engine held.

The tags are SGLang's. ``weights`` frees every parameter (a tied pair once) and resuming allocates them again
uninitialised, as SGLang does without ``--enable-weights-cpu-backup``: the weights must be loaded in full
before generation continues, and the scheduler refuses to continue until they are. ``kv_cache`` drops the KV
of the requests in flight (they are retracted and prefilled again on continue); the engine keeps KV per batch
only, so nothing else is cached. ``cuda_graph`` holds nothing here and is accepted for compatibility.

Prepared weights (the embedded engine's ``/prepare_weights_from_disk``): a full checkpoint is copied, while the
engine generates, into a second set of parameter tensors, so the load inside the pause only points the
Parameters at them (microseconds, where copying every weight is a memcpy of the model). The storage swapped
out is kept as that second set for the next prepare, which then writes into warm pages: one more copy of the
weights in memory, reported as ``rollwave_engine_memory_bytes{kind="spare_weights"}`` and freed with the
``weights`` tag. A prepared set also carries the KV the scheduler computed under it before the swap
(``Scheduler.prefill_ahead``), which the load puts in the prefix cache for the requests its pause retracted.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

import torch
from torch import nn

from rollout_server.engine.prefix_cache import Layers
from rollout_server.engine.weights import copy_into

TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_tags(tags: list[str] | None) -> tuple[str, ...]:
    """The tags a request names (None or [] means all, as SGLang); ValueError names an unknown one."""
    if not tags:
        return TAGS
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"tags: unknown {unknown}; expected a subset of {list(TAGS)}")
    return tuple(dict.fromkeys(tags))


class PreparedWeights:
    """A full checkpoint copied into tensors laid out as the parameters, for ``ModelMemory.swap_in``, and the KV
    that the scheduler computed under it ahead of the swap (``Scheduler.prefill_ahead``)."""

    def __init__(self, key: Hashable, tensors: dict[int, torch.Tensor]) -> None:
        self.key = key
        self.tensors = tensors  # by id of the Parameter they replace
        self.ahead: list[tuple[list[int], Layers]] = []  # (tokens, their KV under these weights)


class ModelMemory:
    """The parameters of a served model, which can be freed and allocated again in place (same Parameter
    objects, so hooks and tied names stay valid), and the prepared and spare copies of them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._freed: set[int] = set()  # parameters released and not allocated again
        self._unloaded: set[int] = set()  # allocated again since a release, not yet loaded
        self._names: dict[int, list[str]] = {}
        self._params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), []).append(name)
            self._params[id(p)] = p
        self._layout = {i: (p.shape, p.dtype, p.device) for i, p in self._params.items()}
        self._lock = threading.Lock()  # the two slots below; prepares run off the scheduler thread
        self._spare: dict[int, torch.Tensor] = {}
        self._prepared: PreparedWeights | None = None

    @property
    def released(self) -> bool:
        return bool(self._freed)

    @property
    def needs_load(self) -> bool:
        """Some parameter holds no weights, or uninitialised ones."""
        return bool(self._freed or self._unloaded)

    def missing(self) -> list[str]:
        """One name per parameter whose weights are gone (freed, or allocated again but not loaded)."""
        return [self._names[i][0] for i in (*self._freed, *self._unloaded)]

    def weight_bytes(self) -> int:
        """Bytes the parameters hold now."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def spare_bytes(self) -> int:
        """Bytes the spare and prepared copies hold now."""
        with self._lock:
            sets = [self._spare, self._prepared.tensors if self._prepared else {}]
        return sum(t.numel() * t.element_size() for s in sets for t in s.values())

    def prepare(self, key: Hashable, tensors: dict[str, torch.Tensor]) -> PreparedWeights | None:
        """Copy a full, checked checkpoint (``{name: tensor}``, one name per tied group enough) into the spare
        set and hold it under ``key`` for ``take_prepared``; returns what is held. Runs off the scheduler thread:
        no parameter holds the spare. Nothing is held while the weights are released."""
        with self._lock:
            spare, self._spare = self._spare, {}
            self._prepared = None
        filled: dict[int, torch.Tensor] = {}
        for i, (shape, dtype, device) in self._layout.items():
            src = next(tensors[n] for n in self._names[i] if n in tensors)
            dst = spare.pop(i, None)
            if dst is None:
                dst = torch.empty(shape, dtype=dtype, device=device)
            copy_into(dst, src.to(dtype))
            filled[i] = dst
        with self._lock:
            if not self.released:
                self._prepared = PreparedWeights(key, filled)
            return self._prepared

    def holds(self, prepared: PreparedWeights) -> bool:
        """``prepared`` is still the set the next load of its key swaps in (not taken, replaced or released)."""
        with self._lock:
            return self._prepared is prepared

    def take_prepared(self, key: Hashable) -> PreparedWeights | None:
        """The weights prepared under ``key``, once; a set prepared under another key becomes the spare."""
        with self._lock:
            prepared, self._prepared = self._prepared, None
            if prepared is None or prepared.key == key:
                return prepared
            self._spare = prepared.tensors
        return None

    def swap_in(self, prepared: PreparedWeights) -> None:
        """Point every parameter at its prepared tensor (scheduler thread, between steps); the storage they
        held becomes the spare set."""
        old = self._point(prepared.tensors)
        self._unloaded.clear()
        with self._lock:
            self._spare = old

    @contextlib.contextmanager
    def serving(self, prepared: PreparedWeights) -> Iterator[None]:
        """The model runs on ``prepared`` inside the block and on its own weights again after it (scheduler
        thread, between steps)."""
        old = self._point(prepared.tensors)
        try:
            yield
        finally:
            self._point(old)

    def _point(self, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Point the parameters at ``tensors`` (by id); returns what they held."""
        old = {}
        for i, tensor in tensors.items():
            p = self._params[i]
            old[i], p.data = p.data, tensor
        return old

    def release(self) -> None:
        for p in self.model.parameters():
            if id(p) not in self._freed:
                self._freed.add(id(p))
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        with self._lock:  # after _freed is set, so a prepare finishing now holds nothing
            self._spare, self._prepared = {}, None

    def resume(self) -> None:
        for p in self.model.parameters():
            if id(p) in self._freed:
                self._freed.discard(id(p))
                shape, dtype, device = self._layout[id(p)]
                p.data = torch.empty(shape, dtype=dtype, device=device)
                self._unloaded.add(id(p))

    def loaded(self, names: set[str]) -> None:
        """``names`` were just written: their parameters hold weights again."""
        self._unloaded = {i for i in self._unloaded if not names.intersection(self._names[i])}
