"""An OpenEnv environment (the `openenv-core` package, `pip install 'lit-ess[envs]'`) as a lit-ess environment:
its `reset` is the episode's first observation, each policy turn is one of its `step`s (the reply's text as
the action's `action_field`), its per-step rewards add up to the episode's reward, its `done` ends the
episode. The runner keeps the tokens (token in, token out): OpenEnv only sees and answers text.

    env: {env: {class_path: lit_ess.envs.openenv_env.OpenEnv, init_args: {base_url: "http://127.0.0.1:8000",
          action_field: message, observation_field: echoed_message}}, max_turns: 2}

Where the environment runs:
* `base_url`: a running OpenEnv server (`uvicorn server.app:app`, a container, a Space). Each episode is a
  session of its own over OpenEnv's own client (`GenericEnvClient`, a WebSocket per episode), so the server
  must allow as many concurrent sessions as a phase has episodes (`create_app(..., max_concurrent_envs=N)`).
* `environment`: an OpenEnv `Environment` class ('package.module:Class'), built in this process, one per
  episode, with `action` its Action class ('package.module:Class').

An observation becomes text as its `observation_field`, or (null) its fields but done, reward and metadata
as compact JSON. The first one is put in `template` (`{observation}`, and `{prompt}`: the prompt source's
example, e.g. a task the episode should pursue).
"""
from __future__ import annotations

import inspect
import json
import zlib

from lit_ess.rewards import import_named

from .base import Action, Environment, Example, Step

INSTALL = "pip install 'lit-ess[envs]' (or openenv-core)"
try:    # imported with this module (when the config names it), not in every episode's thread at once
    from openenv.core import GenericEnvClient
except ImportError as e:
    GenericEnvClient, _MISSING = None, e
NOT_TEXT = ("done", "reward", "metadata")


class OpenEnv(Environment):
    """Args:
        base_url: a running OpenEnv server's URL (http://, ws://); or null with `environment`.
        environment: an OpenEnv Environment class to build in this process ('package.module:Class'), one
            per episode; or null with `base_url`.
        action: the Action class of `environment` ('package.module:Class'); only with `environment`.
        action_field: the action's field that carries the policy's reply (its text, as decoded).
        observation_field: the observation's field shown to the policy as text; null: every field but
            done, reward and metadata, as compact JSON.
        reset: keyword arguments of each episode's `reset` (e.g. {difficulty: 2}). Without a `seed` there, each
            reset gets the example's own (a hash of its prompt and answer): the n episodes of a group start
            from the same state, so their group-relative advantages compare one task, and prompts differ. An
            environment whose reset takes no seed is not given one.
        template: the first observation, a format string of `{observation}` and `{prompt}` (the prompt
            source's example).
        timeout: seconds to connect to `base_url` and to wait for each of its answers (> 0).
    """

    def __init__(self, base_url: str | None = None, environment: str | None = None, action: str | None = None,
                 action_field: str = "message", observation_field: str | None = None, reset: dict | None = None,
                 template: str = "{observation}", timeout: float = 30.0):
        if (base_url is None) == (environment is None):
            raise ValueError("OpenEnv: give base_url (a running server) or environment (a class to build here), "
                             "one of them")
        if (environment is None) != (action is None):
            raise ValueError("OpenEnv.action names the Action class of OpenEnv.environment: give both or neither")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"OpenEnv.timeout must be > 0 seconds, got {timeout!r}")
        try:
            template.format(observation="", prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"OpenEnv.template {template!r} takes {{observation}} and {{prompt}} only "
                             f"({type(e).__name__}: {e})") from None
        if GenericEnvClient is None:
            raise ImportError(f"OpenEnv needs the openenv-core package ({_MISSING}): {INSTALL}")
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_kwargs, self.template = dict(reset or {}), template
        self.client = self.env = self.action_cls = None
        if base_url is not None:
            self.client = GenericEnvClient(base_url=base_url, connect_timeout_s=timeout,
                                           message_timeout_s=timeout).sync()
        else:
            self.env, self.action_cls = import_named(environment, "OpenEnv.environment")(), \
                import_named(action, "OpenEnv.action")

    def reset(self, example: Example) -> str:
        kwargs = dict(self.reset_kwargs)
        kwargs.setdefault("seed", zlib.crc32(json.dumps([example.prompt, example.answer]).encode()) & 0x7FFFFFFF)
        if self.client is not None:                    # the server passes reset only the arguments it takes
            result = self.client.reset(**kwargs)
        else:
            params = inspect.signature(self.env.reset).parameters
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                kwargs = {k: v for k, v in kwargs.items() if k in params or k in self.reset_kwargs}
            result = self.env.reset(**kwargs)
        observation, _, _ = self._answer(result)
        return self.template.format(observation=observation, prompt=example.prompt)

    def step(self, action: Action) -> Step:
        if self.client is not None:
            result = self.client.step({self.action_field: action.text})
        else:
            result = self.env.step(self.action_cls(**{self.action_field: action.text}))
        observation, reward, done = self._answer(result)
        return Step(observation=observation, reward=reward, done=done)

    def _answer(self, result) -> tuple[str, float, bool]:
        """(text, reward, done) of what OpenEnv answered: a client's StepResult (observation a dict) or an
        in-process Environment's Observation (a pydantic model carrying reward and done)."""
        if self.client is not None:
            fields, reward, done = dict(result.observation or {}), result.reward, result.done
        else:
            fields, reward, done = result.model_dump(), result.reward, result.done
        if self.observation_field is not None:
            if self.observation_field not in fields:
                raise ValueError(f"OpenEnv.observation_field {self.observation_field!r} is not a field of the "
                                 f"observation (fields: {', '.join(fields)})")
            text = fields[self.observation_field]
            text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
        else:
            text = json.dumps({k: v for k, v in fields.items() if k not in NOT_TEXT}, ensure_ascii=False,
                              separators=(",", ":"))
        return text, float(reward or 0.0), bool(done)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        elif self.env is not None and hasattr(self.env, "close"):
            self.env.close()
