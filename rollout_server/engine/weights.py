"""Swapping weights into the running model: from an HF directory, or from serialized named tensors.

Everything is checked (names, shapes) before the first tensor is copied, so a bad update leaves the
old weights in place and the error names the offending tensor or file.

Wire format of ``/update_weights_from_tensor`` for this engine: each ``serialized_named_tensors``
element is base64 of either a safetensors blob (``safetensors.torch.save({name: tensor})``) or of
``torch.save([(name, tensor), ...])``
(loaded with ``weights_only=True``). SGLang's own format (ForkingPickler, CUDA IPC handles) cannot
cross processes on a CPU host.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from core.model_dir import missing_tokenizer


class WeightError(ValueError):
    """An update that cannot be applied; the message names the tensor or file."""


def read_hf_dir(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files of an HF model directory (sharded or not)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise WeightError(f"model_path {root}: not a directory")
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise WeightError(f"{index}: not a safetensors index ({exc})") from exc
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise WeightError(f"model_path {root}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(root / name))
        except (OSError, SafetensorError) as exc:
            raise WeightError(f"{root / name}: cannot read safetensors ({exc})") from exc
    return tensors


def decode_named_tensors(payload: str | bytes) -> dict[str, torch.Tensor]:
    """One ``serialized_named_tensors`` element (see the module docstring) as ``{name: tensor}``."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except ValueError as exc:
        raise WeightError(f"serialized_named_tensors: not base64 ({exc})") from exc
    if raw[:4] == b"PK\x03\x04":
        try:
            items = torch.load(io.BytesIO(raw), weights_only=True)
        except (RuntimeError, ValueError, EOFError) as exc:
            raise WeightError(f"serialized_named_tensors: cannot torch.load ({exc})") from exc
        if not isinstance(items, list | tuple) or not all(
            isinstance(it, list | tuple) and len(it) == 2 and isinstance(it[1], torch.Tensor) for it in items
        ):
            raise WeightError("serialized_named_tensors: torch.save payload must be a list of (name, tensor)")
        return {str(name): tensor for name, tensor in items}
    try:
        return load_safetensors_bytes(raw)
    except SafetensorError as exc:
        raise WeightError(f"serialized_named_tensors: neither torch.save zip nor safetensors ({exc})") from exc


def load_into(model: PreTrainedModel, tensors: dict[str, torch.Tensor], *, require_all: bool) -> None:
    """Copy ``tensors`` into ``model`` after checking every name and shape (``check_tensors``)."""
    check_tensors(model, tensors, require_all=require_all)
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in tensors.items():
            copy_into(state[name], tensor.to(state[name].dtype))


def check_tensors(model: PreTrainedModel, tensors: dict[str, torch.Tensor], *, require_all: bool) -> None:
    """WeightError naming the first tensor that is not a parameter of ``model`` or has the wrong shape.

    ``require_all`` (a full checkpoint) also demands every parameter; of tied parameters (one storage
    under several names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) one name suffices.
    """
    state = model.state_dict()
    for name, tensor in tensors.items():
        if name not in state:
            raise WeightError(f"tensor {name!r} is not a parameter of the model")
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise WeightError(
                f"tensor {name!r} has shape {list(tensor.shape)}, the model expects {list(state[name].shape)}"
            )
        if not (tensor.is_floating_point() or tensor.dtype == state[name].dtype):
            raise WeightError(f"tensor {name!r} has dtype {tensor.dtype}, the model holds {state[name].dtype}")
    if require_all:
        groups: dict[int, list[str]] = {}
        for name, tensor in state.items():
            groups.setdefault(tensor.data_ptr(), []).append(name)
        for names in groups.values():
            if not any(n in tensors for n in names):
                raise WeightError(f"tensor {names[0]!r} is missing from the checkpoint")


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Single-threaded memcpy for contiguous CPU tensors: torch's multi-threaded ``copy_`` is several
    times slower on a loaded machine, and an unprepared load copies inside the weight-swap pause."""
    if dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous():
        np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def load_model(model_dir: str | Path, dtype: str = "auto"
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, frozenset[int]]:
    """The model in eval mode with its weights in ``dtype`` (``auto``: the checkpoint's, as SGLang's
    ``--dtype auto``; bfloat16 runs on CPU too), its tokenizer, and every end-of-sequence id it declares."""
    if (why := missing_tokenizer(Path(model_dir))) is not None:
        raise ValueError(why)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    model.eval()
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(
            f"{model_dir}: layer types {sorted(layer_types)}; the embedded engine runs full attention only"
        )
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos: set[int] = set()
    for source in (
        model.config.eos_token_id,
        getattr(model.generation_config, "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
        eos.update(source if isinstance(source, list) else [] if source is None else [source])
    return model, tokenizer, frozenset(eos)
