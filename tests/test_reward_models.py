"""Rewards that are models: a sequence-classification reward model (lit_ess.reward_model.RewardModel), checked
against the model's own forward, and an LLM judge through vLLM's OpenAI API (lit_ess.engines.LLMJudge) on ONE
real server for the module, launched by the judge itself (about 70 s here); then `lit-ess fit` with each."""
from __future__ import annotations

import json
import math
import socket
import subprocess

import pytest
import torch

from e2e_utils import cli, rl_config, scalars, write_config
from lit_ess.engines import LLMJudge
from lit_ess.reward_model import RewardModel
from lit_ess.rewards import Reward, RewardError, RewardScorer

PROMPTS = ["1+1=", "22+33=", "7*8=", "a", "a longer prompt than the others "]
COMPLETIONS = ["2", "55 and more", "", "bcdef", "x" * 40]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from lit_ess.tiny import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm"))


def test_reward_model_scores_are_the_models_own_logit_batched_or_not(rm_dir):
    """Each text alone through the model (no padding) is the reference; batches of 3 texts of unequal lengths
    (right padding, pooled at the last real token) give the same numbers, and so do batches of 1."""
    batched = RewardModel(rm_dir, chat_template=False, batch_size=3)
    model, tok = batched.load()
    with torch.no_grad():
        own = [model(**tok(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(PROMPTS, COMPLETIONS)]
    assert len(set(own)) == len(own)                       # a model that scores every text alike would pass anything
    assert batched(PROMPTS, COMPLETIONS) == pytest.approx(own, abs=1e-5)
    assert RewardModel(rm_dir, chat_template=False, batch_size=1)(PROMPTS, COMPLETIONS) == pytest.approx(own, abs=1e-6)
    assert tok.padding_side == "right" and model.config.pad_token_id == tok.pad_token_id
    assert RewardModel(rm_dir, chat_template=False).load()[0] is model              # loaded once per process
    s = RewardScorer([Reward(batched, weight=2.0, name="rm")])
    assert s(COMPLETIONS, [""] * 5, PROMPTS) == pytest.approx([2 * x for x in own], abs=1e-5)
    assert s.parts["rm"] == pytest.approx(sum(own) / 5, abs=1e-5)


def test_reward_model_refusals_are_one_line(rm_dir, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"^RewardModel\.batch_size must be an integer >= 1, got 0$"):
        RewardModel(rm_dir, batch_size=0)
    with pytest.raises(ValueError, match=r"^RewardModel\.path="):
        RewardModel(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"has no chat template: set RewardModel\.chat_template: false"):
        RewardModel(rm_dir)(["p"], ["c"])
    with pytest.raises(ValueError, match=r"has 2 labels: a reward model gives one score per text"):
        RewardModel(tiny_model_dir, chat_template=False)(["p"], ["c"])           # a causal LM, not a reward model


def test_judge_parse_rule():
    j = LLMJudge(model="m", url="http://127.0.0.1:1")
    assert j.parse("I give it 7/10. Score: 8") == pytest.approx(0.8)          # the last number, / max_score 10
    with pytest.raises(ValueError, match=r"the judge's score 12 is outside \[0, 10\]"):
        j.parse("Score: 12")
    with pytest.raises(ValueError, match=r"no score in the judge's reply 'great'"):
        j.parse("great")
    g = LLMJudge(model="m", url="http://127.0.0.1:1", score_regex=r"\[\[(\d)\]\]", max_score=5)
    assert g.parse("step 1, 2: [[4]] then 3") == pytest.approx(0.8)          # its group, not the last number


@pytest.mark.parametrize("kwargs, says", [
    ({"max_score": 0}, r"LLMJudge\.max_score must be > 0, got 0"),
    ({"concurrency": 0}, r"LLMJudge\.concurrency must be an integer >= 1, got 0"),
    ({"request_timeout": -1}, r"LLMJudge\.request_timeout must be > 0, got -1"),
    ({"score_regex": "(("}, r"LLMJudge\.score_regex='\(\(' is not a regular expression"),
    ({"template": "{prompt} {0}"}, r"LLMJudge\.template: \{0\} is not a name"),
    ({"template": "{prompt"}, r"LLMJudge\.template is not a format string"),
    ({"url": "localhost:8000"}, r"LLMJudge\.url='localhost:8000' is not an http\(s\):// URL"),
])
def test_judge_knobs_are_one_line(kwargs, says):
    with pytest.raises(ValueError, match="^" + says):
        LLMJudge(**{"model": "m", "url": "http://127.0.0.1:1", **kwargs})


def test_a_judge_that_never_answers_is_a_counted_timeout_error():
    """A port that accepts connections and never answers: each request fails after request_timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        j = LLMJudge(model="m", url=f"http://127.0.0.1:{s.getsockname()[1]}", request_timeout=0.5)
        scorer = RewardScorer(j, max_error_rate=1.0)
        with pytest.warns(UserWarning, match=r"reward 'LLMJudge' failed on a completion .*did not answer within 0.5 s"):
            assert scorer(["a", "b"], ["1", "1"]) == [0.0, 0.0]
    assert scorer.errors == 2


# ---- one real judge server for the module, launched by LLMJudge itself ----

TEMPLATE = "Q {prompt} A {completion} L {level} S "
NUMBER = {"structured_outputs": {"regex": "0\\.[0-9]"}}      # vLLM's structured outputs: a reply that parses


@pytest.fixture(scope="module")
def judge(tiny_model_dir):
    """(URL, model name) of the judge server launched by `LLMJudge(url=None).server()`; stopped at the end."""
    from lit_ess.engines import judge as module

    j = LLMJudge(model=tiny_model_dir, chat=False, dtype="float32", max_model_len=256)
    url, name = j.server()
    yield url, name
    for got in list(module._SERVERS.values()):
        if not isinstance(got, Exception):
            got[2].stop()
    module._SERVERS.clear()


def _reply(url: str, name: str, text: str) -> str:
    import urllib.request

    body = {"model": name, "prompt": text, "max_tokens": 4, "temperature": 0.0, **NUMBER}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_a_judge_reply_that_parses_is_its_score_and_one_that_does_not_is_a_counted_error(judge):
    url, name = judge
    rows = [{"level": "1"}, {"level": "2"}, {"level": "3"}]
    prompts, completions, answers = ["1+1=", "2+2=", "3+3="], ["2", "5", "six"], ["2", "4", "6"]
    # the same requests by hand: the template filled with the sample and its column, greedy
    replies = [_reply(url, name, TEMPLATE.format(prompt=p, completion=c, level=r["level"]))
               for p, c, r in zip(prompts, completions, rows)]
    parses = LLMJudge(model=name, url=url, chat=False, template=TEMPLATE, max_tokens=4, max_score=1.0, extra_body=NUMBER)
    scorer = RewardScorer([Reward(parses, name="judge")], columns=["level"])
    assert scorer(completions, answers, prompts, rows) == [float(r) for r in replies]
    assert scorer.errors == 0 and scorer.parts["judge"] == pytest.approx(sum(map(float, replies)) / 3)
    # without structured outputs the random model's replies carry no 'Score: N': each one a counted error
    never = LLMJudge(model=name, url=url, chat=False, template=TEMPLATE, max_tokens=4, score_regex=r"Score: (\d+)")
    scorer = RewardScorer(never, columns=["level"], max_error_rate=1.0)
    with pytest.warns(UserWarning, match=r"reward 'LLMJudge' failed on a completion \(ValueError: no score in the "
                                         r"judge's reply"):
        assert scorer(completions, answers, prompts, rows) == [0.0, 0.0, 0.0]
    assert scorer.errors == 3
    with pytest.warns(UserWarning), pytest.raises(RewardError, match=r"reward 'LLMJudge' failed on 3 of 3 completions"):
        RewardScorer(never, columns=["level"])(completions, answers, prompts, rows)
    # HTTP errors: the tiny model has no chat template (chat: true), and a model the server does not serve
    for bad in (LLMJudge(model=name, url=url, template=TEMPLATE), LLMJudge(model="nope", url=url, chat=False)):
        scorer = RewardScorer(bad, columns=["level"], max_error_rate=1.0)
        with pytest.warns(UserWarning, match=r"RuntimeError: the judge at .* answered HTTP 4\d\d"):
            assert scorer(completions, answers, prompts, rows) == [0.0, 0.0, 0.0]
        assert scorer.errors == 3


# ---- `lit-ess fit` with each ----

@pytest.mark.e2e
def test_fit_with_a_reward_model(tiny_model_dir, rm_dir, tmp_path):
    """`data.reward: {class_path: lit_ess.reward_model.RewardModel, ...}` alone: shown by --print_config, logged as
    train/reward/reward_model, finite, and the same number as rollout/reward_mean (its only reward)."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=2, samples=2, extra_data={
        "reward": {"class_path": "lit_ess.reward_model.RewardModel",
                   "init_args": {"path": rm_dir, "chat_template": False, "batch_size": 3}}})
    path = write_config(cfg, tmp_path / "x.yaml")
    shown = cli(["fit", "--config", str(path), "--print_config"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "class_path: lit_ess.reward_model.RewardModel" in shown.stdout and "batch_size: 3" in shown.stdout
    res = cli(["fit", "--config", str(path)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got = scalars(tmp_path)
    rm = [v for _, v in got["train/reward/reward_model"]]
    assert len(rm) == 2 and all(math.isfinite(v) and v != 0 for v in rm)
    assert rm == pytest.approx([v for _, v in got["rollout/reward_mean"]], abs=1e-6)
    assert [v for _, v in got["rollout/reward_errors"]] == [0.0, 0.0]


@pytest.mark.e2e
def test_fit_with_an_llm_judge_by_url(tiny_model_dir, tmp_path, judge):
    """A weighted list holding the judge (the module's server by URL): train/reward/judge is each phase's
    mean of numbers the structured output makes parse, in [0, 1), with no reward error."""
    url, name = judge
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=2, samples=2, extra_data={
        "reward": [{"fn": {"class_path": "lit_ess.engines.LLMJudge", "init_args": {
                        "model": name, "url": url, "chat": False, "template": "Q {prompt} A {completion} S ",
                        "max_tokens": 4, "max_score": 1.0, "extra_body": NUMBER}}, "weight": 0.5},
                   {"fn": "e2e_utils:digit_fraction", "weight": 0.0}]})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "x.yaml"))], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got = scalars(tmp_path)
    judged = [v for _, v in got["train/reward/judge"]]
    assert len(judged) == 2 and all(0 <= v < 1 for v in judged)
    assert [v for _, v in got["rollout/reward_mean"]] == pytest.approx([0.5 * v for v in judged])
    assert [v for _, v in got["rollout/reward_errors"]] == [0.0, 0.0]



def test_the_docs_snippets_build_the_rewards_they_name(rm_dir):
    """docs/rewards.md's reward model and judge configs, as a user pastes them: every class_path builds with its
    init_args (the hub name swapped for the tiny folder), and the judge's rule reads the reply it asks for."""
    import re
    from pathlib import Path

    import yaml

    from lit_ess.rewards import import_named

    page = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", page, re.S)]
    specs = [b["data"]["init_args"]["reward"] for b in blocks if "data" in b and isinstance(b["data"]["init_args"]["reward"], dict)]
    specs += [r["fn"] for b in blocks if "reward" in b for r in b["reward"] if isinstance(r["fn"], dict)]
    built = [import_named(s["class_path"], "reward")(**{**s["init_args"], **({"path": rm_dir} if "path" in s["init_args"]
                                                                              else {})}) for s in specs]
    assert sorted(type(b).__name__ for b in built) == ["LLMJudge", "RewardModel", "RewardModel"]
    judge = next(b for b in built if isinstance(b, LLMJudge))
    assert judge.parse("Clear and right. Score: 9") == pytest.approx(0.9)
    assert {"{prompt}", "{answer}", "{completion}"} <= set(re.findall(r"\{\w+\}", judge.template))


def test_async_mode_loads_the_reward_model_in_the_worker_process(tiny_model_dir, rm_dir):
    """mode: async: the config travels to the rollout worker process, which loads the model and scores; the
    trainer's process never loads it."""
    from lit_ess import reward_model
    from test_rewards import async_phase_stats

    reward_model._LOADED.clear()
    stats = async_phase_stats(tiny_model_dir, RewardModel(rm_dir, chat_template=False, batch_size=3))
    assert math.isfinite(stats["train/reward/reward_model"]) and stats["train/reward/reward_model"] != 0
    assert stats["rollout/reward_mean"] == pytest.approx(stats["train/reward/reward_model"])
    assert reward_model._LOADED == {}
