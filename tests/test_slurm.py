"""Slurm for real: a 2-task lit-ess run submitted with `sbatch scripts/slurm/trainer.sbatch` (srun inside) to a
one-machine cluster (scripts/slurm/setup_cluster.sh), preempted mid-step with the SIGUSR1 that
`--signal=SIGUSR1@T` sends, requeued by the run itself, and resumed by Slurm with no step lost or repeated.

Where sbatch is missing or the cluster is down, the module sets it up with setup_cluster.sh when it runs as
root (CI) and tears it down after; otherwise it is skipped."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_utils import pythonpath, rl_config, scalars, trained_prompts, write_config
from lit_ess.checkpoint import resolve_resume

SLURM = Path(__file__).resolve().parent.parent / "scripts" / "slurm"


def _cluster_up() -> bool:
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return False
    res = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    return res.returncode == 0 and res.stdout.strip().startswith(("idle", "mix", "alloc"))


@pytest.fixture(scope="module")
def slurm():
    """A one-machine Slurm cluster: the one running, or one stood up for this module (as root) and torn down after."""
    if _cluster_up():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("Slurm is not installed or not running (no sbatch, or sinfo shows no idle node); "
                    "scripts/slurm/setup_cluster.sh sets it up as root")
    res = subprocess.run(["bash", str(SLURM / "setup_cluster.sh")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"setup_cluster.sh failed: {res.stderr[-2000:]}"
    try:
        yield
    finally:
        subprocess.run(["bash", str(SLURM / "teardown_cluster.sh")], timeout=180)


def job(jobid: str) -> dict:
    """`scontrol show job` as a dict (JobState, Restarts, ...); {} once Slurm has forgotten the job."""
    res = subprocess.run(["scontrol", "show", "job", "-o", jobid], capture_output=True, text=True, timeout=30)
    return dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv) if res.returncode == 0 else {}


def wait_until(cond, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log.exists() else "(no job log)"
            pytest.fail(f"{what} after {timeout:.0f} s\n--- job log ---\n{tail}")
        time.sleep(0.5)


@pytest.mark.e2e
def test_sbatch_run_preempted_by_sigusr1_requeues_and_resumes_exactly(slurm, tiny_model_dir, tmp_path):
    """2 srun tasks (DDP on gloo, hf engine, 2 steps per rollout phase, ModelCheckpoint every 3 steps) get
    SIGUSR1 in the middle of step 4 (between backward and optimizer step): the run checkpoints after step 4,
    with step 5's batch in the rollout buffer, requeues itself, and Slurm starts the same script again, which
    resumes with `--ckpt_path last`. Steps 0-5 are each trained once, with the prompts, rollouts, losses and
    gradients of an uninterrupted run of the same config (Lightning's own launcher)."""
    steps, hold = 6, 4

    def config(out: Path, callbacks=()) -> Path:
        cfg = rl_config(tiny_model_dir, out, engine="HFConfig", max_steps=steps, steps_per_rollout=2, ckpt_every=3)
        cfg["trainer"].update(devices=2, strategy="ddp", default_root_dir=str(out))
        cfg["trainer"]["callbacks"] += [{"class_path": "e2e_utils.RecordPrompts",
                                         "init_args": {"path": str(out / "prompts.jsonl")}}, *callbacks]
        return write_config(cfg, out / "config.yaml")

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "slurm"
    held, release, log = run_dir / "held", run_dir / "release", run_dir / "slurm.out"
    cfg = config(run_dir, [{"class_path": "e2e_utils.HoldStep",
                            "init_args": {"step": hold, "held": str(held), "release": str(release)}}])
    env = dict(os.environ, PYTHONPATH=pythonpath(), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               LIT_ESS=f"{sys.executable} -m lit_ess.cli")
    # the template as users copy it, its resources set for this machine on the command line
    sub = subprocess.run(["sbatch", "--parsable", "--job-name=lit-ess-test", "--nodes=1", "--ntasks-per-node=2",
                          "--gpus-per-node=0", "--cpus-per-task=1", "--time=20", f"--chdir={run_dir}",
                          f"--output={log}", str(SLURM / "trainer.sbatch"), str(cfg)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    jobid = sub.stdout.strip().split(";")[0]
    ref_cfg = config(ref_dir)
    ref = subprocess.Popen([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(ref_cfg)], env=env,
                           stdout=subprocess.DEVNULL, stderr=open(ref_dir / "stderr.txt", "w"))
    try:
        wait_until(held.exists, 240, f"job {jobid} did not reach step {hold}", log)
        before = trained_prompts(run_dir / "prompts.jsonl")
        assert sorted(before) == list(range(hold)), before.keys()           # it trains, under srun
        sig = subprocess.run(["scancel", "--signal=USR1", jobid], capture_output=True, text=True, timeout=30)
        assert sig.returncode == 0, sig.stderr
        release.touch()                                                      # the ranks finish step 4
        wait_until(lambda: job(jobid).get("Restarts") == "1" and job(jobid).get("JobState") == "PENDING", 120,
                   f"job {jobid} was not requeued", log)
        # Slurm holds a requeued batch job for 121 s (BeginTime) before it may start again: start it now
        subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"], check=True, timeout=30)
        wait_until(lambda: job(jobid).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", None),
                   240, f"job {jobid} did not end after its requeue", log)
        assert job(jobid)["JobState"] == "COMPLETED", (job(jobid).get("JobState"), log.read_text()[-3000:])
        assert ref.wait(timeout=240) == 0, (ref_dir / "stderr.txt").read_text()[-3000:]
    finally:
        if job(jobid).get("JobState") in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            subprocess.run(["scancel", jobid], timeout=30)
        if ref.poll() is None:
            ref.kill()
            ref.wait()

    text = log.read_text()
    assert "restart 0," in text and "restart 1," in text, text[-3000:]
    for suffix in ("", ".rank1"):           # each rank: every step trained once, in order, as uninterrupted
        lines = (run_dir / f"prompts.jsonl{suffix}").read_text().splitlines()
        assert [int(ln.split('"step": ')[1].split(",")[0]) for ln in lines] == list(range(steps)), lines
        assert trained_prompts(run_dir / f"prompts.jsonl{suffix}") == trained_prompts(ref_dir / f"prompts.jsonl{suffix}")
    got, want = scalars(run_dir), scalars(ref_dir)
    for tag in ["train/loss", "train/ess", "train/grad_norm", "rollout/reward_mean"]:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]] == list(range(1, steps + 1)), tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want[tag]], abs=1e-6), tag
    assert f"lit-ess: preempted (SIGUSR1) at step {hold + 1}" in text, text[-3000:]


def test_ckpt_path_last_takes_the_preemption_checkpoint_when_newer(tmp_path):
    """`--ckpt_path last` picks the newest of last.ckpt and the HPC checkpoints saved at preemption, and
    passes over a torn one."""
    import torch

    ckpt, hpc = tmp_path / "ckpt", [tmp_path / "hpc_ckpt_1.ckpt", tmp_path / "hpc_ckpt_2.ckpt"]
    ckpt.mkdir()
    files = [ckpt / "epoch=0-step=3.ckpt", ckpt / "last.ckpt", *hpc]
    for i, f in enumerate(files):
        torch.save({"step": i}, f)
        os.utime(f, ns=(i * 10**9, i * 10**9))
    assert resolve_resume("last", [ckpt], hpc) == (str(hpc[1]), None)
    assert resolve_resume("last", [ckpt], []) == (str(ckpt / "last.ckpt"), None)
    os.utime(ckpt / "last.ckpt", ns=(10**10, 10**10))                    # last.ckpt newer: it wins
    assert resolve_resume("last", [ckpt], hpc) == (str(ckpt / "last.ckpt"), None)
    os.utime(ckpt / "last.ckpt", ns=(10**9, 10**9))
    hpc[1].write_bytes(hpc[1].read_bytes()[:100])                        # torn: the next newest
    path, notice = resolve_resume("last", [ckpt], hpc)
    assert path == str(hpc[0]) and "hpc_ckpt_2.ckpt is unreadable" in notice, notice
    assert resolve_resume("last", [], hpc)[0] == str(hpc[0])             # no ModelCheckpoint folder
