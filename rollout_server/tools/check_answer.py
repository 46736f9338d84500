"""``check_answer``: the GSM8K answer tool with its reward (verl's ``Gsm8kTool`` / ``calc_gsm8k_reward``).

The task's ``tools_kwargs["check_answer"]["create_kwargs"]["ground_truth"]`` reaches ``create``;
each call scores the submitted answer (flexible GSM8K matching of ``#### answer``) and reports
reward 1.0 or 0.0; the reward of the episode can then be the best (``reward: tool``) or last one.
"""

from __future__ import annotations

from typing import Any

from core.rewards import gsm8k_gold, gsm8k_reward
from rollout_server.tools.base import Tool, ToolResult, function_schema


class CheckAnswerTool(Tool):
    default_name = "check_answer"
    default_schema = function_schema(
        "check_answer",
        "Submit the final numeric answer to the problem; tells whether it is correct.",
        {"answer": {"type": "string", "description": "the final answer, a number, e.g. 42"}},
        ["answer"],
    )
    create_requires = ("ground_truth",)

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        """Refuses a ground truth gsm8k cannot read: every call would fail and the episode be scored 0 for it."""
        await super().create(instance_id, **create_kwargs)  # refuses one without a ground_truth
        ground_truth = str(create_kwargs["ground_truth"])
        if gsm8k_gold(ground_truth) is None:
            raise ValueError(f"{self.name}: ground_truth {ground_truth!r} is not a number (task tools_kwargs)")
        self._instances[instance_id] = {"ground_truth": ground_truth}

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        state = self._instances.get(instance_id)
        if state is None:
            return ToolResult.failure(f"{self.name}: no instance {instance_id!r} (create was not called)")
        answer = arguments.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            return ToolResult.failure(f"{self.name}: answer must be a string or a number")
        answer = str(answer).strip()
        submitted = answer if answer.startswith("####") else f"#### {answer}"
        reward = gsm8k_reward(submitted, state["ground_truth"], mode="flexible")
        verdict = "correct" if reward == 1.0 else "incorrect"
        return ToolResult(f"Answer {answer} is {verdict}.", reward=reward)
