"""Logged metrics: how each one combines over ranks (RULES, reduce_over_ranks), and unbiased pass@k.

Every key lit-ess logs has one rule in `RULES`; `accumulate` applies it over the micro-batches of a
step and `reduce_over_ranks` over data-parallel ranks, for the step's metrics and the rollout
statistics alike. A key without a rule raises: it is never silently averaged.

Held-out metrics: unbiased pass@k (Chen et al. 2021) as a torchmetrics metric.

For a prompt with n samples of which c pass, the probability that at least one of k samples drawn
without replacement passes is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)      (1 if n - c < k)

The product form avoids huge binomials. The metric keeps one row of pass@1..n per prompt and
concatenates the rows of every rank before averaging, so W ranks evaluating different prompts give
the mean over all prompts (torchmetrics syncs at `compute`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric


def pass_at_k(passed: Tensor) -> Tensor:
    """`passed`: [P, n] bool, n samples per prompt. Returns [P, n] float64: pass@k for k = 1..n."""
    P, n = passed.shape
    c = passed.sum(-1).to(torch.float64)                                  # [P]
    i = torch.arange(1, n + 1, dtype=torch.float64, device=passed.device)  # [n]: the i of the product
    k = i.clone()                                                          # [n]: the k of pass@k
    # factor (1 - k / i) for i in (n - c, n], else 1: [P, n(k), n(i)]
    factors = (1 - k[None, :, None] / i[None, None, :]).clamp(min=0.0)
    take = i[None, None, :] > (n - c)[:, None, None]
    prod = torch.where(take, factors, torch.ones_like(factors)).prod(-1)   # [P, n]
    return torch.where((n - c)[:, None] < k[None, :], torch.ones_like(prod), 1 - prod)


class PassAtK(Metric):
    """Mean pass@k over prompts, k = 1..n; `update(passed)` with passed: [P, n] bool."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    def update(self, passed: Tensor) -> None:
        self.rows.append(pass_at_k(passed.bool()))

    def compute(self) -> Tensor:
        rows = self.rows if isinstance(self.rows, Tensor) else torch.cat(self.rows) if self.rows else None
        if rows is None or rows.numel() == 0:
            return torch.zeros(0, dtype=torch.float64)
        return rows.mean(0)


# ----------------------------------------------------------------------------------------------
# How every logged metric combines over the micro-batches of a step and over data-parallel ranks


SUM = "sum"                  # x = sum_r x_r: counts, and losses already divided by the step's global counts
TOKEN_MEAN = "token_mean"    # x = sum_r (n_r / N) x_r: n_r = rank r's completion tokens, N = sum_r n_r
RANK_MEAN = "rank_mean"      # x = (1 / W) sum_r x_r: per-rank means over equally many rows
MIN = "min"                  # x = min_r x_r
MAX = "max"                  # x = max_r x_r
SAME = "same"                # equal on every rank (taken after a reduction, or global by construction): kept
RANK0 = "rank0"              # rank 0's own value (a timing logged by a callback; the logger writes on rank 0)
TORCHMETRICS = "torchmetrics"  # reduced by its torchmetrics state at compute (all rows of all ranks)


@dataclass(frozen=True)
class PooledStd:
    """The unbiased std of all M = sum_r m_r rows, from each rank's mean mu_r, std s_r and row count m_r:

        S = sum_r [ s_r^2 (m_r - 1) + m_r mu_r^2 ]         (sum of x^2 over rank r's rows)
        std = sqrt( (S - M mu^2) / (M - 1) )               mu = the mean over all rows
    """
    mean: str
    rows: str


# One rule per logged key. A key logged without a rule is an error (reduce_over_ranks raises; a test reads
# the keys of a real run), never a silent mean over ranks.
RULES: dict[str, str | PooledStd] = {
    # lit_ess/objectives.py: the objective's metrics, per micro-batch
    "train/loss": SUM,                         # token-mean terms divided by the step's N: micro-batches add up
    "train/policy_loss": SUM,
    "train/kl_term": SUM,
    "train/kl_ref": SUM,
    "train/entropy": SUM,
    "train/nonfinite_tokens": SUM,
    "train/tokens": SUM,
    "train/ratio_mean": TOKEN_MEAN,
    "train/ratio_min": MIN,
    "train/ratio_max": MAX,
    "train/ratio_p05": TOKEN_MEAN,             # quantiles: the token-weighted mean of the parts' quantiles
    "train/ratio_p50": TOKEN_MEAN,
    "train/ratio_p95": TOKEN_MEAN,
    "train/log_ratio_abs_max": MAX,
    "train/kl_behavior": TOKEN_MEAN,
    "train/approx_kl": TOKEN_MEAN,
    "train/ess": TOKEN_MEAN,                   # equal parts in scope step; the diagnostic ESS is global
    "train/capped_frac": TOKEN_MEAN,
    "train/ess_b": TOKEN_MEAN,                 # P4O: the ESS of each anchor and their min (equal parts in scope step)
    "train/ess_prox": TOKEN_MEAN,
    "train/ess_mix": TOKEN_MEAN,
    "train/mix_w_b": TOKEN_MEAN,               # P4O: the mixture's normalised weights, from those ESS
    "train/mix_w_prox": TOKEN_MEAN,
    "train/kl_b": SUM,                         # P4O: k3 to each anchor and to the mixture, aggregated as the loss
    "train/kl_prox": SUM,
    "train/kl_mix": SUM,
    "train/clip_ratio": TOKEN_MEAN,
    "train/clip_ratio_low": TOKEN_MEAN,
    "train/clip_ratio_high": TOKEN_MEAN,
    "train/behavior_capped_frac": TOKEN_MEAN,
    "train/grad_scale": TOKEN_MEAN,            # lit_ess/gradient_profile.py: each part's ratio or share,
    "train/grad_share_rho_lo": TOKEN_MEAN,     # token-weighted over the parts (not weighted by gradient mass)
    "train/grad_share_rho_hi": TOKEN_MEAN,
    "train/grad_share_neg_adv": TOKEN_MEAN,
    "train/kl_grad_share": TOKEN_MEAN,         # P3O: the (1 - e_B) KL term's share of dL/dlp, and its cosine
    "train/kl_grad_cos": TOKEN_MEAN,           # with the policy-gradient term's
    "train/sample_nll": TOKEN_MEAN,            # -lp of the sampled tokens (the entropy when on-policy)
    "train/is_weight_mean": TOKEN_MEAN,        # ISCorrection (objective.correction)
    "train/is_outside_frac": TOKEN_MEAN,
    # lit_ess/module.py: the optimizer step
    "train/grad_norm": SAME,                   # of the all-reduced gradients
    "train/lr": SAME,
    "train/skipped_steps": SAME,
    "train/batch_rows": SUM,
    "train/policy_lag": RANK_MEAN,
    "train/policy_lag_max": MAX,
    "train/token_lag": RANK_MEAN,              # mean lag of the step's trained tokens (in flight: below the rows')
    "train/ess_alarms": SAME,                  # cumulative; decided on the reduced ESS and lag (lit_ess/health.py)
    # lit_ess/rollout/worker.py: statistics of a rollout phase, each rank over its own rows
    "rollout/reward_mean": RANK_MEAN,
    "train/reward/NAME": RANK_MEAN,            # each reward of a weighted list (data.reward), unweighted
    "rollout/reward_std": PooledStd(mean="rollout/reward_mean", rows="rollout/rows"),
    "rollout/rows": SUM,
    "rollout/response_len": RANK_MEAN,
    "rollout/response_len_max": MAX,
    "rollout/truncated_frac": RANK_MEAN,
    "rollout/degenerate_frac": RANK_MEAN,
    "rollout/dropped_groups": SUM,
    "rollout/gen_seconds": MAX,
    "rollout/reward_seconds": MAX,             # the slowest rank's scorer
    "rollout/gen_tokens_per_s": SUM,
    "rollout/reward_errors": SUM,              # cumulative, each rank's own scorer
    "rollout/reward_timeouts": SUM,
    "rollout/phase": RANK_MEAN,                # the same phase on every rank
    "rollout/multi_version_frac": RANK_MEAN,   # rows sampled by 2+ weight versions (in-flight updates)
    # lit_ess/rollout/dapo.py: DAPO's dynamic sampling (one rank) and overlong penalty
    "rollout/refill_rounds": MAX,              # generation rounds of the phase after its first
    "rollout/batch_short": SUM,                # groups the phase lacks after max_rounds (trained short)
    "rollout/surplus_groups": SUM,             # groups with a signal generated past prompts_per_rollout, discarded
    "rollout/overlong_frac": RANK_MEAN,        # share of the phase's samples penalised
    "rollout/overlong_penalty": RANK_MEAN,     # their mean penalty (<= 0), over every sample
    # lit_ess/envs/episodes.py (data.env): multi-turn episodes, each rank over its own (equally many)
    "rollout/turns": RANK_MEAN,                # policy turns per episode
    "rollout/env_tokens": RANK_MEAN,           # environment tokens per episode
    "rollout/env_seconds": RANK_MEAN,          # environment step seconds per episode
    "rollout/tool_calls": RANK_MEAN,           # tool calls per episode
    "rollout/truncated_turns": SUM,            # episodes of the phase stopped by env.max_turns
    "rollout/truncated_tokens": SUM,           # ... by env.max_episode_tokens
    "rollout/truncated_prompts": SUM,          # ... not played: a first observation over max_prompt_tokens
    "rollout/env_errors": SUM,                 # cumulative, each rank's own environments
    "rollout/env_timeouts": SUM,
    # datamodules/rollout.py: the data stream, each rank its own buffer over the same prompt order
    "rollout/skipped_long_prompts": MAX,       # every rank draws the same prompts
    "data/skipped_rows": RANK_MEAN,
    "rollout/stale_dropped": SUM,
    "rollout/buffer_size": SUM,
    "perf/trainer_wait_frac": MAX,
    "perf/worker_idle_frac": RANK_MEAN,
    "rollout/phases_in_flight": MAX,           # the most on any rank
    "perf/train_seconds": MAX,                 # lit_ess/module.py: forward, backward, clip, optimizer step
    # callbacks/weight_sync.py, callbacks/proximal.py
    "perf/weight_sync_seconds": RANK0,
    "perf/proximal_seconds": RANK0,
    # lit_ess/module.py: validation (torchmetrics); val/pass@k stands for k = 1..n
    "val/reward_mean": TORCHMETRICS,
    "val/response_len": TORCHMETRICS,
    "val/pass@k": TORCHMETRICS,
    # lit_ess/sft.py (Lightning's self.log)
    "sft/loss": TORCHMETRICS,
    "sft/teacher_forced_seq_acc": TORCHMETRICS,
    # Lightning's own: the epoch of a self.log call, and TensorBoardLogger's placeholder hyper-parameter metric
    "epoch": SAME,
    "hp_metric": SAME,
}


def rule(key: str) -> str | PooledStd:
    """The rule of a logged key (`val/pass@3` -> `val/pass@k`); raises KeyError naming the table."""
    name = re.sub(r"^train/reward/.+$", "train/reward/NAME", re.sub(r"@\d+$", "@k", key))
    if name not in RULES:
        raise KeyError(f"metric {key!r} has no rule in lit_ess.metrics.RULES: declare how it combines over "
                       f"micro-batches and ranks (sum, token_mean, rank_mean, min, max, ...)")
    return RULES[name]


def accumulate(acc: dict[str, Tensor], metrics: dict[str, Tensor], tokens: Tensor) -> None:
    """Add one micro-batch's metrics into `acc`, the rank's values for the step, by each key's rule:

        sum         acc += x
        token_mean  acc += n_mb x        (divide by the rank's tokens at the end: `finish_token_means`)
        min / max   acc = min(acc, x) / max(acc, x)
    """
    for k, v in metrics.items():
        v, r = v.detach().double(), rule(k)
        if r == SUM:
            acc[k] = acc.get(k, 0.0) + v
        elif r == TOKEN_MEAN:
            acc[k] = acc.get(k, 0.0) + v * tokens
        elif r in (MIN, MAX):
            acc[k] = v if k not in acc else (torch.minimum if r == MIN else torch.maximum)(acc[k], v)
        else:
            raise ValueError(f"metric {k!r} has rule {r!r}, which does not combine micro-batches")


def finish_token_means(acc: dict[str, Tensor], tokens: Tensor) -> None:
    """Divide the token_mean sums of `accumulate` by the rank's tokens: the rank's token-weighted means."""
    for k in acc:
        if rule(k) == TOKEN_MEAN:
            acc[k] = acc[k] / tokens.clamp(min=1.0)


def reduce_over_ranks(values: dict[str, float | Tensor], token_share: float | Tensor = 1.0, device=None,
                      prefix: str = "") -> dict[str, float]:
    """This rank's values of the logged keys `prefix + key` -> the values of the whole step over all ranks,
    each by its rule in RULES (a key without one raises, with any number of ranks). `token_share` is
    n_r / N, this rank's share of the step's completion tokens (token_mean keys).

    Ranks may hold different keys (a rank without valid tokens has no ratio statistics): the keys are
    agreed first, a missing one counts as 0 in sums and means and is left out of min and max.
    One all-reduce per operation (sum, min, max), in float64.
    """
    rules = {k: rule(prefix + k) for k in values}
    if any(r == TORCHMETRICS for r in rules.values()):
        raise ValueError(f"{[prefix + k for k, r in rules.items() if r == TORCHMETRICS]} are reduced by torchmetrics")
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return {k: float(v) for k, v in values.items()}
    world = dist.get_world_size()
    keys: list = [None] * world
    dist.all_gather_object(keys, sorted(values))
    keys = sorted(set().union(*keys))
    rules = {k: rule(prefix + k) for k in keys}
    f64 = dict(dtype=torch.float64, device=device)

    def local(k: str, empty: float) -> Tensor:
        return torch.as_tensor(values[k], **f64) if k in values else torch.tensor(empty, **f64)

    pooled = {k: r for k, r in rules.items() if isinstance(r, PooledStd)}
    summed = [k for k in keys if rules[k] in (SUM, TOKEN_MEAN, RANK_MEAN)]
    sum_in = [local(k, 0.0) * (token_share if rules[k] == TOKEN_MEAN else 1.0) for k in summed]
    for k, r in pooled.items():          # this rank's sum of x^2, from its mean and unbiased std over m rows
        m, mu, sd = float(values[r.rows]), float(values[r.mean]), float(values[k])
        sum_in.append(torch.tensor(sd * sd * (m - 1) + m * mu * mu, **f64))
    out = {k: float(values[k]) for k in keys if rules[k] in (SAME, RANK0)}
    if sum_in:
        t = torch.stack(sum_in)
        dist.all_reduce(t)
        out.update({k: float(v) / (world if rules[k] == RANK_MEAN else 1) for k, v in zip(summed, t.cpu())})
        for (k, r), sq in zip(pooled.items(), t[len(summed):].cpu()):
            M, mu = out[r.rows], out[r.mean]
            out[k] = max((float(sq) - M * mu * mu) / max(M - 1, 1.0), 0.0) ** 0.5
    for op, kind, empty in ((dist.ReduceOp.MIN, MIN, math.inf), (dist.ReduceOp.MAX, MAX, -math.inf)):
        members = [k for k in keys if rules[k] == kind]
        if members:
            t = torch.stack([local(k, empty) for k in members])
            dist.all_reduce(t, op=op)
            out.update(zip(members, map(float, t.cpu())))
    return out
