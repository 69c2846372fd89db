"""ProximalLogprobs: accepted in `trainer.callbacks`, and does nothing.

PolicyModule scores the proximal logprobs itself, in its step, whenever its objective uses them
(PolicyModule.score_phase). A config that lists this callback still runs, with the same result; a
one-line note (once per process, on rank 0) says it can be removed.
"""
from __future__ import annotations

import sys

import lightning as L

NOTE = ("lit-ess: note: lit_ess.callbacks.ProximalLogprobs does nothing: PolicyModule scores proximal logprobs "
        "in its training step whenever the objective uses them; remove it from trainer.callbacks")


class ProximalLogprobs(L.Callback):
    """No-op: PolicyModule.score_phase scores proximal logprobs when the objective needs them."""

    noted = False                                    # once per process

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.is_global_zero and not ProximalLogprobs.noted:
            ProximalLogprobs.noted = True
            print(NOTE, file=sys.stderr)
