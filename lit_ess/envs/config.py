"""Which environment plays the episodes, and the runner's limits (`EnvConfig`): an environment is chosen
by class, as objectives and engines are, with its constructor's arguments

    env: {class_path: lit_ess.envs.RetryArithmetic, init_args: {max_tries: 3}}

(jsonargparse checks `init_args` against the constructor and `--print_config` shows them), or by a
built-in name or 'package.module:Class' alone (its defaults). The config holds the class and its arguments,
never an environment: it travels to the worker process (pickled) and builds a fresh environment per
episode there (`make`).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

from lit_ess.knobs import check, plain
from lit_ess.rewards import import_named

from .arithmetic import Calculator, RetryArithmetic
from .base import Environment
from .single_turn import SingleTurn

ENVIRONMENTS: dict[str, type[Environment]] = {
    "single_turn": SingleTurn, "retry_arithmetic": RetryArithmetic, "calculator": Calculator}


def resolve_env(name: str) -> type[Environment]:
    """A built-in name (single_turn, retry_arithmetic, calculator) or 'package.module:Class' (or .Class)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name and "." not in name:
        raise ValueError(f"unknown environment {name!r}; valid names: {', '.join(ENVIRONMENTS)} or "
                         f"'package.module.Class' (with arguments: {{class_path: package.module.Class, init_args: "
                         f"{{...}}}})")
    return _environment_class(import_named(name, "environment"), repr(name))


def env_class_and_args(env) -> tuple[type[Environment], dict]:
    """(the class, its constructor's keyword arguments) of an `EnvConfig.env`: a name (no arguments), an
    Environment class, or a functools.partial of one with keyword arguments, which is what jsonargparse
    makes of {class_path, init_args} (the class is the last of its positional arguments then)."""
    if isinstance(env, str):
        return resolve_env(env), {}
    if isinstance(env, functools.partial):
        if isinstance(env.func, type) and not env.args:                 # functools.partial(Class, **init_args)
            return _environment_class(env.func, repr(env)), dict(env.keywords)
        if not isinstance(env.func, type) and env.args and isinstance(env.args[-1], type):   # jsonargparse's
            return _environment_class(env.args[-1], repr(env)), dict(env.keywords)
        raise ValueError(f"env {env!r}: give an Environment class with keyword arguments only "
                         f"(functools.partial(Class, name=value), or class_path and init_args)")
    return _environment_class(env, repr(env)), {}


def _environment_class(cls, what: str) -> type[Environment]:
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {what} is a {type(cls).__name__}, not a subclass of lit_ess.envs.Environment")
    return cls


@dataclass
class EnvConfig:
    """Which environment plays the episodes, and the runner's limits.

    Args:
        env: the environment, by class with its constructor's arguments ({class_path:
            lit_ess.envs.RetryArithmetic, init_args: {max_tries: 3}}; one environment per episode), or by
            a built-in name (single_turn, retry_arithmetic, calculator) or 'package.module.Class' with its
            defaults. In Python: a name, a class, or functools.partial(Class, name=value).
        max_turns: policy turns per episode at most; an episode still running after them ends,
            truncated, and is counted (rollout/truncated_turns).
        max_episode_tokens: prompt + every turn + every observation, at most (the context); an episode
            that would pass it ends, truncated at the budget, and is counted (rollout/truncated_tokens).
            None: the engine's model length (the rollout worker sets it; a budget above it is refused).
        step_timeout: seconds an environment step may take; one that takes longer ends its episode with
            reward 0 and is counted (rollout/env_timeouts). Starting an episode (constructor and reset)
            that takes longer stops the run; a close that takes longer is counted. Python cannot stop a thread: a step that
            can hang in C code for ever should do its work in a process of its own. Failures count as
            failing rewards do: data.reward_limits.max_error_rate stops a run that has too many.
    """

    env: str | Callable[[], Environment] = "single_turn"
    max_turns: int = 1
    max_episode_tokens: int | None = None
    step_timeout: float = 10.0

    def __post_init__(self):
        check("env.max_turns", self.max_turns, ge=1, integer=True)
        check("env.max_episode_tokens", self.max_episode_tokens, ge=2, integer=True, null=True,
              hint=" (a prompt token and a turn's)")
        check("env.step_timeout", self.step_timeout, gt=0, hint=" seconds")
        cls, init_args = env_class_and_args(self.env)   # a typo fails now, not after the engine starts
        if not isinstance(self.env, str):                # the class and its arguments, plain: they pickle
            self.env = functools.partial(cls, **init_args)
        try:
            inspect.signature(cls).bind(**init_args)
        except TypeError as e:
            raise ValueError(f"env.init_args {init_args} do not fit environment {cls.__name__}"
                             f"{inspect.signature(cls)}: {e}") from None
        cls.check_limits(init_args, self.step_timeout)

    @property
    def env_class(self) -> type[Environment]:
        return env_class_and_args(self.env)[0]

    @property
    def init_args(self) -> dict:
        """The environment's constructor's keyword arguments."""
        return env_class_and_args(self.env)[1]

    @property
    def name(self) -> str:
        """The environment as messages name it: its built-in name or path, else its class's name."""
        return self.env if isinstance(self.env, str) else self.env_class.__name__

    def make(self) -> Environment:
        """A fresh environment for one episode."""
        cls, init_args = env_class_and_args(self.env)
        return cls(**init_args)

    def hparams(self) -> dict:
        """Plain values to log as hyper-parameters: the environment's class path and arguments, the limits."""
        cls, init_args = env_class_and_args(self.env)
        return {"env": {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": plain(init_args)},
                "max_turns": self.max_turns, "max_episode_tokens": self.max_episode_tokens,
                "step_timeout": self.step_timeout}
