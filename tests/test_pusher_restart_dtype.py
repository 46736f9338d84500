"""A rollout server restarted under its id and address in another dtype: the pusher casts a snapshot only to dtypes
that the server's present incarnation (its registration's ``started``) said it serves.

A real pusher and real receivers on 127.0.0.1, in front of an SGLang-shaped stub engine
(``test_engine_client.sglang_056_stub``); the weights file a receiver committed is what its engine was told to load.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
from pathlib import Path

import torch
from pydantic import SecretStr
from safetensors.torch import load_file, save_file
from test_engine_client import serve, sglang_056_stub
from transformers import AutoModelForCausalLM

from core.checkpoint_format import MODEL_WEIGHTS
from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import CheckpointPusher, Target

WAIT_S = 60.0


def bf16_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with its weights saved in bf16, as a bf16 deployment serves them."""
    shutil.copytree(model_dir, out)
    tensors = load_file(out / MODEL_WEIGHTS)
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, out / MODEL_WEIGHTS, metadata={"format": "pt"})
    return out


def test_a_server_restarted_in_fp32_where_it_served_bf16_gets_the_trainer_s_fp32_weights(tiny_model_dir: Path,
                                                                                         tmp_path: Path) -> None:
    """The server serves bf16: version 2's snapshot is bf16 (cast once for the fleet). It restarts under the same id
    and address serving fp32, back on version 2 (no catch-up due). Version 3 used to be cast to the bf16 its last
    incarnation served, so the fp32 server loaded bf16-rounded weights; now the snapshot keeps the trainer's fp32
    until the new incarnation answers, and the server loads the trainer's weights exactly."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=5.0, retries=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():  # trained weights: most are not exact in bf16
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    want = {n: t.detach().clone() for n, t in model.state_dict().items()}
    bf16_dir = bf16_copy(tiny_model_dir, tmp_path / "bf16" / "model")

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            rec = CheckpointReceiver(cfg, bf16_dir, engine, url, "srv")
            address = await rec.start()
            live = [Target("srv", address, started=1.0)]
            pusher = CheckpointPusher(cfg, lambda: list(live))

            async def push(version: int) -> int:
                """Push ``version``; the bytes of its snapshot."""
                rnd = await asyncio.to_thread(lambda: pusher.push_model(model, version).wait(WAIT_S))
                assert rnd.ok, [s.error for s in rnd.servers]
                return pusher._newest.nbytes  # type: ignore[union-attr]

            try:
                full = await push(1)  # the server not known yet: the trainer's fp32
                assert await push(2) * 2 == full  # known to serve bf16
                await rec.stop()
                rec = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "srv", port=int(address.rsplit(":", 1)[1]),
                                         version=2)
                await rec.start()
                live[0] = Target("srv", address, version=2, started=2.0)
                three = await push(3)
                state = rec.service._state
                assert state.current == 3
                loaded = load_file(state.current_dir / MODEL_WEIGHTS)
                assert [n for n, t in loaded.items() if t.dtype != torch.float32 or not torch.equal(t, want[n])] == []
                assert three == full  # the snapshot in the trainer's fp32, not cast to the old incarnation's bf16
            finally:
                await asyncio.to_thread(pusher.close)
                await rec.stop()

    asyncio.run(run())
