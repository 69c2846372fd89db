"""Where a rank's rollouts run: the executor for a Placement (mode, placement in force, ranks), and the engine it builds.

    sync                 InlineExecutor: the worker in the trainer's process
    async, colocated     WorkerProcess: a worker process per rank, its engine on the rank's own GPU
    async, dedicated     WorkerProcess per rank, each sending its own share to vLLM servers that generation
                         has to itself (VLLMServerConfig): servers by URL, or one that rank 0 launches on
                         engine.worker_devices

vLLM servers shared by several ranks (`urls` on W ranks, or the one server rank 0 launches under the
dedicated placement) take weights from rank 0 alone; the other ranks' engines (`FollowerConfig`) wait
until the servers carry the step their requests name.

The data module resolves its knobs into one `Placement` value in setup (`Placement.of`) and hands it on.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import uuid
from dataclasses import dataclass
from typing import Literal

import torch

from lit_ess.engines import EngineConfig, VLLMServerConfig
from lit_ess.engines.base import visible_devices
from lit_ess.engines.judge import RANK_DEVICE_ENV
from lit_ess.engines.server_launch import free_port
from lit_ess.engines.vllm_server import FollowerConfig, LeaderConfig

from .executor import InlineExecutor, RolloutExecutor
from .process import WorkerProcess
from .ranks import Ranks
from .worker import WorkerConfig


@dataclass(frozen=True)
class Placement:
    """Where a run's rollouts run, resolved once from the knobs (`of`): `mode` "sync" (in the trainer's process)
    or "async" (a worker process per rank); `where` the placement in force, "dedicated" (servers of their own,
    shared by every rank: async on several ranks) or "colocated" (each rank's engine its own, whatever the
    knob says otherwise); `world` the data-parallel ranks."""
    mode: Literal["sync", "async"]
    where: Literal["colocated", "dedicated"]
    world: int

    @classmethod
    def of(cls, mode: str, placement: str, world: int) -> Placement:
        return cls(mode, "dedicated" if mode == "async" and placement == "dedicated" and world > 1 else "colocated", world)

    @property
    def dedicated(self) -> bool:
        return self.where == "dedicated"

    def shares_servers(self, engine: EngineConfig) -> bool:
        """Whether the run's ranks share vLLM servers, rank 0 pushing the weights: servers by URL on several
        ranks, or the dedicated placement's one launched server."""
        return isinstance(engine, VLLMServerConfig) and self.world > 1 and (bool(engine.urls) or self.dedicated)


def engine_for_rank(engine: EngineConfig, place: Placement, ranks: Ranks) -> EngineConfig:
    """The engine config this rank builds (every rank calls it). Servers shared by the ranks: rank 0's a
    LeaderConfig of the user's (under the dedicated placement it launches the server, on a port all ranks
    agree on), the others' a FollowerConfig of the same servers."""
    if not place.shares_servers(engine):
        return engine
    urls = engine.urls
    if not urls:                                # dedicated: rank 0 launches it, on this node
        if len(set(ranks.all_gather(node_address()))) > 1:
            raise ValueError("data.schedule.placement: dedicated with a launched vLLM server: it listens on 127.0.0.1 of rank 0's "
                             "node, which ranks on other nodes cannot reach: start servers with `python -m "
                             "lit_ess.engines.serve` and list them in engine.urls")
        port = engine.port or free_port()               # rank 0's port and log, which every rank's errors name
        log = engine.log_file or os.path.join(tempfile.gettempdir(), f"lit-ess-vllm-server-{port}-{uuid.uuid4().hex[:6]}.log")
        port, log = ranks.all_gather((port, log))[0]
        urls = [f"http://127.0.0.1:{port}"]
        engine = dataclasses.replace(engine, port=port, log_file=log)
    fields = {f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)}
    if ranks.rank == 0:
        return LeaderConfig(**fields)
    return FollowerConfig(**{**fields, "urls": urls, "port": None, "server_args": [], "log_file": None,
                             "worker_devices": None}, exact=engine.exact_dtype(),
                          server_log=None if engine.urls else engine.log_file)


def build_executor(config: WorkerConfig, place: Placement, ranks: Ranks, worker_timeout: float) -> RolloutExecutor:
    """This rank's executor (every rank calls it: servers shared by the ranks are agreed on). sync: the
    worker in this process; async: a worker process per rank, its engine on the rank's own GPU (colocated)
    or the servers shared by every rank (dedicated)."""
    config = dataclasses.replace(config, engine=engine_for_rank(config.engine, place, ranks))
    if place.mode == "sync":
        return InlineExecutor(config)
    dedicated = place.dedicated
    own_devices = "CUDA_VISIBLE_DEVICES" in config.engine.worker_env()
    if ranks.world > 1 and own_devices and not dedicated:
        raise ValueError("data.engine.worker_devices with data.schedule.placement: colocated on several ranks would "
                         "start every rank's engine on the same devices: use placement: dedicated with engine: "
                         "lit_ess.engines.VLLMServerConfig (one server on those devices, shared by every rank)")
    env = None
    if torch.cuda.is_available():      # the rank's own GPU, not every worker on cuda:0; a launched judge's too
        mine = visible_devices([torch.cuda.current_device()], os.environ.get("CUDA_VISIBLE_DEVICES"))
        env = {RANK_DEVICE_ENV: mine, **({} if own_devices else {"CUDA_VISIBLE_DEVICES": mine})}
    if dedicated and not config.engine.urls:             # rank 0's server generates for every rank: their threads
        env = {**(env or {}), **dedicated_threads(ranks.world, config.engine.worker_env())}
    return WorkerProcess(config, progress_timeout=worker_timeout, env=env)


def dedicated_threads(world: int, engine_env: dict[str, str]) -> dict[str, str]:
    """On CPU cores the one server rank 0 launches generates what `world` ranks' engines would: it gets their
    threads, OMP_NUM_THREADS = world x this process's torch threads (with 1 thread per rank and 2 ranks, 2,
    not 1 thread for twice the work). None on GPUs (the server's devices are its own), nor where the engine
    config sets OMP_NUM_THREADS for its worker."""
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in engine_env:
        return {}
    return {"OMP_NUM_THREADS": str(world * torch.get_num_threads())}


def node_address() -> str:
    """This node's address as the other nodes reach it: the interface that routes to the process group's
    rendezvous host (MASTER_ADDR; no packet is sent), else the host name."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "1"))))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()
