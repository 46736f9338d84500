"""Reward functions that the rollout-server tests name by import path (``tests.reward_helpers:<name>``)."""

from __future__ import annotations

from typing import Any


async def judge_down(task: Any, messages: list[dict], final_text: str, tool_rewards: list[float]) -> float:
    """An external judge that is unreachable: every episode's reward fails."""
    raise RuntimeError("the judge is down")


async def digit_share(task: Any, messages: list[dict], final_text: str, tool_rewards: list[float]) -> float:
    """The share of the answer's characters that are digits: a dense reward that even the untrained tiny model
    earns a little of, so a few RL steps measurably raise it (the end-to-end tests' held-out score)."""
    return sum(c.isdigit() for c in final_text) / len(final_text) if final_text else 0.0
