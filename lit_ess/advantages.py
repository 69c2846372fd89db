"""Group advantages: each prompt's n samples form a group.

    zscore:  A_i = (r_i - mean(r)) / (std(r) + eps)     (GRPO; std unbiased, as torch.std)
    mean:    A_i =  r_i - mean(r)                        (Dr.GRPO, no std normalisation)

A group whose rewards are all equal is *degenerate*: its advantages are 0 and it teaches nothing.
"""
from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGES = ("zscore", "mean")


def group_advantages(rewards: Tensor, mode: str = "zscore", eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """rewards [G, n] -> (advantages [G, n], degenerate [G] bool)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    if mode not in ADVANTAGES:
        raise ValueError(f"advantage={mode!r} is not one of {ADVANTAGES}")
    centred = rewards - rewards.mean(-1, keepdim=True)
    degenerate = (rewards == rewards[:, :1]).all(-1)
    if mode == "zscore" and rewards.shape[1] > 1:
        centred = centred / (rewards.std(-1, keepdim=True) + eps)
    return torch.where(degenerate[:, None], torch.zeros_like(centred), centred), degenerate
