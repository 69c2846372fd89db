"""Every fault path of a multi-process run prints one line and leaves no process behind (issue 25): a
rank killed with kill -9 is named on the other, a dead launcher is named on the rank it started, and
Ctrl-C or SIGTERM stops every process (ranks, rollout workers, reward workers) within 2 s of the
launcher, saying where the last checkpoint is."""
import os
import signal
import subprocess
import sys
import time

import pytest

from e2e_utils import kill_session, pythonpath, rl_config, session_processes, write_config


def _two_rank_async(model_dir, out, **kw):
    """2 ranks (DDP, gloo), async rollouts with the hf engine, rewards in a reward worker process."""
    cfg = rl_config(model_dir, out, engine="HFConfig", max_steps=200, prompts=4, samples=2, **kw,
                    extra_data={"schedule": {"mode": "async"}, "reward_limits": {"in_worker": True}})
    cfg["trainer"]["devices"], cfg["trainer"]["strategy"] = 2, "ddp"
    return cfg


def _sigint_as_in_a_terminal():
    """The run's SIGINT as a terminal's foreground job has it (the default: Python's KeyboardInterrupt). A suite
    started in the background by a non-interactive shell (`cmd &`) runs with SIGINT ignored, every child inherits
    that, and Python then installs no handler: the test's Ctrl-C did nothing and the run went on to max_steps."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(cfg, out, act=None):
    """Start `lit-ess fit` in its own session; `act(proc)` once it runs (None: wait for the end). Returns
    (exit code, stderr, the session's processes still alive 2 s after the launcher ended)."""
    env = dict(os.environ, PYTHONPATH=pythonpath())
    err = open(out / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "lit_ess.cli", "fit", "--config", str(write_config(cfg, out / "c.yaml"))],
                            env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                            preexec_fn=_sigint_as_in_a_terminal)
    try:
        if act is not None:
            act(proc)
        proc.wait(timeout=300)
        time.sleep(2.0)
        left = session_processes(proc.pid)
    finally:
        kill_session(proc)
    err.seek(0)
    return proc.returncode, err.read(), left


def _after_checkpoint(out, then):
    def act(proc):
        deadline = time.time() + 240
        while not list((out / "ckpt").glob("*.ckpt")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before its first checkpoint"
        then(proc)
    return act


def _lines(err):
    return [ln for ln in err.splitlines() if ln.startswith("lit-ess: error:")]


@pytest.mark.e2e
@pytest.mark.parametrize("rank", [1, 0], ids=["rank 1", "the launcher"])
def test_a_rank_killed_mid_run_is_named_and_nothing_is_left(tiny_model_dir, tmp_path, rank):
    """kill -9 of one rank after step 2 of a 2-rank async run: the other rank says which rank died in one
    line, and no process of the run is left 2 s after the launcher (main: a bare gloo 'Connection
    reset' traceback)."""
    cfg = _two_rank_async(tiny_model_dir, tmp_path)
    cfg["trainer"]["callbacks"].append({"class_path": "e2e_utils.KillRankAt", "init_args": {"rank": rank, "step": 2}})
    code, err, left = _run(cfg, tmp_path)
    assert "Traceback" not in err, err[-3000:]
    lines = _lines(err)
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"lit-ess: error: rank {rank} (") and "died" in lines[0], lines[0]
    assert code != 0, err[-2000:]      # 1, or -9 when Lightning's launcher ends the group first (or was the one killed)
    assert left == [], left


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_sigterm_or_ctrl_c_stops_every_process_and_names_the_last_checkpoint(tiny_model_dir, tmp_path, how):
    """SIGTERM to the launcher, or SIGINT to the whole process group (Ctrl-C in a terminal), after the
    first checkpoint of a 2-rank async run: no process of the run (ranks, rollout workers, reward
    workers) is alive 2 s after the launcher ended, and one line names the last checkpoint (main: worker
    processes outlive the launcher by 5-10 s, and nothing says where the checkpoint is)."""
    cfg = _two_rank_async(tiny_model_dir, tmp_path, ckpt_every=1)

    def stop(proc):
        os.kill(proc.pid, signal.SIGTERM) if how == "SIGTERM" else os.killpg(proc.pid, signal.SIGINT)
    code, err, left = _run(cfg, tmp_path, _after_checkpoint(tmp_path, stop))
    assert left == [], left
    notice = [ln for ln in err.splitlines() if ln.startswith("lit-ess: stopped at step")]
    assert len(notice) == 1 and f"last checkpoint: {tmp_path / 'ckpt'}" in notice[0], err[-3000:]
    assert code != 0, err[-2000:]
