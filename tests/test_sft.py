"""SFT demonstrations are laid out token for token as rollouts are, and SFT lowers their loss."""

from __future__ import annotations

import json
import logging
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
from core.tasks import Task, load_tasks
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


def test_a_batch_is_cut_to_max_length_and_its_loss_to_the_labels_kept(tiny_model_dir: Path) -> None:
    """``_batch(max_length=180)`` keeps each demonstration's first 180 tokens (the prompt's start, as TRL's SFT
    truncation does): the loss is the full batch's over the trained tokens before 180 only (causal attention: the
    cut tokens change nothing before them), and differs from the uncut loss."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = ChatRenderer(tokenizer)
    rng = random.Random(0)
    examples = [demonstration_ids(renderer, demonstration(t, rng), [CALCULATOR_SCHEMA])
                for t in load_tasks("arith", split="train", limit=4)]
    assert min(len(e) for e in examples) > 180 > max(e.prompt_len for e in examples)
    ids, mask, attn = _batch(examples, tokenizer.pad_token_id, max_length=180)
    assert ids.shape == mask.shape == attn.shape == (4, 180)
    assert mask.tolist() == [[float(v) for v in e.loss_mask[:180]] for e in examples]
    full_ids, full_mask, full_attn = _batch(examples, tokenizer.pad_token_id)
    kept_mask = full_mask.clone()
    kept_mask[:, 180:] = 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        cut = sft_loss(model, ids, mask, attn).item()
        assert cut == pytest.approx(sft_loss(model, full_ids, kept_mask, full_attn).item(), rel=1e-5)
        assert cut != pytest.approx(sft_loss(model, full_ids, full_mask, full_attn).item(), rel=1e-3)


@pytest.mark.parametrize(("max_length", "positions", "recorded"), [
    (180, None, "max_length=180 truncated=8"),
    (1024, 170, "max_length=170 truncated=8"),
    (1024, None, "max_length=1024 truncated=0"),
])
def test_warm_start_cuts_demonstrations_longer_than_max_length(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, max_length: int, positions: int | None,
    recorded: str,
) -> None:
    """Demonstrations (about 205 tokens) longer than ``max_length``, or than the model's max_position_embeddings,
    are cut to the smaller: counted in the log and in sft.txt; by default (1024) none is."""
    model_dir = tiny_model_dir
    if positions is not None:
        model_dir = tmp_path / "short"
        shutil.copytree(tiny_model_dir, model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    with caplog.at_level(logging.WARNING, logger="trainer.sft"):
        out = warm_start(model_dir, tmp_path / "sft", load_tasks("arith", split="train", limit=8), steps=1,
                         batch_size=4, max_length=max_length)
    assert f"examples=8 wrong_formula_rate=0.7 {recorded} " in (out / "sft.txt").read_text()
    cut = recorded.endswith("truncated=8")
    assert ("SFT: 8 of 8 demonstrations are longer than max_length" in caplog.text) == cut


def test_a_max_length_that_leaves_no_trained_token_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A max_length below every prompt (about 150 tokens) would train on nothing: an error that says so."""
    with pytest.raises(ValueError, match=r"^SFT warm start: max_length 100 leaves no demonstration a trained token "
                                         r"\(the shortest prompt is 1\d\d tokens\)"):
        warm_start(tiny_model_dir, tmp_path / "sft", load_tasks("arith", split="train", limit=4), steps=1,
                   max_length=100)


@pytest.mark.parametrize(("tasks", "max_length", "error"), [
    ([], 1024, r"^SFT warm start: arith train limit=0 holds no tasks, so there are no demonstrations to train on "),
    (load_tasks("arith", split="train", limit=1), 0, r"^SFT warm start: max_length must be > 0, got 0$"),
])
def test_no_tasks_or_no_max_length_is_refused_before_the_model_loads(
    tmp_path: Path, tasks: list[Task], max_length: int, error: str
) -> None:
    """No tasks (an empty source, or a limit that leaves none) is an error naming the source, not max()'s bare
    ValueError from the first batch; it and a max_length below 1 come before the model loads (there is none here:
    loading it would be model.path's error)."""
    with pytest.raises(ValueError, match=error):
        warm_start(tmp_path / "no-model", tmp_path / "sft", tasks, steps=1, max_length=max_length,
                   source="arith train limit=0")
