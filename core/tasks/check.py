"""The checks a task passes before it is queued, whether it is a row of a jsonl file or a job's inline task.

A task that would only fail in a rollout (retried, then dead-lettered) is refused when it is given instead, with
an error naming where (``file:line``, or the inline task's path) and the field. The reward spec is checked with
the rules of the reward function that will score it (``core.rewards.check_reward_spec``):

- a spec whose ``kind`` is a built-in is scored by that built-in, whatever the job's reward;
- a spec with no ``kind``, or one naming the job's reward function, is scored by the job's reward function
  (the job's ``reward``, else the run's ``rollout.reward``): checked when that is a built-in, not when it is an
  operator's function from ``rollout.reward_allowlist``, whose rules core cannot know;
- any other ``kind`` fails in every rollout (the server scores a task only with a built-in or the job's function).

``reward=None`` means the job's reward function is not known where the tasks are loaded (a job that names
none, read by a process without the run's config): a ``kind`` that is a function name is then taken to be the
run's, and a spec with no ``kind`` is not checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.rewards import BUILTIN, REWARD_NAME, check_reward_spec
from core.tasks.base import Task

ROLES = ("system", "user", "assistant", "tool")


def _at(where: str | None, message: str) -> ValueError:
    return ValueError(f"{where}: {message}" if where else message)


def _type(value: Any, kind: type) -> str | None:
    """None when ``value`` is a ``kind`` (a bool is no int), else the name of its type."""
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return None
    return type(value).__name__


def check_task(
    *,
    messages: Any,
    tools: Any,
    tools_kwargs: Any,
    reward_spec: Any,
    where: str | None,
    labels: Mapping[str, str],
    reward: str | None = None,
    agent: bool = False,
) -> None:
    """Raise ValueError ``{where}: ... field '{label}' ...`` for the first thing a rollout could not use.

    ``labels`` names each part as the input spells it (``messages``, ``tools``, ``tools_kwargs``, ``reward``):
    ``prompt`` and ``reward_model`` in a jsonl row, ``source.tasks[3].messages`` for an inline task.
    ``reward`` is the job's reward function (see the module docstring); ``agent`` marks an agent job, whose
    agent may post each sample's reward: a spec with no ``kind`` then is not checked against the job's function.
    """
    label = labels["messages"]
    if (got := _type(messages, list)) is not None:
        raise _at(where, f"field {label!r} must be list, got {got}")
    if not messages:
        raise _at(where, f"field {label!r} is empty")
    for i, message in enumerate(messages):
        at = f"{label}[{i}]"
        if (got := _type(message, dict)) is not None:
            raise _at(where, f"field {at!r} must be an object, got {got}")
        for key in ("role", "content"):
            if key not in message:
                raise _at(where, f"missing field '{at}.{key}'")
            if (got := _type(message[key], str)) is not None:
                raise _at(where, f"field '{at}.{key}' must be str, got {got}")
            if key == "role" and message[key] not in ROLES:
                raise _at(where, f"field '{at}.role' is {message[key]!r}; valid: {', '.join(ROLES)}")

    label = labels["tools"]
    if (got := _type(tools, list)) is not None:
        raise _at(where, f"field {label!r} must be list, got {got}")
    first: dict[str, int] = {}
    for i, name in enumerate(tools):
        if (got := _type(name, str)) is not None:
            raise _at(where, f"field '{label}[{i}]' must be str, got {got}")
        if name in first:  # an episode makes one instance per name: a second would never be released
            raise _at(where, f"field '{label}[{i}]': tool {name!r} is named twice (first at {label}[{first[name]}])")
        first[name] = i

    label = labels["tools_kwargs"]
    if (got := _type(tools_kwargs, dict)) is not None:
        raise _at(where, f"field {label!r} must be dict, got {got}")
    for name, value in tools_kwargs.items():
        if (got := _type(value, dict)) is not None:
            raise _at(where, f"field '{label}.{name}' must be dict, got {got}")
        if "create_kwargs" in value and (got := _type(value["create_kwargs"], dict)) is not None:
            raise _at(where, f"field '{label}.{name}.create_kwargs' must be dict, got {got}")  # the create's **kwargs

    check_reward(reward_spec, where=where, label=labels["reward"], reward=reward, agent=agent)


def check_reward(spec: Any, *, where: str | None, label: str, reward: str | None = None, agent: bool = False) -> None:
    """The reward-spec part of ``check_task``."""
    if (got := _type(spec, dict)) is not None:
        raise _at(where, f"field {label!r} must be dict, got {got}")
    kind = spec.get("kind")
    if kind is not None and (got := _type(kind, str)) is not None:
        raise _at(where, f"field '{label}.kind' must be str, got {got}")
    if kind is None:
        scorer = None if agent else reward  # the job's function; an agent job's agent may post the reward itself
    elif kind in BUILTIN:
        scorer = kind
    elif kind == reward:
        scorer = None  # the job's own function from rollout.reward_allowlist
    else:
        builtins = ", ".join(BUILTIN)
        if reward is not None:
            raise _at(where, f"field '{label}.kind' is {kind!r}: not a built-in reward ({builtins}) nor this job's "
                             f"reward {reward!r}, so no rollout could score it")
        if not REWARD_NAME.fullmatch(kind):
            raise _at(where, f"field '{label}.kind' is {kind!r}: not a built-in reward ({builtins}) nor the name of "
                             "a function in rollout.reward_allowlist")
        scorer = None  # taken to be the run's own reward function, which is not known here
    if scorer in BUILTIN:
        try:
            check_reward_spec(scorer, spec, label)
        except ValueError as exc:
            raise _at(where, str(exc)) from None


def check_inline(tasks: Sequence[Task], *, label: str = "source.tasks", reward: str | None = None,
                 agent: bool = False) -> None:
    """``check_task`` for each of a job's inline tasks (``{label}[i].messages[0].role``...), and unique ids."""
    first: dict[str, int] = {}
    for i, task in enumerate(tasks):
        at = f"{label}[{i}]"
        if task.task_id in first:
            raise ValueError(
                f"field '{at}.task_id': duplicate task id {task.task_id!r} (first at {label}[{first[task.task_id]}])"
            )
        first[task.task_id] = i
        check_task(
            messages=task.messages, tools=task.tools, tools_kwargs=task.tools_kwargs, reward_spec=task.reward,
            where=None, labels={key: f"{at}.{key}" for key in ("messages", "tools", "tools_kwargs", "reward")},
            reward=reward, agent=agent,
        )
