"""The rollout protocol: how the data module talks to whatever generates its phases.

    executor.start()                               build the engine (or the process that holds it)
    executor.load_weights(named_tensors, version)  the weights of optimizer step `version`; every rank
                                                   consumes the iterator (FSDP2 gathers tensor by tensor)
    rid = executor.submit(kind, request)           "phase": a RolloutRequest (or, dedicated placement,
                                                   every rank's share), "evaluate": an EvalRequest;
                                                   generated with the newest weights loaded before it
    executor.poll(timeout) -> [(rid, result)]      finished requests, in submission order
    executor.restore(reward_counters)              a resumed run's reward counters
    executor.version                               the newest weights loaded (-1: none yet)
    executor.idle_seconds, executor.busy_seconds   the engine's clock
    executor.close()

Three executors speak it:
* `InlineExecutor` (mode: sync): the worker in the trainer's process runs each request when it is
  submitted; `poll` hands the results back. Generation blocks training.
* `lit_ess.rollout.process.WorkerProcess` (mode: async): the worker in its own process, generating
  while the trainer trains.
* `lit_ess.rollout.receiver.ShareReceiver` (mode: async, placement: dedicated, ranks > 0): no engine;
  it reads this rank's share of each phase from the one worker process that rank 0 runs.

The data module decides what to submit and when (the buffer's admission rule, lit_ess/rollout/buffer.py);
the executor decides only where the work runs.
"""
from __future__ import annotations

import time
from typing import Iterable, Protocol

from torch import Tensor

from .worker import RolloutWorker, WorkerConfig


class WorkerError(RuntimeError):
    """The process that generates rollouts failed, stalled or exited."""


class RolloutExecutor(Protocol):
    version: int
    idle_seconds: float
    busy_seconds: float

    def start(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...

    def submit(self, kind: str, payload) -> int: ...

    def poll(self, timeout: float) -> list[tuple[int, object]]: ...

    def restore(self, reward_counters: dict) -> None: ...

    def close(self, grace: float = 60.0) -> None: ...       # grace: seconds a worker may take to finish


class InlineExecutor:
    """A RolloutWorker in the trainer's process: `submit` generates and scores at once (with the
    weights the engine holds), `poll` returns what was done."""

    def __init__(self, config: WorkerConfig):
        self.config = config
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
        if reward_counters:
            self.worker.scorer.load_state_dict(reward_counters)

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
