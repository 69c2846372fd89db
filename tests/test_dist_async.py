"""Async rollouts on 2 data-parallel ranks (gloo, the hf engine, the `lit-ess fit` CLI), colocated (the
dedicated placement runs on vLLM servers: test_server.py). One 2-rank sync run is the baseline of every
comparison:
* S = steps_per_rollout - 1: async trains exactly the sync run;
* S = 2: the lag never exceeds S on any rank, each phase's prompts are split, disjoint, between the
  ranks and together are the phase the sync run trained;
* kill -9 mid-run, then --ckpt_path last: no prompt lost or trained twice;
* a killed worker stops both ranks, each with an error that names it."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from e2e_utils import cli, kill_after_checkpoint, pythonpath, rl_config, scalars, write_config

pytestmark = pytest.mark.e2e

K, STEPS = 2, 6                  # 2 steps per rollout: phases 0, 1, 2
# one sequence per generate call: a row's seed is its prompt's global position and its sample index, however
# the rows are dealt to ranks and workers (vLLM's async runs: test_async_e2e.py; vLLM on 2 ranks: test_lora.py)
ENGINE = {"class_path": "lit_ess.engines.HFConfig", "init_args": {"batch_size": 1}}


def config(model_dir, out: Path, mode="async", placement="colocated", S=None, strategy="fsdp2", ckpt_every=None, steps=STEPS):
    data = {"schedule": {"mode": mode, "placement": placement, "max_staleness": S, "worker_timeout": 120}, "engine": ENGINE}
    cfg = rl_config(model_dir, out, prompts=8, samples=4, max_steps=steps, steps_per_rollout=K, ckpt_every=ckpt_every,
                    extra_data=data)
    cfg["trainer"]["devices"] = 2
    cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.RecordPrompts",
                                        "init_args": {"path": str(out / "prompts.jsonl")}})
    if strategy == "ddp":
        cfg["trainer"]["strategy"] = "ddp"
    else:
        cfg["trainer"]["strategy"] = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                                      "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}
        cfg["trainer"]["callbacks"].append({"class_path": "lit_ess.callbacks.FSDP2"})
    return cfg


def fit(cfg, out: Path, *extra):
    res = cli(["fit", "--config", str(write_config(cfg, out / "config.yaml")), *extra], timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return scalars(out)


def records(out: Path) -> list[dict]:
    """Every trained batch of both ranks (the last record of a step retrained after a resume wins)."""
    out_ = []
    for name, rank in (("prompts.jsonl", 0), ("prompts.jsonl.rank1", 1)):
        last = {}
        for line in (out / name).read_text().splitlines():
            r = json.loads(line)
            last[r["step"]] = {**r, "rank": rank}
        out_ += list(last.values())
    return out_


def by_phase(recs: list[dict]) -> dict[int, dict[int, list[int]]]:
    got: dict = {}
    for r in recs:
        got.setdefault(r["phase"], {}).setdefault(r["rank"], []).extend(r["prompt_ids"])
    return got


@pytest.fixture(scope="module")
def sync_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync2")
    return fit(config(tiny_model_dir, out, mode="sync"), out), out


def test_async_at_the_sync_lag_trains_the_sync_run_on_two_ranks(tiny_model_dir, tmp_path, sync_run):
    want, want_dir = sync_run
    got = fit(config(tiny_model_dir, tmp_path, S=K - 1), tmp_path)
    for key in ("train/loss", "train/ess", "train/grad_norm", "rollout/reward_mean"):
        a, b = [v for _, v in want[key]], [v for _, v in got[key]]
        assert len(a) == len(b) == STEPS and b == pytest.approx(a, abs=1e-6), (key, a, b)
    assert max(v for _, v in got["train/policy_lag_max"]) <= K - 1
    assert sorted(map(str, records(tmp_path))) == sorted(map(str, records(want_dir)))


def test_async_stays_within_the_bound_and_splits_every_phase(tiny_model_dir, tmp_path, sync_run):
    """Colocated, DDP, S = 2 > K - 1: the worker runs ahead, never past the bound; each phase's
    prompts are those of the sync run's phase, split between the ranks, each group whole, once."""
    S = 2
    got = fit(config(tiny_model_dir, tmp_path, S=S, strategy="ddp"), tmp_path)
    assert max(v for _, v in got["train/policy_lag_max"]) <= S
    assert max(v for _, v in got["rollout/stale_dropped"]) == 0
    recs = records(tmp_path)
    assert all(r["step"] - v <= S for r in recs for v in r["versions"])
    _same_phases(by_phase(recs), by_phase(records(sync_run[1])))


def _same_phases(got, want):
    assert sorted(got) == sorted(want) == list(range(STEPS // K))
    for p, ranks in got.items():
        assert not set(ranks[0]) & set(ranks[1]), f"phase {p}: both ranks trained a prompt"
        assert sorted(ranks[0] + ranks[1]) == sorted(want[p][0] + want[p][1])
        assert set(Counter(ranks[0] + ranks[1]).values()) == {4}          # 4 samples per prompt, each once


def test_kill_and_resume_loses_and_duplicates_no_prompt(tiny_model_dir, tmp_path, sync_run):
    """DDP, S = 2, checkpoints every step: kill -9 after step 3's (mid-phase, the workers ahead), then
    --ckpt_path last: every phase trained whole on both ranks, no prompt twice, lag <= S."""
    S = 2
    cfg = write_config(config(tiny_model_dir, tmp_path, S=S, strategy="ddp", ckpt_every=1),
                       tmp_path / "config.yaml")
    kill_after_checkpoint(cfg, tmp_path / "ckpt", 3)
    res = cli(["fit", "--config", str(cfg), "--ckpt_path", "last"], timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    recs = records(tmp_path)
    assert sorted(r["step"] for r in recs if r["rank"] == 0) == list(range(STEPS))
    assert all(r["step"] - v <= S for r in recs for v in r["versions"])
    _same_phases(by_phase(recs), by_phase(records(sync_run[1])))


KILLER = """
import os, signal, sys, threading, time
import lightning as L
class KillWorker(L.Callback):
    '''At step 2, rank 1 kills its own rollout worker (a crash, OOM kill, or engine failure).'''
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and trainer.global_rank == 1:
            os.kill(trainer.datamodule.executor.proc.pid, signal.SIGKILL)
"""


def test_a_killed_worker_stops_both_ranks_with_a_clear_error(tiny_model_dir, tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    cfg = config(tiny_model_dir, tmp_path, S=1, strategy="ddp", steps=20)
    cfg["trainer"]["callbacks"].append({"class_path": "killer.KillWorker"})
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{pythonpath()}")

    res = subprocess.run([sys.executable, "-m", "lit_ess.cli", "fit", "--config",
                          str(write_config(cfg, tmp_path / "config.yaml"))], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode != 0
    err = res.stderr
    assert "died: exit code -9, killed by SIGKILL" in err and "lit-ess: error: " in err, err[-3000:]
    assert "rank 1 stopped, so this rank (rank 0) stops too" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
