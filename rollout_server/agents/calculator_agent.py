"""A multi-turn, tool-calling agent written against the ``openai`` client, with its own calculator tool.

Nothing in it knows about training: give it any OpenAI-compatible base URL and key. As an ``agent`` job's
entrypoint (``rollout_server.agents.calculator_agent:run``) every call it makes is recorded token-exact, and
its final answer is scored by the job's reward function (it returns None).
"""

from __future__ import annotations

import json
from typing import Any

import openai

from core.tasks.arith import CALCULATOR_SCHEMA
from rollout_server.tools.calculator import CalculatorError, evaluate, format_number

MAX_TURNS = 4


def calculator(arguments: str) -> str:
    try:
        return format_number(evaluate(json.loads(arguments).get("expression")))
    except (CalculatorError, ValueError, AttributeError) as exc:
        return f"Error: {exc}"


async def run(task: dict[str, Any], base_url: str, api_key: str, model: str = "rollwave") -> float | None:
    """Chat until the model answers without a tool call (or ``MAX_TURNS``); the reward is left to the job."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages: list[Any] = list(task["messages"])
    async with client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR_SCHEMA])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                result = calculator(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
