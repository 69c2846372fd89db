"""`lit-ess-export CHECKPOINT OUT`: a lit-ess checkpoint as a plain Hugging Face folder.

    lit-ess-export runs/ckpt/last.ckpt runs/export            # a file, or a folder of FSDP2 shards
    lit-ess-export runs/ckpt/last.ckpt runs/export --model_path Qwen/Qwen2.5-1.5B-Instruct

A sharded checkpoint (ModelParallelStrategy, a folder of `*.distcp` files and `meta.pt`) is read with
`torch.distributed.checkpoint` in one process, policy weights only (not the optimizer state): the
model is built from its config, its state dict is filled in place, and saved with the tokenizer.
`model_path` (architecture and tokenizer) defaults to the one in the checkpoint's hyper-parameters.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

PREFIX = "policy."


def export_hf(checkpoint: str | Path, out: str | Path, model_path: str | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .model_path import check_checkpoint, check_model_path

    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is an existing file: give a folder for the Hugging Face model (OUT)")
    if model_path:
        check_model_path(model_path, "--model_path")
    sharded = checkpoint.is_dir()
    meta_file = check_checkpoint(checkpoint)
    try:
        meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    except Exception as e:         # a damaged archive (zip intact): torch's reader errors vary
        raise ValueError(f"{meta_file} cannot be read as a checkpoint ({type(e).__name__}: {e})") from None
    saved_path = meta.get("hyper_parameters", {}).get("model_path")
    model_path = model_path or saved_path
    if not model_path:
        raise ValueError(f"{checkpoint} names no model_path in its hyper-parameters: pass --model_path")
    check_model_path(model_path, "--model_path" if model_path != saved_path else "the checkpoint's model_path")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    state = {PREFIX + k: v for k, v in model.state_dict().items()}
    if sharded:
        import torch.distributed.checkpoint as dcp

        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        stored = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        _check_shapes(checkpoint, model_path, state, {k.removeprefix("state_dict."): tuple(m.size) for k, m in stored.items()
                                                      if isinstance(m, TensorStorageMetadata)})
        wanted = {"state_dict": state}
        dcp.load(wanted, checkpoint_id=str(checkpoint), no_dist=True)      # fills `state` in place
    else:
        saved = meta["state_dict"]
        _check_shapes(checkpoint, model_path, state, {k: tuple(v.shape) for k, v in saved.items()})
        for k, v in state.items():
            v.copy_(saved[k])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    return out


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
    p.add_argument("--model_path", default=None, help="architecture and tokenizer (default: the checkpoint's)")
    a = p.parse_args(argv)
    try:
        print(export_hf(a.checkpoint, a.out, a.model_path))
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"lit-ess-export: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
