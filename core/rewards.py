"""Episode rewards: GSM8K answer matching, tool-reported rewards, and custom async functions.

GSM8K extraction follows verl's ``gsm8k.compute_score``: *strict* accepts only ``#### N``; *flexible*
tries ``#### N``, ``\\boxed{N}``, "the answer is N", then the last number in the text. Numbers are
compared exactly as decimals after dropping ``$``, thousands commas and a trailing period, so
``1,600`` matches ``1600`` and ``18.0`` matches ``18``.

A reward function that raises or returns garbage (NaN and infinity included) never stops the server, and never
yields a made-up reward: ``score`` raises ``RewardError`` saying why, and the agent loop marks the episode failed
(``finish_reason`` ``reward_error``), so its group is rolled out again instead of trained on reward 0. One that
hangs (a judge over HTTP that never answers) is cancelled after ``rollout.reward_timeout_s`` the same way
(``core.deadline``).

Custom functions are imported only from the operator's ``rollout.reward_allowlist`` (name -> module:function);
jobs and tasks name a function, they never give an import path.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
from collections.abc import Awaitable, Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from core.deadline import Overdue, within
from core.imports import import_object

log = logging.getLogger(__name__)

_NUM = r"[-\u2212]?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"  # U+2212: the minus sign of typeset text
_STRICT = re.compile(r"####\s*(" + _NUM + ")")
_BOXED = re.compile(r"\\boxed\{")
_BRACE = re.compile(r"[{}]")
# one way to match the gap before the number: "\s*:?\s*" split a run of spaces in quadratically many ways before
# failing on what follows it (16000 spaces after "answer is" took 3 s, on the rollout server's event loop)
_ANSWER_IS = re.compile(r"answer\s+is\s*(?::\s*)?(" + _NUM + ")", re.IGNORECASE)
_NUMBER = re.compile(_NUM)
MODES = ("strict", "flexible")
REWARD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", re.ASCII)

RewardFn = Callable[..., Awaitable[float | tuple[float, dict[str, Any]]]]
REWARD_TIMEOUT_S = 60.0  # rollout.reward_timeout_s's default
REWARD_ARGS = ("task", "messages", "final_text", "tool_rewards")  # what a reward function is called with


def normalize_number(raw: str) -> Decimal | None:
    """``"$1,600."`` -> ``Decimal(1600)``; None when it is not a number."""
    cleaned = re.sub(r"[\s$,]", "", raw).rstrip(".").replace("\u2212", "-")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def _last(pattern: re.Pattern[str], text: str) -> str | None:
    matches = pattern.findall(text)
    return matches[-1] if matches else None


def _last_boxed(text: str) -> str | None:
    """What the last ``\\boxed{...}`` whose brace is closed holds, nested braces included (``\\boxed{18
    \\text{ apples}}``): a pattern without nesting missed it and fell back to the text's last number."""
    closes: dict[int, int] = {}
    opened: list[int] = []
    for brace in _BRACE.finditer(text):  # one pass: matching each brace, not one scan per \boxed
        if brace.group() == "{":
            opened.append(brace.start())
        elif opened:
            closes[opened.pop()] = brace.start()
    for boxed in reversed(list(_BOXED.finditer(text))):
        if (end := closes.get(boxed.end() - 1)) is not None:
            return text[boxed.end():end]
    return None


def extract_answer(text: str, mode: str = "flexible") -> str | None:
    """The answer string found in ``text`` (see the module docstring for the order), or None."""
    if mode not in MODES:
        raise ValueError(f"gsm8k mode {mode!r} is not one of {', '.join(MODES)}")
    found = _last(_STRICT, text)
    if found is not None or mode == "strict":
        return found
    boxed = _last_boxed(text)
    if boxed is not None and (number := _last(_NUMBER, boxed)) is not None:
        return number
    found = _last(_ANSWER_IS, text)
    if found is not None:
        return found
    return _last(_NUMBER, text)


def gsm8k_gold(ground_truth: Any) -> Decimal | None:
    """The number a gsm8k ``ground_truth`` stands for (read as text, after its last ``####``); None when it is
    not a finite number (a NaN or infinite gold would never match, and score every answer 0)."""
    gold = normalize_number(str(ground_truth).split("####")[-1])
    return gold if gold is not None and gold.is_finite() else None


def check_reward_spec(kind: str, spec: Mapping[str, Any], label: str = "reward") -> None:
    """Raise ValueError, naming the field as ``{label}.<key>``, when the built-in reward ``kind`` cannot score a
    task with reward spec ``spec``: the rules its function applies when it scores, checked when the task is given.

    ``gsm8k`` needs a ``ground_truth`` that is a finite number (``42``, ``"1,600"``, ``"... #### 42"``) and a
    ``mode`` of ``MODES`` if it names one; ``tool`` and ``tool_last`` read nothing from the spec.
    A kind that is not a built-in is the operator's function (``rollout.reward_allowlist``): nothing to check here.
    """
    if kind != "gsm8k":
        return
    if "ground_truth" not in spec:
        raise ValueError(f"missing field '{label}.ground_truth' (the gsm8k reward compares the answer with it)")
    ground_truth = spec["ground_truth"]
    if gsm8k_gold(ground_truth) is None:
        raise ValueError(
            f"field '{label}.ground_truth' is {ground_truth!r}: the gsm8k reward needs a finite number "
            "(e.g. 42 or \"1,600\")"
        )
    mode = spec.get("mode", "flexible")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"field '{label}.mode' is {mode!r}; valid: {', '.join(MODES)}")


def gsm8k_reward(text: str, ground_truth: str, mode: str = "flexible") -> float:
    """1.0 when the extracted answer equals ``ground_truth`` numerically, else 0.0."""
    gold = gsm8k_gold(ground_truth)
    if gold is None:
        raise ValueError(f"gsm8k ground_truth {ground_truth!r} is not a number")
    found = extract_answer(text, mode)
    return 1.0 if found is not None and normalize_number(found) == gold else 0.0


async def _gsm8k(task: Any, messages: list[dict[str, Any]], final_text: str, tool_rewards: list[float]):
    spec = task.reward
    if "ground_truth" not in spec:
        raise ValueError(f"task {task.task_id}: reward spec has no ground_truth")
    mode = spec.get("mode", "flexible")
    answer = extract_answer(final_text, mode)
    reward = gsm8k_reward(final_text, str(spec["ground_truth"]), mode)
    return reward, {"extracted": answer, "ground_truth": str(spec["ground_truth"]), "mode": mode}


async def _tool_max(task: Any, messages: list[dict[str, Any]], final_text: str, tool_rewards: list[float]):
    return (max(tool_rewards) if tool_rewards else 0.0), {"tool_rewards": list(tool_rewards)}


async def _tool_last(task: Any, messages: list[dict[str, Any]], final_text: str, tool_rewards: list[float]):
    return (tool_rewards[-1] if tool_rewards else 0.0), {"tool_rewards": list(tool_rewards)}


BUILTIN: dict[str, RewardFn] = {"gsm8k": _gsm8k, "tool": _tool_max, "tool_last": _tool_last}


def load_reward_fn(name: str, allowlist: Mapping[str, str] | None = None) -> RewardFn:
    """A built-in (``gsm8k``, ``tool`` = max tool reward, ``tool_last``) or a name of ``allowlist``
    (the operator's ``rollout.reward_allowlist``: name -> ``module:function``).

    A custom function is ``async def fn(task, sample_messages, final_text, tool_rewards)`` returning
    a float or ``(float, dict)``.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    path = (allowlist or {}).get(name)
    if path is None:
        raise ValueError(f"reward {name!r}: not a built-in ({', '.join(BUILTIN)}) nor in rollout.reward_allowlist")
    try:
        fn = import_object(path)
    except ImportError as exc:
        raise ValueError(f"reward {name!r} ({path}): cannot import: {exc}") from exc
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"reward {name!r} ({path}): must be an async function")
    signature = inspect.signature(fn)
    try:  # called so for every episode: a function that takes other arguments would fail them all
        signature.bind(*REWARD_ARGS)
    except TypeError as exc:
        raise ValueError(f"reward {name!r} ({path}): takes {signature} ({exc}); a reward function is called as "
                         f"fn({', '.join(REWARD_ARGS)})") from None
    return fn


class RewardError(RuntimeError):
    """The reward function raised, or returned something that is not a reward: the episode has none."""


class RewardComputer:
    """Scores finished episodes. The config names the default function; a task's ``reward["kind"]``
    may pick another *built-in* (custom functions come only from the operator's allowlist, never from tasks).
    """

    def __init__(
        self, spec: str = "gsm8k", allowlist: Mapping[str, str] | None = None, timeout_s: float = REWARD_TIMEOUT_S
    ) -> None:
        self.default = load_reward_fn(spec, allowlist)
        self.spec = spec
        self.timeout_s = timeout_s

    def _pick(self, task: Any) -> RewardFn:
        kind = task.reward.get("kind")
        if kind is None or kind == self.spec:
            return self.default
        if kind not in BUILTIN:
            valid = ", ".join(BUILTIN)
            raise ValueError(f"task {task.task_id}: reward kind {kind!r} is not a built-in ({valid})")
        return BUILTIN[kind]

    async def score(
        self, task: Any, messages: list[dict[str, Any]], final_text: str, tool_rewards: list[float]
    ) -> tuple[float, dict[str, Any]]:
        """``(reward, reward_info)``; a function that fails, or gives no answer within ``timeout_s``, raises
        ``RewardError`` with the reason (and logs it)."""
        try:
            out = await within(self.timeout_s, self._pick(task)(task, messages, final_text, tool_rewards))
            reward, info = out if isinstance(out, tuple) else (out, {})
            # numbers.Real takes numpy's scalars (np.float32, np.int64: no float or int), not np.bool_ nor a bool
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not isinstance(info, dict):
                raise TypeError(f"reward function returned {out!r}; want a float or (float, dict)")
            if not math.isfinite(reward):  # NaN or inf would poison the group's advantages
                raise ValueError(f"reward function returned {reward!r}, which is not finite")
            return float(reward), dict(info)
        except Exception as exc:  # user code: the episode fails with the reason, the server goes on
            task_id = getattr(task, "task_id", "?")
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, Overdue):
                name = task.reward.get("kind") or self.spec
                reason = f"reward {name!r} for task {task_id}: {exc} (rollout.reward_timeout_s)"
            log.warning("reward for task %s failed: %s", task_id, reason)
            raise RewardError(reason) from exc
