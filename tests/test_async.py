"""Asynchronous rollouts: the scheduling invariants with a fake engine (latency injected, milliseconds
per step), the buffer's hard staleness filter, and the worker process's failure modes."""
import os
import subprocess
import sys
import time

from collections import Counter

import pytest
import torch

from lit_ess.datamodules import Arithmetic, RolloutDataModule
from fake_engine import FakeConfig
from lit_ess.sampling import SamplingConfig
from lit_ess.rollout import RolloutBuffer, WorkerError
from lit_ess.batch import Row, collate
from lit_ess.datamodules.settings import BatchShape, Schedule


def weights(version: int):
    return {"w": torch.tensor([float(version)])}.items()


def make_dm(model_dir, mode="async", S=None, k=1, latency=0.02, prompts=3, samples=2, setup=True,
            reward="e2e_utils:digit_fraction", placement="colocated", **kw):
    dm = RolloutDataModule(model_path=model_dir, engine=FakeConfig(latency=latency), schedule=Schedule(mode=mode, placement=placement, max_staleness=S),
                           batch=BatchShape(steps_per_rollout=k, prompts_per_rollout=prompts, samples_per_prompt=samples),
                           source=Arithmetic(size=40), sampling=SamplingConfig(max_new_tokens=3, seed=0),
                           reward=reward, **kw)
    if setup:
        dm.setup("fit")
    return dm


def drive(dm, steps, train_seconds=0.0, planned=None):
    """What the Trainer and lit_ess.callbacks.WeightSync do: push at start, take a batch per step, push when
    the data side asks. Returns the batches; `planned` collects (step, phases planned) after each push."""
    dm.push_weights(weights(0), 0)
    out = []
    for step in range(steps):
        out.append(dm.next_batch(step))
        time.sleep(train_seconds)
        if dm.wants_weights(step + 1):
            dm.push_weights(weights(step + 1), step + 1)
        if planned is not None:
            planned.append((step + 1, dm.next_plan, len(dm.submitted)))
    return out


@pytest.mark.parametrize("S, k, latency, train", [
    (0, 1, 0.02, 0.0), (1, 1, 0.02, 0.0), (2, 1, 0.02, 0.0), (4, 1, 0.0, 0.02), (3, 2, 0.02, 0.0), (1, 2, 0.0, 0.01)])
def test_async_bound_never_exceeded_nothing_lost_or_duplicated(tiny_model_dir, S, k, latency, train):
    dm = make_dm(tiny_model_dir, S=S, k=k, latency=latency)
    planned = []
    try:
        batches = drive(dm, 12, train, planned)
    finally:
        dm.teardown("fit")
    lags = [int(step - v) for step, b in enumerate(batches) for v in b.versions]
    assert max(lags) <= S and dm.buffer.stale_dropped == 0          # admission alone kept the bound
    if S > k - 1:
        # the worker ran ahead of the synchronous schedule (lag k - 1). How far depends on which side is
        # slower on the machine at the time (training: as far as S allows; generation: about one phase),
        # so only the bound itself is asserted exactly
        assert k <= max(lags) <= S
    for b in batches:                                                  # each row came from the weights of
        m = b.completion_mask                                          # its version (shared-memory transport)
        assert torch.equal(b.behavior_logprobs[m], (-b.versions.float())[:, None].expand_as(m)[m])
    # every phase trained whole and once: its prompts' rows are all there, no row twice
    by_phase = {}
    for b in batches:
        by_phase.setdefault(b.phase, []).extend(b.prompt_ids.tolist())
    assert sorted(by_phase) == list(range(12 // k))
    for rows in by_phase.values():                                     # 3 prompts x 2 samples
        assert len(rows) == 6 and sorted(Counter(rows).values()) == [2, 2, 2]
    # admission: a phase is started only with weights fresh enough, so never more than the bound allows
    for version, next_plan, in_flight in planned:
        assert next_plan - 1 <= (version + S - k + 1) // k and in_flight <= 2


def test_async_with_staleness_zero_equals_sync(tiny_model_dir):
    got = {}
    for mode in ("sync", "async"):
        dm = make_dm(tiny_model_dir, mode=mode, S=0, k=1)
        try:
            got[mode] = drive(dm, 5)
        finally:
            dm.teardown("fit")
    for a, b in zip(got["sync"], got["async"]):
        for f in ("input_ids", "completion_mask", "behavior_logprobs", "advantages", "versions", "prompt_ids"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f


def _batch(versions):
    rows = [Row(prompt=[1, 2], completion=[3], logprobs=[-0.5], advantage=1.0, reward=1.0, version=v, prompt_id=i,
                prompt_text="p", completion_text="c") for i, v in enumerate(versions)]
    return collate(rows, 0, phase=0, index=0)


def test_buffer_drops_and_counts_rows_past_the_bound():
    buf = RolloutBuffer(steps_per_rollout=1, max_staleness=1)
    buf.put(0, [_batch([5, 3, 4])])
    b = buf.take(step=5)                           # lags 0, 2, 1: the row of version 3 is too old
    assert b.versions.tolist() == [5, 4] and buf.stale_dropped == 1
    buf.put(1, [_batch([1, 1])])
    buf.put(2, [_batch([6])])
    assert buf.take(step=6).versions.tolist() == [6]          # phase 1 dropped whole, phase 2 served
    assert buf.stale_dropped == 3
    # phase 3 is the next batch: trained at the next step (7), so weights of step 6 are enough with S=1
    assert buf.ahead(3) == 0 and buf.need(3, step=7) == 6


@pytest.mark.parametrize("mode, S", [("sync", 0), ("async", 0), ("async", 2)])
def test_a_skipped_step_keeps_the_stream_and_the_bound(tiny_model_dir, mode, S):
    """A step skipped for a non-finite gradient consumes its batch but not a global step: the stream
    goes on (it used to stop with 'needs the weights of step 2'), and no row exceeds the bound."""
    dm = make_dm(tiny_model_dir, mode=mode, S=S)
    skip = {1, 4, 5}
    try:
        dm.push_weights(weights(0), 0)
        step, seen = 0, []
        for i in range(10):
            b = dm.next_batch(step)
            seen.append((step, b))
            if i not in skip:
                step += 1
            if dm.wants_weights(step):
                dm.push_weights(weights(step), step)
    finally:
        dm.teardown("fit")
    assert max(int(st - v) for st, b in seen for v in b.versions) <= S
    assert [b.phase for _, b in seen] == list(range(10))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_batch_dropped_whole_admits_the_next_phase(tiny_model_dir, mode):
    """A resume with a smaller max_staleness: the buffer's batches generated ahead are now too old and
    are dropped whole; that frees the next phase's admission, which must start at once (it stopped with
    "no rollout is in flight ... Add WeightSync" although the weights were there)."""
    dm = make_dm(tiny_model_dir, mode=mode, S=3, k=1)
    try:
        drive(dm, 2)                               # phases generated ahead with old weights (S = 3)
        deadline = time.monotonic() + 120          # a phase generated ahead reaches the buffer, however slow
        while not dm.buffer.rows() and time.monotonic() < deadline:          # the worker is on a loaded machine
            dm._collect(0.5)
        state = dm.state_dict()
    finally:
        dm.teardown("fit")
    assert any(b["versions"].max() < 2 for bs in state["buffer"]["ready"].values() for b in bs)
    dm = make_dm(tiny_model_dir, mode=mode, S=0, k=1)
    try:
        dm.load_state_dict(state)
        dm.push_weights(weights(2), 2)
        batch = dm.next_batch(2)
        assert dm.buffer.stale_dropped > 0 and set(batch.versions.tolist()) == {2}
    finally:
        dm.teardown("fit")


def test_max_staleness_below_the_sync_lag_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match="data.schedule.max_staleness=0 is below data.batch.steps_per_rollout - 1 = 1"):
        RolloutDataModule(model_path=tiny_model_dir, batch=BatchShape(steps_per_rollout=2), schedule=Schedule(max_staleness=0))


def test_worker_errors_reach_the_trainer_with_their_cause(tiny_model_dir):
    dm = make_dm(tiny_model_dir, latency=-1.0)                  # time.sleep(-1) raises in the worker
    try:
        dm.push_weights(weights(0), 0)
        with pytest.raises(WorkerError, match="sleep length must be non-negative"):
            dm.next_batch(0)
    finally:
        dm.teardown("fit")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_without_weight_pushes_the_stream_fails_loudly(tiny_model_dir, mode):
    dm = make_dm(tiny_model_dir, mode=mode)
    try:
        if mode == "async":
            with pytest.raises(RuntimeError, match="lit_ess.callbacks.WeightSync"):
                dm.next_batch(0)
        else:
            dm.next_batch(0)                                      # version 0: the engine's own weights
            with pytest.raises(RuntimeError, match="lit_ess.callbacks.WeightSync"):
                dm.next_batch(1)
    finally:
        dm.teardown("fit")


CHILD = """
import sys, os
sys.path.insert(0, {tests!r})
from test_async import make_dm
dm = make_dm({model!r})
print(dm.executor.proc.pid, flush=True)
dm.executor.wait_ready(timeout=60)
os._exit(0)                         # as after kill -9: no teardown
"""


def test_worker_exits_when_the_trainer_dies(tiny_model_dir):
    code = CHILD.format(tests=os.path.dirname(__file__), model=tiny_model_dir)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail("the worker process outlived its trainer by 10 s")


def test_async_validation_samples_in_the_worker_and_starts_no_rollout(tiny_model_dir):
    """`lit-ess validate` pushes weights and evaluates: no training phase may start (and, inside fit,
    phase results that arrive while waiting for the evaluation go to the buffer)."""
    dm = make_dm(tiny_model_dir)
    try:
        dm.push_weights(weights(3), 3)
        metrics = dm.evaluate([(0, "1+1=", "2"), (1, "2+3=", "5")])
        assert metrics.length.tolist() == [[3.0], [3.0]] and metrics.reward.shape == (2, 1)
        assert dm.next_plan == 0 and not dm.submitted
        batch = dm.next_batch(3)                     # training afterwards starts from phase 0, version 3
        assert batch.phase == 0 and set(batch.versions.tolist()) == {3}
    finally:
        dm.teardown("fit")
