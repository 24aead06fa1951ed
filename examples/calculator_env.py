"""A tool-calling environment: the model may call `calculator` (Hermes / Qwen format) before it
answers; the reward functions (`reward.fn`) score its final message.

    hybridrl train --model Qwen/Qwen2.5-0.5B-Instruct --data arith.jsonl --reward math_verify \\
        --env.cls examples.calculator_env:Calc --env.max_turns 4 \\
        --rollout.max_new_tokens 256 --rollout.max_model_len 2048 --data.max_prompt_len 512

(from the repository root, or with this file's directory on PYTHONPATH as `calculator_env:Calc`).
"""

import ast
import operator

from hybridrl import ToolEnv

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. (12+7)*431."""

    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return str(ev(ast.parse(expression, mode="eval").body))  # an error becomes the tool message


class Calc(ToolEnv):
    tools = [calculator]
