"""Warm start by SFT on generated tool-use demonstrations (the demo's first phase).

Demonstrations are laid out token for token as the agent loop lays out a rollout: the prompt,
each assistant turn as the model would emit it (loss 1), the template tokens and tool turns
between them (loss 0). So SFT teaches exactly the sequences RL later samples.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from core.tasks import Task
from core.tasks.arith import CALCULATOR_SCHEMA, demonstration
from core.trajectory import ChatRenderer, TrajectoryBuilder, Turn
from trainer.parallel import causal_lm

log = logging.getLogger(__name__)


def demonstration_ids(renderer: ChatRenderer, messages: list[dict[str, Any]], tools: list[dict]) -> TrajectoryBuilder:
    """Token ids and loss mask of a whole demonstration conversation (system/user prompt first)."""
    n_prompt = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    builder = TrajectoryBuilder(renderer.prompt_ids(messages[:n_prompt], tools))
    i = n_prompt
    while i < len(messages):
        turn = renderer.assistant_turn_ids(messages[i])
        builder.add_generated(Turn(turn, [0.0] * len(turn), [0] * len(turn)))
        i += 1
        tool_msgs = []
        while i < len(messages) and messages[i]["role"] == "tool":
            tool_msgs.append(messages[i])
            i += 1
        builder.add_template(renderer.turn_end_suffix)
        if tool_msgs:
            builder.add_template(renderer.tool_turn_ids(tool_msgs))
    return builder


def _batch(examples: list[TrajectoryBuilder], pad_id: int,
           max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, loss mask and attention mask; each example cut to its first ``max_length`` tokens (TRL's
    SFT truncation: the prompt's start stays, the tokens beyond go with their labels)."""
    cut = [(e.token_ids[:max_length], e.loss_mask[:max_length]) for e in examples]
    width = max(len(token_ids) for token_ids, _ in cut)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (token_ids, loss_mask) in enumerate(cut):
        n = len(token_ids)
        ids[row, :n] = torch.tensor(token_ids)
        mask[row, :n] = torch.tensor(loss_mask, dtype=torch.float32)
        attn[row, :n] = 1
    return ids, mask, attn


def sft_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy over loss-masked positions (position t predicts token t)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    target_mask = mask[:, 1:]
    return (nll * target_mask).sum() / target_mask.sum().clamp(min=1)


def warm_start(
    model_dir: Path,
    out_dir: Path,
    tasks: list[Task],
    *,
    steps: int = 700,
    batch_size: int = 32,
    max_length: int = 1024,
    lr: float = 1e-3,
    wrong_formula_rate: float = 0.7,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    max_seconds: float | None = None,
    save_at_seconds: Sequence[float] = (),
    source: str = "the task list given",
) -> Path:
    """SFT the model at ``model_dir`` on demonstrations of ``tasks``; save to ``out_dir`` (HF format).

    ``max_seconds`` stops earlier, after the step that reaches that wall time (a budget rather than a count:
    bench/learning.py gives SFT the wall time of each RL arm). ``save_at_seconds`` also saves the model as it
    stands after the step that reaches each of those wall times, to ``out_dir/at-<i>`` (i in the given
    order), so one run scores SFT at several budgets.

    A demonstration longer than ``max_length`` tokens, or than the model's ``max_position_embeddings``, is cut to
    that many (``_batch``): memory stays bounded and positions stay within the model's. ``source`` names where
    ``tasks`` came from, for the error that there are none (raised before the model loads)."""
    if not tasks:
        raise ValueError(f"SFT warm start: {source} holds no tasks, so there are no demonstrations to train on (an "
                         "empty data source, or a limit, offset or filter that left none)")
    if max_length <= 0:
        raise ValueError(f"SFT warm start: max_length must be > 0, got {max_length}")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = causal_lm(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    renderer = ChatRenderer(tokenizer)
    tools = [CALCULATOR_SCHEMA]
    examples = [
        demonstration_ids(renderer, demonstration(task, rng, wrong_formula_rate), tools) for task in tasks
    ]
    max_length = min(max_length, model.config.max_position_embeddings)
    examples, truncated = _fit(examples, max_length)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    marks = sorted(enumerate(save_at_seconds), key=lambda mark: mark[1])
    started = time.monotonic()
    done = 0
    for step in range(steps):
        elapsed = time.monotonic() - started
        while marks and elapsed >= marks[0][1]:
            _save(model, tokenizer, out_dir / f"at-{marks.pop(0)[0]}", done, elapsed)
        if max_seconds is not None and elapsed >= max_seconds:
            break
        ids, mask, attn = _batch(rng.sample(examples, min(batch_size, len(examples))), tokenizer.pad_token_id,
                                 max_length)
        loss = sft_loss(model, ids, mask, attn)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        done = step + 1
        if progress is not None:
            progress(step + 1, loss.item())
    elapsed = time.monotonic() - started
    for i, _ in marks:  # budgets the run never reached: the final model
        _save(model, tokenizer, out_dir / f"at-{i}", done, elapsed)
    _save(model, tokenizer, out_dir, done, elapsed,
          f" batch_size={batch_size} lr={lr} examples={len(examples)} wrong_formula_rate={wrong_formula_rate}"
          f" max_length={max_length} truncated={truncated}")
    return out_dir


def _fit(examples: list[TrajectoryBuilder], max_length: int) -> tuple[list[TrajectoryBuilder], int]:
    """The examples that keep a trained token within ``max_length`` (one that keeps none teaches nothing), and how
    many are longer (logged: ``_batch`` cuts them). None kept is an error: SFT would train on nothing."""
    truncated = sum(len(e) > max_length for e in examples)
    kept = [e for e in examples if any(e.loss_mask[:max_length])]
    if truncated:
        log.warning("SFT: %d of %d demonstrations are longer than max_length %d tokens and are cut to it; %d of "
                    "them keep no trained token and are left out", truncated, len(examples), max_length,
                    len(examples) - len(kept))
    if not kept:
        raise ValueError(f"SFT warm start: max_length {max_length} leaves no demonstration a trained token (the "
                         f"shortest prompt is {min(e.prompt_len for e in examples)} tokens): raise max_length "
                         "above it")
    return kept, truncated


def _save(model: torch.nn.Module, tokenizer: Any, out_dir: Path, steps: int, seconds: float, info: str = "") -> None:
    """The model in HF format, with ``sft.txt`` saying how far SFT had got.

    Written to a temporary sibling and renamed into place, so ``out_dir`` never holds a half-written model that
    ``--warm-start`` would take (a crash or Ctrl-C during the save). The directories an earlier save left in it
    (the ``at-<i>`` saves) move into the new one."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "sft.txt").write_text(f"steps={steps}{info} seconds={seconds:.1f}\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is shared read-only
        if out_dir.exists():
            for kept in [d for d in out_dir.iterdir() if d.is_dir()]:
                kept.rename(tmp / kept.name)
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
