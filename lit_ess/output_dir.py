"""One folder per run: `output_dir`, the CLI's top-level key, from which the run's paths follow.

    output_dir: runs/demo/rl
        checkpoints/    ModelCheckpoint's dirpath (every ModelCheckpoint without one, Lightning's default too)
        logs/           TensorBoard's event files (the default logger, name and version empty) and
                        LightningCLI's config.yaml; W&B's and MLflow's local files (wandb/, mlruns/)
        model/          ExportHF's dirpath: the trained policy as a Hugging Face folder
        hpc_ckpt_N.ckpt Slurm preemption checkpoints (the Trainer's default_root_dir is output_dir)

A path the config sets itself is kept: a ModelCheckpoint or ExportHF `dirpath`, a logger's `save_dir` (W&B:
`save_dir` or `dir`; MLflow: `save_dir` or `tracking_uri`; a TensorBoardLogger or CSVLogger block must give
one), `trainer.default_root_dir`. A config with no logger gets TensorBoard; `logger: false` stays off. Without
output_dir (null, the default) nothing follows and nothing below is checked: each path is the config's own,
as in Lightning.

A folder holds one run. `fit` into an output_dir that already holds a run (any of the folders above that lie
inside it, holding something, or an hpc checkpoint) refuses to start in one line, unless told what to do:
`--ckpt_path last` resumes from its newest readable checkpoint (logs continue where they stopped), `--overwrite
true` removes the old run's folders above (only those inside output_dir; a config file or anything else kept
there stays) and starts clean, but only folders a lit-ess fit named as its own (`.lit-ess-run`, written at every
fit's start): `--output_dir .` over a user's own ./model is refused, not emptied. A Slurm job requeued without --ckpt_path resumes from its hpc checkpoint, as
Lightning does. Before this, a second run went on silently: it wrote `last-v1.ckpt` beside the first run's
`last.ckpt`, its curves into the first run's TensorBoard run, and a later `--ckpt_path last` loaded whichever
file was newest.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

CHECKPOINTS, LOGS, MODEL = "checkpoints", "logs", "model"
MARKER = ".lit-ess-run"       # written into output_dir by every fit, naming its folders: --overwrite clears only those
TENSORBOARD = "lightning.pytorch.loggers.TensorBoardLogger"

OUTPUT_DIR_HELP = (
    "The run's folder (null = none: every path is the config's own). Checkpoints go to OUTPUT_DIR/checkpoints, "
    "TensorBoard (the default logger), W&B and MLflow files and config.yaml to OUTPUT_DIR/logs, ExportHF's model to "
    "OUTPUT_DIR/model, unless the config sets that path itself. fit into a folder that holds a run refuses to start: --ckpt_path last "
    "resumes it, --overwrite true starts over; validate --ckpt_path last loads its newest checkpoint.")
OVERWRITE_HELP = (
    "Start over in an output_dir that holds a run: remove its checkpoints/, logs/ and model/ (what this run would "
    "write inside output_dir; nothing else there, nothing outside) before the run starts. Cannot be combined with "
    "--ckpt_path. The run's config.yaml records it as false (a rerun from that file never clears a run).")


def follow(cfg, output_dir: str | None) -> None:
    """Point the trainer's paths in `cfg` (the parsed config of a subcommand, a jsonargparse Namespace) that the
    config leaves unset at `output_dir`: default_root_dir and the loggers' local folders. The callbacks'
    folders are set on the built objects (`follow_callbacks`)."""
    if not output_dir:
        return
    from jsonargparse import Namespace

    t = cfg["trainer"]
    if t.get("default_root_dir") is None:
        t["default_root_dir"] = output_dir
    logs = os.path.join(output_dir, LOGS)
    logger = t.get("logger")
    if logger is None or logger is True:        # Lightning's default logger: TensorBoard
        t["logger"] = Namespace(class_path=TENSORBOARD, init_args=Namespace(save_dir=logs, name="", version=""))
        return
    for one in logger if isinstance(logger, list) else [logger]:
        if isinstance(one, Namespace) and isinstance(one.get("init_args"), Namespace):
            _follow_logger(one["class_path"].rsplit(".", 1)[-1], one["init_args"], logs)


def _follow_logger(name: str, args, logs: str) -> None:
    """A logger's local folder under `logs`, unless the config set it (a value other than the class's default).
    TensorBoardLogger and CSVLogger blocks come with a save_dir (jsonargparse requires it): theirs stays."""
    if name == "WandbLogger" and str(args.get("save_dir")) == "." and args.get("dir") is None:
        args["save_dir"] = logs
    elif name == "MLFlowLogger" and args.get("tracking_uri") is None and args.get("save_dir") == "./mlruns":
        args["save_dir"] = os.path.join(logs, "mlruns")


def follow_callbacks(trainer, output_dir: str | None) -> None:
    """Every ModelCheckpoint without a dirpath (Lightning's default one too) writes to OUTPUT_DIR/checkpoints,
    every ExportHF without one to OUTPUT_DIR/model; without output_dir an ExportHF needs its own dirpath."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_ess.callbacks import ExportHF

    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is None and output_dir:
            cb.dirpath = os.path.realpath(os.path.join(output_dir, CHECKPOINTS))     # as ModelCheckpoint keeps one
        elif isinstance(cb, ExportHF) and cb.dirpath is None:
            if not output_dir:
                raise ValueError("ExportHF.dirpath is not set: give it a folder, or set output_dir (the run's folder; "
                                 "the model then goes to OUTPUT_DIR/model)")
            cb.set_dirpath(os.path.join(output_dir, MODEL))


@dataclass
class Run:
    """What a run writes inside its output_dir: folders (checkpoints, logs, export) and hpc checkpoint files."""
    output_dir: Path
    folders: list[Path] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    def held(self) -> list[Path]:
        """Those already there: folders holding something, files that exist. A folder holding only LightningCLI's
        config.yaml is no run: a fit that stopped at start (a bad config, an engine that did not start) wrote it."""
        def holds(d: Path) -> bool:
            return d.is_dir() and any(p.name != "config.yaml" for p in d.iterdir())
        return [d for d in self.folders if holds(d)] + [f for f in self.files if f.exists()]

    def unowned(self) -> list[Path]:
        """What `held` finds that no lit-ess fit wrote: a folder the MARKER file (written by every fit into
        output_dir, naming the folders it writes) does not list. --overwrite removes nothing when there is one."""
        marker = self.output_dir / MARKER
        try:
            owned = set(json.loads(marker.read_text())["folders"]) if marker.is_file() else set()
        except (ValueError, KeyError, TypeError):
            owned = set()
        return [p for p in self.held() if p.is_dir() and str(p.relative_to(self.output_dir)) not in owned]

    def mark(self) -> None:
        """Say which folders of output_dir are this lit-ess run's (rank 0, once the run is allowed to start): those
        a later `fit --overwrite true` may remove. A folder named by an earlier fit stays named."""
        marker = self.output_dir / MARKER
        try:
            before = json.loads(marker.read_text())["folders"] if marker.is_file() else []
        except (ValueError, KeyError, TypeError):
            before = []
        folders = sorted(set(before) | {str(p.relative_to(self.output_dir)) for p in self.folders})
        self.output_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"written_by": "lit-ess fit", "folders": folders}) + "\n")

    def clear(self) -> list[Path]:
        """Remove what `held` finds; return it."""
        found = self.held()
        for p in found:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        return found


def run_of(trainer, output_dir: str) -> Run:
    """The folders `trainer` writes to that lie inside `output_dir` (its checkpoint, log and export folders,
    whether they follow output_dir or the config put them there), and the hpc checkpoints in its
    default_root_dir when that is output_dir. A folder outside output_dir, or output_dir itself, is not one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_ess.callbacks import ExportHF

    out = Path(output_dir).resolve()
    paths = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, (ModelCheckpoint, ExportHF)) and cb.dirpath]
    for lg in trainer.loggers:
        paths.append(getattr(lg, "log_dir", None) or getattr(lg, "save_dir", None))
    inside = []
    for p in paths:
        if p and "://" not in str(p):
            full = Path(p).resolve()
            if full != out and full.is_relative_to(out) and full not in inside:
                inside.append(full)
    # nested folders (logs/ and logs/wandb): the outermost is enough
    folders = [p for p in inside if not any(q != p and p.is_relative_to(q) for q in inside)]
    root = Path(trainer.default_root_dir).resolve()
    files = sorted(root.glob("hpc_ckpt_*.ckpt")) if root == out else []
    return Run(out, folders, files)


def refusal(output_dir: str) -> str:
    """The one line for a second `fit` into a folder that holds a run."""
    return (f"output_dir {output_dir} already holds a run: resume it with --ckpt_path last, or start over with "
            f"--overwrite true (removes its {CHECKPOINTS}, {LOGS} and {MODEL})")
