"""The cost of the trainer's proximal logprobs (PolicyModule.score_phase), a ratio within this run.

Per optimizer step, DecoupledPPO in a Lightning Trainer on the tiny model, with the proximal policy
recomputed once per phase (the phase's first batch is marked, its k - 1 waiting batches get one no-grad
forward each) against a shortcut (every batch its own proximal policy,
lp.detach(): no forward), at steps_per_rollout k = 1 and 4. The same rows per step in both arms
(--rows rows of --prompt_tokens + --new_tokens tokens). Expected: no cost at k = 1; at k = 4 three
forwards without autograd per four steps.

A step is timed from `on_train_batch_start` (before the module scores) to `on_train_batch_end`, in
wall seconds and in this process's CPU seconds (one torch thread by default: on a machine shared with
other work, CPU seconds are the work done and wall seconds also count the waits for a core). The cost
is the ratio of mean step times over whole phases (a median would hide the phase's first step, which
carries the scoring). The arms alternate over --rounds rounds, the first phase of each run dropped
(warm-up), so slow phases of the machine hit both alike.

    .venv/bin/python benchmarks/proximal.py [--steps 16 --rounds 2] [--out benchmarks/results/proximal.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_ess.sampling import SamplingConfig
from lit_ess.module import PolicyModule
from lit_ess.objectives import DecoupledPPO
from lit_ess.batch import Proximal, RolloutBatch
from lit_ess.tiny import build_tiny_model


def make_batch(vocab: int, rows: int, prompt: int, new: int, phase: int, index: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, prompt + new), generator=g)
    comp = torch.zeros(rows, prompt + new, dtype=torch.bool)
    comp[:, prompt:] = True
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=comp,
                        behavior_logprobs=torch.where(comp, -torch.rand(rows, prompt + new, generator=g) * 5, 0.0),
                        advantages=torch.randn(rows, generator=g), rewards=torch.zeros(rows),
                        versions=torch.zeros(rows, dtype=torch.long), prompt_ids=torch.arange(rows),
                        sampling=SamplingConfig(max_new_tokens=new),
                        stats={"rollout/reward_mean": 0.0}, phase=phase, index=index, max_staleness=10**9)


class Phases(L.LightningDataModule):
    """Synthetic phases of k batches, served one per step with no prefetch (a loader of known length
    whose items are made when read); the module's data side (lit_ess.data.RolloutData) as RolloutDataModule
    is, with no engine to push weights to."""

    def __init__(self, k: int, steps: int, **shape):
        super().__init__()
        self.k, self.steps, self.shape, self.ready = k, steps, shape, {}

    def setup(self, stage: str) -> None:
        self.trainer.lightning_module.attach_rollouts(self)

    def waiting_batches(self, phase: int) -> list[RolloutBatch]:
        return list(self.ready.get(phase, []))

    def wants_weights(self, version: int) -> bool:
        return False

    def push_weights(self, named_tensors, version: int) -> None:
        pass

    def next_batch(self, i: int) -> RolloutBatch:
        p = i // self.k
        if p not in self.ready:
            self.ready[p] = [make_batch(phase=p, index=j, seed=i + j, **self.shape) for j in range(self.k)]
        return self.ready[p].pop(0)

    def train_dataloader(self):
        dm = self

        class Stream(IterableDataset):
            def __len__(self):
                return dm.steps

            def __iter__(self):
                return (dm.next_batch(i) for i in range(dm.steps))

        return DataLoader(Stream(), batch_size=None, collate_fn=lambda x: x)


class OwnProximal(L.Callback):
    """The shortcut: every batch is its own proximal policy (lp.detach()), no forward."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch.proximal = Proximal(trainer.global_step, "own_pass")


class Timed(PolicyModule):
    """PolicyModule keeping the seconds of its last phase's proximal scoring."""

    last_seconds = 0.0

    def score_phase(self, batch: RolloutBatch) -> float | None:
        seconds = super().score_phase(batch)
        if seconds is not None:
            self.last_seconds = seconds
        return seconds


class Timer(L.Callback):
    """(wall, CPU) seconds of each step."""

    def __init__(self):
        self.times = []

    def on_train_batch_start(self, *a):
        self.t0 = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, *a):
        self.times.append((time.perf_counter() - self.t0[0], time.process_time() - self.t0[1]))


def run(model_dir: str, k: int, steps: int, recompute: bool, shape: dict) -> tuple[list[tuple[float, float]], float]:
    """(wall, CPU) seconds of each step, the first phase dropped, and the last phase's scoring time."""
    timer, module = Timer(), Timed(model_dir, objective=DecoupledPPO(), lr=1e-5)
    callbacks = [timer] if recompute else [timer, OwnProximal()]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, Phases(k, steps, **shape))
    return timer.times[k:], module.last_seconds


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16, help="steps per run (a multiple of 4)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt_tokens", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=56)
    p.add_argument("--out", default="benchmarks/results/proximal.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shape = {"rows": a.rows, "prompt": a.prompt_tokens, "new": a.new_tokens}
    result = {"command": "python benchmarks/proximal.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": "tiny (build_tiny_model)", "objective": "DecoupledPPO", **shape, "steps": a.steps,
              "rounds": a.rounds, "torch_threads": torch.get_num_threads(), "results": {}}
    with tempfile.TemporaryDirectory() as d:
        model_dir = str(build_tiny_model(d + "/m"))
        shape["vocab"] = 260
        for k in (1, 4):
            times = {True: [], False: []}
            scoring = []
            for r in range(a.rounds):                 # alternate the order, so drift hits both arms alike
                for recompute in ((False, True) if r % 2 == 0 else (True, False)):
                    t, s = run(model_dir, k, a.steps, recompute, shape)
                    times[recompute] += t
                    if recompute:
                        scoring.append(s)
            out = {"steps_per_rollout": k, "steps_timed": len(times[True]),
                   "scoring_wall_s_per_phase": statistics.mean(scoring)}
            for i, clock in enumerate(("wall", "cpu")):
                on, off = (statistics.mean(t[i] for t in times[arm]) for arm in (True, False))
                out.update({f"recompute_{clock}_s": on, f"shortcut_{clock}_s": off, f"ratio_{clock}": on / off})
                print(f"steps_per_rollout {k}, {clock} seconds: mean step {on * 1e3:.1f} ms with the proximal "
                      f"recomputed ({k - 1} forwards per phase), {off * 1e3:.1f} ms without: ratio {on / off:.3f}")
            out["ratio"] = out["ratio_cpu"]
            result["results"][f"k{k}"] = out
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
