"""lit_ess/gradient_profile.py: where an objective's gradient goes, by hand on 3 tokens."""
import math

import torch
from hypothesis import given, settings, strategies as st

from lit_ess.objectives import GRPO, P3O, REINFORCE

# three tokens of one row: rho = 3, 1, 0.25; advantages +1, -1, +1
LP = torch.tensor([[math.log(3.0), 0.0, math.log(0.25)]]) - 1.0
LB = torch.full((1, 3), -1.0)
ADV = torch.tensor([[1.0, -1.0, 1.0]])
MASK = torch.ones(1, 3)


def test_reinforce_is_the_unit_of_grad_scale():
    m = REINFORCE()(LP, LB, ADV, MASK).metrics
    assert abs(float(m["train/grad_scale"]) - 1.0) < 1e-6       # dL/dlp = -A / 3, the reference itself
    assert abs(float(m["train/grad_share_neg_adv"]) - 1 / 3) < 1e-6
    assert abs(float(m["train/grad_share_rho_hi"]) - 1 / 3) < 1e-6    # rho 3 > 2
    assert abs(float(m["train/grad_share_rho_lo"]) - 1 / 3) < 1e-6    # rho 0.25 < 1/2


def test_p3o_by_hand():
    rho = torch.tensor([3.0, 1.0, 0.25])
    e = float(rho.mean() ** 2 / (rho ** 2).mean())                      # 0.4983...
    w = torch.minimum(rho, torch.tensor(e))                             # e, e, 0.25
    g_pg = -w * ADV[0] / 3
    g_kl = (1 - e) * (1 - 1 / rho) / 3                                  # d k3(lr)/d lr = 1 - exp(-lr)
    g = g_pg + g_kl
    m = P3O()(LP, LB, ADV, MASK).metrics
    assert abs(float(m["train/ess"]) - e) < 1e-6
    assert abs(float(m["train/grad_scale"]) - float(g.abs().sum() / (ADV.abs().sum() / 3))) < 1e-6
    assert abs(float(m["train/grad_share_rho_hi"]) - float(g[0].abs() / g.abs().sum())) < 1e-6
    assert abs(float(m["train/grad_share_rho_lo"]) - float(g[2].abs() / g.abs().sum())) < 1e-6
    assert abs(float(m["train/kl_grad_share"]) - float(g_kl.abs().sum() / (g_kl.abs().sum() + g_pg.abs().sum()))) < 1e-6
    cos = float((g_pg * g_kl).sum() / (g_pg.norm() * g_kl.norm()))
    assert abs(float(m["train/kl_grad_cos"]) - cos) < 1e-6
    # the KL term pulls rho = 3 down against the policy gradient, and rho = 0.25 up with it: cos 0.13
    assert 0.1 < cos < 0.2


def test_grpo_clipped_tokens_carry_no_gradient():
    # eps 0.2: rho 3 with A > 0 is clipped (no gradient), rho 0.25 with A > 0 is not (weight rho), rho 1 A < 0 not
    m = GRPO(clip_eps=0.2)(LP, LB, ADV, MASK).metrics
    g = torch.tensor([0.0, 1.0, 0.25]) / 3
    assert abs(float(m["train/grad_share_rho_hi"])) < 1e-7
    assert abs(float(m["train/grad_share_rho_lo"]) - float(g[2] / g.sum())) < 1e-6
    assert abs(float(m["train/grad_scale"]) - float(g.sum() / 1.0)) < 1e-6


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=2, max_size=12), st.floats(-2, 2))
def test_shares_are_fractions(log_ratios, a):
    lr = torch.tensor([log_ratios])
    adv = torch.full_like(lr, a) * torch.tensor([[(-1.0) ** i for i in range(lr.shape[1])]])
    m = P3O()(lr - 1.0, torch.full_like(lr, -1.0), adv, torch.ones_like(lr)).metrics
    for k in ("grad_share_rho_lo", "grad_share_rho_hi", "grad_share_neg_adv", "kl_grad_share"):
        assert -1e-6 <= float(m[f"train/{k}"]) <= 1 + 1e-6, k
    assert -1 - 1e-6 <= float(m["train/kl_grad_cos"]) <= 1 + 1e-6
