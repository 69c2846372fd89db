"""Verifiable rewards. A reward function maps (completion text, reference answer) to a float.

They only parse model text, they never execute or eval it. `RewardScorer` runs them: an exception, or
a value that is not a finite number (None, a string, NaN, inf), scores 0 and is counted in `errors`;
the first one is shown as a warning, and a batch in which more than `max_error_rate` of the completions
fail stops the run with a `RewardError` naming the reward and its error (a reward that fails on every
input would otherwise train on zeros to the end). `math_verify` (sympy), and every function reward given
`in_worker=True`, runs in a worker process with a timeout per completion, and a timeout scores 0 and is
counted in `timeouts`; the others of a weighted list, a `ModelReward` always, run in the scoring process
(a model or a judge's server is never in a process that a timeout kills). The worker imports a `module:function` reward by its module name (spawn passes it
the parent's sys.path).

The worker is started, and warmed up (its imports done), before any completion is timed, so its start
(about 2 s here) never eats into a completion's timeout. A completion that times out kills the worker
(sympy cannot be interrupted from outside); the next one gets a fresh, warmed-up worker. A worker that
dies (segfault, out of memory) scores that completion 0, counts an error, and is replaced.

What a reward sees is decided by its parameter names, read once when the scorer is built (`bind`):
`prompt`, `completion`, `answer`, and any column of the dataset's row by its own name (`**kwargs` gets
every column; an optional parameter only when it is one of the three). A reward decorated with
`@batched` scores a whole phase at once, TRL's convention: `prompts`, `completions`, `answers` and each
column as a list (and `conversations`: a chat prompt's messages, None for a text prompt), returning one
number per sample. Either kind may be `async def`: per-sample coroutines of a call run concurrently. A list of `Reward`s is
scored as their weighted sum; each one's mean is kept in `RewardScorer.parts` for logging. A reward
that is a configured object rather than a function (a `ModelReward`: lit_ess.reward_model.RewardModel,
lit_ess.engines.LLMJudge) is a @batched reward too; a batched reward may give an exception for a sample
it failed on, which fails that sample alone.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable

from .knobs import check
from .reward_url import RemoteReward, is_url

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


def reasoning_gym(completion: str, entry: dict, task: dict) -> float:
    """A reasoning-gym task's own verifier (`score_answer`) on the completion, for prompts of
    lit_ess.datamodules.ReasoningGym (its columns `entry` and `task`; needs the reasoning-gym package)."""
    from .task_verifiers import score

    return score(completion, entry, task)


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
    "exact_match": exact_match, "gsm8k": gsm8k, "math_verify": math_verify, "reasoning_gym": reasoning_gym,
}
IN_WORKER = {"math_verify"}
FOLDERS: list[str] = []     # where a user's reward module is looked for first: the config's folder, the working directory


def add_search_folders(folders: list[str]) -> None:
    """Put these folders (the config files' and the working directory, set by the CLI) first on sys.path,
    so `my_reward.score` imports my_reward.py beside the config; a spawned worker inherits sys.path."""
    import os
    import sys

    for folder in reversed([os.path.abspath(f) for f in folders]):
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
        if folder not in FOLDERS:
            FOLDERS.insert(0, folder)


def batched(fn: Callable) -> Callable:
    """Declare a reward that scores a whole phase at once (TRL's convention): it is called with lists,
    `prompts`, `completions`, `answers` and any column by its name, and returns one number per sample:

        @batched
        def length_penalty(completions, **columns) -> list[float]: ...
    """
    fn.batched = True
    return fn


class ModelReward:
    """Base of the rewards that are typed configs rather than functions (lit_ess.reward_model.RewardModel,
    lit_ess.engines.LLMJudge): named in YAML by `class_path`/`init_args` (shown by --print_config), called as a
    @batched reward with lists, their model loaded (or their server launched) once per process that scores, on
    the first call or `warm_up`. `label` is their train/reward/NAME unless the Reward names them."""

    batched = True
    label = "model"

    def warm_up(self) -> None:
        """Load what scoring needs (RewardScorer.warm_up calls it when the rank's rollout worker starts)."""

    def check_columns(self, columns: list[str]) -> None:
        """Refuse, in one line, what the dataset's `columns` cannot give (called by `bind` at start)."""


@dataclass
class Reward:
    """One reward of a weighted list (`data.reward`); the total is the weighted sum of the rewards.

    Args:
        fn: a built-in name (exact_match, gsm8k, math_verify, reasoning_gym), 'package.module:function' or
            'module.function' (a module beside the config or in the working directory), a URL that
            scores a batch by POST (lit_ess.reward_url), or a model: lit_ess.reward_model.RewardModel (a
            sequence-classification checkpoint) or lit_ess.engines.LLMJudge (an LLM through vLLM's OpenAI API).
        weight: its weight in the total, any finite number (0 = logged, not trained on; a negative
            weight = a penalty).
        name: its scalar in TensorBoard, train/reward/NAME (default: the function's name).
    """
    fn: str | ModelReward
    weight: float = 1.0
    name: str | None = None

    def __post_init__(self):
        check("Reward.weight", self.weight)


def import_named(name: str, what: str):
    """The object 'package.module:attr' (or 'module.attr') names; a ValueError naming `what` and `name` when it cannot be
    imported (a missing module, a typo in the attribute), or the module's own code fails (a syntax
    error, an error at import: named with its file and line)."""
    mod, attr = name.split(":", 1) if ":" in name else name.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(mod), attr)
    except ModuleNotFoundError as e:
        if e.name is None or not mod.startswith(e.name):
            raise ValueError(f"{what} {name!r} cannot be imported: {e}") from None
        import os

        where = ", ".join(FOLDERS) or os.getcwd()
        raise ValueError(f"{what} {name!r} cannot be imported: no module named {e.name!r} in {where} or the installed "
                         f"packages: put {e.name.split('.')[0]}.py beside the config (or in the working directory), "
                         f"or install its package") from None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {name!r} cannot be imported: {e}") from None
    except Exception as e:
        raise ValueError(f"{what} {name!r} cannot be imported: {where_it_failed(e)}") from None


def resolve_reward(name: str | ModelReward) -> Callable:
    """A built-in name (exact_match, gsm8k, math_verify, reasoning_gym), 'package.module:function', 'module.function', a
    URL (lit_ess.reward_url.RemoteReward), or a ModelReward (itself)."""
    if isinstance(name, ModelReward):
        return name
    if name in REWARDS:
        return REWARDS[name]
    if is_url(name):
        return RemoteReward(name)
    if ":" in name or "." in name:
        fn = import_named(name, "reward")
        if not callable(fn):
            raise ValueError(f"reward {name!r} is a {type(fn).__name__}, not a function")
        return fn
    raise ValueError(f"unknown reward {name!r}; valid names: {', '.join(REWARDS)}, 'module:function' or "
                     f"'module.function'")


@dataclass
class BoundReward:
    """A reward with what it is called with, read from its signature once (`bind`): `params` by name,
    `columns` the row's columns it takes (all of them with `**kwargs`)."""
    fn: Callable
    name: str                  # as the config names it
    label: str                 # train/reward/<label>
    weight: float
    params: tuple[str, ...]
    varkw: bool
    batched: bool
    is_async: bool
    positional: bool = False   # an (x, y) reward of earlier releases: called as fn(completion, answer)

    def call(self, kw: dict):
        """The function on one call's arguments (`kwargs`); a coroutine for an async reward."""
        return self.fn(kw["completion"], kw["answer"]) if self.positional else self.fn(**kw)

    def kwargs(self, prompts: list[str], completions: list[str], answers: list[str], rows: list[dict],
               conversations: list | None = None) -> list[dict]:
        """One call's arguments: per sample, or (batched) one dict of lists."""
        if self.batched:
            known = {"prompts": prompts, "completions": completions, "answers": answers,
                     "conversations": conversations or [None] * len(completions)}
            cols = (set(rows[0]) if rows else set()) if self.varkw else set(self.params) - set(known)
            return [{**{c: [r.get(c) for r in rows] for c in cols},
                     **{k: v for k, v in known.items() if k in self.params}}]
        out = []
        for p, c, a, r in zip(prompts, completions, answers, rows, strict=True):
            known = {"prompt": p, "completion": c, "answer": a}
            cols = r if self.varkw else {k: r.get(k) for k in self.params if k not in known}
            out.append({**cols, **{k: v for k, v in known.items() if k in self.params}})
        return out


def bind(spec: str | Reward, columns: list[str] | None = None) -> BoundReward:
    """The reward `spec` names, with its parameters checked against what a call can give: prompt,
    completion, answer (prompts, completions, answers when @batched) and the dataset's `columns` (None:
    not checked, e.g. in a worker process whose data module checked them)."""
    spec = spec if isinstance(spec, Reward) else Reward(spec)
    fn = resolve_reward(spec.fn)
    where = spec.fn if isinstance(spec.fn, str) else type(spec.fn).__name__
    is_batched = bool(getattr(fn, "batched", False))
    known = ("prompts", "completions", "answers", "conversations") if is_batched else ("prompt", "completion", "answer")
    if isinstance(fn, ModelReward) and columns is not None:
        fn.check_columns(columns)
    try:
        sig = inspect.signature(fn)
    except ValueError:                        # no signature to inspect (a builtin): called as f(completion, answer)
        return BoundReward(fn, where, _label(spec), spec.weight, ("completion", "answer"), False, is_batched, False,
                           positional=True)
    params, optional, varkw = [], [], False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            varkw = True
        elif p.kind is p.VAR_POSITIONAL or (p.default is not p.empty and p.name not in known):
            continue                          # optional and not one of what a call gives: left to its default
        elif p.kind is p.POSITIONAL_ONLY:
            raise ValueError(f"reward {where!r}: parameter {p.name!r} is positional-only; rewards are called by "
                             f"parameter name")
        else:                                 # required, or optional and one of what a call gives (given then)
            (params if p.default is p.empty else optional).append(p.name)
    if not params and not optional and not varkw:
        raise ValueError(f"reward {where!r} takes no parameters: name the ones it scores, e.g. "
                         f"({', '.join(known[1:])})")
    if not is_batched and len(params) == 2 and not varkw and not set(params) & {*known, *(columns or [])}:
        return BoundReward(fn, where, _label(spec), spec.weight, ("completion", "answer"), False, False,
                           inspect.iscoroutinefunction(fn), positional=True)    # f(completion, answer), any names
    params += optional
    if columns is not None:
        for name in params:
            if name not in known and name not in columns:
                hint = ("; a reward of lists is declared with @lit_ess.rewards.batched"
                        if name in ("prompts", "completions", "answers") else
                        "; it scores prompts of lit_ess.datamodules.ReasoningGym" if fn is reasoning_gym else "")
                raise ValueError(f"reward {where!r}: parameter {name!r} is neither {', '.join(known)} nor a column "
                                 f"of the dataset (columns: {', '.join(columns) or 'none'}){hint}")
    return BoundReward(fn, where, _label(spec), spec.weight, tuple(params), varkw, is_batched,
                       inspect.iscoroutinefunction(fn))


def _label(spec: Reward) -> str:
    if isinstance(spec.fn, ModelReward):
        return spec.name or spec.fn.label
    return spec.name or ("remote" if is_url(spec.fn) else re.split(r"[:.]", spec.fn)[-1])


def as_rewards(reward: str | ModelReward | Reward | list) -> list[Reward]:
    """`data.reward` as a list of Reward: a name, a ModelReward, one Reward, or a list of them; names checked unique."""
    items = reward if isinstance(reward, list) else [reward]
    out = [r if isinstance(r, Reward) else Reward(**r) if isinstance(r, dict) else Reward(r) for r in items]
    if not out:
        raise ValueError("data.reward is an empty list: name at least one reward")
    labels = [_label(r) for r in out]
    if len(set(labels)) < len(labels):
        raise ValueError(f"data.reward: two rewards are logged as the same train/reward/NAME ({labels}): give them "
                         f"distinct `name`s")
    return out


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


def _safe_score(reward: BoundReward, kw: dict):
    """(score, None), or (0.0, what went wrong) for an exception or a value that is not a finite number."""
    try:
        value = reward.call(kw)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except Exception as e:  # a reward bug must not kill the run at once; it is counted
        return 0.0, f"{type(e).__name__}: {e}"
    return as_score(value)


def _safe_scores(reward: BoundReward, kws: list[dict]) -> list[tuple[float, str | None]]:
    return [_safe_score(reward, kw) for kw in kws]


async def _awaited(value):
    return await value


def _safe_batch(reward: BoundReward, kw: dict, n: int) -> list[tuple[float, str | None]]:
    """A batched reward's n (score, error): one number per sample (an exception for a sample fails that one
    alone), else every sample fails with why."""
    try:
        values = reward.call(kw)
        if inspect.isawaitable(values):
            values = asyncio.run(_awaited(values))
    except Exception as e:
        return [(0.0, f"{type(e).__name__}: {e}")] * n
    try:
        values = list(values)
    except TypeError:
        return [(0.0, f"returned a {type(values).__name__}, not a list of {n} numbers")] * n
    if len(values) != n:
        return [(0.0, f"returned {len(values)} values for {n} completions")] * n
    return [(0.0, f"{type(v).__name__}: {v}") if isinstance(v, Exception) else as_score(v) for v in values]


async def _gather(reward: BoundReward, kws: list[dict]) -> list[tuple[float, str | None]]:
    """An async per-sample reward: every sample's coroutine at once, each failure its own."""
    async def one(kw):
        try:
            return as_score(await reward.call(kw))
        except Exception as e:
            return 0.0, f"{type(e).__name__}: {e}"
    return list(await asyncio.gather(*(one(kw) for kw in kws)))


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
    """Scores batches of completions with one reward or the weighted sum of several; counts errors and
    timeouts (per reward and completion).

    Args:
        name: `data.reward`: a reward name, 'module:function' / 'module.function', or a list of Reward.
        timeout: seconds per completion for rewards run in a worker (math_verify), the worker's start
            not included, and for a URL's request; a batched reward gets this much per completion of its
            batch.
        in_worker: run the function rewards in a worker process (default: only math_verify); a ModelReward
            always runs in this process (true with one is refused).
        startup_timeout: seconds a new worker may take to start and import the reward.
        max_error_rate: a call in which more than this share of the completions fail raises
            RewardError (1.0: never).
        columns: the dataset's columns the rewards may take by name (None: not checked here).
    """

    def __init__(self, name: str | Reward | list = "exact_match", timeout: float = 5.0, in_worker: bool | None = None,
                 startup_timeout: float = 120.0, max_error_rate: float = 0.5, columns: list[str] | None = None):
        if timeout <= 0:
            raise ValueError(f"data.reward_limits.timeout must be > 0 seconds, got {timeout}")
        if not 0 <= max_error_rate <= 1:
            raise ValueError(f"data.reward_limits.max_error_rate must be in [0, 1], got {max_error_rate}")
        self.max_error_rate = max_error_rate
        self.rewards = [bind(r, columns) for r in as_rewards(name)]
        for r in self.rewards:
            if isinstance(r.fn, RemoteReward):
                r.fn.timeout = timeout
        self.name = name if isinstance(name, str) else ", ".join(r.name for r in self.rewards)
        self.fn = self.rewards[0].fn
        self.timeout, self.startup_timeout = timeout, startup_timeout
        if in_worker and (model := next((r for r in self.rewards if isinstance(r.fn, ModelReward)), None)):
            raise ValueError(f"data.reward_limits.in_worker: true with {model.name} (a model reward, its model or server loaded by "
                             f"the process that scores): leave data.reward_limits.in_worker null")
        # the rewards run in the worker process, by position; a model reward never (a timeout would kill its model)
        self.in_worker = [r.name in IN_WORKER if in_worker is None else in_worker for r in self.rewards]
        self._pool: ProcessPoolExecutor | None = None
        self.errors = 0
        self.timeouts = 0
        self.last_error: str | None = None
        self.parts: dict[str, float] = {}        # the last call's mean of each reward, by label

    def warm_up(self) -> None:
        """Before the first phase is timed: each model reward's model loaded (a judge's server launched) in this
        process, and the reward worker started with its rewards imported, if any runs there."""
        for r, there in zip(self.rewards, self.in_worker):
            if there:
                self._worker()
            elif isinstance(r.fn, ModelReward):
                try:
                    r.fn.warm_up()
                except Exception as e:           # a judge that did not launch, a checkpoint that did not load
                    raise RewardError(f"reward {r.name!r} could not start: {e}") from None

    def _worker(self) -> ProcessPoolExecutor:
        """The worker process, started and warmed up (reward imported) before any completion is timed."""
        if self._pool is None:
            import multiprocessing as mp

            from .lifetime import die_with_parent

            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                             initializer=die_with_parent)        # never outlives the run
            try:
                for r, there in zip(self.rewards, self.in_worker):
                    if there:
                        self._pool.submit(_warm_up, r.fn).result(timeout=self.startup_timeout)
            except (FutureTimeout, BrokenProcessPool) as e:
                self._kill_worker()
                raise RuntimeError(f"reward {self.name!r}: its worker process did not start within "
                                   f"{self.startup_timeout:.0f} s ({type(e).__name__})") from None
        return self._pool

    def _in_worker(self, fn, *args, timeout: float, n: int) -> list[tuple[float, str | None]]:
        """fn(*args) in the worker, or `n` failed completions: a timeout (counted, scores 0; the worker is
        killed, sympy cannot be interrupted) or a worker that died (an error)."""
        try:
            return self._worker().submit(fn, *args).result(timeout=timeout)
        except FutureTimeout:
            self.timeouts += n
            self._kill_worker()
            return [(0.0, None)] * n
        except BrokenProcessPool:
            self._kill_worker()
            return [(0.0, "reward worker process died")] * n

    def _score(self, reward: BoundReward, kws: list[dict], n: int, in_worker: bool) -> list[tuple[float, str | None]]:
        if reward.batched:
            if in_worker:
                return self._in_worker(_safe_batch, reward, kws[0], n, timeout=self.timeout * n, n=n)
            return _safe_batch(reward, kws[0], n)
        if in_worker:               # one completion at a time: a timeout costs that one
            return [out for kw in kws for out in self._in_worker(_safe_scores, reward, [kw], timeout=self.timeout, n=1)]
        if reward.is_async:
            return asyncio.run(_gather(reward, kws))
        return _safe_scores(reward, kws)

    def __call__(self, completions: list[str], answers: list[str], prompts: list[str] | None = None,
                 rows: list[dict] | None = None, conversations: list | None = None) -> list[float]:
        """The total reward of each completion; `prompts` (text), the dataset `rows` (columns) and `conversations`
        (a chat prompt's messages, None for a text prompt) per completion."""
        n = len(completions)
        prompts = prompts if prompts is not None else [""] * n
        rows = rows if rows is not None else [{}] * n
        totals = [0.0] * n
        for reward, in_worker in zip(self.rewards, self.in_worker):
            results = self._score(reward, reward.kwargs(prompts, completions, answers, rows, conversations), n, in_worker)
            errors = [err for _, err in results if err is not None]
            for err in errors:
                if self.errors == 0:
                    warnings.warn(f"reward {reward.name!r} failed on a completion ({err}); failures score 0 and "
                                  f"are counted in rollout/reward_errors", stacklevel=2)
                self.errors += 1
                self.last_error = err
            if n and len(errors) / n > self.max_error_rate:
                raise RewardError(f"reward {reward.name!r} failed on {len(errors)} of {n} completions, more than "
                                  f"data.reward_limits.max_error_rate={self.max_error_rate}; first error: {errors[0]}. A reward "
                                  f"must return a finite number for any completion (0.0 for one it cannot parse)")
            self.parts[reward.label] = sum(s for s, _ in results) / max(n, 1)
            totals = [t + reward.weight * s for t, (s, _) in zip(totals, results)]
        return totals

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
