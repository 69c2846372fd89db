"""Multi-turn environments on the arithmetic task (lit_ess.datamodules.prompts.Arithmetic examples),
in text formats short enough for the byte-level tiny model.

RetryArithmetic: the policy answers; a wrong answer is told so and the question asked again, up to
`max_tries` answers. Reward 1 / tries for a right answer (a right first try counts most), 0 if none is.

    37+85=  121<eos>  wrong\n37+85=  122<eos>                  reward 1/2

Calculator: the policy may call a calculator, `calc(37*85)`; the result is inserted with the question
asked again, and the policy answers. Reward 1 for the right answer, 0 otherwise; at most `max_calls`
calls (one more ends the episode with reward 0). Expressions: integers with +, - and * (usual
precedence), at most 64 characters, operands of at most 12 digits; a malformed one answers 'error'.

    37*85=  calc(37*85)<eos>  3145\n37*85=  3145<eos>          reward 1, one tool call

(<eos> is whatever ends the turn: the tokenizer's eos or a stop string such as ')'.) Answers are
compared after stripping whitespace, as `exact_match` does.
"""
from __future__ import annotations

import re


from lit_ess.knobs import check

from .base import Action, Environment, Example, Step

_CALL = re.compile(r"calc\(([^()]*)\)?")
_EXPR = re.compile(r"\s*-?\d{1,12}(\s*[-+*]\s*-?\d{1,12})*\s*")


class RetryArithmetic(Environment):
    """Args:
        max_tries: answers the policy may give (>= 1).
        feedback: the text that tells a wrong answer, before the question is asked again.
    """

    def __init__(self, max_tries: int = 3, feedback: str = "wrong"):
        if max_tries < 1:
            raise ValueError(f"RetryArithmetic.max_tries must be >= 1, got {max_tries}")
        check("RetryArithmetic.max_tries", max_tries, integer=True)
        self.max_tries, self.feedback = max_tries, feedback
        self.example, self.tries = None, 0

    def reset(self, example: Example) -> str:
        self.example, self.tries = example, 0
        return example.prompt

    def step(self, action: Action) -> Step:
        self.tries += 1
        if action.text.strip() == self.example.answer.strip():
            return Step(reward=1.0 / self.tries, done=True)
        if self.tries >= self.max_tries:
            return Step(reward=0.0, done=True)
        return Step(observation=f"{self.feedback}\n{self.example.prompt}")


def calculate(expr: str) -> int | None:
    """The value of an integer expression of +, - and * (usual precedence), or None when malformed."""
    if len(expr) > 64 or not _EXPR.fullmatch(expr):
        return None
    total, sign = 0, 1
    for part in re.split(r"(?<=\d)([-+])", "".join(expr.split())):   # terms, split at binary + and -
        if part in ("+", "-"):
            sign = 1 if part == "+" else -1
            continue
        product = 1
        for factor in part.split("*"):
            product *= int(factor)                  # int("-5"): a unary minus
        total += sign * product
    return total


class Calculator(Environment):
    """Args:
        max_calls: calculator calls per episode at most (>= 0; 0 = a call ends the episode with reward 0).
    """

    def __init__(self, max_calls: int = 2):
        if max_calls < 0:
            raise ValueError(f"Calculator.max_calls must be >= 0, got {max_calls}")
        check("Calculator.max_calls", max_calls, integer=True)
        self.max_calls, self.calls, self.example = max_calls, 0, None

    def reset(self, example: Example) -> str:
        self.example, self.calls = example, 0
        return example.prompt

    def step(self, action: Action) -> Step:
        call = _CALL.search(action.text)
        if call is None:
            return Step(reward=float(action.text.strip() == self.example.answer.strip()), done=True)
        self.calls += 1
        if self.calls > self.max_calls:
            return Step(reward=0.0, done=True, tool_calls=1)
        value = calculate(call.group(1))
        return Step(observation=self.observation("error" if value is None else str(value), self.example.prompt),
                    tool_calls=1)

    @staticmethod
    def observation(result: str, prompt: str) -> str:
        """What a call inserts: the result, then the question again."""
        return f"{result}\n{prompt}"
