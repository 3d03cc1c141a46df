"""Tools offered to the model: their JSON schemas, the calls parsed from its text, their answers.

A tool is a plain Python function (``task.tools: ["file.py:fn"]``); its schema comes from the
signature and the Google-style docstring (transformers' ``get_json_schema``, what chat templates'
``tools`` argument takes). Calls are read in the Hermes/Qwen format,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Invariant: every call the model
wrote gets one ``tool`` message back: the function's result, or an error text for a malformed
call, an unknown tool, bad arguments or a tool that raised (each counted by the caller).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def schema(fn: Callable) -> dict:
    """The chat-template schema of ``fn`` (name, description, typed parameters)."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def check_tool(fn: Any, spec: str) -> None:
    """A ``task.tools`` entry must be a function whose schema can be derived; raises ValueError
    naming the entry and what is missing."""
    if not callable(fn):
        raise ValueError(f"task.tools entry {spec!r} is not callable ({type(fn).__name__})")
    try:
        schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
        raise ValueError(f"task.tools entry {spec!r}: no schema from its signature and docstring "
                         f"({type(exc).__name__}: {exc}); type every argument and document it under 'Args:'") from None


def parse_calls(text: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """The tool calls in ``text``: ``[(name, arguments)]`` and an error text per malformed call."""
    calls, errors = [], []
    for body in CALL.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            errors.append(f"malformed tool call (not JSON: {exc.msg}): {body.strip()[:80]!r}")
            continue
        name = call.get("name") if isinstance(call, dict) else None
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            errors.append(f"malformed tool call (needs a 'name' and an 'arguments' object): {body.strip()[:80]!r}")
            continue
        calls.append((name, args))
    return calls, errors


def run_calls(calls: list[tuple[str, dict]], errors: list[str], tools: dict[str, Callable]) -> tuple[list[dict], int]:
    """One ``tool`` message per call (and per malformed call); returns them and how many failed."""
    messages = [{"role": "tool", "content": f"error: {e}"} for e in errors]
    failed = len(errors)
    for name, args in calls:
        fn = tools.get(name)
        if fn is None:
            failed += 1
            content = f"error: no tool named {name!r} (tools: {sorted(tools)})"
        else:
            try:
                result = fn(**args)
                content = result if isinstance(result, str) else json.dumps(result, default=str)
            except Exception as exc:  # the model's arguments or the tool itself: answered, counted
                failed += 1
                content = f"error: {name} raised {type(exc).__name__}: {exc}"
        messages.append({"role": "tool", "name": name, "content": content})
    return messages, failed


def tools_prompt(schemas: list[dict]) -> str:
    """A Hermes-style system section describing the tools, for a chat template that does not take
    ``tools`` itself (it would drop them and the model would never hear of them)."""
    listing = "\n".join(json.dumps(s) for s in schemas)
    return ("You may call one or more functions to assist with the user query. The functions are:\n<tools>\n"
            f"{listing}\n</tools>\nFor each function call, return a JSON object with the function name and "
            'arguments within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call>')
