"""The rollout layer: the worker that turns prompts into scored, batched samples, the versioned buffer
the trainer reads from, and the worker's process for asynchronous training. The batches it makes are
lit_ess.batch's RolloutBatch; the trainer sees this layer only through lit_ess.data's Protocols."""
from .buffer import RolloutBuffer
from .dapo import DynamicSampling, OverlongPenalty, PhaseFill, overlong_penalty
from .executor import InlineExecutor, RolloutExecutor, WorkerError
from .placement import Placement, build_executor
from .process import WorkerProcess
from .ranks import RankFailed, Ranks, TorchRanks, in_step
from .worker import EvalRequest, PhaseResult, RolloutRequest, RolloutWorker, WorkerConfig

__all__ = ["DynamicSampling", "EvalRequest", "InlineExecutor", "OverlongPenalty", "PhaseFill", "RankFailed", "Ranks",
           "RolloutExecutor", "TorchRanks", "build_executor", "in_step", "overlong_penalty", "Placement",
           "PhaseResult", "RolloutBuffer", "RolloutRequest", "RolloutWorker", "WorkerConfig", "WorkerError",
           "WorkerProcess"]
