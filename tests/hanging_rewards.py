"""Test rewards that hang, in a module of their own: a reward worker process imports a reward's
module each time it starts, and a completion that times out costs a fresh worker. e2e_utils imports
Lightning; this module imports nothing heavy, so each fresh worker starts fast."""
import time


def digits_unless_five(completion: str, answer: str) -> float:
    """The share of digits in the completion; never returns when the answer ends in 5 (a verifier
    that hangs on some inputs)."""
    while str(answer).endswith("5"):
        time.sleep(1.0)
    return sum(c.isdigit() for c in completion) / max(1, len(completion))
