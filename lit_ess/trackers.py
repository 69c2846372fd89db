"""Trackers: lit-ess's histograms, chart layout and completion tables, on whichever Lightning loggers a run has.

Scalars need nothing from here: PolicyModule._log_step calls `log_metrics` on every logger of the trainer.
What Lightning has no common call for goes through this module, one branch per kind of logger:

- TensorBoard (the default): histograms, the custom-scalars layout, the completions table as markdown in
  the Text tab.
- W&B (`WandbLogger`): a `wandb.Histogram` and a `wandb.Table` under the same keys. No layout: W&B groups
  charts by the prefix before '/'.
- MLflow (`MLFlowLogger`): no histograms, so each is logged as its p05/p50/p95 scalars
  (`ratio/log_ratio/p50`); the table as a JSON artifact `completions/step_000001.json` in MLflow's table
  format (`{"columns": [...], "data": [[...], ...]}`).
- Any other logger (e.g. CSVLogger): the quantile scalars; no table.

A logger that cannot show something that the run's callbacks write says so in one line at fit start
(rank 0, once per fit): nothing disappears silently. The callers write on rank 0 only (the loggers'
experiments are dummies elsewhere).
"""
from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

QUANTILES = (0.05, 0.5, 0.95)

# what a logger shows natively; the callbacks declare what they write in a class attribute `writes`
NATIVE = {TensorBoardLogger: {"histograms", "layout", "tables"}, WandbLogger: {"histograms", "tables"},
          MLFlowLogger: {"tables"}}
INSTEAD = {"histograms": "histograms are logged as their p05/p50/p95 scalars (e.g. ratio/log_ratio/p50)",
           "layout": "its charts are grouped by the prefix before '/' only",
           "tables": "completion tables are not logged to it"}
NAMES = {"histograms": "histograms", "layout": "custom-scalars layout", "tables": "tables"}

_announced: weakref.WeakSet = weakref.WeakSet()


def _native(lg: Logger) -> set[str]:
    return next((kinds for cls, kinds in NATIVE.items() if isinstance(lg, cls)), set())


def notices(trainer: L.Trainer) -> list[str]:
    """One line per logger that cannot show something the trainer's callbacks write, saying what it gets instead."""
    wanted = {w for cb in trainer.callbacks for w in getattr(cb, "writes", ())}
    lines = []
    for lg in trainer.loggers:
        missing = [w for w in ("histograms", "layout", "tables") if w in wanted and w not in _native(lg)]
        if missing:
            names = [NAMES[w] for w in missing]
            what = " or ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " or " + names[-1]
            lines.append(f"lit-ess: {type(lg).__name__} has no {what}: "
                         + "; ".join(INSTEAD[w] for w in missing))
    return lines


def announce(trainer: L.Trainer) -> None:
    """Print `notices` on rank 0, once per trainer (every lit-ess callback that writes calls this at fit start)."""
    if trainer.is_global_zero and trainer not in _announced:
        _announced.add(trainer)
        for line in notices(trainer):
            print(line, file=sys.stderr)


def log_layout(trainer: L.Trainer, layout: dict) -> None:
    """TensorBoard's custom-scalars layout, on the TensorBoard loggers (the others group charts by prefix)."""
    for lg in trainer.loggers:
        if isinstance(lg, TensorBoardLogger):
            lg.experiment.add_custom_scalars(layout)


def log_histogram(trainer: L.Trainer, name: str, values: torch.Tensor, step: int) -> None:
    """A histogram of `values` (1-D, non-empty) on every logger: native where it has them, else quantile scalars."""
    quantiles = None
    for lg in trainer.loggers:
        if isinstance(lg, TensorBoardLogger):
            lg.experiment.add_histogram(name, values, step)
        elif isinstance(lg, WandbLogger):
            import numpy as np
            import wandb

            # binned here in float64: W&B bins in the values' dtype and refuses float32 values a few ulps apart
            counts = np.histogram(values.double().numpy(), bins=64)
            lg.log_metrics({name: wandb.Histogram(np_histogram=counts)}, step=step)
        else:
            if quantiles is None:
                q = torch.quantile(values.float(), torch.tensor(QUANTILES))
                quantiles = {f"{name}/p{round(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)}
            lg.log_metrics(quantiles, step=step)


def log_table(trainer: L.Trainer, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int,
              markdown: str) -> None:
    """A table on every logger that can hold one: `markdown` (the same table, formatted) in TensorBoard's Text
    tab, a wandb.Table on W&B, a JSON artifact `KEY/step_NNNNNN.json` on MLflow."""
    for lg in trainer.loggers:
        if isinstance(lg, TensorBoardLogger):
            lg.experiment.add_text(key, markdown, step)
        elif isinstance(lg, WandbLogger):
            lg.log_table(key, columns=list(columns), data=[list(r) for r in rows], step=step)
        elif isinstance(lg, MLFlowLogger):
            lg.experiment.log_dict(lg.run_id, {"columns": list(columns), "data": [list(r) for r in rows]},
                                   f"{key}/step_{step:06d}.json")
