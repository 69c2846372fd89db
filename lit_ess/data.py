"""The data side as the trainer sees it: two typed interfaces between the data module and the module.

    RolloutData        what the trainer asks of the data side during a run (implemented by
                       lit_ess.datamodules.RolloutDataModule):
        waiting_batches(phase)            the phase's batches not yet trained (the module: proximal scoring)
        wants_weights(version)            will the engine generate before the trainer's next step?
        push_weights(tensors, version)    the policy's weights of optimizer step `version`
                                          (both asked by lit_ess.callbacks.WeightSync, the push's one owner)
    RolloutConsumer    a module that trains from one: `attach_rollouts(data)`, which the data module calls
                       once per stage, in its `setup` (lit_ess.module.PolicyModule implements it)

`wants_weights` gives the same answer on every data-parallel rank, so under FSDP2 every rank enters the
weight gather at the same steps.

They sit on the ground floor, beside the batch they carry, so the module and the callbacks name them
without importing the rollout layer or the data modules.
"""
from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

from torch import Tensor

from .batch import RolloutBatch


class RolloutData(Protocol):
    def waiting_batches(self, phase: int) -> list[RolloutBatch]: ...

    def wants_weights(self, version: int) -> bool: ...

    def push_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...


@runtime_checkable
class RolloutConsumer(Protocol):
    def attach_rollouts(self, data: RolloutData) -> None: ...
