"""The environment interface: gym-like, for text.

An `Environment` plays one episode: `reset(example)` returns the first observation (the prompt) and
`step(action)` takes the policy's turn (its text and its sampled token ids) and returns a `Step`: the
next observation, a reward, and whether the episode is done. An observation is text, or a list of chat
messages (`{"role": ..., "content": ...}`) for models with a chat template; text observations become
one message of role `observation_role` there (the first, the prompt, a user message as every prompt
is). Episode rewards add up the steps' rewards.

An environment only answers: the episode runner (lit_ess/envs/episodes.py) owns the tokens, calls the
engine, times every step and enforces the limits. One environment object plays one episode (a fresh one
per sample), so it may keep the episode's state on `self`.

Which environment plays, and the runner's limits: `EnvConfig` (config.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Union

from lit_ess.rewards import RewardError

Message = dict[str, str]
Observation = Union[str, list[Message]]


def is_observation(obs) -> bool:
    """Text, or a non-empty list of {'role', 'content'} messages of text."""
    return isinstance(obs, str) or isinstance(obs, list) and bool(obs) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obs)


class EnvError(RewardError):
    """An environment cannot play (it cannot be built or started, or answers in a form the tokenizer
    cannot take), or its steps failed (raised, timed out, bad answer) in more than `max_error_rate` of a
    run's episodes (data.reward_limits.max_error_rate). One line; a RewardError, so a worker process reports it
    as it is, not as a crash."""


@dataclass(frozen=True)
class Example:
    """A prompt-source example, what an environment starts an episode from (lit_ess.datamodules.prompts
    re-exports it: prompt sources make them). `prompt` is text, or chat messages (lit_ess.chat).
    `columns`: the dataset row's fields, which a reward may take by name (lit_ess.rewards.bind)."""
    prompt: str | list[Message]
    answer: str
    columns: dict = field(default_factory=dict)


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
    """One episode of a text environment. Subclasses take their settings as keyword arguments of their
    constructor (a config's `env: {class_path: ..., init_args: {...}}`, `EnvConfig`)."""

    observation_role: ClassVar[str] = "user"      # the chat role of text observations

    @abstractmethod
    def reset(self, example: Example) -> Observation:
        """Start the episode from a prompt-source example; return the first observation (the prompt)."""

    @abstractmethod
    def step(self, action: Action) -> Step:
        """Answer the policy's turn."""

    @classmethod
    def check_limits(cls, init_args: dict, step_timeout: float) -> None:
        """Refuse, in one line, constructor arguments `init_args` that do not fit the runner's `step_timeout`
        (EnvConfig calls it at start). Nothing to check by default."""

    def close(self) -> None:
        """Free what the episode holds (called once it ends, unless its last step timed out)."""
