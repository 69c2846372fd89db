"""End-to-end runs on the tiny model: real vLLM, real TensorBoard files, real checkpoints."""

import re

import pytest

from e2e_utils import cli_each, kill_after_checkpoint, rl_config, scalars, write_config
from lit_ess.report import read_histogram_tags

pytestmark = pytest.mark.e2e


VAL = {"validation": {"source": {"class_path": "lit_ess.datamodules.Arithmetic", "init_args": {"size": 40, "seed": 7}},
                      "prompts": 16, "samples": 3}}


def shared_config(model_dir, out, **data):
    """The sync vLLM run that several tests below read (one run instead of one each): 4 steps, P3O with
    an IcePop correction, 2 micro-batches per step, validation every 2 steps, a checkpoint every 2."""
    cfg = rl_config(model_dir, out, max_steps=4, micro_batch_size=8, ckpt_every=2, extra_data={**VAL, **data})
    cfg["model"]["init_args"]["objective"]["init_args"] = {"correction": {"level": "token", "mode": "mask"}}
    cfg["trainer"]["check_val_every_n_epoch"] = 2
    return cfg


def unknown_objective_config(model_dir, out):
    return rl_config(model_dir, out, objective="ppo9000")


def four_steps_config(model_dir, out):
    return rl_config(model_dir, out, engine="HFConfig", max_steps=8, steps_per_rollout=4, prompts=8, samples=4)


def broken_sync_config(model_dir, out):
    cfg = rl_config(model_dir, out, engine="HFConfig", max_steps=3, lr=2e-2, extra_model={"ess_alarm": {"error": True}})
    cfg["trainer"]["callbacks"][0] = {"class_path": "e2e_utils.StaleWeightSync"}
    return cfg


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The module's runs, {name: (folder, CompletedProcess)}, one after another in one process (cli_each: one
    start of Python and Lightning instead of one each): the shared sync vLLM run that several tests read,
    `validate` from its last checkpoint, the same config async with S = 0, the hf engine's on-policy run,
    4 steps per rollout, a broken weight sync, an unknown objective."""
    root = tmp_path_factory.mktemp("runs")
    fits = {"sync": shared_config(tiny_model_dir, root / "sync"),
            "async0": shared_config(tiny_model_dir, root / "async0", schedule={"mode": "async", "max_staleness": 0}),
            "hf": rl_config(tiny_model_dir, root / "hf", engine="HFConfig"),
            "four_steps": four_steps_config(tiny_model_dir, root / "four_steps"),
            "broken_sync": broken_sync_config(tiny_model_dir, root / "broken_sync"),
            "unknown_objective": unknown_objective_config(tiny_model_dir, root / "unknown_objective")}
    cases = {k: (["fit", "--config", str(write_config(cfg, root / k / "config.yaml"))], None) for k, cfg in fits.items()}
    # the run's config and last checkpoint; its TensorBoard scalars in a folder of their own (tb/validate),
    # not among the run's, which the tests read
    validate = ["validate", "--config", str(root / "sync" / "config.yaml"), "--ckpt_path",
                str(root / "sync" / "ckpt" / "last.ckpt"), "--trainer.logger.init_args.version", "validate"]
    cases = {"sync": cases.pop("sync"), "validate": (validate, None), **cases}
    return {k: (root / k, res) for k, res in cli_each(cases, timeout=1800).items()}


def ok(runs, name):
    """A run of `runs` that exited 0: its TensorBoard scalars and its stderr."""
    out, res = runs[name]
    assert res.returncode == 0, res.stderr[-4000:]
    return scalars(out), res.stderr


@pytest.fixture(scope="module")
def sync_run(runs):
    """The shared sync vLLM run: its TensorBoard scalars and folder."""
    return ok(runs, "sync")[0], runs["sync"][0]


@pytest.mark.parametrize("engine", ["VLLMConfig", "HFConfig"])
def test_on_policy_ess_is_one_every_step(engine, runs):
    s, console = ok(runs, "sync" if engine == "VLLMConfig" else "hf")
    ess = [v for _, v in s["train/ess"]]
    assert len(ess) == 4 and min(ess) >= 0.9999, ess
    # the lag-0 ESS alarm (fp32 engine and trainer, T = 1) applies on every step and stays silent
    assert [v for _, v in s["train/ess_alarms"]] == [0.0] * 4 and "ess_alarm" not in console
    assert [v for _, v in s["train/policy_lag"]] == [0.0] * 4
    # the weights really moved (else ESS = 1 would prove nothing)
    assert min(v for _, v in s["train/grad_norm"]) > 0
    assert max(v for _, v in s["rollout/degenerate_frac"]) < 1


def test_four_steps_per_rollout_go_off_policy(runs):
    """Steps 2-4 of each phase train on data the policy already moved away from. The hf engine: staleness is
    the trainer's own (the engine samples once per phase), and the hf engine's logprobs equal the trainer's
    as vLLM's do (test_on_policy_ess_is_one_every_step runs both)."""
    s, _ = ok(runs, "four_steps")            # four_steps_config
    ess = [v for _, v in s["train/ess"]]
    lag = [v for _, v in s["train/policy_lag"]]
    assert ess[0] >= 0.9999 and ess[4] >= 0.9999          # first step of each phase: fresh data
    assert all(e < 0.9999 for i, e in enumerate(ess) if i % 4), ess
    assert lag == [0, 1, 2, 3, 0, 1, 2, 3]


def test_dashboard_tags_and_histograms(sync_run):
    """P3O with an IcePop correction, 2 micro-batches: the dashboard's tags, and on-policy data keeps
    every token with weight 1 (pi_prox = pi_b)."""
    s, out = sync_run
    for tag in ["train/ess", "train/loss", "train/kl_behavior", "train/ratio_max", "train/capped_frac",
                "rollout/reward_mean", "rollout/reward_std", "rollout/response_len", "rollout/degenerate_frac"]:
        assert tag in s, tag
    assert [v for _, v in s["train/is_weight_mean"]] == pytest.approx([1.0] * 4, abs=1e-4)
    assert [v for _, v in s["train/is_outside_frac"]] == [0.0] * 4
    assert {"ratio/log_ratio", "ratio/capped_weight"} <= read_histogram_tags(out / "tb" / "run")


def test_async_with_staleness_zero_reproduces_the_sync_run(runs, sync_run):
    sync = sync_run[0]
    asyn, _ = ok(runs, "async0")             # shared_config with schedule: {mode: async, max_staleness: 0}
    for tag in ("train/loss", "train/ess", "rollout/reward_mean", "train/grad_norm", "val/reward_mean", "val/pass@1"):
        assert [v for _, v in asyn[tag]] == pytest.approx([v for _, v in sync[tag]], abs=1e-6), tag
    assert [v for _, v in asyn["train/policy_lag_max"]] == [0.0] * 4


def test_kill_and_resume_matches_uninterrupted(tiny_model_dir, tmp_path):
    """SIGKILL mid-phase, then --ckpt_path last: the same losses as the uninterrupted run, the learning
    rate logged is the one each step used (warm-up), and cumulative counters carry over."""
    steps, lr, warmup = 6, 1e-3, 4

    def config(out):
        cfg = rl_config(tiny_model_dir, out, max_steps=steps, steps_per_rollout=2, ckpt_every=3, lr=lr,
                        extra_model={"optim": {"warmup_steps": warmup}},
                        extra_data={"reward": "e2e_utils:flaky_digit_fraction", "reward_limits": {"max_error_rate": 1.0}})
        cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.RecordPrompts",
                                            "init_args": {"path": str(out / "prompts.jsonl")}})
        return cfg

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    cfg = write_config(config(run_dir), run_dir / "config.yaml")
    kill_after_checkpoint(cfg, run_dir / "ckpt", 3)
    # the resume, then the uninterrupted run, in one process (e2e_utils.cli_each): one start of Lightning and
    # vLLM fewer; the resume first, in a fresh process as a user's, so nothing the other run left can help it
    done = cli_each({"resumed": (["fit", "--config", str(cfg), "--ckpt_path", "last"], None),
                     "ref": (["fit", "--config", str(write_config(config(ref_dir), ref_dir / "config.yaml"))], None)})
    for res in done.values():
        assert res.returncode == 0, res.stderr[-4000:]
    ref = scalars(ref_dir)
    lines = (run_dir / "prompts.jsonl").read_text().splitlines()
    assert sum('"step": 0,' in ln for ln in lines) == 1            # really resumed, not started again
    got = scalars(run_dir)
    for tag in ["train/loss", "train/ess", "rollout/reward_mean", "train/lr", "train/grad_norm",
                "rollout/reward_errors", "train/skipped_steps"]:
        want = [v for _, v in ref[tag]]
        have = [v for _, v in got[tag]]
        assert [s for s, _ in got[tag]] == [s for s, _ in ref[tag]], tag
        assert have == pytest.approx(want, abs=1e-6), tag
    # step s is taken with the warm-up rate lr * (s + 1) / (warmup + 1)
    assert [v for _, v in got["train/lr"]] == pytest.approx([lr * (s + 1) / (warmup + 1) if s < warmup else lr
                                                             for s in range(steps)], rel=1e-6)
    errors = [v for _, v in got["rollout/reward_errors"]]
    assert errors[-1] > errors[2] > 0                         # cumulative, also across the resume


def test_unknown_objective_lists_valid_names(runs):
    res = runs["unknown_objective"][1]       # unknown_objective_config
    assert res.returncode == 2
    for name in ["P3O", "GRPO", "DAPO", "GSPO", "CISPO", "DecoupledPPO", "REINFORCE"]:
        assert name in res.stderr
    assert "Traceback" not in res.stderr


def test_validation_in_fit_and_validate_from_checkpoint(sync_run, runs):
    s, out = sync_run
    assert len(s["val/reward_mean"]) == 2 and 0 <= s["val/reward_mean"][0][1] <= 1       # every 2nd of 4 epochs
    passes = [s[f"val/pass@{k}"][-1][1] for k in (1, 2, 3)]
    assert 0 <= passes[0] <= passes[1] <= passes[2] <= 1 and "val/pass@4" not in s
    res = runs["validate"][1]                # lit-ess validate --config OUT/config.yaml --ckpt_path OUT/ckpt/last.ckpt
    assert res.returncode == 0, res.stderr[-4000:]
    assert "val/reward_mean" in res.stdout


def test_a_broken_weight_sync_stops_the_run_with_ess_alarm_error(runs):
    """A sync that keeps pushing the first weights (labelled as current): with model.ess_alarm.error the
    run stops at step 1, the first step whose engine lags, with one line that says what is wrong. The hf
    engine: the broken sync is the callback's, the alarm the module's; neither is the engine's."""
    out, res = runs["broken_sync"]           # broken_sync_config
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("lit-ess: error: "))
    assert re.search(r"^lit-ess: error: step 1: ESS 0\.\d+ \(mean ratio pi_theta/pi_b [\d.e+-]+\) below model\.ess_alarm\.threshold=0\.999 "
                    r"on rows sampled by the trainer's current weights at its precision \(float32\) and temperature "
                    r"\(1\.0\), where it must be 1: .*\(check the weight sync\)$", line), line
    assert len(scalars(out)["train/loss"]) == 1                        # step 0 (fresh weights) trained
