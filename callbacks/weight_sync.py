"""WeightSync: hand the trainer's policy weights to the rollout engine when it will generate next.

The data side declares what it needs through two methods (`WeightReceiver`, implemented by
`lit_ess.datamodules.RolloutDataModule`): `wants_weights(version)` says whether the engine generates before the
trainer's next step, `push_weights(named_tensors, version)` takes the weights of optimizer step
`version`. So with k optimizer steps per rollout the full weights are gathered once per phase, not
after every step. Both are called on every rank at the same point, and `wants_weights` gives the same
answer on every rank (the data module agrees on it over ranks), so under FSDP2 every rank enters the
weight gather at the same steps. The callback pushes at train start (which covers a resume: Lightning has restored
the checkpoint's weights by then, while the engine was built from the initial folder), after every
step whose successor needs new weights, and before every validation.
"""
from __future__ import annotations

import time
from typing import Iterable, Protocol, runtime_checkable

import lightning as L
from torch import Tensor


@runtime_checkable
class WeightReceiver(Protocol):
    def wants_weights(self, version: int) -> bool: ...

    def push_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...


class WeightSync(L.Callback):
    """Pushes `pl_module.policy_weights()` (gathered tensor by tensor on every rank under FSDP2) to the datamodule;
    logs `perf/weight_sync_seconds` on the step axis.

    Args:
        every_n_steps: not used (weights are pushed when the engine generates next); 1 is accepted,
            any other value stops with a message that says what to use.
    """

    def __init__(self, every_n_steps: int | None = None):
        if every_n_steps not in (None, 1):
            raise ValueError(f"WeightSync.every_n_steps={every_n_steps} is gone: weights reach the engine "
                             f"whenever it generates next. For deliberately stale data set "
                             f"data.steps_per_rollout, or data.mode: async with data.max_staleness")
        self.pushes = 0
        self.last_seconds = 0.0

    def _receiver(self, trainer) -> WeightReceiver:
        dm = trainer.datamodule
        if not isinstance(dm, WeightReceiver):
            raise RuntimeError(f"WeightSync needs a datamodule with wants_weights/push_weights (a RolloutDataModule), "
                               f"got {type(dm).__name__}")
        return dm

    def push(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        t0 = time.perf_counter()
        # every rank gathers (FSDP2: one tensor at a time, in step) and feeds its colocated engine
        self._receiver(trainer).push_weights(pl_module.policy_weights(), version=trainer.global_step)
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
        step = trainer.global_step
        if 0 <= trainer.max_steps <= step:                   # the run ends here: nothing will be generated
            return
        if self._receiver(trainer).wants_weights(step):
            self.push(trainer, pl_module)
            for lg in trainer.loggers:                       # same x-axis as PolicyModule's metrics
                lg.log_metrics({"perf/weight_sync_seconds": self.last_seconds}, step=step)
