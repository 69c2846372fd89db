"""LoRA on the policy: the typed config, its application with peft, and the merged weights the engine
receives.

With LoRA, a target linear layer computes y = x (W + s B A)^T, W frozen, A [r, in] and B [out, r]
trained, s = alpha / r. Only A and B (and their optimizer state) change, so checkpoints hold them alone;
the engine samples from the merged weights W + s B A, which `merged_weights` computes tensor by tensor
under the base model's Hugging Face names (W itself is never modified: merging in place and unmerging
later would leave W + sBA - sBA != W in floating point, a drift that grows with every sync).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import torch
from torch import Tensor

from .knobs import check

ADAPTER = "default"          # peft's name of the one adapter


@dataclass
class LoRA:
    """Low-rank adapters on the policy (peft); full fine-tuning when the module's `lora` is None.

    Args:
        rank: r, the rank of A and B, >= 1.
        alpha: scale numerator: the update is (alpha / r) B A; > 0.
        dropout: dropout on the adapter's input, in [0, 1) (0 = none). 0 by default: with dropout the trainer scores tokens
            with a random sub-network, so on-policy data no longer has ESS 1 and a resume is not exact.
            PolicyModule's disable_dropout does not touch it (it is set explicitly here); it warns.
        target_modules: the layers that get adapters: "all-linear" (every linear layer but the output
            head) or a list of module names (e.g. [q_proj, v_proj]).
        sync: what the engine receives: "merged" (W + s B A under the base's names, through the same
            transports as full weights) or "adapter" (A and s B only; vLLM serves them as a LoRA
            adapter: start it with data.engine.init_args.max_lora_rank >= rank).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = field(default="all-linear")
    sync: Literal["merged", "adapter"] = "merged"

    def __post_init__(self):
        check("lora.rank", self.rank, ge=1, integer=True)
        check("lora.alpha", self.alpha, gt=0)
        check("lora.dropout", self.dropout, ge=0, lt=1)
        if self.sync not in ("merged", "adapter"):
            raise ValueError(f"lora.sync must be 'merged' or 'adapter', got {self.sync!r}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(f"lora.target_modules must be 'all-linear' or a list of module names, "
                             f"got {self.target_modules!r}")

    def shape(self) -> dict:
        """The settings that fix the adapters' tensors and their update (not how they are synced)."""
        targets = self.target_modules if isinstance(self.target_modules, str) else sorted(self.target_modules)
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "target_modules": targets}

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model wrapped by peft with fresh adapters (B = 0: the adapted model starts as the base)."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                            target_modules=self.target_modules)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        ends = {id(model.get_input_embeddings()): "the input embeddings", id(model.get_output_embeddings()): "the output head"}
        try:
            peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
        except ValueError as e:                       # e.g. a target module name the model does not have
            raise ValueError(f"lora.target_modules={self.target_modules!r}: {e}") from None
        for name, module in peft_model.get_base_model().named_modules():
            base = getattr(module, "base_layer", None)
            if base is None:
                continue
            if tied and id(base) in ends:             # the adapted model would no longer be tied; engines are
                raise ValueError(f"lora.target_modules: {name} is {ends[id(base)]}, tied to the other end of "
                                 f"this model (tie_word_embeddings): leave it out of target_modules")
            if self.sync == "adapter" and isinstance(base, torch.nn.Embedding):
                raise ValueError(f"lora.target_modules: {name} is an embedding; lora.sync: adapter pushes linear "
                                 f"adapters only: leave it out, or use sync: merged")
        return peft_model


def is_peft(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def full(t: Tensor) -> Tensor:
    """The whole tensor: an FSDP2 shard (DTensor) is all-gathered, a collective every rank must enter."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) of the base model with every adapter merged, W + s B A, in the base
    model's state-dict order; adapter tensors themselves are not yielded. Under FSDP2 W, A and B are
    shards: s B A and the sum are DTensor ops on them, and each merged tensor is gathered when its turn
    comes; every rank must consume the iterator in step."""
    base = model.get_base_model()
    for name, t in base.state_dict().items():
        if is_adapter_key(name):
            continue
        if ".base_layer." not in name:
            yield name, full(t)
            continue
        owner, leaf = name.split(".base_layer.")
        if leaf == "weight":
            t = t + base.get_submodule(owner).get_delta_weight(ADAPTER).to(t.dtype)
        yield f"{owner}.{leaf}", full(t)


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The adapters as a self-describing LoRA checkpoint: `adapter_state` under peft's saved names (the
    adapter's name dropped, `...q_proj.lora_A.weight`, as get_peft_model_state_dict writes them), with
    the scale s = alpha / r folded into B, so an adapter config with lora_alpha = r (scale 1) reproduces
    the update exactly (see `write_adapter`). Gathered one tensor at a time under FSDP2, as
    `merged_weights`."""
    base = model.get_base_model()
    for name, t in adapter_state(model).items():
        name = name.replace(f".{ADAPTER}.", ".").removesuffix(f".{ADAPTER}")
        if ".lora_B." in name:
            owner = name.split(".lora_B.")[0].removeprefix("base_model.model.")
            t = t * base.get_submodule(owner).scaling[ADAPTER]
        yield name, full(t)


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict name is an adapter tensor's: the one definition of "the adapters" (the tensors
    checkpoints hold, export writes and sync pushes). peft names them `<layer>.lora_A.<adapter>.weight`
    (lora_B, lora_embedding_A, lora_embedding_B likewise). State-dict names, not parameter names:
    activation checkpointing's wrapper adds `_checkpoint_wrapped_module.` to the latter only."""
    return ".lora_" in name


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter tensors of a peft model under its state-dict names (`policy.` prefix added by the
    caller); the tensors share the parameters' storage (filling them in place fills the model)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}


def peft_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """`adapter_state` whole (gathered under FSDP2: every rank must call it), for
    `model.save_pretrained(folder, state_dict=...)`: peft's own adapter folder."""
    return {k: full(v) for k, v in adapter_state(model).items()}


def is_adapter_payload(names: list[str]) -> bool:
    """True when pushed weights are adapters (`adapter_weights`) rather than full or merged weights."""
    return bool(names) and all(is_adapter_key(n) for n in names)


def write_adapter(folder: str | Path, tensors: dict[str, Tensor]) -> Path:
    """A peft adapter folder (adapter_model.safetensors + adapter_config.json) for the tensors of
    `adapter_weights`: rank from lora_A's shape, target modules from the names, lora_alpha = rank."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rank = next(t.shape[0] for n, t in tensors.items() if ".lora_A." in n)
    targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors})
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": targets, "task_type": "CAUSAL_LM", "fan_in_fan_out": False}))
    return folder


def base_fingerprint(model_path: str) -> str:
    """A short hash of the base model's weight files, so a LoRA checkpoint can tell whether it is resumed
    on the base it was trained from."""
    h = hashlib.sha256()
    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not files:                                    # a hub name: the best we can do is the name
        h.update(model_path.encode())
    for f in files:
        st = f.stat()
        h.update(json.dumps([f.name, st.st_size]).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))                 # the header and first MiB: cheap, and tells bases apart
    return h.hexdigest()[:16]


# LoRA configs are saved in checkpoints' hyper-parameters: let torch.load(weights_only=True) rebuild them.
torch.serialization.add_safe_globals([LoRA])
