"""The rollout protocol: how the data module talks to whatever generates its phases.

    executor = build_executor(config, mode, placement, ranks, worker_timeout)   on every rank, in setup
    executor.start()                               build the engine (or the process that holds it)
    executor.ready() -> bool                       whether the engine is built (waits up to a second; raises
                                                   the worker's error): ranks that share servers wait for
                                                   every rank's before the first push
    executor.load_weights(named_tensors, version)  the weights of optimizer step `version`; every rank
                                                   consumes the iterator (FSDP2 gathers tensor by tensor)
    rid = executor.submit(request)                 a RolloutRequest (this rank's share of a phase's prompts)
                                                   or an EvalRequest (its held-out prompts; every rank
                                                   evaluates equally often); generated with the newest
                                                   weights loaded before it
    executor.poll(timeout) -> [(rid, result)]      finished requests, in submission order: a PhaseResult
                                                   for a RolloutRequest, an EvalResult for an EvalRequest
    executor.restore(reward_counters)              a resumed run's failure counters (RolloutWorker.counters:
                                                   the reward scorer's and the environment's)
    executor.version                               the newest weights loaded (-1: none yet)
    executor.updates_in_flight                     the engine takes pushes while it generates (the
                                                   trainer then pushes while phases are in flight)
    executor.idle_seconds, executor.busy_seconds   the engine's clock
    executor.close()

Where the work runs is the executor's business (the placement, lit_ess/rollout/placement.py); the data
module decides what to submit and when (the buffer's admission rule, lit_ess/rollout/buffer.py), the same
way on every rank: each rank submits its own share and evaluates its own held-out prompts, with
`InlineExecutor` (sync: the worker in the trainer's process, generation blocks training; weights go
straight to its engine) or `lit_ess.rollout.process.WorkerProcess` (async: the worker in its own process,
whose engine may be vLLM servers shared by every rank; weights travel by a transport, transport.py).
"""
from __future__ import annotations

import time
from typing import Iterable, Protocol

from torch import Tensor

from lit_ess.batch import EvalResult

from .worker import EvalRequest, PhaseResult, RolloutRequest, RolloutWorker, WorkerConfig


class WorkerError(RuntimeError):
    """The process that generates rollouts failed, stalled or exited."""


def check_request(request) -> None:
    """What `submit` takes: a RolloutRequest or an EvalRequest (one line naming anything else)."""
    if not isinstance(request, (RolloutRequest, EvalRequest)):
        raise TypeError(f"submit takes a RolloutRequest or an EvalRequest, not {type(request).__name__}")


class RolloutExecutor(Protocol):
    version: int
    updates_in_flight: bool
    idle_seconds: float
    busy_seconds: float

    def start(self) -> None: ...

    def ready(self) -> bool: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...

    def submit(self, request: RolloutRequest | EvalRequest) -> int: ...

    def poll(self, timeout: float) -> list[tuple[int, PhaseResult | EvalResult]]: ...

    def restore(self, reward_counters: dict) -> None: ...

    def close(self, grace: float = 60.0) -> None: ...       # grace: seconds a worker may take to finish


class InlineExecutor:
    """A RolloutWorker in the trainer's process: `submit` generates and scores at once (with the
    weights the engine holds), `poll` returns what was done; `load_weights` hands the trainer's tensors
    to the engine, unconsumed (FSDP2 gathers tensor by tensor as the engine loads; no copy, no transport)."""
    updates_in_flight = False

    def __init__(self, config: WorkerConfig):
        config.engine.weight_transfer(in_process=True)       # refuses what needs the worker process: fails fast
        self.config = config
        self.worker: RolloutWorker | None = None
        self.done: list[tuple[int, PhaseResult | EvalResult]] = []
        self.next_id = 0
        self.idle_seconds = self.busy_seconds = 0.0

    def start(self) -> None:
        worker = RolloutWorker(self.config)
        try:
            worker.warm_up()
        except BaseException:
            worker.close()                     # the engine and the reward worker with it
            raise
        self.worker = worker

    def ready(self) -> bool:
        return self.worker is not None

    @property
    def version(self) -> int:
        return self.worker.version

    def load_weights(self, named_tensors, version: int) -> None:
        self.worker.engine.load_weights(named_tensors, version)

    def restore(self, reward_counters: dict) -> None:
        self.worker.load_counters(reward_counters)

    def submit(self, request: RolloutRequest | EvalRequest) -> int:
        check_request(request)
        rid, self.next_id = self.next_id, self.next_id + 1
        t0 = time.perf_counter()
        result = self.worker.run(request) if isinstance(request, RolloutRequest) else self.worker.evaluate(request)
        self.busy_seconds += time.perf_counter() - t0
        self.done.append((rid, result))
        return rid

    def poll(self, timeout: float) -> list[tuple[int, PhaseResult | EvalResult]]:
        out, self.done = self.done, []
        return out

    def close(self, grace: float = 60.0) -> None:
        if self.worker is not None:
            self.worker.close()
