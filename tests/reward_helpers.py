"""Reward functions that the rollout-server tests name by import path (``tests.reward_helpers:<name>``)."""

from __future__ import annotations

from typing import Any


async def judge_down(task: Any, messages: list[dict], final_text: str, tool_rewards: list[float]) -> float:
    """An external judge that is unreachable: every episode's reward fails."""
    raise RuntimeError("the judge is down")
