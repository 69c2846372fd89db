"""Helpers the benchmarks load into `lit-ess` runs by class path."""
from __future__ import annotations

import json
import time
from pathlib import Path

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


class TrainPeak:
    """Peak memory of a stretch of a process (CPU): RSS high-water mark from `start` (freed heap handed back
    to the OS first, then VmHWM reset to the current RSS by /proc/self/clear_refs 5) to `stop`, minus the
    RSS at `start`, in KiB: what the stretch's activations and gradients added."""

    def __init__(self):
        self.base = None

    def start(self) -> None:
        from benchmarks.memory import _release_freed, _status_kib

        _release_freed()
        Path("/proc/self/clear_refs").write_text("5")
        self.base = _status_kib("VmRSS")

    def stop(self) -> int:
        from benchmarks.memory import _status_kib

        return _status_kib("VmHWM") - self.base if self.base is not None else 0


class TrainingPhase(L.Callback):
    """What each step's training phase saw, written to `path` (JSON) at fit end: its peak memory
    (`TrainPeak`, from the batch's start to its end: forward, backward, optimizer) and the completion
    lengths of the batch. Place it before WeightSync (whose push after the step is not training)."""

    def __init__(self, path: str):
        self.path, self.peak, self.peaks, self.lengths = path, TrainPeak(), [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lengths.append(batch.completion_mask.sum(1).tolist())
        self.peak.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peaks.append(self.peak.stop())

    def on_fit_end(self, trainer, pl_module):
        if not trainer.global_rank:
            Path(self.path).write_text(json.dumps({"peak_kib": self.peaks, "lengths": self.lengths}))


def first_character(completion: str, answer: str) -> float:
    """The first character's code point modulo 10 (0 for an empty completion), whatever the answer: a group's
    samples rarely tie, and the completion's length does not count (under a length reward the tail shape's
    one stopping weight is trained away within a few steps)."""
    return float(ord(completion[0]) % 10) if completion else 0.0
