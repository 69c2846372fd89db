"""Ranks: the data-parallel group as the rollout side sees it (its position, one collective), and
`in_step`, the way every rank waits for its rollout data without any rank hanging.

Every rank waits for its own data (its worker's phase). If one
rank's worker dies while another rank already has its batch, that other rank would go on into the
training step's collectives and wait there for a peer that never comes. So the ranks wait together:
each round, every rank tries (waiting at most about a second), then all exchange (done, error) in one
small all-gather. A failure on any rank raises on every rank in the same round, naming the rank and
its error; the run stops when every rank has its data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch.distributed as dist


class Ranks(Protocol):
    rank: int
    world: int

    def all_gather(self, obj) -> list: ...


@dataclass
class TorchRanks:
    """The default process group (torch.distributed, set up by Lightning's strategy)."""
    rank: int = 0
    world: int = 1

    def all_gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


class RankFailed(RuntimeError):
    """Another rank's rollout side failed; this rank stops with its message."""


def in_step(ranks: Ranks, attempt: Callable[[], object], share: bool = False):
    """Call `attempt()` (a result, or None while still waiting; it may raise) on every rank until every
    rank has its result. Returns this rank's result, or with `share` the list of all ranks' results
    (small objects only: they travel by all-gather). An exception on any rank raises on every rank."""
    value = None
    while True:
        error = None
        if value is None:
            try:
                value = attempt()
            except Exception as e:              # noqa: BLE001 - handed to every rank, then re-raised here
                error = e
        if ranks.world == 1:
            if error is not None:
                raise error
            if value is not None:
                return [value] if share else value
            continue
        said = None if error is None else f"{type(error).__name__}: {error}"
        states = ranks.all_gather((value is not None, said, value if share and value is not None else None))
        if error is not None:
            raise error
        failed = [(r, s[1]) for r, s in enumerate(states) if s[1] is not None]
        if failed:
            r, msg = failed[0]
            raise RankFailed(f"rank {r} stopped, so this rank (rank {ranks.rank}) stops too: {msg}")
        if all(s[0] for s in states):
            return [s[2] for s in states] if share else value
