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
from lit_ess.engines import SamplingConfig
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


@pytest.mark.parametrize("placement", ["colocated", "dedicated"])
@pytest.mark.parametrize("S, k, latency, train", [
    (1, 1, [0.0, 0.05], 0.01), (2, 1, [0.03, 0.0], 0.0), (3, 2, [0.0, 0.02], 0.01), (1, 2, [0.02, 0.02], 0.0)])
def test_two_ranks_keep_the_bound_push_together_and_split_every_phase(tiny_model_dir, placement, S, k, latency, train):
    if placement == "dedicated":
        latency = [latency[0], latency[0]]           # one engine: rank 0's
    steps = 8
    res, err = on_two_ranks(lambda dm, r: drive(dm, steps, train), model_dir=tiny_model_dir, S=S, k=k,
                            latency=latency, placement=placement)
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


@pytest.mark.parametrize("placement", ["colocated", "dedicated"])
def test_a_dead_worker_stops_both_ranks_with_its_cause(tiny_model_dir, placement):
    """Rank 1's worker (colocated) or the one worker (dedicated) is killed at step 2: both ranks raise
    within seconds, the rank that saw it with the worker's exit code, the other naming that rank."""
    def fn(dm, r):
        dm.push_weights(weights(0), 0)
        for step in range(6):
            dm.next_batch(step)
            if step == 2 and isinstance(dm.executor, WorkerProcess) and (placement == "dedicated" or r == 1):
                os.kill(dm.executor.proc.pid, 9)
            if dm.wants_weights(step + 1):
                dm.push_weights(weights(step + 1), step + 1)
        return "finished"
    t0 = time.monotonic()
    res, err = on_two_ranks(fn, model_dir=tiny_model_dir, S=1, k=1, placement=placement)
    assert time.monotonic() - t0 < 60
    assert res == [None, None] and all(isinstance(e, (WorkerError, RankFailed)) for e in err), err
    if placement == "colocated":           # rank 1 saw its worker die; rank 0 names rank 1 and the cause
        assert isinstance(err[1], WorkerError) and "exit code -9" in str(err[1]), err
        assert isinstance(err[0], RankFailed) and "rank 1 stopped" in str(err[0]) and "exit code -9" in str(err[0])
    else:                                  # rank 0 saw its process die, rank 1 its connection close
        assert any("exit code -9" in str(e) for e in err) or all("exited" in str(e) for e in err), err


@pytest.fixture(scope="module")
def dedicated_checkpoint(tiny_model_dir):
    """The data modules' state_dicts of a dedicated run on two ranks (S = 2, k = 1), taken while phases are
    in flight and rank 0 has read more than rank 1; with what each rank held and what rank 0 planned."""
    def run(dm, r):
        drive(dm, 2)
        time.sleep(1.0)
        dm.ranks.all_gather(None)
        dm.push_weights(weights(2), 2)
        if r == 0:
            dm._collect(0)                        # rank 0 reads what has arrived (as in wants_weights)
            dm._start_admissible(2)               # and submits the admissible phases (as in next_batch)
        dm.ranks.all_gather(None)
        time.sleep(1.0)                            # the worker delivers: rank 1's shares wait in its inbox
        state = dm.state_dict()
        return state, sorted(dm.buffer.ready), sorted(dm.requests)
    return on_two_ranks(run, model_dir=tiny_model_dir, S=2, k=1, placement="dedicated")


def test_dedicated_checkpoint_agrees_across_ranks_and_resumes(tiny_model_dir, dedicated_checkpoint):
    """A checkpoint while phases are in flight: rank 0 has read less than rank 1 (or the other way
    round), and state_dict first brings both to the same phase, so the phases rank 0 regenerates after
    the resume are exactly those no rank holds. (The drain once let a lagging rank read past the
    others: the resume then failed with "arrived twice", or waited for ever for a phase no one made.)"""
    res, err = dedicated_checkpoint
    assert err == [None, None], err
    (state, ready0, planned), (_, ready1, _) = res
    assert ready0 == ready1 and not set(ready1) & set(planned), (ready0, ready1, planned)

    def resume(dm, r):
        dm.load_state_dict(state)
        dm.push_weights(weights(2), 2)
        out = []
        for step in range(2, 7):
            out.append(dm.next_batch(step))
            if dm.wants_weights(step + 1):
                dm.push_weights(weights(step + 1), step + 1)
        return [b.phase for b in out]
    res, err = on_two_ranks(resume, model_dir=tiny_model_dir, S=2, k=1, placement="dedicated")
    assert err == [None, None], err
    assert res[0] == res[1] == list(range(2, 7))


def test_a_checkpoint_of_one_placement_does_not_resume_under_the_other(tiny_model_dir, dedicated_checkpoint):
    res, err = dedicated_checkpoint
    assert err == [None, None], err

    def resume(dm, r):
        dm.load_state_dict(res[0][0])
    _, err = on_two_ranks(resume, model_dir=tiny_model_dir, S=2, k=1, placement="colocated")
    assert all(isinstance(e, ValueError) and "placed dedicated (data.placement), this run's colocated" in str(e)
               for e in err), err


ROUNDS = [[[(0, "1+1=", "2"), (1, "2+2=", "4")], [(2, "3+3=", "6")]],      # [rank 0's, rank 1's]
          [[(3, "4+4=", "8")], []], [[], []], [[(4, "5+5=", "10")], [(5, "6+6=", "12"), (6, "7+7=", "14")]]]


@pytest.fixture(scope="module")
def dedicated_evaluation(tiny_model_dir):
    """Each rank's held-out results for ROUNDS on a dedicated run of two ranks, and rank 0's worker's
    environment."""
    def fn(dm, r):
        dm.push_weights(weights(0), 0)
        return [dm.evaluate(chunks[r]) for chunks in ROUNDS], dict(dm.executor.env) if r == 0 else None
    return on_two_ranks(fn, model_dir=tiny_model_dir, placement="dedicated", val_samples=2,
                        reward="e2e_utils:varies_unless_const")


def test_dedicated_evaluation_is_one_engine_call_split_between_the_ranks(tiny_model_dir, dedicated_evaluation):
    """Dedicated placement: rank 0's worker evaluates both ranks' held-out prompts in one engine call and
    each rank gets its own rows, exactly what one rank evaluating them all gets; a rank with no prompts,
    or a round where no rank has any, still takes part. (The fake engine's completions depend on a
    prompt's position in its call, and this reward on the completion: a wrong split shows.)"""
    rounds, reward = ROUNDS, "e2e_utils:varies_unless_const"
    res, err = dedicated_evaluation
    assert err == [None, None], err
    res = [evals for evals, _ in res]
    one = make_dm(tiny_model_dir, val_samples=2, reward=reward)
    try:
        one.push_weights(weights(0), 0)
        want = [one.evaluate(chunks[0] + chunks[1]) for chunks in rounds]
    finally:
        one.teardown("fit")
    assert len(set(want[0]["reward"].flatten().tolist())) > 1
    for i, chunks in enumerate(rounds):
        n0 = len(chunks[0])
        for key in ("reward", "length"):
            assert torch.equal(res[0][i][key], want[i][key][:n0]) and torch.equal(res[1][i][key], want[i][key][n0:])


@pytest.mark.parametrize("connected", [False, True])
def test_a_receiver_closes_at_once_whether_or_not_the_worker_connected(connected):
    """Teardown of a rank > 0 (dedicated): close() returns at once and its reader thread ends, both
    before the worker connected (lit-ess validate: no phase sent) and while a connection is open (the
    end of fit). A close that handshook with its own listener once hung rank 1 at the end of fit."""
    from lit_ess.rollout.process import Deliveries
    from lit_ess.rollout.receiver import ShareReceiver

    r = ShareReceiver()
    r.start()
    d = Deliveries([None, r.address])
    if connected:
        d.send(1, "a result", (0.0, 1.0))
        assert r.poll(timeout=5) == [(-1, "a result")]
    t0 = time.monotonic()
    r.close()
    d.close()
    r.reader.join(timeout=5)
    assert time.monotonic() - t0 < 5 and not r.reader.is_alive()


MEET = threading.Barrier(2, timeout=10)


def both_shares_at_once(completion: str, answer: str) -> float:
    """A reward that returns only when another completion is being scored at the same time (a barrier of
    two): scored one share after the other, the first call waits 10 s and every later one fails. It
    raises for the answer "bad" (after meeting)."""
    MEET.wait()
    if answer == "bad":
        raise ValueError("bad answer")
    return 1.0


def test_dedicated_worker_scores_the_shares_at_the_same_time(tiny_model_dir):
    """Dedicated placement: one worker scores every rank's share, each share by its own scorer at the same
    time (as each rank scores its own in the other placements), so a reward that waits costs one share's
    wait per phase, not the sum. The failure counters are the scorers' total, carried by share 0 only."""
    from lit_ess.rollout.worker import PhaseShares, RolloutRequest, RolloutWorker, WorkerConfig

    MEET.reset()
    cfg = WorkerConfig(model_path=tiny_model_dir, engine=FakeConfig(latency=0.0), samples_per_prompt=2,
                       sampling=SamplingConfig(max_new_tokens=3, seed=0), reward="test_async_ranks:both_shares_at_once")
    worker = RolloutWorker(cfg, in_process=False)
    shares = [RolloutRequest(0, [0, 1, 2], [[49, 43, 49]] * 3, ["1+1"] * 3, ["2", "2", "2"], [0, 1, 2]),
              RolloutRequest(0, [3, 4, 5], [[50, 43, 50]] * 3, ["2+2"] * 3, ["4", "bad", "4"], [3, 4, 5])]
    try:
        req = PhaseShares(0, shares)
        out = worker.score_shares(req, *worker.sample(req.merged()))
        assert [sorted(x for b in res.batches for x in b.rewards.tolist()) for res in out] == [[1.0] * 6, [0.0] * 2 + [1.0] * 4]
        assert out[0].reward_counters == {"errors": 2, "timeouts": 0} and out[1].reward_counters == {}
        assert [res.batches[0].stats["rollout/reward_errors"] for res in out] == [2.0, 0.0]
        assert worker.counters() == {"errors": 2, "timeouts": 0}
        worker.load_counters({"errors": 5, "timeouts": 1})            # a resumed run's total
        assert worker.counters() == {"errors": 5, "timeouts": 1}
    finally:
        worker.close()


def test_dedicated_worker_on_cpu_gets_every_ranks_threads(dedicated_evaluation):
    """CPU: the dedicated worker generates both ranks' shares, so its process gets both ranks' threads
    (OMP_NUM_THREADS = 2 x the trainer's torch threads), where a colocated worker gets its own rank's."""
    res, err = dedicated_evaluation
    assert err == [None, None], err
    assert res[0][1]["OMP_NUM_THREADS"] == str(2 * torch.get_num_threads())
