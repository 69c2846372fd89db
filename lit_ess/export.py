"""`lit-ess-export CHECKPOINT OUT`: a lit-ess checkpoint as a plain Hugging Face folder.

    lit-ess-export runs/ckpt/last.ckpt runs/export            # a file, or a folder of FSDP2 shards
    lit-ess-export runs/ckpt/last.ckpt runs/export --model_path Qwen/Qwen2.5-1.5B-Instruct
    lit-ess-export runs/lora/last.ckpt runs/adapter           # LoRA: the peft adapter folder
    lit-ess-export runs/lora/last.ckpt runs/export --merged   # LoRA: merged model, adapter in OUT/adapter

A sharded checkpoint (ModelParallelStrategy, a folder of `*.distcp` files and `meta.pt`) is read with
`torch.distributed.checkpoint` in one process, policy weights only (not the optimizer state): the
model is built from its config, its state dict is filled in place, and saved with the tokenizer.
`model_path` (architecture and tokenizer) defaults to the one in the checkpoint's hyper-parameters.

A LoRA checkpoint (model.lora) holds the adapters only: the base is loaded from `model_path`, which
must be the base the run trained on (the checkpoint's fingerprint of its weight files is checked),
the adapters are applied with the run's settings and filled in, and OUT is peft's adapter folder
(`PeftModel.from_pretrained(base, OUT)`); with `--merged`, OUT is the merged model W + s B A
(`AutoModelForCausalLM.from_pretrained(OUT)`) with the tokenizer, and the adapter folder is OUT/adapter.

OUT is written whole or not at all (lit_ess.checkpoint.atomic_folder): a temp folder beside it, renamed
when every file is in; a full disk is one line and leaves nothing behind.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

PREFIX = "policy."


def export_hf(checkpoint: str | Path, out: str | Path, model_path: str | None = None, merged: bool = False) -> Path:
    """Write the policy of `checkpoint` to `out`; `merged` matters for LoRA checkpoints only (a full
    checkpoint is always written as a whole model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model_path import check_checkpoint, check_model_path

    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is an existing file: give a folder for the Hugging Face model (OUT)")
    meta_file = check_checkpoint(checkpoint)
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    except Exception as e:         # a damaged archive (zip intact): torch's reader errors vary
        raise ValueError(f"{meta_file} cannot be read as a checkpoint ({type(e).__name__}: {e})") from None
    saved_path = meta.get("hyper_parameters", {}).get("model_path")
    what = "--model_path" if model_path else "the checkpoint's model_path"
    model_path = model_path or saved_path
    if not model_path:
        raise ValueError(f"{checkpoint} names no model_path in its hyper-parameters: pass --model_path")
    if "lora_base" in meta.get("lit_ess", {}):
        return _export_lora(checkpoint, out, meta, model_path, what, merged)
    check_model_path(model_path, what)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    state = {PREFIX + k: v for k, v in model.state_dict().items()}
    _fill(checkpoint, meta, model_path, state)
    save_model(model, out, model_path)
    return out


def save_model(model: torch.nn.Module, out: str | Path, model_path: str, state_dict: dict | None = None) -> None:
    """Write a Hugging Face model folder at `out`, whole or not at all (atomic_folder): the weights
    (`state_dict`, default the model's), its config and generation config, `model_path`'s tokenizer."""
    from .checkpoint import atomic_folder

    with atomic_folder(out, "export") as tmp:
        _write_model(model, tmp, model_path, state_dict)


def _write_model(model: torch.nn.Module, folder: Path, model_path: str, state_dict: dict | None) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(folder, state_dict=state_dict)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def _fill(checkpoint: Path, meta: dict, model_path: str, state: dict) -> None:
    """Copy the checkpoint's tensors of the keys of `state` into its tensors, in place: from `meta`'s
    state dict (a file), or from the shards (a folder)."""
    if checkpoint.is_dir():
        import torch.distributed.checkpoint as dcp

        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        _check_shapes(checkpoint, model_path, state, {k.removeprefix("state_dict."): tuple(m.size) for k, m in stored.items()
                                                      if isinstance(m, TensorStorageMetadata)})
        dcp.load({"state_dict": state}, checkpoint_id=str(checkpoint), no_dist=True)      # fills `state` in place
    else:
        saved = meta["state_dict"]
        _check_shapes(checkpoint, model_path, state, {k: tuple(v.shape) for k, v in saved.items()})
        with torch.no_grad():
            for k, v in state.items():
                v.copy_(saved[k])


def _export_lora(checkpoint: Path, out: Path, meta: dict, base: str, what: str, merged: bool) -> Path:
    """A LoRA checkpoint: the base of `base` (checked against the checkpoint's fingerprint) with the
    run's adapters filled in, written as peft's adapter folder, or merged (`save_adapted`)."""
    from transformers import AutoModelForCausalLM

    from .lora import LoRA, adapter_state, base_fingerprint, merged_weights, peft_state
    from .model_path import check_model_path

    try:
        check_model_path(base, what)
    except ValueError:
        if Path(base).expanduser().is_dir():
            raise
        raise ValueError(f"{what}={base!r} is missing: a LoRA checkpoint holds the adapters only, and needs the base "
                         f"model it was trained on: pass --model_path with that base's folder") from None
    trained_on, now = meta["lit_ess"]["lora_base"], base_fingerprint(base)
    if now != trained_on:
        raise ValueError(f"{what}={base!r} is not the base this LoRA checkpoint was trained on (its weight files "
                         f"changed since: fingerprint {now}, the checkpoint's {trained_on}): pass --model_path "
                         f"with the base it was trained on")
    lora = meta["hyper_parameters"].get("lora")
    lora = LoRA(**lora) if isinstance(lora, dict) else lora
    if not isinstance(lora, LoRA):
        raise ValueError(f"{checkpoint} has a LoRA base fingerprint but no model.lora in its hyper-parameters")
    policy = lora.apply(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    _fill(checkpoint, meta, base, {PREFIX + k: v for k, v in adapter_state(policy).items()})
    save_adapted(policy, out, base, dict(merged_weights(policy)) if merged else None, peft_state(policy))
    return out


def save_adapted(policy: torch.nn.Module, out: str | Path, model_path: str, merged: dict | None,
                 adapter: dict) -> None:
    """Write a peft policy: `adapter` (`lit_ess.lora.peft_state`) as peft's adapter folder at `out`; or,
    given its `merged` weights (`lit_ess.lora.merged_weights`), the merged Hugging Face model at `out`
    with `model_path`'s tokenizer, and the adapter folder at `out/adapter`."""
    from .checkpoint import atomic_folder

    with atomic_folder(out, "export") as tmp:
        if merged is not None:
            _write_model(policy.get_base_model(), tmp, model_path, merged)
        policy.save_pretrained(tmp / "adapter" if merged is not None else tmp, state_dict=adapter)


def _check_shapes(checkpoint: Path, model_path: str, state: dict, saved: dict[str, tuple]) -> None:
    """Every policy weight of the model is in the checkpoint, with the model's shape."""
    missing = sorted(set(state) - set(saved))
    if missing:
        raise ValueError(f"{checkpoint} lacks policy weights {missing[:3]}: is it a lit-ess policy checkpoint?")
    for k, v in state.items():
        if tuple(v.shape) != saved[k]:
            raise ValueError(f"{checkpoint}: weight {k.removeprefix(PREFIX)} has shape {list(saved[k])}, the model "
                             f"of {model_path} has {list(v.shape)}: pass the --model_path the run trained")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lit-ess-export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a .ckpt file or a folder of shards (e.g. runs/ckpt/last.ckpt)")
    p.add_argument("out", help="the Hugging Face folder to write")
    p.add_argument("--model_path", default=None, help="architecture and tokenizer (default: the checkpoint's); "
                   "with LoRA, the base model the adapters were trained on")
    p.add_argument("--merged", action="store_true", help="LoRA checkpoints: write the merged model (the adapter "
                   "folder goes to OUT/adapter); without it OUT is the peft adapter folder")
    a = p.parse_args(argv)
    try:
        print(export_hf(a.checkpoint, a.out, a.model_path, a.merged))
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"lit-ess-export: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
