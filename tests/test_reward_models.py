"""Rewards that are models: a sequence-classification reward model (lit_ess.reward_model.RewardModel), checked
against the model's own forward, and an LLM judge through vLLM's OpenAI API (lit_ess.engines.LLMJudge) on ONE
real server for the module, launched by the judge itself (about 70 s here); then `lit-ess fit` with each."""
from __future__ import annotations

import json
import shutil
import math
import socket
import subprocess

import pytest
import torch

from e2e_utils import cli, cli_each, rl_config, scalars, write_config
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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_prompt_reaches_the_reward_model_as_its_own_conversation(rm_dir, tmp_path):
    """A conversation (system + user) is rendered message by message with the RM's template, the completion as
    the assistant's turn, not flattened to one '[system] ...\n[user] ...' user message; a text prompt is one
    user message."""
    import shutil

    from transformers import AutoTokenizer

    chat_dir = tmp_path / "rm_chat"
    shutil.copytree(rm_dir, chat_dir)
    tok = AutoTokenizer.from_pretrained(chat_dir)
    tok.chat_template = CHATML
    tok.save_pretrained(chat_dir)
    rm = RewardModel(str(chat_dir), batch_size=2)
    model, tok = rm.load()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    own = [model(**tok(tok.apply_chat_template(m + [{"role": "assistant", "content": "2"}], tokenize=False),
                       add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
           for m in (chat, [{"role": "user", "content": "3+3="}])]
    scorer = RewardScorer(rm)
    got = scorer(["2", "2"], ["", ""], ["[system] Be brief.\n[user] 1+1=", "3+3="], [{}, {}], [chat, None])
    assert got == pytest.approx(own, abs=1e-5)


def test_a_text_longer_than_the_reward_models_positions_keeps_its_end(rm_dir):
    """The tiny RM has 256 positions: a 400-byte text is scored on its last 256 tokens (the pooled last token
    kept), warned once and counted; shorter texts of the same batch are unchanged."""
    rm = RewardModel(rm_dir, chat_template=False, batch_size=2)
    model, tok = rm.load()
    long = "".join(chr(97 + i % 26) for i in range(400))
    with torch.no_grad():
        tail = model(input_ids=tok(long, return_tensors="pt")["input_ids"][:, -256:]).logits     # no special tokens
        short = model(**tok("ab", return_tensors="pt")).logits[0, 0].item()
    with pytest.warns(UserWarning, match=r"1 of 2 texts are longer than its 256 positions and keep their last 256"):
        assert rm(["", "a"], [long, "b"]) == pytest.approx([tail[0, 0].item(), short], abs=1e-5)
    assert rm.truncated == 1


def test_model_rewards_are_scored_in_this_process_beside_math_verify(rm_dir):
    """math_verify runs in the killable reward worker; the reward model of the same list is loaded and scored
    here (a timeout would otherwise kill and reload it); reward_limits.in_worker: true with a model reward is refused."""
    from lit_ess import reward_model

    reward_model._LOADED.clear()
    rm = RewardModel(rm_dir, chat_template=False)
    scorer = RewardScorer([Reward("math_verify"), Reward(rm, name="rm")])
    try:
        got = scorer(["$2$", "3"], ["2", "2"], ["1+1=", "1+1="])
        assert scorer._pool is not None and reward_model._LOADED            # the worker for math_verify; the RM here
        assert got == pytest.approx([1 + s for s in rm(["1+1="] * 2, ["$2$", "3"])][:1] + rm(["1+1="], ["3"]),
                                    abs=1e-5)
    finally:
        scorer.close()
    with pytest.raises(ValueError, match=r"^data.reward_limits.in_worker: true with RewardModel \(a model reward"):
        RewardScorer([Reward("gsm8k"), Reward(rm, name="rm")], in_worker=True)


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
    ({"url": None, "model": "Qwen/Qwen2.5-7B-Instruct"}, r"LLMJudge\.model='Qwen/Qwen2\.5-7B-Instruct' is not a "
                                                         r"folder: a launched judge \(url: null\) serves a model folder"),
    ({"api_key_env": "LIT_ESS_TEST_NO_SUCH_KEY"}, r"LLMJudge\.api_key_env='LIT_ESS_TEST_NO_SUCH_KEY': that "
                                                   r"environment variable is unset or empty"),
])
def test_judge_knobs_are_one_line(kwargs, says):
    with pytest.raises(ValueError, match="^" + says):
        LLMJudge(**{"model": "m", "url": "http://127.0.0.1:1", **kwargs})


def test_lit_ess_token_goes_to_a_launched_or_loopback_judge_only(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("LIT_ESS_SERVER_TOKEN", "secret")
    monkeypatch.setenv("JUDGE_KEY", "theirs")
    mine = {"Content-Type": "application/json", "Authorization": "Bearer secret"}
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/v1", "http://[::1]:8000"):
        assert LLMJudge(model="m", url=url).headers() == mine
    assert LLMJudge(model=tiny_model_dir).headers() == mine                     # launched by this process
    assert LLMJudge(model="m", url="https://api.example.com").headers() == {"Content-Type": "application/json"}
    assert LLMJudge(model="m", url="https://api.example.com", api_key_env="JUDGE_KEY").headers()["Authorization"] \
        == "Bearer theirs"


def test_a_judge_url_given_as_an_openai_base_url_is_its_server():
    assert LLMJudge(model="m", url="http://host:8000/v1/").server() == ("http://host:8000", "m")
    assert LLMJudge(model="m", url="http://host:8000/").server() == ("http://host:8000", "m")


def test_a_launched_judge_runs_on_this_ranks_gpu(monkeypatch, tiny_model_dir):
    """The trainer's rank on cuda:1 under CUDA_VISIBLE_DEVICES=4,5 launches its judge on GPU 5 alone; a rollout
    worker process launches it on the device placement names for its rank."""
    from lit_ess.engines import judge as module
    from lit_ess.engines import server_launch

    launched = []

    class Launched:
        url = "http://127.0.0.1:1"

        def wait_ready(self, timeout):
            return 0.0

    def launch(model, settings, host, port, log_file, serve=False, env=None):
        launched.append(env)
        return Launched()

    monkeypatch.setattr(server_launch, "launch", launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(module, "_SERVERS", {})
    LLMJudge(model=tiny_model_dir).warm_up()
    monkeypatch.setattr(module, "_SERVERS", {})
    monkeypatch.setenv(module.RANK_DEVICE_ENV, "7")
    LLMJudge(model=tiny_model_dir).warm_up()
    assert launched == [{"CUDA_VISIBLE_DEVICES": "5"}, {"CUDA_VISIBLE_DEVICES": "7"}]


def test_a_template_field_that_is_no_column_fails_at_start():
    with pytest.raises(ValueError, match=r"^LLMJudge\.template names \{levle\}, which is neither prompt, completion, "
                                         r"answer nor a column of the dataset \(columns: level, id\)$"):
        RewardScorer(LLMJudge(model="m", url="http://127.0.0.1:1", template="{prompt} {levle}"), columns=["level", "id"])
    RewardScorer(LLMJudge(model="m", url="http://127.0.0.1:1", template="{prompt} {level}"), columns=["level"])


def test_a_judge_that_refuses_the_connection_is_said_so_and_a_null_reply_has_no_score():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                     # bound, not listening: the connection is refused
        scorer = RewardScorer(LLMJudge(model="m", url=f"http://127.0.0.1:{port}"), max_error_rate=1.0)
        with pytest.warns(UserWarning, match=r"RuntimeError: the judge at http://127\.0\.0\.1:\d+ refused the "
                                             r"connection: no server listens there"):
            assert scorer(["a"], ["1"]) == [0.0]
    with pytest.raises(ValueError, match=r"no score in the judge's reply ''"):
        LLMJudge(model="m", url="http://127.0.0.1:1").parse(None)


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
    # the OpenAI client's base_url form, .../v1, is the same server
    by_base = LLMJudge(model=name, url=url + "/v1", chat=False, template=TEMPLATE, max_tokens=4, max_score=1.0,
                       extra_body=NUMBER)
    assert RewardScorer(by_base, columns=["level"])(completions, answers, prompts, rows) == [float(r) for r in replies]
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
    # printed, then run, in one process (e2e_utils.cli_each): one start of Lightning, not two
    shown, res = cli_each({"print": (["fit", "--config", str(path), "--print_config"], tmp_path),
                           "fit": (["fit", "--config", str(path)], tmp_path)}).values()
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "class_path: lit_ess.reward_model.RewardModel" in shown.stdout and "batch_size: 3" in shown.stdout
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


def test_the_rollout_worker_loads_a_model_reward_before_the_first_phase(tiny_model_dir, rm_dir, tmp_path):
    """The reward model is loaded (a judge's server launched) when the rank's rollout worker starts, not inside
    the first phase, whose scoring time would then hold the load (a judge's launch: about a minute); a model
    reward that cannot start stops the start in one line naming it."""
    from fake_engine import FakeConfig

    from lit_ess import reward_model
    from lit_ess.rollout import InlineExecutor, WorkerConfig
    from lit_ess.sampling import SamplingConfig

    def executor(reward):
        return InlineExecutor(WorkerConfig(model_path=tiny_model_dir, engine=FakeConfig(latency=0.0),
                                           samples_per_prompt=2, sampling=SamplingConfig(max_new_tokens=3, seed=0),
                                           reward=reward))

    reward_model._LOADED.clear()
    ex = executor(RewardModel(path=rm_dir, chat_template=False))
    ex.start()
    try:
        assert [key[0] for key in reward_model._LOADED] == [rm_dir]
    finally:
        ex.close()
    broken = RewardModel(path=rm_dir, chat_template=False)
    shutil.rmtree(tmp_path / "gone", ignore_errors=True)
    object.__setattr__(broken, "path", str(tmp_path / "gone"))      # its folder removed after the config was read
    with pytest.raises(RewardError, match="reward 'RewardModel' could not start: "):
        executor(broken).start()
