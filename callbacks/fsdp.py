"""FSDP2: shard the policy per decoder layer with `fully_shard`, under Lightning's ModelParallelStrategy.

    trainer:
      strategy:
        class_path: lightning.pytorch.strategies.ModelParallelStrategy
        init_args: {data_parallel_size: 8, tensor_parallel_size: 1}   # W = devices x nodes
      callbacks:
        - class_path: lit_ess.callbacks.FSDP2
          init_args: {param_dtype: bfloat16, reduce_dtype: float32}

Lightning calls the callbacks' `setup` after the process group and the device mesh exist and before
the module's `configure_model`; this callback builds the module's models there (the module's own
`configure_model`, which is idempotent) and shards them: each decoder layer (the classes a Hugging
Face model lists in `_no_split_modules`) is one FSDP unit, the root (embeddings, final norm, head,
tied weights included) another. Parameters are DTensors sharded over the data-parallel mesh;
`fully_shard` reduce-scatters averaged gradients, which PolicyModule accounts for. The frozen
reference model (ref_kl_coef > 0) is sharded the same way. With `model.lora` the peft model is the
policy: FSDP2 shards each parameter on its own, so a layer's unit holds its frozen base weights and
its trainable adapters together; only the adapters get gradients (reduce-scattered) and optimizer
state, and a checkpoint's shards hold the adapters alone.

Mixed precision: parameters stay in their stored dtype (the optimizer's master copy); forward and
backward run in `param_dtype`, gradients are reduced in `reduce_dtype`. Weight sync and export
gather full tensors one at a time in a fixed order (`lit_ess.module.full_weights`).
"""
from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import lightning as L
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@runtime_checkable
class CastAware(Protocol):
    """A module whose checks depend on the forward's dtype (PolicyModule: its lag-0 ESS alarm); SFTModule is not."""

    def cast_forward(self, dtype: str | None) -> None: ...


class FSDP2(L.Callback):
    """Shard the policy (and a frozen reference) with FSDP2 under ModelParallelStrategy.

    Args:
        param_dtype: dtype of parameters during forward/backward (None = as stored, no cast). With
            bfloat16 the trainer's log-probs are bf16: a mismatch with an fp32 engine that the ESS sees.
        reduce_dtype: dtype of the gradient reduce-scatter (None = param_dtype).
        reshard_after_forward: free each layer's gathered parameters after its forward (less memory,
            one more all-gather in backward); False keeps them until backward.
        activation_checkpointing: recompute each decoder layer's activations in backward
            (non-reentrant checkpoint wrapper applied before sharding).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only;
            the gather and clipping of CPU shards need a CPU backend beside NCCL: set
            ModelParallelStrategy's process_group_backend: "cuda:nccl,cpu:gloo").
    """

    def __init__(self, param_dtype: Literal["float32", "bfloat16", "float16"] | None = None,
                 reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = "float32",
                 reshard_after_forward: bool = True, activation_checkpointing: bool = False,
                 cpu_offload: bool = False):
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise ValueError(f"FSDP2.{name}={value!r} is not one of {tuple(DTYPES)} or null")
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing, self.cpu_offload = activation_checkpointing, cpu_offload

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, ModelParallelStrategy):
            raise ValueError(f"lit_ess.callbacks.FSDP2 needs trainer.strategy: lightning.pytorch.strategies.ModelParallelStrategy "
                             f"(got {type(strategy).__name__}); for DDP drop the callback and use strategy: ddp")
        mesh = strategy.device_mesh
        if mesh["tensor_parallel"].size() != 1:
            raise ValueError(f"lit_ess.callbacks.FSDP2 shards over data-parallel ranks only: set ModelParallelStrategy's "
                             f"data_parallel_size to devices x nodes ({mesh.size()}) and tensor_parallel_size: 1 "
                             f"(its 'auto' puts a node's devices on the tensor-parallel axis)")
        if self.cpu_offload and strategy.root_device.type != "cuda":
            raise ValueError("FSDP2.cpu_offload moves shards from GPU to CPU memory: it needs CUDA devices")
        pl_module.configure_model()
        for model in pl_module.sharded_models():
            self.shard(model, mesh["data_parallel"])
        if isinstance(pl_module, CastAware):
            pl_module.cast_forward(self.param_dtype)        # PolicyModule: a fact of its lag-0 ESS alarm

    def shard(self, model: torch.nn.Module, mesh) -> None:
        """fully_shard every decoder layer, then the root."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        if self.param_dtype or self.reduce_dtype:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=DTYPES.get(self.param_dtype), reduce_dtype=DTYPES.get(self.reduce_dtype or self.param_dtype))
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        layers = decoder_layers(model)
        if self.activation_checkpointing:
            layers = _checkpoint_layers(model, layers)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose class a Hugging Face model names in `_no_split_modules` (its decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} lists no decoder-layer classes in _no_split_modules: FSDP2 cannot "
                         f"choose its sharding units")
    return layers


def _checkpoint_layers(model: torch.nn.Module, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Replace each layer by a non-reentrant checkpoint wrapper of it (state-dict names unchanged)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    wrapped = {id(layer): checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT) for layer in layers}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in wrapped:
                setattr(parent, name, wrapped[id(child)])
    return list(wrapped.values())
