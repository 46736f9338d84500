"""Prepared weights (``ModelMemory.prepare`` / ``swap_in``): a full checkpoint copied into spare parameter
tensors off the scheduler thread, then swapped in by pointer; the storage swapped out is written by the next
prepare, and releasing the weights frees both copies."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_helpers import perturbed_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout_server.engine.memory import ModelMemory
from rollout_server.engine.weights import WeightError, check_tensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Two perturbed versions of the tiny model as read from disk (tied: no lm_head.weight in the file)."""
    out = tmp_path_factory.mktemp("versions")
    return [load_file(perturbed_model(tiny_model_dir, out / str(s), seed=s) / "model.safetensors") for s in (1, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_weights_swap_in_and_their_storage_is_reused(
    tiny_model_dir: Path, checkpoints: list[dict[str, torch.Tensor]], dtype: torch.dtype
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
    memory = ModelMemory(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert "lm_head.weight" not in checkpoints[0] and params["lm_head.weight"] is params["model.embed_tokens.weight"]
    served = {name: p.data for name, p in params.items()}
    first, second = checkpoints

    prepare = threading.Thread(target=memory.prepare, args=(("v1",), first))  # off the scheduler thread
    prepare.start()
    prepare.join()
    assert memory.take_prepared(("v0",)) is None and memory.take_prepared(("v1",)) is None  # a wrong key drops it
    memory.prepare(("v1",), first)
    assert memory.spare_bytes() == memory.weight_bytes()  # the prepared copy
    memory.swap_in(memory.take_prepared(("v1",)))
    for name, p in params.items():
        want = first[name if name in first else "model.embed_tokens.weight"]
        assert p.dtype == dtype and torch.equal(p, want.to(dtype))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one Parameter under both names
    assert memory.spare_bytes() == memory.weight_bytes()  # what was served is the spare now

    memory.prepare(("v2",), second)
    prepared = memory.take_prepared(("v2",))
    assert {prepared.tensors[id(p)].data_ptr() for p in params.values()} == {t.data_ptr() for t in served.values()}
    memory.swap_in(prepared)
    assert all(torch.equal(p, second[n].to(dtype)) for n, p in params.items() if n in second)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 17, 42]])).logits
    assert torch.isfinite(logits).all()


def test_releasing_the_weights_frees_the_spare_and_prepared_copies(
    tiny_model_dir: Path, checkpoints: list[dict[str, torch.Tensor]]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    memory = ModelMemory(model)
    memory.prepare("v1", checkpoints[0])
    memory.swap_in(memory.take_prepared("v1"))
    memory.prepare("v2", checkpoints[1])
    assert memory.spare_bytes() == memory.weight_bytes() > 0
    memory.release()
    assert memory.spare_bytes() == memory.weight_bytes() == 0
    memory.prepare("v3", checkpoints[1])  # a prepare that ends while released holds nothing
    assert memory.spare_bytes() == 0 and memory.take_prepared("v3") is None


def test_a_checkpoint_that_does_not_fit_is_refused_before_it_is_prepared(
    tiny_model_dir: Path, checkpoints: list[dict[str, torch.Tensor]]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    short = {k: v for k, v in checkpoints[0].items() if k != "model.norm.weight"}
    with pytest.raises(WeightError, match="'model.norm.weight' is missing"):
        check_tensors(model, short, require_all=True)
    wrong = {**checkpoints[0], "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(WeightError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \[3, 3\]"):
        check_tensors(model, wrong, require_all=True)
