"""Verifiable rewards. A reward function maps (completion text, reference answer) to a float.

They only parse model text, they never execute or eval it. `RewardScorer` runs them: an exception, or
a value that is not a finite number (None, a string, NaN, inf), scores 0 and is counted in `errors`;
the first one is shown as a warning, and a batch in which more than `max_error_rate` of the completions
fail stops the run with a `RewardError` naming the reward and its error (a reward that fails on every
input would otherwise train on zeros to the end). `math_verify` (sympy), and any reward given
`in_worker=True`, runs in a worker process with a timeout per completion, and a timeout scores 0 and is
counted in `timeouts`. The worker imports a `module:function` reward by its module name (spawn passes it
the parent's sys.path).

The worker is started, and warmed up (its imports done), before any completion is timed, so its start
(about 2 s here) never eats into a completion's timeout. A completion that times out kills the worker
(sympy cannot be interrupted from outside); the next one gets a fresh, warmed-up worker. A worker that
dies (segfault, out of memory) scores that completion 0, counts an error, and is replaced.
"""
from __future__ import annotations

import importlib
import inspect
import math
import re
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

_NUMBER = r"-?[\d,]*\.?\d+"
_GSM8K_ANSWER = re.compile(r"####\s*(" + _NUMBER + r")")


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer."""
    return float(completion.strip() == str(answer).strip())


def _to_number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def gsm8k(completion: str, answer: str) -> float:
    """GSM8K: the last '#### <number>' of the completion equals the reference number (commas ignored).

    The reference may be the raw GSM8K solution (its own '#### 72' line) or the bare number.
    """
    ref_match = _GSM8K_ANSWER.findall(str(answer))
    ref = _to_number(ref_match[-1] if ref_match else str(answer).strip())
    found = _GSM8K_ANSWER.findall(completion)
    pred = _to_number(found[-1]) if found else None
    return float(ref is not None and pred is not None and abs(pred - ref) < 1e-9)


def math_verify(completion: str, answer: str) -> float:
    """math-verify equivalence of the completion's final (e.g. \\boxed{}) answer and the reference."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return float(bool(verify(gold, parse(completion))))


def _import_math_verify() -> None:
    import math_verify  # noqa: F401  (sympy and the parsers: about 2 s on a cold process)


math_verify.warm_up = _import_math_verify     # run once in a new worker, before any completion is timed


def _warm_up(fn) -> bool:
    """Runs in a new worker: unpickling `fn` imported its module; `fn.warm_up()` does the rest."""
    warm = getattr(fn, "warm_up", None)
    if callable(warm):
        warm()
    return True


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match, "gsm8k": gsm8k, "math_verify": math_verify,
}
IN_WORKER = {"math_verify"}


def import_named(name: str, what: str):
    """The object 'package.module:attr' names; a ValueError naming `what` and `name` when it cannot be
    imported (a missing module, a typo in the attribute), or the module's own code fails (a syntax
    error, an error at import: named with its file and line)."""
    mod, attr = name.split(":", 1)
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {name!r} cannot be imported: {e}") from None
    except Exception as e:
        raise ValueError(f"{what} {name!r} cannot be imported: {where_it_failed(e)}") from None


def resolve_reward(name: str) -> Callable[[str, str], float]:
    """A built-in name (exact_match, gsm8k, math_verify) or 'package.module:function'."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        fn, attr = import_named(name, "reward"), name.split(":", 1)[1]
        if not callable(fn):
            raise ValueError(f"reward {name!r} is a {type(fn).__name__}, not a function of (completion, answer)")
        try:
            inspect.signature(fn).bind("completion", "answer")
        except TypeError as e:
            raise ValueError(f"reward {name!r} cannot be called as {attr}(completion, answer): {e}") from None
        except ValueError:
            pass                          # no signature to inspect (a builtin): its calls will tell
        return fn
    raise ValueError(f"unknown reward {name!r}; valid names: {', '.join(REWARDS)} or 'module:function'")


def where_it_failed(e: Exception) -> str:
    """`file, line N: Error: message` for an exception raised while a module was imported: a
    SyntaxError's own position, else the innermost frame of the traceback outside importlib."""
    import traceback

    if isinstance(e, SyntaxError):
        return f"{e.filename}, line {e.lineno}: SyntaxError: {e.msg}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
    where = f"{frames[-1].filename}, line {frames[-1].lineno}: " if frames else ""
    return f"{where}{type(e).__name__}: {e}"


class RewardError(ValueError):
    """A reward failed on more than `max_error_rate` of a batch's completions."""


def _safe_score(fn, completion, answer):
    """(score, None), or (0.0, what went wrong) for an exception or a value that is not a finite number."""
    try:
        value = fn(completion, answer)
    except Exception as e:  # a reward bug must not kill the run at once; it is counted
        return 0.0, f"{type(e).__name__}: {e}"
    return as_score(value)


def as_score(value) -> tuple[float, str | None]:
    """(value as a float, None), or (0.0, why) when it is not a finite number (None, a string, NaN, inf)."""
    if value is None or isinstance(value, (str, bytes)):
        return 0.0, f"returned {value!r}, not a number"
    try:
        score = float(value)
    except (TypeError, ValueError):
        return 0.0, f"returned a {type(value).__name__}, not a number"
    if not math.isfinite(score):
        return 0.0, f"returned {score}"
    return score, None


class RewardScorer:
    """Scores batches of completions; counts errors and timeouts.

    Args:
        name: reward name or 'module:function'.
        timeout: seconds per completion for rewards run in a worker (math_verify), the worker's start
            not included.
        in_worker: run in a worker process (default: only for math_verify).
        startup_timeout: seconds a new worker may take to start and import the reward.
        max_error_rate: a call in which more than this share of the completions fail raises
            RewardError (1.0: never).
    """

    def __init__(self, name: str = "exact_match", timeout: float = 5.0, in_worker: bool | None = None,
                 startup_timeout: float = 120.0, max_error_rate: float = 0.5):
        if timeout <= 0:
            raise ValueError(f"reward_timeout must be > 0 seconds, got {timeout}")
        if not 0 <= max_error_rate <= 1:
            raise ValueError(f"max_reward_error_rate must be in [0, 1], got {max_error_rate}")
        self.max_error_rate = max_error_rate
        self.name, self.fn, self.timeout, self.startup_timeout = name, resolve_reward(name), timeout, startup_timeout
        self.in_worker = name in IN_WORKER if in_worker is None else in_worker
        self._pool: ProcessPoolExecutor | None = None
        self.errors = 0
        self.timeouts = 0
        self.last_error: str | None = None

    def _worker(self) -> ProcessPoolExecutor:
        """The worker process, started and warmed up (reward imported) before any completion is timed."""
        if self._pool is None:
            import multiprocessing as mp

            from .lifetime import die_with_parent

            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                             initializer=die_with_parent)        # never outlives the run
            try:
                self._pool.submit(_warm_up, self.fn).result(timeout=self.startup_timeout)
            except (FutureTimeout, BrokenProcessPool) as e:
                self._kill_worker()
                raise RuntimeError(f"reward {self.name!r}: its worker process did not start within "
                                   f"{self.startup_timeout:.0f} s ({type(e).__name__})") from None
        return self._pool

    def _score_in_worker(self, completion: str, answer: str) -> tuple[float, str | None]:
        future = self._worker().submit(_safe_score, self.fn, completion, answer)
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            self.timeouts += 1
            self._kill_worker()
            return 0.0, None
        except BrokenProcessPool:
            self._kill_worker()
            return 0.0, "reward worker process died"

    def __call__(self, completions: list[str], answers: list[str]) -> list[float]:
        scores, failed, first = [], 0, None
        for c, a in zip(completions, answers, strict=True):
            s, err = self._score_in_worker(c, a) if self.in_worker else _safe_score(self.fn, c, a)
            if err is not None:
                if self.errors == 0:
                    warnings.warn(f"reward {self.name!r} failed on a completion ({err}); failures score 0 and "
                                  f"are counted in rollout/reward_errors", stacklevel=2)
                self.errors += 1
                failed += 1
                self.last_error = err
                first = first or err
            scores.append(s)
        if scores and failed / len(scores) > self.max_error_rate:
            raise RewardError(f"reward {self.name!r} failed on {failed} of {len(scores)} completions, more than "
                              f"max_reward_error_rate={self.max_error_rate}; first error: {first}. A reward must "
                              f"return a finite number for any completion (0.0 for one it cannot parse)")
        return scores

    def state_dict(self) -> dict[str, int]:
        """Cumulative counters, kept across a resume."""
        return {"errors": self.errors, "timeouts": self.timeouts}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.errors, self.timeouts = int(state.get("errors", 0)), int(state.get("timeouts", 0))

    def _kill_worker(self) -> None:
        if self._pool is not None:
            for p in list(getattr(self._pool, "_processes", {}).values()):
                p.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        self._kill_worker()
