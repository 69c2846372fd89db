"""How many project files one synchronous iteration on one rank passes through.

A short `fit` on the tiny model (sync mode, one rank, the demo's callbacks: WeightSync, RatioDashboard,
LogCompletions) with a profiler (sys.setprofile) switched on from the start of one training step to the
start of the next (the iteration after the first, so nothing is a warm-up): every Python call into a file
of this repository is recorded. Prints one JSON object: the files, and per file the distinct functions
called and the number of calls.

    PYTHONPATH=. .venv/bin/python scripts/trace_iteration.py [--engine HFConfig] [--objective DecoupledPPO
        --steps_per_rollout 2] [--callback CLASS_PATH] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="VLLMConfig", choices=["VLLMConfig", "HFConfig"])
    p.add_argument("--objective", default="P3O", help="a class of lit_ess.objectives, default settings")
    p.add_argument("--steps_per_rollout", type=int, default=1)
    p.add_argument("--step", type=int, default=1, help="the iteration traced: this step's start to the next one's")
    p.add_argument("--callback", action="append", default=[], help="an extra callback class path (no arguments)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)

    from lit_ess.console import quiet_console

    quiet_console()
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from lit_ess import engines, objectives
    from lit_ess.callbacks import LogCompletions, RatioDashboard, WeightSync
    from lit_ess.datamodules import Arithmetic, RolloutDataModule
    from lit_ess.module import PolicyModule
    from lit_ess.sampling import SamplingConfig
    from lit_ess.tiny import build_tiny_model

    calls: Counter = Counter()               # (file, function) -> calls

    def profile(frame, event, arg):
        if event == "call" and not frame.f_code.co_filename.startswith("<"):      # not <string>, <frozen ...>
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(str(ROOT) + os.sep) and path != os.path.realpath(__file__):
                calls[(os.path.relpath(path, ROOT), frame.f_code.co_qualname)] += 1

    class Trace(L.Callback):
        """Profiles from on_train_batch_start of step `args.step` to on_train_batch_start of the next (first
        in the callback list: before every other callback's hook of that step, after none)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == args.step:
                sys.setprofile(profile)
            elif trainer.global_step == args.step + 1:
                sys.setprofile(None)

    extra = []
    for path in args.callback:
        module, name = path.rsplit(".", 1)
        extra.append(getattr(importlib.import_module(module), name)())
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "model"))
        data = RolloutDataModule(model_path=model, engine=getattr(engines, args.engine)(),
                                 sampling=SamplingConfig(max_new_tokens=6, seed=0), source=Arithmetic(size=500),
                                 prompts_per_rollout=8, samples_per_prompt=4, steps_per_rollout=args.steps_per_rollout)
        module = PolicyModule(model, objective=getattr(objectives, args.objective)(), lr=1e-3)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.step + 2, log_every_n_steps=1,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            logger=TensorBoardLogger(tmp, name="tb"),
                            callbacks=[Trace(), WeightSync(), RatioDashboard(every_n_steps=1),
                                       LogCompletions(every_n_steps=1, max_rows=4), *extra])
        trainer.fit(module, data)
    sys.setprofile(None)

    files: dict[str, dict] = {}
    for (path, fn), n in sorted(calls.items()):
        f = files.setdefault(path, {"functions": 0, "calls": 0})
        f["functions"] += 1
        f["calls"] += n
    out = {"engine": args.engine, "objective": args.objective, "steps_per_rollout": args.steps_per_rollout,
           "callbacks": args.callback, "files": len(files), "functions": len(calls), "calls": sum(calls.values()),
           "per_file": files}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
