"""DAPO's two data-side techniques (arXiv 2503.14476), as typed knobs of the data module:

    data.dynamic_sampling (DynamicSampling)   groups whose rewards are all equal teach nothing: drop them and
                                              generate further prompts until the phase holds
                                              prompts_per_rollout groups with a signal, in at most
                                              max_rounds generation rounds
    data.overlong (OverlongPenalty)           the soft overlong punishment: a completion past
                                              max_length - buffer tokens loses up to `factor` of reward

How a phase fills (`PhaseFill`, kept by the data module, which owns the prompt cursor): round 0 is the
phase's request of prompts_per_rollout prompts; the worker scores it (rewards, overlong penalty, group
advantages) and returns every group with a flag that says whether it carries a signal (`metric`), not yet
batched. The data module keeps the groups with a signal; while it holds fewer than prompts_per_rollout
and fewer than max_rounds rounds ran, it draws prompts_per_rollout further prompts from the cursor and
submits them as the phase's next round (each round as large as the first, as verl's generation batches
are: on a GPU a round costs about the latency of its longest completion whatever its size, so few large
rounds beat many small ones). The phase is then the first prompts_per_rollout kept groups, in the order
they were generated (the rest, `rollout/surplus_groups`, are discarded, as verl does); shuffled and split
into steps_per_rollout batches as any phase. When max_rounds rounds leave it short, the phase is trained
short, with the groups it has (`rollout/batch_short` says by how many groups); with none at all, dropped
groups (zero advantage) are restored until every step has a row, as drop_degenerate does. verl raises an
error there instead; a run that stops after hours on a streak of hard prompts helps nobody, and the
count shows it.

The sync and async paths are the same code: the rounds are ordinary requests to the executor, submitted
by the data module as soon as the previous round's result arrives (sync: at once, with the weights of that
round; async: queued to the worker process, with the newest weights, so a refill's rows are never older
than the phase's first round's and the staleness bound holds for them as for any row). A phase's rounds
draw from the same prompt cursor as every phase, so no prompt is skipped or used twice by a refill; the
checkpoint holds the cursor, the groups kept so far and the round in flight, which a resumed run
generates again.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import Tensor

from lit_ess.knobs import check

from lit_ess.batch import Row

METRICS = ("reward", "shaped")


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (`data.dynamic_sampling`; verl's algorithm.filter_groups).

    Args:
        enable: drop the groups whose rewards (by `metric`) are all equal and refill the phase from further
            prompts until it holds prompts_per_rollout groups with a signal. false (default): every group is
            trained as generated (data.drop_degenerate drops without refilling).
        max_rounds: generation rounds of a phase at most, its first included, each of prompts_per_rollout
            prompts (verl's max_num_gen_batches; an integer >= 1, 1 = drop without refilling). A phase whose
            rounds keep, on average, at least 1 / max_rounds of their groups fills; one that stays short is
            trained short and counted (`rollout/batch_short`).
        metric: what a group must vary in to be kept: "reward" (default; the task reward before the
            overlong penalty, DAPO's `acc`) or "shaped" (the reward trained on, after data.overlong's
            penalty: a group of equally right answers of different lengths is kept).
    """
    enable: bool = False
    max_rounds: int = 4
    metric: Literal["reward", "shaped"] = "reward"

    def __post_init__(self):
        if not isinstance(self.enable, bool):
            raise ValueError(f"dynamic_sampling.enable must be true or false, got {self.enable!r}")
        check("dynamic_sampling.max_rounds", self.max_rounds, ge=1, integer=True)
        if self.metric not in METRICS:
            raise ValueError(f"dynamic_sampling.metric={self.metric!r} is not one of {METRICS}")


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (`data.overlong`; verl's reward_model.overlong_buffer), added to the
    training reward of each sample before the group advantages. With L = max_length and B = buffer, a
    completion of |y| tokens (the policy's: an episode's over all its turns) gets

        0                        if |y| <= L - B
        factor * (L - B - |y|) / B   if L - B < |y| <= L        (from 0 down to -factor)
        -factor                  if |y| > L

    `rollout/reward_mean` stays the task reward; `rollout/overlong_penalty` is the phase's mean penalty and
    `rollout/overlong_frac` the share of its samples penalised; the rows' rewards (completion tables) are
    the shaped ones. Held-out evaluation is not shaped.

    Args:
        enable: add the penalty to the training rewards. false (default): rewards as the reward gives them.
        buffer: B, the tokens before max_length over which the penalty grows (an integer >= 1, at most
            max_length). None = a fifth of max_length (at least 1), DAPO's 4,096 of 20,480.
        max_length: L, in tokens (an integer >= 1). None = sampling.max_new_tokens (the engine's cap, DAPO's
            setting); with data.env set it explicitly, since an episode's tokens add up over its turns.
        factor: the penalty at max_length and beyond (> 0; verl's penalty_factor, 1.0 in DAPO's recipe).
    """
    enable: bool = False
    buffer: int | None = None
    max_length: int | None = None
    factor: float = 1.0

    def __post_init__(self):
        if not isinstance(self.enable, bool):
            raise ValueError(f"overlong.enable must be true or false, got {self.enable!r}")
        check("overlong.buffer", self.buffer, ge=1, integer=True, null=True)
        check("overlong.max_length", self.max_length, ge=1, integer=True, null=True)
        check("overlong.factor", self.factor, gt=0)
        if self.buffer is not None and self.max_length is not None and self.buffer > self.max_length:
            raise ValueError(f"overlong.buffer={self.buffer} exceeds overlong.max_length={self.max_length}: the "
                             f"penalty would start before the first token")

    def resolved(self, max_new_tokens: int) -> "OverlongPenalty":
        """With max_length and buffer filled in (max_length None = max_new_tokens); a buffer over it is named."""
        length = self.max_length if self.max_length is not None else max_new_tokens
        buffer = self.buffer if self.buffer is not None else max(1, length // 5)
        if buffer > length:
            raise ValueError(f"overlong.buffer={buffer} exceeds the max_length {length} (overlong.max_length, else "
                             f"sampling.max_new_tokens): the penalty would start before the first token")
        return OverlongPenalty(self.enable, buffer, length, self.factor)


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """The soft overlong punishment of completions of `lengths` tokens (any shape): 0 up to max_length -
    buffer, then falling linearly to -factor at max_length, -factor beyond."""
    lengths = lengths.to(torch.float32)
    return factor * ((max_length - buffer - lengths) / buffer).clamp(min=-1.0, max=0.0)


# ---------------------------------------------------------------------------------------------------- filling a phase
# How each statistic of a round (RolloutWorker.score) combines over a phase's rounds: a mean weighted by the
# round's samples, a sum, a max, the last round's (cumulative counters), or recomputed from the others.
WEIGHTED = ("rollout/reward_mean", "rollout/response_len", "rollout/truncated_frac", "rollout/degenerate_frac",
            "rollout/turns", "rollout/env_tokens", "rollout/env_seconds", "rollout/tool_calls",
            "rollout/overlong_frac", "rollout/overlong_penalty")
SUMMED = ("rollout/rows", "rollout/gen_seconds", "rollout/reward_seconds", "rollout/dropped_groups",
          "rollout/truncated_turns", "rollout/truncated_tokens", "rollout/truncated_prompts")
LARGEST = ("rollout/response_len_max",)
LAST = ("rollout/reward_errors", "rollout/reward_timeouts", "rollout/env_errors", "rollout/env_timeouts",
        "rollout/phase")
DERIVED = ("rollout/reward_std", "rollout/gen_tokens_per_s", "rollout/multi_version_frac")


def merge_round_stats(rounds: list[dict[str, float]]) -> dict[str, float]:
    """One phase's statistics from its rounds' (each over every sample the round generated, kept or not).
    A key without a rule here raises, naming it."""
    n = [r["rollout/rows"] for r in rounds]
    total = sum(n)
    out: dict[str, float] = {}
    for key in rounds[0]:
        vals = [r[key] for r in rounds]
        if key in WEIGHTED or key.startswith("train/reward/"):
            out[key] = sum(v * w for v, w in zip(vals, n)) / max(total, 1.0)
        elif key in SUMMED:
            out[key] = float(sum(vals))
        elif key in LARGEST:
            out[key] = float(max(vals))
        elif key in LAST:
            out[key] = float(vals[-1])
        elif key not in DERIVED:
            raise KeyError(f"rollout statistic {key!r} has no rule for combining a phase's rounds in "
                           f"lit_ess.rollout.dapo.merge_round_stats")
    mean = out["rollout/reward_mean"]                    # the pooled std over every round's samples (unbiased)
    ss = sum((w - 1) * r["rollout/reward_std"] ** 2 + w * (r["rollout/reward_mean"] - mean) ** 2
             for r, w in zip(rounds, n))
    out["rollout/reward_std"] = math.sqrt(ss / (total - 1)) if total > 1 else 0.0
    tokens = sum(r["rollout/response_len"] * w for r, w in zip(rounds, n))
    out["rollout/gen_tokens_per_s"] = tokens / max(out["rollout/gen_seconds"], 1e-9)
    return out


@dataclass
class PhaseFill:
    """The rounds of one phase under dynamic sampling (module docstring): the groups kept so far, a few
    dropped ones in case the phase must be padded to a row per step, and each round's statistics.

    `target` groups are wanted (prompts_per_rollout), at most `max_rounds` rounds run, and every one of the
    phase's `min_rows` steps (steps_per_rollout) needs a row."""
    phase: int
    target: int
    max_rounds: int
    min_rows: int
    kept: list[list[Row]] = field(default_factory=list)
    spare: list[list[Row]] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)

    def add(self, groups: list[list[Row]], keep: list[bool], stats: dict[str, float]) -> None:
        """One round's groups (rows of every group, in prompt order), which of them carry a signal, its statistics."""
        self.kept += [g for g, k in zip(groups, keep) if k]
        for g, k in zip(groups, keep):
            if not k and sum(map(len, self.spare)) < self.min_rows:
                self.spare.append(g)
        self.rounds.append(dict(stats))

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.target or len(self.rounds) >= self.max_rounds

    def rows(self) -> tuple[list[Row], dict[str, float]]:
        """The phase's rows (the first `target` kept groups; dropped ones restored, in order, only while some
        step would have none) and the phase's statistics, its rounds' merged with the fill's counters."""
        groups = self.kept[:self.target]
        short = self.target - len(groups)
        spare = list(self.spare)
        while sum(map(len, groups)) < self.min_rows and spare:
            groups.append(spare.pop(0))
        rows = [r for g in groups for r in g]
        stats = merge_round_stats(self.rounds)
        stats.update({"rollout/refill_rounds": float(len(self.rounds) - 1), "rollout/batch_short": float(short),
                      "rollout/surplus_groups": float(max(len(self.kept) - self.target, 0)),
                      "rollout/multi_version_frac": sum(len(set(r.versions_trained())) > 1 for r in rows) / max(len(rows), 1)})
        return rows, stats

    def state_dict(self) -> dict:
        """Plain containers (torch.load's weights_only accepts them)."""
        return {"phase": self.phase, "target": self.target, "max_rounds": self.max_rounds, "min_rows": self.min_rows,
                "kept": [[asdict(r) for r in g] for g in self.kept], "spare": [[asdict(r) for r in g] for g in self.spare],
                "rounds": [dict(r) for r in self.rounds]}

    @classmethod
    def from_state(cls, state: dict) -> "PhaseFill":
        groups = {k: [[Row(**r) for r in g] for g in state[k]] for k in ("kept", "spare")}
        return cls(state["phase"], state["target"], state["max_rounds"], state["min_rows"], rounds=list(state["rounds"]),
                   **groups)
