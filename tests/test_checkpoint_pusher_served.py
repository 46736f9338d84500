"""Full pushes to what servers really hold: a fleet whose servers serve different dtypes (each server's stream casts
to its own, from the trainer's precision), and served files with tensors that are no parameter (a tied head, rotary
buffers).

Two real embedded engines on 127.0.0.1, one serving the tiny model in fp32, one in bf16, each with a real receiver;
the pusher streams a real model. The weights file each server committed is what its engine loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import SecretStr
from receiver_helpers import started_receiver
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from core.checkpoint_format import MODEL_WEIGHTS, StageError, check_manifest, served_tensor_specs
from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine.process import EngineProcess
from trainer.checkpoint_pusher import CheckpointPusher, Target
from trainer.snapshot import TensorMeta, build_manifest

WAIT_S = 60.0


@contextlib.asynccontextmanager
async def receiver(cfg: CheckpointConfig, model_dir: Path, name: str) -> AsyncIterator[CheckpointReceiver]:
    """A receiver in front of an embedded engine serving ``model_dir`` (in the dtype it is saved in)."""
    with EngineProcess(model_dir, max_batch_size=2, threads=1, log_path=model_dir.parent / f"{name}.log") as proc:
        async with started_receiver(cfg, model_dir, proc.url, name) as rec:
            yield rec


def bf16_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with its weights saved in bf16, as a bf16 deployment serves them."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / MODEL_WEIGHTS)
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, out / MODEL_WEIGHTS, metadata={"format": "pt"})
    return out


def served(rec: CheckpointReceiver, version: int) -> dict[str, torch.Tensor]:
    """The weights file of the version ``rec`` committed (its engine loaded it)."""
    state = rec.service._state
    assert state.current == version, (rec.service.server_id, state.current, version)
    return load_file(state.current_dir / MODEL_WEIGHTS)


def test_each_server_gets_the_weights_in_its_own_dtype_at_the_trainer_s_precision(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The bf16 server answers first (version 1 goes to it alone), then the fp32 server joins. It used to get the
    bf16 server's dtypes from version 2 on: the snapshot was bf16, so the fp32 server loaded bf16-rounded weights.
    Now each server loads the trainer's fp32 weights cast to its own dtype, before and after the fp32 server's
    first answer; and a fleet that agrees on bf16 gets a bf16 snapshot (half the bytes), cast once."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=5.0, retries=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():  # trained weights: most are not exact in bf16
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    want = {n: t.detach().clone() for n, t in model.state_dict().items()}
    served_bf16 = bf16_copy(tiny_model_dir, tmp_path / "bf16" / "model")
    fp32_dir = shutil.copytree(tiny_model_dir, tmp_path / "fp32" / "model")

    async def run() -> None:
        async with receiver(cfg, served_bf16, "bf16") as half, receiver(cfg, fp32_dir, "fp32") as full:
            live: list[Target] = []
            pusher = CheckpointPusher(cfg, lambda: live)

            def push(version: int, *servers: CheckpointReceiver) -> None:
                live[:] = [Target(r.service.server_id, r.address) for r in servers]
                rnd = pusher.push_model(model, version=version)
                assert rnd is not None and rnd.wait(WAIT_S).ok, [s.error for s in rnd.servers]

            try:
                await asyncio.to_thread(push, 1, half)
                for version in (2, 3):  # the fp32 server unknown, then known
                    await asyncio.to_thread(push, version, half, full)
                    wrong = [(rec.service.server_id, name) for rec, dtype in ((half, torch.bfloat16),
                                                                             (full, torch.float32))
                             for name, tensor in served(rec, version).items()
                             if tensor.dtype != dtype or not torch.equal(tensor, want[name].to(dtype))]
                    assert wrong == [], version
                full_bytes = pusher._newest.nbytes  # type: ignore[union-attr]
                await asyncio.to_thread(push, 4, half)
                assert pusher._newest.nbytes * 2 == full_bytes  # type: ignore[union-attr]
                assert all(t.dtype == torch.bfloat16 for t in served(half, 4).values())
            finally:
                await asyncio.to_thread(pusher.close)

    asyncio.run(run())


def with_old_tensors(model_dir: Path, out: Path, *, tied: bool = True) -> Path:
    """``model_dir`` as older tools saved it: the tied output embedding written beside the input one, and each
    layer's rotary ``inv_freq`` buffer; ``tied`` False says in its config that ``lm_head`` is a weight of its own."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / MODEL_WEIGHTS)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and "lm_head.weight" not in tensors  # as transformers saves it today
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    for i in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(half) / half)
    save_file(tensors, out / MODEL_WEIGHTS, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tied}))
    return out


def test_a_checkpoint_with_a_tied_head_and_rotary_buffers_takes_full_pushes(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """The served files hold ``lm_head.weight`` (tied to the input embedding) and ``inv_freq`` buffers, which the
    trainer's model has as no parameter: every full push used to be refused (``lm_head.weight: missing from the
    manifest``). A push carries neither, as SGLang's loader skips both; the engine loads it and its tied head follows
    the embedding. The same files with an untied head still refuse a manifest without it."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=5.0, retries=0)
    served_dir = with_old_tensors(tiny_model_dir, tmp_path / "old" / "model")
    model = AutoModelForCausalLM.from_pretrained(served_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a "trained" version whose greedy tokens differ from the served one's
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (p.std() + 0.05))
    assert "lm_head.weight" not in dict(model.named_parameters())
    prompts = [[5, 17, 99, 4], [300, 2, 41]]

    async def run() -> list[list[int]]:
        async with receiver(cfg, served_dir, "old") as rec:
            pusher = CheckpointPusher(cfg, [rec.address])
            try:
                rnd = await asyncio.to_thread(lambda: pusher.push_model(model, version=1).wait(WAIT_S))
            finally:
                await asyncio.to_thread(pusher.close)
            assert rnd.ok, [s.error for s in rnd.servers]
            body = {"input_ids": prompts, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                               "ignore_eos": True}}
            async with httpx.AsyncClient(timeout=WAIT_S) as http:
                reply = await http.post(rec.service.engine_url + "/generate", json=body)
            return [r["output_ids"] for r in reply.json()]

    served = asyncio.run(run())
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(p):]
                .tolist() for p in prompts]
    assert served == want

    untied = served_tensor_specs(with_old_tensors(tiny_model_dir, tmp_path / "untied" / "model", tied=False))
    manifest = build_manifest(1, [TensorMeta(n, getattr(torch, d), s) for n, (d, s) in untied.items()
                                  if n != "lm_head.weight" and not n.endswith("inv_freq")])
    with pytest.raises(StageError, match="tensor lm_head.weight: missing from the manifest"):
        check_manifest(manifest, untied)
