"""The rollout protocol: how the data module talks to whatever generates its phases.

    executor = build_executor(config, mode, placement, ranks, worker_timeout)   on every rank, in setup
    executor.start()                               build the engine (or the process that holds it)
    executor.load_weights(named_tensors, version)  the weights of optimizer step `version`; every rank
                                                   consumes the iterator (FSDP2 gathers tensor by tensor)
    executor.plans                                 this rank plans and submits phases
    request = executor.phase_request(phase, shares)  what this rank submits for a phase, from every rank's
                                                   share of its prompts (shares[r]: rank r's)
    rid = executor.submit(kind, request)           "phase": that request; "evaluate": this rank's EvalRequest
                                                   (every rank evaluates equally often); generated with the
                                                   newest weights loaded before it
    executor.poll(timeout) -> [(rid, result)]      finished requests, in submission order: a PhaseResult,
                                                   or an evaluation's {"reward": [P, n], "length": [P, n]}
    executor.drain() -> [(rid, result)]            before a checkpoint (every rank): results every rank must
                                                   have read, so that the ranks' checkpoints agree
    executor.restore(reward_counters)              a resumed run's failure counters (RolloutWorker.counters:
                                                   the reward scorer's and the environment's)
    executor.version                               the newest weights loaded (-1: none yet)
    executor.updates_in_flight                     the engine takes pushes while it generates (the
                                                   trainer then pushes while phases are in flight)
    executor.idle_seconds, executor.busy_seconds   the engine's clock
    executor.close()

Where the work runs is the executor's business (the placement); the data module decides what to submit
and when (the buffer's admission rule, lit_ess/rollout/buffer.py), the same way under every placement.
* colocated (mode: sync, or async on each rank): each rank's engine generates that rank's share and
  evaluates its held-out prompts; `InlineExecutor` (sync: the worker in the trainer's process, generation
  blocks training) or `lit_ess.rollout.process.WorkerProcess` (async: the worker in its own process).
* dedicated (async on several ranks, lit_ess/rollout/receiver.py): rank 0's `DedicatedWorker` generates
  every rank's share of a phase in one engine call and sends each rank its own; the other ranks'
  `ShareReceiver`s have no engine and plan nothing.
"""
from __future__ import annotations

import time
from typing import Iterable, Protocol

from torch import Tensor

from .worker import PhaseShares, RolloutRequest, RolloutWorker, WorkerConfig


class WorkerError(RuntimeError):
    """The process that generates rollouts failed, stalled or exited."""


class RolloutExecutor(Protocol):
    plans: bool
    version: int
    updates_in_flight: bool
    idle_seconds: float
    busy_seconds: float

    def start(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...

    def phase_request(self, phase: int, shares: list[RolloutRequest]) -> RolloutRequest | PhaseShares: ...

    def submit(self, kind: str, payload) -> int: ...

    def poll(self, timeout: float) -> list[tuple[int, object]]: ...

    def drain(self) -> list[tuple[int, object]]: ...

    def restore(self, reward_counters: dict) -> None: ...

    def close(self, grace: float = 60.0) -> None: ...       # grace: seconds a worker may take to finish


class OwnShare:
    """The colocated placement's part of the protocol: this rank plans its phases and submits its own
    share; nothing is read on another rank's behalf, so there is nothing to drain."""
    plans = True
    rank = 0
    updates_in_flight = False

    def phase_request(self, phase: int, shares: list[RolloutRequest]) -> RolloutRequest:
        return shares[self.rank]

    def drain(self) -> list[tuple[int, object]]:
        return []


class InlineExecutor(OwnShare):
    """A RolloutWorker in the trainer's process: `submit` generates and scores at once (with the
    weights the engine holds), `poll` returns what was done."""

    def __init__(self, config: WorkerConfig, rank: int = 0):
        self.config, self.rank = config, rank
        self.worker: RolloutWorker | None = None
        self.done: list[tuple[int, object]] = []
        self.next_id = 0
        self.idle_seconds = self.busy_seconds = 0.0

    def start(self) -> None:
        self.worker = RolloutWorker(self.config)

    @property
    def version(self) -> int:
        return self.worker.version

    def load_weights(self, named_tensors, version: int) -> None:
        self.worker.load_weights(named_tensors, version)

    def restore(self, reward_counters: dict) -> None:
        self.worker.load_counters(reward_counters)

    def submit(self, kind: str, payload) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        t0 = time.perf_counter()
        result = self.worker.run(payload) if kind == "phase" else self.worker.evaluate(payload)
        self.busy_seconds += time.perf_counter() - t0
        self.done.append((rid, result))
        return rid

    def poll(self, timeout: float) -> list[tuple[int, object]]:
        out, self.done = self.done, []
        return out

    def close(self, grace: float = 60.0) -> None:
        if self.worker is not None:
            self.worker.close()
