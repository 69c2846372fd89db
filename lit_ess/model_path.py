"""Model folders: fail early, with what to do, when `model_path` names no model.

A `model_path` is a local Hugging Face folder (config.json inside) or a hub name ("org/name"). A path
that is neither fails at once with the command that makes a folder, instead of transformers' retries
against the hub and its "couldn't connect to huggingface.co".
"""
from __future__ import annotations

import os
import re
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
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    looks_local = not _HUB_NAME.fullmatch(path) or Path(path.split("/")[0]).is_dir()
    if offline or looks_local:
        raise ValueError(f"{what}={path!r}: no such model folder. Make one with `lit-ess-tiny {path}` (a tiny "
                         f"offline model) or run `bash scripts/demo.sh` (which also warm-starts it); a hub name "
                         f"looks like 'Qwen/Qwen2.5-1.5B-Instruct'")
