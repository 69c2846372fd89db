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

    checkpoint, out = Path(checkpoint), Path(out)
    sharded = checkpoint.is_dir()
    meta_file = checkpoint / "meta.pt" if sharded else checkpoint
    if not meta_file.exists():
        raise FileNotFoundError(f"{checkpoint} is neither a checkpoint file nor a folder of shards with meta.pt")
    meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    model_path = model_path or meta.get("hyper_parameters", {}).get("model_path")
    if not model_path:
        raise ValueError(f"{checkpoint} names no model_path in its hyper-parameters: pass --model_path")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    state = {PREFIX + k: v for k, v in model.state_dict().items()}
    if sharded:
        import torch.distributed.checkpoint as dcp

        wanted = {"state_dict": state}
        dcp.load(wanted, checkpoint_id=str(checkpoint), no_dist=True)      # fills `state` in place
    else:
        saved = meta["state_dict"]
        missing = sorted(set(state) - set(saved))
        if missing:
            raise ValueError(f"{checkpoint} lacks policy weights {missing[:3]}: is it a lit-ess policy checkpoint?")
        for k, v in state.items():
            v.copy_(saved[k])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    return out


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
