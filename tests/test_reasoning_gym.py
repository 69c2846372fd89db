"""reasoning-gym tasks as a prompt source (lit_ess.datamodules.ReasoningGym) scored by each task's own
verifier (reward `reasoning_gym`): the source's refusals, the reward against the task's `score_answer`, and
configs/demo_reasoning_gym.yaml run by `lit-ess fit` for a few steps on the tiny model. Skipped without
the `envs` extra (scripts/setup.sh installs it)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed: pip install 'lit-ess[envs]'")

from e2e_utils import cli, scalars, write_config  # noqa: E402

from lit_ess.datamodules import ReasoningGym  # noqa: E402
from lit_ess.rewards import RewardScorer  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_examples_carry_the_tasks_entry_and_answer():
    import reasoning_gym

    src = ReasoningGym("chain_sum", {"max_terms": 2, "max_digits": 2}, size=6, seed=3, template="Q: {question}")
    ref = reasoning_gym.create_dataset("chain_sum", max_terms=2, max_digits=2, size=6, seed=3)
    assert len(src) == 6 and src.skipped == 0
    for i, ex in enumerate(src.examples):
        assert ex.prompt == "Q: " + ref[i]["question"] and ex.answer == ref[i]["answer"]
        assert ex.columns["entry"] == ref[i]
        assert ex.columns["task"] == {"name": "chain_sum", "config": {"max_terms": 2, "max_digits": 2, "size": 6,
                                                                     "seed": 3}, "answer_tag": "answer"}


def test_the_reward_is_the_tasks_own_verifier():
    """What the task's score_answer says, partial credit included; the answer tag is extracted first."""
    import reasoning_gym

    src = ReasoningGym("word_ladder", size=4, seed=0)
    ref = reasoning_gym.create_dataset("word_ladder", size=4, seed=0)
    scorer = RewardScorer("reasoning_gym", columns=list(src.examples[0].columns))
    rows = [e.columns for e in src.examples]
    right = src.examples[0].answer
    wrong_start = ",".join(["XXXX", *right.split(",")[1:]])
    completions = [f"think first <answer>{right}</answer>", right, f"<answer>{wrong_start}</answer>",
                   "<answer>no</answer>"]
    got = scorer(completions, [e.answer for e in src.examples[:1]] * 4, rows=rows[:1] * 4)
    want = [ref.score_answer(a, ref[0]) for a in (right, None, wrong_start, "no")]
    assert got == want and got[0] == 1.0 and got[1] == 0.0      # no tag: no answer
    bare = ReasoningGym("chain_sum", size=2, answer_tag=None)
    scorer = RewardScorer("reasoning_gym", columns=["entry", "task"])
    e = bare.examples[0]
    got = scorer([f"  {e.answer}\n", e.answer + "0", "x"], [e.answer] * 3, rows=[e.columns] * 3)
    assert got == [1.0, len(e.answer) / (len(e.answer) + 1), 0.0]    # chain_sum's partial credit: the answer inside


@pytest.mark.parametrize("kwargs, message", [
    ({"task": "chain_sun"}, "'chain_sun' is not a reasoning-gym task; did you mean 'chain_sum'"),
    ({"task": "chain_sum", "config": {"max_term": 2}}, "'max_term' is not a setting of task 'chain_sum'; did you mean 'max_terms'?"),
    ({"task": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}, "reasoning-gym refuses it: max_terms must be >= min_terms"),
    ({"task": "chain_sum", "config": {"seed": 1}}, "ReasoningGym.config.seed: set ReasoningGym.seed instead"),
    ({"task": "chain_sum", "size": 0}, "ReasoningGym.size must be an integer >= 1, got 0"),
    ({"task": "chain_sum", "template": "{q}"}, "is not a format string of {question} alone"),
    ({"task": "chain_sum", "template": "Solve it."}, "leaves out {question}"),
    ({"task": "chain_sum", "answer_tag": "<answer>"}, "ReasoningGym.answer_tag must be a tag name"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match="^ReasoningGym") as e:
        ReasoningGym(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_reward_needs_the_sources_columns():
    with pytest.raises(ValueError, match="it scores prompts of lit_ess.datamodules.ReasoningGym"):
        RewardScorer("reasoning_gym", columns=["prompt", "answer"])


@pytest.mark.e2e
def test_demo_reasoning_gym_trains_on_the_tasks_verdicts(tiny_model_dir, tmp_path):
    """configs/demo_reasoning_gym.yaml, smaller (8 prompts x 4 samples, 3 steps, no validation), on the tiny
    model: `lit-ess fit` samples the task's prompts with vLLM, scores them with the task's verifier and trains
    on-policy."""
    cfg = yaml.safe_load((CONFIGS / "demo_reasoning_gym.yaml").read_text())
    cfg["model"]["init_args"]["model_path"] = tiny_model_dir
    d = cfg["data"]["init_args"]
    d["batch"].update(prompts_per_rollout=8, samples_per_prompt=4)
    d["source"]["init_args"]["size"] = 64
    d.pop("validation")
    t = cfg["trainer"]
    t.update(max_steps=3, enable_progress_bar=False, enable_checkpointing=False)
    t.pop("check_val_every_n_epoch")
    cfg["output_dir"] = None            # the paths below are the test's own
    t["logger"] = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                   "init_args": {"save_dir": str(tmp_path), "name": "tb", "version": "run"}}
    t["callbacks"] = [c for c in t["callbacks"] if c["class_path"].endswith(("WeightSync", "RatioDashboard"))]
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    ess, rewards = [v for _, v in s["train/ess"]], [v for _, v in s["rollout/reward_mean"]]
    assert len(ess) == 3 and min(ess) >= 0.9999, ess
    assert len(rewards) == 3 and all(0.0 <= r <= 1.0 for r in rewards), rewards
    assert max(v for _, v in s["rollout/reward_errors"]) == 0
