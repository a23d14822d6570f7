"""The calculator environment: one tool, calculator(expression), that evaluates arithmetic exactly
(+ - * / // % ** and parentheses over integers and decimals) without eval: the expression is parsed
with ast and only those nodes are evaluated, with bounds so no expression can take the service's
time or memory (a 10**10**10 is refused, not computed)."""

from __future__ import annotations

import ast
import operator
from typing import TYPE_CHECKING

from rlfabric.env.environment import Tool, ToolEnvironment, ToolError
from rlfabric.env.items import Task, ToolSpec

if TYPE_CHECKING:
    from rlfabric.core.config import EnvConfig

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30

CALCULATOR_SPEC = ToolSpec(
    name="calculator",
    description="Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 12"}},
                "required": ["expression"]},
)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorEnvironment(ToolEnvironment):
    """One tool, calculator(expression); the final answer scores as the task's ground truth ("#### ANSWER")."""

    def __init__(self, task: Task, config: EnvConfig):
        super().__init__(task, [Tool(CALCULATOR_SPEC, calculator)])


def calculator(expression: str) -> str:
    """The value of `expression` as text (an integer when it is one); ToolError saying what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponents above {MAX_EXPONENT} are not supported")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("the result is too large" if not isinstance(value, complex) else "the result is not real")
        return value
    raise ToolError(f"only numbers, + - * / // % ** and parentheses are supported, not {ast.unparse(node)!r}")
