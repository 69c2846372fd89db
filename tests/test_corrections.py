"""Mismatch corrections (ISCorrection): hand-computed weights for each level and mode, and their
composition with the objectives (the weight scales each token's policy-gradient term)."""
import math

import pytest
import torch

from lit_ess.objectives import GRPO, P3O, REINFORCE, DecoupledPPO, ISCorrection, batch_ess

LN = math.log


def weights(level, mode, log_w, mask=None, **bounds):
    lr = torch.tensor(log_w, dtype=torch.float64)
    mask = torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.tensor(mask)
    c, metrics = ISCorrection(level, mode, **bounds)(lr, mask)
    return c.flatten().tolist(), {k: float(v) for k, v in metrics.items()}


def test_token_truncate_caps_each_ratio():
    # w = [0.5, 1, 3], C = 2 -> [0.5, 1, 2]; with low 0.8 -> [0.8, 1, 2]
    c, m = weights("token", "truncate", [[LN(0.5), 0.0, LN(3)]], high=2.0)
    assert c == pytest.approx([0.5, 1.0, 2.0])
    assert m["train/is_weight_mean"] == pytest.approx(3.5 / 3) and m["train/is_outside_frac"] == pytest.approx(1 / 3)
    c, m = weights("token", "truncate", [[LN(0.5), 0.0, LN(3)]], high=2.0, low=0.8)
    assert c == pytest.approx([0.8, 1.0, 2.0]) and m["train/is_outside_frac"] == pytest.approx(2 / 3)


def test_token_mask_is_icepop():
    # bounds [1/2, 2] by default: w = [0.4, 0.5, 1.5, 3] -> [0, 0.5, 1.5, 0] (bounds inclusive)
    c, m = weights("token", "mask", [[LN(0.4), LN(0.5), LN(1.5), LN(3)]], high=2.0)
    assert c == pytest.approx([0.0, 0.5, 1.5, 0.0])
    assert m["train/is_outside_frac"] == pytest.approx(0.5)


def test_sequence_truncate_uses_the_product_of_the_ratios():
    # sequence 1: w = 2 * 2 = 4 -> 2 on each token; sequence 2: 0.5 * 1 (last token is padding) -> 0.5
    c, _ = weights("sequence", "truncate", [[LN(2), LN(2)], [LN(0.5), LN(9)]], mask=[[True, True], [True, False]])
    assert c == pytest.approx([2.0, 2.0, 0.5, 0.0])


def test_geometric_reject_masks_whole_sequences_without_reweighting():
    # geometric means: sequence 1 exp(mean(ln 2, ln 2)) = 2 (inside [0.5, 2]); sequence 2: 4 (outside);
    # sequence 3: exp((ln 8 + ln 1/8) / 2) = 1 although each token is far off
    c, m = weights("geometric", "reject", [[LN(2), LN(2)], [LN(4), LN(4)], [LN(8), LN(1 / 8)]])
    assert c == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    assert m["train/is_outside_frac"] == pytest.approx(2 / 6)


def test_huge_log_ratios_give_finite_weights():
    c, m = weights("sequence", "mask", [[500.0, 500.0], [-900.0, 0.0]])
    assert c == [0.0, 0.0, 0.0, 0.0] and all(math.isfinite(v) for v in m.values())


def test_reinforce_with_token_truncation_hand_computed():
    # lp = ln[0.5, 0.25], lb = ln[0.25, 0.25] -> w = [2, 1]; C = 1.5 -> c = [1.5, 1]; A = [1, -1]
    # loss = -(1.5 ln .5 - 1 ln .25) / 2 = (1.5 ln 2 - 2 ln 2) / 2 = -0.25 ln 2; dL/dlp = -c A / 2
    lp = torch.tensor([[LN(0.5), LN(0.25)]], dtype=torch.float64, requires_grad=True)
    lb = torch.tensor([[LN(0.25), LN(0.25)]], dtype=torch.float64)
    adv, mask = torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    out = REINFORCE(correction=ISCorrection("token", "truncate", high=1.5))(lp, lb, adv, mask)
    assert out.loss.item() == pytest.approx(-0.25 * LN(2), abs=1e-12)
    out.loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.75, 0.5])            # the weight is detached
    assert out.metrics["train/is_weight_mean"].item() == pytest.approx(1.25)


def test_a_correction_weights_the_surrogate_and_counts_the_mismatch_once():
    """For each objective: the loss with a correction equals the loss without it on advantages times c,
    with the objective's ratio taken against pi_prox (here the current policy) instead of pi_b; P3O
    keeps its ratio, ESS and cap against pi_b (KL term untouched)."""
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 2).requires_grad_()
    lb = lp.detach() + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.2
    corr = ISCorrection("token", "mask", high=1.3)
    c, _ = corr(lp.detach() - lb, mask)
    assert 0 < int((c == 0).sum()) < int(mask.sum())                  # some tokens masked, some kept
    for obj in (GRPO(), P3O(), REINFORCE(), DecoupledPPO()):
        with_c = type(obj)(correction=corr)(lp, lb, adv, mask)
        if isinstance(obj, P3O):
            by_hand = obj(lp, lb, adv * c, mask, ess=batch_ess(lp.detach() - lb, mask)).loss
        else:
            by_hand = obj(lp, lp.detach(), adv * c, mask).loss
        assert with_c.loss.item() == pytest.approx(by_hand.item(), abs=1e-12), type(obj).__name__
        ratio_max = (lp.detach() - lb)[mask].exp().max().item()
        assert with_c.metrics["train/ratio_max"].item() == pytest.approx(ratio_max, rel=1e-5)   # still against pi_b


@pytest.mark.parametrize("objective", [GRPO, DecoupledPPO, REINFORCE])
def test_gradient_matches_trls_truncated_correction(objective):
    """One token, trainer p = 0.55, sampler p = 0.5, A = 1, token truncation at 2: TRL's loss
    -min(r A, clip(r) A) * min(pi_old / pi_vllm, 2) with r = pi / pi_old = 1 has dL/dlp = -1.1 (the
    mismatch counted once; a ratio against pi_b as well would give -1.21)."""
    lp = torch.tensor([[LN(0.55)]], dtype=torch.float64, requires_grad=True)
    lb = torch.tensor([[LN(0.5)]], dtype=torch.float64)
    out = objective(correction=ISCorrection("token", "truncate", high=2.0))(lp, lb, torch.ones(1, 1, dtype=torch.float64),
                                                                             torch.ones(1, 1, dtype=torch.bool))
    out.loss.backward()
    assert lp.grad.item() == pytest.approx(-1.1, abs=1e-9)


def test_the_proximal_policy_sets_the_weight_when_given():
    # lp = lb (the update has not moved yet) but pi_prox / pi_b = 4 on both tokens: C = 2 caps them
    lp = torch.tensor([[LN(0.5), LN(0.5)]], dtype=torch.float64, requires_grad=True)
    lb = lp.detach().clone()
    prox = lb + LN(4)
    adv, mask = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    out = DecoupledPPO(correction=ISCorrection("token", "truncate", high=2.0))(lp, lb, adv, mask, proximal_logprobs=prox)
    assert out.metrics["train/is_weight_mean"].item() == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [dict(level="tok"), dict(mode="clip"), dict(high=0.0), dict(low=3.0, high=2.0),
                                 dict(mode="mask", high=0.5)])           # default low 1/high = 2 > high
def test_bad_settings_name_the_field(bad):
    with pytest.raises(ValueError, match="correction"):
        ISCorrection(**bad)
