"""FSDP2 over 2 gloo ranks trains exactly like 1 rank; batching, π_prox and parameter streaming."""

from __future__ import annotations

import copy
import json
import math
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from rank_helpers import spawn_ranks
from torch.distributed.tensor import DTensor
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from buffer.keys import Keys
from buffer.replay import ReplayBuffer
from buffer.schema import Sample, TrajectoryGroup
from core.config import BufferConfig, LoraConfig, TrainerConfig, load_config
from core.net import free_port_outside_ephemeral
from trainer import losses
from trainer.batching import collate, fed_tokens, lay_out, layout, plan_ranks
from trainer.optim import apply_gradients, lr_factor
from trainer.parallel import (
    DistContext,
    close_distributed,
    exit_rank,
    init_distributed,
    iter_full_params,
    resolve_device,
)
from trainer.worker import Trainer

STEPS = 3
GROUPS = 3
CFG = {
    "total_steps": STEPS,
    "checkpoint_every": STEPS,
    "lr": 1e-3,
    "micro_batch_tokens": 96,
    "loss_agg": "seq-mean-token-mean",
    "kl_coef": 0.05,
    "entropy_coef": 0.01,
    "device": "cpu",
}


def synthetic_batches() -> list[list[TrajectoryGroup]]:
    """``STEPS`` steps of ``GROUPS`` synthetic groups, the same on every rank."""
    return [synthetic_groups(seed, GROUPS) for seed in range(STEPS)]


def train_ranks(rank: int, world: int, port: int, model_dir: Path, run_dir: Path, out: Path, cfg: dict,
                lora: dict | None, batches: Callable[[], list[list[TrajectoryGroup]]] = synthetic_batches) -> None:
    """One rank of a pool of ``world`` (``mp.spawn``'s target): trains a step on each of ``batches()``; rank 0 saves
    the records and the full parameters (the policy's, the critic's) to ``out``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on two cores
    ctx = init_distributed("cpu")
    try:
        trainer = Trainer(TrainerConfig(**cfg), model_dir, run_dir,
                          lora=None if lora is None else LoraConfig(**lora)).start(ctx=ctx)
        records = [trainer.train(groups) for groups in batches()]
        params = {name: t.clone() for name, t in iter_full_params(trainer.model) if t is not None}
        critic = {} if trainer.critic is None else {
            name: t.clone() for name, t in iter_full_params(trainer.critic[0]) if t is not None
        }
        trainer.close()
        if rank == 0:
            torch.save({"records": records, "params": params, "critic": critic}, out)
    finally:
        close_distributed()
    exit_rank()


# What a rank prints and logs last, and whether the interpreter's teardown (an atexit hook) runs after it.
EXIT_PROBE = """
import atexit, logging, sys
from trainer.parallel import exit_rank
logging.basicConfig(stream=sys.stdout, format="%(message)s")
atexit.register(print, "teardown")
print("printed", end=" ")
logging.getLogger("probe").warning("logged")
exit_rank(3)
"""


@pytest.mark.parametrize(("world", "out"), [("2", "printed logged\n"), ("1", "printed logged\nteardown\n")])
def test_one_of_several_ranks_exits_without_teardown(world: str, out: str) -> None:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "WORLD_SIZE": world, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", EXIT_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (3, out), proc.stderr


def _spawn(world: int, model_dir: Path, tmp_path: Path, cfg: dict, lora: dict | None = None) -> dict:
    out = tmp_path / f"world{world}.pt"
    args = (world, free_port_outside_ephemeral(), model_dir, tmp_path / f"run{world}", out, cfg, lora)
    spawn_ranks(train_ranks, args=args, nprocs=world)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_two_ranks_match_one_rank(tiny_model_dir: Path, tmp_path: Path, minibatches: int) -> None:
    """Also with 2 minibatches, where each is sharded on its own: π_prox must be that of the rows trained."""
    cfg = {**CFG, "ppo_minibatches": minibatches}
    one = _spawn(1, tiny_model_dir, tmp_path, cfg)
    two = _spawn(2, tiny_model_dir, tmp_path, cfg)
    for a, b in zip(one["records"], two["records"], strict=True):
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "is_ratio_mean", "is_ratio_max", "logprob_gap"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert a["loss_tokens"] == b["loss_tokens"] and a["staleness_hist"] == b["staleness_hist"]
    assert one["records"][-1]["kl"] > 0  # the reference policy is really used
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(one["params"]) == set(two["params"]) == {n for n, _ in plain.named_parameters()}
    moved = 0.0
    # Adam divides by sqrt(v): where a gradient is ~0, summation-order noise moves a weight by up to ~lr/100 per update
    # (2.0e-5 after 3 at lr 1e-3 on an AMX CPU; 1e-5 allowed failed there)
    noise = STEPS * minibatches * cfg["lr"] / 100
    for name, initial in plain.named_parameters():
        torch.testing.assert_close(one["params"][name], two["params"][name], rtol=1e-4, atol=noise)
        moved = max(moved, (one["params"][name] - initial).abs().max().item())
    assert moved > 1e-4
    for run in ("run1", "run2"):  # the final step was checkpointed by every rank
        assert (tmp_path / run / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").is_file()


def test_two_ranks_match_one_rank_with_lora(tiny_model_dir: Path, tmp_path: Path) -> None:
    """LoRA (rank 4 on the attention and MLP projections) with 2 minibatches: the adapter trains the same on 2
    ranks as on 1, and the base weights do not move."""
    cfg = {**CFG, "ppo_minibatches": 2}
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    one = _spawn(1, tiny_model_dir, tmp_path, cfg, lora)
    two = _spawn(2, tiny_model_dir, tmp_path, cfg, lora)
    for a, b in zip(one["records"], two["records"], strict=True):
        for key in ("loss", "pg_loss", "kl", "grad_norm", "is_ratio_mean", "logprob_gap"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    plain = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    adapters = [n for n in one["params"] if ".lora_" in n]
    assert len(adapters) == 2 * 3 * 2  # A and B of 3 modules in each of 2 layers
    for name in one["params"]:
        torch.testing.assert_close(one["params"][name], two["params"][name], rtol=1e-4, atol=1e-5)
        base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if base in plain:
            torch.testing.assert_close(one["params"][name], plain[base], rtol=0, atol=0)  # frozen
    assert max((one["params"][n] if ".lora_B." in n else torch.zeros(1)).abs().max().item() for n in adapters) > 1e-4


def test_two_ranks_match_one_rank_with_a_critic(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The critic's values (each rank's rows, summed over ranks), its clipped updates over 2 minibatches and the
    warm-up step: the same on 2 ranks as on 1."""
    cfg = {**CFG, "kl_coef": 0.0, "advantage": "gae", "ppo_minibatches": 2,
           "critic": {"warmup_steps": 1, "value_clip": 1e-3, "lr": 1e-3, "gamma": 0.9, "lam": 0.8}}
    one = _spawn(1, tiny_model_dir, tmp_path, cfg)
    two = _spawn(2, tiny_model_dir, tmp_path, cfg)
    keys = ("loss", "pg_loss", "grad_norm", "value_loss", "value_clip_fraction", "explained_variance", "value_mean",
            "return_mean", "critic_grad_norm")
    for a, b in zip(one["records"], two["records"], strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        assert a["policy_updates"] == b["policy_updates"]
    assert [r["policy_updates"] for r in one["records"]] == [0, 2, 2]
    assert one["records"][-1]["value_clip_fraction"] > 0  # the clip really acts
    plain = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    assert set(one["critic"]) == set(two["critic"]) == {n for n, _ in plain.named_parameters()}
    # Adam turns summation-order noise in a ~0 gradient into a move of up to ~lr/100 per update: 4 policy updates
    for name in one["critic"]:
        torch.testing.assert_close(one["critic"][name], two["critic"][name], rtol=1e-4, atol=1e-5)
    for name in one["params"]:
        torch.testing.assert_close(one["params"][name], two["params"][name], rtol=1e-4, atol=4e-5)



def test_proximal_shortcut_equals_no_grad_recompute(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(TrainerConfig(**{**CFG, "kl_coef": 0.0}), tiny_model_dir, tmp_path).start(ctx=ctx)
    step = trainer.train_step
    batch = collate(synthetic_groups(0, 3), vocab_size=step.vocab_size)
    prox = step.proximal_logprobs(batch)
    for rows, mb, mb_layout in step._micro_batches(list(range(len(batch))), batch):
        logp, _, columns = step._forward_logprobs(step.model, mb, mb_layout)  # with autograd on, as in the update
        assert logp.requires_grad
        assert torch.equal(logp.detach(), prox[rows, columns])
    trainer.close()


def test_logprobs_skip_the_prompt_columns_no_row_trains_on(ctx: DistContext, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """The LM head runs from the first column any row of the micro-batch trains on; its logprobs there are those
    of a full forward."""
    trainer = Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path).start(ctx=ctx)
    step = trainer.train_step
    batch = collate(synthetic_groups(0, 3), vocab_size=step.vocab_size)
    mb = batch.select(list(range(len(batch))))
    logp, logits, columns = step._forward_logprobs(step.model, mb, layout(mb))
    first = int(mb.loss_mask.any(dim=0).nonzero()[0])
    assert columns == slice(first, mb.loss_mask.shape[1]) and first > 0 and logits.shape[1] == columns.stop - first
    assert not mb.loss_mask[:, :first].any()
    with torch.no_grad():
        full = step.model(input_ids=mb.input_ids).logits[:, :-1].float() / mb.temperatures[:, None, None]
    want = losses.logprobs_from_logits(full, mb.input_ids[:, 1:])[:, columns]
    torch.testing.assert_close(logp.detach(), want, rtol=1e-5, atol=1e-5)
    trainer.close()


def _score_at(model_dir: Path, groups: list[TrajectoryGroup], temperatures: list[float]) -> None:
    """Set each sample's behaviour logprobs to the tiny model's own at its group's temperature (``temperatures``,
    one per group), as an engine sampling at that temperature would record them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for group, temperature in zip(groups, temperatures, strict=True):
        for s in group.samples:
            ids = torch.as_tensor(s.token_ids, dtype=torch.long)[None]
            with torch.no_grad():
                logits = model(ids).logits[0, :-1].float() / temperature
            forced = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
            s.behaviour_logprobs = np.r_[0.0, np.where(s.loss_mask[1:] > 0, forced, 0.0)].astype(np.float32)


def test_each_group_is_scored_at_its_own_sampling_temperature(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Behaviour logprobs drawn at 0.5 and 2.0 in one batch: π_prox matches them only if each group's logits
    are divided by its own temperature (the trainer's default, 1.0, stands in for groups without one)."""
    groups = synthetic_groups(5, 3)
    for group, temperature in zip(groups, (0.5, 2.0, None), strict=True):
        group.temperature = temperature
    _score_at(tiny_model_dir, groups, [0.5, 2.0, 1.0])
    trainer = Trainer(TrainerConfig(**{**CFG, "kl_coef": 0.0}), tiny_model_dir, tmp_path).start(ctx=ctx)
    record = trainer.train(groups)
    trainer.close()
    assert record["logprob_gap"] < 1e-5 and abs(record["is_ratio_mean"] - 1) < 1e-5


def test_rollout_temperature_scores_the_groups_that_do_not_record_theirs(tiny_model_dir: Path, redis_server,
                                                                        tmp_path: Path) -> None:
    """rollout.temperature reaches ``python -m trainer``'s step: groups without a recorded temperature (schema 1),
    sampled at 0.7, are scored at the configured 0.7, so π_prox matches their behaviour logprobs. Were the key
    ignored, the step would score them at 1.0, a logprob gap of the size checked first."""
    groups = synthetic_groups(5, 2, run="temp")
    for group in groups:
        assert group.temperature is None
        for s, reward in zip(group.samples, (1.0, 0.0, 0.0, 1.0), strict=True):
            s.reward = reward  # not degenerate: the trainer keeps both groups
    _score_at(tiny_model_dir, groups, [0.7, 0.7])
    at_one = copy.deepcopy(groups)
    _score_at(tiny_model_dir, at_one, [1.0, 1.0])
    gaps = [np.abs(a.behaviour_logprobs - b.behaviour_logprobs)[a.loss_mask > 0]
            for g, h in zip(groups, at_one, strict=True) for a, b in zip(g.samples, h.samples, strict=True)]
    assert np.concatenate(gaps).mean() > 0.05  # what a trainer scoring at 1.0 would record as logprob_gap
    buffer = ReplayBuffer(redis.Redis.from_url(redis_server.url), Keys("temp"), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    assert buffer.put_many(groups) == [1, 1]
    overrides = ["run.name=temp", f"run.dir={tmp_path}", f"model.path={tiny_model_dir}", "model.init_if_missing=false",
                 f"redis.url={redis_server.url}", "buffer.groups_per_step=2", "trainer.total_steps=1",
                 "trainer.checkpoint_every=1", "trainer.device=cpu", "trainer.micro_batch_tokens=96",
                 "rollout.temperature=0.7"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_") and k != "REDIS_URL"}
    env.update(OMP_NUM_THREADS="1", ROLLWAVE_CHECKPOINT_TOKEN=secrets.token_urlsafe(32))
    proc = subprocess.run([sys.executable, "-m", "trainer", *overrides], capture_output=True, text=True, timeout=300,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [record] = [json.loads(line) for line in (tmp_path / "temp" / "metrics.jsonl").read_text().splitlines()]
    assert record["samples"] == 8
    assert record["logprob_gap"] < 1e-5 and abs(record["is_ratio_mean"] - 1) < 1e-5


def test_minibatches_recompute_prox_and_clip(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = {**CFG, "kl_coef": 0.0, "loss": "ppo", "lr": 0.05, "grad_clip": 100.0}
    one = Trainer(TrainerConfig(**cfg), tiny_model_dir, tmp_path / "a").start(ctx=ctx)
    rec = one.train(synthetic_groups(0, 4))
    assert rec["clip_fraction"] == 0.0  # one update: π_θ = π_prox in every forward, u = 1
    several = Trainer(TrainerConfig(**cfg, ppo_minibatches=4), tiny_model_dir, tmp_path / "b").start(ctx=ctx)
    rec = several.train(synthetic_groups(0, 4))
    assert rec["clip_fraction"] > 0.0  # later minibatches see moved weights, clipped against π_prox
    # a step with fewer samples (the last partial batch of a drained run) makes one update per sample: it was an
    # error, which ended the run at the end of its data and lost the steps since the last checkpoint
    short = synthetic_groups(0, 1)
    rec = Trainer(TrainerConfig(**cfg, ppo_minibatches=99), tiny_model_dir, tmp_path / "c").start(ctx=ctx).train(short)
    assert rec["policy_updates"] == rec["samples"] == len(short[0].samples) < 99


def test_collate_aligns_to_predicted_tokens_and_rejects_bad_ids() -> None:
    groups = synthetic_groups(3, 2)
    batch = collate(groups)
    s = groups[0].samples[1]
    n = len(s.token_ids)
    assert torch.equal(batch.input_ids[1, :n], torch.as_tensor(s.token_ids, dtype=torch.long))
    assert torch.equal(batch.loss_mask[1, : n - 1], torch.as_tensor(s.loss_mask[1:], dtype=torch.bool))
    assert torch.equal(batch.behaviour_logprobs[1, : n - 1], torch.as_tensor(s.behaviour_logprobs[1:]))
    assert not batch.loss_mask[1, n - 1 :].any()
    assert batch.group_index.tolist() == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match=r"group s3-g0\.samples\[0\]\.token_ids: id \d+ outside"):
        collate(groups, vocab_size=5)


def test_rank_plan_gives_every_rank_the_same_number_of_micro_batches() -> None:
    lengths = [100] + [10] * 10
    plans = plan_ranks(list(range(11)), lengths, 2, budget=40)
    assert plans[0] == [[0], [], []]  # the long row alone, then dummies to match rank 1's three
    assert plans[1] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    for plan in plans:
        for mb in plan:
            assert len(mb) <= 1 or len(mb) * max(lengths[r] for r in mb) <= 40


def test_rank_plan_keeps_a_group_together() -> None:
    """With the rows' groups, a group's rows go to one rank and to as few micro-batches as the budget allows;
    a group over the budget is cut into pieces that fit."""
    groups = [0] * 4 + [1] * 2 + [2] * 6 + [3]
    lengths = [12, 14, 13, 12, 30, 29, 10, 12, 11, 10, 13, 10, 40]
    rows = list(range(len(groups)))
    plans = plan_ranks(rows, lengths, 2, budget=60, groups=groups)
    assert sorted(r for plan in plans for mb in plan for r in mb) == rows
    assert len(plans[0]) == len(plans[1])
    for group in range(4):
        members = {r for r, g in enumerate(groups) if g == group}
        holders = [(rank, i) for rank, plan in enumerate(plans) for i, mb in enumerate(plan) if members & set(mb)]
        assert len({rank for rank, _ in holders}) == 1, group
        assert len(holders) == (2 if group == 2 else 1), group  # 6 rows x 13 tokens > 60: two pieces
    for plan in plans:
        for mb in plan:
            assert len(mb) <= 1 or len(mb) * max(lengths[r] for r in mb) <= 60


def test_a_shared_prompt_trains_exactly_like_a_forward_per_sample(ctx: DistContext, tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """``share_prefix``: each group's prompt runs once per micro-batch, and the step's loss, gradient and updated
    weights are those of a forward per sample (``share_prefix: false``)."""
    groups = synthetic_groups(5, 3)
    batch = collate(groups)
    runs = {}
    for share in (True, False):
        cfg = TrainerConfig(**{**CFG, "lr": 1e-4, "micro_batch_tokens": 4096, "share_prefix": share})
        trainer = Trainer(cfg, tiny_model_dir, tmp_path / str(share)).start(ctx=ctx)
        fed: list[int] = []
        embeddings = trainer.model.get_input_embeddings()
        embeddings.register_forward_hook(lambda _m, args, _o, fed=fed: fed.append(args[0].numel()))
        record = trainer.train(groups)
        params = {name: t.clone() for name, t in iter_full_params(trainer.model)}
        trainer.close()
        runs[share] = record, params, fed
    (shared, shared_params, shared_fed), (plain, plain_params, plain_fed) = runs[True], runs[False]
    rows, longest = len(batch), int(batch.lengths.max())
    prefix = min(int(np.flatnonzero(s.loss_mask)[0]) for g in groups for s in g.samples) - 1
    assert plain_fed == [rows * longest] and shared_fed == [len(groups) * prefix, rows * (longest - prefix)]
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "is_ratio_mean", "logprob_gap"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    for name, value in plain_params.items():  # Adam's summation-order noise where a gradient is ~0: ~lr/100
        torch.testing.assert_close(shared_params[name], value, rtol=1e-4, atol=1e-5)


def _groups_of(prompt_len: int, completions: list[list[int]]) -> list[TrajectoryGroup]:
    """One group per list of completion lengths, its samples sharing a prompt of ``prompt_len`` tokens."""
    rng = np.random.default_rng(0)
    groups = []
    for g, lengths in enumerate(completions):
        prompt = rng.integers(3, 600, prompt_len)
        samples = [Sample(i, np.r_[prompt, rng.integers(3, 600, n)], prompt_len,
                          np.r_[np.zeros(prompt_len), np.ones(n)], np.zeros(prompt_len + n),
                          np.zeros(prompt_len + n, dtype=int), reward=float(i % 2))
                   for i, n in enumerate(lengths)]
        groups.append(TrajectoryGroup(run="test", job_id="job", task_id=f"g{g}", samples=samples))
    return groups


def test_the_step_keeps_a_group_together_only_where_that_feeds_the_model_fewer_tokens(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Long shared prompts: a group per micro-batch, its prompt fed once. Short prompts and completions of very
    different lengths: rows sorted by length, as without sharing, since padding each row of a group to its
    longest would cost more than the prompt saves."""
    cfg = TrainerConfig(**{**CFG, "micro_batch_tokens": 400})
    trainer = Trainer(cfg, tiny_model_dir, tmp_path).start(ctx=ctx)
    for prompt_len, completions, grouped in ((100, [[20, 22, 21, 20]] * 3, True),
                                             (2, [[5, 90, 6, 95], [4, 92, 7, 88]], False)):
        batch = collate(_groups_of(prompt_len, completions))
        rows, lengths = list(range(len(batch))), batch.lengths.tolist()
        by_group = plan_ranks(rows, lengths, 1, 400, batch.group_index.tolist())
        by_length = plan_ranks(rows, lengths, 1, 400)
        assert by_group != by_length
        assert (fed_tokens(lay_out(batch, by_group, True)) < fed_tokens(lay_out(batch, by_length, True))) == grouped
        chosen = [m.rows for m in trainer.train_step._micro_batches(rows, batch)]
        assert chosen == (by_group if grouped else by_length)[0]
    assert fed_tokens(lay_out(batch, [[[0, 4]]], True)) == 2 * 7  # no two rows of one group: nothing shared
    assert fed_tokens(lay_out(batch, [[[0, 1]]], True)) == 1 * 1 + 2 * (92 - 1)  # up to the first trained column
    assert fed_tokens(lay_out(batch, [[[0, 1]]], False)) == 2 * 92
    assert fed_tokens(lay_out(batch, [[[0, 1]], [[]]], True)) == 2 * 92 + 2  # a rank's dummy: no rank shares
    trainer.close()


def test_a_non_finite_gradient_skips_the_update_and_says_whose(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    assert apply_gradients(model, optimizer, 1.0, "policy") > 0  # a finite norm: the step is taken
    assert not torch.equal(before[0], model.weight) and model.weight.grad is None
    moved = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(1, 3)).sum() * float("nan")).backward()
    with caplog.at_level("WARNING"):
        assert math.isnan(apply_gradients(model, optimizer, 1.0, "critic"))
    assert all(torch.equal(a, b) for a, b in zip(moved, model.parameters(), strict=True))
    assert model.weight.grad is None and "critic gradient norm is nan: update skipped" in caplog.text


def test_a_non_finite_gradient_in_a_later_update_is_the_step_s_norm(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two updates, the second one's gradient NaN: the step reports NaN for the policy (grad_norm) and the critic
    (critic_grad_norm), not the first update's finite norm, which Python's max returns (it skips a NaN that is
    not first). A reward beyond fp32's range breaks the policy's loss of its row (its unnormalised advantage
    overflows), a reward of 1e30 the critic's squared error (inf; the collator refuses a NaN reward); each row is in
    the second group, so in the second minibatch."""
    cfg = {**CFG, "kl_coef": 0.0, "ppo_minibatches": 2}
    groups = synthetic_groups(0, 2)
    groups[1].samples[0].reward = 1e39
    trainer = Trainer(TrainerConfig(**cfg, std_norm=False), tiny_model_dir, tmp_path / "policy").start(ctx=ctx)
    with caplog.at_level("WARNING"):
        record = trainer.train(groups)
    trainer.close()
    assert record["policy_updates"] == 2 and record["skipped_updates"] == 1 and math.isnan(record["grad_norm"])
    assert caplog.text.count("policy gradient norm is nan: update skipped") == 1

    groups = synthetic_groups(0, 2)
    groups[1].samples[0].reward = 1e30
    critic_cfg = TrainerConfig(**cfg, advantage="gae", critic={"warmup_steps": 1})  # the critic alone trains
    trainer = Trainer(critic_cfg, tiny_model_dir, tmp_path / "critic").start(ctx=ctx)
    caplog.clear()
    with caplog.at_level("WARNING"):
        record = trainer.train(groups)
    trainer.close()
    assert record["policy_updates"] == 0 and record["critic_grad_norm"] == math.inf
    assert caplog.text.count("critic gradient norm is inf: update skipped") == 1


def test_lr_schedule_warmup_then_constant_or_cosine() -> None:
    const = TrainerConfig(warmup_steps=4, total_steps=12, lr_schedule="constant")
    assert [lr_factor(s, const) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = TrainerConfig(warmup_steps=2, total_steps=10, lr_schedule="cosine")
    assert [lr_factor(s, cos) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, cos) == pytest.approx(0.5)  # halfway through the 8 decay steps
    assert lr_factor(10, cos) == pytest.approx(0.0) and lr_factor(50, cos) == pytest.approx(0.0)
    # under gae the first critic.warmup_steps train the critic alone and do not advance the schedule: the decay
    # spans the policy's 10 - 4 steps, so it ends at 0 with the run (it stopped 4 steps short of 0)
    gae = TrainerConfig(warmup_steps=2, total_steps=10, lr_schedule="cosine", advantage="gae",
                        critic={"warmup_steps": 4})
    assert lr_factor(4, gae) == pytest.approx(0.5) and lr_factor(6, gae) == pytest.approx(0.0)
    grpo = TrainerConfig(warmup_steps=2, total_steps=10, lr_schedule="cosine", critic={"warmup_steps": 4})
    assert lr_factor(6, grpo) == pytest.approx(0.5)  # the critic's warm-up is ignored without a critic


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def _second_step_after_a_gradient(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A step on a gradient of ones, then one on a zero gradient: the weights before and after that second step.
    With a zero gradient AdamW moves a weight only by its decay and by the first moment (β1) it kept."""
    for grad in (1.0, 0.0):
        before = [_full(p) for p in _optimizer_params(optimizer)]
        for p in _optimizer_params(optimizer):
            p.grad = torch.full_like(p, grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return before, [_full(p) for p in _optimizer_params(optimizer)]


def test_weight_decay_and_betas_reach_the_policy_and_critic_optimizers(ctx: DistContext, tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    """trainer.weight_decay and trainer.betas set both AdamWs the trainer builds: with β1 = 0 a step on a zero
    gradient keeps no momentum and only decays each matrix by lr·wd (biases and norm gains, in a group of their
    own, not at all); with the defaults (β1 = 0.9, no decay) the same step still moves the weights on the first
    step's momentum."""
    cfg = {**CFG, "advantage": "gae", "kl_coef": 0.0}
    tuned = Trainer(TrainerConfig(**cfg, weight_decay=0.1, betas=(0.0, 0.99)), tiny_model_dir, tmp_path / "a")
    tuned.start(ctx=ctx)
    assert tuned.critic is not None
    for optimizer in (tuned.optimizer, tuned.critic[1]):
        groups = optimizer.param_groups
        assert [(g["weight_decay"], g["betas"]) for g in groups] == [(0.1, (0.0, 0.99)), (0.0, (0.0, 0.99))]
        before, after = _second_step_after_a_gradient(optimizer)
        shrink = 1.0 - groups[0]["lr"] * 0.1
        assert max(b.abs().max().item() for b in before) > 0.1 and shrink < 1.0
        for p, b, a in zip(_optimizer_params(optimizer), before, after, strict=True):
            torch.testing.assert_close(a, b * shrink if p.ndim >= 2 else b, rtol=1e-6, atol=0)
    tuned.close()
    default = Trainer(TrainerConfig(**cfg), tiny_model_dir, tmp_path / "b").start(ctx=ctx)
    assert default.critic is not None
    for optimizer in (default.optimizer, default.critic[1]):
        before, after = _second_step_after_a_gradient(optimizer)
        assert min((a - b).abs().min().item() for b, a in zip(before, after, strict=True)) > 0  # momentum moved all
    default.close()


def test_clip_eps_sets_how_many_tokens_the_later_minibatches_clip(ctx: DistContext, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """trainer.clip_eps reaches the step's loss: over 4 minibatches at a high lr the later ones are clipped
    against π_prox, and a tight ε clips more tokens than the default 0.2, giving another loss."""
    cfg = {**CFG, "kl_coef": 0.0, "loss": "ppo", "lr": 0.05, "grad_clip": 100.0, "ppo_minibatches": 4}
    records = {}
    for eps in (1e-3, 0.2):
        trainer = Trainer(TrainerConfig(**cfg, clip_eps=eps), tiny_model_dir, tmp_path / str(eps)).start(ctx=ctx)
        records[eps] = trainer.train(synthetic_groups(0, 4))
        trainer.close()
    assert records[1e-3]["clip_fraction"] > records[0.2]["clip_fraction"] + 0.05  # of all tokens
    assert records[1e-3]["pg_loss"] != records[0.2]["pg_loss"]


def test_clip_eps_high_sets_the_upper_clip_apart_from_the_lower(ctx: DistContext, tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    """trainer.clip_eps_high (DAPO's clip-higher) replaces ε above 1 only. Over 2 minibatches at a high lr the
    first update is the same in every run (u = 1: nothing clips), so the second sees the same ratios u against the
    same π_prox in every run, and only the clip differs: a token clips where A > 0 and u > 1 + ε_high, or A < 0
    and u < 1 - ε. With ε = 1e-3 both ways, the tokens clipped are exactly those of the lower clip alone (upper at
    1e3) and of the upper clip alone (ε = 1e3, ε_high = 1e-3), each side some. Ignored, the upper clip would be ε:
    the lower-alone run would clip as both, and the upper-alone run, with no clip at 1 ± 1e3, nothing."""
    cfg = {**CFG, "kl_coef": 0.0, "loss": "ppo", "lr": 0.05, "grad_clip": 100.0, "ppo_minibatches": 2}
    runs = {"both": (1e-3, None), "lower": (1e-3, 1e3), "upper": (1e3, 1e-3)}
    records = {}
    for name, (eps, high) in runs.items():
        trainer = Trainer(TrainerConfig(**cfg, clip_eps=eps, clip_eps_high=high), tiny_model_dir,
                          tmp_path / name).start(ctx=ctx)
        records[name] = trainer.train(synthetic_groups(0, 4))
        trainer.close()
    clipped = {name: r["clip_fraction"] * r["loss_tokens"] for name, r in records.items()}  # tokens of the step
    assert clipped["lower"] >= 5 and clipped["upper"] >= 5
    assert clipped["both"] == pytest.approx(clipped["lower"] + clipped["upper"], abs=1e-4)
    assert records["lower"]["pg_loss"] != pytest.approx(records["both"]["pg_loss"], rel=1e-3)


def test_std_norm_off_keeps_the_group_advantages_unscaled(ctx: DistContext, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """trainer.std_norm=false (Dr. GRPO) only centres each group's rewards; true also divides by the group's
    unbiased std. Every group with signal here has std 0.5 (one reward of four differs: [1,0,0,0], [0,1,1,1]; the
    third group is all 1, advantage 0 either way), so on the same first step the policy loss and its gradient
    with std_norm are those without, times 1/(0.5 + 1e-6), exactly (the loss is linear in the advantages).
    Ignored, the two steps would be equal."""
    rewards = ((1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0))
    records = {}
    for norm in ("true", "false"):
        overrides = [f"trainer.{k}={v}" for k, v in {**CFG, "kl_coef": 0.0, "entropy_coef": 0.0}.items()]
        cfg = load_config(overrides=[*overrides, f"trainer.std_norm={norm}"]).trainer
        assert cfg.std_norm == (norm == "true")
        groups = synthetic_groups(0, GROUPS)
        for group, values in zip(groups, rewards, strict=True):
            for s, reward in zip(group.samples, values, strict=True):
                s.reward = reward
        trainer = Trainer(cfg, tiny_model_dir, tmp_path / norm).start(ctx=ctx)
        records[norm] = trainer.train(groups)
        trainer.close()
    normed, plain = records["true"], records["false"]
    assert abs(plain["pg_loss"]) > 1e-4 and plain["loss"] == plain["pg_loss"]
    scale = 1 / (0.5 + 1e-6)
    assert normed["pg_loss"] == pytest.approx(scale * plain["pg_loss"], rel=1e-5)
    assert normed["grad_norm"] == pytest.approx(scale * plain["grad_norm"], rel=1e-5)


def _grad_norm_at_step(optimizer: torch.optim.Optimizer, seen: list[float]) -> None:
    """Record in ``seen`` the global norm of the gradients ``optimizer`` steps on: after the clip, before Adam."""

    def hook(opt: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        grads = [_full(p.grad).double() for p in _optimizer_params(opt) if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    optimizer.register_step_pre_hook(hook)


def test_grad_clip_bounds_the_gradient_the_policy_and_critic_optimizers_step_on(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """trainer.grad_clip scales the policy's and the critic's gradients down to that norm before AdamW steps: at
    1e-3 both optimizers see a norm of exactly 1e-3 (the default 1.0 would leave them at their own norm, or 1.0),
    while the record reports the norm before the clip, far above it; with a clip far above the norm, the
    optimizers see the reported norm itself."""
    cfg = {**CFG, "advantage": "gae", "kl_coef": 0.0}
    for clip in (1e-3, 1e6):
        trainer = Trainer(TrainerConfig(**cfg, grad_clip=clip), tiny_model_dir, tmp_path / str(clip)).start(ctx=ctx)
        assert trainer.critic is not None
        policy: list[float] = []
        critic: list[float] = []
        _grad_norm_at_step(trainer.optimizer, policy)
        _grad_norm_at_step(trainer.critic[1], critic)
        record = trainer.train(synthetic_groups(0, GROUPS))
        trainer.close()
        assert record["policy_updates"] == 1 and len(policy) == len(critic) == 1
        assert min(record["grad_norm"], record["critic_grad_norm"]) > 0.01  # the clip at 1e-3 really acts
        if clip < 1:
            assert policy[0] == pytest.approx(clip, rel=1e-4) and critic[0] == pytest.approx(clip, rel=1e-4)
        else:
            assert policy[0] == pytest.approx(record["grad_norm"], rel=1e-5)
            assert critic[0] == pytest.approx(record["critic_grad_norm"], rel=1e-5)


def test_kl_coef_adds_its_share_of_the_kl_to_the_loss(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    """trainer.kl_coef > 0 scores a reference policy and adds kl_coef · KL to the loss. The first step starts at the
    reference (KL 0, and low-var-kl has no gradient there), so a run with kl_coef 0.5 and one with 0 take the same
    first step; on the second, from the same moved policy, the policy loss is the same but the loss is larger by
    0.5 · kl and the gradient differs. Ignored, the KL would be 0 (no reference) or missing from the loss.
    trainer.kl_estimator k1 (log π − log π_ref) is 0 at the reference too, but its gradient is not: its first step
    differs."""
    cfg = {**CFG, "lr": 0.05, "entropy_coef": 0.0, "loss_agg": "token-mean"}
    records = {}
    for coef, estimator in ((0.5, "low-var-kl"), (0.0, "low-var-kl"), (0.5, "k1")):
        trainer = Trainer(TrainerConfig(**{**cfg, "kl_coef": coef, "kl_estimator": estimator}), tiny_model_dir,
                          tmp_path / f"{coef}-{estimator}")
        trainer.start(ctx=ctx)
        assert (trainer.train_step.ref_model is not None) == (coef > 0)
        steps = 1 if estimator == "k1" else 2  # k1's case is its first step
        records[coef, estimator] = [trainer.train(synthetic_groups(seed, GROUPS)) for seed in range(steps)]
        trainer.close()
    (first, second), (first0, second0) = records[0.5, "low-var-kl"], records[0.0, "low-var-kl"]
    first_k1 = records[0.5, "k1"][0]
    assert first_k1["kl"] == pytest.approx(0.0, abs=1e-6)
    assert first_k1["grad_norm"] != pytest.approx(first0["grad_norm"], rel=1e-3)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["loss"] == pytest.approx(first0["loss"], rel=1e-5)
    assert first["grad_norm"] == pytest.approx(first0["grad_norm"], rel=1e-5)
    assert second0["kl"] == 0.0 and second0["loss"] == second0["pg_loss"]
    assert second["kl"] > 1e-3  # the policy moved away from the reference
    assert second["pg_loss"] == pytest.approx(second0["pg_loss"], rel=1e-4, abs=1e-6)
    assert second["loss"] - second["pg_loss"] == pytest.approx(0.5 * second["kl"], rel=1e-4)
    assert second["grad_norm"] != pytest.approx(second0["grad_norm"], rel=1e-3)


def test_cuda_without_a_gpu_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """trainer.device=cuda on a host where torch sees no GPU is an error, not a silent fall back to the CPU that
    auto (the default) would pick: resolve_device, a trainer's start and ``python -m trainer`` (one line, exit 2)
    refuse it. Where torch sees a GPU, cuda is what it picks."""
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == resolve_device("auto").type == "cuda"
        return
    message = "trainer.device: cuda requested but torch sees no GPU"
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=message):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=message):
        Trainer(TrainerConfig(device="cuda"), tiny_model_dir, tmp_path).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    proc = subprocess.run([sys.executable, "-m", "trainer", f"run.dir={tmp_path}", f"model.path={tiny_model_dir}",
                           "trainer.device=cuda"], capture_output=True, text=True, timeout=120,
                          env={**env, "ROLLWAVE_CHECKPOINT_TOKEN": "x" * 40}, cwd=Path(__file__).resolve().parents[1])
    assert (proc.returncode, proc.stderr.strip()) == (2, f"error: {message}"), proc.stderr
