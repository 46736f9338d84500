"""Train-step throughput: the full RL step against a plain supervised step of the same model, same batch.

Both sides see the same batch (groups of the tiny Qwen2's shape, prompt + generated tokens) cut into the
same token-budget micro-batches, and count the same tokens (prompt + generated, padding excluded):

- ``plain``: the unsharded HF model; per micro-batch forward, token-mean NLL over the loss mask,
  backward; then gradient clipping and AdamW. The floor any trainer pays.
- ``step``: ``trainer.step.TrainStep`` on the FSDP2-wrapped model (1-rank gloo group): collation,
  GRPO advantages, forward, decoupled-PPO loss with its IS weights, entropy and metrics, backward,
  clipping, AdamW, LR schedule, and the reduction of the step's statistics.

What is fair about π_prox: the step makes one optimizer update per batch (``ppo_minibatches=1``), so
the weights during its forward are exactly the weights at the start of the step and π_prox is that
forward's own logprobs with the gradient stopped; no extra forward exists to count, and the step is
compared with the plain step as is. ``step+recompute`` also times the no-grad proximal pass that
``ppo_minibatches > 1`` needs (and that systems recomputing π_prox separately always pay), for reference.

Timings alternate the variants per round and report medians. One torch thread by default: on a small
shared machine, two threads per process swing timings several-fold when other processes run, while the
comparison between the variants is what counts. Last line: the headline ratio
``step tokens/s ÷ plain tokens/s`` (goal ≥ 0.7).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, not this script, is `trainer`

from buffer.schema import Sample, TrajectoryGroup  # noqa: E402
from core.config import TrainerConfig  # noqa: E402
from core.tiny_model import build_tiny_model  # noqa: E402
from trainer.batching import collate, plan_ranks  # noqa: E402
from trainer.optim import build_optimizer, build_scheduler  # noqa: E402
from trainer.parallel import close_distributed, init_distributed, load_model  # noqa: E402
from trainer.step import TrainStep  # noqa: E402


def make_groups(n_groups: int, group_size: int, vocab: int, seed: int = 0) -> list[TrajectoryGroup]:
    """Prompts of 40-80 tokens and completions of 60-200, like short agent turns."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, int(rng.integers(40, 80)))
        samples = []
        for i in range(group_size):
            gen = int(rng.integers(60, 200))
            ids = np.concatenate([prompt, rng.integers(3, vocab, gen)])
            mask = np.r_[np.zeros(prompt.size), np.ones(gen)]
            samples.append(
                Sample(
                    sample_index=i,
                    token_ids=ids,
                    prompt_len=prompt.size,
                    loss_mask=mask,
                    behaviour_logprobs=np.where(mask > 0, -np.log(vocab) + rng.normal(0, 0.2, ids.size), 0),
                    token_versions=np.where(mask > 0, 0, -1),
                    reward=float(rng.integers(0, 2)),
                )
            )
        groups.append(TrajectoryGroup(run="bench", job_id="bench", task_id=f"g{g}", samples=samples))
    return groups


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups, cfg: TrainerConfig) -> None:
    batch = collate(groups)
    lengths = batch.lengths.tolist()
    plan = plan_ranks(list(range(len(batch))), lengths, 1, cfg.micro_batch_tokens)[0]
    tokens = int(batch.loss_mask.sum())
    for rows in plan:
        mb = batch.select(rows)
        logits = model(input_ids=mb.input_ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), mb.input_ids[:, 1:].reshape(-1), reduction="none"
        )
        (nll[mb.loss_mask.reshape(-1)].sum() / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = init_distributed("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model")
        cfg = TrainerConfig(micro_batch_tokens=4096, device="cpu", lr=1e-5)
        model = load_model(model_dir, ctx)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, cfg)
        step = TrainStep(model, optimizer, scheduler, cfg, ctx)
        per_sample = TrainStep(model, optimizer, scheduler, cfg.model_copy(update={"share_prefix": False}), ctx)
        plain = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        plain_opt = build_optimizer(plain, cfg)
    groups = make_groups(args.groups, args.group_size, plain.config.vocab_size)
    batch = collate(groups)
    tokens = int(batch.lengths.sum())

    def run_step() -> None:
        step(groups, 0)

    def run_recompute() -> None:
        step.proximal_logprobs(batch)
        step(groups, 0)

    variants = {
        "plain": lambda: plain_step(plain, plain_opt, groups, cfg),
        "step": run_step,
        "step per sample": lambda: per_sample(groups, 0),
        "step+recompute": run_recompute,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 1):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            if round_:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
    close_distributed()
    print(
        f"batch: {len(batch)} samples, {tokens} tokens ({int(batch.loss_mask.sum())} trained), "
        f"{sum(p.numel() for p in plain.parameters()):,} parameters, {torch.get_num_threads()} threads"
    )
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    for name, value in rate.items():
        print(f"{name:>15}: {value:10.0f} tokens/s  (median of {len(times[name])})")
    print(f"shared_prompt_vs_per_sample ratio {rate['step'] / rate['step per sample']:.3f}")
    print(f"step+recompute_vs_plain ratio {rate['step+recompute'] / rate['plain']:.3f}")
    print(f"train_step_vs_plain ratio {rate['step'] / rate['plain']:.3f}")


if __name__ == "__main__":
    main()
