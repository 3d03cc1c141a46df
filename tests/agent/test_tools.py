"""Tool calls as the model writes them (Hermes format): parsing, answering, schemas."""

from __future__ import annotations

import pytest

from streamrl.agent import tools


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("no")


def test_calls_are_parsed_with_object_or_string_arguments_and_malformed_ones_are_reported():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    calls, errors = tools.parse_calls(text)
    assert calls == [("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})]
    assert len(errors) == 2 and "not JSON" in errors[0] and "needs a 'name'" in errors[1]
    assert tools.parse_calls("no call here") == ([], [])
    assert tools.parse_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}') == ([("add", {"a": 1, "b": 2})], [])


def test_every_call_gets_one_tool_message_and_failures_are_counted():
    messages, failed = tools.run_calls([("add", {"a": 2, "b": 3}), ("nope", {}), ("add", {"c": 1}), ("boom", {"x": 1})],
                                       ["malformed tool call"], {"add": add, "boom": boom})
    assert [m["role"] for m in messages] == ["tool"] * 5 and failed == 4
    assert messages[0]["content"] == "error: malformed tool call" and messages[1]["content"] == "5"
    assert "no tool named 'nope'" in messages[2]["content"] and "TypeError" in messages[3]["content"]
    assert "boom raised RuntimeError: no" in messages[4]["content"]


def test_a_schema_comes_from_the_signature_and_docstring_and_an_undocumented_tool_is_refused():
    s = tools.schema(add)
    assert s["function"]["name"] == "add" and s["function"]["parameters"]["required"] == ["a", "b"]
    assert s["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}

    def bare(a, b):
        return a

    with pytest.raises(ValueError, match="task.tools entry 'x.py:bare'"):
        tools.check_tool(bare, "x.py:bare")
    assert "<tool_call>" in tools.tools_prompt([s]) and '"name": "add"' in tools.tools_prompt([s])
