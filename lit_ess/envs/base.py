"""The environment interface: gym-like, for text.

An `Environment` plays one episode: `reset(example)` returns the first observation (the prompt) and
`step(action)` takes the policy's turn (its text and its sampled token ids) and returns a `Step`: the
next observation, a reward, and whether the episode is done. An observation is text, or a list of chat
messages (`{"role": ..., "content": ...}`) for models with a chat template; text observations become
one message of role `observation_role` there. Episode rewards add up the steps' rewards.

An environment only answers: the episode runner (lit_ess/envs/episodes.py) owns the tokens, calls the
engine, times every step and enforces the limits. One environment object plays one episode (a fresh one
per sample), so it may keep the episode's state on `self`.

`EnvConfig` names the class as a built-in name or 'package.module:Class' (as rewards are named), with
its constructor arguments and the runner's limits, as plain values that can travel to the worker
process.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Union

from lit_ess.rewards import import_named

Message = dict[str, str]
Observation = Union[str, list[Message]]


class Example(Protocol):
    """What an environment reads of a prompt-source example (lit_ess.datamodules.prompts.Example)."""
    prompt: str
    answer: str


@dataclass(frozen=True)
class Action:
    """The policy's turn: its text (special tokens dropped) and the token ids the engine sampled."""
    text: str
    token_ids: list[int]
    finish_reason: str             # "stop" (eos or a stop string) or "length" (max_new_tokens)


@dataclass
class Step:
    """What an environment answers to a turn. `observation` is ignored when `done`."""
    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0            # tool calls this turn made (for rollout/tool_calls)


class Environment(ABC):
    """One episode of a text environment. Subclasses take their settings as keyword arguments
    (`EnvConfig.init_args`)."""

    observation_role: ClassVar[str] = "user"      # the chat role of text observations

    @abstractmethod
    def reset(self, example: Example) -> Observation:
        """Start the episode from a prompt-source example; return the first observation (the prompt)."""

    @abstractmethod
    def step(self, action: Action) -> Step:
        """Answer the policy's turn."""

    def close(self) -> None:
        """Free what the episode holds (called once it ends, unless its last step timed out)."""


def builtin_environments() -> dict[str, type[Environment]]:
    from .arithmetic import Calculator, RetryArithmetic
    from .single_turn import SingleTurn

    return {"single_turn": SingleTurn, "retry_arithmetic": RetryArithmetic, "calculator": Calculator}


def resolve_env(name: str) -> type[Environment]:
    """A built-in name (single_turn, retry_arithmetic, calculator) or 'package.module:Class'."""
    builtin = builtin_environments()
    if name in builtin:
        return builtin[name]
    if ":" not in name:
        raise ValueError(f"unknown environment {name!r}; valid names: {', '.join(builtin)} or 'module:Class'")
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
        init_args: keyword arguments of its constructor (one environment per episode).
        max_turns: policy turns per episode at most; an episode still running after them ends,
            truncated, and is counted (rollout/truncated_turns).
        max_episode_tokens: prompt + every turn + every observation, at most (the context); an episode
            that would pass it ends, truncated at the budget, and is counted (rollout/truncated_tokens).
            None: no budget of its own (the engine's context limit applies).
        step_timeout: seconds an environment step may take; one that takes longer ends its episode with
            reward 0 and is counted (rollout/env_timeouts). Python cannot stop a thread: a step that
            can hang in C code for ever should do its work in a process of its own.
        max_error_rate: a run in which more than this share of the episodes end by an environment
            error or timeout raises EnvError (1.0: never).
    """

    env: str = "single_turn"
    init_args: dict = field(default_factory=dict)
    max_turns: int = 1
    max_episode_tokens: int | None = None
    step_timeout: float = 10.0
    max_error_rate: float = 0.5

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 2:
            raise ValueError(f"env.max_episode_tokens must be >= 2 (a prompt token and a turn's) or null, got "
                             f"{self.max_episode_tokens}")
        if not self.step_timeout > 0:
            raise ValueError(f"env.step_timeout must be > 0 seconds, got {self.step_timeout}")
        if not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"env.max_error_rate must be in [0, 1], got {self.max_error_rate}")
        cls = resolve_env(self.env)                 # a typo fails now, not after the engine starts
        try:
            inspect.signature(cls).bind(**self.init_args)
        except TypeError as e:
            raise ValueError(f"env.init_args {self.init_args} do not fit environment {self.env!r} "
                             f"({cls.__name__}{inspect.signature(cls)}): {e}") from None

    def make(self) -> Environment:
        """A fresh environment for one episode."""
        return resolve_env(self.env)(**self.init_args)
