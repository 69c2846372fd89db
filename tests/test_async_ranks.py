"""Async rollouts on W = 2 data-parallel ranks, scheduling only: the fake engine (milliseconds per
call) in real worker processes, the two ranks as two threads whose collective is a barrier (a fake
for the process group: the real one is tested end to end in test_dist_async.py)."""
import os
import threading
import time
from collections import Counter

import pytest
import torch

from lit_ess.rollout import RankFailed, WorkerError, WorkerProcess
from fake_engine import FakeConfig
from lit_ess.sampling import SamplingConfig
from test_async import make_dm, weights


class ThreadRanks:
    """`world` threads, one per rank; all_gather meets at a barrier."""

    def __init__(self, rank: int, world: int, shared: dict):
        self.rank, self.world, self.shared = rank, world, shared

    def all_gather(self, obj) -> list:
        self.shared["slots"][self.rank] = obj
        self.shared["barrier"].wait(timeout=60)
        out = list(self.shared["slots"])
        self.shared["barrier"].wait(timeout=60)
        return out


def on_two_ranks(fn, **kw):
    """Run fn(dm, rank) on two ranks (threads) with their own data modules; returns (results, errors)."""
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    results, errors, dms = [None, None], [None, None], [None, None]

    def rank_main(r):
        try:
            latency = kw.get("latency", [0.02, 0.02])[r]
            dm = make_dm(kw["model_dir"], latency=latency, prompts=4, setup=False,
                         **{k: v for k, v in kw.items() if k not in ("model_dir", "latency")})
            dms[r] = dm
            dm.ranks = ThreadRanks(r, 2, shared)
            dm.setup("fit")
            results[r] = fn(dm, r)
        except BaseException as e:      # noqa: BLE001
            errors[r] = e
            # a real rank exits, and its peers' later collectives fail: abort the barrier, but only after the
            # peer has left the all-gather this rank just finished (it may not have woken up yet)
            threading.Timer(2.0, shared["barrier"].abort).start()
        finally:
            if dms[r] is not None:
                dms[r].teardown("fit")
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results, errors


def drive(dm, steps, train_seconds=0.0):
    """What the Trainer and WeightSync do on each rank; returns the batches and the steps pushed."""
    dm.push_weights(weights(0), 0)
    out, pushed = [], []
    for step in range(steps):
        out.append(dm.next_batch(step))
        time.sleep(train_seconds)
        if dm.wants_weights(step + 1):
            dm.push_weights(weights(step + 1), step + 1)
            pushed.append(step + 1)
    return out, pushed


@pytest.mark.parametrize("S, k, latency, train", [
    (1, 1, [0.0, 0.05], 0.01), (2, 1, [0.03, 0.0], 0.0), (3, 2, [0.0, 0.02], 0.01), (1, 2, [0.02, 0.02], 0.0)])
def test_two_ranks_keep_the_bound_push_together_and_split_every_phase(tiny_model_dir, S, k, latency, train):
    steps = 8
    res, err = on_two_ranks(lambda dm, r: drive(dm, steps, train), model_dir=tiny_model_dir, S=S, k=k,
                            latency=latency)
    assert err == [None, None], err
    (b0, pushed0), (b1, pushed1) = res
    assert pushed0 == pushed1                                   # every rank enters the gather at the same steps
    for batches in (b0, b1):
        lags = [int(step - v) for step, b in enumerate(batches) for v in b.versions]
        assert max(lags) <= S
    # the phase's 4 prompts: 2 per rank, disjoint, every group whole (2 samples) and trained once
    one, _ = _one_rank_phases(tiny_model_dir, steps // k, k)
    for p in range(steps // k):
        rows = [[i for b in bs if b.phase == p for i in b.prompt_ids.tolist()] for bs in (b0, b1)]
        assert not set(rows[0]) & set(rows[1])
        assert sorted(rows[0] + rows[1]) == one[p]
        assert all(sorted(Counter(r).values()) == [2, 2] for r in rows)


def _one_rank_phases(model_dir, phases, k):
    dm = make_dm(model_dir, mode="sync", prompts=4, k=k)
    try:
        dm.push_weights(weights(0), 0)
        return {p: sorted(i for b in dm.generate_phase() for i in b.prompt_ids.tolist()) for p in range(phases)}, None
    finally:
        dm.teardown("fit")


def test_a_dead_worker_stops_both_ranks_with_its_cause(tiny_model_dir):
    """Rank 1's worker is killed at step 2: both ranks raise within seconds, the rank that saw it with the
    worker's exit code, the other naming that rank."""
    def fn(dm, r):
        dm.push_weights(weights(0), 0)
        for step in range(6):
            dm.next_batch(step)
            if step == 2 and isinstance(dm.executor, WorkerProcess) and r == 1:
                os.kill(dm.executor.proc.pid, 9)
            if dm.wants_weights(step + 1):
                dm.push_weights(weights(step + 1), step + 1)
        return "finished"
    t0 = time.monotonic()
    res, err = on_two_ranks(fn, model_dir=tiny_model_dir, S=1, k=1)
    assert time.monotonic() - t0 < 60
    assert res == [None, None] and all(isinstance(e, (WorkerError, RankFailed)) for e in err), err
    assert isinstance(err[1], WorkerError) and "exit code -9" in str(err[1]), err       # rank 1 saw it
    assert isinstance(err[0], RankFailed) and "rank 1 stopped" in str(err[0]) and "exit code -9" in str(err[0])


def test_placement_dedicated_needs_the_server_engine(tiny_model_dir):
    """placement: dedicated is vLLM servers shared by every rank: another engine is refused at once, in one
    line naming the fix."""
    with pytest.raises(ValueError, match=r"^data.schedule.placement: dedicated generates on vLLM servers .* not with FakeConfig: "
                                         r"set data.engine to lit_ess.engines.VLLMServerConfig"):
        make_dm(tiny_model_dir, placement="dedicated", setup=False)


def test_the_server_rank_0_launches_on_cpu_gets_every_ranks_threads():
    """CPU: the one server generates both ranks' shares, so it gets both ranks' threads (OMP_NUM_THREADS =
    2 x the trainer's torch threads); not where the engine config sets its own, nor on GPUs."""
    from lit_ess.rollout.placement import dedicated_threads

    want = {} if torch.cuda.is_available() else {"OMP_NUM_THREADS": str(2 * torch.get_num_threads())}
    assert dedicated_threads(2, {}) == want
    assert dedicated_threads(2, {"OMP_NUM_THREADS": "3"}) == {}
