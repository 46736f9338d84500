"""The numbers of multi-turn, tool-calling trajectories, from the engine's sampling to the trainer's loss.

The episodes are real: the embedded engine serves the demo's SFT warm start (``tests/data/arith_warm_start``), which
calls the calculator, and the agent loop runs real tools. Every /generate goes through a recorder that keeps what
the engine was given and what it answered, so each check compares the trajectory with the engine's own numbers:

- every token the model sampled is in the sample, in order, loss mask 1, with exactly the logprob the engine returned
  (and the logprob a teacher-forced forward of the model gives at the group's temperature);
- every other token (prompt, template glue, tool output) has loss mask 0, no logprob and no version;
- the tokens before each turn are exactly those the engine was given for it (no re-tokenisation between turns);
- each token limit ends the episode with its finish reason, and the truncated samples are the ones over-long
  shaping masks;
- in the trainer, π_θ of every trained token of every micro-batch equals its behaviour logprob, at several ranks,
  token budgets and minibatch counts, with and without a shared prompt, and each row's advantage is its group's
  GRPO value computed by hand.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM, AutoTokenizer

from buffer.schema import Sample, TrajectoryGroup, decode_group, encode_group
from core.config import OverlongConfig, RolloutConfig, TrainerConfig
from core.tasks import load_tasks
from core.trajectory import ChatRenderer, masked_spans
from rollout_server.agent_loop import AgentLoop
from rollout_server.engine.process import EngineProcess
from rollout_server.engine_client import EngineClient
from rollout_server.metrics import RolloutMetrics
from rollout_server.tools import ToolRegistry
from rollout_server.tools.calculator import CalculatorTool
from rollout_server.tools.check_answer import CheckAnswerTool
from trainer.advantages import compute_advantages
from trainer.batching import collate, plan_step
from trainer.parallel import DistContext
from trainer.shaping import shape_batch
from trainer.worker import Trainer

WARM_START = Path(__file__).resolve().parent / "data" / "arith_warm_start"
# name -> (rollout settings, arith test tasks from offset, samples per task); each its own tasks, so group ids differ
SETTINGS: dict[str, tuple[dict[str, Any], int, int]] = {
    "multi_turn": ({"temperature": 0.8, "max_turns": 3, "max_new_tokens": 48, "max_total_tokens": 400}, 0, 6),
    "turn_limit": ({"temperature": 1.3, "max_turns": 3, "max_new_tokens": 12, "max_total_tokens": 400}, 2, 4),
    "context_limit": ({"temperature": 0.7, "max_turns": 3, "max_new_tokens": 48, "max_total_tokens": 200}, 4, 6),
    "turns_limit": ({"temperature": 0.7, "max_turns": 1, "max_new_tokens": 48, "max_total_tokens": 400}, 6, 4),
}


@dataclass
class Call:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    reply: dict[str, Any]


class Recorder:
    """The real engine client, every /generate passed through and kept (what it was given, what it answered)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.calls: list[Call] = []

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], return_logprob: bool = True,
                       rid: str | None = None) -> dict[str, Any]:
        reply = await self.client.generate(input_ids, sampling_params, return_logprob, rid)
        self.calls.append(Call(str(rid), list(input_ids), dict(sampling_params), reply))
        return reply


@dataclass
class Rollout:
    config: RolloutConfig
    groups: list[TrajectoryGroup]
    calls: list[Call]

    def turns(self, group: TrajectoryGroup, sample: Sample) -> list[Call]:
        """The engine calls of one sample, in turn order (request ids are ``task-sample-turn-nonce``)."""
        prefix = f"{group.task_id}-{sample.sample_index}-"
        mine = [c for c in self.calls if c.rid.startswith(prefix)]
        return sorted(mine, key=lambda c: int(c.rid[len(prefix):].split("-")[0]))


@pytest.fixture(scope="module")
def warm_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(WARM_START)


@pytest.fixture(scope="module")
def warm_model() -> Any:
    return AutoModelForCausalLM.from_pretrained(WARM_START, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rollouts(warm_tokenizer: Any) -> Iterator[dict[str, Rollout]]:
    """One run of each of ``SETTINGS`` against the engine serving the warm start; every group through the wire."""

    async def roll(url: str) -> dict[str, Rollout]:
        out = {}
        async with EngineClient(url) as client:
            for name, (settings, offset, n) in SETTINGS.items():
                recorder = Recorder(client)
                config = RolloutConfig(n_samples=n, **settings)
                loop = AgentLoop(recorder, warm_tokenizer, ToolRegistry([CalculatorTool(), CheckAnswerTool()]),
                                 config, metrics=RolloutMetrics())
                tasks = load_tasks("arith", split="test", limit=2, offset=offset)
                groups = [await loop.run_group(t, run="numbers", job_id=name) for t in tasks]
                out[name] = Rollout(config, [decode_group(encode_group(g)) for g in groups], recorder.calls)
        return out

    with EngineProcess(WARM_START, max_batch_size=16, max_context=1024, threads=1) as engine:
        yield asyncio.run(roll(engine.url))


def _generated_spans(sample: Sample) -> list[tuple[int, int]]:
    return [(a, b) for a, b, v in masked_spans(sample.loss_mask) if v]


def _closed(call: Call, eos_id: int) -> bool:
    """The turn ends with its end token, or with another stop token of the model that the engine says it matched."""
    out, finish = call.reply["output_ids"], call.reply["meta_info"]["finish_reason"]
    return out[-1] == eos_id or (finish["type"] == "stop" and finish.get("matched") == out[-1])


def _tool_answers(sample: Sample) -> list[list[dict[str, Any]]]:
    """The tool messages that answered each assistant turn that called tools, in turn order."""
    turns: list[list[dict[str, Any]]] = []
    for before, message in zip(sample.messages, sample.messages[1:], strict=False):
        if message["role"] == "tool":
            if before["role"] == "assistant":
                turns.append([])
            turns[-1].append(message)
    return turns


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_sampled_token_is_trained_with_the_engine_s_logprob_and_nothing_else_is(
        rollouts: dict[str, Rollout], name: str, warm_model: Any) -> None:
    rollout = rollouts[name]
    temperature = rollout.config.temperature
    for group in rollout.groups:
        assert group.temperature == temperature
        for s in group.samples:
            ids = s.token_ids.tolist()
            turns, spans = rollout.turns(group, s), _generated_spans(s)
            assert len(turns) == len(spans) == s.num_turns >= 1, (name, s.finish_reason)
            assert spans[0][0] == s.prompt_len
            for (a, b), call in zip(spans, turns, strict=True):
                assert call.input_ids == ids[:a]  # the engine continued from exactly the stored tokens
                assert ids[a:b] == call.reply["output_ids"]
                engine_logprobs = [e[0] for e in call.reply["meta_info"]["output_token_logprobs"]]
                assert s.behaviour_logprobs[a:b].tolist() == np.asarray(engine_logprobs, dtype=np.float32).tolist()
                assert (s.token_versions[a:b] == 0).all()
                room = rollout.config.max_total_tokens - len(call.input_ids)
                assert call.sampling_params == {"max_new_tokens": min(rollout.config.max_new_tokens, room),
                                                "temperature": temperature, "top_p": 1.0, "top_k": -1}
            off = ~s.loss_mask.astype(bool)
            assert (s.behaviour_logprobs[off] == 0).all() and (s.token_versions[off] == -1).all()
            assert spans[-1][1] == len(ids)  # nothing is appended after the last turn
            with torch.no_grad():
                logits = warm_model(torch.tensor(s.token_ids, dtype=torch.long)[None]).logits[0].float()
            forced = torch.log_softmax(logits / temperature, dim=-1)
            positions = np.flatnonzero(s.loss_mask)
            gap = forced[positions - 1, s.token_ids[positions]].numpy() - s.behaviour_logprobs[positions]
            assert np.abs(gap).max() <= 1e-4


def test_the_glue_between_turns_is_the_template_s_tool_turn(rollouts: dict[str, Rollout], warm_tokenizer: Any) -> None:
    """Between two turns: the template's end of the assistant turn, the tool results as the chat template renders
    them and the next assistant header, nothing else; the rollout had episodes of several turns with tool calls."""
    renderer = ChatRenderer(warm_tokenizer)
    tool_turns = 0
    for rollout in rollouts.values():
        for group in rollout.groups:
            for s in group.samples:
                spans = _generated_spans(s)
                answers = _tool_answers(s)
                assert len(answers) >= len(spans) - 1
                for (_, end), (start, _), answer in zip(spans, spans[1:], answers, strict=False):
                    glue = renderer.turn_end_suffix + renderer.tool_turn_ids(answer)
                    assert s.token_ids[end:start].tolist() == glue
                    tool_turns += 1
    assert tool_turns >= 4, "the warm start called no tools: nothing multi-turn was checked"


def test_each_token_limit_ends_the_episode_with_its_reason(rollouts: dict[str, Rollout], warm_tokenizer: Any) -> None:
    """``length``: the last turn used all of max_new_tokens without its end token; ``max_total_tokens``: the context
    is full, or the tool turn would not fit after a finished turn; ``max_turns``: the last allowed turn called a
    tool, whose answer the policy never sees. The first two are the truncated samples over-long masking leaves out
    of the loss."""
    eos = warm_tokenizer.eos_token_id
    renderer = ChatRenderer(warm_tokenizer)
    seen: set[str] = set()
    for name, rollout in rollouts.items():
        cfg = rollout.config
        for group in rollout.groups:
            for s in group.samples:
                last = rollout.turns(group, s)[-1]
                out, finish = last.reply["output_ids"], last.reply["meta_info"]["finish_reason"]
                seen.add(s.finish_reason)
                assert s.truncated == (s.finish_reason in ("length", "max_total_tokens"))
                if s.finish_reason == "stop":  # answered: the last turn called no tool
                    assert _closed(last, eos) and s.messages[-1]["role"] == "assistant"
                    assert not s.messages[-1].get("tool_calls")
                elif s.finish_reason == "length":
                    assert not _closed(last, eos) and finish["type"] == "length"
                    assert len(out) == cfg.max_new_tokens == last.sampling_params["max_new_tokens"]
                elif s.finish_reason == "max_total_tokens":
                    assert len(s.token_ids) <= cfg.max_total_tokens
                    if not _closed(last, eos):
                        assert len(s.token_ids) == cfg.max_total_tokens and finish["type"] == "length"
                    else:  # a finished turn whose tool results (and the next header) would not fit
                        assert s.messages[-1]["role"] == "tool"
                        room = cfg.max_total_tokens - len(s.token_ids)
                        assert len(renderer.turn_end_suffix + renderer.tool_turn_ids(_tool_answers(s)[-1])) >= room
                else:
                    assert s.finish_reason == "max_turns", (name, s.finish_reason)
                    assert s.num_turns == cfg.max_turns and _closed(last, eos) and s.messages[-1]["role"] == "tool"
        groups = rollout.groups
        shaped, stats = shape_batch(collate(groups), groups, OverlongConfig(mode="mask"))
        truncated = [s.truncated for g in groups for s in g.samples]
        assert stats["overlong_masked"] == sum(truncated)
        assert [not bool(row.any()) for row in shaped.loss_mask] == truncated
    assert {"length", "max_total_tokens", "max_turns", "stop"} <= seen, seen


def _grpo_by_hand(rewards: list[float]) -> list[float]:
    """GRPO for one group: (r - mean) / (unbiased std + 1e-6), all 0 where the rewards are equal."""
    n, mean = len(rewards), sum(rewards) / len(rewards)
    if n == 1 or max(rewards) == min(rewards):
        return [0.0] * n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_trainer_scores_every_trained_token_as_the_engine_did_however_the_step_is_cut(
        rollouts: dict[str, Rollout], ctx: DistContext, tmp_path: Path, world: int) -> None:
    """The step's micro-batches as each of ``world`` ranks would run them (several token budgets, shared prompt on
    and off, one or three minibatches), forwarded with the served weights: π_θ of every trained token equals the
    engine's behaviour logprob (the groups were sampled at different temperatures), every row of a minibatch is
    trained exactly once, its tokens, mask and logprobs are its sample's, and its advantage is its group's GRPO
    value by hand."""
    groups = [g for name in ("multi_turn", "turn_limit", "context_limit") for g in rollouts[name].groups]
    rewards = [[float(i % 3 == 0) for i in range(len(g.samples))] for g in groups]  # a signal in every group
    for g, rs in zip(groups, rewards, strict=True):
        for s, r in zip(g.samples, rs, strict=True):
            s.reward = r
    trainer = Trainer(TrainerConfig(device="cpu", kl_coef=0.0, total_steps=1), WARM_START, tmp_path).start(ctx=ctx)
    step = trainer.train_step
    batch = collate(groups, vocab_size=step.vocab_size)
    adv = compute_advantages(batch.rewards, batch.group_index, batch.loss_mask)
    samples = [s for g in groups for s in g.samples]
    want_adv = [a for rs in rewards for a in _grpo_by_hand(rs)]
    n, worst = len(batch), 0.0
    for budget in (300, 1000, 8192):
        for share in (True, False):
            for minibatches in ([list(range(n))], [list(range(i, min(n, i + 10))) for i in range(0, n, 10)]):
                for rows in minibatches:
                    trained = []
                    for plan in plan_step(batch, rows, world, budget, share):
                        for mb_rows, mb, layout in plan:
                            with torch.no_grad():
                                logp, _, columns = step._forward_logprobs(step.model, mb, layout)
                            if not mb_rows:
                                continue
                            trained += mb_rows
                            mask = mb.loss_mask[:, columns]
                            assert int(mask.sum()) == int(mb.loss_mask.sum())  # no trained token left out
                            for i, row in enumerate(mb_rows):
                                s = samples[row]
                                k = len(s.token_ids)
                                assert mb.input_ids[i, :k].tolist() == s.token_ids.tolist()
                                assert mb.loss_mask[i, : k - 1].tolist() == s.loss_mask[1:].astype(bool).tolist()
                                group = groups[int(batch.group_index[row])]
                                assert mb.temperatures[i] == pytest.approx(group.temperature)
                                assert mb.behaviour_logprobs[i, : k - 1].tolist() == s.behaviour_logprobs[1:].tolist()
                                row_adv = adv[row, columns][mask[i]]
                                assert row_adv.numel() == s.num_generated
                                assert torch.allclose(row_adv, torch.tensor(want_adv[row], dtype=torch.float32))
                            gap = (logp - mb.behaviour_logprobs[:, columns]).abs()[mask]
                            worst = max(worst, float(gap.max()))
                    assert sorted(trained) == rows
    trainer.close()
    assert worst <= 1e-4


def test_grpo_advantages_by_hand_equal_rewards_and_different_lengths() -> None:
    """Three groups: binary rewards of samples of different lengths, all equal (no signal), and graded rewards with
    DAPO's over-long penalty separating two samples of one outcome; every generated token of a sample carries its
    sample's value, every other token 0."""
    groups = synthetic_groups(7, 3, group_size=4)
    outcome = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 1.0, 1.0, 0.25]]
    for g, rs in zip(groups, outcome, strict=True):
        for s, r in zip(g.samples, rs, strict=True):
            s.reward = r
    lengths = [s.num_generated for g in groups for s in g.samples]
    assert len(set(lengths)) > 4
    batch = collate(groups)
    adv = compute_advantages(batch.rewards, batch.group_index, batch.loss_mask)
    # (1 - 0.5) / (sqrt(1/3) + 1e-6): the unbiased std of [1, 0, 0, 1] is sqrt(1/3)
    half = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    std = math.sqrt(((0 - 0.5625) ** 2 + 2 * (1 - 0.5625) ** 2 + (0.25 - 0.5625) ** 2) / 3)
    want = [half, -half, -half, half, 0.0, 0.0, 0.0, 0.0] + [(r - 0.5625) / (std + 1e-6) for r in outcome[2]]
    for row, value in enumerate(want):
        trained = batch.loss_mask[row]
        assert int(trained.sum()) == lengths[row]
        assert torch.all(adv[row][trained] == torch.tensor(value, dtype=torch.float32))
        assert torch.all(adv[row][~trained] == 0)
    penalty = OverlongConfig(mode="penalty", max_tokens=20, buffer_tokens=10, penalty_factor=1.0)
    shaped, _ = shape_batch(batch, groups, penalty)
    shaped_adv = compute_advantages(shaped.rewards, shaped.group_index, shaped.loss_mask)
    for g_index, g in enumerate(groups):
        rows = [r for r in range(len(batch)) if int(batch.group_index[r]) == g_index]
        rewards = [s.reward + min(0.0, max(-1.0, (10 - s.num_generated) / 10)) for s in g.samples]
        for row, value in zip(rows, _grpo_by_hand(rewards), strict=True):
            assert torch.allclose(shaped_adv[row][shaped.loss_mask[row]], torch.tensor(value, dtype=torch.float32))


def test_groups_with_one_id_in_a_step_keep_their_own_baseline_and_temperature() -> None:
    """The step tells its groups apart by position: two groups that share an id (the same task rolled out twice, at
    two temperatures) are two baselines, each scored at its own temperature, not one group of eight."""
    groups = synthetic_groups(3, 2)
    groups[1].task_id = groups[0].task_id
    groups[0].temperature, groups[1].temperature = 0.5, 2.0
    for g, rs in zip(groups, ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]), strict=True):
        for s, r in zip(g.samples, rs, strict=True):
            s.reward = r
    batch = collate(groups)
    assert batch.group_index.tolist() == [0] * 4 + [1] * 4
    assert batch.temperatures.tolist() == [0.5] * 4 + [2.0] * 4
    assert not compute_advantages(batch.rewards, batch.group_index, batch.loss_mask).any()  # each group all equal
