"""``trainer.offload`` on a GPU (``make test-cuda``; CI has none): a colocated trainer on CUDA (bf16 FSDP2) frees
the device between steps, and trains exactly the numbers it trains when it keeps the device.

Three trainers in turn in one process, each with a local push after every step: ``none`` (the reference),
``cpu`` and ``memory_saver``. Between steps the device memory in use (``cudaMemGetInfo``, what a colocated
engine would find) is measured against the process's before the trainer existed.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from core.config import BufferConfig, TrainerConfig  # noqa: E402
from core.tiny_model import save_random_qwen2  # noqa: E402
from tests.trainer_helpers import synthetic_groups  # noqa: E402
from trainer.colocation import LocalPusher  # noqa: E402
from trainer.parallel import close_distributed, init_distributed  # noqa: E402
from trainer.worker import Trainer  # noqa: E402

pytestmark = pytest.mark.cuda
STEPS = 3
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cuda_ctx():
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)  # their backward accumulates with atomics
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    context = init_distributed("cuda")
    yield context
    close_distributed()
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 37.6M-parameter Qwen2 (held: 430 MiB of fp32 weights and Adam state), large against allocator slack; its
    MLP matrices (11 MiB) get segments of their own, which the caching allocator can give back."""
    out = tmp_path_factory.mktemp("model")
    save_random_qwen2(out, layers=4, hidden=512, intermediate=5632, heads=8, kv_heads=2, max_positions=512)
    return out


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def train(offload: str, model_dir: Path, root: Path, ctx) -> tuple[list[int], list[dict], dict[str, torch.Tensor]]:
    """(device bytes in use after each step, above what the process used before; the step records; the weights
    the last step pushed)."""
    gc.collect()
    torch.cuda.empty_cache()
    before = used_bytes()
    share = LocalPusher(root / "push", model_dir)
    trainer = Trainer(TrainerConfig(total_steps=STEPS, checkpoint_every=2, lr=1e-3, device="cuda", offload=offload),
                      model_dir, root / "run", BufferConfig(groups_per_step=2), pusher=share,
                      device_share=share).start(ctx=ctx)
    kept, records = [], []
    for seed in range(STEPS):
        records.append(trainer.train(synthetic_groups(seed, 2, vocab=400)))
        kept.append(used_bytes() - before)
    trainer.close()
    assert trainer.offload.kind == offload
    del trainer
    return kept, records, load_file(share.directory(STEPS) / "model.safetensors")


@pytest.fixture(scope="module")
def reference(cuda_ctx, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return train("none", model_dir, tmp_path_factory.mktemp("none"), cuda_ctx)


@pytest.mark.parametrize("offload", ["cpu", "memory_saver"])
def test_an_offloaded_trainer_frees_the_device_between_steps_and_trains_the_same_numbers(
    offload: str, cuda_ctx, model_dir: Path, reference, tmp_path: Path
) -> None:
    kept_none, records_none, weights_none = reference
    kept, records, weights = train(offload, model_dir, tmp_path, cuda_ctx)
    held = records[-1]["held_bytes"]
    print(f"{offload}: held {held / 2**20:.0f} MiB; in use between steps {[k // 2**20 for k in kept]} MiB "
          f"(none: {[k // 2**20 for k in kept_none]}); offload {[round(r['offload_s'], 3) for r in records]} s, "
          f"onload {[round(r['onload_s'], 3) for r in records]} s, step "
          f"{[round(r['step_time_s'], 3) for r in records]} s")
    assert all(k >= held for k in kept_none), (kept_none, held)  # kept: the reference holds it all
    assert all(k < 0.1 * held for k in kept), (kept, held)
    assert [r["loss"] for r in records] == [r["loss"] for r in records_none]
    worst = max((weights[n].float() - weights_none[n].float()).abs().max().item() for n in weights_none)
    assert worst == 0.0, f"{offload}: weights differ from the reference by up to {worst}"


def test_a_process_that_trained_with_memory_saver_exits_cleanly(model_dir: Path, tmp_path: Path) -> None:
    """Teardown frees the region's memory: torch-memory-saver's allocator would end the process with status 1."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from tests.test_trainer_offload_cuda import train
        from trainer.parallel import close_distributed, init_distributed
        ctx = init_distributed("cuda")
        kept, records, _ = train("memory_saver", Path({str(model_dir)!r}), Path({str(tmp_path)!r}), ctx)
        close_distributed()
        print("kept", kept)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "kept" in run.stdout, run.stderr[-3000:]
