"""WeightSync: push the trainer's policy weights into the rollout engine.

Pushes at the start of training (which covers a resume: Lightning has restored the checkpoint's weights
by then, and the engine was built from the initial folder) and after every `every_n_steps` optimizer
steps. Samples carry the engine's version (the global step of the weights that produced them), so the
policy lag of every batch is logged.

With `every_n_steps: 1` and one optimizer step per rollout the data is exactly on-policy (ESS = 1 in
fp32). Larger values make rollouts deliberately stale.
"""
from __future__ import annotations

import time

import lightning as L


class WeightSync(L.Callback):
    """Args:
        every_n_steps: refresh the engine after this many optimizer steps.
    """

    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"WeightSync.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.pushes = 0
        self.last_seconds = 0.0

    def push(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.datamodule, "engine", None)
        if engine is None:
            raise RuntimeError("WeightSync: the datamodule has no rollout engine (is it a RolloutDataModule?)")
        t0 = time.perf_counter()
        state = pl_module.policy_state_dict()   # every rank gathers (FSDP) and feeds its colocated engine
        engine.load_weights(state.items(), version=trainer.global_step)
        self.pushes += 1
        self.last_seconds = time.perf_counter() - t0

    def on_train_start(self, trainer, pl_module) -> None:
        self.push(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        # `lit-ess validate`: the engine was built from model_path, the weights may come from a
        # checkpoint. (Inside fit the engine is already current: validation follows the step's push.)
        if not trainer.training:
            self.push(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != getattr(trainer.datamodule.engine, "version", -1):
            self.push(trainer, pl_module)
            for lg in trainer.loggers:                       # same x-axis as PolicyModule's metrics
                lg.log_metrics({"perf/weight_sync_seconds": self.last_seconds}, step=step)
