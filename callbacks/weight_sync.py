"""WeightSync: hand the trainer's policy weights to the rollout engine when it will generate next.

The decision is the module's (PolicyModule.push_due, asked of the data side: `wants_weights`, the same
on every rank), taken at the end of each step; this callback then gathers the weights
(`pl_module.policy_weights()`) and hands them to the data side (lit_ess.data.RolloutData
`push_weights`), which the module received at setup (`pl_module.rollouts`). So with k optimizer steps
per rollout the full weights are gathered once per phase, not after every step, and under FSDP2 every
rank enters the weight gather at the same steps. The callback pushes at train start (which covers a
resume: Lightning has restored the checkpoint's weights by then, while the engine was built from the
initial folder), after every step whose successor needs new weights, and before every validation.
"""
from __future__ import annotations

import time

import lightning as L

from lit_ess.data import RolloutData


class WeightSync(L.Callback):
    """Pushes `pl_module.policy_weights()` (gathered tensor by tensor on every rank under FSDP2) to the data
    side; logs `perf/weight_sync_seconds` on the step axis."""

    def __init__(self):
        self.pushes = 0
        self.last_seconds = 0.0

    @staticmethod
    def _receiver(pl_module) -> RolloutData:
        if pl_module.rollouts is None:
            raise RuntimeError(f"WeightSync needs the data side of a RolloutDataModule (none was attached to "
                               f"{type(pl_module).__name__})")
        return pl_module.rollouts

    def push(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        t0 = time.perf_counter()
        # every rank gathers (FSDP2: one tensor at a time, in step) and feeds its colocated engine
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
        if pl_module.weights_due:                            # PolicyModule.push_due, decided in its step
            self.push(trainer, pl_module)
            for lg in trainer.loggers:                       # same x-axis as PolicyModule's metrics
                lg.log_metrics({"perf/weight_sync_seconds": self.last_seconds}, step=trainer.global_step)
