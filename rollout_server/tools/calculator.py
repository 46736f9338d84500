"""``calculator``: exact arithmetic on an expression, parsed with ``ast`` (nothing is evaluated as Python).

Allowed: numbers, ``+ - * / // % **``, parentheses, unary ``+``/``-``. Values are ``Fraction`` so
``0.1 + 0.2`` is ``0.3``; a result prints as an integer when integral, as a decimal when it
terminates, else as a reduced fraction ``p/q``. Exponents and operand sizes are bounded so no
expression can tie up the event loop.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any

from core.tasks.arith import CALCULATOR_SCHEMA
from rollout_server.tools.base import Tool, ToolResult

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_BITS = 4096

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_REPLACEMENTS = {"×": "*", "÷": "/", "−": "-"}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


def _check_size(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"result too large (over {MAX_BITS} bits)")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents give exact results")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is beyond ±{MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if bits * abs(int(exponent)) > MAX_BITS:
        raise CalculatorError(f"result too large (over {MAX_BITS} bits)")
    return base ** int(exponent)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError(f"number out of range: {node.value}")
        value = Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        return _check_size(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        op = _BINOPS.get(type(node.op))
        if op is None:
            hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed{hint}")
        if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
            raise CalculatorError("division by zero")
        return _check_size(Fraction(op(left, right)))
    raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and ( )")


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``; ``CalculatorError`` says why one is refused."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    for old, new in _REPLACEMENTS.items():
        expression = expression.replace(old, new)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse expression: {exc.msg}") from None
    except ValueError as exc:
        raise CalculatorError(f"cannot parse expression: {exc}") from None
    return _eval(tree.body)


def format_number(value: Fraction) -> str:
    """``12``, ``2.5`` (a terminating decimal, written exactly) or ``7/3``."""
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = max(twos, fives)
    scaled = abs(value.numerator) * 10**digits // value.denominator
    sign = "-" if value < 0 else ""
    whole, frac = divmod(scaled, 10**digits)
    return f"{sign}{whole}.{frac:0{digits}d}"


class CalculatorTool(Tool):
    """Exact arithmetic; its schema is the one the arith tasks' prompts and demonstrations use."""

    default_name = "calculator"
    default_schema = CALCULATOR_SCHEMA

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            return ToolResult(format_number(evaluate(arguments.get("expression"))))
        except CalculatorError as exc:
            return ToolResult.failure(str(exc))
