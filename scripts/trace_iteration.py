"""How many project files one synchronous iteration on one rank passes through.

A short `fit` on the tiny model (sync mode, one rank, the demo's callbacks: WeightSync, RatioDashboard,
LogCompletions) with a profiler (sys.setprofile) switched on from the start of one training step to the
start of the next (the iteration after the first, so nothing is a warm-up): every Python call into a file
of this repository is recorded. Prints one JSON object: the files, and per file the distinct functions
called and the number of calls; and the weight push of that iteration (`push`):

    decision   the project functions on the stack when the data side is asked (`wants_weights`),
               outermost first
    load       the project functions on the stack when an engine's `load_weights` is called
    chain      the decision's stack, then the load's: one list when both run under the same hook (the
               load's stack), else joined by "(state between hooks)" (the decision is kept for a later hook)
    hand_offs  len(chain) - 1: the calls (and the state) the decision passes through to reach the engine

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
from lit_ess.datamodules.settings import BatchShape
from lit_ess.settings import Optim

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
    decisions: list[list[str]] = []          # project stacks at the data side's answer (wants_weights)
    loads: list[tuple[int, list[str]]] = []  # project stacks at an engine's load_weights (and the decisions before)

    def project(frame) -> tuple[str, str] | None:
        """(file, function) of a frame in this repository (not this script), else None."""
        if frame.f_code.co_filename.startswith("<"):                               # not <string>, <frozen ...>
            return None
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(str(ROOT) + os.sep) and path != os.path.realpath(__file__):
            return os.path.relpath(path, ROOT), frame.f_code.co_qualname
        return None

    def stack(frame) -> list[str]:
        """The project functions on the stack of `frame`, outermost first, as "file:function"."""
        out = []
        while frame is not None:
            if (key := project(frame)) is not None:
                out.append(":".join(key))
            frame = frame.f_back
        return out[::-1]

    def profile(frame, event, arg):
        if event == "call" and (key := project(frame)) is not None:
            calls[key] += 1
            fn = key[1].rsplit(".", 1)[-1]
            if fn == "wants_weights":
                decisions.append(stack(frame))
            elif fn == "load_weights" and key[0].startswith("lit_ess/engines/"):
                st = stack(frame)
                if sum(f.startswith("lit_ess/engines/") and f.endswith(".load_weights") for f in st) == 1:
                    loads.append((len(decisions), st))   # the outermost engine load (not one engine's load calling another)

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
                                 batch=BatchShape(prompts_per_rollout=8, samples_per_prompt=4, steps_per_rollout=args.steps_per_rollout))
        module = PolicyModule(model, objective=getattr(objectives, args.objective)(), optim=Optim(lr=1e-3))
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
           "per_file": files, "push": push_chain(decisions, loads)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


def push_chain(decisions: list[list[str]], loads: list[tuple[int, list[str]]]) -> dict | None:
    """The iteration's weight push: the last decision taken before the (one) engine load, the load's stack, the chain
    from one to the other and its hand-offs. None when the iteration pushed nothing."""
    if not loads:
        return None
    if len(loads) > 1:
        raise RuntimeError(f"{len(loads)} engine loads in one iteration: {loads}")
    before, load = loads[0]
    decision = decisions[before - 1] if before else []
    if decision and decision[0] == load[0]:         # decided and pushed under the same hook
        chain = load
    else:
        chain = decision + ["(state between hooks)"] + load
    return {"decision": decision, "load": load, "chain": chain, "hand_offs": len(chain) - 1,
            "files": sorted({f.split(":")[0] for f in chain if ":" in f})}


if __name__ == "__main__":
    main()
