"""LoRA adapters in the embedded engine, applied in the forward, never merged into the base weights.

An adapter is read from a peft directory (``core.lora``) and checked against the served model before anything
changes: every tensor's module must be a Linear of the model, every ``lora_A`` [r, in] needs its ``lora_B``
[out, r], nothing else may be there. Reading and casting happen off the scheduler thread; installing is a dict
update and, for new target modules, a forward hook, so loading an adapter costs generation a pointer swap.

Each request names at most one adapter (SGLang's ``lora_path``) or none (the base model). Before every forward
the scheduler gives ``AdapterSet.rows`` the adapter of each batch row, and each hooked Linear adds
``scale * (x @ A.T) @ B.T`` to the rows of each adapter: a batch may mix adapters and base rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, adapter_checksum
from rollout_server.engine.weights import WeightError

_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class Adapter:
    """One adapter ready to serve: per target module, A [r, in] and B [out, r] in the model's dtype."""

    path: str
    checksum: str  # core.lora.adapter_checksum of the tensors as the file holds them
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(model: nn.Module, path: str | Path) -> Adapter:
    """Read and check the peft adapter directory ``path`` for ``model``; WeightError names the file and tensor."""
    root = Path(path)
    config_file, weights_file = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    try:
        config = json.loads(config_file.read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except FileNotFoundError:
        raise WeightError(f"{config_file}: no such file (a peft adapter directory is expected)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightError(f"{config_file}: not a peft LoRA config ({exc!r})") from None
    try:
        tensors = load_file(weights_file)
    except FileNotFoundError:
        raise WeightError(f"{weights_file}: no such file") from None
    except (OSError, SafetensorError) as exc:
        raise WeightError(f"{weights_file}: cannot read safetensors ({exc})") from None
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in sorted(tensors):
        if not (name.startswith(PREFIX) and name.endswith((_A, _B))):
            raise WeightError(f"{weights_file}: tensor {name!r} is not a LoRA A or B weight ({PREFIX}<module>"
                              f"{_A} or {_B})")
        module_name = name[len(PREFIX):].removesuffix(_A).removesuffix(_B)
        if module_name in weights:
            continue
        module = modules.get(module_name)
        if not isinstance(module, nn.Linear):
            raise WeightError(f"{weights_file}: tensor {name!r}: the model has no Linear module {module_name!r}")
        a, b = (tensors.get(f"{PREFIX}{module_name}{suffix}") for suffix in (_A, _B))
        if a is None or b is None:
            missing = f"{PREFIX}{module_name}{_A if a is None else _B}"
            raise WeightError(f"{weights_file}: tensor {missing!r} is missing (A and B come in pairs)")
        want_a, want_b = (rank, module.in_features), (module.out_features, rank)
        for tensor_name, tensor, want in ((f"{module_name}{_A}", a, want_a), (f"{module_name}{_B}", b, want_b)):
            if tuple(tensor.shape) != want:
                raise WeightError(f"{weights_file}: tensor {PREFIX}{tensor_name!r} has shape {list(tensor.shape)}, "
                                  f"r={rank} and the model's {module_name} need {list(want)}")
        weights[module_name] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not weights:
        raise WeightError(f"{weights_file}: no LoRA tensors")
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    return Adapter(str(root), adapter_checksum(tensors), scale, weights)


class AdapterSet:
    """The adapters an engine serves by name, and the hooks that apply them row by row. Scheduler thread only."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.loaded: dict[str, Adapter] = {}
        self.rows: list[str | None] = []  # the adapter of each row of the next forward
        self._modules = dict(model.named_modules())
        self._hooks: dict[str, Any] = {}

    def install(self, name: str, adapter: Adapter) -> None:
        """Serve ``adapter`` as ``name``, replacing an adapter of that name."""
        self.loaded[name] = adapter
        for module_name in adapter.weights:
            if module_name not in self._hooks:
                self._hooks[module_name] = self._modules[module_name].register_forward_hook(self._hook(module_name))

    def remove(self, name: str) -> None:
        del self.loaded[name]
        used = {m for a in self.loaded.values() for m in a.weights}
        for module_name in [m for m in self._hooks if m not in used]:
            self._hooks.pop(module_name).remove()

    def _hook(self, module_name: str) -> Any:
        def add_delta(_module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            x, rows = args[0], self.rows
            for name in {r for r in rows if r is not None}:
                adapter = self.loaded[name]
                if module_name not in adapter.weights:
                    continue
                a, b = adapter.weights[module_name]
                if all(r == name for r in rows):
                    out = out + adapter.scale * ((x @ a.T) @ b.T)
                else:
                    idx = torch.tensor([i for i, r in enumerate(rows) if r == name])
                    out = out.index_add(0, idx, adapter.scale * ((x[idx] @ a.T) @ b.T))
            return out

        return add_delta

    def info(self) -> dict[str, dict[str, str]]:
        return {name: {"path": a.path, "checksum": a.checksum} for name, a in self.loaded.items()}
