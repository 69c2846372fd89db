"""The rollout layer: the worker that turns prompts into scored, batched samples, the versioned buffer
the trainer reads from, and the worker's process for asynchronous training."""
from .batch import Proximal, RolloutBatch, Row, collate
from .buffer import RolloutBuffer
from .dapo import DynamicSampling, OverlongPenalty, PhaseFill, overlong_penalty
from .data import RolloutConsumer, RolloutData
from .executor import InlineExecutor, RolloutExecutor, WorkerError
from .placement import build_executor, placed, shares_servers
from .process import WorkerProcess
from .ranks import RankFailed, Ranks, TorchRanks, in_step
from .worker import EvalRequest, PhaseResult, RolloutRequest, RolloutWorker, WorkerConfig

__all__ = ["DynamicSampling", "OverlongPenalty", "PhaseFill", "overlong_penalty", "EvalRequest", "InlineExecutor", "RankFailed", "Ranks", "RolloutExecutor",
           "TorchRanks", "build_executor", "in_step", "placed", "shares_servers", "PhaseResult", "Proximal",
           "RolloutBatch", "RolloutBuffer", "RolloutConsumer", "RolloutData", "RolloutRequest", "RolloutWorker", "Row",
           "WorkerConfig", "WorkerError", "WorkerProcess", "collate"]
