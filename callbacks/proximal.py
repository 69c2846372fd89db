"""ProximalLogprobs: the trainer's own old logprobs, recomputed once per rollout phase.

A phase is `steps_per_rollout` batches generated together and trained one per optimizer step. When the
trainer starts training a phase (the first of its batches it is served: index 0, or a later one when
the staleness filter dropped the first ones), the proximal policy pi_prox is the policy with the weights
of that step (verl's and TRL's default "old" policy; in async mode, the weights of the step that first
trains the batch, as AReaL does). This callback then

    marks the batch being trained:        its gradient pass's lp.detach() are its proximal logprobs
                                          (same weights, same forward: no extra pass)
    scores the phase's waiting batches:   one no-grad forward each, in micro-batches, stored on the
                                          batches (`prox_logprobs` [B, T]), kept in the data module's
                                          checkpoint, so a mid-phase resume keeps them

Cost: k - 1 no-grad forwards per phase of k steps (none at steps_per_rollout 1), measured in
benchmarks/proximal.py. Logs `perf/proximal_seconds` on the steps that score. A run resumed mid-phase
from a checkpoint written without this callback scores the rest of that phase with the weights of
its first step after the resume.

Both sides are declared interfaces: the data module lists a phase's waiting batches (`PhaseBatches`,
implemented by lit_ess.datamodules.RolloutDataModule) and the module scores them (`ProximalScorer`,
lit_ess.module.PolicyModule), so every rank runs the same number of forwards (FSDP2), with
micro_batch_size, the train temperature and LoRA adapters as in the gradient pass.
"""
from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import lightning as L
import torch.distributed as dist

from lit_ess.rollout import Proximal, RolloutBatch


@runtime_checkable
class PhaseBatches(Protocol):
    def waiting_batches(self, phase: int) -> list[RolloutBatch]: ...


@runtime_checkable
class ProximalScorer(Protocol):
    def score_proximal(self, batches: list[RolloutBatch], pad: RolloutBatch) -> None: ...


class ProximalLogprobs(L.Callback):
    """Proximal logprobs for every objective (`proximal_logprobs`): needed by DecoupledPPO, GRPO/DAPO/GSPO
    with `old: proximal` and P3O with `kl_anchor: behavior_at_train_temperature`; an ISCorrection then
    weights by pi_prox / pi_b of the phase's first step."""

    def __init__(self):
        self.last_seconds = 0.0
        self.scored_phases = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dm = trainer.datamodule
        if not isinstance(dm, PhaseBatches) or not isinstance(pl_module, ProximalScorer):
            raise RuntimeError(f"ProximalLogprobs needs a data module with waiting_batches (a RolloutDataModule) and a "
                               f"module with score_proximal (a PolicyModule), got {type(dm).__name__} and "
                               f"{type(pl_module).__name__}")
        starts = batch.proximal is None                # no step has scored this batch's phase yet
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not (starts or several):
            return
        t0 = time.perf_counter()
        waiting = [b for b in dm.waiting_batches(batch.phase) if b.proximal is None] if starts else []
        if starts:
            batch.proximal = Proximal(trainer.global_step, "own_pass")
        pl_module.score_proximal(waiting, pad=batch)    # every rank, every step: the forwards are collectives
        if starts:
            self.scored_phases += 1
            self.last_seconds = time.perf_counter() - t0
            for lg in trainer.loggers:                  # at the x of this step's metrics (logged after its update)
                lg.log_metrics({"perf/proximal_seconds": self.last_seconds}, step=trainer.global_step + 1)
