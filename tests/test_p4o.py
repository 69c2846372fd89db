"""P4O (issue 39, item 1): P3O with the proximal policy as a second anchor, as the authors define it in
FeynRL's algs/P4O/p4o.py. Hand-computed values, the authors' formula, invariances, and a Trainer run."""
import math
from dataclasses import replace

import lightning as L
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lit_ess.objectives import P3O, P4O, batch_ess
from lit_ess.batch import Proximal
from lit_ess.datamodules.settings import BatchShape
from lit_ess.settings import MicroBatch, Optim

LN2 = math.log(2)


def two_tokens(prox=(1 / 6, 1 / 4), lb=(1 / 4, 1 / 4)):
    """One sequence of two tokens, pi = [1/2, 1/4], A = [1, -1]: rho_b = pi / pi_b, rho_prox = pi / pi_prox."""
    lp = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64)).requires_grad_()
    f = lambda p: torch.log(torch.tensor([list(p)], dtype=torch.float64))       # noqa: E731
    return lp, f(lb), f(prox), torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)


def test_hand_computed():
    # rho_b = [2, 1]:    e_b    = (2 + 1)^2 / (2 (4 + 1)) = 0.9
    # rho_prox = [3, 1]: e_prox = (3 + 1)^2 / (2 (9 + 1)) = 0.8;  e_mix = min = 0.8
    # w_b = 0.1, w_prox = 0.2: shares 1/3, 2/3; pi_mix = [1/3 1/4 + 2/3 1/6, 1/4] = [7/36, 1/4]
    # weight = min(rho_b, 0.8) = [0.8, 0.8]: pg = -(0.8 ln .5 - 0.8 ln .25) / 2 = -0.4 ln 2
    # lp - log pi_mix = [ln(18/7), 0]: k3 = [7/18 - 1 + ln(18/7), 0]; kl_mix = (ln(18/7) - 11/18) / 2
    # loss = pg + (1 - 0.8) kl_mix
    lp, lb, prox, adv, mask = two_tokens()
    out = P4O()(lp, lb, adv, mask, proximal_logprobs=prox)
    kl_mix = (math.log(18 / 7) - 11 / 18) / 2
    assert out.loss.item() == pytest.approx(-0.4 * LN2 + 0.2 * kl_mix, abs=1e-12)
    want = {"train/ess_b": 0.9, "train/ess_prox": 0.8, "train/ess_mix": 0.8,
            "train/mix_w_b": 1 / 3, "train/mix_w_prox": 2 / 3, "train/kl_mix": kl_mix,
            "train/kl_b": (0.5 - 1 + LN2) / 2,                       # k3 of rho_b = [2, 1]: [1/2 - 1 + ln 2, 0]
            "train/kl_prox": (1 / 3 - 1 + math.log(3)) / 2,          # k3 of rho_prox = [3, 1]
            "train/capped_frac": 1.0}                                # 2 > 0.8 and 1 > 0.8
    assert {k: out.metrics[k].item() for k in want} == pytest.approx(want, abs=1e-12)
    assert out.metrics["train/ess"].item() == pytest.approx(0.8, abs=1e-7)    # e_mix, logged in float32
    out.loss.backward()
    # d/dlp_t = (-w_t A_t + (1 - e_mix) (1 - pi_mix / pi)) / 2 = [(-0.8 + 0.2 (1 - 7/18)) / 2, (0.8 + 0) / 2]
    assert lp.grad.tolist()[0] == pytest.approx([-0.4 + 11 / 180, 0.4], abs=1e-12)


def test_an_anchor_of_weight_zero_drops_out_and_two_give_no_term():
    # pi_b = pi (on-policy sampler): e_b = 1, w_b = 0, so pi_mix = pi_prox exactly (log 0 = -inf, no NaN);
    # rho_prox = [3, 1] as above: e_mix = 0.8, weight [0.8, 0.8] (A = [1, -1]: pg = -0.4 ln 2), k3 to pi_prox
    lp, _, prox, adv, mask = two_tokens()
    out = P4O()(lp, lp.detach(), adv, mask, proximal_logprobs=prox)
    assert out.loss.item() == pytest.approx(-0.4 * LN2 + 0.2 * (math.log(3) - 2 / 3) / 2, abs=1e-12)
    assert (out.metrics["train/mix_w_b"].item(), out.metrics["train/mix_w_prox"].item()) == (0.0, 1.0)
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()
    # both anchors are the policy: w_b + w_prox = 0, the term is skipped: REINFORCE, weights 0, no NaN
    lp, _, _, adv, mask = two_tokens()
    out = P4O()(lp, lp.detach(), adv, mask, proximal_logprobs=lp.detach())
    assert out.loss.item() == pytest.approx(-(math.log(0.5) - math.log(0.25)) / 2, abs=1e-12)
    assert [out.metrics[k].item() for k in ("train/mix_w_b", "train/mix_w_prox", "train/kl_mix")] == [0, 0, 0]
    out.loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-0.5, 0.5], abs=1e-12)


def test_the_kl_term_is_gated_at_1e_6():
    # e_mix = 1 - 1e-7 (passed): the term is skipped, the loss is the capped policy gradient alone;
    # at 1 - 1e-5 it is there (weight 1e-5 times a KL > 0)
    lp, lb, prox, adv, mask = two_tokens()
    pg = -(1 - 1e-7) * (math.log(0.5) - math.log(0.25)) / 2
    out = P4O()(lp, lb, adv, mask, proximal_logprobs=prox, ess=1 - 1e-7, proximal_ess=1.0)
    assert out.loss.item() == pytest.approx(pg, abs=1e-15) and out.metrics["train/kl_mix"].item() == 0.0
    out = P4O()(lp, lb, adv, mask, proximal_logprobs=prox, ess=1 - 1e-5, proximal_ess=1.0)
    assert out.metrics["train/kl_mix"].item() > 0
    assert out.loss.item() == pytest.approx(-(1 - 1e-5) * LN2 / 2 + 1e-5 * out.metrics["train/kl_mix"].item(), abs=1e-15)


def random_batch(B, T, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 0.1).requires_grad_()
    lb = lp.detach() + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    prox = lp.detach() + 0.5 * spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    return lp, lb, prox, adv, mask


def authors_p4o(lp, lb, prox, adv, mask, ess_eps=1e-8):
    """FeynRL's P4O.compute_policy_loss (algs/P4O/p4o.py), one call on one rank, normalize_loss: the sums
    divided by the token count; their compute_kl_distance (algs/RL/common.py) for the KL. `ess_eps` is the
    1e-8 their calculate_ess adds to sum rho^2."""
    m = mask.to(lp.dtype)

    def ess(log_ratio):                                   # calculate_ess: plain ratios, + eps, 1.0 if not finite
        r = torch.exp(torch.where(mask, log_ratio, torch.zeros_like(log_ratio)))[mask]
        s1, s2, n = r.sum().item(), r.pow(2).sum().item(), float(r.numel())
        return 1.0 if n < 0.5 or not (math.isfinite(s1) and math.isfinite(s2)) else s1 ** 2 / (s2 + ess_eps) / n

    def kl(a, ref):                                       # log(pi/pi_ref) + pi_ref/pi - 1, the exponent clamped
        return (a - ref) + torch.exp(torch.clamp(ref - a, -10.0, 10.0)) - 1

    ess_b, ess_prox = ess((lp - lb).detach()), ess((lp - prox).detach())
    ess_mix = min(ess_b, ess_prox)
    rho = torch.clamp(torch.exp(torch.where(mask, lp - lb, torch.zeros_like(lp))), min=0, max=ess_mix)
    total = -(rho.detach() * lp * adv * m).sum()
    w_b, w_prox = max(0.0, 1.0 - ess_b), max(0.0, 1.0 - ess_prox)
    if 1.0 - ess_mix > 1e-6:
        log_mix = torch.logsumexp(torch.stack([math.log(w_b + 1e-30) + lb, math.log(w_prox + 1e-30) + prox]), 0) \
            - math.log(w_b + w_prox)
        total = total + (1.0 - ess_mix) * (torch.where(mask, kl(lp, log_mix), torch.zeros_like(lp)) * m).sum()
    return total / m.sum().clamp(min=1.0), (ess_b, ess_prox)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000), st.floats(0.0, 1.5))
def test_equals_the_authors_formula(B, T, seed, spread):
    """On log-ratios where their clamps do not act (|lp - anchor| well below 10), our loss, gradient and ESS
    equal the authors' without the 1e-8 their ESS adds to sum rho^2 (with it, theirs is lower by a relative
    1e-8 / sum rho^2: 1.3e-7 for one token of rho = 0.28, found by this test)."""
    lp, lb, prox, adv, mask = random_batch(B, T, seed, spread)
    want, (ess_b, ess_prox) = authors_p4o(lp, lb, prox, adv, mask, ess_eps=0.0)
    want.backward()
    g_want, lp.grad = lp.grad.clone(), None
    out = P4O()(lp, lb, adv, mask, proximal_logprobs=prox)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(want.item(), abs=1e-10)
    assert torch.allclose(lp.grad, g_want, atol=1e-10)
    if mask.any():
        assert out.metrics["train/ess_b"].item() == pytest.approx(ess_b, abs=1e-10)
        assert out.metrics["train/ess_prox"].item() == pytest.approx(ess_prox, abs=1e-10)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(1, 6), st.integers(0, 10_000), st.data())
def test_parts_with_the_steps_ess_and_counts_add_up_to_the_whole(B, T, seed, data):
    """Micro-batches (or ranks) that get the step's e_b, e_prox and token count give the whole batch's loss
    and gradient: the pieces PolicyModule's pre-pass and all-reduce supply."""
    lp, lb, prox, adv, mask = random_batch(B, T, seed)
    whole = P4O()(lp, lb, adv, mask, proximal_logprobs=prox)
    whole.loss.backward()
    g_whole, lp.grad = lp.grad.clone(), None
    step = {"ess": batch_ess(lp.detach() - lb, mask), "proximal_ess": batch_ess(lp.detach() - prox, mask),
            "num_tokens": mask.sum()}
    cut = data.draw(st.integers(1, B - 1))
    loss = sum(P4O()(lp[s], lb[s], adv[s], mask[s], proximal_logprobs=prox[s], **step).loss
               for s in (slice(0, cut), slice(cut, B)))
    loss.backward()
    assert loss.item() == pytest.approx(whole.loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, g_whole, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000))
def test_at_a_phases_first_step_it_is_p3o(B, T, seed):
    """pi_prox = the current policy (a call without proximal logprobs; one step per rollout): e_prox = 1,
    and loss and gradient are P3O's exactly."""
    lp, lb, _, adv, mask = random_batch(B, T, seed)
    p4o = P4O()(lp, lb, adv, mask)
    p4o.loss.backward()
    g4, lp.grad = lp.grad.clone(), None
    p3o = P3O()(lp, lb, adv, mask)
    p3o.loss.backward()
    assert p4o.loss.item() == p3o.loss.item() and torch.equal(g4, lp.grad)
    if mask.any():
        assert p4o.metrics["train/ess_prox"].item() == 1.0
        assert p4o.metrics["train/ess"].item() == p3o.metrics["train/ess"].item()


def test_it_says_what_it_needs():
    assert P4O().needs_proximal and P4O().needs_ess and P4O().needs_proximal_ess
    assert not P3O().needs_proximal_ess


# ------------------------------------------------------------------------------ through PolicyModule


@pytest.fixture(scope="module")
def stale_batch(tiny_model_dir):
    """A sampled batch made off-policy toward both anchors: pi_b and pi_prox (scored, from other weights)."""
    from e2e_utils import off_policy, sampled_batch

    return off_policy(sampled_batch(tiny_model_dir))


def step(model_dir, batch, objective, **kw):
    from lit_ess.module import PolicyModule

    module = PolicyModule(model_dir, objective=objective, **kw)
    module.configure_model()
    metrics, ess = module.accumulate_gradients(replace(batch))
    return torch.cat([p.grad.flatten() for p in module.policy.parameters()]), metrics, ess


def test_micro_batching_does_not_change_the_update(tiny_model_dir, stale_batch):
    """Both ESS are the step's (the pre-pass): micro-batches of 3 rows give the one-pass update and metrics;
    ess_scope micro (the authors' per-micro-batch ESS) does not."""
    g_full, m_full, e_full = step(tiny_model_dir, stale_batch, P4O())
    g_micro, m_micro, e_micro = step(tiny_model_dir, stale_batch, P4O(), micro_batch=MicroBatch(size=3))
    assert 0 < m_full["train/ess_prox"] < 0.99 and 0 < m_full["train/ess_b"] < 0.99 and m_full["train/kl_mix"] > 0
    assert float(e_full) == pytest.approx(m_full["train/ess_mix"], rel=1e-6)      # returned: the cap e_mix
    assert float(e_micro) == pytest.approx(float(e_full), rel=1e-6)
    assert torch.allclose(g_full, g_micro, atol=1e-6, rtol=1e-4)
    for k in ("train/loss", "train/ess_b", "train/ess_prox", "train/ess_mix", "train/mix_w_b", "train/kl_mix",
              "train/kl_prox", "train/capped_frac"):
        assert m_micro[k] == pytest.approx(m_full[k], rel=1e-5, abs=1e-6), k
    g_scope, *_ = step(tiny_model_dir, stale_batch, P4O(), micro_batch=MicroBatch(size=3), ess_scope="micro")
    assert not torch.allclose(g_scope, g_full, atol=1e-6)


@pytest.mark.parametrize("cut", [{}, {"micro_batch": MicroBatch(size=3)}], ids=["one-pass", "micro"])
def test_with_its_own_pass_as_proximal_it_is_p3o(tiny_model_dir, stale_batch, cut):
    """A phase's first step (one step per rollout: every step) takes pi_prox from its own gradient pass: e_prox
    = 1 and the update is P3O's, through the pre-pass too."""
    first = replace(stale_batch, proximal=Proximal(0, "own_pass"), prox_logprobs=None)
    g4, m4, e4 = step(tiny_model_dir, first, P4O(), **cut)
    g3, m3, e3 = step(tiny_model_dir, first, P3O(), **cut)
    assert m4["train/ess_prox"] == 1.0 and m4["train/mix_w_prox"] == 0.0 and float(e4) == float(e3) < 0.99
    assert torch.allclose(g4, g3, atol=1e-7, rtol=1e-6) and m4["train/loss"] == pytest.approx(m3["train/loss"], abs=1e-7)


class Kept(L.pytorch.loggers.Logger):
    """A logger that keeps every step's metrics."""

    name, version = "kept", 0

    def __init__(self):
        super().__init__()
        self.steps: list[dict[str, float]] = []

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        if "train/loss" in metrics:
            self.steps.append(dict(metrics))


def test_trains_through_the_module_with_two_steps_per_rollout(tiny_model_dir):
    """A plain Trainer, 2 optimizer steps per rollout, micro-batches of 3 rows: at each phase's first step
    pi_prox is the policy itself (e_prox = 1, the mixture is pi_b); at its second the first step has moved
    the policy, so e_prox < 1 and pi_prox takes a share of the mixture."""
    from lit_ess.callbacks import WeightSync
    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.engines import HFConfig
    from lit_ess.sampling import SamplingConfig
    from lit_ess.module import PolicyModule

    kept = Kept()
    dm = RolloutDataModule(model_path=tiny_model_dir, engine=HFConfig(), source=Arithmetic(size=200),
                           batch=BatchShape(prompts_per_rollout=4, samples_per_prompt=4, steps_per_rollout=2),
                           sampling=SamplingConfig(max_new_tokens=6, seed=0), reward="e2e_utils:digit_fraction")
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=kept, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[WeightSync()])
    trainer.fit(PolicyModule(tiny_model_dir, objective=P4O(), micro_batch=MicroBatch(size=3), optim=Optim(lr=1e-2)), dm)
    assert len(kept.steps) == 4 and all(math.isfinite(s["train/loss"]) for s in kept.steps)
    first, second = kept.steps[0::2], kept.steps[1::2]
    for s in first:
        assert s["train/ess_prox"] == pytest.approx(1.0, abs=1e-9) and s["train/mix_w_prox"] == 0.0
        assert s["train/ess_mix"] == pytest.approx(s["train/ess_b"], abs=1e-9)
    for s in second:
        assert s["train/ess_prox"] < 1 - 1e-6 and s["train/mix_w_prox"] > 0 and s["train/kl_prox"] > 0
        assert s["train/ess_mix"] == pytest.approx(min(s["train/ess_b"], s["train/ess_prox"]), abs=1e-9)
        assert s["train/ess"] == pytest.approx(s["train/ess_mix"], abs=1e-6)
