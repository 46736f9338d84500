"""Giving the device back between rollouts (SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation``), so a colocated trainer can use the memory the engine held.

The tags are SGLang's. ``weights`` frees every parameter (a tied pair once) and resuming allocates them again
uninitialised, as SGLang does without ``--enable-weights-cpu-backup``: the weights must be loaded in full
before generation continues, and the scheduler refuses to continue until they are. ``kv_cache`` drops the KV
of the requests in flight (they are retracted and prefilled again on continue); the engine keeps KV per batch
only, so nothing else is cached. ``cuda_graph`` holds nothing here and is accepted for compatibility.
"""

from __future__ import annotations

import torch
from torch import nn

TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_tags(tags: list[str] | None) -> tuple[str, ...]:
    """The tags a request names (None or [] means all, as SGLang); ValueError names an unknown one."""
    if not tags:
        return TAGS
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"tags: unknown {unknown}; expected a subset of {list(TAGS)}")
    return tuple(dict.fromkeys(tags))


class ModelMemory:
    """The parameters of a served model, which can be freed and allocated again in place (same Parameter
    objects, so hooks and tied names stay valid)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._freed: dict[int, tuple[torch.Size, torch.dtype, torch.device]] = {}
        self._unloaded: set[int] = set()  # allocated again since a release, not yet loaded
        self._names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self._names.setdefault(id(p), []).append(name)

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

    def release(self) -> None:
        for p in self.model.parameters():
            if id(p) not in self._freed:
                self._freed[id(p)] = (p.shape, p.dtype, p.device)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def resume(self) -> None:
        for p in self.model.parameters():
            if id(p) in self._freed:
                shape, dtype, device = self._freed.pop(id(p))
                p.data = torch.empty(shape, dtype=dtype, device=device)
                self._unloaded.add(id(p))

    def loaded(self, names: set[str]) -> None:
        """``names`` were just written: their parameters hold weights again."""
        self._unloaded = {i for i in self._unloaded if not names.intersection(self._names[i])}
