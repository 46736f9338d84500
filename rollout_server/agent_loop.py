"""The multi-turn agent loop: one task -> n episodes (generate, call tools, repeat) -> one trajectory group.

Each episode is a small state machine, like verl's ``AsyncRolloutRequest``::

    PENDING -> GENERATING -> CALLING_TOOLS -> GENERATING -> ... -> COMPLETED | FAILED

Token-in/token-out (see ``trajectory.py``): the engine's ``output_ids`` are appended as they are,
with their behaviour logprobs and the policy version of each token. Every limit ends the episode
with its own ``finish_reason``: ``stop`` (answered; a turn ended by any stop token of the model, Qwen's
``<|endoftext|>`` as well as ``<|im_end|>``, is finished and its tool calls run), ``length`` (a turn hit
``max_new_tokens`` before its end token; a turn whose end token is the last allowed one is answered, whatever the
engine reports),
``max_total_tokens`` (the context budget), ``max_turns``, ``abort`` (the engine aborted the
request), ``error`` (the engine failed, or a tool could not be set up) or ``reward_error`` (the
reward function failed). The last three are failures (``Sample.failed``), counted in
``rollwave_rollout_failed_total{reason}``: such an episode has no outcome, so the worker rolls its
group out again rather than let it be trained as reward 0. Tools and rewards are the operator's code, each await
bounded (``rollout.tool_timeout_s``, ``rollout.reward_timeout_s``): a tool call past it is answered to the model as
an error (outcome ``timeout``), a tool create or a reward past it fails the episode.

A task whose prompt alone leaves no room within ``max_total_tokens`` to generate a single token runs no episode:
``run_group`` raises ``PromptTooLong``, and the worker dead-letters the task at once (it would fail the same way on
every attempt; ending its samples ``max_total_tokens`` with reward 0 would train on bad input).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import numbers
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from buffer.schema import Sample, ToolCallRecord, TrajectoryGroup
from core.config import RolloutConfig
from core.deadline import Overdue, within
from core.rewards import RewardComputer, RewardError
from core.trajectory import ChatRenderer, TrajectoryBuilder, Turn, model_stop_ids
from rollout_server.engine_client import EngineClient, EngineError
from rollout_server.metrics import RolloutMetrics
from rollout_server.tool_parser import ToolCall, ToolCallError, parse_tool_calls
from rollout_server.tools import ToolRegistry, ToolResult

log = logging.getLogger(__name__)
# SGLang's finish_reason "matched" for a request whose logits held a NaN: it ends the request as stopped (200), a stop
# token in place of the one it could not sample, which a trainer would take for a finished turn
NAN_HAPPENED = "NaN happened"


class State(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    CALLING_TOOLS = "calling_tools"
    COMPLETED = "completed"
    FAILED = "failed"


class EngineReplyError(ValueError):
    """A /generate reply that breaks the engine contract (lengths or ids that do not match)."""


class PromptTooLong(ValueError):
    """A task's prompt leaves no room to generate within ``rollout.max_total_tokens``: bad input, not bad luck, so
    the task is dead-lettered rather than rolled out again or trained as reward 0."""

    @classmethod
    def of(cls, task_id: str, prompt_tokens: int, limit: int) -> PromptTooLong:
        return cls(f"task {task_id}: its prompt is {prompt_tokens} tokens, which leaves no room to generate a token "
                   f"within rollout.max_total_tokens ({limit})")


def parse_version(version: Any) -> int:
    """Engine weight versions are strings; ours are integers the pusher numbers. ``"7"`` -> 7; anything else
    (SGLang's ``"default"``, ``"step0"``, None) is an error: a token with an unknown version cannot be judged
    for staleness, and reading it as 0 would silently mislabel it."""
    text = str(version).strip()
    if not text.lstrip("-").isdigit():
        raise ValueError(f"weight version {version!r} is not an integer: rollwave numbers versions 0, 1, 2, ... "
                         "(start the engine with --weight-version 0)")
    return int(text)


def turn_from_reply(reply: dict[str, Any]) -> Turn:
    """``output_ids``, behaviour logprobs and per-token versions of one SGLang /generate reply (as
    ``EngineClient`` normalises it: ``weight_versions_approximate`` when the engine gave no spans)."""
    ids = [int(t) for t in reply.get("output_ids") or []]
    meta = reply.get("meta_info") or {}
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(ids) or any(int(e[1]) != t for e, t in zip(entries, ids, strict=True)):
        raise EngineReplyError(f"output_token_logprobs ({len(entries)}) do not match output_ids ({len(ids)})")
    logprobs = [float(e[0]) for e in entries]
    finish = meta.get("finish_reason") or {}
    if finish.get("matched") == NAN_HAPPENED or not all(map(math.isfinite, logprobs)):
        raise EngineReplyError(f"the policy's logits were not finite (finish_reason {finish}, logprobs "
                               f"{[lp for lp in logprobs if not math.isfinite(lp)][:4]}): the policy diverged or "
                               "its weights hold NaN; the turn is not trained")
    spans = meta.get("weight_versions")
    if ids and not spans:
        raise EngineReplyError("the reply says no weight version for its tokens (SGLang >= 0.5.6 is required)")
    versions = [-1] * len(ids)
    try:
        for span in spans or []:
            start, end = int(span["start"]), min(int(span["end"]), len(ids))
            versions[start:end] = [parse_version(span["version"])] * max(0, end - start)
    except ValueError as exc:
        raise EngineReplyError(str(exc)) from None
    if -1 in versions:
        raise EngineReplyError(f"weight_versions {spans} do not cover the {len(ids)} output tokens")
    return Turn(ids, logprobs, versions, bool(meta.get("weight_versions_approximate")))


def ends_turn(ids: list[int], reply: dict[str, Any], eos_id: int, stop_ids: Collection[int] = ()) -> bool:
    """The turn's last token closes it: the chat template's end token, or another stop token of the model (Qwen's
    ``<|endoftext|>``), which the engine names as the int it matched (a stop string is a str), or which is one of
    ``stop_ids`` (``model_stop_ids``) where it was the last token allowed and the engine says ``length``. Its text is
    then the tokens before it."""
    if not ids:
        return False
    finish = reply.get("meta_info", {}).get("finish_reason") or {}
    return (ids[-1] == eos_id or ids[-1] in stop_ids
            or (finish.get("type") == "stop" and finish.get("matched") == ids[-1]))


def checked_result(result: Any) -> ToolResult:
    """``result`` if it is a ``ToolResult`` with text and no reward or a finite one (as a float: numpy's numbers too),
    else TypeError saying what it is:
    a tool's return value is operator code as much as its exceptions, and one it cannot use must not fail the group
    (nor a NaN reward poison it)."""
    if not isinstance(result, ToolResult):
        raise TypeError(f"it returned a {type(result).__name__}, not a ToolResult")
    if not isinstance(result.text, str):
        raise TypeError(f"its text is a {type(result.text).__name__}, not a str")
    reward = result.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)  # numpy's too
                               or not math.isfinite(reward)):
        raise TypeError(f"its reward is {reward!r}, not a finite number")
    return result if reward is None or type(reward) is float else dataclasses.replace(result, reward=float(reward))


@dataclass
class Episode:
    """One sample's state while it runs (verl's ``AsyncRolloutRequest``)."""

    sample_index: int
    builder: TrajectoryBuilder
    messages: list[dict[str, Any]]
    queued: float
    state: State = State.PENDING
    instance_ids: dict[str, str] = field(default_factory=dict)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    num_turns: int = 0
    finish_reason: str = ""
    final_text: str = ""
    error: str | None = None
    failure: str = ""  # what failed (engine, abort, tool, reward); "" when the episode has an outcome
    started: float = field(default_factory=time.time)

    def finish(self, reason: str) -> None:
        self.finish_reason, self.state = reason, State.COMPLETED

    def fail(self, failure: str, error: str, reason: str = "error") -> None:
        self.finish_reason, self.state, self.error, self.failure = reason, State.FAILED, error, failure


class AgentLoop:
    """Runs episodes of tasks against one engine; owns nothing that needs closing (the caller owns
    the engine client, the tools and the metrics)."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        tools: ToolRegistry,
        config: RolloutConfig,
        metrics: RolloutMetrics | None = None,
        reward: RewardComputer | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = ChatRenderer(tokenizer)
        self.stop_ids = model_stop_ids(tokenizer)
        self.tools = tools
        self.config = config
        self.metrics = metrics if metrics is not None else RolloutMetrics()
        self.reward = reward if reward is not None else RewardComputer(
            config.reward, config.reward_allowlist, config.reward_timeout_s
        )

    async def run_group(
        self, task: Any, *, run: str, job_id: str, n: int | None = None, queued: float | None = None
    ) -> TrajectoryGroup:
        """The ``n`` samples of ``task`` (default ``config.n_samples``), run concurrently, as one group; raises
        ``PromptTooLong`` before any runs when the prompt leaves no room to generate."""
        try:
            schemas = self.tools.schemas(task.tools)
        except KeyError as exc:  # a task/config mismatch: fail the group loudly
            raise ValueError(f"task {task.task_id}: {exc.args[0]}") from None
        prompt_ids = self.renderer.prompt_ids(task.messages, schemas)
        if len(prompt_ids) >= self.config.max_total_tokens:
            raise PromptTooLong.of(task.task_id, len(prompt_ids), self.config.max_total_tokens)
        queued = time.time() if queued is None else queued
        n = self.config.n_samples if n is None else n
        episodes = [asyncio.ensure_future(self.run_episode(task, i, prompt_ids, queued)) for i in range(n)]
        try:
            samples = await asyncio.gather(*episodes)
        except BaseException:  # the group has failed: its other episodes stop (releasing their tools) before it says so
            for episode in episodes:
                episode.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            raise
        self.metrics.groups_completed.inc()
        return TrajectoryGroup(
            run=run, job_id=job_id, task_id=task.task_id, samples=list(samples), temperature=self.config.temperature
        )

    async def run_episode(self, task: Any, sample_index: int, prompt_ids: list[int], queued: float) -> Sample:
        ep = Episode(sample_index, TrajectoryBuilder(prompt_ids), [dict(m) for m in task.messages], queued)
        self.metrics.inflight_requests.inc()
        try:
            await self._create_tools(task, ep)
            while ep.state in (State.PENDING, State.GENERATING):
                ep.state = State.GENERATING
                calls, errors = await self._generate(task, ep)
                if ep.state is State.CALLING_TOOLS:
                    await self._call_tools(task, ep, calls, errors)
            reward, info = 0.0, {}
            if ep.state is State.COMPLETED:
                try:
                    reward, info = await self.reward.score(task, ep.messages, ep.final_text, ep.tool_rewards)
                except RewardError as exc:
                    ep.fail("reward", str(exc), reason="reward_error")
            if ep.failure:
                info = {"error": ep.error}
        finally:
            await self._release_tools(ep)
            self.metrics.inflight_requests.dec()
        return self._sample(ep, reward, info)

    async def _create_tools(self, task: Any, ep: Episode) -> None:
        for name in task.tools:
            instance_id = f"{task.task_id}/{ep.sample_index}/{uuid.uuid4().hex[:8]}"
            kwargs = task.tools_kwargs.get(name, {}).get("create_kwargs", {})
            ep.instance_ids[name] = instance_id  # released even if create fails: it may have taken something first
            try:
                await within(self.config.tool_timeout_s, self.tools.get(name).create(instance_id, **kwargs))
            except Exception as exc:  # user tool code: the episode fails with the reason, the group goes on
                ep.fail("tool", f"tool {name}: create failed: {type(exc).__name__}: {exc}")
                return

    async def _release_tools(self, ep: Episode) -> None:
        for name, instance_id in ep.instance_ids.items():
            try:
                await within(self.config.tool_timeout_s, self.tools.get(name).release(instance_id))
            except Exception as exc:  # user tool code: the finished sample is kept, the leak is logged
                log.warning("tool %s: release of %s failed: %s: %s", name, instance_id, type(exc).__name__, exc)

    def _sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        cfg = self.config
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
        }

    async def _generate(self, task: Any, ep: Episode) -> tuple[list[ToolCall], list[ToolCallError]]:
        """One assistant turn; sets the next state. Returns the parsed calls when tools are next. The context has
        room for at least one token: ``run_group`` checked the prompt, ``_call_tools`` each tool turn."""
        cfg = self.config
        max_new = min(cfg.max_new_tokens, cfg.max_total_tokens - len(ep.builder))
        rid = f"{task.task_id}-{ep.sample_index}-{ep.num_turns}-{uuid.uuid4().hex[:8]}"
        try:
            reply = await self.engine.generate(
                ep.builder.token_ids, self._sampling_params(max_new), return_logprob=True, rid=rid
            )
            turn = turn_from_reply(reply)
        except (EngineError, EngineReplyError) as exc:
            ep.fail("engine", f"engine: {type(exc).__name__}: {exc}")
            return [], []
        ep.builder.add_generated(turn)
        ep.num_turns += 1
        self.metrics.generated_tokens.inc(len(turn.output_ids))
        reason = (reply.get("meta_info", {}).get("finish_reason") or {}).get("type", "stop")
        closed = ends_turn(turn.output_ids, reply, self.renderer.eos_id, self.stop_ids)
        text = self.renderer.decode(turn.output_ids[:-1] if closed else turn.output_ids)
        ep.final_text = text
        if reason == "abort":
            ep.messages.append({"role": "assistant", "content": text})
            ep.fail("abort", "the engine aborted the request", reason="abort")
            return [], []
        normal_text, calls, errors = parse_tool_calls(text, task.tools)
        if not closed or not (calls or errors):
            ep.messages.append({"role": "assistant", "content": text})
            # a turn that emitted its end token is finished, though SGLang reports it as length when that
            # token was the last allowed one (its length check comes before the stop check)
            if not closed and reason == "length":
                ep.finish("max_total_tokens" if max_new < cfg.max_new_tokens else "length")
            else:
                ep.finish("stop")
            return [], []
        tool_calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        ep.messages.append({"role": "assistant", "content": normal_text, "tool_calls": tool_calls})
        ep.state = State.CALLING_TOOLS
        return calls, errors

    async def _call_tools(self, task: Any, ep: Episode, calls: list[ToolCall], errors: list[ToolCallError]) -> None:
        """Run the turn's calls concurrently, answer each (errors too) in order, then continue or stop."""
        done = await asyncio.gather(*(self._run_call(task, ep, c) for c in calls))
        ep.tool_rewards += [float(result.reward) for result, _ in done if result.reward is not None]  # call order
        answers = [(c.index, c.name, result.text, record) for c, (result, record) in zip(calls, done, strict=True)]
        for err in errors:
            name = err.name or "invalid"
            # a name the model made up is no label: each would be a new series, without bound
            label = name if name == "invalid" or name in self.tools.tools else "unknown"
            self.metrics.tool_calls.labels(tool=label, outcome="parse_error").inc()
            record = ToolCallRecord(name=name, ok=False, error=err.message)
            answers.append((err.index, name, f"Error: {err.message}", record))
        answers.sort(key=lambda a: a[0])
        ep.tool_calls += [record for *_, record in answers]
        tool_messages = [{"role": "tool", "name": name, "content": text} for _, name, text, _ in answers]
        ep.messages += tool_messages
        if ep.num_turns >= self.config.max_turns:
            ep.finish("max_turns")
            return
        ids = self.renderer.turn_end_suffix + self.renderer.tool_turn_ids(tool_messages)
        if len(ep.builder) + len(ids) >= self.config.max_total_tokens:
            ep.finish("max_total_tokens")
            return
        ep.builder.add_template(ids)
        ep.state = State.GENERATING

    async def _run_call(self, task: Any, ep: Episode, call: ToolCall) -> tuple[ToolResult, ToolCallRecord]:
        tool = self.tools.get(call.name)
        start = time.perf_counter()
        outcome = None  # the result's, unless the call timed out
        try:
            problem = tool.check_arguments(call.arguments)
            if problem is not None:
                result = ToolResult.failure(problem)
            else:
                execute = tool.execute(ep.instance_ids[call.name], call.arguments)
                result = checked_result(await within(self.config.tool_timeout_s, execute))
        except Overdue as exc:  # cancelled: the model is told, the call is counted as a timeout
            log.warning("tool %s, task %s sample %d: %s (rollout.tool_timeout_s)", call.name, task.task_id,
                        ep.sample_index, exc)
            result, outcome = ToolResult.failure(f"{call.name} timed out: {exc}"), "timeout"
        except Exception as exc:  # user tool code: the model is told, the call is counted as an error
            log.warning("tool %s raised: %s: %s", call.name, type(exc).__name__, exc)
            result = ToolResult.failure(f"{call.name} failed: {type(exc).__name__}: {exc}")
        latency = time.perf_counter() - start
        outcome = outcome or ("ok" if result.ok else result.outcome or "error")
        self.metrics.tool_calls.labels(tool=call.name, outcome=outcome).inc()
        self.metrics.tool_latency.labels(tool=call.name).observe(latency)
        return result, ToolCallRecord(name=call.name, ok=result.ok, error=result.error, latency_s=latency)

    def _sample(self, ep: Episode, reward: float, info: dict[str, Any]) -> Sample:
        self.metrics.finish_reasons.labels(reason=ep.finish_reason).inc()
        self.metrics.episode_turns.observe(ep.num_turns)
        if ep.failure:
            self.metrics.failed.labels(reason=ep.failure).inc()
        else:
            self.metrics.reward.observe(reward)
        return Sample(
            sample_index=ep.sample_index,
            prompt_len=ep.builder.prompt_len,
            **ep.builder.arrays(),
            versions_approximate=ep.builder.versions_approximate,
            reward=reward,
            reward_info=info,
            finish_reason=ep.finish_reason,
            num_turns=ep.num_turns,
            tool_calls=ep.tool_calls,
            messages=ep.messages,
            queued=ep.queued,
            started=ep.started,
            finished=time.time(),
        )
