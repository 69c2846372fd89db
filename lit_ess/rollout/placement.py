"""Where a rank's rollouts run: the executor for (mode, placement, ranks).

    sync                 InlineExecutor: the worker in the trainer's process
    async, colocated     WorkerProcess: a worker process per rank, on the rank's own GPU
    async, dedicated     rank 0's DedicatedWorker generates for every rank; the others' ShareReceiver reads
"""
from __future__ import annotations

import os

import torch

from lit_ess.engines.base import visible_devices

from .executor import InlineExecutor, RolloutExecutor
from .process import WorkerProcess
from .ranks import Ranks
from .receiver import dedicated_executor
from .worker import WorkerConfig


def placed(mode: str, placement: str, world: int) -> str:
    """The placement in force: "dedicated" (one worker, rank 0's, for every rank) is async on several ranks;
    otherwise each rank generates its own share ("colocated"), whatever the knob says."""
    return "dedicated" if mode == "async" and placement == "dedicated" and world > 1 else "colocated"


def build_executor(config: WorkerConfig, mode: str, placement: str, ranks: Ranks,
                   worker_timeout: float) -> RolloutExecutor:
    """This rank's executor (every rank calls it: the dedicated placement exchanges addresses). sync: the
    worker in this process; async colocated: a worker process per rank (on the rank's own GPU); async
    dedicated: rank 0's worker process generates for all, the other ranks receive."""
    if mode == "sync":
        return InlineExecutor(config, rank=ranks.rank)
    if placed(mode, placement, ranks.world) == "dedicated":
        return dedicated_executor(config, ranks, worker_timeout)
    own_devices = "CUDA_VISIBLE_DEVICES" in config.engine.worker_env()
    if ranks.world > 1 and own_devices:
        raise ValueError("engine.worker_devices with placement: colocated on several ranks would start every "
                         "rank's worker on the same devices: use placement: dedicated (one worker on those devices)")
    env = None
    if torch.cuda.is_available() and not own_devices:    # the rank's own GPU, not every worker on cuda:0
        env = {"CUDA_VISIBLE_DEVICES": visible_devices([torch.cuda.current_device()],
                                                       os.environ.get("CUDA_VISIBLE_DEVICES"))}
    return WorkerProcess(config, progress_timeout=worker_timeout, env=env, rank=ranks.rank)
