"""The grouped settings of RolloutDataModule (`data.init_args.batch`, `.schedule`, `.reward_limits`, `.validation`).

    data.batch          the shape of a phase: prompts x samples rows, cut into steps
    data.schedule       where and how far ahead rollouts are generated (sync | async, staleness)
    data.reward_limits  how long a reward may take, how often it may fail, in which process it runs
    data.validation     the held-out prompts and how they are sampled

Each group checks its own fields (one line naming the full key); the checks that need another group or the
engine stay in RolloutDataModule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lit_ess.knobs import check

from .prompts import PromptSource


@dataclass(frozen=True)
class BatchShape:
    """The rows of a rollout phase and the optimizer steps they feed (`data.batch`).

    Args:
        prompts_per_rollout: prompts sampled per phase, over all data-parallel ranks (>= 1, a multiple of
            their number: each rank generates and trains prompts_per_rollout / W of them).
        samples_per_prompt: completions per prompt (the group size), at least 2: a group of one has
            advantage 0 under both estimators, so nothing would be learned.
        steps_per_rollout: optimizer steps per phase (>= 1, at most prompts_per_rollout x samples_per_prompt);
            rows are split evenly between them. 1 = on-policy.
        steps_per_epoch: batches per Lightning epoch (None = steps_per_rollout, one phase per epoch),
            the unit of check_val_every_n_epoch.
    """
    prompts_per_rollout: int = 32
    samples_per_prompt: int = 8
    steps_per_rollout: int = 1
    steps_per_epoch: int | None = None

    def __post_init__(self):
        for name in ("prompts_per_rollout", "samples_per_prompt", "steps_per_rollout"):
            check(f"data.batch.{name}", getattr(self, name), ge=1, integer=True)
        check("data.batch.steps_per_epoch", self.steps_per_epoch, ge=1, integer=True, null=True)
        if self.samples_per_prompt == 1:
            raise ValueError("data.batch.samples_per_prompt=1: the group advantage (data.advantage) of a group of one "
                             "sample is always 0, so nothing would be learned; use samples_per_prompt >= 2")
        if self.prompts_per_rollout * self.samples_per_prompt < self.steps_per_rollout:
            raise ValueError(f"data.batch.steps_per_rollout={self.steps_per_rollout} exceeds the "
                             f"{self.prompts_per_rollout}x{self.samples_per_prompt} rows of a rollout")


@dataclass(frozen=True)
class Schedule:
    """When and where rollouts are generated (`data.schedule`).

    Args:
        mode: "sync" (generate in this process when the schedule admits a phase; training waits) or
            "async" (a worker process generates ahead while the trainer trains, within max_staleness).
        placement: async on several ranks: "colocated" (each rank's worker process has its own engine;
            pick it when the engine shares the trainer's GPUs) or "dedicated" (every rank's worker sends
            its prompts to vLLM servers of their own, engine: lit_ess.engines.VLLMServerConfig: servers by
            URL, or one rank 0 launches on `engine.worker_devices`; pick it when generation has GPUs of
            its own; needs mode: async). One rank: the same.
        max_staleness: S, the largest policy lag (optimizer steps between the weights that sampled a
            row and the step that trains on it) ever trained on, >= batch.steps_per_rollout - 1 (0 = on-policy,
            with steps_per_rollout 1). None = steps_per_rollout - 1, the synchronous lag. Async with
            S = steps_per_rollout - 1 reproduces sync exactly; each step above it lets a phase start one
            optimizer step earlier (sync: generated ahead with older weights, a reproducible staleness;
            async: as far as the worker gets).
        worker_timeout: async: seconds the worker process may go without a word (a stage of a request
            begun, a result sent) while it has work; then the run stops with an error that names the
            worker's pid and the stage it was in (a hung engine or reward, a stopped process); > 0. Generous
            by default: one phase's sampling, or its scoring, may take this long.
    """
    mode: Literal["sync", "async"] = "sync"
    placement: Literal["colocated", "dedicated"] = "colocated"
    max_staleness: int | None = None
    worker_timeout: float = 1800.0

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"data.schedule.mode={self.mode!r} is not one of ('sync', 'async')")
        if self.placement not in ("colocated", "dedicated"):
            raise ValueError(f"data.schedule.placement={self.placement!r} is not one of ('colocated', 'dedicated')")
        if self.placement == "dedicated" and self.mode != "async":
            raise ValueError("data.schedule.placement: dedicated generates on servers beside the trainers: it needs "
                             "mode: async (mode: sync generates in each trainer's process)")
        check("data.schedule.max_staleness", self.max_staleness, ge=0, integer=True, null=True)
        check("data.schedule.worker_timeout", self.worker_timeout, gt=0)


@dataclass(frozen=True)
class RewardLimits:
    """How long a reward may take, how often it may fail, and where it runs (`data.reward_limits`).

    Args:
        timeout: seconds per completion for rewards run in a worker process (> 0); a completion that
            takes longer scores 0 and is counted in `rollout/reward_timeouts`.
        max_error_rate: a reward that raises or returns something other than a finite number
            scores 0 and is counted (`rollout/reward_errors`, the first error shown as a warning); a
            rollout phase or validation batch in which more than this share of the completions fail
            stops the run with the reward's error (1.0: never stop; 0.0: stop at the first failure).
            Environment failures count as failing rewards too.
        in_worker: run the reward in a worker process with `timeout`, so a verifier that hangs costs one
            completion, not the run. None (default): only math_verify; true: every function reward (e.g. a
            `module:function` that may hang; the worker process must import its module; a RewardModel or
            LLMJudge, always scored in the scoring process, is refused with it); false: in this process, no
            timeout.
    """
    timeout: float = 5.0
    max_error_rate: float = 0.5
    in_worker: bool | None = None

    def __post_init__(self):
        check("data.reward_limits.timeout", self.timeout, gt=0)
        check("data.reward_limits.max_error_rate", self.max_error_rate, ge=0, le=1)
        if self.in_worker is not None and not isinstance(self.in_worker, bool):
            raise ValueError(f"data.reward_limits.in_worker must be true, false or null, got {self.in_worker!r}")


@dataclass(frozen=True)
class Validation:
    """Held-out prompts, sampled by the engine with the current weights (`data.validation`).

    Args:
        source: held-out prompts for validation (None = no validation loop in fit; `lit-ess validate`
            needs it).
        prompts: validation prompts per batch (>= 1); every example of source is used once (with W
            ranks, each evaluates every W-th batch; the metrics are reduced across ranks).
        samples: samples per held-out prompt, n (>= 1): validation logs the unbiased pass@k for k = 1..n
            (`val/pass@k`; a sample passes when its reward is 1), the mean reward and length.
        sampling: held-out evaluation's changes to data.sampling, e.g. {temperature: 1.0} (every other
            setting, the seed and max_new_tokens included, stays the training one); None = sample
            held-out prompts as in training. A fixed setting compares runs trained with different
            sampling on the same ruler.
    """
    source: PromptSource | None = None
    prompts: int = 64
    samples: int = 1
    sampling: dict | None = None

    def __post_init__(self):
        check("data.validation.prompts", self.prompts, ge=1, integer=True)
        check("data.validation.samples", self.samples, ge=1, integer=True)
        if self.sampling is not None and not isinstance(self.sampling, dict):
            raise ValueError(f"data.validation.sampling must be a mapping of sampling settings or null, "
                             f"got {self.sampling!r}")
