"""The plain-PyTorch pieces of an optimizer step, shared by PolicyModule and lit_ess/reference.py.

    finite_mask      the tokens that enter the loss and the ESS, [B, T]
    build_optimizer  AdamW, weight decay on matrices only
    lr_factor        warm-up, then constant / cosine / linear decay
    clip_gradients   clip the global gradient norm, return it (before clipping)
    disable_dropout  every dropout probability to 0, so on-policy data scores rho = 1
    full_weights     (name, full tensor) pairs for the rollout engine, gathered one at a time
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
from torch import Tensor

from .knobs import check


def finite_mask(completion_mask: Tensor, behavior_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """[B, T] bool: completion tokens whose behaviour and trainer logprobs are both finite. A token outside
    the trainer's top-k/top-p set (-inf) or a NaN is dropped from the loss and the ESS alike, and counted
    in `train/nonfinite_tokens`."""
    return completion_mask & torch.isfinite(behavior_logprobs) & torch.isfinite(logprobs.detach())


def build_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices (dim >= 2), none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=tuple(betas))


def lr_factor(step: int, warmup_steps: int = 0, schedule: str = "constant", total_steps: int | None = None,
              min_lr_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step `step` as a fraction of lr:

        step < warmup:   (step + 1) / (warmup + 1)
        constant:        1
        cosine:          r + (1 - r) (1 + cos(pi f)) / 2        f = (step - warmup) / (total - warmup), r = min_lr_ratio
        linear:          r + (1 - r) (1 - f)
    (no total_steps: constant after the warm-up)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant" or not total_steps:
        return 1.0
    frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return min_lr_ratio + (1 - min_lr_ratio) * shape


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> Tensor:
    """Scale the gradients so that ||g||_2 <= max_norm (None: leave them) and return ||g||_2 before
    clipping. Under FSDP2 the gradients are DTensor shards: the norm is reduced over ranks and returned
    as a plain tensor."""
    check("max_grad_norm", max_norm, gt=0, null=True, hint=": use null for no clipping")   # -1 would negate g
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
    else:
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


DROPOUT_ATTRS = ("attention_dropout", "dropout", "hidden_dropout", "attn_dropout")   # floats HF layers drop with


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0: `nn.Dropout` modules and the float `attention_dropout` /
    `dropout` attributes that Hugging Face attention layers pass to their functional dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr in DROPOUT_ATTRS:
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    for attr in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)


def has_dropout(model: torch.nn.Module) -> bool:
    """True when any dropout that disable_dropout would zero is on (LoRA's nn.Dropout included)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        if any(isinstance(v := getattr(module, a, None), float) and v > 0
               for a in DROPOUT_ATTRS):
            return True
    return False


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) for every entry of the state dict, in its fixed order, with Hugging Face
    names (wrapper prefixes are stripped by the wrappers' state-dict hooks). A DTensor shard (FSDP2)
    is gathered when its turn comes, so at most one full tensor exists beside the shards; every rank
    must consume the iterator in step."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)
