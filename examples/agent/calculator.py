"""A calculator tool for the SmolLM2 multi-turn recipe (``configs/agent-smollm2.yaml``).

The model may write ``<tool_call>{"name": "calculate", "arguments": {"expression": "47 + 38"}}</tool_call>``;
the answer comes back as a ``tool`` message and the conversation goes on. The arithmetic task's
reward scores the whole conversation (its last number).
"""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"not integer arithmetic: {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """Evaluate integer arithmetic with +, -, *, // and parentheses.

    Args:
        expression: the expression, for example "47 + 38 * 2"
    """
    return str(_value(ast.parse(expression, mode="eval").body))
