"""The rollout layer: the worker that turns prompts into scored, batched samples, the versioned buffer
the trainer reads from, and the worker's process for asynchronous training."""
from .batch import RolloutBatch, Row, collate
from .buffer import RolloutBuffer
from .process import WorkerError, WorkerProcess
from .worker import EvalRequest, PhaseResult, RolloutRequest, RolloutWorker, WorkerConfig

__all__ = ["EvalRequest", "PhaseResult", "RolloutBatch", "RolloutBuffer", "RolloutRequest", "RolloutWorker", "Row", "WorkerConfig",
           "WorkerError", "WorkerProcess", "collate"]
