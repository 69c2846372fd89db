"""The lag-0 ESS alarm: a health check of the weight sync (model.ess_alarm, lit_ess.settings.ESSAlarm).

Rows sampled by the weights the trainer holds (policy lag 0), by an engine whose logprobs are the
trainer's own at the same precision and temperature, have rho_t = pi_theta / pi_b = 1 on every token,
so the step's ESS e_B = (sum rho)^2 / (n sum rho^2) is 1 (measured: 1.0000 on every on-policy step of
the tests and the demo). Below the threshold there, the engine did not sample with the trainer's
weights: a weight push that failed silently, a stale prefix cache, another checkpoint. (trl#5312: a
broken sleep-mode sync showed as a mean IS ratio of 3e-7 and went unnoticed.)

Whether a step's ESS must be 1 is decided in one place, `exact_on_policy`, from the facts the run
declares (`StepFacts`).

Non-finite state. A NaN or inf in a weight makes every loss and gradient non-finite: each step is
skipped (`train/skipped_steps`) and the run would go on forever without learning, or die in the
engine's sampler. `first_nonfinite` names the first such tensor: the policy and the reference are
checked once when the run starts (the loaded checkpoint's weights after a resume), and again when a
step is skipped. `SkippedSteps` stops the run after `bound` consecutive skipped steps with finite
weights (a gradient that is non-finite step after step): nothing non-finite reaches the weights, so
no checkpoint holds one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from .knobs import check
from .settings import ESSAlarm

# Lightning's "*-true" precisions: the whole forward in one dtype ("32-true": the weights' stored dtype)
TRUE_PRECISIONS = {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}


@dataclass(frozen=True)
class StepFacts:
    """What decides whether a step's ESS must be exactly 1, as the run declares it.

    lag_max             the largest policy lag of the step's rows, over all ranks
    engine_dtype        the dtype in which the engine's logprobs equal the trainer's (EngineConfig.exact_dtype,
                        carried by the batch); None: never (raw or quantized logprobs, an engine that does not say)
    precision           Lightning's trainer.precision ("32-true", "bf16-true", "bf16-mixed", ...)
    model_dtype         the dtype the policy's weights are stored in (model.compute.dtype)
    cast_dtype          the dtype a sharding callback casts the forward to (FSDP2's param_dtype), else None
    lora                LoRA adapters (peft keeps them in fp32 whatever the base's dtype)
    dropout             the trainer's forward drops units at random
    sample_temperature  the engine's sampling temperature
    train_temperature   the temperature of the trainer's logprobs
    """
    lag_max: float
    engine_dtype: str | None
    precision: str
    model_dtype: str
    cast_dtype: str | None
    lora: bool
    dropout: bool
    sample_temperature: float
    train_temperature: float

    @property
    def trainer_dtype(self) -> str | None:
        """The one dtype the trainer scores tokens in: FSDP2's param_dtype when it casts, else the stored
        dtype under "32-true" or the dtype of a "*-true" precision; None when the forward mixes dtypes
        (mixed precision: autocast; LoRA's fp32 adapters on a base below fp32)."""
        if "mixed" in self.precision:
            return None
        if self.cast_dtype is not None:
            dtype = self.cast_dtype
        elif self.precision in ("32-true", "32"):
            dtype = self.model_dtype
        else:
            dtype = TRUE_PRECISIONS.get(self.precision)
        return None if self.lora and dtype not in ("float32", "float64") else dtype


def exact_on_policy(f: StepFacts) -> bool:
    """True when the step's ESS must be 1: every row at lag 0, an engine whose logprobs are the trainer's at
    the trainer's one dtype, the same temperature, no dropout in the trainer's forward."""
    return (f.lag_max == 0 and f.engine_dtype is not None and f.engine_dtype == f.trainer_dtype
            and f.sample_temperature == f.train_temperature and not f.dropout)



class NonFiniteError(RuntimeError):
    """Non-finite weights, or too many consecutive steps with a non-finite loss or gradient norm."""


def first_nonfinite(named: Iterable[tuple[str, Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or inf (and which), or None. A DTensor shard (FSDP2)
    is checked locally: the caller combines the ranks' answers."""
    for name, t in named:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name} ({'NaN' if bool(t.isnan().any()) else 'inf'})"
    return None


class SkippedSteps:
    """Counts consecutive skipped optimizer steps and stops the run at `bound` of them.

    `update(skipped, step)` after every step: a finite step resets the count; the `bound`-th
    consecutive skipped one raises NonFiniteError with the step and what to check."""

    def __init__(self, bound: int = 10):
        check("model.max_consecutive_skipped_steps", bound, ge=1, integer=True)
        self.bound, self.consecutive = bound, 0

    def update(self, skipped: bool, step: int, grad_norm: float) -> None:
        self.consecutive = self.consecutive + 1 if skipped else 0
        if self.consecutive >= self.bound:
            raise NonFiniteError(
                f"{self.consecutive} consecutive steps skipped at optimizer step {step} for a non-finite loss or "
                f"gradient norm (last: {grad_norm}) with finite weights (max_consecutive_skipped_steps={self.bound}): the run "
                f"is not learning; check the rewards, the learning rate and the precision (no checkpoint was "
                f"written from non-finite weights)")


class ESSAlarmError(RuntimeError):
    """The lag-0 ESS alarm with model.ess_alarm.error: true."""


class ESSWatch:
    """Counts the steps whose ESS must be 1 (`exact_on_policy`) and is below `alarm.threshold` (None = off);
    warns once, or raises with `alarm.error` (lit_ess.settings.ESSAlarm, model.ess_alarm)."""

    def __init__(self, alarm: ESSAlarm = ESSAlarm()):
        self.threshold, self.error = alarm.threshold, alarm.error
        self.count = 0                    # cumulative, kept in checkpoints by PolicyModule
        self.warned = False

    def check(self, step: int, ess: float | None, ratio_mean: float | None, facts: StepFacts) -> str | None:
        """Count a step whose ESS should be 1 and is below the threshold. Returns the message the first
        time (None otherwise); raises ESSAlarmError with it when `error` is set."""
        if self.threshold is None or ess is None or ess >= self.threshold or not exact_on_policy(facts):
            return None
        self.count += 1
        ratio = "n/a" if ratio_mean is None else f"{ratio_mean:.3g}"
        message = (f"step {step}: ESS {ess:.6f} (mean ratio pi_theta/pi_b {ratio}) below model.ess_alarm.threshold={self.threshold} on "
                   f"rows sampled by the trainer's current weights at its precision ({facts.trainer_dtype}) and "
                   f"temperature ({facts.train_temperature}), where it must be 1: the engine is likely not sampling "
                   f"with the trainer's weights (check the weight sync)")
        if self.error:
            raise ESSAlarmError(message)
        if self.warned:
            return None
        self.warned = True
        return message + "; counted in train/ess_alarms, warned once (model.ess_alarm.error: true stops the run)"
