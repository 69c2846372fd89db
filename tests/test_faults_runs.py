"""Faults that must stop a run loudly or be survived, never give a silent wrong run: a checkpoint torn
by a kill or a full disk, a rollout worker that hangs, a reward that hangs."""
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from e2e_utils import cli, kill_when_rewritten, rl_config, write_config
from lit_ess.checkpoint import unreadable
from lit_ess.datamodules.settings import BatchShape, RewardLimits, Schedule


def _other_filesystem_tmpdir(than: Path) -> str | None:
    """A temp folder on another filesystem than `than` (tmpfs), as on the shared filesystems of
    multi-node runs; None when this machine has none."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != than.stat().st_dev:
        return tempfile.mkdtemp(dir=shm, prefix="lit-ess-test-")
    return None


@pytest.mark.e2e
def test_kill_during_checkpoint_write_and_torn_last_ckpt_resume(tiny_model_dir, tmp_path):
    """kill -9 while last.ckpt is rewritten, the temp folder on another filesystem: last.ckpt stays
    whole. A torn last.ckpt (as a copy across filesystems left it) is named in one line and the run
    resumes from the newest whole checkpoint instead, training each step once."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=3, ckpt_every=1)
    cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.RecordPrompts",
                                        "init_args": {"path": str(tmp_path / "prompts.jsonl")}})
    path = write_config(cfg, tmp_path / "config.yaml")
    ckpt, tmpdir = tmp_path / "ckpt", _other_filesystem_tmpdir(tmp_path)
    try:
        kill_when_rewritten(path, ckpt / "last.ckpt", env=dict(os.environ, TMPDIR=tmpdir or tempfile.gettempdir()))
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    assert unreadable(ckpt / "last.ckpt") is None
    intact = sorted(ckpt.glob("epoch=*.ckpt"), key=lambda p: p.stat().st_mtime_ns)[-1]
    last = ckpt / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 10])          # torn
    before = len((tmp_path / "prompts.jsonl").read_text().splitlines())
    res = cli(["fit", "--config", str(path), "--ckpt_path", "last"])
    assert res.returncode == 0, res.stderr[-4000:]
    notice = [ln for ln in res.stderr.splitlines() if "unreadable" in ln]
    assert len(notice) == 1 and "last.ckpt" in notice[0] and f"resuming from {intact}" in notice[0], res.stderr[-2000:]
    resumed_at = int(intact.name.split("step=")[1].split(".")[0])
    resumed = [json.loads(ln)["step"] for ln in (tmp_path / "prompts.jsonl").read_text().splitlines()[before:]]
    assert resumed_at >= 1 and resumed == list(range(resumed_at, 3))


def test_an_explicit_torn_checkpoint_is_one_line(tiny_model_dir, tmp_path):
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig")
    torn = tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    torn.parent.mkdir()
    torn.write_bytes(b"PK\x03\x04" + b"\0" * 1000)
    res = cli(["fit", "--config", str(write_config(cfg, tmp_path / "c.yaml")), "--ckpt_path", str(torn)])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"--ckpt_path {torn}: torn or not a checkpoint" in res.stderr


def test_readable_judges_shard_folders_by_their_parts(tmp_path):
    """A sharded checkpoint (DCP shards + .metadata, then rank 0's meta.pt) is whole when meta.pt is
    and no shard is newer: a shard rewritten after meta.pt is a folder caught mid-rewrite."""
    import torch

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    (folder / ".metadata").write_bytes(b"\0")
    assert unreadable(folder) == "a folder without meta.pt"
    torch.save({"global_step": 3}, folder / "meta.pt")
    assert unreadable(folder) is None
    later = (folder / "meta.pt").stat().st_mtime_ns + 10**9
    os.utime(folder / "__0_0.distcp", ns=(later, later))
    assert "newer than meta.pt" in unreadable(folder)


@pytest.mark.parametrize("fault", ["engine hangs", "SIGSTOP"])
def test_a_stalled_async_worker_stops_the_run_with_its_pid_and_stage(tiny_model_dir, fault):
    """The async worker hangs in its engine (fake engine) or is stopped (SIGSTOP) while phase 1 is in
    flight: the trainer's wait ends after worker_timeout with an error naming the pid and the stage,
    and the worker is gone."""
    import signal
    import time

    from fake_engine import FakeConfig
    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.sampling import SamplingConfig
    from lit_ess.rollout import WorkerError
    from test_async import weights

    dm = RolloutDataModule(model_path=tiny_model_dir, engine=FakeConfig(latency=0.0, hang_on_call=1 if fault == "engine hangs" else -1),
                           schedule=Schedule(mode="async", max_staleness=0, worker_timeout=1.0), batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2),
                           source=Arithmetic(size=40), sampling=SamplingConfig(max_new_tokens=3, seed=0),
                           reward="e2e_utils:digit_fraction")
    dm.setup("fit")
    try:
        dm.push_weights(weights(0), 0)
        dm.next_batch(0)                            # S = 0: phase 1 starts only after the next push
        pid = dm.executor.proc.pid
        if fault == "SIGSTOP":
            os.kill(pid, signal.SIGSTOP)
        dm.push_weights(weights(1), 1)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rollout worker \(pid {pid}\) sent nothing for \d+ s while (\w.*) "
                                              rf"\(requested: phase 1\)") as e:
            dm.next_batch(1)
        assert time.monotonic() - t0 < 10
        if fault == "engine hangs":
            assert "while sampling phase 1" in str(e.value)
        dm.executor.proc.join(timeout=5)
        assert not dm.executor.proc.is_alive()
    finally:
        dm.teardown("fit")


def test_a_custom_reward_that_hangs_times_out_in_the_worker(tiny_model_dir):
    """reward_in_worker: a `module:function` reward that never returns on some inputs scores 0 on
    them after reward_timeout, counted in rollout/reward_timeouts; the others are scored normally."""
    from fake_engine import FakeConfig
    from hanging_rewards import digits_unless_five
    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.sampling import SamplingConfig

    dm = RolloutDataModule(model_path=tiny_model_dir, engine=FakeConfig(latency=0.0), batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2), source=Arithmetic(size=40), sampling=SamplingConfig(max_new_tokens=3, seed=0),
                           reward="hanging_rewards:digits_unless_five", reward_limits=RewardLimits(in_worker=True, timeout=0.5))
    dm.setup("fit")
    try:
        batch = dm.next_batch(0)
    finally:
        dm.teardown("fit")
    answers = [dm.source.examples[i].answer for i in batch.prompt_ids.tolist()]
    hung = [a.endswith("5") for a in answers]
    assert 0 < sum(hung) < len(hung), answers                 # the test needs both kinds of rows
    assert batch.stats["rollout/reward_timeouts"] == sum(hung)
    assert batch.stats["rollout/reward_errors"] == 0
    for a, h, r, text in zip(answers, hung, batch.rewards.tolist(), batch.completion_texts, strict=True):
        assert r == (0.0 if h else pytest.approx(digits_unless_five(text, "0")))


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path):
    """A write that fails midway (a disk with 100 kB left: RLIMIT_FSIZE) raises one OSError that
    names the checkpoint, leaves no temp file, and the previous checkpoint loads."""
    import resource
    import signal

    import torch

    from lit_ess.checkpoint import AtomicCheckpointIO

    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.zeros(10)}, path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(OSError, match=rf"checkpoint {path} not written \(File too large\); the previous one is kept"):
            io.save_checkpoint({"step": 2, "w": torch.zeros(100_000)}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert os.listdir(tmp_path) == ["last.ckpt"] and torch.load(path)["step"] == 1


def test_a_long_training_step_is_not_a_stalled_worker(tiny_model_dir):
    """S = 1: the worker finishes phase 2 while step 1 trains for longer than worker_timeout; the next
    request is judged from its own submission, not from the old result read late."""
    import time

    from fake_engine import FakeConfig
    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.sampling import SamplingConfig
    from test_async import weights

    dm = RolloutDataModule(model_path=tiny_model_dir, engine=FakeConfig(latency=0.05), schedule=Schedule(mode="async", max_staleness=1, worker_timeout=2.0),
                           batch=BatchShape(prompts_per_rollout=2, samples_per_prompt=2), source=Arithmetic(size=40),
                           sampling=SamplingConfig(max_new_tokens=3, seed=0), reward="e2e_utils:digit_fraction")
    dm.setup("fit")
    try:
        dm.push_weights(weights(0), 0)
        for step in range(3):
            dm.next_batch(step)
            time.sleep(4.0 if step == 0 else 0.0)      # a training step twice as long as worker_timeout
            dm.push_weights(weights(step + 1), step + 1)
    finally:
        dm.teardown("fit")
