"""Rollout jobs: the spec a user submits, and the per-job rollout settings a worker derives from it.

The spec is validated whole (and its tasks loaded) before anything is written, so a rejected job
leaves nothing behind. The worker reads the stored spec and fills what it leaves out from its own
``RolloutConfig``. A train job's sampling temperature travels with each of its groups, and the trainer
scales that group's logits by it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.config import RolloutConfig, check_sampling, check_train_temperature
from core.rewards import IMPORT_PATH, REWARD_NAME
from core.tasks import Task, load_tasks
from core.tasks.base import check_split, window
from core.tasks.check import check_inline

MAX_INLINE_TASKS = 10_000
# which of path, split and seed each kind reads (all read limit and offset): one given to another kind is refused
_READS = {"arith": ("split", "seed"), "gsm8k": ("path", "split"), "jsonl": ("path", "split"), "inline": ()}


class Strict(BaseModel):
    """Unknown keys refused, and values of another type: pydantic's lax mode took ``"limit": true`` as 1 and
    ``"n_samples": "4"`` as 4 (an int is still taken for a float: JSON writes 1.0 as 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TaskSource(Strict):
    """Where a job's tasks come from: a named source or tasks given inline. A field the kind does not read (a
    ``path`` for arith, a ``seed`` for a file, which is read in file order) is refused, not ignored; ``seed`` 0 is
    the default every kind takes, so a stored spec validates again."""

    kind: Literal["arith", "gsm8k", "jsonl", "inline"] = "arith"
    path: str | None = Field(
        None, description="gsm8k/jsonl: a .jsonl file or a directory of {split}.jsonl; gsm8k defaults to data/gsm8k"
    )
    split: str | None = Field(None, description="train or test; a plain name: a directory's {split}.jsonl")
    limit: int | None = Field(None, ge=1, le=100_000, description="how many tasks (a file is read no further)")
    offset: int = Field(0, ge=0, le=100_000, description="skip this many tasks first (arith generates them)")
    seed: int = Field(0, description="arith: which problem stream; files are read in order (no seed)")
    tasks: list[Task] | None = Field(None, max_length=MAX_INLINE_TASKS, description="inline tasks (kind=inline)")

    @field_validator("split")
    @classmethod
    def _plain_split(cls, split: str | None) -> str | None:
        """Refused here, before any source runs, so the error names ``source.split`` (the sources refuse it too)."""
        return check_split(split)

    @model_validator(mode="after")
    def _check(self) -> TaskSource:
        if self.kind == "inline":
            if not self.tasks:
                raise ValueError("kind=inline needs a non-empty `tasks` list")
            if self.offset >= len(self.tasks):
                raise ValueError(f"source.offset: {self.offset} is past the {len(self.tasks)} inline tasks")
        elif self.tasks is not None:
            raise ValueError(f"`tasks` is only allowed with kind=inline, not kind={self.kind}")
        for name in ("path", "split", "seed"):
            if name not in _READS[self.kind] and getattr(self, name) not in (None, 0):
                readers = ", ".join(kind for kind, fields in _READS.items() if name in fields)
                order = "; its tasks are taken in order: offset and limit pick them" if name == "seed" else ""
                raise ValueError(f"source.{name}: kind={self.kind} does not read it, so it would be ignored (kind "
                                 f"{readers} reads it){order}; leave it out")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("kind=jsonl needs `path`")
        if self.kind == "arith" and self.limit is None:
            raise ValueError("kind=arith needs `limit` (the number of generated problems)")
        return self

    def load(self, data_root: Path | None = None, reward: str | None = None, agent: bool = False) -> list[Task]:
        """The tasks, each checked as a jsonl row is (``core.tasks.check``: a ValueError names the field, e.g.
        ``source.tasks[0].messages[0].role``); inline task ids must be unique, and ``offset``/``limit`` pick which
        of the (all checked) inline tasks the job holds, as they pick a file's rows. With ``data_root``, a ``path`` is
        read relative to it and must not lead out of it. ``reward`` is the reward function that scores the
        tasks, when known (``JobSpec.load_tasks``); ``agent``: an agent runs them (and may post the reward)."""
        if self.kind == "inline":
            assert self.tasks is not None
            check_inline(self.tasks, label="source.tasks", reward=reward, agent=agent)
            return window(list(self.tasks), self.offset, self.limit)
        return load_tasks(
            self.kind, path=self.path, split=self.split, limit=self.limit, seed=self.seed, offset=self.offset,
            root=data_root, reward=reward,
        )


class SamplingSpec(Strict):
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, description="-1 (the whole vocabulary) or 1 .. 2**30, as SGLang requires")
    max_new_tokens: int | None = Field(None, ge=1, le=32_768)

    @model_validator(mode="after")
    def _sglang_rules(self) -> SamplingSpec:
        check_sampling(1.0 if self.temperature is None else self.temperature,
                       1.0 if self.top_p is None else self.top_p, -1 if self.top_k is None else self.top_k)
        return self


class JobSpec(Strict):
    """A rollout job. ``eval`` jobs are never trained on: their groups go to ``eval:<job>``."""

    kind: Literal["train", "eval"] = "train"
    source: TaskSource
    n_samples: int | None = Field(None, ge=1, le=256, description="samples per task (eval defaults to 1)")
    sampling: SamplingSpec = SamplingSpec()
    max_turns: int | None = Field(None, ge=1, le=64)
    tools: list[str] | None = Field(None, description="tool names; None uses each task's own list")
    reward: str | None = Field(
        None, description="a built-in (gsm8k, tool, tool_last) or a rollout.reward_allowlist name; None: the server's"
    )
    agent: str | None = Field(
        None, description="module:function of an OpenAI-client agent run once per sample (the job is then an "
        "agent job); servers run only entrypoints in their rollout.agent_allowlist"
    )
    name: str | None = Field(None, max_length=200)

    @field_validator("reward")
    @classmethod
    def _reward_name(cls, reward: str | None) -> str | None:
        """A name, never an import path: which functions exist is the operator's choice (the API checks the
        name against the run's allowlist)."""
        if reward is not None and not REWARD_NAME.fullmatch(reward):
            raise ValueError(
                f"reward {reward!r}: a job names a reward function (a built-in or one the operator allowlisted "
                "in rollout.reward_allowlist), never an import path"
            )
        return reward

    @field_validator("agent")
    @classmethod
    def _agent_name(cls, agent: str | None) -> str | None:
        if agent is not None and not IMPORT_PATH.fullmatch(agent):
            raise ValueError(f"agent {agent!r}: not module:function")
        return agent

    @model_validator(mode="after")
    def _eval_defaults(self) -> JobSpec:
        if self.kind == "train" and self.sampling.temperature is not None:
            check_train_temperature(self.sampling.temperature, where="sampling.temperature: ")
        if self.kind == "eval":
            if self.n_samples is None:
                self.n_samples = 1
            if self.sampling.temperature is None:
                self.sampling = self.sampling.model_copy(update={"temperature": 0.0})
        return self

    def load_tasks(self, data_root: Path | None = None, run_reward: str | None = None) -> list[Task]:
        """The source's tasks, each checked against the reward function that will score it: the job's ``reward``,
        else the run's ``rollout.reward`` (``run_reward``)."""
        return self.source.load(data_root, self.reward or run_reward, agent=self.agent is not None)


def rollout_settings(spec: JobSpec, defaults: RolloutConfig) -> RolloutConfig:
    """The server's rollout section with what the job sets laid over it."""
    update: dict[str, Any] = {
        "n_samples": spec.n_samples,
        "max_turns": spec.max_turns,
        "reward": spec.reward,
        **spec.sampling.model_dump(),
    }
    return defaults.model_copy(update={k: v for k, v in update.items() if v is not None})
