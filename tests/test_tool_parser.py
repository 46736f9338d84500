"""Tool-call parsing: SGLang's qwen25 behaviour plus the errors we keep for the model."""

from __future__ import annotations

from rollout_server.tool_parser import parse_tool_calls

TOOLS = ["get_weather", "search"]


def test_sglang_example_two_calls() -> None:
    text = (
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    )
    normal, calls, errors = parse_tool_calls(text, TOOLS)
    assert normal == "I will check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("search", {"q": "x"}),
    ]
    assert [c.index for c in calls] == [0, 1]
    assert errors == []


def test_no_tool_call_returns_text_unchanged() -> None:
    text = "  The answer is 42.  "
    assert parse_tool_calls(text, TOOLS) == (text, [], [])


def test_no_tools_parses_nothing() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, []) == (text, [], [])


def test_text_after_calls_is_dropped_and_prefix_stripped() -> None:
    text = '  hi \n<tool_call>\n{"name": "search", "arguments": {"q": 1}}\n</tool_call> trailing words'
    normal, calls, _ = parse_tool_calls(text, TOOLS)
    assert normal == "hi"
    assert calls[0].arguments == {"q": 1}


def test_newlines_are_required_like_sglang() -> None:
    text = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    normal, calls, errors = parse_tool_calls(text, TOOLS)
    assert normal == text and calls == []
    assert len(errors) == 1 and "malformed tool call block" in errors[0].message


def test_parameters_key_and_string_arguments_are_accepted() -> None:
    text = (
        '<tool_call>\n{"name": "search", "parameters": {"q": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"b\\"}"}\n</tool_call>'
    )
    _, calls, errors = parse_tool_calls(text, TOOLS)
    assert [c.arguments for c in calls] == [{"q": "a"}, {"q": "b"}] and errors == []


def test_malformed_json_unknown_tool_and_bad_arguments_become_errors_in_order() -> None:
    text = (
        "x\n<tool_call>\n{not json}\n</tool_call>\n"
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "ok"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": [1, 2]}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {}}\n</tool_call>'
    )
    normal, calls, errors = parse_tool_calls(text, TOOLS)
    assert normal == "x"
    assert [(c.index, c.name) for c in calls] == [(2, "search")]
    assert [e.index for e in errors] == [0, 1, 3, 4]
    assert "invalid JSON" in errors[0].message
    assert "unknown tool 'nope'" in errors[1].message and errors[1].name == "nope"
    assert "available: get_weather, search" in errors[1].message
    assert "must be a JSON object" in errors[2].message and errors[2].name == "search"
    assert '"name"' in errors[3].message


def test_all_invalid_keeps_prefix_like_sglang() -> None:
    text = 'pre\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    normal, calls, errors = parse_tool_calls(text, TOOLS)
    assert (normal, calls, len(errors)) == ("pre", [], 1)


def test_list_payload_and_unterminated_block() -> None:
    text = (
        '<tool_call>\n[{"name": "search", "arguments": {"q": 1}}, {"name": "get_weather", "arguments": {}}]\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {'
    )
    _, calls, errors = parse_tool_calls(text, TOOLS)
    assert [c.name for c in calls] == ["search", "get_weather"]
    assert [c.index for c in calls] == [0, 1]
    assert len(errors) == 1 and errors[0].index == 2 and "malformed" in errors[0].message
