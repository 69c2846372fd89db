"""Rewards as users write them: parameters by name (prompt, completion, answer, the dataset's columns),
@batched rewards of lists (sync and async), weighted lists logged one scalar each, and a reward module
beside the config. Unit checks with hand-computed values, then `lit-ess fit` runs on the tiny model."""
from __future__ import annotations

import asyncio
import sys
import json
import math
import time
from pathlib import Path

import pytest
import torch

from e2e_utils import cli, rl_config, scalars, write_config
from lit_ess.datamodules import Arithmetic, HFPrompts, RolloutDataModule
from lit_ess.metrics import rule
from lit_ess.rewards import Reward, RewardError, RewardScorer, batched
from test_faults_input import one_line
from lit_ess.datamodules.settings import BatchShape, Schedule

ROWS = [{"prompt": "1+1=", "answer": "2", "level": "1", "source": "a"},
        {"prompt": "2+2=", "answer": "4", "level": "3", "source": "b"}]


def by_level(completion, answer, level):
    """The row's level / 4 when the completion is right, else 0."""
    return float(completion == answer) * int(level) / 4


def echo_prompt(prompt, completion):
    return float(prompt.startswith(completion))


def legacy(c, a):                      # the form of earlier releases: two positional parameters, any names
    return float(c == a)


def legacy_with_prompt(c, a, prompt=None):   # two positional, and an optional standard name: given when known
    return float(c == a) + (0.5 if prompt else 0.0)


def takes_all(completion, **columns):
    return float(len(columns))


def unknown_column(completion, difficulty):
    return 1.0


def per_sample_lists(completions):
    return 1.0


@batched
def batch_levels(prompts, completions, level):
    """One value per sample: its level plus the position of its prompt's first sample in the batch / 10."""
    return [int(lv) + prompts.index(p) / 10 for p, lv in zip(prompts, level)]


@batched
def batch_short(completions):
    return [1.0] * (len(completions) - 1)


@batched
def batch_nan(completions):
    return [float("nan")] + [1.0] * (len(completions) - 1)


@batched
async def batch_async(completions, answers):
    await asyncio.sleep(0.01)
    return [float(c == a) for c, a in zip(completions, answers)]


async def slow_async(completion):
    await asyncio.sleep(0.5)
    return 1.0


def _score(reward, completions, answers, prompts, rows, **kw):
    s = RewardScorer(reward, columns=["prompt", "answer", "level", "source"], **kw)
    return s(completions, answers, prompts, rows), s


def test_a_reward_takes_prompt_answer_and_columns_by_name():
    prompts, answers, rows = ["1+1=", "2+2="], ["2", "4"], ROWS
    assert _score("test_rewards:by_level", ["2", "4"], answers, prompts, rows)[0] == [0.25, 0.75]
    assert _score("test_rewards:by_level", ["2", "5"], answers, prompts, rows)[0] == [0.25, 0.0]
    assert _score("test_rewards:echo_prompt", ["1+", "x"], answers, prompts, rows)[0] == [1.0, 0.0]
    assert _score("test_rewards:legacy", ["2", "5"], answers, prompts, rows)[0] == [1.0, 0.0]
    assert _score("test_rewards:legacy_with_prompt", ["2", "5"], answers, prompts, rows)[0] == [1.0, 0.0]
    assert _score("test_rewards:takes_all", ["2", "5"], answers, prompts, rows)[0] == [4.0, 4.0]   # every column
    assert _score("test_rewards.by_level", ["2", "4"], answers, prompts, rows)[0] == [0.25, 0.75]  # module.function


def test_an_unknown_parameter_is_refused_in_one_line_naming_the_columns(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ValueError) as e:
        RolloutDataModule(source=HFPrompts(str(data)), reward="test_rewards:unknown_column")
    assert str(e.value) == ("reward 'test_rewards:unknown_column': parameter 'difficulty' is neither prompt, completion, "
                            "answer nor a column of the dataset (columns: prompt, answer, level, source)")
    with pytest.raises(ValueError, match=r"parameter 'completions' .*declared with @lit_ess.rewards.batched"):
        RolloutDataModule(source=HFPrompts(str(data)), reward="test_rewards:per_sample_lists")
    with pytest.raises(ValueError, match=r"parameter 'level' .*\(columns: none\)"):       # arithmetic has no columns
        RolloutDataModule(source=Arithmetic(size=10), reward="test_rewards:by_level")
    RolloutDataModule(source=HFPrompts(str(data)), reward="test_rewards:by_level")     # a column: accepted


def test_prompt_sources_carry_the_rows_columns(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    src = HFPrompts(str(data), template="Q: {prompt}")
    assert [(e.prompt, e.answer, e.columns["level"]) for e in src.examples] == [("Q: 1+1=", "2", "1"), ("Q: 2+2=", "4", "3")]


def test_a_batched_reward_gets_lists_and_returns_one_value_per_sample():
    prompts, rows = ["1+1=", "1+1=", "2+2=", "2+2="], [ROWS[0], ROWS[0], ROWS[1], ROWS[1]]
    scores, _ = _score("test_rewards:batch_levels", ["x"] * 4, ["2", "2", "4", "4"], prompts, rows)
    assert scores == pytest.approx([1.0, 1.0, 3.2, 3.2])
    scores, _ = _score("test_rewards:batch_async", ["2", "3", "4", "4"], ["2", "2", "4", "4"], prompts, rows)
    assert scores == [1.0, 0.0, 1.0, 1.0]
    scores, s = _score("test_rewards:batch_levels", ["x"] * 4, ["2", "2", "4", "4"], prompts, rows, in_worker=True)
    s.close()
    assert scores == pytest.approx([1.0, 1.0, 3.2, 3.2])                # reward_in_worker: the same, in a process


def test_a_wrong_length_or_non_finite_batch_is_counted_never_nan():
    with pytest.warns(UserWarning, match=r"reward 'test_rewards:batch_short' failed on a completion \(returned 3 values "
                                         r"for 4 completions\)"):
        scores, s = _score("test_rewards:batch_short", ["x"] * 4, ["1"] * 4, ["p"] * 4, [{}] * 4, max_error_rate=1.0)
    assert scores == [0.0] * 4 and s.errors == 4
    with pytest.warns(UserWarning, match="returned nan"):
        scores, s = _score("test_rewards:batch_nan", ["x"] * 4, ["1"] * 4, ["p"] * 4, [{}] * 4, max_error_rate=1.0)
    assert scores == [0.0, 1.0, 1.0, 1.0] and s.errors == 1 and all(math.isfinite(x) for x in scores)
    with pytest.raises(RewardError, match=r"'test_rewards:batch_short' failed on 4 of 4 completions"):
        _score("test_rewards:batch_short", ["x"] * 4, ["1"] * 4, ["p"] * 4, [{}] * 4)


def test_async_per_sample_rewards_run_concurrently():
    t0 = time.perf_counter()
    scores, _ = _score("test_rewards:slow_async", ["x"] * 8, ["1"] * 8, ["p"] * 8, [{}] * 8)
    assert scores == [1.0] * 8 and time.perf_counter() - t0 < 3.0          # 8 x 0.5 s one after another: 4 s


def test_a_weighted_list_is_the_weighted_sum_and_keeps_each_part():
    rewards = [Reward("test_rewards:by_level", weight=0.5), Reward("test_rewards:legacy", weight=2.0, name="exact")]
    scores, s = _score(rewards, ["2", "5"], ["2", "4"], ["1+1=", "2+2="], ROWS)
    assert scores == [0.5 * 0.25 + 2.0 * 1.0, 0.0]
    assert s.parts == {"by_level": 0.125, "exact": 0.5}          # each one's mean, unweighted
    with pytest.raises(ValueError, match=r"same train/reward/NAME \(\['legacy', 'legacy'\]\)"):
        RewardScorer(["test_rewards:legacy", "test_rewards:legacy"])
    with pytest.raises(ValueError, match="Reward.weight must be a finite number, got nan"):
        RewardScorer([Reward("test_rewards:legacy", weight=float("nan"))])
    assert rule("train/reward/by_level") == rule("rollout/reward_mean")


def async_phase_stats(model_dir: str, reward, **data) -> dict:
    """The statistics of the first phase of an async data module (the fake engine, 2 prompts x 2 samples)."""
    from fake_engine import FakeConfig
    from lit_ess.sampling import SamplingConfig

    dm = RolloutDataModule(model_path=model_dir, engine=FakeConfig(latency=0.0), schedule=Schedule(mode="async"), batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2), sampling=SamplingConfig(max_new_tokens=3, seed=0), reward=reward, **data)
    dm.setup("fit")
    try:
        dm.push_weights({"w": torch.zeros(1)}.items(), 0)
        return dm.next_batch(0).stats
    finally:
        dm.teardown("fit")


def test_async_worker_scores_columns_and_batches(tiny_model_dir, tmp_path):
    """The worker process gets each prompt's row and the weighted list: the phase's parts and total by hand."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({**r, "level": "2"}) + "\n" for r in ROWS))
    stats = async_phase_stats(tiny_model_dir, [Reward("test_rewards:takes_all", 0.5), Reward("test_rewards:batch_levels", 1.0)],
                              source=HFPrompts(str(data)))
    # takes_all: 4 columns; batch_levels: level 2 + the first sample's position of its prompt (0 or 2) / 10
    assert stats["train/reward/takes_all"] == 4.0 and stats["train/reward/batch_levels"] == pytest.approx(2.1)
    assert stats["rollout/reward_mean"] == pytest.approx(0.5 * 4.0 + 2.1)


@pytest.mark.e2e
def test_fit_with_a_reward_file_beside_the_config_and_a_weighted_list(tiny_model_dir, tmp_path):
    """`lit-ess fit` from another folder: my_reward.py beside configs/x.yaml imports as my_reward.score, a
    column reaches it, a batched reward runs beside it, and each reward has its own TensorBoard scalar.
    (main: "reward 'my_reward:score' cannot be imported: No module named 'my_reward'")"""
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "my_reward.py").write_text(
        "from lit_ess.rewards import batched\n\n\n"
        "def score(completion, answer, level):\n    return int(level) / 4\n\n\n"
        "@batched\ndef ones(prompts, completions):\n    return [1.0 for _ in completions]\n")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "level": "2"}) + "\n" for i in range(8)))
    cfg = rl_config(tiny_model_dir, tmp_path / "out", engine="HFConfig", max_steps=2, prompts=2, samples=2, extra_data={
        "source": {"class_path": "lit_ess.datamodules.HFPrompts", "init_args": {"path": str(data)}},
        "reward": [{"fn": "my_reward.score", "weight": 0.5}, {"fn": "my_reward.ones", "weight": 2.0, "name": "format"}]})
    res = cli(["fit", "--config", str(write_config(cfg, configs / "x.yaml"))], cwd=tmp_path / "elsewhere")
    assert res.returncode == 0, res.stderr[-3000:]
    got = scalars(tmp_path / "out")
    assert [v for _, v in got["train/reward/score"]] == [0.5, 0.5]
    assert [v for _, v in got["train/reward/format"]] == [1.0, 1.0]
    assert [v for _, v in got["rollout/reward_mean"]] == [0.5 * 0.5 + 2.0 * 1.0] * 2


def test_a_missing_reward_module_says_where_it_looked(tiny_model_dir, tmp_path):
    configs = tmp_path / "configs"
    cfg = rl_config(tiny_model_dir, tmp_path / "out", engine="HFConfig", extra_data={"reward": "my_reward.score"})
    res = cli(["fit", "--config", str(write_config(cfg, configs / "x.yaml"))], cwd=tmp_path)
    assert one_line(res) == (
        f"lit-ess: error: reward 'my_reward.score' cannot be imported: no module named 'my_reward' in {configs}, "
        f"{tmp_path} or the installed packages: put my_reward.py beside the config (or in the working directory), "
        f"or install its package")


def test_the_docs_reward_file_scores_as_the_page_says(tmp_path, monkeypatch):
    """docs/rewards.md's file to copy and its config's list, as a user pastes them."""
    import re

    import yaml

    page = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text()
    code, config = re.findall(r"```python\n(.*?)```", page, re.S)[0], re.findall(r"```yaml\n(.*?)```", page, re.S)[0]
    (tmp_path / "my_reward.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)    # another test's my_reward.py (docs/own-task.md's)
    rewards = [Reward(**r) for r in yaml.safe_load(config)["data"]["init_args"]["reward"]]
    s = RewardScorer(rewards, columns=["prompt", "answer", "difficulty"])
    rows = [{"prompt": "p", "answer": "42", "difficulty": "3"}] * 2
    assert s(["so 42", "41"], ["42", "42"], ["p", "p"], rows) == pytest.approx([1.3 + 0.1 * (1 - 5 / 200), 0.1 * (1 - 2 / 200)])
    assert s.parts == pytest.approx({"by_difficulty": 0.65, "length": (0.975 + 0.99) / 2})


class _Verifier:
    """A tiny HTTP reward server on a free port: POST / answers each completion's length; /one 1.0 for
    each; /slow sleeps past the timeout; /broken answers 500; /short one value too few. `bodies`: what
    it got."""

    def __init__(self):
        import http.server
        import threading

        bodies = self.bodies = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                if self.path == "/slow":
                    time.sleep(3)                     # the client has given up: nothing to answer
                    return
                if self.path == "/broken":
                    self.send_error(500, "verifier crashed")
                    return
                rewards = [float(len(c)) for c in body["completions"]][: -1 if self.path == "/short" else None]
                rewards = [1.0] * len(body["completions"]) if self.path == "/one" else rewards
                out = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def verifier():
    v = _Verifier()
    yield v
    v.close()


def test_a_reward_by_url_posts_the_batch_and_counts_failures(verifier):
    rows = [ROWS[0], ROWS[0], ROWS[1]]
    s = RewardScorer([Reward(verifier.url, weight=0.5), Reward("test_rewards:legacy")], timeout=0.5, max_error_rate=1.0,
                     columns=["prompt", "answer", "level", "source"])
    assert s(["2", "22", "4"], ["2", "2", "4"], ["1+1=", "1+1=", "2+2="], rows) == [0.5 + 1.0, 1.0 + 0.0, 0.5 + 1.0]
    assert s.parts == pytest.approx({"remote": 4 / 3, "legacy": 2 / 3}) and s.errors == 0
    assert verifier.bodies == [{"prompts": ["1+1=", "1+1=", "2+2="], "completions": ["2", "22", "4"],
                                "answers": ["2", "2", "4"], "prompt": ["1+1=", "1+1=", "2+2="], "answer": ["2", "2", "4"],
                                "level": ["1", "1", "3"], "source": ["a", "a", "b"]}]
    for path, says in [("/broken", "HTTP 500"), ("/slow", "did not answer"), ("/short", "returned 2 values for 3")]:
        s = RewardScorer(verifier.url + path, timeout=0.5, max_error_rate=1.0)
        with pytest.warns(UserWarning, match=f"reward '{verifier.url}{path}' failed on a completion .*{says}"):
            assert s(["a", "bb", "c"], ["1", "1", "1"]) == [0.0, 0.0, 0.0]
        assert s.errors == 3


@pytest.mark.e2e
def test_fit_with_a_reward_by_url(tiny_model_dir, tmp_path, verifier):
    """`lit-ess fit` posts each phase's completions to the server once, and logs its reward on its own."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=2, prompts=2, samples=2, extra_data={
        "reward": [{"fn": verifier.url + "/one", "name": "verifier"}, {"fn": "e2e_utils:digit_fraction", "weight": 0.0}]})
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "x.yaml"))], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [len(b["completions"]) for b in verifier.bodies] == [4, 4]          # 2 prompts x 2 samples, per phase
    got = scalars(tmp_path)
    assert [v for _, v in got["train/reward/verifier"]] == [1.0, 1.0]
    assert [v for _, v in got["rollout/reward_mean"]] == [1.0, 1.0]           # digit_fraction weighs 0
    assert [v for _, v in got["rollout/reward_errors"]] == [0.0, 0.0]
