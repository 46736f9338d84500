"""The embedded engine's LoRA routes against a real engine process: a peft adapter directory loads under a name,
its checksum is reported, requests that name it (alone or beside base-model rows in one batch) get it, unloading
aborts nothing that does not use it, and a bad adapter is refused naming the file and tensor while the adapter
served before stays."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint_engine import PROMPTS, WAIT_S, greedy_reference
from test_lora_push import lora_model
from transformers import AutoModelForCausalLM

from core.config import LoraConfig
from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, adapter_checksum
from rollout_server.engine.lora import AdapterSet, read_adapter
from rollout_server.engine.process import EngineProcess
from trainer.lora import add_adapter


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    proc = EngineProcess(tiny_model_dir, log_path=tmp_path_factory.mktemp("engine") / "engine.log").start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapter")
    lora_model(tiny_model_dir, seed=7).save_pretrained(out)
    return out


def post(engine: EngineProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=WAIT_S)


def greedy(engine: EngineProcess, lora_path: str | list[str | None] | None) -> httpx.Response:
    body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}}
    return post(engine, "/generate", {**body, "lora_path": lora_path})


def outputs(reply: httpx.Response) -> list[list[int]]:
    assert reply.status_code == 200, reply.text
    return [r["output_ids"] for r in reply.json()]


def test_load_name_mix_and_unload(engine: EngineProcess, adapter_dir: Path, tiny_model_dir: Path) -> None:
    base = outputs(greedy(engine, None))
    reply = post(engine, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter_dir)})
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert reply.json()["loaded_adapters"] == {"a": str(adapter_dir)}
    assert reply.json()["checksums"] == {"a": adapter_checksum(load_file(adapter_dir / ADAPTER_WEIGHTS))}
    info = httpx.get(engine.url + "/model_info", timeout=WAIT_S).json()["lora_adapters"]
    assert info == {"a": {"path": str(adapter_dir), "checksum": reply.json()["checksums"]["a"]}}
    expected = greedy_reference(lora_model(tiny_model_dir, seed=7))
    assert outputs(greedy(engine, "a")) == expected != base
    mixed = outputs(greedy(engine, ["a", None]))  # one batch: an adapter row and a base row
    assert mixed == [expected[0], base[1]]

    assert post(engine, "/unload_lora_adapter", {"lora_name": "a"}).json()["loaded_adapters"] == {}
    refused = greedy(engine, "a")
    assert refused.status_code == 400 and "'a' is not loaded" in refused.text
    gone = post(engine, "/unload_lora_adapter", {"lora_name": "a"})
    assert gone.status_code == 400 and not gone.json()["success"]
    assert "'a' is not loaded" in gone.json()["error_message"]
    assert outputs(greedy(engine, None)) == base


def _broken(src: Path, out: Path, change: str) -> Path:
    shutil.copytree(src, out)
    tensors = load_file(src / ADAPTER_WEIGHTS)
    q_a = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"
    if change == "missing_b":
        del tensors[q_a.replace("lora_A", "lora_B")]
    elif change == "shape":
        tensors[q_a] = torch.zeros(8, 3)
    elif change == "module":
        tensors[q_a.replace("q_proj", "nope_proj")] = tensors[q_a].clone()
    elif change == "no_file":
        (out / ADAPTER_WEIGHTS).unlink()
        return out
    elif change == "config":
        (out / ADAPTER_CONFIG).write_text(json.dumps({"lora_alpha": 16}))
        return out
    save_file(tensors, out / ADAPTER_WEIGHTS)
    return out


@pytest.mark.parametrize(("change", "needle"), [
    ("missing_b", "self_attn.q_proj.lora_B.weight' is missing"),
    ("shape", "q_proj.lora_A.weight' has shape [8, 3]"),
    ("module", "no Linear module 'model.layers.0.self_attn.nope_proj'"),
    ("no_file", f"{ADAPTER_WEIGHTS}: no such file"),
    ("config", f"{ADAPTER_CONFIG}: not a peft LoRA config"),
])
def test_a_bad_adapter_is_refused_and_the_served_one_stays(engine: EngineProcess, adapter_dir: Path, tmp_path: Path,
                                                          change: str, needle: str) -> None:
    assert post(engine, "/load_lora_adapter", {"lora_name": "good", "lora_path": str(adapter_dir)}).status_code == 200
    before = outputs(greedy(engine, "good"))
    bad = _broken(adapter_dir, tmp_path / change, change)
    reply = post(engine, "/load_lora_adapter", {"lora_name": "good", "lora_path": str(bad)})
    assert reply.status_code == 400 and not reply.json()["success"]
    assert needle in reply.json()["error_message"] and str(bad) in reply.json()["error_message"]
    assert reply.json()["loaded_adapters"] == {"good": str(adapter_dir)}
    assert outputs(greedy(engine, "good")) == before


def test_the_engine_scales_an_adapter_by_its_own_alpha_over_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank and alpha other than the defaults (rank 4, alpha 32: scale 8, not the default 2) reach the engine's
    forward from adapter_config.json: its logits with the adapter are peft's, and the base rows of the batch stay
    the base model's."""
    lora = LoraConfig(rank=4, alpha=32, target_modules=["q_proj", "down_proj"])
    peft_model = add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), lora).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    adapter = read_adapter(base, tmp_path)
    assert adapter.scale == 8.0 and adapter.weights["model.layers.0.self_attn.q_proj"][0].shape[0] == 4
    served = AdapterSet(base)
    served.install("a", adapter)
    ids = torch.tensor([list(range(5, 25))] * 2)
    served.rows = ["a", None]
    with torch.no_grad():
        got, want = base(input_ids=ids).logits, peft_model(input_ids=ids[:1]).logits
        served.rows = []
        plain = base(input_ids=ids[1:]).logits
    torch.testing.assert_close(got[:1], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:], plain, rtol=1e-5, atol=1e-5)
    assert (want - plain).abs().max() > 1e-2
