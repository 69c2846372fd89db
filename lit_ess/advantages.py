"""Group advantages: each prompt's n samples form a group, and an estimator maps the group's rewards to
the samples' advantages, rewards [G, n] -> advantages [G, n]. Chosen by class (`data.advantage: {class_path:
lit_ess.advantages.RLOO}`) or by a short name:

    zscore  GroupMean()                      A_i = (r_i - mean(r)) / (std(r) + eps)   (GRPO; std unbiased, as torch.std)
    mean    GroupMean(normalize_std=False)   A_i =  r_i - mean(r)                     (Dr.GRPO, no std normalisation)
    rloo    RLOO()                           A_i =  r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean(r))

A group whose rewards are all equal is *degenerate* (`degenerate_groups`): its advantages are 0 under every
estimator (`Advantage.__call__` sets them, so an estimator's `estimate` need not) and it teaches nothing.
A new estimator is a subclass with an `estimate`; the rollout worker calls every one the same way.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, is_dataclass

import torch
from torch import Tensor

from .knobs import check, plain


def degenerate_groups(rewards: Tensor) -> Tensor:
    """rewards [G, n] -> [G] bool: the groups whose rewards are all equal."""
    return (rewards == rewards[:, :1]).all(-1)


class Advantage(ABC):
    """An advantage estimator: `estimator(rewards [G, n]) -> advantages [G, n]`, 0 for degenerate groups."""

    def __call__(self, rewards: Tensor) -> Tensor:
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
        if rewards.shape[1] < 2:                       # a group of one is degenerate
            return torch.zeros_like(rewards)
        adv = self.estimate(rewards)                                                  # [G, n]
        return torch.where(degenerate_groups(rewards)[:, None], torch.zeros_like(adv), adv)

    @abstractmethod
    def estimate(self, rewards: Tensor) -> Tensor:
        """rewards [G, n], n >= 2 -> advantages [G, n]."""

    def hparams(self) -> dict:
        """Plain values to log as hyper-parameters: the class name and its fields."""
        return {"name": type(self).__name__, **plain(asdict(self) if is_dataclass(self) else dict(vars(self)))}


@dataclass
class GroupMean(Advantage):
    """The reward minus the group's mean, divided by the group's std (GRPO) unless `normalize_std` is off
    (Dr.GRPO).

    Args:
        normalize_std: divide by the group's (unbiased) std + eps.
        eps: added to the std (> 0), so a group of nearly equal rewards stays finite.
    """

    normalize_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        check("advantage.eps", self.eps, gt=0)

    def estimate(self, rewards: Tensor) -> Tensor:
        centred = rewards - rewards.mean(-1, keepdim=True)                            # [G, n]
        return centred / (rewards.std(-1, keepdim=True) + self.eps) if self.normalize_std else centred


@dataclass
class RLOO(Advantage):
    """REINFORCE leave-one-out: the reward minus the mean of the group's other rewards, n / (n - 1) times
    the reward minus the group's mean (an unbiased baseline: it does not depend on the sample itself)."""

    def estimate(self, rewards: Tensor) -> Tensor:
        n = rewards.shape[1]
        return (rewards - rewards.mean(-1, keepdim=True)) * (n / (n - 1))


ADVANTAGES = {"zscore": GroupMean, "mean": lambda: GroupMean(normalize_std=False), "rloo": RLOO}


def resolve_advantage(advantage: str | Advantage) -> Advantage:
    """A short name (zscore, mean, rloo) or an estimator, as an estimator."""
    if isinstance(advantage, Advantage):
        return advantage
    if advantage not in ADVANTAGES:
        raise ValueError(f"advantage={advantage!r} is not one of {', '.join(ADVANTAGES)} or an estimator "
                         f"(class_path lit_ess.advantages.GroupMean, RLOO, or a subclass of "
                         f"lit_ess.advantages.Advantage of your own)")
    return ADVANTAGES[advantage]()
