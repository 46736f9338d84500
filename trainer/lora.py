"""LoRA on the policy: peft adds the adapter before FSDP2 shards the model, only the adapter trains, and a
push or an export carries the adapter's tensors under peft's saved names (``core.lora``).

Dropout (``model.lora.dropout``) acts in the training forward only: the proximal and reference passes run
without gradients and see the adapter without dropout, the same function the engines serve. So with dropout
the training forward cannot stand in for π_prox, and the step computes it in its no-grad pass even for a single
update (``has_dropout``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from core.config import ConfigError, LoraConfig
from trainer.parallel import hf_name
from trainer.snapshot import TensorMeta, cast_metas

if TYPE_CHECKING:
    import peft

ADAPTER = "default"  # peft's name for the one adapter; saved tensor names leave it out


def add_adapter(model: PreTrainedModel, lora: LoraConfig, seed: int = 0, base_model: str = "") -> peft.PeftModel:
    """``model`` with a fresh adapter (B = 0, so it computes what ``model`` did), its base frozen. ``seed`` makes
    the A matrices the same on every rank and every run. ConfigError where ``target_modules`` names a module the
    engines cannot serve an adapter on (they hook Linear modules only): refused at the trainer's start, not at
    every push. The adapter's dropout alone follows the grad mode; the base model's own stays as it is (off).
    peft is imported here, by a LoRA run only: importing ``trainer.__main__`` took 3.8-4.4 s without it, 4.7-5.1 s
    with."""
    import peft

    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                             lora_dropout=lora.dropout, base_model_name_or_path=base_model or None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config)
    for name, module in model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer):
            continue
        if not isinstance(module, peft.tuners.lora.Linear):
            kind = type(module.get_base_layer()).__name__
            raise ConfigError(f"model.lora.target_modules: {name!r} ({kind}) is not a Linear: the engines serve "
                              "adapters on Linear modules only")
        for dropout in module.lora_dropout.values():
            dropout.register_forward_pre_hook(_dropout_only_with_grad)
    return wrapped


def _dropout_only_with_grad(module: nn.Module, _args: object) -> None:
    module.training = torch.is_grad_enabled()


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries an adapter: never where peft was not imported (``add_adapter`` imports it)."""
    loaded = sys.modules.get("peft")
    return loaded is not None and isinstance(model, loaded.PeftModel)


def has_dropout(model: nn.Module) -> bool:
    """Whether the training forward drops adapter inputs (``model.lora.dropout > 0``): then it is not the
    function the engines serve, which the no-grad forward is."""
    return is_lora(model) and model.peft_config[ADAPTER].lora_dropout > 0


def saved_name(param_name: str) -> str:
    """A trainable parameter's name as peft saves it (``...q_proj.lora_A.weight``)."""
    return hf_name(param_name).replace(f".{ADAPTER}.", ".")


def _adapter_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in model.named_parameters():
        if param.requires_grad:
            yield saved_name(name), param


def adapter_metas(model: nn.Module, dtypes: Mapping[str, torch.dtype] | None = None) -> list[TensorMeta]:
    """Manifest entries of the adapter in ``iter_adapter_params`` order, from metadata alone."""
    return cast_metas([TensorMeta(n, p.dtype, tuple(p.shape)) for n, p in _adapter_params(model)], dtypes)


def iter_adapter_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(saved name, full tensor)`` of each adapter parameter, gathered like ``iter_full_params`` (a collective:
    every rank iterates in step; rank 0 gets the tensors, others None)."""
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    for name, param in _adapter_params(model):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, (full.detach() if is_main else None)
        del full


def adapter_config_json(model: peft.PeftModel) -> str:
    """``adapter_config.json`` of ``model``'s adapter, as peft writes it."""
    return json.dumps(model.peft_config[ADAPTER].to_dict(), default=sorted, sort_keys=True)
