"""Tool-call parsing compatible with SGLang's ``qwen25`` detector (``FunctionCallParser(tools, "qwen25")``).

A call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the newlines are required,
as in SGLang); a turn may hold several. ``normal_text`` and the valid calls equal what
``parse_non_stream`` returns. Unlike SGLang, which logs and drops invalid blocks, every block that
cannot be run comes back as a ``ToolCallError``: the episode must tell the model what went wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

BOT_TOKEN = "<tool_call>\n"
EOT_TOKEN = "</tool_call>"  # a call's closing tag: as a stop string, it ends the turn after one call
_BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_OPEN_TAG = "<tool_call>"
_FORMAT_HINT = 'write <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>'


@dataclass
class ToolCall:
    """A parsed call; ``index`` orders calls and errors of one turn as they appeared in the text."""

    index: int
    name: str
    arguments: dict[str, Any]


@dataclass
class ToolCallError:
    """A block that cannot be run; ``message`` is shown to the model in the tool turn."""

    index: int
    message: str
    name: str | None = None
    raw: str = ""


# what json.loads raises on bad text; RecursionError on nesting past Python's limit (a policy can write ``[[[[...``)
_BAD_JSON = (json.JSONDecodeError, RecursionError)


def _parse_arguments(act: dict[str, Any]) -> dict[str, Any] | str:
    """The call's arguments as a dict (SGLang: ``parameters`` or ``arguments``), or an error message."""
    args = act.get("parameters") or act.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except _BAD_JSON:
            return "arguments must be a JSON object, got a string that is not JSON"
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    return args


def parse_tool_calls(
    text: str, tool_names: list[str] | set[str]
) -> tuple[str, list[ToolCall], list[ToolCallError]]:
    """Split an assistant turn into ``(normal_text, calls, errors)``.

    ``normal_text`` is the text before the first ``<tool_call>\\n``, stripped (text after the calls
    is dropped), or the whole text when there is none, as SGLang does. With no tools, nothing is
    parsed. An opening tag without a well-formed block (no newlines, unterminated) is an error.
    """
    names = set(tool_names)
    if not names or _OPEN_TAG not in text:
        return text, [], []
    start = text.find(BOT_TOKEN)
    normal_text = text[:start].strip() if start != -1 else text
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    index = 0
    blocks = _BLOCK.findall(text) if start != -1 else []
    for raw in blocks:
        try:
            payload = json.loads(raw.strip())
        except _BAD_JSON as exc:
            errors.append(ToolCallError(index, f"invalid JSON in tool call: {exc}", raw=raw))
            index += 1
            continue
        acts = payload if isinstance(payload, list) else [payload]
        for act in acts or [None]:  # an empty list is no call either: the model is told, as for any other block
            if not isinstance(act, dict) or not isinstance(act.get("name"), str):
                message = 'tool call must be an object with a string "name"'
                errors.append(ToolCallError(index, message, raw=raw))
            elif act["name"] not in names:
                message = f"unknown tool {act['name']!r} (available: {', '.join(sorted(names))})"
                errors.append(ToolCallError(index, message, act["name"], raw))
            else:
                args = _parse_arguments(act)
                if isinstance(args, str):
                    errors.append(ToolCallError(index, args, act["name"], raw))
                else:
                    calls.append(ToolCall(index, act["name"], args))
            index += 1
    unmatched = text.count(_OPEN_TAG) - len(blocks)
    if unmatched > 0:
        errors.append(ToolCallError(index, f"malformed tool call block: {_FORMAT_HINT}"))
    return normal_text, calls, errors
