"""Edges of what jobs are made of and how they are scored: gsm8k answers a model writes, reward functions that
return numpy's scalars."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from core.rewards import RewardComputer, RewardError, extract_answer, gsm8k_reward
from core.tasks import Task


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("The answer is \\boxed{18 \\text{ apples}}. Check: 18 / 2 = 9.", "18"),
        ("So \\boxed{\\textbf{42}} in all (7 * 6 = 42, from 3 boxes).", "42"),
        ("\\boxed{1,000.50} \\quad (1 000 cents)", "1,000.50"),
        ("first \\boxed{5}, then \\boxed{\\text{\\$7}} after 2 more", "$7"),
        ("\\boxed{12} and a cut-off \\boxed{\\text{3", "12"),  # the last one never closes: the one before it
    ],
)
def test_flexible_reads_a_boxed_answer_with_nested_braces(text: str, found: str) -> None:
    """A ``\\boxed{}`` holding braces (``\\text{...}``) was missed and the text's last number taken instead."""
    assert extract_answer(text, "flexible") == found
    assert extract_answer(text, "strict") is None
    assert gsm8k_reward(text, found) == 1.0


def test_boxed_search_is_linear_in_the_braces() -> None:
    text = "\\boxed{" * 50_000 + "7"
    assert extract_answer(text) == "7"  # no closed box: the last number


async def numpy_float32_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    return np.float32(0.5), {"judge": "np"}


async def numpy_int_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    return np.int64(1)


async def numpy_bool_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    return np.bool_(True)


async def numpy_nan_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    return np.float32("nan")


ALLOWLIST = {name: f"{__name__}:{name}" for name in ("numpy_float32_reward", "numpy_int_reward",
                                                      "numpy_bool_reward", "numpy_nan_reward")}


def _score(name: str) -> tuple[float, dict] | str:
    task = Task(task_id="t1", messages=[{"role": "user", "content": "q"}], reward={})
    try:
        return asyncio.run(RewardComputer(name, allowlist=ALLOWLIST).score(task, [], "", []))
    except RewardError as exc:
        return str(exc)


def test_a_reward_given_as_a_numpy_number_is_taken_as_a_float() -> None:
    """A judge computing with numpy returns np.float32 or np.int64 (no float or int): every episode it scored
    failed ``reward_error``. A numpy bool is refused as a bool is, a numpy NaN as a NaN is."""
    reward, info = _score("numpy_float32_reward")
    assert (reward, type(reward), info) == (0.5, float, {"judge": "np"})
    reward, _ = _score("numpy_int_reward")
    assert (reward, type(reward)) == (1.0, float)
    assert "want a float" in _score("numpy_bool_reward")
    assert "not finite" in _score("numpy_nan_reward")
