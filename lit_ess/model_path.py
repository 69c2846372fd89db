"""Model folders and checkpoints: fail early, with what to do, when a path names no usable model.

A `model_path` is a local Hugging Face folder (config.json inside) or a hub name ("org/name"). A path
that is neither fails at once with the command that makes a folder, instead of transformers' retries
against the hub and its "couldn't connect to huggingface.co". A folder whose `*.safetensors` file is
truncated or not safetensors at all fails naming that file, instead of a bare SafetensorError from
deep inside transformers (or vLLM).
"""
from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_path(path: str, what: str = "model_path") -> None:
    """Raise ValueError naming `path` unless it is a model folder or can be a hub name."""
    if not path:
        raise ValueError(f"{what} is empty: give a Hugging Face model folder or hub name")
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{what}={path!r} is a folder without config.json, not a Hugging Face model folder")
        _check_weights(p, what)
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    looks_local = not _HUB_NAME.fullmatch(path) or Path(path.split("/")[0]).is_dir()
    if offline or looks_local:
        raise ValueError(f"{what}={path!r}: no such model folder. Make one with `lit-ess-tiny {path}` (a tiny "
                         f"offline model) or run `bash scripts/demo.sh` (which also warm-starts it); a hub name "
                         f"looks like 'Qwen/Qwen2.5-1.5B-Instruct'")


def _check_weights(folder: Path, what: str) -> None:
    """Read the header of every safetensors file (cheap: its size is checked against the header)."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{what}: {f} is not a readable safetensors file ({e}): it is truncated or damaged; "
                             f"write the model folder again (e.g. `lit-ess-tiny {folder}` or a new download)") from None


def check_checkpoint(path: str | Path, what: str = "checkpoint") -> Path:
    """The file to read for a checkpoint given explicitly (a .ckpt file, or `meta.pt` of a folder of
    shards); raises naming it when it is missing, or is no zip archive (torch.save's format), as after
    a run killed while saving."""
    p = Path(path)
    f = p / "meta.pt" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r}: no such checkpoint file" if not p.is_dir() else
                                f"{what} {str(path)!r} is a folder without meta.pt, not a folder of checkpoint shards")
    try:
        with zipfile.ZipFile(f) as z:
            if not any(n.endswith("data.pkl") for n in z.namelist()):
                raise zipfile.BadZipFile("no data.pkl inside")
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{what} {str(f)!r} cannot be read as a checkpoint ({e}): it is truncated or damaged (a run "
                         f"killed while saving?) or not a checkpoint; give another one") from None
    return f
