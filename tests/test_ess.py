"""Properties of the batch ESS: range, equality case, invariances, huge log-ratios, merging, ranks."""
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings, strategies as st

from lit_ess.objectives import batch_ess, ess_stats

log_ratios = st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=40)


def ess(values, mask=None):
    lr = torch.tensor([values], dtype=torch.float64)
    return batch_ess(lr, torch.ones_like(lr, dtype=torch.bool) if mask is None else mask).item()


def direct(values):
    rho = torch.tensor(values, dtype=torch.float64).exp()
    return (rho.mean() ** 2 / (rho * rho).mean()).item()


def test_hand_computed():
    assert ess([math.log(2), 0.0]) == pytest.approx(0.9)
    assert ess([0.0, 0.0, 0.0]) == pytest.approx(1.0)
    # one token carries all the weight: e = 1/n
    assert ess([800.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    a = math.exp(-1)
    assert ess([800.0, 799.0]) == pytest.approx((1 + a) ** 2 / (2 * (1 + a * a)))
    assert ess([-800.0, -800.0]) == pytest.approx(1.0)


def test_padding_never_counts():
    lr = torch.tensor([[math.log(2), 0.0, 123.0, -50.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    assert batch_ess(lr, mask).item() == pytest.approx(0.9)


def test_empty_batch_is_one_and_finite():
    lr = torch.zeros(2, 3)
    assert batch_ess(lr, torch.zeros(2, 3, dtype=torch.bool)).item() == 1.0


@settings(max_examples=200, deadline=None)
@given(log_ratios)
def test_range_and_direct_formula(values):
    e = ess(values)
    n = len(values)
    assert 1 / n - 1e-12 <= e <= 1.0
    assert e == pytest.approx(direct(values), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.floats(-700, 700), st.integers(1, 30))
def test_one_iff_all_equal(c, n):
    assert ess([c] * n) == pytest.approx(1.0, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(log_ratios.filter(lambda v: max(v) - min(v) > 1e-3))
def test_below_one_when_ratios_differ(values):
    assert ess(values) < 1.0


@settings(max_examples=100, deadline=None)
@given(log_ratios, st.floats(-500, 500), st.randoms())
def test_scale_and_permutation_invariance(values, shift, rnd):
    shuffled = list(values)
    rnd.shuffle(shuffled)
    e = ess(values)
    assert ess([v + shift for v in values]) == pytest.approx(e, rel=1e-9, abs=1e-12)
    assert ess(shuffled) == pytest.approx(e, rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1000, 1000), min_size=1, max_size=20))
def test_huge_log_ratios_stay_finite(values):
    e = ess(values)
    assert math.isfinite(e) and 1 / len(values) - 1e-12 <= e <= 1.0


@settings(max_examples=100, deadline=None)
@given(log_ratios, st.integers(0, 40))
def test_merged_micro_batches_equal_concatenation(values, cut):
    cut = min(cut, len(values))
    lr = torch.tensor([values], dtype=torch.float64)
    m = torch.ones_like(lr, dtype=torch.bool)
    merged = ess_stats(lr[:, :cut], m[:, :cut]).merge(ess_stats(lr[:, cut:], m[:, cut:]))
    assert merged.value().item() == pytest.approx(batch_ess(lr, m).item(), rel=1e-12)


def _worker(rank, world, port, parts, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lr, mask = parts[rank]
    results[rank] = batch_ess(lr, mask, group=True).item()
    dist.destroy_process_group()


@pytest.mark.dist
def test_two_gloo_ranks_equal_single_process():
    g = torch.Generator().manual_seed(0)
    lr = torch.randn(6, 9, generator=g, dtype=torch.float64) * 3
    lr[0, 0] = 400.0                                    # extreme token on rank 0 only
    mask = torch.rand(6, 9, generator=g) > 0.2
    mask[3:] = False                                   # rank 1 has an empty part in one row block
    mask[4, 2] = True
    parts = [(lr[:3], mask[:3]), (lr[3:], mask[3:])]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        results = mgr.dict()
        with socket.socket() as s:                     # a free port (other tests may run beside this one)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(2, port, parts, results), nprocs=2, start_method="spawn")
        got = dict(results)
    want = batch_ess(lr, mask).item()
    assert got[0] == pytest.approx(want, rel=1e-12) and got[1] == pytest.approx(want, rel=1e-12)
