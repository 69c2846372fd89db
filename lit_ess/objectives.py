"""Policy-gradient objectives for RL post-training of language models: P3O and its baselines.

Pure tensor code, no Lightning. Every objective takes `[B, T]` tensors of the tokens sampled by the
rollout engine:

    logprobs           log pi_theta(y_t | .)   (differentiable, from the trainer)
    behavior_logprobs  log pi_b(y_t | .)       (what the engine really sampled with)
    advantages         A_t                     ([B, T], or [B] broadcast over the sequence)
    mask               1 for completion tokens, 0 for prompt and padding

and returns an `ObjectiveOutput(loss, metrics)`. With rho_t = pi_theta / pi_b, the normalised effective
sample size of the batch is

    e_B = (sum_t rho_t)^2 / (n * sum_t rho_t^2)         in [1/n, 1], n = number of masked tokens

and P3O ("Trust the Batch, On- or Off-Policy", arXiv 2605.12380) minimises

    L = -mean_t[ sg(min(rho_t, e_B)) * log pi_theta(y_t) * A_t ] + (1 - e_B) * mean_t[ k3_t ]
    k3_t = exp(lb_t - lp_t) - 1 - (lb_t - lp_t)            (estimator of KL(pi_theta || pi_b))

Fresh data gives e_B = 1 and plain REINFORCE; stale or mismatched data lowers e_B, which tightens the
cap and strengthens the pull toward pi_b. There is no clip range. P4O (the authors' follow-up) adds the
proximal policy as a second anchor: cap min(rho, e_b, e_prox) and a KL toward a mixture of pi_b and
pi_prox; with one optimizer step per rollout it is exactly P3O.

Aggregation ("token-mean" by default) is over the masked tokens of the *whole optimizer step*: when a
step is split into micro-batches pass `num_tokens` (and `num_seqs`) of the full step so that the
micro-batch losses add up to the step loss.

`proximal_logprobs` (log pi_prox, [B, T]) are the trainer's own logprobs of the tokens with the weights
that start the rollout phase (verl's and TRL's "old" logprobs; PolicyModule scores them once per phase,
`PolicyModule.score_phase`). Objectives that use them (`needs_proximal`: DecoupledPPO, GRPO/DAPO/GSPO
with `old: proximal`, P3O with `kl_anchor: behavior_at_train_temperature`, P4O, any objective with a
`correction`) take a call without them to be the first step on its data, where pi_prox is the current
policy: lp.detach().

The clipped objectives (GRPO, DAPO, GSPO) take their ratio r = pi_theta / pi_old against the policy
named by `old`:
    behavior   pi_b, the sampler's logprobs (verl's bypass mode; the default)
    proximal   pi_prox (verl's and TRL's default): the clip acts from the phase's second step on, and
               the sampler mismatch pi_prox / pi_b is left to `correction`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import Tensor

from .gradient_profile import gradient_profile, term_shares, token_grad
from .knobs import check

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# k3 is exact for log(pi_theta/pi_b) >= K3_LINEAR_BELOW and continued linearly below it: the value and
# the gradient stay finite and the gradient keeps its sign (it still pulls log pi_theta up).
K3_LINEAR_BELOW = -20.0
# Ratios reported in metrics are exp(log-ratio) with the log-ratio clamped here, so they stay finite.
METRIC_LOG_RATIO_CLAMP = 80.0


@dataclass
class ObjectiveOutput:
    loss: Tensor                       # differentiable scalar
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached scalars, by their logged names (train/...)


# ----------------------------------------------------------------------------------------------
# Effective sample size


@dataclass
class ESSStats:
    """Partial statistics of the ESS, mergeable across micro-batches and ranks.

    With m = max log-ratio: s1 = sum exp(lr - m), s2 = sum exp(2 (lr - m)), n = token count, so
    e_B = s1^2 / (n s2) without ever forming exp(lr) itself.
    """

    m: Tensor   # float64 scalar, -inf when n == 0
    s1: Tensor
    s2: Tensor
    n: Tensor

    def merge(self, other: "ESSStats") -> "ESSStats":
        m = torch.maximum(self.m, other.m)
        a, b = _shift(self.m, m), _shift(other.m, m)
        return ESSStats(m, self.s1 * a + other.s1 * b, self.s2 * a * a + other.s2 * b * b, self.n + other.n)

    def all_reduce(self, group=None) -> "ESSStats":
        """Combine the statistics of every rank of `group` (a max, then one sum of three numbers)."""
        import torch.distributed as dist

        m = self.m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        scale = _shift(self.m, m)
        sums = torch.stack([self.s1 * scale, self.s2 * scale * scale, self.n])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        return ESSStats(m, sums[0], sums[1], sums[2])

    def value(self) -> Tensor:
        """e_B as a float64 scalar; 1.0 for an empty batch (which also contributes no loss)."""
        if self.n <= 0:
            return torch.ones((), dtype=torch.float64, device=self.n.device)
        return (self.s1 * self.s1 / (self.n * self.s2)).clamp(max=1.0)


def _shift(m_old: Tensor, m_new: Tensor) -> Tensor:
    """exp(m_old - m_new), with exp(-inf - x) = 0 for an empty part."""
    if torch.isinf(m_old) and m_old < 0:
        return torch.zeros_like(m_old)
    return torch.exp(m_old - m_new)


def ess_stats(log_ratio: Tensor, mask: Tensor) -> ESSStats:
    """Partial ESS statistics of the masked tokens of `log_ratio` ([B, T]), in float64."""
    lr = log_ratio.detach().to(torch.float64)
    valid = mask.bool()
    n = valid.sum().to(torch.float64)
    if n == 0:
        z = torch.zeros((), dtype=torch.float64, device=lr.device)
        return ESSStats(torch.full_like(z, -math.inf), z, z.clone(), n)
    m = lr[valid].max()
    x = torch.where(valid, lr - m, torch.full_like(lr, -math.inf))
    return ESSStats(m, torch.exp(x).sum(), torch.exp(2 * x).sum(), n)


def batch_ess(log_ratio: Tensor, mask: Tensor, group=None) -> Tensor:
    """Normalised ESS e_B = (sum rho)^2 / (n sum rho^2) over the masked tokens of `log_ratio`.

    Computed from log-ratios without forming rho, so a log-ratio of 800 gives the right tiny value
    instead of inf/inf. With `group` (a torch.distributed process group, or `True` for the default
    one) the statistics of all ranks are combined, giving the ESS of the concatenated batch.
    Returns a float64 scalar in [1/n, 1].
    """
    stats = ess_stats(log_ratio, mask)
    if group is not None:
        stats = stats.all_reduce(None if group is True else group)
    return stats.value()


# ----------------------------------------------------------------------------------------------
# Aggregation and input checks


def aggregate(
    x: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_len: int | None = None,
) -> Tensor:
    """Reduce per-token values `x` ([B, T]) to a scalar.

    token-mean               sum_{b,t} x m / N_tokens
    seq-mean-token-mean      sum_b (sum_t x m / len_b) / N_seqs
    seq-mean-token-sum-norm  sum_{b,t} x m / (N_seqs * norm_len)       (Dr.GRPO: norm_len is a constant,
                             the rollout's max_new_tokens in PolicyModule; here it defaults to T)

    N_tokens and N_seqs default to this batch's counts; pass the counts of the whole optimizer step
    when `x` is one of its micro-batches.
    """
    m = mask.to(x.dtype)
    if mode == "token-mean":
        denom = m.sum() if num_tokens is None else num_tokens
        return (x * m).sum() / torch.clamp(torch.as_tensor(denom, dtype=x.dtype, device=x.device), min=1.0)
    seqs = (m.sum(-1) > 0).sum() if num_seqs is None else num_seqs
    seqs = torch.clamp(torch.as_tensor(seqs, dtype=x.dtype, device=x.device), min=1.0)
    if mode == "seq-mean-token-mean":
        per_seq = (x * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        check("norm_len", norm_len, ge=1, null=True)
        return (x * m).sum() / (seqs * (x.shape[-1] if norm_len is None else norm_len))
    raise ValueError(f"aggregation={mode!r} is not one of {AGGREGATIONS}")


def _check_inputs(**tensors: Tensor | None) -> None:
    shape = tensors["logprobs"].shape
    if len(shape) != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name == "advantages" and t.shape == shape[:1]:
            continue
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logprobs has shape {tuple(shape)}")
        if name != "mask" and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if name == "mask" and (t.is_floating_point() and ((t != 0) & (t != 1)).any()):
            raise ValueError("mask must be boolean or hold only 0 and 1")


def _sanitize(mask: Tensor, *tensors: Tensor | None) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    """Mask out tokens where any input is NaN/inf; zero those entries so no NaN reaches the loss.

    Returns (mask, number of dropped tokens, cleaned tensors). `torch.where` routes a zero gradient
    to the dropped entries.
    """
    valid = mask.bool()
    finite = torch.ones_like(valid)
    for t in tensors:
        if t is not None:
            finite &= torch.isfinite(t)
    dropped = (valid & ~finite).sum()
    valid = valid & finite
    cleaned = [None if t is None else torch.where(finite, t, torch.zeros_like(t)) for t in tensors]
    return valid, dropped, cleaned


def k3(log_ratio: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_b) from lr = log pi_theta - log pi_b:

        k3 = exp(-lr) - 1 + lr              for lr >= K3_LINEAR_BELOW,
        continued by its tangent below it   (finite, same-sign gradient d k3 / d lr = 1 - exp(-lr)).
    """
    L = K3_LINEAR_BELOW
    c = log_ratio.clamp(min=L)                       # exp(-c) never overflows
    tail = (math.exp(-L) - 1 + L) + (1 - math.exp(-L)) * (log_ratio - L)
    return torch.where(log_ratio >= L, torch.exp(-c) - 1 + c, tail)   # where: no cancellation in the grad


def k3_sampled(log_ratio: Tensor) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_b) on tokens sampled from pi_b (k3 importance-weighted):

        KL(pi_theta || pi_b) = E_pi_b[ rho log rho ] = E_pi_b[ rho k3 ] = E_pi_b[ 1 - rho + rho lr ]   (>= 0)
        d / d lr = rho lr                   (the exact gradient of the KL; k3's is 1 - 1/rho)

    k3 alone estimates the KL on tokens drawn from pi_theta; on pi_b's tokens its expectation is
    E_b[1/rho] - 1 - KL(pi_b || pi_theta), and its gradient 1 - 1/rho is unbounded as rho -> 0: the
    staler the data, the harder tokens the policy has left are pulled back. Here a token with rho -> 0
    contributes nothing (the gradient's minimum is -1/e at rho = 1/e). Continued by its tangent above
    lr = -K3_LINEAR_BELOW (20), so it stays finite, and flat below K3_LINEAR_BELOW (its gradient there,
    lr e^lr, is under 5e-8).
    """
    U = -K3_LINEAR_BELOW
    c = log_ratio.clamp(K3_LINEAR_BELOW, U)
    head = (c * torch.exp(c) - torch.expm1(c)).clamp(min=0)     # = 1 - rho + rho lr, rounding kept >= 0
    tail = (1 - math.exp(U) + U * math.exp(U)) + U * math.exp(U) * (log_ratio - U)
    return torch.where(log_ratio <= U, head, tail)


KL_ESTIMATORS = {"k3": k3, "k3_sampled": k3_sampled, "k3_sampled_capped": k3_sampled}


def kl_weight_cap(kl_estimator: str, log_ratio: Tensor, e: Tensor) -> Tensor | float:
    """The detached factor on each token's KL estimate [B, T]. "k3_sampled_capped": the KL's importance
    weight rho capped as the policy-gradient weight is, min(rho, e_B), so the factor on rho k3 is
    sg(min(1, e_B / rho)): value min(1, e_B / rho) (1 - rho + rho lr) >= 0, gradient min(rho, e_B) lr, linear
    in lr where rho > e_B instead of rho lr's exponential growth (a token the policy raised far above pi_b).
    Every other estimator: 1."""
    if kl_estimator != "k3_sampled_capped":
        return 1.0
    return (e * torch.exp(-log_ratio.detach())).clamp(max=1.0)      # exp(800) = inf -> 1; exp(-800) = 0 -> 0


def ratio_metrics(log_ratio: Tensor, mask: Tensor, ess: Tensor | None = None) -> dict[str, Tensor]:
    """Detached statistics of rho over the masked tokens: mean/min/max, quantiles, KL to pi_b."""
    with torch.no_grad():
        valid = mask.bool()
        if not valid.any():
            return {}
        lr = log_ratio.detach().float()[valid]
        rho = lr.clamp(-METRIC_LOG_RATIO_CLAMP, METRIC_LOG_RATIO_CLAMP).exp()
        q = torch.quantile(rho, torch.tensor([0.05, 0.5, 0.95], device=rho.device))
        out = {
            "train/ratio_mean": rho.mean(),
            "train/ratio_min": rho.min(),
            "train/ratio_max": rho.max(),
            "train/ratio_p05": q[0],
            "train/ratio_p50": q[1],
            "train/ratio_p95": q[2],
            "train/log_ratio_abs_max": lr.abs().max(),
            "train/kl_behavior": k3(lr).mean(),
            "train/approx_kl": 0.5 * (lr * lr).mean(),
        }
        if ess is not None:
            out["train/ess"] = ess.detach().float()
            # rho > e_B, with a 1e-5 margin in log space so float noise at e_B = 1 does not count
            out["train/capped_frac"] = (lr > torch.log(ess.float()) + 1e-5).float().mean()
        return out


# ----------------------------------------------------------------------------------------------
# Mismatch corrections (composable with every objective)


@dataclass
class ISCorrection:
    """The field's correction for a sampler that is not the trainer's policy: a detached weight c_t >= 0
    on each token's policy-gradient term, from the importance ratio of the proximal policy to the
    sampler, w = pi_prox / pi_b (TRL's `vllm_importance_sampling_correction`, verl's
    `rollout_correction`, IcePop).

    level   token:      w_t = exp(lp_prox_t - lb_t)
            sequence:   w_b = exp(sum_t (lp_prox_t - lb_t)), the same for every token of the sequence
            geometric:  w_b = exp(mean_t (lp_prox_t - lb_t)), the per-token geometric mean
    mode    truncate:   c = min(w, high), and max(c, low) when low is set        (TIS)
            mask:       c = w if low <= w <= high else 0     (IcePop; TRL's *_mask masks above high only: low 0)
            reject:     c = 1 if low <= w <= high else 0     (verl's rejection masks, which also drop the
                                                               token from the normalisation; here it stays)

    The weight multiplies the token's advantage, which scales the objective's surrogate by c_t (each is
    linear in A_t for c_t >= 0: min(r A c, clip(r) A c) = c min(r A, clip(r) A)); KL and entropy terms
    are not reweighted, and a masked token still counts in the loss's token normalisation (as in TRL).
    So that the mismatch is counted once, the objective's own ratio is then taken against pi_prox
    instead of pi_b (GRPO/DAPO/GSPO/CISPO clip r = pi_theta / pi_prox, DecoupledPPO's behaviour weight
    becomes c), as TRL and verl do. P3O keeps rho = pi_theta / pi_b for its ESS and cap: its weight is
    min(rho, e_B) * c. pi_prox is the objective's `proximal_logprobs` (PolicyModule gives them), else
    the current policy before the update (detached): the trainer's own logprobs, exact for the first
    step after a rollout; with several steps per rollout (or async) w then also holds staleness.

    Args:
        level: token, sequence or geometric.
        mode: truncate, mask or reject.
        high: upper bound C of the ratio (TRL's cap, verl's threshold 2.0), > 0.
        low: lower bound in [0, high]; None = none for truncate, 1 / high for mask and reject; 0 = none.
    """

    level: Literal["token", "sequence", "geometric"] = "token"
    mode: Literal["truncate", "mask", "reject"] = "truncate"
    high: float = 2.0
    low: float | None = None

    def __post_init__(self):
        if self.level not in ("token", "sequence", "geometric"):
            raise ValueError(f"correction.level={self.level!r} is not one of ('token', 'sequence', 'geometric')")
        if self.mode not in ("truncate", "mask", "reject"):
            raise ValueError(f"correction.mode={self.mode!r} is not one of ('truncate', 'mask', 'reject')")
        check("correction.high", self.high, gt=0)
        check("correction.low", self.low, ge=0, null=True)
        low = self.low if self.low is not None or self.mode == "truncate" else 1 / self.high
        if low is not None and not low <= self.high:
            raise ValueError(f"correction bounds must satisfy 0 <= low <= high; got low={self.low} "
                             f"(in effect {low}), high={self.high}")

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(c [B, T] detached, metrics) from the log-ratio log(pi_prox / pi_b) [B, T] and the token mask."""
        with torch.no_grad():
            m = mask.to(log_ratio.dtype)
            lr = log_ratio * m
            if self.level == "sequence":
                lr = lr.sum(-1, keepdim=True).expand_as(lr)
            elif self.level == "geometric":
                lr = (lr.sum(-1) / m.sum(-1).clamp(min=1))[:, None].expand_as(lr)
            w = lr.clamp(-METRIC_LOG_RATIO_CLAMP, METRIC_LOG_RATIO_CLAMP).exp()
            low = self.low if self.low is not None or self.mode == "truncate" else 1 / self.high
            inside = (w <= self.high) & (w >= (low or 0.0))
            if self.mode == "truncate":
                c = w.clamp(min=low, max=self.high)
            else:
                c = torch.where(inside, w if self.mode == "mask" else torch.ones_like(w), torch.zeros_like(w))
            c = c * m
            n = m.sum().clamp(min=1)
            metrics = {"train/is_weight_mean": c.sum() / n, "train/is_outside_frac": (~inside & mask.bool()).float().sum() / n}
        return c, metrics


# ----------------------------------------------------------------------------------------------
# Objectives


@dataclass
class Objective:
    """Base class: input checks, NaN masking, entropy bonus and reference-KL penalty.

    Objectives are dataclasses: their fields are the hyper-parameters, so a config can name one as
    `class_path: lit_ess.objectives.GRPO` with `init_args`, and `--print_config` lists every field.
    Subclasses implement `policy_loss(lp, lb, adv, mask, agg, **extra) -> (loss, metrics)`.

    Args:
        aggregation: how per-token terms become a scalar: token-mean (over every token of the
            optimizer step), seq-mean-token-mean, or seq-mean-token-sum-norm (Dr.GRPO). None = the
            objective's own default (token-mean; seq-mean-token-mean for GSPO), so switching the
            class_path of a config does not carry one objective's aggregation over to another.
        entropy_coef: weight of an entropy bonus, >= 0 (0 = off).
        ref_kl_coef: weight of a k3 KL penalty to a frozen reference model, >= 0 (0 = off; > 0 loads the
            reference model, which is scored exactly as the policy).
        norm_len: the constant length of seq-mean-token-sum-norm, >= 1. None = the rollout's
            max_new_tokens (PolicyModule passes it), else the width T of the call's tensors.
        correction: a mismatch correction (ISCorrection: truncated IS, IcePop masks, sequence masks)
            weighting each token's policy-gradient term; None = off.
    """

    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    entropy_coef: float = 0.0
    ref_kl_coef: float = 0.0
    norm_len: int | None = None
    correction: ISCorrection | None = None

    name: ClassVar[str] = "base"
    needs_ess: ClassVar[bool] = False
    # also weighs by the ESS of pi_theta / pi_prox (P4O): PolicyModule then passes `proximal_ess` as well
    needs_proximal_ess: ClassVar[bool] = False
    # with a correction, take the objective's ratio against pi_prox (the correction's weight carries
    # pi_prox / pi_b), so the mismatch is not counted twice; P3O keeps its ratio against pi_b
    rebase_on_correction: ClassVar[bool] = True
    default_aggregation: ClassVar[str] = "token-mean"

    def __post_init__(self):
        if self.aggregation is None:
            self.aggregation = self.default_aggregation
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r} is not one of {AGGREGATIONS}")
        cls = type(self).__name__
        check(f"{cls}.entropy_coef", self.entropy_coef, ge=0)
        check(f"{cls}.ref_kl_coef", self.ref_kl_coef, ge=0)
        check(f"{cls}.norm_len", self.norm_len, ge=1, integer=True, null=True)
        if self.correction is not None and not isinstance(self.correction, ISCorrection):
            raise ValueError(f"correction must be an ISCorrection or None, got {self.correction!r}")

    @property
    def needs_proximal(self) -> bool:
        """True when the loss uses pi_prox: a correction (its weight is pi_prox / pi_b), or the objective's
        own terms (subclasses). PolicyModule then scores them once per rollout phase."""
        return self.correction is not None

    @property
    def proximal_stands_for_behavior(self) -> bool:
        """True when the objective uses pi_prox as the behaviour weights scored by the trainer (P3O's
        kl_anchor): exact only when no row is older than the phase's first step (sync, S = k - 1)."""
        return False

    def __call__(
        self,
        logprobs: Tensor,
        behavior_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        ess: Tensor | float | None = None,
        proximal_ess: Tensor | float | None = None,
        proximal_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        entropy: Tensor | None = None,
        num_tokens: float | Tensor | None = None,
        num_seqs: float | Tensor | None = None,
        norm_len: int | None = None,
    ) -> ObjectiveOutput:
        _check_inputs(logprobs=logprobs, behavior_logprobs=behavior_logprobs, advantages=advantages,
                      mask=mask, proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs, entropy=entropy)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(logprobs)
        if self.ref_kl_coef and ref_logprobs is None:
            raise ValueError(f"{self.name}: ref_kl_coef={self.ref_kl_coef} needs ref_logprobs")
        if self.entropy_coef and entropy is None:
            raise ValueError(f"{self.name}: entropy_coef={self.entropy_coef} needs entropy")
        valid, dropped, (lp, lb, adv, prox, ref, ent) = _sanitize(
            mask, logprobs, behavior_logprobs, advantages, proximal_logprobs, ref_logprobs, entropy)

        norm_len = norm_len if self.norm_len is None else self.norm_len

        def agg(x: Tensor) -> Tensor:
            return aggregate(x, valid, self.aggregation, num_tokens, num_seqs, norm_len)

        if self.correction is None:
            def policy_loss_of(x: Tensor) -> Tensor:
                return self.policy_loss(x, lb, adv, valid, agg, ess=ess, proximal_ess=proximal_ess,
                                        proximal_logprobs=prox)[0]

            loss, metrics = self.policy_loss(lp, lb, adv, valid, agg, ess=ess, proximal_ess=proximal_ess,
                                             proximal_logprobs=prox)
        else:
            base = lp.detach() if prox is None else prox
            weight, correction = self.correction(base - lb, valid)
            # the mismatch pi_prox / pi_b is carried by the weight alone: the objective's own ratio is
            # taken against pi_prox (its clip then acts around the trainer's policy, as in TRL and verl)
            rebased = base if self.rebase_on_correction else lb

            def policy_loss_of(x: Tensor) -> Tensor:
                return self.policy_loss(x, rebased, adv * weight, valid, agg, ess=ess, proximal_ess=proximal_ess,
                                        proximal_logprobs=prox)[0]

            loss, metrics = self.policy_loss(lp, rebased, adv * weight, valid, agg, ess=ess, proximal_ess=proximal_ess,
                                             proximal_logprobs=prox)
            if self.rebase_on_correction:
                metrics.update(ratio_metrics(lp - lb, valid))      # the ratio statistics stay against pi_b
            metrics.update(correction)
        metrics["train/policy_loss"] = loss.detach()
        metrics.update(gradient_profile(token_grad(policy_loss_of, lp), lp - lb, adv, valid, agg))
        # the policy's cross-entropy on the sampled tokens: its entropy when the data is on-policy, a cheap
        # trace of a collapse (no pass over the vocabulary)
        metrics["train/sample_nll"] = -(lp.detach().float() * valid).sum() / valid.sum().clamp(min=1)
        if self.entropy_coef:
            ent_term = agg(ent)
            loss = loss - self.entropy_coef * ent_term
            metrics["train/entropy"] = ent_term.detach()
        if self.ref_kl_coef:
            ref_kl = agg(k3(lp - ref))
            loss = loss + self.ref_kl_coef * ref_kl
            metrics["train/kl_ref"] = ref_kl.detach()
        metrics["train/nonfinite_tokens"] = dropped.float()
        metrics["train/tokens"] = valid.sum().float()
        metrics["train/loss"] = loss.detach()
        return ObjectiveOutput(loss, metrics)

    def policy_loss(self, lp, lb, adv, mask, agg, **extra) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError


def _clip_fractions(ratio: Tensor, adv: Tensor, mask: Tensor, low: float, high: float) -> dict[str, Tensor]:
    """TRL-style clip statistics: tokens where the clipped branch is the active one."""
    m = mask.float()
    n = m.sum().clamp(min=1)
    low_hit = ((ratio < low) & (adv < 0)).float() * m
    high_hit = ((ratio > high) & (adv > 0)).float() * m
    return {"train/clip_ratio_low": low_hit.sum() / n, "train/clip_ratio_high": high_hit.sum() / n,
            "train/clip_ratio": (low_hit + high_hit).sum() / n}


@dataclass
class P3O(Objective):
    """Batch-adaptive ESS objective (no clip range, no extra hyper-parameter).

        L = -agg[ sg(min(rho, e_B)) * lp * A ] + (1 - e_B) * agg[ k3(lp - lb) ]

    `ess` may be passed precomputed (the ESS of the whole optimizer step, over micro-batches and
    ranks); otherwise it is the ESS of this call's tokens.

    The KL anchor at the trainer's temperature (`kl_anchor: behavior_at_train_temperature`). With
    z_b the logits of the behaviour weights theta_b, the sampler draws from pi_b = softmax(z_b / T_s)
    and the trainer scores pi_theta = softmax(z_theta / T_t). When T_s != T_t, pi_b is a tempered copy
    of the policy, and KL(pi_theta || pi_b) pulls pi_theta toward it: flatter for T_s > T_t, and the
    next rollout tempers the flatter policy again (docs/results.md: P3O sampled at 1.5, trained at 1.0,
    collapses; without the KL term it does not). The principled anchor is the behaviour weights at the
    trainer's temperature, pi_b' = softmax(z_b / T_t), while the ratio keeps the sampler's true pi_b:

        rho_t = pi_theta(y_t) / pi_b(y_t)                  (ESS e_B and the cap, as above)
        L = -agg[ sg(min(rho_t, e_B)) lp_t A_t ] + (1 - e_B) agg[ k3(lp_t - la_t) ],   la_t = log pi_b'(y_t)

    KL(pi_theta || pi_b') is 0 at theta = theta_b: a trust region around the weights that sampled, with
    no pull toward another temperature. The engine returns log pi_b(y_t) for the sampled token only,
    and log pi_b'(y) = (T_s / T_t)(log pi_b(y) + log Z_s) - log Z_t needs both partition functions
    over the vocabulary, so la_t comes from the trainer: the proximal logprobs (the weights that start
    the phase, scored at T_t by PolicyModule.score_phase), which are theta_b's in sync mode
    (a phase is sampled with the weights of the step that trains its first batch). In async mode with
    rows older than their phase's first step, the anchor is that newer policy at T_t (warned once). With T_s = T_t
    and an engine at the trainer's precision, la_t = lb_t: the two anchors agree.

    Args:
        ess_cap: cap the detached weight at e_B (ablation). False: sg(rho) itself (plain importance
            sampling, log-ratios clamped at +-20 so rho stays finite).
        adaptive_kl: add the (1 - e_B) KL term (ablation). False: the policy-gradient term alone.
        kl_anchor: the KL term's reference. "behavior": the sampler's pi_b (the paper's).
            "behavior_at_train_temperature": the behaviour weights scored by the trainer at its own
            temperature (see above; the trainer's proximal logprobs).
        kl_estimator: the per-token KL estimate. "k3" (the paper's): exp(-lr) - 1 + lr, whose gradient
            1 - 1/rho grows without bound on tokens the policy has left (rho -> 0). "k3_sampled": k3
            weighted by rho, the estimate for tokens drawn from pi_b (`k3_sampled`), whose gradient is the
            KL's own, rho log rho, and vanishes as rho -> 0 (docs/results.md, "Where P3O breaks").
            "k3_sampled_capped": k3_sampled with its importance weight rho capped at e_B as the
            policy-gradient weight is (`kl_weight_cap`): gradient min(rho, e_B) lr, bounded by e_B |lr| where
            the policy raised a token far above pi_b (rho lr grows as e^lr there).
    """

    ess_cap: bool = True
    adaptive_kl: bool = True
    kl_anchor: Literal["behavior", "behavior_at_train_temperature"] = "behavior"
    kl_estimator: Literal["k3", "k3_sampled", "k3_sampled_capped"] = "k3"
    rebase_on_correction: ClassVar[bool] = False
    name: ClassVar[str] = "p3o"
    needs_ess: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.kl_anchor not in ("behavior", "behavior_at_train_temperature"):
            raise ValueError(f"p3o: kl_anchor={self.kl_anchor!r} is not one of ('behavior', "
                             f"'behavior_at_train_temperature')")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"p3o: kl_estimator={self.kl_estimator!r} is not one of {tuple(KL_ESTIMATORS)}")
        if self.kl_estimator == "k3_sampled_capped" and not self.ess_cap:
            raise ValueError("p3o: kl_estimator='k3_sampled_capped' caps the KL's weight at e_B as the policy gradient's "
                             "is; with ess_cap=false nothing is capped: use kl_estimator='k3_sampled'")
        if self.kl_estimator.startswith("k3_sampled") and self.kl_anchor != "behavior":
            # rho * k3 estimates KL(pi || anchor) only for tokens drawn from the anchor; these are drawn from pi_b
            raise ValueError(f"p3o: kl_estimator={self.kl_estimator!r} estimates the KL on the sampler's own tokens and needs "
                             f"kl_anchor='behavior' (got kl_anchor={self.kl_anchor!r})")

    @property
    def needs_proximal(self) -> bool:
        return super().needs_proximal or self.proximal_stands_for_behavior

    @property
    def proximal_stands_for_behavior(self) -> bool:
        return self.adaptive_kl and self.kl_anchor == "behavior_at_train_temperature"

    def policy_loss(self, lp, lb, adv, mask, agg, ess=None, proximal_logprobs=None, **_):
        log_ratio = lp - lb
        e = _given_or_batch_ess(ess, log_ratio, mask)
        if self.ess_cap:
            weight = torch.minimum(log_ratio.detach().exp(), e)       # exp(800) = inf -> min gives e
        else:
            weight = log_ratio.detach().clamp(-20.0, 20.0).exp()
        pg = agg(-weight * lp * adv)
        anchor = lb if self.kl_anchor == "behavior" else _old_logprobs("proximal", lp, lb, proximal_logprobs)
        cap = kl_weight_cap(self.kl_estimator, log_ratio, e)                # 1 but for k3_sampled_capped
        kl_of = lambda x: cap * KL_ESTIMATORS[self.kl_estimator](x)
        kl = agg(kl_of(lp - anchor))
        loss = pg + (1 - e) * kl if self.adaptive_kl else pg
        metrics = ratio_metrics(log_ratio, mask, e)
        if not self.ess_cap:
            metrics.pop("train/capped_frac", None)                     # nothing is capped
        metrics["train/kl_term"] = kl.detach()
        if self.adaptive_kl:
            metrics.update(term_shares(token_grad(lambda x: agg(-weight * x * adv), lp),
                                       token_grad(lambda x: (1 - e) * agg(kl_of(x - anchor)), lp), mask, "kl"))
        return loss, metrics


def _given_or_batch_ess(ess: Tensor | float | None, log_ratio: Tensor, mask: Tensor) -> Tensor:
    """The ESS passed (the step's, over micro-batches and ranks), else this call's, of exp(log_ratio) [B, T]:
    a detached scalar in log_ratio's dtype."""
    e = batch_ess(log_ratio, mask) if ess is None else torch.as_tensor(ess, dtype=torch.float64)
    return e.to(device=log_ratio.device, dtype=log_ratio.dtype).detach()


# P4O's mixture KL term is skipped when its weight 1 - e_mix is at most this (the authors' eps_gate)
P4O_KL_GATE = 1e-6


@dataclass
class P4O(Objective):
    """P3O with two anchors, the sampler pi_b and the proximal policy pi_prox, as the P3O paper's authors
    define it in their code (FeynRL, algs/P4O/p4o.py):

        rho_b = pi_theta / pi_b,   rho_prox = pi_theta / pi_prox                [B, T] each
        e_b, e_prox = the normalised ESS of rho_b, rho_prox (over the step),   e_mix = min(e_b, e_prox)
        w_b = 1 - e_b,   w_prox = 1 - e_prox                                    the staler anchor weighs more
        log pi_mix = logsumexp(log w_b + lb, log w_prox + lprox) - log(w_b + w_prox)
        L = -agg[ sg(min(rho_b, e_mix)) lp A ] + (1 - e_mix) agg[ k3(lp - log pi_mix) ]

    The KL term is skipped when 1 - e_mix <= P4O_KL_GATE (1e-6): both anchors are then fresh, and
    w_b + w_prox = 0, where the mixture is undefined, can only happen there. An anchor of weight 0 drops
    out of the mixture exactly (log 0 = -inf in the logsumexp).

    pi_prox is the trainer's policy with the weights that start the rollout phase (PolicyModule scores it
    once per phase, `score_phase`; `needs_proximal`); a call without `proximal_logprobs` is the phase's
    first step, pi_prox = lp.detach(). `ess` and `proximal_ess` may be passed precomputed (the step's,
    over micro-batches and ranks: PolicyModule's pre-pass); otherwise they are this call's.

    What it reduces to: at a phase's first step pi_prox is the current policy, so e_prox = 1, w_prox = 0,
    pi_mix = pi_b and e_mix = e_b: the loss is exactly P3O's. With one optimizer step per rollout every
    step is a first step, so P4O is P3O; it differs only with several steps per rollout, where the cap
    also tightens with the drift from pi_prox and the KL pulls toward the mixture of the two anchors.

    Metrics: `train/ess` is e_mix (the ESS the loss uses; `train/capped_frac` counts rho_b > e_mix),
    `train/ess_b`, `train/ess_prox`, `train/ess_mix`, the normalised mixture weights `train/mix_w_b` and
    `train/mix_w_prox` (w / (w_b + w_prox); both 0 when the term is skipped with w_b + w_prox = 0), and the
    k3 estimates `train/kl_b`, `train/kl_prox`, `train/kl_mix` (0 when the term is skipped), aggregated
    as the loss is.
    """

    name: ClassVar[str] = "p4o"
    needs_ess: ClassVar[bool] = True
    needs_proximal_ess: ClassVar[bool] = True
    rebase_on_correction: ClassVar[bool] = False      # as P3O: rho_b stays against pi_b, a correction multiplies

    @property
    def needs_proximal(self) -> bool:
        return True

    def policy_loss(self, lp, lb, adv, mask, agg, ess=None, proximal_ess=None, proximal_logprobs=None, **_):
        prox = _old_logprobs("proximal", lp, lb, proximal_logprobs)                  # [B, T], detached
        lr_b = lp - lb                                                               # [B, T]
        e_b = _given_or_batch_ess(ess, lr_b, mask)
        e_prox = _given_or_batch_ess(proximal_ess, lp - prox, mask)
        e_mix = torch.minimum(e_b, e_prox)
        pg = agg(-torch.minimum(lr_b.detach().exp(), e_mix) * lp * adv)             # exp(800) = inf -> e_mix
        w = torch.stack([1 - e_b, 1 - e_prox]).clamp(min=0)                         # [2]: w_b, w_prox
        share = w / w.sum() if w.sum() > 0 else torch.zeros_like(w)                 # normalised weights
        kl_mix, loss = torch.zeros_like(pg), pg
        if 1 - e_mix > P4O_KL_GATE:                                                  # then w.sum() > 1e-6
            log_mix = torch.logsumexp(torch.stack([lb, prox]) + share.log()[:, None, None], dim=0)   # [B, T]
            kl_mix = agg(k3(lp - log_mix))
            loss = pg + (1 - e_mix) * kl_mix
        metrics = ratio_metrics(lr_b, mask, e_mix)
        with torch.no_grad():
            metrics.update({"train/ess_b": e_b, "train/ess_prox": e_prox, "train/ess_mix": e_mix,
                            "train/mix_w_b": share[0], "train/mix_w_prox": share[1],
                            "train/kl_b": agg(k3(lr_b.detach())), "train/kl_prox": agg(k3(lp.detach() - prox)),
                            "train/kl_mix": kl_mix.detach()})
        return loss, metrics


OLD_POLICIES = ("behavior", "proximal")


def _old_logprobs(old: str, lp: Tensor, lb: Tensor, proximal_logprobs: Tensor | None) -> Tensor:
    """The policy a clipped objective's ratio is taken against: pi_b (`behavior`) or pi_prox
    (`proximal`; lp.detach() when a direct call gives none, i.e. the first step on the data)."""
    if old == "behavior":
        return lb
    return lp.detach() if proximal_logprobs is None else proximal_logprobs.detach()


class _ClipsAroundOld(Objective):
    """The clipped objectives' `old` switch (each declares the field, so its positional order stays):
    checked at construction; "proximal" asks the run for the trainer's proximal logprobs."""

    def __post_init__(self):
        super().__post_init__()
        if self.old not in OLD_POLICIES:
            raise ValueError(f"{self.name}: old={self.old!r} is not one of {OLD_POLICIES}")

    @property
    def needs_proximal(self) -> bool:
        return super().needs_proximal or self.old == "proximal"


def _ppo_clip_loss(lp, old, lb, adv, mask, agg, clip_low: float, clip_high: float):
    """-agg[ min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) ], r = pi_theta / pi_old (pi_b or pi_prox);
    log-ratios are clamped to +-20 before exp so r stays finite. The clip fractions are around pi_old;
    the ratio statistics stay against pi_b."""
    ratio = (lp - old).clamp(-20.0, 20.0).exp()
    low, high = 1 - clip_low, 1 + clip_high
    surr = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    metrics = ratio_metrics(lp - lb, mask)
    metrics.update(_clip_fractions(ratio.detach(), adv, mask, low, high))
    return agg(-surr), metrics


@dataclass
class GRPO(_ClipsAroundOld):
    """GRPO: PPO's clipped surrogate, symmetric clip.

        L = -agg[ min(r A, clip(r, 1 - clip_eps, 1 + clip_eps) A) ],   r = pi_theta / pi_old

    Args:
        clip_eps: clip range epsilon, > 0.
        old: the policy the ratio is taken against: "behavior" (pi_b) or "proximal" (pi_prox); see the
            module's docstring.
    """

    clip_eps: float = 0.2
    old: Literal["behavior", "proximal"] = "behavior"
    name: ClassVar[str] = "grpo"

    def __post_init__(self):
        super().__post_init__()
        check("GRPO.clip_eps", self.clip_eps, gt=0)

    def policy_loss(self, lp, lb, adv, mask, agg, proximal_logprobs=None, **_):
        old = _old_logprobs(self.old, lp, lb, proximal_logprobs)
        return _ppo_clip_loss(lp, old, lb, adv, mask, agg, self.clip_eps, self.clip_eps)


@dataclass
class DAPO(_ClipsAroundOld):
    """DAPO: the clipped surrogate with decoupled bounds (clip-higher) and token-mean aggregation.

    Args:
        clip_low: lower clip, r >= 1 - clip_low; > 0.
        clip_high: upper clip, r <= 1 + clip_high; > 0.
        old: the policy the ratio is taken against: "behavior" (pi_b) or "proximal" (pi_prox); see the
            module's docstring.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    old: Literal["behavior", "proximal"] = "behavior"
    name: ClassVar[str] = "dapo"

    def __post_init__(self):
        super().__post_init__()
        check("DAPO.clip_low", self.clip_low, gt=0)
        check("DAPO.clip_high", self.clip_high, gt=0)

    def policy_loss(self, lp, lb, adv, mask, agg, proximal_logprobs=None, **_):
        old = _old_logprobs(self.old, lp, lb, proximal_logprobs)
        return _ppo_clip_loss(lp, old, lb, adv, mask, agg, self.clip_low, self.clip_high)


@dataclass
class GSPO(_ClipsAroundOld):
    """GSPO: one length-normalised ratio per sequence, s_b = exp(mean_t (lp - lp_old)).

    Token form: s_bt = sg(s_b) * exp(lp - sg(lp)) (same value, per-token gradient), then
        L = -agg[ min(s_bt A, clip(s_bt, 1 - clip_low, 1 + clip_high) A) ]
    with seq-mean-token-mean aggregation by default, as in the paper.

    Args:
        clip_low: lower clip of the sequence ratio, s >= 1 - clip_low; > 0.
        clip_high: upper clip of the sequence ratio, s <= 1 + clip_high; > 0.
        old: the policy the ratio is taken against: "behavior" (pi_b) or "proximal" (pi_prox); see the
            module's docstring.
    """

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    old: Literal["behavior", "proximal"] = "behavior"
    name: ClassVar[str] = "gspo"
    default_aggregation: ClassVar[str] = "seq-mean-token-mean"

    def __post_init__(self):
        super().__post_init__()
        check("GSPO.clip_low", self.clip_low, gt=0)
        check("GSPO.clip_high", self.clip_high, gt=0)

    def policy_loss(self, lp, lb, adv, mask, agg, proximal_logprobs=None, **_):
        m = mask.to(lp.dtype)
        log_ratio = lp - _old_logprobs(self.old, lp, lb, proximal_logprobs)
        seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)          # [B]
        s = seq_log_ratio.detach().clamp(-20.0, 20.0).exp()[:, None] * torch.exp(lp - lp.detach())
        low, high = 1 - self.clip_low, 1 + self.clip_high
        surr = torch.minimum(s * adv, s.clamp(low, high) * adv)
        metrics = ratio_metrics(lp - lb, mask)
        metrics.update(_clip_fractions(s.detach(), adv, mask, low, high))
        return agg(-surr), metrics


@dataclass
class CISPO(Objective):
    """CISPO: REINFORCE weighted by the clipped, detached IS ratio.

        L = -agg[ sg(clip(rho, 1 - clip_low, 1 + clip_high)) * lp * A ]

    Args:
        clip_high: upper bound of the weight is 1 + clip_high; > 0.
        clip_low: lower bound of the weight is 1 - clip_low, in (0, 1]; None = no lower bound.
    """

    clip_high: float = 4.0
    clip_low: float | None = None
    name: ClassVar[str] = "cispo"

    def __post_init__(self):
        super().__post_init__()
        check("CISPO.clip_high", self.clip_high, gt=0)
        check("CISPO.clip_low", self.clip_low, gt=0, le=1, null=True)

    def policy_loss(self, lp, lb, adv, mask, agg, **_):
        log_ratio = lp - lb
        rho = log_ratio.detach().exp()
        low = None if self.clip_low is None else 1 - self.clip_low
        weight = rho.clamp(min=low, max=1 + self.clip_high)
        metrics = ratio_metrics(log_ratio, mask)
        metrics["train/capped_frac"] = ((rho > 1 + self.clip_high) & mask).float().sum() / mask.sum().clamp(min=1)
        return agg(-weight * lp * adv), metrics


@dataclass
class DecoupledPPO(Objective):
    """Decoupled PPO (Hilton et al. 2022; AReaL): PPO clip around a proximal policy pi_prox, with the
    behaviour correction as a separate, capped, detached weight.

        L = -agg[ min(pi_prox / pi_b, behavior_cap) * min(r A, clip(r, 1 - eps, 1 + eps) A) ],
        r = pi_theta / pi_prox

    pi_prox is the trainer's own policy with the weights that start the rollout phase (PolicyModule
    scores it once per phase): the clip acts from the phase's second step on. A
    direct call without `proximal_logprobs` takes the detached current logprobs, exact for the phase's
    first step (the policy just before this update is the proximal policy); with them alone the clip
    never acts and the loss is token-level truncated IS with cap behavior_cap.

    Args:
        clip_eps: clip range around the proximal policy, > 0.
        behavior_cap: cap of the behaviour weight pi_prox / pi_b, > 0.
    """

    clip_eps: float = 0.2
    behavior_cap: float = 5.0
    name: ClassVar[str] = "decoupled"

    def __post_init__(self):
        super().__post_init__()
        check("DecoupledPPO.clip_eps", self.clip_eps, gt=0)
        check("DecoupledPPO.behavior_cap", self.behavior_cap, gt=0)

    @property
    def needs_proximal(self) -> bool:
        return True

    def policy_loss(self, lp, lb, adv, mask, agg, proximal_logprobs=None, **_):
        prox = lp.detach() if proximal_logprobs is None else proximal_logprobs.detach()
        behave_w = (prox - lb).clamp(max=20.0).exp().clamp(max=self.behavior_cap)
        r = (lp - prox).clamp(-20.0, 20.0).exp()
        low, high = 1 - self.clip_eps, 1 + self.clip_eps
        surr = torch.minimum(r * adv, r.clamp(low, high) * adv)
        metrics = ratio_metrics(lp - lb, mask)
        metrics.update(_clip_fractions(r.detach(), adv, mask, low, high))
        metrics["train/behavior_capped_frac"] = ((prox - lb > math.log(self.behavior_cap)) & mask).float().sum() / mask.sum().clamp(min=1)
        return agg(-behave_w * surr), metrics


@dataclass
class REINFORCE(Objective):
    """Plain policy gradient, no importance weight: L = -agg[ lp * A ]."""

    name: ClassVar[str] = "reinforce"

    def policy_loss(self, lp, lb, adv, mask, agg, **_):
        return agg(-lp * adv), ratio_metrics(lp - lb, mask)


# Every objective of this module, in the order the docs list them.
OBJECTIVE_CLASSES: tuple[type[Objective], ...] = (P3O, P4O, GRPO, DAPO, GSPO, CISPO, DecoupledPPO, REINFORCE)

# Objectives are saved in checkpoints' hyper-parameters: let torch.load(weights_only=True) rebuild them.
torch.serialization.add_safe_globals([*OBJECTIVE_CLASSES, ISCorrection])
