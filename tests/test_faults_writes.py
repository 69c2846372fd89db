"""Artifacts are written whole or not at all, and one run owns a checkpoint folder (issue 25): a full
disk during an export leaves nothing that looks like a model, a second run into a checkpoint folder
refuses to start, naming the first."""
import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from e2e_utils import cli, kill_session, pythonpath, rl_config, write_config
from test_faults_input import _checkpoint
from test_faults_state import fault_line


def _export_with_file_limit(ckpt, out, limit: int | None) -> subprocess.CompletedProcess:
    """`lit-ess-export ckpt out` in a process that may write at most `limit` bytes per file (RLIMIT_FSIZE,
    SIGXFSZ ignored): a write past it fails with EFBIG, as a full disk fails one with ENOSPC."""
    import resource

    def limited():
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = dict(os.environ, PYTHONPATH=pythonpath())
    return subprocess.run([sys.executable, "-m", "lit_ess.export", str(ckpt), str(out)], env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=limited)


def test_export_onto_a_full_disk_is_one_line_and_leaves_no_folder(tiny_model_dir, tmp_path):
    """The weights file cannot be written (config.json can): one line naming the export, no folder (main:
    a bare safetensors traceback and a folder with config.json and no weights)."""
    ckpt = _checkpoint(tiny_model_dir, tmp_path / "last.ckpt")
    out = tmp_path / "export"
    res = _export_with_file_limit(ckpt, out, 200_000)
    line = fault_line(res, code=2, prog="lit-ess-export")
    assert line.endswith(f"export {out} not written (File too large); nothing was left there"), line
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_atomic_folder_on_enospc(tmp_path):
    """A write that raises ENOSPC (what a full disk raises) inside the block: one OSError naming the
    folder, no temp folder left, an existing folder untouched."""
    from lit_ess.checkpoint import atomic_folder

    out = tmp_path / "model"
    with pytest.raises(OSError, match=rf"export {out} not written \(No space left on device\); nothing was left there$"):
        with atomic_folder(out, "export") as tmp:
            (tmp / "config.json").write_text("{}")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert os.listdir(tmp_path) == []
    with atomic_folder(out, "export") as tmp:
        (tmp / "config.json").write_text("{}")
    with pytest.raises(OSError, match="the previous one is kept"):
        with atomic_folder(out, "export") as tmp:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert os.listdir(tmp_path) == ["model"] and os.listdir(out) == ["config.json"]


def test_a_checkpoint_folder_lock_names_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    from lit_ess.checkpoint import lock_folder

    folder, host = tmp_path / "ckpt", socket.gethostname()
    lock = tmp_path / ".ckpt.lit-ess.lock"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{other.pid} {host}\n")
        with pytest.raises(ValueError, match=rf"checkpoint folder {folder} is in use by another run \(pid {other.pid}\)"):
            lock_folder(folder)
    finally:
        other.kill()
        other.wait()
    assert lock_folder(folder) == f"checkpoint folder {folder}: taking over the lock of pid {other.pid}, which is no longer running"
    assert lock.read_text() == f"{os.getpid()} {host}\n"
    assert lock_folder(folder) is None                 # held by this process already
    lock.write_text(f"{other.pid} another-host\n")
    with pytest.raises(ValueError, match=rf"pid {other.pid} on another-host"):
        lock_folder(folder)



def test_a_lock_left_by_a_run_killed_on_another_host_is_taken_over_once_it_is_stale(tmp_path, monkeypatch):
    """A run killed on host A (preempted, requeued on host B, or a new container: a new host name) leaves its
    lock; its liveness cannot be checked from B. The holder refreshes the lock's mtime; a lock from another
    host not refreshed for LOCK_STALE_S is taken over with a notice, a fresh one still refuses (review of
    issue 25: the resume on B refused for ever)."""
    import lit_ess.checkpoint as ck

    monkeypatch.setattr(ck, "LOCK_REFRESH_S", 0.05)
    folder, lock = tmp_path / "ckpt", tmp_path / ".ckpt.lit-ess.lock"
    lock.write_text("4242 another-host\n")
    with pytest.raises(ValueError, match="pid 4242 on another-host"):       # refreshed just now: a live run
        ck.lock_folder(folder)
    old = time.time() - ck.LOCK_STALE_S - 60
    os.utime(lock, (old, old))
    notice = ck.lock_folder(folder)
    assert notice is not None and "taking over the lock of pid 4242 on another-host" in notice, notice
    assert lock.read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    os.utime(lock, (old, old))                                     # the holder keeps its lock fresh
    deadline = time.monotonic() + 60                               # (its thread, every 0.05 s: however loaded
    while time.time() - lock.stat().st_mtime > 5 and time.monotonic() < deadline:   # the machine, it comes round)
        time.sleep(0.05)
    assert time.time() - lock.stat().st_mtime < 5

@pytest.mark.e2e
def test_a_second_run_into_one_checkpoint_folder_refuses_to_start(tiny_model_dir, tmp_path):
    """Run A writes checkpoints into runs/ckpt; run B, started into the same folder once A holds it (its
    lock names A's pid: A is past the start of fit), stops at start with one line naming the folder and
    A's pid (main: B starts, and both write the same temp file)."""
    cfg = rl_config(tiny_model_dir, tmp_path, engine="HFConfig", max_steps=200, ckpt_every=1)
    path = write_config(cfg, tmp_path / "c.yaml")
    env = dict(os.environ, PYTHONPATH=pythonpath())
    first = subprocess.Popen([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(path)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        lock, deadline = tmp_path / ".ckpt.lit-ess.lock", time.time() + 120
        while not (lock.exists() and lock.read_text().split()[:1] == [str(first.pid)]) and time.time() < deadline \
                and first.poll() is None:
            time.sleep(0.2)
        assert first.poll() is None, "run A ended early"
        res = cli(["fit", "--config", str(path)], timeout=300)
        line = fault_line(res, code=2)
        assert f"checkpoint folder {tmp_path / 'ckpt'} is in use by another run (pid {first.pid})" in line, line
    finally:
        kill_session(first)


def test_export_onto_a_folder_that_is_not_a_model_keeps_its_files(tiny_model_dir, tmp_path, capsys):
    """`lit-ess-export CKPT OUT` with OUT the checkpoint's own folder (or a run folder): the export replaces
    OUT whole, so it must refuse a folder that holds other files, naming it, and delete nothing (review of
    issue 25: the checkpoint was deleted)."""
    from lit_ess.export import main

    folder = tmp_path / "ckpt"
    folder.mkdir()
    ckpt = _checkpoint(tiny_model_dir, folder / "last.ckpt")
    with pytest.raises(SystemExit) as e:
        main([str(ckpt), str(folder)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("lit-ess-export: error: ") and str(folder) in err, err
    assert os.listdir(folder) == ["last.ckpt"] and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_export_hf_refuses_a_folder_that_is_not_a_model_at_start(tmp_path):
    """ExportHF replaces its dirpath whole at the end of fit: a folder holding other files is refused when
    the callback is built, not after the run (review of issue 25)."""
    from lit_ess.callbacks import ExportHF

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="ExportHF.dirpath"):
        ExportHF(dirpath=str(tmp_path))
    (tmp_path / "notes.txt").unlink()
    ExportHF(dirpath=str(tmp_path))                       # an empty folder is fine
