"""Episodes, token in, token out: the policy and an environment take turns; the engine sees token ids.

An episode is one token sequence

    prompt | turn 1 | observation 1 | turn 2 | ... | turn K                 (completion = after the prompt)

where each turn is the ids the engine sampled, kept as they are (never decoded and encoded again), and
each observation is the environment's answer as tokens (lit_ess/envs/tokens.py). Per completion token:

    mask       1 on the policy's sampled tokens, 0 on the environment's
    logprobs   log pi_b of the policy's tokens (as the engine sampled them), 0.0 on the environment's
    versions   the weight version that sampled the token's turn (-1 on the environment's)

The episode always ends with a policy turn: a last observation (after `done`, or past a limit) is not
appended, since no policy token would follow it.

`EpisodeRunner.run` steps a batch of episodes together: one engine call per turn for every episode
still running (the first turn is the single-turn rollout's call: n samples of each prompt, the same
seeds), then every environment step at once, each in its own thread with `step_timeout`. A step that
raises, times out, or returns something that is not a Step (a finite reward, a bool `done`, a count of
tool calls, an observation of text or messages unless done) ends its episode with reward 0, counted
(env_errors, env_timeouts); a run in which more than `max_error_rate` of the episodes fail raises EnvError
(the worker passes data.reward_limits.max_error_rate: environment failures count as failing rewards do). What
every episode would do alike stops the run at once, an EnvError naming the environment: a constructor or
`reset` that raises, returns no observation or takes longer than `step_timeout` (they run in threads too),
chat messages for a tokenizer without a chat template. A `close` that raises or takes longer is counted.
Limits: `max_turns` policy turns and `max_episode_tokens` tokens (prompt included); an episode stopped
by one is truncated and counted (truncated = "turns" or "tokens"): a turn that would pass the token
budget is cut at it (a prefix of a sample is a sample: its logprobs stay exact) and not stepped, an
observation that would reach it is dropped. The reward is then what the steps so far gave.

`to_row` makes an episode a batch row whose `mask` is the episode's token mask; `collate_episodes` pads
episodes into a RolloutBatch whose completion mask is that mask.
"""
from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np

from lit_ess.batch import RolloutBatch, Row, collate
from lit_ess.knobs import check
from lit_ess.rewards import as_score
from lit_ess.sampling import Completion, Sampler, SamplingConfig, derive_seed

from .base import Action, EnvError, Environment, Example, Message, Step, is_observation
from .config import EnvConfig
from .tokens import EpisodeTokens, TemplateError

TRUNCATIONS = ("turns", "tokens", "prompt")


@dataclass
class Episode:
    """One finished episode: its tokens, per-token mask and behaviour logprobs, reward and counters."""
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)            # 1: sampled by the policy, 0: the environment's
    logprobs: list[float] = field(default_factory=list)      # log pi_b on policy tokens, 0.0 elsewhere
    versions: list[int] = field(default_factory=list)        # weight version that sampled each token, -1: env's
    turn_versions: list[int] = field(default_factory=list)   # each policy turn's oldest version
    turn_starts: list[int] = field(default_factory=list)     # where each policy turn starts in the completion
    finish_reasons: list[str] = field(default_factory=list)  # each policy turn's: "stop" or "length"
    parts: list[tuple[str, str]] = field(default_factory=list)   # ("policy" | "env", text), in order
    reward: float = 0.0
    turns: int = 0
    env_tokens: int = 0
    env_errors: int = 0
    env_timeouts: int = 0
    env_seconds: float = 0.0
    tool_calls: int = 0
    truncated: str | None = None       # "turns" (max_turns), "tokens" (max_episode_tokens) or "prompt" (not played:
                                       # its first observation was longer than max_prompt_tokens, cut to it)
    error: str | None = None           # the environment's failure that ended the episode
    start_version: int = 0             # the engine's version when the episode started

    @property
    def version(self) -> int:
        """The staleness of an episode is its oldest turn's."""
        return min(self.turn_versions, default=self.start_version)

    @property
    def failed(self) -> bool:
        return self.env_errors + self.env_timeouts > 0

    def token_versions(self) -> list[int]:
        """The weight version that sampled every completion token (in-flight updates: a turn may have
        several); -1 on the environment's tokens."""
        return list(self.versions)

    def add_policy(self, s: Completion, n: int | None = None) -> None:
        """Append a sampled turn (its first `n` tokens: a budget cut) with its pi_b and versions."""
        n = len(s.token_ids) if n is None else n
        versions = list(s.token_versions) if s.token_versions is not None else [s.version] * len(s.token_ids)
        self.turn_starts.append(len(self.completion_ids))
        self.completion_ids += list(s.token_ids[:n])
        self.mask += [1] * n
        self.logprobs += list(s.logprobs[:n])
        self.versions += versions[:n]
        self.turn_versions.append(min(versions[:n], default=s.version))
        self.finish_reasons.append(s.finish_reason)
        self.turns += 1

    def add_env(self, ids: list[int]) -> None:
        """Append the environment's tokens: context, never trained on (mask 0, logprob 0, version -1)."""
        self.completion_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.env_tokens += len(ids)

    def text(self) -> str:
        """The conversation after the prompt, the environment's parts marked: 'turn [env: obs] turn'."""
        return "".join(t if who == "policy" else f"[env: {t}]" for who, t in self.parts)


@dataclass
class LiveEpisode:
    """An episode being played: its environment and chat history beside the record."""
    env: Environment
    episode: Episode
    history: list[Message]
    key: int


def run_timed(calls: list, timeout: float) -> list[tuple[str, object, float]]:
    """Run every call in its own daemon thread, all at once; wait at most `timeout` seconds from the
    start. Returns (status, value, seconds) per call: ("ok", result), ("error", exception) or
    ("timeout", None). A timed-out thread is left to finish on its own (daemon: it never blocks exit)."""
    futures: list[Future] = []
    for fn in calls:
        fut: Future = Future()

        def target(fn=fn, fut=fut):
            t0 = time.perf_counter()
            try:
                value = fn()
            except BaseException as e:      # noqa: BLE001 - an environment's failure is counted, not raised
                fut.set_result(("error", e, time.perf_counter() - t0))
            else:
                fut.set_result(("ok", value, time.perf_counter() - t0))

        threading.Thread(target=target, daemon=True, name="lit-ess-env-step").start()
        futures.append(fut)
    wait_futures(futures, timeout=timeout)
    return [f.result() if f.done() else ("timeout", None, timeout) for f in futures]


class EpisodeRunner:
    """Plays episodes of `config`'s environment with an engine; `tokenizer` is the policy's. A run in
    which more than `max_error_rate` of the episodes fail raises EnvError (1.0: never; 0.0: at the first).

    Counters `errors` and `timeouts` add up over runs (kept across a resume: `state_dict`). An episode whose
    first observation is longer than `prompt_limit` tokens (data.max_prompt_tokens) is not played: its prompt
    is cut to the limit, it gets no turn, and it is counted (truncated "prompt", rollout/truncated_prompts)."""

    def __init__(self, config: EnvConfig, tokenizer, max_error_rate: float = 0.5, prompt_limit: int | None = None):
        check("data.reward_limits.max_error_rate", max_error_rate, ge=0, le=1)
        self.config, self.tokens, self.tokenizer = config, EpisodeTokens(tokenizer), tokenizer
        self.prompt_limit = prompt_limit
        self.max_error_rate = max_error_rate
        self.errors = self.timeouts = 0
        self.what = f"environment {config.name!r}"        # who failed, in messages

    def run(self, engine: Sampler, examples: list[Example], n: int, sampling: SamplingConfig,
            call_seed: int = 0, prompt_keys: list[int] | None = None) -> list[Episode]:
        """n episodes per example, example-major (example i's at i*n ... i*n + n - 1). Request seeds
        derive from (sampling.seed, call_seed, turn, the example's key, the sample), `prompt_keys` as in
        RolloutEngine.generate."""
        c = self.config
        keys = list(range(len(examples))) if prompt_keys is None else list(prompt_keys)
        starts = [(ex, key * n + j) for ex, key in zip(examples, keys) for j in range(n)]
        opened = run_timed([lambda ex=ex: self._open(ex) for ex, _ in starts], c.step_timeout)
        live = [self._start(ex, key, engine.version, *o) for (ex, key), o in zip(starts, opened)]
        if any(x.episode.prompt_ids != live[i - i % n].episode.prompt_ids for i, x in enumerate(live)):
            raise ValueError(f"environment {c.name!r}: the {n} episodes of an example start from different prompts "
                             f"(reset must give one first observation per example: a group shares its prompt)")
        active = [x for x in live if not self._over_budget(x)]
        for turn in range(c.max_turns):
            if not active:
                break
            samples = self._sample(engine, active, n, sampling, call_seed, turn)
            stepping = []
            for x, s in zip(active, samples):
                if self._append_turn(x, s):
                    stepping.append((x, s))
            actions = [Action(x.episode.parts[-1][1], list(s.token_ids), s.finish_reason) for x, s in stepping]
            results = run_timed([lambda env=x.env, a=a: env.step(a) for (x, _), a in zip(stepping, actions)],
                                 c.step_timeout)
            active = []
            for (x, s), (status, value, seconds) in zip(stepping, results):
                x.episode.env_seconds += seconds
                if self._answer(x, s, status, value, last_turn=turn == c.max_turns - 1):
                    active.append(x)
        self._finish(live)
        episodes = [x.episode for x in live]
        self._check_failures(episodes)
        return episodes

    def _check_failures(self, episodes: list[Episode]) -> None:
        """EnvError when more than max_error_rate of a run's episodes failed."""
        failed = [e for e in episodes if e.failed]
        if episodes and len(failed) / len(episodes) > self.max_error_rate:
            raise EnvError(f"{self.what} failed in {len(failed)} of {len(episodes)} episodes, more than "
                           f"data.reward_limits.max_error_rate={self.max_error_rate}; first error: {failed[0].error}")

    def _open(self, example: Example) -> tuple[Environment, object]:
        """A fresh environment and its first observation (run in a thread of its own, timed)."""
        try:
            env = self.config.make()
        except Exception as e:
            raise EnvError(f"{self.what} cannot be built from env.init_args {self.config.init_args}: "
                           f"{type(e).__name__}: {_one_line(e)}") from None
        try:
            return env, env.reset(example)
        except Exception as e:
            raise EnvError(f"{self.what} cannot start an episode from {example!r}: "
                           f"{type(e).__name__}: {_one_line(e)}") from None

    def _start(self, example: Example, key: int, version: int, status: str, opened, seconds: float) -> LiveEpisode:
        """The episode of `_open`'s result: what it raised, or its timeout, stops the run (every episode
        would do alike)."""
        if status == "timeout":
            raise EnvError(f"{self.what} did not start an episode from {example!r} (constructor and reset) within "
                           f"env.step_timeout={self.config.step_timeout} s")
        if status == "error":
            if isinstance(opened, EnvError):
                raise opened
            raise EnvError(f"{self.what} cannot start an episode from {example!r}: "
                           f"{type(opened).__name__}: {_one_line(opened)}")
        env, obs = opened
        if not is_observation(obs):
            raise EnvError(f"{self.what} reset returned {_short(obs)}, not text or a list of "
                           f"{{'role', 'content'}} messages (at least one)")
        role = env.observation_role
        # a text prompt is a user turn (EpisodeTokens.prompt), whatever the role of later observations
        history = self.tokens.messages(obs, "user") if self.tokens.chat else []
        try:
            prompt = self.tokens.prompt(obs, role)
        except TemplateError as e:
            raise TemplateError(f"{self.what}: {e}") from None
        if self.prompt_limit is not None and len(prompt) > self.prompt_limit:     # never a row of its whole length
            return LiveEpisode(env, Episode(prompt[:self.prompt_limit], start_version=version, truncated="prompt"),
                               history, key)
        return LiveEpisode(env, Episode(prompt, start_version=version), history, key)

    def _over_budget(self, x: LiveEpisode) -> bool:
        if x.episode.truncated == "prompt":
            return True
        b = self.config.max_episode_tokens
        if b is not None and len(x.episode.prompt_ids) >= b:
            x.episode.truncated = "tokens"
            return True
        return False

    def _sample(self, engine, active: list[LiveEpisode], n: int, sampling: SamplingConfig,
                call_seed: int, turn: int) -> list[Completion]:
        """One engine call. Turn 0 samples n of each prompt, as the single-turn rollout does; later turns
        one sample of each running episode, seeded by its own key and the turn."""
        if turn == 0:
            groups = active[::n]                 # whole groups: its n episodes share the prompt and the budget
            out = engine.generate([g.episode.prompt_ids for g in groups], n, sampling, call_seed=call_seed,
                                  prompt_keys=[g.key // n for g in groups])
            return [s for g in out for s in g]
        prompts = [x.episode.prompt_ids + x.episode.completion_ids for x in active]
        out = engine.generate(prompts, 1, sampling, call_seed=derive_seed(call_seed, turn),
                              prompt_keys=[x.key for x in active])
        return [g[0] for g in out]

    def _append_turn(self, x: LiveEpisode, s: Completion) -> bool:
        """Append the sampled turn; False when the token budget cut it (the episode ends, truncated)."""
        e, b = x.episode, self.config.max_episode_tokens
        n = len(s.token_ids)
        cut = b is not None and len(e.prompt_ids) + len(e.completion_ids) + n > b
        if cut:
            n = b - len(e.prompt_ids) - len(e.completion_ids)
        e.add_policy(s, n)
        ids = list(s.token_ids[:n])
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        e.parts.append(("policy", text))
        if self.tokens.chat:
            x.history.append({"role": "assistant", "content": text})
        if cut:
            e.truncated = "tokens"
        return not cut

    def _answer(self, x: LiveEpisode, s: Completion, status: str, value, last_turn: bool) -> bool:
        """Take an environment's answer to a turn; True when the episode goes on."""
        e = x.episode
        if status == "ok" and not isinstance(value, Step):
            status, value = "error", TypeError(f"step returned a {type(value).__name__}, not a Step")
        if status == "ok":
            reward, bad = as_score(value.reward)
            if bad is not None:
                status, value = "error", ValueError(f"step's reward {bad}")
            elif not isinstance(value.done, (bool, np.bool_)):
                status, value = "error", TypeError(f"step returned done {_short(value.done)}, not a bool")
            elif isinstance(value.tool_calls, bool) or not isinstance(value.tool_calls, (int, np.integer)) \
                    or value.tool_calls < 0:
                status, value = "error", TypeError(f"step returned tool_calls {_short(value.tool_calls)}, not a "
                                                   f"count (an int >= 0)")
            elif not value.done and not is_observation(value.observation):
                status, value = "error", ValueError(f"step returned the observation {_short(value.observation)} for "
                                                    f"an episode that is not done, not text or chat messages")
        if status != "ok":
            self._fail(x, status, value)
            return False
        e.reward += reward
        e.tool_calls += int(value.tool_calls)
        if value.done:
            return False
        if last_turn:
            e.truncated = "turns"
            return False
        try:
            obs_ids = self.tokens.observation(x.history, value.observation, x.env.observation_role, list(s.token_ids))
        except TemplateError as err:
            raise TemplateError(f"{self.what}: {err}") from None
        b = self.config.max_episode_tokens
        if b is not None and len(e.prompt_ids) + len(e.completion_ids) + len(obs_ids) >= b:
            e.truncated = "tokens"              # no room for the next turn: the observation is not appended
            return False
        e.add_env(obs_ids)
        e.parts.append(("env", self.tokens.text(value.observation)))
        if self.tokens.chat:
            x.history += self.tokens.messages(value.observation, x.env.observation_role)
        return True

    def _fail(self, x: LiveEpisode, status: str, error) -> None:
        e = x.episode
        e.reward = 0.0
        if status == "timeout":
            e.env_timeouts += 1
            self.timeouts += 1
            e.error = f"timed out after {self.config.step_timeout} s (env.step_timeout)"
            x.env = None                        # its thread may still run: it is not closed under it
        else:
            e.env_errors += 1
            self.errors += 1
            e.error = f"{type(error).__name__}: {error}"
        if self.errors + self.timeouts == 1:
            warnings.warn(f"{self.what} failed in an episode ({e.error}); the episode ends with "
                          f"reward 0 and is counted in rollout/env_errors, rollout/env_timeouts", stacklevel=3)

    def _finish(self, live: list[LiveEpisode]) -> None:
        """Close the episodes' environments, each in its own thread with step_timeout; a close that raises or
        times out is counted (its episode keeps its reward)."""
        closing = [x for x in live if x.env is not None]
        results = run_timed([x.env.close for x in closing], self.config.step_timeout)
        for x, (status, err, _) in zip(closing, results):
            if status == "error":
                x.episode.env_errors += 1
                self.errors += 1
                x.episode.error = x.episode.error or f"close: {type(err).__name__}: {err}"
            elif status == "timeout":
                x.episode.env_timeouts += 1
                self.timeouts += 1
                x.episode.error = x.episode.error or f"close: timed out after {self.config.step_timeout} s"

    def close(self) -> None:
        """Free what the runner holds (nothing here: environments close with their episodes)."""

    def state_dict(self) -> dict[str, int]:
        return {"errors": self.errors, "timeouts": self.timeouts}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.errors, self.timeouts = int(state.get("errors", 0)), int(state.get("timeouts", 0))


def _short(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (an error line stays one short line)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def episode_stats(episodes: list[Episode]) -> dict[str, float]:
    """Means per episode (turns, environment tokens and seconds, tool calls) and counts of truncations of
    one batch of episodes, under the rollout/ names the dashboards show. (Failures are the runner's
    cumulative counters, `EpisodeRunner.state_dict`, logged as rollout/env_errors and rollout/env_timeouts.)"""
    n = max(len(episodes), 1)
    return {
        "rollout/turns": sum(e.turns for e in episodes) / n,
        "rollout/env_tokens": sum(e.env_tokens for e in episodes) / n,
        "rollout/env_seconds": sum(e.env_seconds for e in episodes) / n,
        "rollout/tool_calls": sum(e.tool_calls for e in episodes) / n,
        "rollout/truncated_turns": float(sum(e.truncated == "turns" for e in episodes)),
        "rollout/truncated_tokens": float(sum(e.truncated == "tokens" for e in episodes)),
        "rollout/truncated_prompts": float(sum(e.truncated == "prompt" for e in episodes)),
    }


def to_row(episode: Episode, advantage: float, prompt_id: int, prompt_text: str) -> Row:
    """A batch row of the episode: the completion is every token after the prompt (the environment's
    too, with logprob 0 and mask False), the version its oldest turn's, the text the whole conversation
    with the environment's parts marked."""
    e = episode
    return Row(prompt=e.prompt_ids, completion=e.completion_ids, logprobs=e.logprobs, advantage=advantage,
               reward=e.reward, version=e.version, prompt_id=prompt_id, prompt_text=prompt_text, completion_text=e.text(),
               mask=[bool(m) for m in e.mask], token_versions=e.token_versions())


def collate_episodes(episodes: list[Episode], advantages: list[float], prompt_ids: list[int],
                     prompt_texts: list[str], pad_id: int, **fields) -> RolloutBatch:
    """Pad episodes into a RolloutBatch (lit_ess.batch.collate) whose completion_mask is True on
    the policy's tokens only: the environment's tokens are context, never trained on, never in the ESS."""
    rows = [to_row(e, a, i, t) for e, a, i, t in zip(episodes, advantages, prompt_ids, prompt_texts, strict=True)]
    return collate(rows, pad_id, **fields)
