"""WeightSync: the one owner of the weight push. It decides when the rollout engine needs the trainer's
policy weights and hands them over.

    when           train start (covers a resume: Lightning has restored the checkpoint's weights by then,
                   while the engine was built from the initial folder), before every validation, and after
                   every step whose successor the engine generates for (`due`)
    due(step)      the run goes on and the data side wants them (lit_ess.data.RolloutData `wants_weights`:
                   the same answer on every rank), so with k optimizer steps per rollout the full weights
                   are gathered once per phase, and under FSDP2 every rank enters the gather at the same steps
    push           `pl_module.policy_weights()` (gathered tensor by tensor under FSDP2; with LoRA merged or
                   the adapters) to the data side's `push_weights`, which the module received at setup
                   (`pl_module.rollouts`); its executor hands them to the engine (sync: directly; async:
                   through the worker process's transport)
"""
from __future__ import annotations

import time

import lightning as L

from lit_ess.data import RolloutData


class WeightSync(L.Callback):
    """Pushes `pl_module.policy_weights()` (gathered tensor by tensor on every rank under FSDP2) to the data
    side when the engine will generate next; logs `perf/weight_sync_seconds` on the step axis."""

    def __init__(self):
        self.pushes = 0
        self.last_seconds = 0.0

    @staticmethod
    def _receiver(pl_module) -> RolloutData:
        if pl_module.rollouts is None:
            raise RuntimeError(f"WeightSync needs the data side of a RolloutDataModule (none was attached to "
                               f"{type(pl_module).__name__})")
        return pl_module.rollouts

    def due(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """Whether the engine generates before the trainer's next step and so needs the weights of this one
        (`trainer.global_step`, counted after the step's update); false when the run ends here. Every rank
        asks at the same point."""
        step = trainer.global_step
        return not 0 <= trainer.max_steps <= step and self._receiver(pl_module).wants_weights(step)

    def push(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        t0 = time.perf_counter()
        # every rank gathers (FSDP2: one tensor at a time, in step) and feeds its engine
        self._receiver(pl_module).push_weights(pl_module.policy_weights(), version=trainer.global_step)
        self.pushes += 1
        self.last_seconds = time.perf_counter() - t0

    def on_train_start(self, trainer, pl_module) -> None:
        self.push(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        # Validation samples with the current policy: in `lit-ess validate` the engine was built from
        # model_path while the weights come from a checkpoint; inside fit the engine may hold older
        # weights (several steps per rollout, or async). A push starts no rollout.
        self.push(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.due(trainer, pl_module):
            self.push(trainer, pl_module)
            for lg in trainer.loggers:                       # same x-axis as PolicyModule's metrics
                lg.log_metrics({"perf/weight_sync_seconds": self.last_seconds}, step=trainer.global_step)
