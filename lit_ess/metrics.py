"""Held-out metrics: unbiased pass@k (Chen et al. 2021) as a torchmetrics metric.

For a prompt with n samples of which c pass, the probability that at least one of k samples drawn
without replacement passes is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)      (1 if n - c < k)

The product form avoids huge binomials. The metric keeps one row of pass@1..n per prompt and
concatenates the rows of every rank before averaging, so W ranks evaluating different prompts give
the mean over all prompts (torchmetrics syncs at `compute`).
"""
from __future__ import annotations

import torch
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
