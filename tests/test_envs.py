"""Multi-turn episodes, token in, token out: the environment interface, the episode runner's tokens,
masks, limits and failures, the built-in environments, and (e2e) the token-for-token and logprob
equality of multi-turn episodes sampled by vLLM on a tiny Qwen2 with a BPE tokenizer and a chat template."""
from __future__ import annotations

import math
from functools import partial
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_ess.datamodules import SFTDataModule
from lit_ess.datamodules.prompts import Arithmetic, CalculatorTranscripts, Example, PromptSource, encode_prompt
from lit_ess.engines import RolloutEngine
from lit_ess.sampling import Completion, SamplingConfig
from lit_ess.envs import (Action, Calculator, EnvConfig, EnvError, Environment, EpisodeRunner, RetryArithmetic, Step,
                          TemplateError, collate_episodes, episode_stats)
from lit_ess.envs.arithmetic import calculate
from lit_ess.objectives import P3O
from lit_ess.batch import Row, collate
from lit_ess.tiny import build_chat_tokenizer, build_tokenizer

S = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0)


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    return build_chat_tokenizer()


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


class ScriptedEngine(RolloutEngine):
    """Replaces generation: episode `key * n + j`'s turn t is `script[key * n + j][t]` (token ids); the
    behaviour logprob of its i-th token is -(1 + t + i / 10). Records every call."""

    def __init__(self, script: dict[int, list[list[int]]], eos_id: int, version: int = 3):
        self.script, self.eos_id, self.version, self.calls = script, eos_id, version, []

    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        turn = len(self.calls)
        self.calls.append((prompts, n, call_seed, prompt_keys))
        keys = prompt_keys if prompt_keys is not None else range(len(prompts))
        out = []
        for k in keys:
            group = []
            for j in range(n):
                t = self.script[k * n + j if turn == 0 else k][turn]
                group.append(Completion(list(t), [-(1 + turn + i / 10) for i in range(len(t))],
                                        "stop" if t and t[-1] == self.eos_id else "length", self.version))
            out.append(group)
        return out

    def load_weights(self, named_tensors, version):
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------------
# The typed config


def test_env_config_names_the_culprit():
    with pytest.raises(ValueError, match="unknown environment 'retry'; valid names: single_turn, retry_arithmetic"):
        EnvConfig(env="retry")
    with pytest.raises(ValueError, match=r"environment 'no_such_module:Env' cannot be imported: no module named "
                                         r"'no_such_module' in .* or the installed packages: put no_such_module.py beside"):
        EnvConfig(env="no_such_module:Env")
    with pytest.raises(ValueError, match=r"environment 'lit_ess.envs:Nope' cannot be imported"):
        EnvConfig(env="lit_ess.envs:Nope")
    with pytest.raises(ValueError, match=r"'lit_ess.envs:Step' is a type, not a subclass of lit_ess.envs.Environment"):
        EnvConfig(env="lit_ess.envs:Step")
    with pytest.raises(ValueError, match=r"env.init_args \{'tries': 2\} do not fit environment RetryArithmetic\(max_tries"):
        EnvConfig(env=partial(RetryArithmetic, tries=2))
    for knob, value in [("max_turns", 0), ("max_episode_tokens", 1), ("step_timeout", 0)]:
        with pytest.raises(ValueError, match=f"env.{knob} must be"):
            EnvConfig(**{knob: value})
    with pytest.raises(ValueError, match="data.reward_limits.max_error_rate must be"):
        EpisodeRunner(EnvConfig(), build_tokenizer(), max_error_rate=1.5)
    with pytest.raises(ValueError, match="RetryArithmetic.max_tries must be >= 1"):
        EnvConfig(env=partial(RetryArithmetic, max_tries=0)).make()
    assert isinstance(EnvConfig(env=f"{__name__}:Flaky").make(), Flaky)       # a user's own, module:Class


# ---------------------------------------------------------------------------------------------------------
# Built-in environments, stepped by hand


def test_retry_rewards_fewer_tries_more():
    ex = Example("37+85=", "122")
    env = RetryArithmetic(max_tries=3)
    assert env.reset(ex) == "37+85="
    assert env.step(Action("121", [], "stop")) == Step(observation="wrong\n37+85=")
    assert env.step(Action(" 122 ", [], "stop")) == Step(reward=0.5, done=True)
    env.reset(ex)
    assert env.step(Action("122", [], "stop")) == Step(reward=1.0, done=True)
    env.reset(ex)
    assert [env.step(Action("1", [], "stop")).done for _ in range(3)] == [False, False, True]


def test_calculator_inserts_the_result_and_counts_calls():
    env = Calculator(max_calls=1)
    env.reset(Example("37*85=", "3145"))
    assert env.step(Action("calc(37*85)", [], "stop")) == Step(observation="3145\n37*85=", tool_calls=1)
    assert env.step(Action("3145", [], "stop")) == Step(reward=1.0, done=True)
    env.reset(Example("37*85=", "3145"))
    assert env.step(Action("calc(3 7)", [], "stop")).observation == "error\n37*85="
    assert env.step(Action("calc(1+1)", [], "stop")) == Step(reward=0.0, done=True, tool_calls=1)   # over max_calls
    assert [calculate(e) for e in ["37*85", "1+2*3", "10-2-3", "3--5", "-2*-3+1", " 4 * 5 ", "9\x1c"]] == [3145, 7, 5, 8, 7, 20, 9]
    assert [calculate(e) for e in ["1+", "", "1**2", "2^3", "9" * 13, "1+" * 40 + "1"]] == [None] * 6


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("0123456789+-*() \t\n\x1c\x85\u3000\u0663x"), max_size=20) | st.text(max_size=20))
def test_calculate_answers_any_text_with_a_value_or_none(expr):
    """What a policy writes in calc(...) never raises (a sampled '9\\x1c' once did): whitespace is any
    Unicode space, as the pattern's \\s allows."""
    value = calculate(expr)
    assert value is None or isinstance(value, int)
    if value is not None:
        assert value == calculate("".join(expr.split()))


# ---------------------------------------------------------------------------------------------------------
# The runner: tokens, masks, logprobs, one engine call per turn


def test_retry_episodes_are_sampled_ids_plus_observation_tokens(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    right, wrong = ids(tok, "122") + [eos], ids(tok, "121") + [eos]
    engine = ScriptedEngine({0: [right], 1: [wrong, right], 2: [wrong, wrong, wrong]}, eos)
    runner = EpisodeRunner(EnvConfig(env=partial(RetryArithmetic, max_tries=3), max_turns=3), tok)
    a, b, c = runner.run(engine, [Example("37+85=", "122")], n=3, sampling=S, call_seed=5)

    prompt = encode_prompt(tok, "37+85=")
    obs = ids(tok, "wrong\n37+85=")
    assert a.prompt_ids == b.prompt_ids == c.prompt_ids == prompt
    assert (a.completion_ids, a.mask, a.reward, a.turns) == (right, [1] * 4, 1.0, 1)
    assert b.completion_ids == wrong + obs + right
    assert b.mask == [1] * 4 + [0] * len(obs) + [1] * 4
    assert b.logprobs == [-1.0, -1.1, -1.2, -1.3] + [0.0] * len(obs) + [-2.0, -2.1, -2.2, -2.3]
    assert (b.reward, b.turns, b.env_tokens, b.turn_starts) == (0.5, 2, len(obs), [0, 4 + len(obs)])
    assert b.token_versions() == [3] * 4 + [-1] * len(obs) + [3] * 4
    assert b.text() == "121[env: wrong\n37+85=]122"
    assert (c.reward, c.turns, c.truncated) == (0.0, 3, None)         # the environment ended it, no limit
    # one engine call per turn, for the episodes still running; turn 0 is the single-turn call (n per prompt)
    assert [(len(p), n, k) for p, n, _, k in engine.calls] == [(1, 3, [0]), (2, 1, [1, 2]), (1, 1, [2])]
    assert engine.calls[1][0][0] == prompt + wrong + obs and engine.calls[2][0][0] == prompt + c.completion_ids[:-4]

    assert engine.calls[0][2] == 5 and len({call[2] for call in engine.calls}) == 3   # each turn its own seeds
    stats = episode_stats([a, b, c])
    assert stats["rollout/turns"] == 2.0 and stats["rollout/env_tokens"] == 3 * len(obs) / 3

class InFlightEngine(ScriptedEngine):
    """ScriptedEngine whose turns switch weights in flight: turn t's tokens after the second are sampled
    by version 4 + t, those before by 3 + t."""

    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        turn = len(self.calls)
        out = super().generate(prompts, n, sampling, call_seed, prompt_keys)
        for group in out:
            for c in group:
                c.token_versions = [3 + turn if i < 2 else 4 + turn for i in range(len(c.token_ids))]
                c.version = 3 + turn
        return out


@pytest.mark.parametrize("budget", [None, 9])
def test_a_turn_sampled_by_two_versions_keeps_each_tokens_version(budget, byte_tok):
    """In-flight updates: a turn's tokens carry the version that sampled each (not the turn's oldest), the
    environment's carry -1; the episode's version is its oldest token's; a budget cut keeps the labels
    of the tokens it keeps."""
    tok, eos = byte_tok, byte_tok.eos_token_id
    wrong, right = ids(tok, "121") + [eos], ids(tok, "122") + [eos]
    engine = InFlightEngine({0: [wrong, right]}, eos)
    prompt = encode_prompt(tok, "37+85=")
    obs = ids(tok, "wrong\n37+85=")
    cfg = EnvConfig(env=partial(RetryArithmetic, max_tries=3), max_turns=3,
                    max_episode_tokens=None if budget is None else len(prompt) + 4 + len(obs) + 3)
    (e,) = EpisodeRunner(cfg, tok).run(engine, [Example("37+85=", "122")], n=1, sampling=S, call_seed=5)
    second = [4, 4, 5, 5] if budget is None else [4, 4, 5]
    assert e.token_versions() == [3, 3, 4, 4] + [-1] * len(obs) + second
    assert e.turn_versions == [3, 4] and e.version == 3
    assert e.truncated == (None if budget is None else "tokens")


def test_single_turn_episodes_batch_as_the_single_turn_rollout(byte_tok, tiny_model_dir):
    """SingleTurn: the same engine call and seeds as RolloutWorker.sample, and the same batch as its rows."""
    from lit_ess.engines import HFConfig

    tok = byte_tok
    examples = Arithmetic(digits=1, size=3, seed=0).examples
    prompts = [encode_prompt(tok, e.prompt) for e in examples]
    engine = HFConfig().build(tiny_model_dir)
    direct = engine.generate(prompts, 2, S, call_seed=7, prompt_keys=[4, 5, 6])
    eps = EpisodeRunner(EnvConfig(), tok).run(engine, examples, 2, S, call_seed=7, prompt_keys=[4, 5, 6])
    assert [e.completion_ids for e in eps] == [s.token_ids for g in direct for s in g]
    texts = [tok.decode(s.token_ids, skip_special_tokens=True) for g in direct for s in g]
    assert [e.reward for e in eps] == [float(t.strip() == examples[i // 2].answer) for i, t in enumerate(texts)]
    rows = [Row(prompt=prompts[i // 2], completion=s.token_ids, logprobs=s.logprobs, advantage=0.5, reward=eps[i].reward,
                version=s.version, prompt_id=i // 2, prompt_text="p", completion_text=texts[i])
            for i, s in enumerate(s for g in direct for s in g)]
    want = collate(rows, tok.pad_token_id)
    got = collate_episodes(eps, [0.5] * 6, [i // 2 for i in range(6)], ["p"] * 6, tok.pad_token_id)
    for name in ("input_ids", "attention_mask", "completion_mask", "behavior_logprobs", "rewards", "versions"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.completion_texts == want.completion_texts


def test_plain_multiturn_episodes_are_on_policy_with_the_hf_engine(byte_tok, tiny_model_dir):
    """A real engine over turns, plain tokenizer: behaviour logprobs equal the trainer's on the assembled
    sequences, and the environment's tokens sit between the turns with mask 0."""
    from transformers import AutoModelForCausalLM

    from lit_ess.engines import HFConfig
    from lit_ess.logprobs import sequence_logprobs

    engine = HFConfig().build(tiny_model_dir)
    cfg = EnvConfig(env="retry_arithmetic", max_turns=3, max_episode_tokens=64)
    eps = EpisodeRunner(cfg, byte_tok).run(engine, Arithmetic(digits=1, size=2, seed=0).examples, 2, S)
    assert sum(e.turns for e in eps) > len(eps) and all(e.env_tokens > 0 for e in eps if e.turns > 1)
    batch = collate_episodes(eps, [1.0] * 4, [0, 0, 1, 1], [""] * 4, byte_tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    m = batch.completion_mask
    assert (lp - batch.behavior_logprobs)[m].abs().max() < 1e-5


def test_calculator_episode(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    call, answer = ids(tok, "calc(37*85)") + [eos], ids(tok, "3145") + [eos]
    engine = ScriptedEngine({0: [call, answer]}, eos)
    (e,) = EpisodeRunner(EnvConfig(env="calculator", max_turns=3), tok).run(engine, [Example("37*85=", "3145")], 1, S)
    assert e.completion_ids == call + ids(tok, "3145\n37*85=") + answer
    assert (e.reward, e.turns, e.tool_calls) == (1.0, 2, 1)
    assert episode_stats([e])["rollout/tool_calls"] == 1.0


class OneProblem(PromptSource):
    def __init__(self, prompt: str, answer: str):
        self.examples = [Example(prompt, answer)]


def test_calculator_warm_start_trains_the_episodes_own_tokens(tiny_model_dir, byte_tok):
    """configs/demo_calculator_sft.yaml's pairs are the ids of the episode RL samples (the call turn cut
    at the stop string ')'), token for token: the policy's turns are the targets, the inserted result
    and question are context."""
    tok, eos = byte_tok, byte_tok.eos_token_id
    call, answer = ids(tok, "calc(37*85)"), ids(tok, "3145") + [eos]
    engine = ScriptedEngine({0: [call, answer]}, eos)
    (e,) = EpisodeRunner(EnvConfig(env="calculator", max_turns=2), tok).run(engine, [Example("37*85=", "3145")], 1, S)
    assert e.reward == 1.0
    dm = SFTDataModule(model_path=tiny_model_dir, source=CalculatorTranscripts(OneProblem("37*85=", "3145")))
    dm.setup("fit")
    (p1, a1), (p2, a2) = dm.items
    observed = len(e.completion_ids) - len(answer)
    assert p1 == e.prompt_ids and a1 == call + [eos]                      # eos after ')' is never sampled
    assert p2 == e.prompt_ids + e.completion_ids[:observed] and a2 == e.completion_ids[observed:]


@pytest.mark.parametrize("prompt,answer", [("37+85=", "121"), ("37*85", "3145"), ("what is 37*85?", "3145")])
def test_calculator_warm_start_refuses_a_problem_the_calculator_does_not_answer(prompt, answer):
    with pytest.raises(ValueError, match="CalculatorTranscripts.source"):
        CalculatorTranscripts(OneProblem(prompt, answer))


# ---------------------------------------------------------------------------------------------------------
# Chat models: observation tokens are the template's delta, sampled ids are never re-encoded


def test_chat_observations_are_template_deltas_after_the_sampled_ids(chat_tok):
    tok, eos = chat_tok, chat_tok.eos_token_id
    split = [tok.convert_tokens_to_ids(ch) for ch in "579"]            # sampled one digit at a time
    assert ids(tok, "579") != split and len(ids(tok, "579")) == 1      # the text '579' encodes to one id
    right = ids(tok, "122") + [eos]
    engine = ScriptedEngine({0: [split + [eos], right], 1: [split, right]}, eos)   # 1: cut by max_new_tokens
    runner = EpisodeRunner(EnvConfig(env="retry_arithmetic", max_turns=3), tok)
    a, b = runner.run(engine, [Example("37+85=", "122")], 2, S)
    assert a.prompt_ids == ids(tok, "<|im_start|>user\n37+85=<|im_end|>\n<|im_start|>assistant\n")
    delta = ids(tok, "\n<|im_start|>user\nwrong\n37+85=<|im_end|>\n<|im_start|>assistant\n")
    assert a.completion_ids == split + [eos] + delta + right
    assert b.completion_ids == split + [eos] + delta + right and b.mask[3] == 0   # the template's eos: not sampled
    assert a.mask == [1] * 4 + [0] * len(delta) + [1] * len(right)
    assert (a.reward, b.reward) == (0.5, 0.5)
    resampled = tok.apply_chat_template([{"role": "user", "content": "37+85="}, {"role": "assistant", "content": "579"},
                                         {"role": "user", "content": "wrong\n37+85="}], add_generation_prompt=True)
    resampled = resampled["input_ids"] if hasattr(resampled, "keys") else resampled
    assert a.prompt_ids + a.completion_ids[:-len(right)] != list(resampled)       # re-encoding would drift


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = build_chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = ScriptedEngine({0: [ids(tok, "1") + [tok.eos_token_id]] * 2}, tok.eos_token_id)
    with pytest.raises(TemplateError, match="the chat template rewrites earlier turns when a message is added"):
        EpisodeRunner(EnvConfig(env="retry_arithmetic", max_turns=2), tok).run(engine, [Example("1+1=", "2")], 1, S)


class Hints(Environment):
    """Answers with a system message."""

    def reset(self, example):
        return example.prompt

    def step(self, action):
        return Step(observation=[{"role": "system", "content": "hint"}])


def test_a_template_that_raises_on_the_messages_stops_in_one_line():
    """A chat template that refuses the environment's messages (raise_exception, as many templates do for
    roles out of order) stops the run with one line naming the environment and the template's words."""
    tok = build_chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                         "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                         "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = ScriptedEngine({0: [ids(tok, "1") + [tok.eos_token_id]] * 2}, tok.eos_token_id)
    with pytest.raises(TemplateError, match=rf"^environment '{__name__}:Hints': the chat template .*"
                                            r"System message must be at the beginning") as e:
        EpisodeRunner(EnvConfig(env=f"{__name__}:Hints", max_turns=2), tok).run(engine, [Example("1+1=", "2")], 1, S)
    assert "\n" not in str(e.value)


class ToolRole(Environment):
    """Text observations in the 'tool' role; the prompt (text) is a user message as every prompt is."""
    observation_role = "tool"

    def reset(self, example):
        return example.prompt

    def step(self, action):
        return Step(observation="42", done=len(action.token_ids) > 2)


def test_a_text_prompt_is_the_user_message_in_the_history_whatever_the_observation_role():
    """The first observation, text, is encoded as a user turn (encode_prompt); the history the template
    renders the deltas from says so too, also for an environment whose observations are 'tool' messages
    (a template that needs a user query, as Qwen3's does, would refuse a history without one)."""
    tok = build_chat_tokenizer()
    tok.chat_template = ("{% if not messages | selectattr('role', 'equalto', 'user') | list %}"
                         "{{ raise_exception('No user query found in messages.') }}{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    eos = tok.eos_token_id
    engine = ScriptedEngine({0: [ids(tok, "1") + [eos], ids(tok, "12") + [eos]]}, eos)
    (e,) = EpisodeRunner(EnvConfig(env=f"{__name__}:ToolRole", max_turns=2), tok).run(engine, [Example("1+1=", "2")], 1, S)
    assert e.prompt_ids == ids(tok, "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n")
    delta = ids(tok, "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert e.completion_ids == ids(tok, "1") + [eos] + delta + ids(tok, "12") + [eos] and e.turns == 2


# ---------------------------------------------------------------------------------------------------------
# Failures and limits


class Flaky(Environment):
    """The example's answer says how the step misbehaves."""

    def reset(self, example):
        self.how = example.answer
        if self.how == "reset raises":
            raise KeyError("no such task")
        return 42 if self.how == "bad reset" else example.prompt

    def step(self, action):
        if self.how == "raise":
            raise RuntimeError("tool server down")
        if self.how == "hang":
            time.sleep(30)                   # far past step_timeout and the bound below: a stall would show
        if self.how == "nan":
            return Step(reward=math.nan, done=True)
        if self.how == "none":
            return None
        if self.how == "bad observation":
            return Step(observation=[{"role": "user"}])
        if self.how == "late":
            if action.token_ids[-1] == 51:
                raise ValueError("late failure")
            return Step(observation="more", reward=0.75)
        if self.how == "twice":
            return Step(observation="again", reward=0.25, done=action.token_ids[-1] == 99)
        if self.how == "done yes":
            return Step(observation="more", reward=1.0, done="yes")
        if self.how == "done none":
            return Step(reward=1.0, done=None)
        if self.how == "numpy done":
            return Step(reward=np.float32(0.5), done=np.bool_(True))
        if self.how == "calls":
            return Step(reward=1.0, done=True, tool_calls="2")
        if self.how == "no messages":
            return Step(observation=[], reward=1.0)
        if self.how == "messages":
            return Step(observation=[{"role": "user", "content": "more"}])
        return Step(reward=1.0, done=True)


def test_failing_steps_end_their_episode_with_reward_0_and_are_counted(byte_tok):
    hows = ["ok", "raise", "hang", "nan", "none", "bad observation"]
    engine = ScriptedEngine({i: [[50, 51]] for i in range(6)}, byte_tok.eos_token_id)
    runner = EpisodeRunner(EnvConfig(env=f"{__name__}:Flaky", step_timeout=0.5), byte_tok, max_error_rate=1.0)
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match="failed in an episode"):
        eps = runner.run(engine, [Example("q", h) for h in hows], 1, S)
    assert time.perf_counter() - t0 < 10                                   # the hung step (30 s) did not stall the batch
    assert [e.reward for e in eps] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [(e.env_errors, e.env_timeouts) for e in eps] == [(0, 0), (1, 0), (0, 1), (1, 0), (1, 0), (1, 0)]
    assert "tool server down" in eps[1].error and "reward returned nan" in eps[3].error and "not a Step" in eps[4].error
    assert "not text or chat messages" in eps[5].error
    assert runner.state_dict() == {"errors": 4, "timeouts": 1}
    assert episode_stats(eps)["rollout/env_seconds"] > 0.5 / 6
    with pytest.raises(ValueError, match="reset returned 42, not text or a list of"):
        runner.run(engine, [Example("q", "bad reset")], 1, S)


def test_answers_that_are_not_a_steps_fields_end_their_episode_with_reward_0_and_are_counted(byte_tok):
    """A done that is not a bool ('yes' would read as done, None as not done), tool calls that are not a
    count, an empty list of messages: the episode ends with reward 0, counted, the reason in its error.
    numpy's bool and float are a bool and a number."""
    hows = ["done yes", "done none", "calls", "no messages", "numpy done"]
    engine = ScriptedEngine({i: [[50, 51]] for i in range(len(hows))}, byte_tok.eos_token_id)
    runner = EpisodeRunner(EnvConfig(env=f"{__name__}:Flaky", max_turns=2), byte_tok, max_error_rate=1.0)
    with pytest.warns(UserWarning, match="failed in an episode"):
        eps = runner.run(engine, [Example("q", h) for h in hows], 1, S)
    assert [(e.reward, e.turns, e.env_errors) for e in eps] == [(0.0, 1, 1)] * 4 + [(0.5, 1, 0)]
    assert "done 'yes', not a bool" in eps[0].error and "done None, not a bool" in eps[1].error
    assert "tool_calls '2', not a count" in eps[2].error and "not text or chat messages" in eps[3].error
    assert runner.state_dict() == {"errors": 4, "timeouts": 0}


class Unbuildable(Environment):
    def __init__(self):
        raise RuntimeError("no licence")

    def reset(self, example):
        return example.prompt

    def step(self, action):
        return Step(done=True)


def test_an_environment_that_cannot_start_or_answer_in_the_tokenizers_format_stops_in_one_line(byte_tok):
    """What every episode would do the same (a constructor or reset that raises, chat messages for a
    tokenizer without a chat template) is no episode's failure: one line naming the environment, an
    EnvError (a worker process reports it as it is, not as a crash)."""
    engine = ScriptedEngine({0: [[50]] * 2}, byte_tok.eos_token_id)
    built = r"cannot be built from env.init_args \{\}: RuntimeError: no licence"
    for env, answer, why in [(f"{__name__}:Unbuildable", "ok", built),
                             (f"{__name__}:Flaky", "bad reset", "reset returned 42, not text"),
                             (f"{__name__}:Flaky", "messages", "answered with chat messages, but the tokenizer has no "
                                                               "chat template")]:
        runner = EpisodeRunner(EnvConfig(env=env, max_turns=2), byte_tok)
        with pytest.raises(EnvError, match=f"^environment '{env}'.* {why}") as e:
            runner.run(engine, [Example("q", answer)], 1, S)
        assert "\n" not in str(e.value)
    with pytest.raises(EnvError, match=f"^environment '{__name__}:Flaky' cannot start an episode from .*KeyError"):
        EpisodeRunner(EnvConfig(env=f"{__name__}:Flaky"), byte_tok).run(engine, [Example("q", "reset raises")], 1, S)


class Stuck(Environment):
    """reset or close hangs (for 30 s) when the example's answer says so."""

    def reset(self, example):
        self.how = example.answer
        if self.how == "reset hangs":
            time.sleep(30)
        return example.prompt

    def step(self, action):
        return Step(reward=1.0, done=True)

    def close(self):
        if self.how == "close hangs":
            time.sleep(30)


def test_a_reset_or_close_that_hangs_does_not_hang_the_rollout(byte_tok):
    """env.step_timeout bounds an environment's reset and close as it bounds its steps: a reset that hangs
    stops the run in one line (as one that raises), a close that hangs is counted, its episode kept."""
    engine = ScriptedEngine({0: [[50]], 1: [[50]]}, byte_tok.eos_token_id)
    runner = EpisodeRunner(EnvConfig(env=f"{__name__}:Stuck", step_timeout=0.5), byte_tok, max_error_rate=1.0)
    t0 = time.perf_counter()
    with pytest.raises(EnvError, match=rf"^environment '{__name__}:Stuck' did not start an episode .* within "
                                       r"env.step_timeout=0.5 s"):
        runner.run(engine, [Example("q", "ok"), Example("q", "reset hangs")], 1, S)
    assert time.perf_counter() - t0 < 5
    t0 = time.perf_counter()
    a, b = runner.run(engine, [Example("q", "ok"), Example("q", "close hangs")], 1, S)
    assert time.perf_counter() - t0 < 5
    assert (a.reward, a.failed, b.reward, b.env_timeouts) == (1.0, False, 1.0, 1)
    assert runner.state_dict() == {"errors": 0, "timeouts": 1}


def test_an_error_after_a_rewarded_step_zeroes_the_episode(byte_tok):
    engine = ScriptedEngine({0: [[50], [51]]}, byte_tok.eos_token_id)
    runner = EpisodeRunner(EnvConfig(env=f"{__name__}:Flaky", max_turns=2), byte_tok, max_error_rate=1.0)
    with pytest.warns(UserWarning, match="late failure"):
        (e,) = runner.run(engine, [Example("q", "late")], 1, S)
    assert (e.reward, e.turns, e.env_errors) == (0.0, 2, 1)


def test_more_failures_than_the_error_rate_raise_one_line(byte_tok):
    engine = ScriptedEngine({i: [[50]] for i in range(4)}, byte_tok.eos_token_id)
    runner = EpisodeRunner(EnvConfig(env=f"{__name__}:Flaky"), byte_tok, max_error_rate=0.5)
    exs = [Example("q", h) for h in ["raise", "raise", "raise", "ok"]]
    with pytest.warns(UserWarning), pytest.raises(EnvError, match=r"failed in 3 of 4 episodes, more than "
                                                                  r"data.reward_limits.max_error_rate=0.5; first error: RuntimeError: tool"):
        runner.run(engine, exs, 1, S)


def test_turn_and_token_limits_truncate_and_are_counted(byte_tok):
    tok = byte_tok
    turn = [60, 61, 62]
    engine = ScriptedEngine({0: [turn] * 5}, tok.eos_token_id)
    (e,) = EpisodeRunner(EnvConfig(env=f"{__name__}:Flaky", max_turns=2), tok).run(engine, [Example("q", "twice")], 1, S)
    obs = ids(tok, "again")
    assert (e.turns, e.truncated, e.reward) == (2, "turns", 0.5)
    assert e.completion_ids == turn + obs + turn                         # the last observation is not appended
    P = len(encode_prompt(tok, "q"))
    for budget, want in [(P + 3 + len(obs) + 2, turn + obs + [60, 61]),  # the second turn cut at the budget
                         (P + 3 + len(obs), turn),                       # no room after the observation: dropped
                         (P + 2, [60, 61])]:
        engine = ScriptedEngine({0: [turn] * 5}, tok.eos_token_id)
        cfg = EnvConfig(env=f"{__name__}:Flaky", max_turns=5, max_episode_tokens=budget)
        (e,) = EpisodeRunner(cfg, tok).run(engine, [Example("q", "twice")], 1, S)
        assert (e.completion_ids, e.truncated) == (want, "tokens")
        assert len(e.prompt_ids) + len(e.completion_ids) <= budget
        assert e.logprobs[-1] != 0.0 and e.mask[-1] == 1                 # ends with a (cut) policy turn
    assert episode_stats([e])["rollout/truncated_tokens"] == 1.0
    (e,) = EpisodeRunner(EnvConfig(max_episode_tokens=P), tok).run(engine, [Example("q", "a")], 1, S)
    assert (e.completion_ids, e.turns, e.truncated) == ([], 0, "tokens")    # the prompt fills the budget


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=4), min_size=1, max_size=4),
       max_turns=st.integers(1, 4), budget=st.one_of(st.none(), st.integers(4, 40)))
def test_episode_invariants(lengths, max_turns, budget):
    """Any turn lengths and limits: aligned per-token lists, logprob 0 exactly off the mask, the policy's
    tokens are prefixes of what was sampled in order, the budget and the turn limit hold."""
    tok = build_tokenizer()
    script = {i: [[70 + i] * k + [99 if t == len(ls) - 1 else 70] for t, k in enumerate(ls)] + [[71]] * 4
              for i, ls in enumerate(lengths)}
    engine = ScriptedEngine(script, tok.eos_token_id)
    cfg = EnvConfig(env=f"{__name__}:Flaky", max_turns=max_turns, max_episode_tokens=budget)
    eps = EpisodeRunner(cfg, tok).run(engine, [Example("q", "twice")] * len(lengths), 1, S)
    for i, e in enumerate(eps):
        assert len(e.completion_ids) == len(e.mask) == len(e.logprobs)
        assert all((lp != 0.0) == bool(m) for lp, m in zip(e.logprobs, e.mask))
        assert e.turns <= max_turns and (budget is None or len(e.prompt_ids) + len(e.completion_ids) <= budget)
        policy = [t for t, m in zip(e.completion_ids, e.mask) if m]
        sampled = [t for turn in script[i][:e.turns] for t in turn]
        assert policy == sampled[:len(policy)] and len(policy) > sum(len(t) for t in script[i][:e.turns - 1])
        assert e.truncated in (None, "turns", "tokens") and (e.truncated != "turns" or e.turns == max_turns)
        assert not e.mask or e.mask[-1] == 1


# ---------------------------------------------------------------------------------------------------------
# The loss sees the policy's tokens only


def test_observation_tokens_would_change_the_loss_if_unmasked(byte_tok):
    tok, eos = byte_tok, byte_tok.eos_token_id
    engine = ScriptedEngine({0: [ids(tok, "121") + [eos], ids(tok, "122") + [eos]], 1: [ids(tok, "122") + [eos]]}, eos)
    eps = EpisodeRunner(EnvConfig(env="retry_arithmetic", max_turns=2), tok).run(engine, [Example("37+85=", "122")], 2, S)
    batch = collate_episodes(eps, [-0.7, 0.7], [0, 0], ["37+85="] * 2, tok.pad_token_id)
    torch.manual_seed(0)
    lp = batch.behavior_logprobs + 0.3 * torch.randn(batch.behavior_logprobs.shape)
    P = len(eps[0].prompt_ids)
    unmasked = torch.zeros_like(batch.completion_mask)
    unmasked[:, P:] = batch.attention_mask[:, P:].bool()               # every token after the prompt
    assert batch.completion_mask.sum() == 12 and unmasked.sum() == 12 + len(ids(tok, "wrong\n37+85="))
    obj = P3O()
    real = obj(lp, batch.behavior_logprobs, batch.advantages, batch.completion_mask).loss
    wrong = obj(lp, batch.behavior_logprobs, batch.advantages, unmasked).loss
    # by hand, over the policy's tokens only: P3O = -mean(min(rho, e) lp A) + (1 - e) mean(k3)
    pos = batch.completion_mask.nonzero().tolist()
    x = [float(lp[b, t]) for b, t in pos]
    y = [float(batch.behavior_logprobs[b, t]) for b, t in pos]
    A = [float(batch.advantages[b]) for b, _ in pos]
    rho = [math.exp(a - b) for a, b in zip(x, y)]
    e = sum(rho) ** 2 / (len(rho) * sum(r * r for r in rho))
    pg = -sum(min(r, e) * a * adv for r, a, adv in zip(rho, x, A)) / len(x)
    kl = sum(math.exp(b - a) - 1 - (b - a) for a, b in zip(x, y)) / len(x)
    assert float(real) == pytest.approx(pg + (1 - e) * kl, abs=1e-6)
    assert abs(float(wrong) - float(real)) > 1e-2


# ---------------------------------------------------------------------------------------------------------
# e2e: vLLM samples multi-turn chat episodes; the trained sequence is the sampled one, ratio 1


class Recording(RolloutEngine):
    def __init__(self, engine):
        self.engine, self.calls = engine, []

    @property
    def version(self):
        return self.engine.version

    def generate(self, prompts, n, sampling, call_seed=0, prompt_keys=None):
        out = self.engine.generate(prompts, n, sampling, call_seed, prompt_keys)
        self.calls.append((prompts, n, prompt_keys, out))
        return out

    def load_weights(self, named_tensors, version):
        self.engine.load_weights(named_tensors, version)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    from lit_ess.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("chat") / "model", tokenizer="bpe_chat"))


@pytest.mark.e2e
def test_vllm_multiturn_chat_episodes_are_token_in_token_out(chat_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_ess.engines import VLLMConfig
    from lit_ess.logprobs import sequence_logprobs
    from lit_ess.objectives import batch_ess

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    engine = Recording(VLLMConfig(max_model_len=256).build(chat_model_dir))      # the module's one vLLM engine
    examples = Arithmetic(digits=2, size=4, seed=0).examples
    n, s = 4, SamplingConfig(temperature=1.0, max_new_tokens=6, seed=0)
    cfg = EnvConfig(env=partial(RetryArithmetic, max_tries=3), max_turns=3, max_episode_tokens=200)
    eps = EpisodeRunner(cfg, tok).run(engine, examples, n, s)
    assert sum(e.turns for e in eps) > len(eps)                       # multi-turn: a random model answers wrong

    # (a) the episode is the engine's sampled ids plus the template's deltas, token for token
    sampled: dict[int, list[list[int]]] = {i: [] for i in range(len(eps))}
    for turn, (prompts, m, keys, out) in enumerate(engine.calls):
        for k, p, g in zip(keys, prompts, out):
            for j, c in enumerate(g):
                e = k * n + j if turn == 0 else k
                assert p == eps[e].prompt_ids + eps[e].completion_ids[:len(p) - len(eps[e].prompt_ids)]
                sampled[e].append(c.token_ids)
    drift = 0
    for i, e in enumerate(eps):
        ex, want = examples[i // n], []
        for t, turn in enumerate(sampled[i]):
            want += turn
            if t < e.turns - 1:
                want += ([] if turn[-1] == tok.eos_token_id else [tok.eos_token_id]) + ids(
                    tok, f"\n<|im_start|>user\nwrong\n{ex.prompt}<|im_end|>\n<|im_start|>assistant\n")
        assert e.completion_ids == want and e.turns == len(sampled[i])
        # (b) re-encoding the decoded conversation would give other ids
        texts = [tok.decode(t, skip_special_tokens=True) for t in sampled[i]]
        drift += any(ids(tok, x) != [y for y in t if y not in tok.all_special_ids] for x, t in zip(texts, sampled[i]))
    assert drift >= 1

    # (c) the engine's logprob of every policy token is the trainer's at the same position: ratio 1
    batch = collate_episodes(eps, [1.0] * len(eps), list(range(len(eps))), [""] * len(eps), tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    m = batch.completion_mask
    gap = (lp - batch.behavior_logprobs)[m].abs().max().item()
    assert gap < 1e-4, gap
    assert (batch.behavior_logprobs[~m] == 0).all() and sum(e.env_tokens for e in eps) > 0
    assert batch_ess(lp - batch.behavior_logprobs, m).item() > 0.9999
