"""A `verifiers` environment played token in, token out (lit_ess.envs.verifiers_env, lit_ess.datamodules.
VerifiersTasks): the env's own multi-turn run() through the episode runner's turns, its rubric as the reward,
and configs/demo_verifiers.yaml run by `lit-ess fit` for a few steps on a tiny model with a chat template.
Skipped without the `envs` extra (scripts/setup.sh installs it)."""
from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import yaml

pytest.importorskip("verifiers.v1", reason="verifiers is not installed: pip install 'lit-ess[envs]'")

from e2e_utils import cli, scalars, short_run, write_config  # noqa: E402

from lit_ess.envs.base import Action  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ENV = {"taskset": {"id": "vf_retry_arithmetic", "size": 6, "seed": 0}, "max_tries": 3, "player": {"max_turns": 3}}


@pytest.fixture(scope="module")
def tasks():
    """configs/vf_retry_arithmetic.py's tasks as the prompt source gives them (its module found beside the
    config, as the CLI finds it)."""
    import sys

    sys.path.insert(0, str(CONFIGS))
    from lit_ess.datamodules import VerifiersTasks
    from lit_ess.envs.verifiers_env import load

    yield VerifiersTasks(ENV, limit=4), list(load(ENV)[1].values())
    sys.path.remove(str(CONFIGS))


def play(example, replies, max_turns=3):
    from lit_ess.envs.verifiers_env import Verifiers

    env = Verifiers(max_turns=max_turns)
    seen = [env.reset(example)]
    steps = []
    for reply in replies:
        steps.append(env.step(Action(reply, [1], "stop")))
        if steps[-1].done:
            break
        seen.append(steps[-1].observation)
    env.close()
    return seen, steps


def test_the_envs_own_run_holds_the_turns_and_its_rubric_scores(tasks):
    src, vf_tasks = tasks
    assert [e.columns["verifiers_task"] for e in src.examples] == [t.key for t in vf_tasks[:4]]     # by key, not position
    assert [e.prompt for e in src.examples] == [t.data.prompt for t in vf_tasks[:4]]
    ex, task = src.examples[1], vf_tasks[1]
    seen, steps = play(ex, ["7", task.data.answer, "never asked"])
    assert seen == [[{"role": "user", "content": task.data.prompt}], [{"role": "user", "content": f"wrong, {task.data.prompt}"}]]
    assert [s.done for s in steps] == [False, True] and steps[-1].reward == 0.5          # the rubric: right at try 2
    _, steps = play(ex, ["1", "2", "3"])
    assert [s.done for s in steps] == [False, False, True] and steps[-1].reward == 0.0   # max_tries 3, none right
    _, steps = play(ex, ["1"], max_turns=1)                       # the adapter's limit ends run(), which scores
    assert steps[0].done and steps[0].reward == 0.0


def test_an_example_of_another_source_is_refused(tasks):
    from lit_ess.envs.base import Example
    from lit_ess.envs.verifiers_env import Verifiers

    with pytest.raises(ValueError, match="use lit_ess.datamodules.VerifiersTasks as data.source"):
        Verifiers().reset(Example("1+1=", "2"))
    with pytest.raises(ValueError, match="Verifiers.max_turns must be an integer >= 1"):
        Verifiers(max_turns=0)


def test_a_taskset_verifiers_cannot_load_is_one_line():
    from lit_ess.datamodules import VerifiersTasks

    with pytest.raises(ValueError, match="^verifiers cannot load the environment .*no_such_taskset") as e:
        VerifiersTasks({"taskset": {"id": "no_such_taskset"}})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="VerifiersTasks.env must be a verifiers env config with a taskset id"):
        VerifiersTasks({"player": {}})


@pytest.mark.e2e
def test_demo_verifiers_runs_the_envs_turns_on_policy(tmp_path):
    """configs/demo_verifiers.yaml, smaller (4 prompts x 4 episodes, 2 steps), on a tiny model with a chat
    template: three policy turns per episode (a random model never answers right), the feedback's tokens
    are context, and every step is on-policy: the trainer scores the ids the engine sampled."""
    from lit_ess.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "chat_init", tokenizer="bpe_chat")
    cfg = yaml.safe_load((CONFIGS / "demo_verifiers.yaml").read_text())
    cfg["model"]["init_args"]["model_path"] = str(model)
    d = cfg["data"]["init_args"]
    d["batch"].update(prompts_per_rollout=4, samples_per_prompt=4)
    d["source"]["init_args"]["env"]["taskset"]["size"] = 50
    short_run(cfg, tmp_path, max_steps=2)
    shutil.copy(CONFIGS / "vf_retry_arithmetic.py", tmp_path)          # beside the config, as a user keeps it
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "config.yaml"))], timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    s = scalars(tmp_path)
    ess, turns = [v for _, v in s["train/ess"]], [v for _, v in s["rollout/turns"]]
    assert len(ess) == 2 and min(ess) >= 0.9999, ess
    assert all(2.5 < v <= 3.0 for v in turns), turns           # a random model is almost never right
    assert min(v for _, v in s["rollout/env_tokens"]) > 0
    assert max(v for _, v in s["rollout/env_errors"]) == 0 and max(v for _, v in s["rollout/truncated_turns"]) == 0


def test_a_timeout_not_below_the_runners_step_timeout_is_refused_and_a_late_run_is_cancelled(tasks):
    """Verifiers.timeout must act before the runner's step_timeout (which can only abandon a step's thread); when
    it fires, the episode's run() (waiting for a reply that will not come) is cancelled, not left on the loop."""
    from lit_ess.envs import EnvConfig
    from lit_ess.envs.verifiers_env import Verifiers

    with pytest.raises(ValueError, match=r"^env.init_args.timeout=60.0 s \(Verifiers\) must be below env.step_timeout=10.0 s"):
        EnvConfig(env="lit_ess.envs.verifiers_env:Verifiers")
    EnvConfig(env=partial(Verifiers, timeout=5.0), step_timeout=10.0)
    src, _ = tasks
    env = Verifiers(timeout=0.5)
    env.reset(src.examples[0])
    env.exchange.answer = lambda text: None          # the reply is lost: run() never asks again nor ends
    with pytest.raises(TimeoutError, match="Verifiers.timeout=0.5 s"):
        env.step(Action("7", [1], "stop"))
    import time

    for _ in range(50):                                # the cancellation runs on the env's loop
        if env.future.done():
            break
        time.sleep(0.02)
    assert env.future.cancelled()
