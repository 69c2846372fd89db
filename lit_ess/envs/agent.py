"""Users' agents: a function that talks to the policy through an OpenAI-compatible URL, recorded token in,
token out.

    env: {env: {class_path: lit_ess.envs.Agent, init_args: {function: "mymod:run_agent"}}, max_turns: 4, step_timeout: 60}

`run_agent(base_url, example) -> reward` plays one episode: it posts to `{base_url}/chat/completions` or
`{base_url}/completions` as to any OpenAI-compatible server (an `async def` runs in an event loop of its
own) and returns the episode's reward, a number. lit-ess serves that URL (lit_ess/envs/proxy.py), one per
episode, and samples every call itself, on token ids, with the run's engine, so that the episode is the
token sequence the policy really saw and sampled:

    call 1   prompt p1                  -> sampled s1
    call 2   prompt p1 s1 o1            -> sampled s2        o1: what the agent added (tool output, feedback)
    episode  p1 | s1 o1 s2              mask 1 on s1 and s2 (pi_b, the version of their call), 0 on o1

A call continues the conversation when its request only appends to the previous one:
    chat         messages = the previous messages + the reply as returned + new messages: the prompt is
                 the previous prompt + the sampled ids + the chat template's delta for the new messages
                 (lit_ess/envs/tokens.py); the model's reply is never re-encoded, so no tokenization drift;
    completions  prompt text = the previous prompt text + the reply as returned + new text: the previous
                 prompt + the sampled ids + the new text's ids; a prompt of token ids is taken as it is.
The first call's prompt is rendered (chat template + generation prompt) or encoded (bos + text). A request
that does not continue (a dropped or edited message or reply, other tools, a conversation of its own)
cannot be one token sequence: it is refused with HTTP 400 naming the function, and the episode fails; so
does a prompt of token ids the policy's tokenizer does not have (the engine cannot take them).

Sampling is the run's (data.sampling): a request's temperature, top_p and top_k must be the run's or absent
(the trainer scores with the run's), penalties, logit_bias, min_p and min_tokens absent or neutral, its max_tokens is capped by sampling.max_new_tokens (the default),
its stop strings apply (a reply keeps the stop string that ended it), its seed is ignored: seeds derive
from the run's as every rollout's (phase, episode, call). Calls of one episode are sequential. Limits:
env.max_turns calls (one more is refused: truncated "turns"), env.max_episode_tokens tokens (a prompt that
reaches it is refused, a reply is cut at it: truncated "tokens"), env.step_timeout seconds for the whole
function. A function that raises, times out, returns no finite number, makes no call or rewrites the
conversation ends its episode with reward 0, counted as an environment failure (rollout/env_errors,
rollout/env_timeouts; data.reward_limits.max_error_rate applies).
"""
from __future__ import annotations

import asyncio
import inspect
import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace

from lit_ess.rewards import as_score, import_named
from lit_ess.sampling import Completion, Sampler, SamplingConfig, derive_seed

from .base import Action, Environment, Example, Message, Step
from .config import EnvConfig
from .episodes import Episode, EpisodeRunner, LiveEpisode, run_timed
from .proxy import Proxy, RequestError
from .tokens import TemplateError, encode_prompt, encode_text, render_chat


OVER = "this episode is over (its agent timed out or returned)"


class Agent(Environment):
    """A user's agent function as an episode's environment, played whole by AgentRunner (not turn by turn).

    Args:
        function: 'package.module:function', called as function(base_url, example) -> reward, where
            base_url is an OpenAI-compatible URL ending in /v1 and example a lit_ess.envs.base.Example
            (prompt, answer).
    """

    def __init__(self, function: str):
        if ":" not in function:
            raise ValueError(f"env.init_args.function={function!r} is not 'package.module:function'")
        fn = import_named(function, "agent function")
        if not callable(fn):
            raise ValueError(f"agent function {function!r} is a {type(fn).__name__}, not a function of (base_url, example)")
        try:
            inspect.signature(fn).bind("http://127.0.0.1/v1", Example("", ""))
        except TypeError as e:
            raise ValueError(f"agent function {function!r} cannot be called as function(base_url, example): {e}") from None
        self.name, self.fn = function, fn

    def play(self, base_url: str, example: Example):
        """Run the function once; what it returns (the reward, checked by the runner)."""
        if inspect.iscoroutinefunction(self.fn):
            return asyncio.run(self.fn(base_url, example))
        return self.fn(base_url, example)

    def reset(self, example: Example):
        raise TypeError("an Agent plays whole episodes through lit_ess.envs.agent.AgentRunner, not reset/step")

    def step(self, action: Action) -> Step:
        raise TypeError("an Agent plays whole episodes through lit_ess.envs.agent.AgentRunner, not reset/step")


@dataclass
class Call:
    """One recorded model call: the prompt ids sent, what was sampled, and the texts the table shows."""
    prompt_ids: list[int]
    sample: Completion
    text: str = ""             # the reply as returned to the agent
    added: str = ""            # what the request added to the conversation (the environment's part)


def continues(seq: list[int], prompt: list[int]) -> bool:
    """Whether `prompt` starts with the token sequence `seq` (the previous prompt + sampled ids)."""
    return len(prompt) >= len(seq) and prompt[:len(seq)] == seq


def assemble(calls: list[Call], episode: Episode) -> Episode:
    """Fill `episode` with its calls as one token sequence: the first prompt, then per call the tokens its
    prompt added (mask 0, logprob 0: the environment's) and its sampled ids (mask 1, its pi_b, its version).
    A call whose prompt does not start with the previous prompt + sampled ids is a RequestError."""
    e = episode
    seq = list(calls[0].prompt_ids)
    e.prompt_ids = list(seq)
    for k, c in enumerate(calls):
        if not continues(seq, c.prompt_ids):
            raise RequestError(f"call {k + 1}'s prompt does not continue call {k}'s prompt and reply")
        added = c.prompt_ids[len(seq):]
        if added:
            e.add_env(added)
            e.parts.append(("env", c.added))
        s = c.sample
        e.add_policy(s)
        e.parts.append(("policy", c.text))
        seq = list(c.prompt_ids) + list(s.token_ids)
    return e


class EngineQueue:
    """Calls of many episodes to an engine that takes one call at a time (not `Sampler.concurrent`):
    the calls that arrive while one runs go together in the next, one `generate` per (sampling, call seed),
    each prompt with its own key, so each sample has the seed it would have alone. The thread that finds
    the engine free runs it for everyone waiting. `close` ends the run's use of the engine."""

    def __init__(self, engine: Sampler):
        self.engine, self.lock, self.running = engine, threading.Lock(), threading.Lock()
        self.pending: list[tuple[list[int], SamplingConfig, int, int, Future]] = []
        self.closed = False

    def sample(self, ids: list[int], sampling: SamplingConfig, call_seed: int, key: int) -> Completion:
        fut: Future = Future()
        with self.lock:
            if self.closed:
                raise RequestError(OVER)
            self.pending.append((ids, sampling, call_seed, key, fut))
        while self.running.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.running.release()
            with self.lock:                 # a call that came after the last drain, while the engine was held
                if not self.pending:
                    break
        return fut.result()

    def _drain(self) -> None:
        while True:
            with self.lock:
                batch, self.pending = self.pending, []
            if not batch:
                return
            groups: dict[tuple[str, int], list] = {}
            for job in batch:
                groups.setdefault((repr(job[1]), job[2]), []).append(job)
            for jobs in groups.values():
                try:
                    out = self.engine.generate([j[0] for j in jobs], 1, jobs[0][1], call_seed=jobs[0][2],
                                               prompt_keys=[j[3] for j in jobs])
                except Exception as e:
                    for j in jobs:
                        j[4].set_exception(e)
                    continue
                for j, group in zip(jobs, out):
                    j[4].set_result(group[0])

    def close(self) -> None:
        """Refuse calls from now on and the waiting ones (their episodes are over: timed out agents'), and
        return once a call in progress has ended: the engine is free for the next phase or a weight push."""
        with self.lock:
            self.closed, waiting, self.pending = True, self.pending, []
        for job in waiting:
            job[4].set_exception(RequestError(OVER))
        with self.running:
            pass


def same_message(a: Message, b: Message) -> bool:
    return a.get("role") == b.get("role") and a.get("content") == b.get("content")


class Session:
    """One episode's conversation with the policy: each request's prompt ids (continuing the conversation
    token in, token out), the engine call, the record. Its methods run in the proxy's threads."""

    def __init__(self, runner: "AgentRunner", engine: Sampler | EngineQueue, sampling: SamplingConfig,
                 call_seed: int, key: int):
        self.runner, self.engine, self.sampling, self.call_seed, self.key = runner, engine, sampling, call_seed, key
        self.calls: list[Call] = []
        self.history: list[Message] | None = None   # chat: the messages sent last + the reply as returned
        self.tools: list[dict] | None = None
        self.text: str | None = None                # completions: the prompt text sent last + the reply
        self.truncated: str | None = None
        self.refused: str | None = None             # why a request failed the episode (HTTP 400; reward 0)
        self.over = False
        self.engine_error: Exception | None = None
        self.lock = threading.Lock()
        self.busy = False

    @property
    def seq(self) -> list[int] | None:
        """The conversation so far as token ids: the last prompt + its sampled ids (None before a call)."""
        if not self.calls:
            return None
        return self.calls[-1].prompt_ids + self.calls[-1].sample.token_ids

    def chat(self, messages: list[Message], tools: list[dict] | None, sampling: SamplingConfig) -> Call:
        """POST /chat/completions: `messages` continuing the conversation, sampled with `sampling`."""
        tok = self.runner.tokens
        if not tok.chat:
            raise RequestError("the policy's tokenizer has no chat template: post to /completions")

        def prompt() -> tuple[list[int], str]:
            if self.seq is None:
                return render_chat(tok.tok, messages, generation=True, tools=tools), tok.text(messages)
            h = self.history
            if h is None or tools != self.tools or len(messages) <= len(h) or \
                    not all(same_message(a, b) for a, b in zip(messages, h)):
                raise self._refuse("its messages are not the previous messages + the reply as returned + new "
                                   "messages" + (" (other tools)" if h is not None and tools != self.tools else ""))
            new = messages[len(h):]
            try:
                delta = tok.observation(h, new, "user", self.calls[-1].sample.token_ids, tools)
            except TemplateError as e:
                raise self._refuse(str(e)) from None
            return self.seq + delta, tok.text(new)

        call = self._call(prompt, sampling)
        self.history, self.tools, self.text = list(messages) + [{"role": "assistant", "content": call.text}], tools, None
        return call

    def complete(self, prompt: str | list[int], sampling: SamplingConfig) -> Call:
        """POST /completions: a prompt text (or token ids) continuing the conversation."""
        tok = self.runner.tokenizer

        def ids() -> tuple[list[int], str]:
            seq = self.seq
            if isinstance(prompt, list):
                if seq is not None and not continues(seq, prompt):
                    raise self._refuse("its prompt ids do not start with the previous prompt and reply ids")
                self._check_ids(prompt[len(seq or []):])
                return list(prompt), tok.decode(prompt[len(seq or []):], skip_special_tokens=True)
            if seq is None:
                return encode_text(tok, prompt), prompt
            if self.text is None or not prompt.startswith(self.text):
                raise self._refuse("its prompt is not the previous prompt + the reply as returned + new text")
            new = prompt[len(self.text):]
            return seq + (list(tok(new, add_special_tokens=False)["input_ids"]) if new else []), new

        call = self._call(ids, sampling)
        self.text = None if isinstance(prompt, list) else prompt + call.text
        self.history = self.tools = None
        return call

    def _refuse(self, why: str) -> RequestError:
        return self._failed(f"agent {self.runner.agent.name!r} rewrote the conversation at call {len(self.calls) + 1}: "
                            f"{why}; lit-ess trains one token sequence per episode, so a request may only append to "
                            f"the previous one")

    def _check_ids(self, ids: list[int]) -> None:
        """Token ids an agent added: ids the policy's tokenizer has, else the request fails the episode (the
        engine would fail on them, and an engine's failure stops the run)."""
        size = len(self.runner.tokenizer)
        if bad := [t for t in ids if not 0 <= t < size]:
            raise self._failed(f"agent {self.runner.agent.name!r} posted token ids outside the policy's vocabulary "
                               f"(0..{size - 1}) at call {len(self.calls) + 1}: {bad[:5]}")

    def _failed(self, why: str) -> RequestError:
        """A request that fails the episode (HTTP 400 to the agent; reward 0, counted as its failure)."""
        self.refused = why
        return RequestError(why)

    def _call(self, prompt, sampling: SamplingConfig) -> Call:
        """Build the prompt (`prompt()` -> ids, added text), check the limits, sample, record."""
        with self.lock:
            if self.over or self.refused:
                raise RequestError(self.refused or OVER)
            if self.busy:
                raise RequestError("the calls of one episode are sequential: this one came while another ran")
            self.busy = True
        try:
            c = self.runner.config
            if len(self.calls) >= c.max_turns:
                self.truncated = "turns"
                raise RequestError(f"this episode made env.max_turns={c.max_turns} calls already")
            ids, added = prompt()
            budget = c.max_episode_tokens
            if budget is not None and len(ids) >= budget:
                self.truncated = "tokens"
                raise RequestError(f"the prompt has {len(ids)} tokens, env.max_episode_tokens={budget}: no room "
                                   f"for a reply")
            room = sampling.max_new_tokens if budget is None else min(sampling.max_new_tokens, budget - len(ids))
            s = replace(sampling, max_new_tokens=room)
            seed = derive_seed(self.call_seed, len(self.calls))
            try:
                if isinstance(self.engine, EngineQueue):
                    sample = self.engine.sample(ids, s, seed, self.key)
                else:
                    sample = self.engine.generate([ids], 1, s, call_seed=seed, prompt_keys=[self.key])[0][0]
            except RequestError:                # the queue closed: the run is over, the engine is fine
                raise
            except Exception as e:
                self.engine_error = e           # the engine's failure stops the run, not only this episode
                raise
            if room < sampling.max_new_tokens and sample.finish_reason == "length" and len(sample.token_ids) >= room:
                self.truncated = "tokens"
            text = self.runner.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            call = Call(list(ids), sample, text, added)
            with self.lock:
                if self.over:                       # sampled while its function timed out: not in the episode
                    raise RequestError(OVER)
                self.calls.append(call)
            return call
        finally:
            with self.lock:
                self.busy = False

    def end(self) -> list[Call]:
        """The episode's calls; no request is served after this (a timed-out function's thread may still post)."""
        with self.lock:
            self.over = True
            return list(self.calls)


class AgentRunner(EpisodeRunner):
    """Plays episodes of an Agent (`config.env` names lit_ess.envs.agent:Agent): every episode's function
    at once, each in its own thread with its own base URL, timed by `config.step_timeout`; then each
    episode from its recorded calls. Counters and failure handling are EpisodeRunner's."""

    def __init__(self, config: EnvConfig, tokenizer, max_error_rate: float = 0.5, prompt_limit: int | None = None):
        super().__init__(config, tokenizer, max_error_rate, prompt_limit)
        self.agent = config.make()
        if not isinstance(self.agent, Agent):
            raise ValueError(f"environment {config.name!r} is not an Agent: EpisodeRunner plays it")
        self.what = f"agent {self.agent.name!r}"
        self.proxy = None

    def run(self, engine: Sampler, examples: list[Example], n: int, sampling: SamplingConfig,
            call_seed: int = 0, prompt_keys: list[int] | None = None) -> list[Episode]:
        """n episodes per example, example-major; call k of episode `key * n + j` is seeded by (sampling.seed,
        call_seed, k, the episode) as EpisodeRunner seeds its later turns."""
        if self.proxy is None:
            self.proxy = Proxy(self.tokenizer)
        keys = list(range(len(examples))) if prompt_keys is None else list(prompt_keys)
        calls_to = engine if engine.concurrent else EngineQueue(engine)
        jobs = [(ex, Session(self, calls_to, sampling, call_seed, key * n + j), engine.version)
                for ex, key in zip(examples, keys) for j in range(n)]
        urls = [self.proxy.open(s) for _, s, _ in jobs]
        results = run_timed([lambda ex=ex, url=url: self.agent.play(url, ex) for (ex, _, _), url in zip(jobs, urls)],
                             self.config.step_timeout)
        calls = []
        for (_, s, _), url in zip(jobs, urls):
            calls.append(s.end())
            self.proxy.close_session(url)
        if isinstance(calls_to, EngineQueue):
            calls_to.close()                    # a timed-out agent's call may still hold the engine
        broken = next((s.engine_error for _, s, _ in jobs if s.engine_error is not None), None)
        if broken is not None:
            raise broken                        # the engine's failure stops the run, as in every other rollout
        episodes = [self._episode(ex, s, c, version, *result)
                    for (ex, s, version), c, result in zip(jobs, calls, results)]
        self._check_failures(episodes)
        return episodes

    def _episode(self, example: Example, s: Session, calls: list[Call], version: int, status: str, value,
                 seconds: float) -> Episode:
        e = Episode(encode_prompt(self.tokenizer, example.prompt), start_version=version, env_seconds=seconds,
                    truncated=s.truncated)
        if calls:
            assemble(calls, e)
        if status == "ok":
            reward, bad = as_score(value)
            if s.refused:
                status, value = "error", RequestError(s.refused)
            elif bad is not None:
                status, value = "error", ValueError(f"the function {bad}")
            elif not calls:
                status, value = "error", ValueError("the function made no call through its base_url: nothing to train on")
            else:
                e.reward = reward
        if status != "ok":
            self._fail(LiveEpisode(self.agent, e, [], s.key), status, value)
        return e

    def close(self) -> None:
        """Stop the proxy (a later run starts another)."""
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None


def make_runner(config: EnvConfig, tokenizer, max_error_rate: float = 0.5, prompt_limit: int | None = None) -> EpisodeRunner:
    """The runner of `config`'s environment: AgentRunner for a user's agent (Agent), which plays whole
    episodes through an OpenAI-compatible URL, else the turn-by-turn EpisodeRunner. `prompt_limit`: the
    longest first observation played (data.max_prompt_tokens, as for source prompts)."""
    cls = AgentRunner if issubclass(config.env_class, Agent) else EpisodeRunner
    return cls(config, tokenizer, max_error_rate=max_error_rate, prompt_limit=prompt_limit)
