"""Helpers the benchmarks load into `lit-ess` runs by class path."""
from __future__ import annotations

import json
import time

import lightning as L


class StepTimes(L.Callback):
    """Writes the wall-clock time at the end of every optimizer step to `path` (JSON list), at fit end;
    with `cpu_path`, the process's CPU time (all its threads) at the same moments: on a machine shared
    with other jobs, CPU seconds per step measure the work done, wall seconds also the waiting."""

    def __init__(self, path: str, cpu_path: str | None = None):
        self.path, self.cpu_path, self.times, self.cpu = path, cpu_path, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank:                     # several ranks: rank 0's clock
            return
        with open(self.path, "w") as f:
            json.dump(self.times, f)
        if self.cpu_path:
            with open(self.cpu_path, "w") as f:
                json.dump(self.cpu, f)


def waiting_exact_match(completion: str, answer: str, wait: float = 0.002) -> float:
    """exact_match behind a verifier that takes `wait` seconds to answer (a remote sandbox or judge):
    latency, not computation."""
    time.sleep(wait)
    return float(completion.strip() == str(answer).strip())


def completion_length(completion: str, answer: str) -> float:
    """The completion's length in characters, whatever the answer: a reward under which a group of
    samples almost never ties (a random byte-level model's texts differ in length, replacement
    characters included), and which does not shorten completions."""
    return float(len(completion))
