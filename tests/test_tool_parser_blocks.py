"""Tool-call parsing: every ``<tool_call>`` block is a call or an error the model is told about."""

from __future__ import annotations

from rollout_server.tool_parser import parse_tool_calls

CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'


def test_an_empty_list_block_is_an_error_not_silence() -> None:
    """``[]`` is valid JSON but no call: it used to vanish, so a turn holding only it ended the episode as if it
    were the answer, and one beside a call got no reply of its own."""
    _, calls, errors = parse_tool_calls("<tool_call>\n[]\n</tool_call>", ["search"])
    assert calls == [] and [(e.index, e.message) for e in errors] == [
        (0, 'tool call must be an object with a string "name"')
    ]
    _, calls, errors = parse_tool_calls(f"{CALL}\n<tool_call>\n[]\n</tool_call>\n{CALL}", ["search"])
    assert [c.index for c in calls] == [0, 2] and [e.index for e in errors] == [1]


def test_json_nested_too_deeply_is_an_error_not_a_crash() -> None:
    """JSON nested past Python's recursion limit (a degenerate policy writes ``[[[[...``) made ``json.loads`` raise
    RecursionError, which escaped the parser and failed the whole group; it is a tool error like any bad JSON."""
    deep = "[" * 5000 + "]" * 5000
    _, calls, errors = parse_tool_calls(f"<tool_call>\n{deep}\n</tool_call>\n{CALL}", ["search"])
    assert [c.index for c in calls] == [1]
    assert [e.index for e in errors] == [0] and errors[0].message.startswith("invalid JSON in tool call: ")
    nested_string = '{"name": "search", "arguments": "' + "[" * 5000 + '"}'
    _, calls, errors = parse_tool_calls(f"<tool_call>\n{nested_string}\n</tool_call>", ["search"])
    assert calls == [] and [(e.index, e.name) for e in errors] == [(0, "search")]
    assert errors[0].message.startswith("arguments must be a JSON object")
