"""SFT demonstrations are laid out token for token as rollouts are, and SFT lowers their loss."""

from __future__ import annotations

import random
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import ConfigError
from core.tasks import load_tasks
from core.tasks.arith import CALCULATOR_SCHEMA, demonstration
from core.trajectory import ChatRenderer, masked_spans
from trainer.sft import _batch, _save, demonstration_ids, sft_loss, warm_start


def test_demonstration_layout_matches_the_template(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = ChatRenderer(tokenizer)
    task = load_tasks("arith", split="train", limit=1)[0]
    messages = demonstration(task, random.Random(0), wrong_formula_rate=0.0)
    example = demonstration_ids(renderer, messages, [CALCULATOR_SCHEMA])
    rendered = tokenizer.apply_chat_template(messages, tools=[CALCULATOR_SCHEMA], tokenize=True, return_dict=False)
    assert example.token_ids == list(rendered)
    trained = [renderer.decode(example.token_ids[a:b]) for a, b, v in masked_spans(example.loss_mask) if v]
    assert len(trained) == 2
    assert trained[0].startswith("<tool_call>\n") and trained[0].endswith("</tool_call><|im_end|>")
    assert trained[1] == f"The answer is {task.reward['ground_truth']}.<|im_end|>"


def test_warm_start_lowers_the_loss(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = load_tasks("arith", split="train", limit=64)
    out = warm_start(tiny_model_dir, tmp_path / "sft", tasks, steps=30, batch_size=16, lr=3e-3)

    def loss_of(model_dir: Path) -> float:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        renderer = ChatRenderer(tokenizer)
        rng = random.Random(1)
        examples = [demonstration_ids(renderer, demonstration(t, rng), [CALCULATOR_SCHEMA]) for t in tasks[:16]]
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():
            return sft_loss(model, *_batch(examples, tokenizer.pad_token_id)).item()

    assert loss_of(out) < 0.5 * loss_of(tiny_model_dir)


def test_warm_start_stops_at_its_time_budget(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = load_tasks("arith", split="train", limit=16)
    seen: list[int] = []
    started = time.monotonic()
    out = warm_start(tiny_model_dir, tmp_path / "sft", tasks, steps=100_000, batch_size=4, max_seconds=1.0,
                     progress=lambda step, _loss: seen.append(step))
    assert time.monotonic() - started < 30 and 0 < len(seen) < 100_000
    assert f"steps={len(seen)} " in (out / "sft.txt").read_text()


def test_warm_start_saves_the_model_at_each_wall_time(tiny_model_dir: Path, tmp_path: Path) -> None:
    """bench/learning.py scores one SFT run at each RL arm's wall time: a snapshot per mark, in the given
    order; a mark the run never reached gets the final model."""
    tasks = load_tasks("arith", split="train", limit=16)
    out = warm_start(tiny_model_dir, tmp_path / "sft", tasks, steps=100_000, batch_size=4, max_seconds=3.0,
                     save_at_seconds=[60.0, 0.5])

    def steps(path: Path) -> int:
        return int((path / "sft.txt").read_text().split()[0].removeprefix("steps="))

    assert 0 < steps(out / "at-1") < steps(out)
    assert steps(out / "at-0") == steps(out)
    assert (out / "at-1" / "config.json").exists()


def test_a_save_that_fails_leaves_the_model_before_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A crash or Ctrl-C while SFT saves must not leave a half-written model where ``--warm-start`` takes it:
    the directory keeps the last complete save, and nothing half written stays beside it."""
    out = warm_start(tiny_model_dir, tmp_path / "sft", load_tasks("arith", split="train", limit=8), steps=1,
                     batch_size=4)
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    class DiskFull:
        def save_pretrained(self, path: Path) -> None:
            (Path(path) / "tokenizer.json").write_text("{")
            raise OSError("No space left on device")

    model = AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(OSError, match="No space left"):
        _save(model, DiskFull(), out, steps=2, seconds=1.0)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]


def test_a_model_whose_weights_lack_a_tensor_is_refused_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SFT loads its model as the trainer does: weights that lack a tensor of their config.json's model are a
    ConfigError naming ``model.path`` and the tensor (transformers started it at random, and SFT trained from there)."""
    partial = tmp_path / "partial"
    shutil.copytree(tiny_model_dir, partial)
    weights = load_file(partial / "model.safetensors")
    name = next(n for n in weights if n.endswith("mlp.down_proj.weight"))
    save_file({n: t for n, t in weights.items() if n != name}, partial / "model.safetensors", {"format": "pt"})
    with pytest.raises(ConfigError, match=rf"^model.path: {partial}: its weights lack {re.escape(name)}, "):
        warm_start(partial, tmp_path / "sft", load_tasks("arith", split="train", limit=4), steps=1)
