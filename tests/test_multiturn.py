"""Multi-turn rollouts as users meet them: the data module's `env` knob, the worker's batches (environment
tokens masked), failures and their counters, and (e2e) configs/demo_multiturn.yaml: on-policy at ESS 1 over
several turns on vLLM, kill -9 and resume, async within the lag bound (hf engine), two ranks."""
from __future__ import annotations

import re
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from e2e_utils import cli, cli_each, kill_after_checkpoint, merged, scalars, trained_prompts, write_config
from test_dist_async import by_phase, records
from lit_ess.datamodules import Arithmetic, RolloutDataModule
from lit_ess.datamodules.prompts import PromptOrder, encode_prompt
from lit_ess.engines import HFConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.envs import EnvConfig, EnvError, Environment, RetryArithmetic, Step
from lit_ess.datamodules.settings import BatchShape, RewardLimits

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RETRY = EnvConfig(env=partial(RetryArithmetic, max_tries=3), max_turns=3, max_episode_tokens=64)


class AlwaysFails(Environment):
    def reset(self, example):
        return example.prompt

    def step(self, action) -> Step:
        raise RuntimeError("tool server down")


def data_module(model_dir, env=RETRY, **kw) -> RolloutDataModule:
    dm = RolloutDataModule(model_path=model_dir, engine=HFConfig(), source=Arithmetic(size=50), batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=2), sampling=SamplingConfig(max_new_tokens=4, seed=0), env=env, **kw)
    dm.setup("fit")
    return dm


def test_worker_batches_mask_the_environments_tokens(tiny_model_dir):
    """The collated batch the trainer gets: after the prompt, the tokens with completion mask 0 are exactly
    the environment's parts of the conversation ('wrong\\n' + the question), with behaviour logprob 0;
    the policy's tokens carry the logprob the trainer computes (on-policy)."""
    from transformers import AutoModelForCausalLM

    from lit_ess.logprobs import sequence_logprobs

    dm = data_module(tiny_model_dir)
    (batch,) = dm.generate_phase()
    tok, env_tokens = dm.tokenizer, 0
    assert batch.stats["rollout/turns"] > 1                          # a random model answers wrong: it retries
    for b in range(batch.rows):
        P = len(encode_prompt(tok, batch.prompt_texts[b]))
        after = batch.attention_mask[b].bool()
        after[:P] = False
        m = batch.completion_mask[b]
        env = after & ~m
        parts = re.findall(r"\[env: (.*?)\]", batch.completion_texts[b], re.S)
        assert parts == [f"wrong\n{batch.prompt_texts[b]}"] * len(parts)
        assert tok.decode(batch.input_ids[b][env]) == "".join(parts)
        assert not (m[:P]).any() and (batch.behavior_logprobs[b][env] == 0).all()
        assert (batch.behavior_logprobs[b][m] < 0).all()
        env_tokens += int(env.sum())
    assert env_tokens > 0 and env_tokens / batch.rows == batch.stats["rollout/env_tokens"]
    assert batch.versions.tolist() == [0] * batch.rows
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert (lp - batch.behavior_logprobs)[batch.completion_mask].abs().max() < 1e-5


def test_environment_failures_count_as_reward_failures_and_survive_a_checkpoint(tiny_model_dir, tmp_path):
    failing = EnvConfig(env=f"{__name__}:AlwaysFails")
    dm = data_module(tiny_model_dir, env=failing, reward_limits=RewardLimits(max_error_rate=1.0))
    with pytest.warns(UserWarning, match="tool server down"):
        (batch,) = dm.generate_phase()
    assert batch.stats["rollout/env_errors"] == 8.0 and batch.rewards.tolist() == [0.0] * 8
    torch.save(dm.state_dict(), tmp_path / "state.pt")
    fresh = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=50), env=failing)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    fresh.setup("fit")
    assert fresh.executor.worker.counters() == {"errors": 0, "timeouts": 0, "env": {"errors": 8, "timeouts": 0}}
    strict = data_module(tiny_model_dir, env=failing, reward_limits=RewardLimits(max_error_rate=0.5))
    with pytest.warns(UserWarning), pytest.raises(EnvError, match=r"failed in 8 of 8 episodes, more than "
                                                                  r"data.reward_limits.max_error_rate=0.5"):
        strict.generate_phase()


def test_a_phase_carries_the_environment_counters_its_sampling_left(tiny_model_dir):
    """The worker process scores phase p while its engine samples phase p + 1 (two threads): phase p's
    cumulative environment counters (its batches' rollout/env_errors, the counters a checkpoint keeps)
    count phases <= p only. Counting p + 1's too would count them twice after a resume, which samples
    p + 1 again."""
    from fake_engine import FakeConfig
    from lit_ess.rollout import RolloutRequest, RolloutWorker, WorkerConfig

    worker = RolloutWorker(WorkerConfig(model_path=tiny_model_dir, engine=FakeConfig(latency=0.0), samples_per_prompt=2,
                                        sampling=SamplingConfig(max_new_tokens=3, seed=0), max_reward_error_rate=1.0,
                                        env=EnvConfig(env=f"{__name__}:AlwaysFails")))
    tok = worker.tokenizer

    def phase(p: int) -> RolloutRequest:                     # 4 prompts x 2 episodes
        return RolloutRequest(p, [0, 1, 2, 3], [encode_prompt(tok, "1+1=")] * 4, ["1+1="] * 4, ["2"] * 4)
    with pytest.warns(UserWarning, match="tool server down"):
        s0 = worker.sample(phase(0))
        s1 = worker.sample(phase(1))
    for p, sampled in ((0, s0), (1, s1)):
        whole = worker.score(phase(p), *sampled)
        assert whole.reward_counters["env"] == {"errors": 8 * (p + 1), "timeouts": 0}
        assert whole.batches[0].stats["rollout/env_errors"] == 8 * (p + 1)
    worker.close()


def test_async_environment_that_cannot_start_stops_the_run_in_one_line(tiny_model_dir):
    """An environment whose reset raises, in the async worker process: the data module raises the
    environment's EnvError, one line (not a crash report of the worker with its traceback)."""
    from test_async import make_dm, weights

    dm = make_dm(tiny_model_dir, mode="async", env=EnvConfig(env=f"{__name__}:CannotStart"))
    try:
        dm.push_weights(weights(0), 0)
        with pytest.raises(EnvError, match=r"^environment 'test_multiturn:CannotStart' cannot start an episode from "
                                           r".*: KeyError: 'no such task'$"):
            dm.next_batch(0)
    finally:
        dm.teardown("fit")


class CannotStart(AlwaysFails):
    def reset(self, example):
        raise KeyError("no such task")


def test_an_episode_budget_above_the_models_length_is_refused(tiny_model_dir):
    env = EnvConfig(env="retry_arithmetic", max_turns=3, max_episode_tokens=1000)
    with pytest.raises(ValueError, match=r"env.max_episode_tokens=1000 exceeds the engine's model length 256"):
        data_module(tiny_model_dir, env=env)
    with pytest.raises(ValueError, match=r"env must be an environment config"):
        RolloutDataModule(model_path=tiny_model_dir, env="retry_arithmetic")


# ---------------------------------------------------------------------------------------------------------
# e2e: configs/demo_multiturn.yaml, from a short warm start


def warm_start_config(root: Path, config: str, steps: int) -> Path:
    """configs/`config` (a warm start) cut to `steps`, run from ROOT (its model in ROOT/runs/demo/init)."""
    cfg = yaml.safe_load((CONFIGS / config).read_text())
    cfg["trainer"].update(max_steps=steps, enable_progress_bar=False, logger=False)
    return write_config(cfg, root / config)


S_ASYNC, N_ASYNC = 2, 4          # test_async_multiturn_stays_within_the_lag_bound: the bound, the steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-rank runs from warm starts, one after another in one process (e2e_utils.cli_each: one
    start of Python and Lightning instead of one each), {name: folder}: configs/demo_sft.yaml cut to 300
    steps ("warm": a policy that answers in the arithmetic format, often wrong), then from it
    configs/demo_multiturn.yaml on vLLM ("on_policy", 6 steps) and async with S = 2 on the hf engine
    ("async", 4 steps); configs/demo_calculator_sft.yaml cut to 50 steps, then configs/demo_calculator.yaml
    from it on vLLM ("calculator", 6 steps)."""
    from lit_ess.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("multiturn")
    warm, calc = root / "warm", root / "calculator_sft"
    for d in (warm, calc):
        build_tiny_model(d / "runs/demo/init")
    policy = warm / "runs/demo/sft/model"
    cases = {"warm": (["fit", "--config", str(warm_start_config(warm, "demo_sft.yaml", 300))], warm),
             "on_policy": multiturn_config(policy, root / "on_policy", steps=6),
             "async": multiturn_config(policy, root / "async", steps=N_ASYNC,
                                       schedule={"mode": "async", "max_staleness": S_ASYNC}, engine=HF),
             "calculator_sft": (["fit", "--config", str(warm_start_config(calc, "demo_calculator_sft.yaml", 50))], calc),
             "calculator": multiturn_config(calc / "runs/demo/calculator_sft/model", root / "calculator", steps=6,
                                            config="demo_calculator.yaml")}
    cases = {k: c if isinstance(c, tuple) else (["fit", "--config", str(c)], None) for k, c in cases.items()}
    done = cli_each(cases, timeout=2400)
    for name in ("warm", "calculator_sft"):
        assert done[name].returncode == 0, done[name].stderr[-4000:]
    return {k: (root / k, res) for k, res in done.items()}


def ran(runs, name) -> Path:
    """The folder of a run of `runs` that exited 0."""
    out, res = runs[name]
    assert res.returncode == 0, res.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def warm_start(runs):
    """configs/demo_sft.yaml cut to 300 steps: a policy that answers in the arithmetic format, often wrong."""
    return ran(runs, "warm") / "runs/demo/sft/model"


def multiturn_config(model: Path, out: Path, steps: int, ckpt_every: int | None = None, devices: int = 1,
                     config: str = "demo_multiturn.yaml", **data) -> Path:
    """configs/demo_multiturn.yaml (or `config`), smaller (16 prompts x 4 episodes unless `data` says), no
    validation or export, every step's prompts and row versions recorded (rank r > 0: prompts.jsonl.rank{r});
    several `devices`: DDP."""
    cfg = yaml.safe_load((CONFIGS / config).read_text())
    cfg["model"]["init_args"]["model_path"] = str(model)
    d = cfg["data"]["init_args"] = merged({**cfg["data"]["init_args"], "batch": {"prompts_per_rollout": 16, "samples_per_prompt": 4}},
                                          data)
    d.pop("validation", None)
    t = cfg["trainer"]
    t.update(max_steps=steps, enable_progress_bar=False, enable_checkpointing=ckpt_every is not None)
    if devices > 1:
        t.update(devices=devices, strategy="ddp")
    t.pop("check_val_every_n_epoch", None)
    cfg["output_dir"] = None            # the paths below are the test's own
    t["logger"] = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                   "init_args": {"save_dir": str(out), "name": "tb", "version": "run"}}
    t["callbacks"] = [c for c in t["callbacks"] if c["class_path"].split(".")[-1] in ("WeightSync", "LogCompletions")]
    if ckpt_every is not None:
        t["callbacks"].append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                               "init_args": {"dirpath": str(out / "ckpt"), "save_last": True,
                                             "every_n_train_steps": ckpt_every, "save_top_k": -1}})
    t["callbacks"].append({"class_path": "e2e_utils.RecordPrompts", "init_args": {"path": str(out / "prompts.jsonl")}})
    return write_config(cfg, out / "config.yaml")


def fit(cfg: Path, *extra) -> dict:
    res = cli(["fit", "--config", str(cfg), *extra], timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    return scalars(cfg.parent)


@pytest.mark.e2e
def test_demo_multiturn_is_on_policy_over_several_turns(runs):
    s = scalars(ran(runs, "on_policy"))
    ess, turns = [v for _, v in s["train/ess"]], [v for _, v in s["rollout/turns"]]
    assert len(ess) == 6 and min(ess) >= 0.9999, ess
    assert min(turns) > 1 and max(turns) <= 3, turns
    # the weights moved (a step whose groups all score alike has no gradient): ESS 1 says something
    assert sum(v > 0 for _, v in s["train/grad_norm"]) >= 4
    assert min(v for _, v in s["rollout/env_tokens"]) > 0
    for tag in ("rollout/env_seconds", "rollout/tool_calls", "rollout/truncated_turns", "rollout/truncated_tokens",
                "rollout/env_errors", "rollout/env_timeouts"):
        assert tag in s, tag


@pytest.mark.e2e
def test_demo_calculator_calls_the_tool_on_policy(runs):
    """configs/demo_calculator_sft.yaml cut to 50 steps, then configs/demo_calculator.yaml for 6 steps on
    vLLM: the policy calls the calculator, the call turns stop at ')', and every step is on-policy."""
    s = scalars(ran(runs, "calculator"))
    ess, calls = [v for _, v in s["train/ess"]], [v for _, v in s["rollout/tool_calls"]]
    assert len(ess) == 6 and min(ess) >= 0.9999, ess
    assert min(calls) > 0 and max(calls) <= 2, calls          # max_calls 1: a second call ends the episode, counted
    assert min(v for _, v in s["rollout/env_tokens"]) > 0     # the results the calculator inserted


HF = {"class_path": "lit_ess.engines.HFConfig"}


@pytest.mark.e2e
def test_multiturn_kill_and_resume_continues_exactly(warm_start, tmp_path):
    """kill -9 after the step-2 checkpoint, then --ckpt_path last: the same episodes (prompts, turns,
    environment tokens), losses and cumulative environment-failure counters as the uninterrupted run.
    On the hf engine: what a resume restores here (prompt order, episodes' seeds, environment counters) lies
    outside the engine; vLLM's seeded sampling across a resume: test_e2e.py::test_kill_and_resume_matches_uninterrupted."""
    env = {"env": {"class_path": "e2e_utils.FlakyRetry", "init_args": {"max_tries": 3}}, "max_turns": 3, "max_episode_tokens": 96}
    ref_dir, run_dir, steps = tmp_path / "ref", tmp_path / "killed", 4
    ref_cfg = multiturn_config(warm_start, ref_dir, steps=steps, ckpt_every=2, env=env,
                               reward_limits={"max_error_rate": 1.0}, engine=HF)
    cfg = multiturn_config(warm_start, run_dir, steps=steps, ckpt_every=2, env=env, reward_limits={"max_error_rate": 1.0},
                           engine=HF)
    kill_after_checkpoint(cfg, run_dir / "ckpt", 2)
    # the resume, then the uninterrupted run, in one process (e2e_utils.cli_each): one start of Lightning fewer;
    # the resume first, in a fresh process as a user's, so nothing the uninterrupted run left behind can help it
    runs = cli_each({"resumed": (["fit", "--config", str(cfg), "--ckpt_path", "last"], None),
                     "ref": (["fit", "--config", str(ref_cfg)], None)}, timeout=1200)
    for res in runs.values():
        assert res.returncode == 0, res.stderr[-4000:]
    got, ref = scalars(run_dir), scalars(ref_dir)
    lines = (run_dir / "prompts.jsonl").read_text().splitlines()
    assert sum('"step": 0,' in ln for ln in lines) == 1               # really resumed, not started again
    for tag in ("train/loss", "train/ess", "rollout/reward_mean", "rollout/turns", "rollout/env_tokens",
                "rollout/env_errors"):
        assert len(got[tag]) == steps and [s for s, _ in got[tag]] == [s for s, _ in ref[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in ref[tag]], abs=1e-6), tag
    errors = [v for _, v in got["rollout/env_errors"]]
    assert errors[-1] > errors[1] > 0                                 # cumulative, also across the resume
    a, b = trained_prompts(ref_dir / "prompts.jsonl"), trained_prompts(run_dir / "prompts.jsonl")
    assert Counter(p for r in b.values() for p in r["prompt_ids"]) == Counter(p for r in a.values() for p in r["prompt_ids"])


@pytest.mark.e2e
def test_async_multiturn_stays_within_the_lag_bound(runs):
    """The hf engine in the worker process (async multi-turn on vLLM: the dedicated-server case below)."""
    S, n, out = S_ASYNC, N_ASYNC, ran(runs, "async")
    s = scalars(out)
    lag_max = [v for _, v in s["train/policy_lag_max"]]
    assert 1 <= max(lag_max) <= S, lag_max                           # the worker really ran ahead
    steps = trained_prompts(out / "prompts.jsonl")
    assert sorted(steps) == list(range(n))
    assert all(step - v <= S for step, r in steps.items() for v in r["versions"])
    assert min(v for _, v in s["rollout/turns"]) > 1


@pytest.mark.e2e
@pytest.mark.parametrize("placement, engine", [("colocated", {"class_path": "lit_ess.engines.HFConfig"}),
                                               ("dedicated", {"class_path": "lit_ess.engines.VLLMServerConfig"})],
                         ids=["colocated-hf", "dedicated-server"])
def test_two_ranks_async_multiturn_keep_the_bound_and_lose_no_episode_on_kill(tiny_model_dir, tmp_path, placement,
                                                                                engine):
    """The multi-turn config on 2 ranks (DDP, gloo), async with S = 2, from a random policy (wrong answers,
    so episodes of 3 turns), one vLLM server that rank 0 launches and both ranks' workers use (dedicated) or
    the hf engine in each rank's worker (colocated: two vLLM engines on this CPU cost more than they show). kill -9 after the step-2
    checkpoint, which holds episodes not yet trained (phases planned or sampled for steps >= 2), then
    --ckpt_path last. Every step is trained on both ranks; each phase's prompts are the ones the prompt
    order draws, split between the ranks, and every episode (prompt x sample) is trained once; no row is
    dropped as stale; the lag stays within S, in TensorBoard and on every trained row. The environment
    fails on some answers: its failure counters go on from the checkpoint's (each rank's worker its own)."""
    S, P, n, steps = 2, 8, 4, 4
    env = {"env": {"class_path": "e2e_utils.FlakyRetry", "init_args": {"max_tries": 3}}, "max_turns": 3, "max_episode_tokens": 96}
    cfg = multiturn_config(Path(tiny_model_dir), tmp_path, steps=steps, ckpt_every=2, devices=2,
                           schedule={"mode": "async", "placement": placement, "max_staleness": S},
                           batch={"prompts_per_rollout": P, "samples_per_prompt": n}, env=env,
                           reward_limits={"max_error_rate": 1.0}, engine=engine)
    kill_after_checkpoint(cfg, tmp_path / "ckpt", 2)
    (ckpt,) = (tmp_path / "ckpt").glob("*step=2*.ckpt")
    ranks = torch.load(ckpt, weights_only=False)["RolloutDataModule"]["ranks"]
    held = {r["phase"] for st in ranks for r in st["requests"]} | {int(p) for st in ranks
                                                                    for p in st["buffer"]["ready"]}
    assert held and min(held) >= 2, held                            # episodes in flight at the kill
    s = fit(cfg, "--ckpt_path", "last")
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    assert sum('"step": 0,' in ln for ln in lines) == 1             # resumed, not started again
    assert len(s["train/policy_lag_max"]) == steps
    assert max(v for _, v in s["train/policy_lag_max"]) <= S
    assert max(v for _, v in s["rollout/stale_dropped"]) == 0
    assert min(v for _, v in s["rollout/turns"]) > 1
    errors = [v for _, v in s["rollout/env_errors"]]
    assert len(errors) == steps and 0 < errors[0] and errors == sorted(errors), errors    # cumulative across the kill
    recs = records(tmp_path)
    assert sorted(r["step"] for r in recs if r["rank"] == 0) == sorted(r["step"] for r in recs if r["rank"] == 1) \
        == list(range(steps))
    assert all(r["step"] - v <= S for r in recs for v in r["versions"])
    src = yaml.safe_load(cfg.read_text())["data"]["init_args"]["source"]["init_args"]
    order = PromptOrder(len(Arithmetic(**src)), seed=0)
    phases = by_phase(recs)
    assert sorted(phases) == list(range(steps))                     # one phase per step
    for phase in range(steps):
        got, want = phases[phase], order.take(P)
        assert not set(got[0]) & set(got[1]), f"phase {phase}: both ranks trained a prompt"
        assert Counter(got[0] + got[1]) == Counter(want * n), phase
