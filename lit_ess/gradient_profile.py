"""Where an objective's gradient goes: detached diagnostics of dL/dlp_t, the loss's gradient with respect to
each token's log-probability (the factor that multiplies grad log pi_theta(y_t) in the model's backward).

For REINFORCE dL/dlp_t = -A_t a_t, with a_t = d agg / dx_t the aggregation's weight of token t (1/N for a
token mean). An objective reweights, clips or adds terms to that; these metrics say by how much and on
which tokens, cheaply ([B, T] elementwise work, no model forward), for every objective alike:

    grad_scale          sum_t |dL/dlp_t| / sum_t |A_t a_t|   (1: a plain policy-gradient step; P3O's is <= e_B
                                                              before its KL term)
    grad_share_rho_lo   share of sum_t |dL/dlp_t| on tokens with rho_t < 1/2   (rho = pi_theta / pi_b)
    grad_share_rho_hi   share on tokens with rho_t > 2
    grad_share_neg_adv  share on tokens with A_t < 0
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

RHO_LO, RHO_HI = 0.5, 2.0


def token_grad(loss_of: Callable[[Tensor], Tensor], lp: Tensor) -> Tensor:
    """dL/dlp [B, T] of the scalar `loss_of(lp)`, on a detached copy of lp (the model's graph is untouched)."""
    with torch.enable_grad():
        x = lp.detach().float().requires_grad_()
        (g,) = torch.autograd.grad(loss_of(x.to(lp.dtype)), x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def gradient_profile(g: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor,
                     agg: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """The metrics above from g = dL/dlp [B, T], log rho [B, T], advantages [B, T] and the token mask."""
    with torch.no_grad():
        valid = mask.bool()
        a = token_grad(agg, torch.zeros_like(g))                       # [B, T] the aggregation's weights
        mass = g.abs() * valid
        total = mass.sum().clamp(min=1e-30)
        lr = log_ratio.detach().float()
        return {
            "train/grad_scale": mass.sum() / (adv.detach().float().abs() * a * valid).sum().clamp(min=1e-30),
            "train/grad_share_rho_lo": (mass * (lr < torch.log(torch.tensor(RHO_LO)))).sum() / total,
            "train/grad_share_rho_hi": (mass * (lr > torch.log(torch.tensor(RHO_HI)))).sum() / total,
            "train/grad_share_neg_adv": (mass * (adv < 0)).sum() / total,
        }


def term_shares(g_main: Tensor, g_term: Tensor, mask: Tensor, name: str) -> dict[str, Tensor]:
    """How much of the per-token gradient an added term (P3O's (1 - e_B) KL) carries, and whether it works
    with or against the main term:

        {name}_grad_share   |g_term|_1 / (|g_main|_1 + |g_term|_1)
        {name}_grad_cos     cos(g_main, g_term) over the tokens (< 0: the term pulls back what the main term pushes)
    """
    with torch.no_grad():
        m = mask.bool()
        gm, gt = g_main[m].float(), g_term[m].float()
        share = gt.abs().sum() / (gm.abs().sum() + gt.abs().sum()).clamp(min=1e-30)
        cos = (gm * gt).sum() / (gm.norm() * gt.norm()).clamp(min=1e-30)
        return {f"train/{name}_grad_share": share, f"train/{name}_grad_cos": cos}
