"""Hand-computed values and gradients for every objective (see the numbers worked out in comments)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lit_ess.objectives import (CISPO, DAPO, GRPO, GSPO, OBJECTIVE_CLASSES, P3O, REINFORCE, DecoupledPPO, ISCorrection,
                                aggregate, k3, k3_sampled, kl_weight_cap)

LN2, LN4 = math.log(2), math.log(4)


def two_tokens(lp=(math.log(0.5), math.log(0.25)), lb=(math.log(0.25), math.log(0.25)), adv=(1.0, -1.0)):
    """One sequence of two tokens: rho = [2, 1] by default."""
    lp = torch.tensor([list(lp)], dtype=torch.float64, requires_grad=True)
    lb = torch.tensor([list(lb)], dtype=torch.float64)
    adv = torch.tensor([list(adv)], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    return lp, lb, adv, mask


def test_p3o_hand_computed():
    # rho = [2, 1]; e_B = (2 + 1)^2 / (2 * (4 + 1)) = 0.9; weight = min(rho, 0.9) = [0.9, 0.9]
    # pg = -(0.9 * ln .5 * 1 + 0.9 * ln .25 * -1) / 2 = -0.45 ln 2
    # k3 = [0.5 - 1 + ln 2, 0]; kl = (ln 2 - 0.5) / 2; loss = pg + 0.1 kl
    lp, lb, adv, mask = two_tokens()
    out = P3O()(lp, lb, adv, mask)
    expected = -0.45 * LN2 + 0.1 * (LN2 - 0.5) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.metrics["train/ess"].item() == pytest.approx(0.9, abs=1e-7)
    assert out.metrics["train/capped_frac"].item() == pytest.approx(1.0)   # 2 > 0.9 and 1 > 0.9
    out.loss.backward()
    # d/dlp_t = (-w_t A_t + (1 - e) (1 - exp(-lr_t))) / n = [(-0.9 + 0.1 * 0.5) / 2, 0.9 / 2]
    assert lp.grad.tolist()[0] == pytest.approx([-0.425, 0.45], abs=1e-12)


def test_p3o_uses_passed_ess():
    lp, lb, adv, mask = two_tokens()
    out = P3O()(lp, lb, adv, mask, ess=torch.tensor(0.5, dtype=torch.float64))
    # weight = [0.5, 0.5]: pg = -0.25 ln 2; kl term weighted 0.5
    assert out.loss.item() == pytest.approx(-0.25 * LN2 + 0.5 * (LN2 - 0.5) / 2, abs=1e-12)


def test_p3o_ablations_hand_computed():
    # rho = [2, 1], e_B = 0.9 (see above)
    # no cap: weight = rho = [2, 1]: pg = -(2 ln .5 - 1 ln .25) / 2 = -(-2 ln 2 + 2 ln 2) / 2 = 0; loss = 0.1 kl
    lp, lb, adv, mask = two_tokens()
    out = P3O(ess_cap=False)(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(0.1 * (LN2 - 0.5) / 2, abs=1e-12)
    out.loss.backward()
    # d/dlp_t = (-rho_t A_t + 0.1 (1 - exp(-lr_t))) / 2 = [(-2 + 0.05) / 2, 1 / 2]
    assert lp.grad.tolist()[0] == pytest.approx([-0.975, 0.5], abs=1e-12)
    # no adaptive KL: the capped policy-gradient term alone, -0.45 ln 2
    lp, lb, adv, mask = two_tokens()
    out = P3O(adaptive_kl=False)(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-0.45 * LN2, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-0.45, 0.45], abs=1e-12)


def test_grpo_hand_computed():
    # rho = [2, 1], A = [1, -1]: t1 clipped to 1.2 (no grad), t2 = -1; loss = -(1.2 - 1) / 2
    lp, lb, adv, mask = two_tokens()
    out = GRPO(clip_eps=0.2)(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-0.1, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.5], abs=1e-12)
    assert out.metrics["train/clip_ratio_high"].item() == pytest.approx(0.5)


def test_grpo_negative_advantage_is_not_clipped_above():
    # rho = 2, A = -1: min(-2, -1.2) = -2, the unclipped branch; d/dlp = -(rho A) / n = 2 / 2
    lp, lb, adv, mask = two_tokens(adv=(-1.0, 0.0))
    out = GRPO()(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(1.0, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([1.0, 0.0], abs=1e-12)


def test_dapo_clip_higher():
    lp, lb, adv, mask = two_tokens()
    out = DAPO()(lp, lb, adv, mask)            # clip_high 0.28: t1 -> 1.28
    assert out.loss.item() == pytest.approx(-(1.28 - 1.0) / 2, abs=1e-12)


def test_gspo_sequence_ratio():
    # s = exp(mean(ln 2, 0)) = sqrt 2, far outside [1 - 3e-4, 1 + 4e-4]
    lp, lb, adv, mask = two_tokens(adv=(1.0, 1.0))
    out = GSPO()(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-(1 + 4e-4), abs=1e-12)   # clipped, A > 0
    out.loss.backward()
    assert lp.grad.abs().sum().item() == 0.0
    lp, lb, adv, mask = two_tokens(adv=(-1.0, -1.0))
    out = GSPO()(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(math.sqrt(2), abs=1e-12)    # unclipped branch -s * A
    out.loss.backward()
    # d/dlp_t of mean_t(-s_bt A) = -A s / T
    assert lp.grad.tolist()[0] == pytest.approx([math.sqrt(2) / 2] * 2, abs=1e-12)


def test_cispo_hand_computed():
    # weight = clip(rho, max 1.5) = [1.5, 1]; loss = -(1.5 ln .5 - ln .25) / 2
    lp, lb, adv, mask = two_tokens()
    out = CISPO(clip_high=0.5)(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-(-1.5 * LN2 + LN4) / 2, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-0.75, 0.5], abs=1e-12)


def test_decoupled_hand_computed():
    # prox = [.4, .25], lb = [.25, .25] -> behaviour weight [1.6, 1]; r = pi/prox = [1.25, 1], A = [1, 1]
    # t1: min(1.25, 1.2) = 1.2 (clipped); t2: 1. loss = -(1.6 * 1.2 + 1) / 2
    lp, lb, adv, mask = two_tokens(adv=(1.0, 1.0))
    prox = torch.log(torch.tensor([[0.4, 0.25]], dtype=torch.float64))
    out = DecoupledPPO()(lp, lb, adv, mask, proximal_logprobs=prox)
    assert out.loss.item() == pytest.approx(-1.46, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -0.5], abs=1e-12)
    # behaviour weight cap: prox/lb = 1.6 > cap 1.5
    out = DecoupledPPO(behavior_cap=1.5)(lp.detach(), lb, adv, mask, proximal_logprobs=prox)
    assert out.loss.item() == pytest.approx(-(1.5 * 1.2 + 1) / 2, abs=1e-12)


def test_reinforce_hand_computed():
    lp, lb, adv, mask = two_tokens()
    out = REINFORCE()(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-(-LN2 + LN4) / 2, abs=1e-12)


def test_entropy_and_ref_kl_terms():
    lp, lb, adv, mask = two_tokens()
    ent = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]], dtype=torch.float64)
    base = REINFORCE()(lp, lb, adv, mask).loss.item()
    out = REINFORCE(entropy_coef=0.1, ref_kl_coef=0.5)(
        lp, lb, adv, mask, entropy=ent, ref_logprobs=ref)
    # entropy mean 2 -> -0.2; k3 to ref = [ln 2 - 0.5, 0] mean -> 0.5 * (ln 2 - 0.5) / 2
    assert out.loss.item() == pytest.approx(base - 0.2 + 0.25 * (LN2 - 0.5), abs=1e-12)
    with pytest.raises(ValueError, match="ref_logprobs"):
        P3O(ref_kl_coef=0.1)(lp, lb, adv, mask)


def test_aggregations_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(x, m, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert aggregate(x, m, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(10 / 20)
    # micro-batch: global counts make the parts add up to the whole
    whole = aggregate(x, m)
    parts = aggregate(x[:1], m[:1], num_tokens=4) + aggregate(x[1:], m[1:], num_tokens=4)
    assert parts.item() == pytest.approx(whole.item())
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(x, m, "sum")


def test_k3_value_gradient_and_linear_tail():
    lr = torch.tensor([LN2, 0.0, -1.0, -30.0], dtype=torch.float64, requires_grad=True)
    v = k3(lr)
    assert v[:3].tolist() == pytest.approx([0.5 - 1 + LN2, 0.0, math.e - 1 - 1])
    assert torch.isfinite(v).all()
    v.sum().backward()
    assert lr.grad[:3].tolist() == pytest.approx([1 - 0.5, 0.0, 1 - math.e])
    assert lr.grad[3] < 0 and torch.isfinite(lr.grad[3])   # tail keeps pulling lp up, finitely


def test_nonfinite_tokens_are_masked_and_counted():
    lp, lb, adv, mask = two_tokens()
    lp_bad = torch.tensor([[float("nan"), math.log(0.25)]], dtype=torch.float64, requires_grad=True)
    lb_bad = torch.tensor([[math.log(0.25), float("-inf")]], dtype=torch.float64)
    for cls in OBJECTIVE_CLASSES:
        out = cls()(lp_bad, lb, adv, mask)
        assert torch.isfinite(out.loss), cls
        assert out.metrics["train/nonfinite_tokens"].item() == 1, cls
        out.loss.backward()
        assert torch.isfinite(lp_bad.grad).all(), cls
        lp_bad.grad = None
        out = cls()(lp.detach(), lb_bad, adv, mask)
        assert torch.isfinite(out.loss) and out.metrics["train/tokens"].item() == 1, cls


def test_bad_shapes_and_dtypes_name_the_argument():
    lp, lb, adv, mask = two_tokens()
    obj = P3O()
    with pytest.raises(ValueError, match="behavior_logprobs"):
        obj(lp, lb[:, :1], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        obj(lp, lb, adv[:, :1], mask)
    with pytest.raises(ValueError, match="mask"):
        obj(lp, lb, adv, mask[:, :1])
    with pytest.raises(ValueError, match="behavior_logprobs.*floating"):
        obj(lp, lb.long(), adv, mask)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        obj(lp[0], lb[0], adv[0], mask[0])


def test_sequence_advantages_broadcast():
    lp, lb, _, mask = two_tokens()
    a = P3O()(lp, lb, torch.tensor([[0.7, 0.7]], dtype=torch.float64), mask).loss
    b = P3O()(lp, lb, torch.tensor([0.7], dtype=torch.float64), mask).loss
    assert a.item() == pytest.approx(b.item())


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000))
def test_on_policy_p3o_equals_reinforce(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 5).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    p3o = P3O()(lp, lp.detach().clone(), adv, mask)
    p3o.loss.backward()
    g1, lp.grad = lp.grad.clone(), None
    rf = REINFORCE()(lp, lp.detach().clone(), adv, mask)
    rf.loss.backward()
    assert p3o.loss.item() == pytest.approx(rf.loss.item(), abs=1e-12)
    assert torch.allclose(g1, lp.grad, atol=1e-12)
    if mask.any():
        assert p3o.metrics["train/ess"].item() == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------- proximal logprobs (issue 18, items 1 and 5)


def test_grpo_clips_around_the_proximal_policy_when_asked():
    # rho = pi/pi_b = [2, 1]; pi_prox = [.45, .25] -> r = pi/pi_prox = [10/9, 1], A = [1, -1]
    # old: behavior clips t1 (2 > 1.2: no gradient); old: proximal keeps it (10/9 < 1.2):
    # loss = -(10/9 - 1) / 2 = -1/18, d/dlp = -r A / 2 = [-5/9, 1/2]
    prox = torch.log(torch.tensor([[0.45, 0.25]], dtype=torch.float64))
    lp, lb, adv, mask = two_tokens()
    out = GRPO()(lp, lb, adv, mask, proximal_logprobs=prox)           # default: around pi_b, prox unused
    assert out.loss.item() == pytest.approx(-0.1, abs=1e-12) and out.metrics["train/clip_ratio"].item() == 0.5
    lp, lb, adv, mask = two_tokens()
    out = GRPO(old="proximal")(lp, lb, adv, mask, proximal_logprobs=prox)
    assert out.loss.item() == pytest.approx(-1 / 18, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-5 / 9, 0.5], abs=1e-12)
    assert out.metrics["train/clip_ratio"].item() == 0.0                     # clip fraction around pi_prox
    assert out.metrics["train/ratio_max"].item() == pytest.approx(2.0)       # ratio statistics stay against pi_b
    # pi_prox = [.4, .25]: r = [1.25, 1]; GRPO clips t1 at 1.2, DAPO (clip_high .28) does not
    prox = torch.log(torch.tensor([[0.4, 0.25]], dtype=torch.float64))
    lp, lb, adv, mask = two_tokens()
    out = GRPO(old="proximal")(lp, lb, adv, mask, proximal_logprobs=prox)
    assert out.loss.item() == pytest.approx(-0.1, abs=1e-12) and out.metrics["train/clip_ratio_high"].item() == 0.5
    out = DAPO(old="proximal")(lp, lb, adv, mask, proximal_logprobs=prox)
    assert out.loss.item() == pytest.approx(-0.125, abs=1e-12) and out.metrics["train/clip_ratio"].item() == 0.0


def test_a_call_without_proximal_logprobs_is_the_first_step_on_its_data():
    # pi_prox = the current policy: r = 1 on both tokens, nothing clipped: loss = -(1 - 1) / 2, grad -A / 2
    for obj in (GRPO(old="proximal"), DAPO(old="proximal"), DecoupledPPO(behavior_cap=1e9)):
        lp, lb, adv, mask = two_tokens()
        out = obj(lp, lp.detach(), adv, mask)
        assert out.loss.item() == pytest.approx(0.0, abs=1e-12), obj
        out.loss.backward()
        assert lp.grad.tolist()[0] == pytest.approx([-0.5, 0.5], abs=1e-12), obj


def test_gspo_sequence_ratio_around_the_proximal_policy():
    # pi_prox = pi except t1 at lp - 2e-4: s = exp(mean(2e-4, 0)) = e^1e-4, inside [1 - 3e-4, 1 + 4e-4]
    # A = [1, 1]: loss = -s, d/dlp_t = -s A / 2 (old: behavior has s = sqrt 2, clipped, no gradient)
    lp, lb, adv, mask = two_tokens(adv=(1.0, 1.0))
    prox = lp.detach() - torch.tensor([[2e-4, 0.0]], dtype=torch.float64)
    out = GSPO(old="proximal")(lp, lb, adv, mask, proximal_logprobs=prox)
    s = math.exp(1e-4)
    assert out.loss.item() == pytest.approx(-s, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-s / 2, -s / 2], abs=1e-12)
    assert out.metrics["train/clip_ratio"].item() == 0.0


def test_objectives_say_whether_they_need_proximal_logprobs():
    assert [o.needs_proximal for o in (P3O(), GRPO(), DAPO(), GSPO(), REINFORCE(), DecoupledPPO())] == \
        [False, False, False, False, False, True]
    assert GRPO(old="proximal").needs_proximal and GSPO(old="proximal").needs_proximal
    assert P3O(kl_anchor="behavior_at_train_temperature").needs_proximal
    assert not P3O(kl_anchor="behavior_at_train_temperature", adaptive_kl=False).needs_proximal
    for cls in (P3O, GRPO, DAPO, GSPO, CISPO, REINFORCE):            # a correction weighs pi_prox / pi_b
        assert cls(correction=ISCorrection()).needs_proximal, cls.__name__
    assert not P3O(correction=ISCorrection()).proximal_stands_for_behavior    # the anchor stays pi_b
    with pytest.raises(ValueError, match="old='pi_b' is not one of"):
        DAPO(old="pi_b")
    with pytest.raises(ValueError, match="kl_anchor='proximal' is not one of"):
        P3O(kl_anchor="proximal")


def test_p3o_kl_estimated_on_the_samplers_tokens_hand_computed():
    # rho = [2, 1], e_B = 0.9, pg = -0.45 ln 2 (test_p3o_hand_computed)
    # k3_sampled = 1 - rho + rho lr = [1 - 2 + 2 ln 2, 0]: kl = (2 ln 2 - 1) / 2; loss = pg + 0.1 kl
    # d/dlp_t = (-w_t A_t + (1 - e) rho_t lr_t) / 2 = [(-0.9 + 0.2 ln 2) / 2, 0.9 / 2]
    lp, lb, adv, mask = two_tokens()
    out = P3O(kl_estimator="k3_sampled")(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-0.45 * LN2 + 0.1 * (2 * LN2 - 1) / 2, abs=1e-12)
    assert out.metrics["train/kl_term"].item() == pytest.approx((2 * LN2 - 1) / 2, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([(-0.9 + 0.2 * LN2) / 2, 0.45], abs=1e-12)
    with pytest.raises(ValueError, match="kl_estimator='k2' is not one of"):
        P3O(kl_estimator="k2")
    with pytest.raises(ValueError, match="needs kl_anchor='behavior'"):       # its tokens are pi_b's, not the anchor's
        P3O(kl_estimator="k3_sampled", kl_anchor="behavior_at_train_temperature")


def test_p3o_kl_on_the_samplers_tokens_with_its_weight_capped_hand_computed():
    # rho = [2, 1], e_B = 0.9, pg = -0.45 ln 2 (test_p3o_hand_computed); the KL's weight min(rho, e_B) = [0.9, 0.9],
    # its factor on rho k3 min(1, e_B / rho) = [0.45, 0.9]: kl = 0.45 (1 - 2 + 2 ln 2) / 2; loss = pg + 0.1 kl
    # d/dlp_t = (-w_t A_t + (1 - e) min(rho_t, e) lr_t) / 2 = [(-0.9 + 0.1 * 0.9 * ln 2) / 2, 0.9 / 2]
    lp, lb, adv, mask = two_tokens()
    out = P3O(kl_estimator="k3_sampled_capped")(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-0.45 * LN2 + 0.1 * 0.45 * (2 * LN2 - 1) / 2, abs=1e-12)
    assert out.metrics["train/kl_term"].item() == pytest.approx(0.45 * (2 * LN2 - 1) / 2, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([(-0.9 + 0.09 * LN2) / 2, 0.45], abs=1e-12)
    with pytest.raises(ValueError, match="needs kl_anchor='behavior'"):
        P3O(kl_estimator="k3_sampled_capped", kl_anchor="behavior_at_train_temperature")
    with pytest.raises(ValueError, match="with ess_cap=false nothing is capped"):
        P3O(kl_estimator="k3_sampled_capped", ess_cap=False)


@given(st.floats(-60.0, 60.0), st.floats(0.01, 1.0))
def test_k3_sampled_capped_is_nonnegative_and_its_gradient_linear_in_the_log_ratio(lr, e):
    x = torch.tensor([[lr]], dtype=torch.float64, requires_grad=True)
    v = kl_weight_cap("k3_sampled_capped", x, torch.tensor(e, dtype=torch.float64)) * k3_sampled(x)
    v.sum().backward()
    g = x.grad.item()
    assert torch.isfinite(v).all() and math.isfinite(g) and v.item() >= 0
    if -20 <= lr <= 20:                     # d/dlr = min(rho, e_B) lr: never steeper than e_B |lr|
        assert g == pytest.approx(min(math.exp(lr), e) * lr, rel=1e-9, abs=1e-12)
    assert abs(g) <= e * abs(lr) + 1e-12


@given(st.floats(-60.0, 60.0))
def test_k3_sampled_is_k3_weighted_by_rho_nonnegative_and_its_gradient_bounded_where_rho_vanishes(lr):
    x = torch.tensor(lr, dtype=torch.float64, requires_grad=True)
    v = k3_sampled(x)
    v.backward()
    assert torch.isfinite(v) and torch.isfinite(x.grad) and v.item() >= 0
    if -20 <= lr <= 20:                     # rho * k3(lr), and d/dlr = rho lr
        assert v.item() == pytest.approx(math.exp(lr) * k3(torch.tensor(lr, dtype=torch.float64)).item(),
                                         rel=1e-9, abs=1e-12)
        assert x.grad.item() == pytest.approx(lr * math.exp(lr), rel=1e-9, abs=1e-12)
    if lr < 0:                               # never below -1/e: no pull toward tokens the policy has left
        assert -1 / math.e - 1e-12 <= x.grad.item() <= 0


def test_p3o_kl_anchor_at_the_train_temperature_hand_computed():
    # rho = [2, 1] against pi_b: e_B = 0.9 and weight [0.9, 0.9] as in test_p3o_hand_computed: pg = -0.45 ln 2.
    # anchor la = [ln .5, ln .5]: lp - la = [0, -ln 2], k3 = [0, 2 - 1 - ln 2]: kl = (1 - ln 2) / 2
    # d/dlp_t = (-w_t A_t + (1 - e) (1 - exp(la_t - lp_t))) / 2 = [(-0.9 + 0) / 2, (0.9 + 0.1 * (1 - 2)) / 2]
    lp, lb, adv, mask = two_tokens()
    la = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    out = P3O(kl_anchor="behavior_at_train_temperature")(lp, lb, adv, mask, proximal_logprobs=la)
    assert out.loss.item() == pytest.approx(-0.45 * LN2 + 0.1 * (1 - LN2) / 2, abs=1e-12)
    assert out.metrics["train/ess"].item() == pytest.approx(0.9, abs=1e-7)          # the ratio keeps the true pi_b
    assert out.metrics["train/kl_term"].item() == pytest.approx((1 - LN2) / 2, abs=1e-12)
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-0.45, 0.4], abs=1e-12)


def test_the_train_temperature_anchor_stops_the_pull_toward_a_tempered_copy():
    """Lag 0, sampled at T_s = 1.5 and trained at T_t = 1.0 (the collapse of docs/results.md): the policy's
    logits z over 3 tokens are the sampler's. pi_b = softmax(z / 1.5) is flatter than pi = softmax(z).
    The default anchor's KL gradient pushes the likely token down (toward the tempered copy); the
    anchor at the trainer's temperature, log softmax(z / 1.0) of the sampling weights, is the policy
    itself: k3 = 0 and no gradient, while e_B (from the true pi_b) and the policy-gradient term are the
    same. The anchor also equals (T_s / T_t)(log pi_b + log Z_s) - log Z_t (the docstring's identity)."""
    z = torch.tensor([2.0, 0.5, -1.0], dtype=torch.float64)
    Ts, Tt = 1.5, 1.0
    y = torch.tensor([0, 0, 1, 2])                           # sampled tokens, one sequence
    lp = torch.log_softmax(z / Tt, -1)[y][None].clone().requires_grad_()
    lb = torch.log_softmax(z / Ts, -1)[y][None]
    la = torch.log_softmax(z / Tt, -1)[y][None]
    assert torch.allclose(la, Ts / Tt * (lb + torch.logsumexp(z / Ts, -1)) - torch.logsumexp(z / Tt, -1))
    adv, mask = torch.zeros(1, 4, dtype=torch.float64), torch.ones(1, 4, dtype=torch.bool)   # A = 0: the KL alone
    sampler = P3O()(lp, lb, adv, mask)
    sampler.loss.backward()
    g_sampler, lp.grad = lp.grad.clone(), None
    trainer = P3O(kl_anchor="behavior_at_train_temperature")(lp, lb, adv, mask, proximal_logprobs=la)
    trainer.loss.backward()
    e = float(batch_ess_of(lp.detach() - lb))
    assert e < 1 and trainer.metrics["train/ess"].item() == pytest.approx(e) == sampler.metrics["train/ess"].item()
    # default: d/dlp_t = (1 - e) (1 - pi_b / pi) / 4; token 0 is likelier under pi than pi_b: pushed down
    want = (1 - e) * (1 - (lb - lp.detach()).exp()) / 4
    assert g_sampler[0].tolist() == pytest.approx(want[0].tolist(), abs=1e-12) and g_sampler[0, 0] > 0
    assert trainer.loss.item() == 0.0 and lp.grad.abs().max().item() == 0.0


def batch_ess_of(log_ratio):
    from lit_ess.objectives import batch_ess

    return batch_ess(log_ratio, torch.ones_like(log_ratio, dtype=torch.bool))
