"""The grouped settings of PolicyModule (`model.init_args.optim`, `.micro_batch`, `.compute`, `.ess_alarm`).

    model.optim         AdamW, its learning-rate schedule and gradient clipping
    model.micro_batch   how a step is cut into forward/backward passes (the update does not depend on it)
    model.compute       the policy's dtype and the memory/compute trade-offs of its forward
    model.ess_alarm     the lag-0 ESS health check of the weight sync (lit_ess/health.py)

Each group checks its own fields (one line naming the full key). Checkpoints keep them in the module's
hyper-parameters: they are registered for torch.load(weights_only=True).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .knobs import check
from .logprobs import DEFAULT_CHUNK

LR_SCHEDULES = ("constant", "cosine", "linear")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Optim:
    """AdamW and its schedule (`model.optim`; lit_ess.step.build_optimizer, lr_factor).

    Args:
        lr: AdamW learning rate, > 0.
        weight_decay: AdamW weight decay, >= 0 (0 = none).
        betas: AdamW betas, each in [0, 1).
        warmup_steps: linear warm-up steps, >= 0 (0 = none).
        lr_schedule: "constant", "cosine" or "linear" decay to min_lr_ratio * lr at trainer.max_steps.
        min_lr_ratio: final learning rate as a fraction of lr, in [0, 1] (0 = decay to 0).
        max_grad_norm: clip the global gradient norm to this value, > 0; None = no clipping (0 and -1,
            "off" in some frameworks, are refused: clip_grad_norm_ would zero or negate every gradient).
            A step whose gradient norm is not finite is skipped and counted in `train/skipped_steps`.
    """
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        check("model.optim.lr", self.lr, gt=0)
        check("model.optim.weight_decay", self.weight_decay, ge=0)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"model.optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        for i, beta in enumerate(self.betas):
            check(f"model.optim.betas[{i}]", beta, ge=0, lt=1)
        check("model.optim.warmup_steps", self.warmup_steps, ge=0, integer=True)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"model.optim.lr_schedule={self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        check("model.optim.min_lr_ratio", self.min_lr_ratio, ge=0, le=1)
        check("model.optim.max_grad_norm", self.max_grad_norm, gt=0, null=True, hint=": use null for no clipping")


@dataclass(frozen=True)
class MicroBatch:
    """How a step's rows are cut into forward/backward passes (`model.micro_batch`). Losses are normalised
    by the whole step's token count, so the update is the same however the step is cut.

    Args:
        size: rows per forward/backward, >= 1 (None = the whole step at once).
        tokens: instead of size, the most tokens one forward/backward holds, >= 1,
            counted as a trimmed micro-batch holds them: rows x its longest row (prompt + completion).
            Rows are grouped by length, longest first (lit_ess.packing.plan_micro_batches), so short rows
            are no longer padded to the step's longest; a row longer than the budget gets a micro-batch
            of its own. The ESS pre-pass, the proximal scoring and the reference model use the same
            micro-batches, and the update is the same as with one micro-batch. On several data-parallel
            ranks the step's rows are gathered and dealt to the ranks by token count (lit_ess.packing.plan_ranks:
            ranks within one row's length of each other, the same number of passes).
            None (default) = size decides.
        packing: padding-free forwards (lit_ess.packing.packed_logprobs): the rows of each micro-batch laid
            end to end in lines as wide as its longest row, position ids restarting at every row, so the
            MLPs and projections see (almost) only tokens and attention is block-diagonal (transformers
            builds that mask from the position ids for sdpa and eager, varlen for flash-attention; no
            row attends to another). Lines, not one [1, N] line: sdpa and eager hold a dense mask, whose
            attention costs N^2 against the padded b T^2. Rows longer than half the longest share no line,
            so lengths within a factor 2 gain nothing. Logprobs and entropies come back as [b, T]: the
            objectives, the ESS pre-pass, the proximal scoring and the reference model are unchanged, and
            loss, gradient and ESS equal the padded forward's. With tokens the budget counts
            the rows' tokens (their sum) instead of rows x longest row. Needs attn_implementation sdpa,
            eager or flash_attention_2/3. False (default): padded [b, T] forwards.
    """
    size: int | None = None
    tokens: int | None = None
    packing: bool = False

    def __post_init__(self):
        check("model.micro_batch.size", self.size, ge=1, integer=True, null=True)
        check("model.micro_batch.tokens", self.tokens, ge=1, integer=True, null=True)
        if self.size is not None and self.tokens is not None:
            raise ValueError(f"model.micro_batch.size={self.size} and model.micro_batch.tokens={self.tokens} are "
                             f"alternatives: set one of them (or neither, for the whole step at once)")
        if not isinstance(self.packing, bool):
            raise ValueError(f"model.micro_batch.packing must be true or false, got {self.packing!r}")


@dataclass(frozen=True)
class Compute:
    """The policy's dtype and what its forward trades for memory (`model.compute`).

    Args:
        dtype: dtype the policy weights are loaded in (mixed precision comes from the Trainer).
        gradient_checkpointing: trade compute for memory in the policy.
        logprob_chunk: tokens per LM-head chunk of every scoring forward (gradient pass, ESS pre-pass,
            proximal and reference scoring, packed or padded), >= 1 (lit_ess.logprobs): the hidden states of
            the completion tokens go through the LM head this many at a time, each chunk reduced to the
            sampled token's log-probability (and entropy) and recomputed in the backward, so no
            [rows, tokens, vocabulary] logits exist; peak memory grows with logprob_chunk x vocabulary
            (1,024 x 151,936 fp32 = 0.62 GB per copy). null = the plain path: the model's full logits of the
            completion span (what a model whose forward post-processes its logits needs; such a model is
            refused at start with chunking on).
        disable_dropout: set every dropout probability of the base model to 0 (TRL's `disable_dropout`).
            With dropout on, the trainer scores tokens with a random sub-network: on-policy ESS is not 1
            and the ESS pre-pass and the gradient pass see different masks. LoRA's own dropout
            (lora.dropout, 0 by default) is an explicit choice and stays: it warns instead.
    """
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False
    logprob_chunk: int | None = DEFAULT_CHUNK
    disable_dropout: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"model.compute.dtype={self.dtype!r} is not one of {DTYPES}")
        check("model.compute.logprob_chunk", self.logprob_chunk, ge=1, integer=True, null=True,
              hint=": tokens per LM-head chunk, or null for the full logits")
        for name in ("gradient_checkpointing", "disable_dropout"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.compute.{name} must be true or false, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ESSAlarm:
    """The health check of the weight sync (`model.ess_alarm`; lit_ess/health.py). A step whose rows were all
    sampled by the trainer's current weights (policy lag 0), by an engine whose logprobs match the trainer's
    precision (engine dtype = the trainer's: FSDP2's param_dtype, else compute.dtype under a "32-true"
    Trainer; never under mixed precision, quantized or raw engine logprobs) at the train temperature, with
    no dropout in the trainer's forward (compute.disable_dropout, lora.dropout 0) and no fp32 LoRA adapters
    on a 16-bit base, must have ESS 1.

    Args:
        threshold: below it lit-ess warns once with the numbers (ESS, mean ratio, step) and counts the step
            in `train/ess_alarms` (in (0, 1]; None = off). GPU kernels of engine and trainer differ in bf16:
            lower it there if a healthy run warns.
        error: stop the run at the first such step instead of warning (the engine is then almost surely not
            sampling with the trainer's weights: check the weight sync).
    """
    threshold: float | None = 0.999
    error: bool = False

    def __post_init__(self):
        check("model.ess_alarm.threshold", self.threshold, gt=0, le=1, null=True)
        if not isinstance(self.error, bool):
            raise ValueError(f"model.ess_alarm.error must be true or false, got {self.error!r}")


# The groups are saved in checkpoints' hyper-parameters: let torch.load(weights_only=True) rebuild them.
torch.serialization.add_safe_globals([Optim, MicroBatch, Compute, ESSAlarm])
