"""SFTModule: supervised fine-tuning on (prompt, answer) pairs, the warm start before RL.

Loss: token-mean cross-entropy over the answer tokens (and the eos that ends them); prompt tokens are
not trained. Used by the CPU demo to give a random tiny model a policy that RL can sharpen.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from .knobs import check
from .model_path import check_model_path
from .module import check_gradients_synchronised, full_weights


class SFTModule(L.LightningModule):
    """Supervised fine-tuning on (prompt, answer) pairs: the warm start before RL.

    Args:
        model_path: Hugging Face causal LM folder.
        lr: AdamW learning rate, > 0.
        weight_decay: AdamW weight decay, >= 0 (0 = none).
        warmup_steps: linear warm-up steps, then constant; >= 0 (0 = none).
    """

    def __init__(self, model_path: str, lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 50):
        super().__init__()
        check("model.lr", lr, gt=0)
        check("model.weight_decay", weight_decay, ge=0)
        check("model.warmup_steps", warmup_steps, ge=0, integer=True)
        self.save_hyperparameters()
        check_model_path(model_path)
        self.policy = None

    def configure_model(self) -> None:
        if self.policy is None:
            from transformers import AutoModelForCausalLM

            self.policy = AutoModelForCausalLM.from_pretrained(self.hparams.model_path, dtype=torch.float32).train()

    def on_fit_start(self) -> None:
        check_gradients_synchronised(self)

    def sharded_models(self) -> list[torch.nn.Module]:
        """The models a sharding callback (lit_ess.callbacks.FSDP2) shards."""
        return [self.policy]

    def policy_weights(self):
        """Full weights with Hugging Face names, one tensor at a time (see lit_ess.module.full_weights)."""
        return full_weights(self.policy)

    def training_step(self, batch, batch_idx):
        logits = self.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["input_ids"][:, 1:].masked_fill(~batch["loss_mask"][:, 1:], -100)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        with torch.no_grad():
            hit = (logits[:, :-1].argmax(-1) == batch["input_ids"][:, 1:]) | ~batch["loss_mask"][:, 1:]
            seq_acc = hit.all(-1).float().mean()
        self.log_dict({"sft/loss": loss, "sft/teacher_forced_seq_acc": seq_acc}, prog_bar=True, batch_size=1)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.policy.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        w = self.hparams.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (w + 1)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
