"""Unbiased pass@k: hand-computed values, the binomial form, and the cross-prompt mean."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lit_ess.metrics import PassAtK, pass_at_k


def test_pass_at_k_hand_computed():
    # n = 4, c = 1: pass@k = k / 4 (one passing sample among 4, k drawn without replacement)
    got = pass_at_k(torch.tensor([[True, False, False, False]]))
    assert got[0].tolist() == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-12)
    # n = 4, c = 2: pass@1 = 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 5/6, pass@3 = pass@4 = 1
    got = pass_at_k(torch.tensor([[True, True, False, False]]))
    assert got[0].tolist() == pytest.approx([0.5, 5 / 6, 1.0, 1.0], abs=1e-12)
    # c = 0: all zero
    assert pass_at_k(torch.zeros(1, 3, dtype=torch.bool))[0].tolist() == [0.0, 0.0, 0.0]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_pass_at_k_equals_the_binomial_form(n, data):
    c = data.draw(st.integers(0, n))
    passed = torch.zeros(1, n, dtype=torch.bool)
    passed[0, torch.randperm(n)[:c]] = True
    got = pass_at_k(passed)[0]
    for k in range(1, n + 1):
        want = 1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k)
        assert got[k - 1].item() == pytest.approx(want, abs=1e-12)
    assert all(a <= b + 1e-12 for a, b in zip(got, got[1:]))       # pass@k grows with k


def test_metric_averages_over_prompts_of_all_updates():
    m = PassAtK()
    m.update(torch.tensor([[True, False]]))          # pass@1 0.5, pass@2 1
    m.update(torch.tensor([[False, False], [True, True]]))   # 0, 0 and 1, 1
    assert m.compute().tolist() == pytest.approx([0.5, 2 / 3])
