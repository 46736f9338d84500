"""A LoRA adapter as it travels between the trainer and the engines: peft's directory layout, and the
checksum both sides compute so that a delivered adapter is verified, not assumed.

The directory is what ``peft``'s ``save_pretrained`` writes and SGLang's ``/load_lora_adapter`` reads:
``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and ``adapter_model.safetensors``
with tensors named ``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r]).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def adapter_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """zlib.crc32 over every tensor's name and raw bytes, in name order, as 8 hex digits. The trainer computes
    it over what it pushes and the engine over what it loaded, so a stale or corrupted adapter shows."""
    crc = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"
