"""Users' agents (lit_ess.envs.agent): episodes assembled from recorded calls, the OpenAI-compatible URL
served by the proxy (token in, token out over HTTP, chat and completions), refusals and failures. The
engine is scripted here; the real vLLM server's e2e is in test_server.py (its module server)."""
from __future__ import annotations

import threading
import time
from functools import partial
import urllib.request

import pytest
import torch
from agent_fns import HTTPFailure, post
from test_envs import byte_tok, chat_tok, ids  # noqa: F401  (fixtures)

from lit_ess.datamodules.prompts import Example, encode_prompt
from lit_ess.engines import RolloutEngine
from lit_ess.sampling import Completion, SamplingConfig, derive_seed
from lit_ess.envs import Agent, AgentRunner, EnvConfig, EnvError, EpisodeRunner, RetryArithmetic, make_runner
from lit_ess.envs.agent import Call, assemble
from lit_ess.envs.proxy import RequestError
from lit_ess.envs.episodes import Episode
from lit_ess.datamodules.settings import BatchShape

S = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0)


class PerEpisodeEngine(RolloutEngine):
    """Replaces generation: call c of episode `key` samples `script[key][c]`; the behaviour logprob of its
    i-th token is -(1 + c + i / 10), its version 4 + c; cut at max_new_tokens. Records every prompt and sampling setting."""

    def __init__(self, script: dict[int, list[list[int]]], eos_id: int):
        self.script, self.eos_id, self.version, self.seen = script, eos_id, 4, []

    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        (key,) = prompt_keys
        c = sum(k == key for k, _, _ in self.seen)
        self.seen.append((key, list(prompts[0]), sampling))
        t = self.script[key][c][:sampling.max_new_tokens]
        return [[Completion(list(t), [-(1 + c + i / 10) for i in range(len(t))],
                            "stop" if t and t[-1] == self.eos_id else "length", 4 + c)]]

    def load_weights(self, named_tensors, version):
        raise NotImplementedError


def run(fn: str, tok, engine, examples, n=1, **env) -> tuple[list[Episode], AgentRunner]:
    runner = make_runner(EnvConfig(env=partial(Agent, function=fn), **{"max_turns": 4, **env}),
                         tok, max_error_rate=1.0)
    try:
        return runner.run(engine, examples, n, S), runner
    finally:
        runner.close()


# ---------------------------------------------------------------------------------------------------------
# Assembly from recorded calls


def test_calls_that_append_are_one_sequence_with_the_agents_tokens_masked():
    """Hand-made calls: the episode is the first prompt, then each call's added tokens (mask 0, logprob 0)
    and sampled ids (mask 1, their pi_b and version)."""
    calls = [Call([1, 2], Completion([3, 4], [-0.1, -0.2], "stop", 5), "ab", ""),
             Call([1, 2, 3, 4, 9, 9], Completion([5], [-0.3], "length", 6), "c", "xy"),
             Call([1, 2, 3, 4, 9, 9, 5], Completion([7, 8], [-0.4, -0.5], "stop", 6), "de", "")]
    e = assemble(calls, Episode([]))
    assert e.prompt_ids == [1, 2]
    assert e.completion_ids == [3, 4, 9, 9, 5, 7, 8]
    assert e.mask == [1, 1, 0, 0, 1, 1, 1]
    assert e.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5]
    assert e.turn_starts == [0, 4, 5] and e.turn_versions == [5, 6, 6] and e.version == 5
    assert e.token_versions() == [5, 5, -1, -1, 6, 6, 6]
    assert (e.turns, e.env_tokens, e.finish_reasons) == (3, 2, ["stop", "length", "stop"])
    assert e.text() == "ab[env: xy]cde"


@pytest.mark.parametrize("second", [[1, 2, 3], [1, 2, 9, 4], [9, 1, 2, 3, 4]])
def test_a_call_that_does_not_continue_the_last_is_refused(second):
    calls = [Call([1, 2], Completion([3, 4], [-0.1, -0.2], "stop", 0)), Call(second, Completion([5], [-1.0], "stop", 0))]
    with pytest.raises(RequestError, match="call 2's prompt does not continue call 1's"):
        assemble(calls, Episode([]))


# ---------------------------------------------------------------------------------------------------------
# Through the proxy, token in, token out


def test_completions_continue_on_the_sampled_ids(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    first, second = ids(tok, "12") + [eos], ids(tok, "10")
    engine = PerEpisodeEngine({0: [first, second], 1: [ids(tok, "9") + [eos], ids(tok, "1") + [eos]]}, eos)
    (a, b), runner = run("agent_fns:two_completions", tok, engine, [Example("5+5=", "10")], n=2)
    added = ids(tok, "\nagain 5+5=")
    assert a.prompt_ids == [tok.bos_token_id] + ids(tok, "5+5=")
    assert a.completion_ids == first + added + second                  # the sampled eos stays: never re-encoded
    assert a.mask == [1] * len(first) + [0] * len(added) + [1] * len(second)
    assert a.logprobs[:len(first)] == [-1.0, -1.1, -1.2] and a.logprobs[-2:] == [-2.0, -2.1]
    assert a.turn_versions == [4, 5] and a.version == 4
    assert (a.reward, b.reward, a.turns, a.env_tokens) == (1.0, 0.0, 2, len(added))
    sent = [p for key, p, _ in engine.seen if key == 0]
    assert sent == [a.prompt_ids, a.prompt_ids + first + added]         # what the engine saw is what is trained
    assert runner.errors == runner.timeouts == 0 and not a.failed


def test_chat_replies_are_never_re_encoded(chat_tok):
    """The reply '579' sampled one digit at a time comes back as the text '579' (one token when encoded):
    the next prompt keeps the three sampled ids and appends the template's delta for the new message."""
    tok, eos = chat_tok, chat_tok.eos_token_id
    split = [tok.convert_tokens_to_ids(ch) for ch in "579"]
    assert ids(tok, "579") != split
    engine = PerEpisodeEngine({0: [split + [eos], ids(tok, "122") + [eos]]}, eos)
    (e,), _ = run("agent_fns:two_chats", tok, engine, [Example("37+85=", "122")])
    delta = ids(tok, "\n<|im_start|>user\nagain 37+85=<|im_end|>\n<|im_start|>assistant\n")
    assert e.prompt_ids == ids(tok, "<|im_start|>user\n37+85=<|im_end|>\n<|im_start|>assistant\n")
    assert e.completion_ids == split + [eos] + delta + ids(tok, "122") + [eos]
    assert e.mask == [1] * 4 + [0] * len(delta) + [1] * 2
    assert e.reward == 1.0 and e.text() == "579[env: [user] again 37+85=]122"
    assert [p for _, p, _ in engine.seen] == [e.prompt_ids, e.prompt_ids + split + [eos] + delta]


GOT: dict = {}          # what the agents below saw
OVER = threading.Event()  # set by a test once the run that timed an agent out has returned


def answers(url, ex):
    GOT["models"] = urllib.request.urlopen(url + "/models").read()
    GOT["answer"] = post(url + "/completions", {"prompt": ex.prompt, "max_tokens": 100, "stop": ["\n"],
                                                "temperature": 1.0, "logprobs": 1})
    return 0.5


def test_answers_carry_the_token_ids_and_the_runs_sampling(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    engine = PerEpisodeEngine({0: [ids(tok, "7") + [eos]]}, eos)
    (e,), _ = run("test_agents:answers", tok, engine, [Example("3+4=", "7")])
    choice = GOT["answer"]["choices"][0]
    assert choice["token_ids"] == ids(tok, "7") + [eos] and choice["prompt_token_ids"] == e.prompt_ids
    assert choice["text"] == "7" and choice["logprobs"]["token_logprobs"] == [-1.0, -1.1]
    assert GOT["answer"]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    _, _, s = engine.seen[0]
    assert (s.max_new_tokens, s.stop, s.temperature) == (8, ["\n"], 1.0)      # capped by the run's max_new_tokens
    assert e.reward == 0.5 and b"policy" in GOT["models"]


# ---------------------------------------------------------------------------------------------------------
# Refusals and failures: reward 0, counted, one line


def edits_the_reply(url, ex):
    first = post(url + "/completions", {"prompt": ex.prompt})
    try:
        post(url + "/completions", {"prompt": ex.prompt + first["choices"][0]["text"].upper() + "!"})
    except HTTPFailure as e:
        GOT["refused"] = str(e)
    return 1.0                                       # the agent swallowed the refusal: the episode still fails


def other_temperature(url, ex):
    post(url + "/completions", {"prompt": ex.prompt, "temperature": 0.7})


def raises(url, ex):
    post(url + "/completions", {"prompt": ex.prompt})
    raise KeyError("tool")


def sleeps(url, ex):
    """One call, then it waits until the test says its episode is over, then calls again (a late call)."""
    post(url + "/completions", {"prompt": ex.prompt})
    OVER.wait(60)
    try:
        post(url + "/completions", {"prompt": ex.prompt})
    except HTTPFailure as e:
        GOT["late"] = str(e)


def returns_text(url, ex):
    post(url + "/completions", {"prompt": ex.prompt})
    return "1.0"


def no_call(url, ex):
    return 1.0


def many_calls(url, ex):
    text = ex.prompt
    for _ in range(5):
        try:
            text += post(url + "/completions", {"prompt": text})["choices"][0]["text"]
        except HTTPFailure as e:
            GOT.setdefault("limits", []).append(str(e))
            return 0.25
    return 1.0


def test_a_rewritten_conversation_is_refused_and_fails_the_episode(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    engine = PerEpisodeEngine({0: [ids(tok, "ab") + [eos], ids(tok, "x")]}, eos)
    with pytest.warns(UserWarning, match="agent 'test_agents:edits_the_reply' failed in an episode"):
        (e,), runner = run("test_agents:edits_the_reply", tok, engine, [Example("q=", "a")])
    assert "HTTP 400: agent 'test_agents:edits_the_reply' rewrote the conversation at call 2" in GOT["refused"]
    assert len(engine.seen) == 1                                    # the refused call was not sampled
    assert (e.reward, e.env_errors, runner.errors) == (0.0, 1, 1) and "rewrote the conversation" in e.error
    assert e.completion_ids == ids(tok, "ab") + [eos] and e.mask == [1, 1, 1]


@pytest.mark.parametrize("fn, says", [
    ("other_temperature", "data.sampling.temperature=1.0"), ("raises", "KeyError: 'tool'"),
    ("returns_text", "returned '1.0', not a number"), ("no_call", "made no call through its base_url")])
def test_a_failing_agent_ends_its_episode_with_reward_0_and_is_counted(fn, says, byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    engine = PerEpisodeEngine({0: [ids(tok, "1") + [eos]], 1: [ids(tok, "2") + [eos]]}, eos)
    with pytest.warns(UserWarning, match=f"agent 'test_agents:{fn}' failed"):
        eps, runner = run(f"test_agents:{fn}", tok, engine, [Example("q=", "1"), Example("r=", "2")])
    assert [e.reward for e in eps] == [0.0, 0.0] and runner.errors == 2 and runner.timeouts == 0
    assert says in eps[0].error and "\n" not in eps[0].error
    with pytest.raises(EnvError, match=f"agent 'test_agents:{fn}' failed in 2 of 2 episodes"), pytest.warns(UserWarning):
        make_runner(EnvConfig(env=partial(Agent, function=f"test_agents:{fn}")), tok,
                    max_error_rate=0.5).run(PerEpisodeEngine(engine.script, eos), [Example("q=", "1"), Example("r=", "2")], 1, S)


def test_a_slow_agent_times_out_and_its_late_calls_are_refused(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    engine = PerEpisodeEngine({0: [ids(tok, "1") + [eos]] * 2}, eos)
    GOT.pop("late", None)
    OVER.clear()
    runner = make_runner(EnvConfig(env=partial(Agent, function="test_agents:sleeps"),
                                   step_timeout=1.0), tok, max_error_rate=1.0)
    try:
        with pytest.warns(UserWarning, match="timed out after 1.0 s"):
            (e,) = runner.run(engine, [Example("q=", "1")], 1, S)
    finally:
        OVER.set()                                    # the run returned: its thread posts again, into an episode that is over
    assert (e.reward, e.env_timeouts, runner.timeouts, e.turns) == (0.0, 1, 1, 1)
    deadline = time.monotonic() + 60
    while "late" not in GOT and time.monotonic() < deadline:
        time.sleep(0.02)
    runner.close()
    assert "HTTP 404" in GOT["late"] and len(engine.seen) == 1


def test_calls_past_max_turns_and_the_token_budget_are_refused_and_counted(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    engine = PerEpisodeEngine({0: [ids(tok, "1")] * 5, 1: [ids(tok, "12345678")] * 5}, eos)
    (a, b), _ = run("test_agents:many_calls", tok, engine, [Example("q=", "1"), Example("r=", "2")], max_turns=3,
                    max_episode_tokens=14)
    assert (a.turns, a.truncated, a.reward) == (3, "turns", 0.25)
    assert len(b.prompt_ids) + len(b.completion_ids) == 14 and b.truncated == "tokens" and b.turns == 2
    assert [s.max_new_tokens for k, _, s in engine.seen if k == 1] == [8, 3]     # the second reply cut at the budget
    assert sorted(GOT["limits"]) == ["HTTP 400: the prompt has 14 tokens, env.max_episode_tokens=14: no room for a reply",
                                     "HTTP 400: this episode made env.max_turns=3 calls already"]


def test_an_agent_is_named_as_rewards_are(byte_tok):
    """A function that cannot be imported or called as function(base_url, example) fails in one line when
    the runner is made (the rollout worker makes it before the engine)."""
    for fn, says in [("agent_fns:nope", "agent function 'agent_fns:nope' cannot be imported"),
                     ("agent_fns", "is not 'package.module:function'"),
                     ("agent_fns:__doc__", "not a function of \\(base_url, example\\)"),
                     ("json:dumps", "cannot be called as function\\(base_url, example\\)")]:
        config = EnvConfig(env=partial(Agent, function=fn))
        with pytest.raises(ValueError, match=says) as e:
            make_runner(config, byte_tok)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="do not fit environment"):
        EnvConfig(env=partial(Agent, fn="agent_fns:two_chats"))
    assert type(make_runner(EnvConfig(env=partial(Agent, function="agent_fns:two_chats")),
                            byte_tok)) is AgentRunner
    assert type(make_runner(EnvConfig(env="retry_arithmetic"), byte_tok)) is EpisodeRunner


class Broken(PerEpisodeEngine):
    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        raise RuntimeError("vLLM server http://127.0.0.1:9: POST /inference/v1/generate failed")


def test_an_engine_failure_stops_the_run_not_only_the_episode(byte_tok):
    with pytest.raises(RuntimeError, match="vLLM server http://127.0.0.1:9"):
        run("agent_fns:two_completions", byte_tok, Broken({}, byte_tok.eos_token_id), [Example("q=", "1")])


class ByPrompt(RolloutEngine):
    """Replaces generation: the reply to a prompt is `replies[tries]` where tries counts 'wrong' in it; its
    logprobs -0.5 each."""

    def __init__(self, tok, replies: list[list[int]]):
        self.tok, self.replies, self.version = tok, replies, 2

    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        out = []
        for p in prompts:
            t = self.replies[self.tok.decode(p).count("wrong")]
            out.append([Completion(list(t), [-0.5] * len(t), "stop", self.version)] * n)
        return out

    def load_weights(self, named_tensors, version):
        raise NotImplementedError


def test_the_demo_agent_trains_what_retry_arithmetic_trains(byte_tok):
    """lit_ess/envs/retry_agent.py (OpenAI client code, configs/demo_agent.yaml) and the RetryArithmetic
    environment (configs/demo_multiturn.yaml) on the same replies: the same episodes, token for token."""
    tok, eos = byte_tok, byte_tok.eos_token_id
    engine = ByPrompt(tok, [ids(tok, "121") + [eos], ids(tok, "12") + [eos], ids(tok, "122") + [eos]])
    examples = [Example("37+85=", "122"), Example("1+1=", "121")]
    (a, b), _ = run("lit_ess.envs.retry_agent:retry_arithmetic", tok, engine, examples, max_turns=3)
    env = EpisodeRunner(EnvConfig(env=partial(RetryArithmetic, max_tries=3), max_turns=3), tok)
    want_a, want_b = env.run(engine, examples, 1, S)
    for got, want in ((a, want_a), (b, want_b)):
        assert (got.prompt_ids, got.completion_ids, got.mask, got.logprobs) == \
            (want.prompt_ids, want.completion_ids, want.mask, want.logprobs)
        assert (got.reward, got.turns, got.env_tokens, got.text()) == (want.reward, want.turns, want.env_tokens, want.text())
    assert (a.reward, a.turns, b.reward, b.turns) == (1 / 3, 3, 1.0, 1)


class Seeded(RolloutEngine):
    """A sample is 3 tokens chosen by (call seed, prompt key): the same alone or in a batch. 20 ms per call;
    records the calls' sizes and whether two calls ever overlapped."""
    delay = 0.02

    def __init__(self, concurrent: bool):
        self.concurrent, self.version, self.sizes, self.inside, self.overlap = concurrent, 0, [], 0, False
        self.lock = threading.Lock()

    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        with self.lock:
            self.inside += 1
            self.overlap |= self.inside > 1
        time.sleep(self.delay)
        out = [[Completion([40 + derive_seed(call_seed, k) % 10, 41], [-0.5, -0.5], "length", 0)] for k in prompt_keys]
        with self.lock:
            self.inside -= 1
            self.sizes.append(len(prompts))
        return out

    def load_weights(self, named_tensors, version):
        raise NotImplementedError


def test_an_engine_of_one_call_at_a_time_gets_the_waiting_calls_together(byte_tok):
    """An in-process engine (not concurrent) is never called from two threads at once; the calls that wait
    go in one generate, and every episode is what a concurrent engine gives (seeds per episode and call)."""
    examples = [Example(f"{i}+1=", str(i + 1)) for i in range(6)]
    queued, direct = Seeded(concurrent=False), Seeded(concurrent=True)
    a, _ = run("agent_fns:two_completions", byte_tok, queued, examples, n=2)
    b, _ = run("agent_fns:two_completions", byte_tok, direct, examples, n=2)
    assert [e.completion_ids for e in a] == [e.completion_ids for e in b]
    assert len({tuple(e.completion_ids) for e in a}) > 1
    assert sum(queued.sizes) == 24 and len(queued.sizes) < 24 and not queued.overlap
    assert direct.sizes == [1] * 24 and direct.overlap


def test_the_data_modules_batches_from_an_agent_are_on_policy(tiny_model_dir):
    """data.env naming an agent, an in-process engine (HF: one call at a time): the trainer's batch has the
    agent's text ('\\nagain ' + the question) at completion mask 0 with logprob 0, and the behaviour
    logprobs of the sampled tokens are the trainer's."""
    from transformers import AutoModelForCausalLM

    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.engines import HFConfig
    from lit_ess.logprobs import sequence_logprobs

    env = EnvConfig(env=partial(Agent, function="agent_fns:two_completions"), max_turns=2)
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=50), batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=2), sampling=SamplingConfig(max_new_tokens=4, seed=0), env=env)
    dm.setup("fit")
    (batch,) = dm.generate_phase()
    tok = dm.tokenizer
    assert batch.stats["rollout/turns"] == 2.0 and batch.stats["rollout/env_errors"] == 0.0
    for b in range(batch.rows):
        P = len(encode_prompt(tok, batch.prompt_texts[b]))
        after = batch.attention_mask[b].bool()
        after[:P] = False
        env_part = after & ~batch.completion_mask[b]
        assert tok.decode(batch.input_ids[b][env_part]) == "\nagain " + batch.prompt_texts[b]
        assert (batch.behavior_logprobs[b][env_part] == 0).all()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert (lp - batch.behavior_logprobs)[batch.completion_mask].abs().max() < 1e-5
    proxy = dm.executor.worker.samples.runner.proxy
    dm.executor.close()
    assert not proxy.loop.is_running()


@pytest.mark.e2e
def test_episodes_whose_agent_failed_before_any_call_train_without_harm(tiny_model_dir, tmp_path):
    """`lit-ess fit` (HF engine) with an agent that raises before its first call on half the examples: those
    rows have no policy token (reward 0, counted); the steps run with finite losses at ESS 1."""
    import math

    from e2e_utils import cli, rl_config, scalars, write_config

    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, extra_data={
        "env": {"env": {"class_path": "lit_ess.envs.agent.Agent", "init_args": {"function": "agent_fns:raises_before_calling_on_odd_sums"}},
                "max_turns": 2}, "reward_limits": {"max_error_rate": 1.0}})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))])
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    assert min(v for _, v in s["rollout/env_errors"]) > 0 and s["rollout/turns"][0][1] < 2
    assert all(math.isfinite(v) for _, v in s["train/loss"]) and min(v for _, v in s["train/ess"]) >= 0.9999


class Slow(Seeded):
    """Seeded, 2.5 s per call."""
    delay = 2.5


@pytest.mark.filterwarnings("ignore:agent .* failed in an episode")
def test_an_engine_of_one_call_at_a_time_is_free_when_a_run_of_timed_out_agents_returns(byte_tok):
    """Agents that time out while their call is in the engine: the run returns once the engine is free, so
    the next phase's calls (or a weight push) never overlap the old call."""
    engine = Slow(concurrent=False)
    runner = make_runner(EnvConfig(env=partial(Agent, function="agent_fns:two_completions"),
                                   max_turns=4, step_timeout=1.5), byte_tok, max_error_rate=1.0)
    try:
        for phase in range(2):                        # two phases, back to back, as the worker runs them
            eps = runner.run(engine, [Example("1+1=", "2")], 2, S, call_seed=phase)
            assert engine.inside == 0
            assert all(e.env_timeouts == 1 and e.reward == 0.0 for e in eps)
    finally:
        runner.close()
    assert not engine.overlap


@pytest.mark.parametrize("knob, value", [("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("repetition_penalty", 1.2),
                                         ("min_p", 0.1), ("logit_bias", {"50": 100}), ("min_tokens", 4)])
def test_a_request_that_asks_for_another_distribution_is_refused(knob, value):
    """Penalties, biases and floors change what is sampled: the engine samples with the run's settings, so a
    request asking for them is refused in one line naming the knob (their neutral values are served)."""
    from lit_ess.envs.proxy import request_sampling

    with pytest.raises(RequestError, match=f"^{knob}="):
        request_sampling({knob: value}, S)
    neutral = {"logit_bias": {}, "repetition_penalty": 1.0}.get(knob, 0)
    assert request_sampling({knob: neutral}, S) == S and request_sampling({knob: None}, S) == S
