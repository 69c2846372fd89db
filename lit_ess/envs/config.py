"""Which environment plays the episodes, and the runner's limits, as plain values (`EnvConfig`): an
environment is named as a reward is, by a built-in name or 'package.module:Class', so the config can
travel to the worker process and build a fresh environment per episode there.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from lit_ess.knobs import check
from lit_ess.rewards import import_named

from .arithmetic import Calculator, RetryArithmetic
from .base import Environment
from .single_turn import SingleTurn

ENVIRONMENTS: dict[str, type[Environment]] = {
    "single_turn": SingleTurn, "retry_arithmetic": RetryArithmetic, "calculator": Calculator}


def resolve_env(name: str) -> type[Environment]:
    """A built-in name (single_turn, retry_arithmetic, calculator) or 'package.module:Class'."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name:
        raise ValueError(f"unknown environment {name!r}; valid names: {', '.join(ENVIRONMENTS)} or 'module:Class'")
    cls = import_named(name, "environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {name!r} is a {type(cls).__name__}, not a subclass of "
                         f"lit_ess.envs.Environment")
    return cls


@dataclass
class EnvConfig:
    """Which environment plays the episodes, and the runner's limits.

    Args:
        env: a built-in name (single_turn, retry_arithmetic, calculator) or 'package.module:Class'.
        kwargs: keyword arguments of its constructor (one environment per episode).
        max_turns: policy turns per episode at most; an episode still running after them ends,
            truncated, and is counted (rollout/truncated_turns).
        max_episode_tokens: prompt + every turn + every observation, at most (the context); an episode
            that would pass it ends, truncated at the budget, and is counted (rollout/truncated_tokens).
            None: the engine's model length (the rollout worker sets it; a budget above it is refused).
        step_timeout: seconds an environment step may take; one that takes longer ends its episode with
            reward 0 and is counted (rollout/env_timeouts). Starting an episode (constructor and reset)
            that takes longer stops the run; a close that takes longer is counted. Python cannot stop a thread: a step that
            can hang in C code for ever should do its work in a process of its own. Failures count as
            failing rewards do: data.max_reward_error_rate stops a run that has too many.
    """

    env: str = "single_turn"
    kwargs: dict = field(default_factory=dict)
    max_turns: int = 1
    max_episode_tokens: int | None = None
    step_timeout: float = 10.0

    def __post_init__(self):
        check("env.max_turns", self.max_turns, ge=1, integer=True)
        check("env.max_episode_tokens", self.max_episode_tokens, ge=2, integer=True, null=True,
              hint=" (a prompt token and a turn's)")
        check("env.step_timeout", self.step_timeout, gt=0, hint=" seconds")
        cls = resolve_env(self.env)                 # a typo fails now, not after the engine starts
        try:
            inspect.signature(cls).bind(**self.kwargs)
        except TypeError as e:
            raise ValueError(f"env.kwargs {self.kwargs} do not fit environment {self.env!r} "
                             f"({cls.__name__}{inspect.signature(cls)}): {e}") from None
        cls.check_limits(self.kwargs, self.step_timeout)

    def make(self) -> Environment:
        """A fresh environment for one episode."""
        return resolve_env(self.env)(**self.kwargs)
