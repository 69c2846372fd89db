"""vLLM's own OpenAI server as the rollout engine: one or more servers by URL, or one launched here.

Token ids in, token ids out: each prompt's group of n samples is one `POST /inference/v1/generate`
with `n` and the group's derived seed (vLLM seeds sample j with it + j; the in-process engine asks the
same, so both draw the same tokens), sent concurrently from a background event loop over a pool of
kept-alive connections and spread over the servers by least outstanding requests. (The token route
takes one prompt a request; a batched /v1/completions call takes one seed for all its prompts and
returns copies for repeated prompts.) A response carries
the sampled ids, vLLM's *processed* logprob of each (what it sampled from: pi_b) and the weight-version
spans of its tokens: each token's behaviour version (`Completion.token_versions`); a completion's
version is the oldest span's label.

Weights (CPU path, and wherever NCCL is not there): the trainer's tensors are written as safetensors
into a folder the servers can read (written under a temporary name, then renamed), and every server

    POST /pause?mode=wait        finish what runs, hold new requests         (weight_update: drain)
         /pause?mode=keep        freeze what runs where it is                 (weight_update: in_flight)
    POST /collective_rpc         {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /update_weight_version  {"new_version": "<optimizer step>"}
    POST /reset_prefix_cache     body {"success": true} checked: no KV entry of the old weights is reused
                                 (in_flight: ?reset_running_requests=true, the frozen requests are
                                 preempted and their prefix recomputed with the new weights on resume)
    POST /resume                 always (finally)
    GET  /weight_info            the label must now be the pushed version

In flight, a request frozen after t tokens goes on with the new weights: its spans say which tokens
each version sampled, and the logprob of every token is the one it was sampled with (its own pi_b).

LoRA adapters pushed alone (model.lora.sync: adapter, `max_lora_rank` set): the base weights never
change; each push is written as a peft folder and loaded as a new adapter (`lit-ess-<run>-a<n>`),

    POST /v1/load_lora_adapter   {"lora_name": "lit-ess-<run>-a<n>", "lora_path": DIR}   (vLLM loads it)

and from then on every request names it (`"model": ...`). A request samples with one adapter from its
start to its end, so its tokens' version is the adapter's it named (the spans label base weights); the
adapter before is unloaded at the next push, once no request can name it, and the last ones at close.

The dev routes need `VLLM_SERVER_DEV_MODE=1`, the token route `--enable-scale-out`; both are checked at
start, with the vLLM version, processed logprobs, the dtype and the model (`server_launch.model_fingerprint`),
and a server that fails a check is refused with the flag to add. The dev routes are not guarded by
`--api-key`; every server lit-ess starts runs lit_ess/engines/guard.py's middleware: with
LIT_ESS_SERVER_TOKEN set (required on a non-loopback host) every route but /health wants that token,
which this client sends. A launched server listens on 127.0.0.1, on a port checked free, and its
readiness check reads back the id it was launched with: no other process is taken for it
(lit_ess/engines/server_launch.py).

Faults: a server that refuses connections, resets them, gives no answer within its timeout
(startup_timeout for a server by URL's first answer, request_timeout for generation and a drain's pause,
control_timeout for the rest; the error names the knob), or answers HTTP 5xx is out of the run (ServerGone): the
request goes again, with its seed, to the server with the fewest outstanding requests among the
others, and weight pushes skip it. A server out that answers GET /health again (the heartbeat asks) is
taken back in the background once the start checks pass, the last pushed weights are loaded and its label
is the run's, while the run goes on (lit_ess/engines/server_pool.py). When none is left the call fails with
one line naming the URL, the request, the servers out before it and, for a launched server, its exit code
and log (an EngineFault: the CLI prints that line).

A server for other machines: `python -m lit_ess.engines.serve --model DIR --port P` (lit_ess/engines/serve.py).

This file holds the engine and its configs; launching a server is lit_ess/engines/server_launch.py, and the
HTTP client the engine sends every call through (calls, failover, heartbeat, take-back) is
lit_ess/engines/server_pool.py, which asks the engine what it needs through `PoolOwner`.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch
from torch import Tensor

from ..knobs import check
from ..lora import is_adapter_payload
from ..sampling import Completion, SamplingConfig, group_seed
from .base import EngineConfig, RolloutEngine, WeightTransfer, capped_limit, devices_env
from .server_launch import LaunchedServer, free_port, launch, same_model, served_model_name
from .server_pool import VLLM_SERIES, PoolOwner, ServerError, ServerGone, ServerPool
from .vllm_engine import LORA_RANKS, adapter_root, lora_dtype_error, remove_orphan_adapter_dirs

WEIGHTS_PREFIX = "lit-ess-weights-"


@dataclass
class VLLMServerConfig(EngineConfig):
    """vLLM's own server (`vllm.entrypoints.openai.api_server`): servers by URL, or one launched here.

    Args:
        urls: base URLs of running servers (`http://host:port`), each started with the flags of
            `python -m lit_ess.engines.serve` (the same model folder, dev mode, scale-out
            routes, processed logprobs). None or [] = launch one server on this machine.
        dtype: the servers' precision: float32, bfloat16, float16 or auto. Launched servers get it as
            --dtype; servers by URL must run it (checked at start).
        max_model_len: longest prompt + completion: a launched server's --max-model-len; servers by URL
            must take at least this many tokens (checked at start). None = the model's.
        gpu_memory_utilization: launched server: share of device memory (of RAM on CPU) vLLM may take;
            None = 0.1 on CPU, 0.4 on CUDA (as the in-process engine).
        kv_cache_gib: launched server on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).
        enforce_eager: launched server: no CUDA graphs / compilation (faster start).
        seed: launched server: the engine's own seed, an integer >= 0 (each request also gets a derived seed).
        port: launched server: its port on 127.0.0.1, which must be free (a port another process holds is
            refused, naming that process); None = a free one.
        server_args: launched server: more command-line flags, as they are (e.g. ["--max-num-seqs", "512"]).
        log_file: launched server: where its output goes; None = a file in the temp folder. Every error
            names it.
        startup_timeout: seconds to wait for a launched server's /health (start-up takes 60-140 s on
            CPU) and for a server by URL to answer at all.
        request_timeout: seconds one generate request may take before the call fails.
        heartbeat_seconds: while requests are in flight, each server's GET /health every this many seconds:
            a server that does not answer it within heartbeat_timeout (stopped, hung, cut off) is out of the
            run at once, and its requests go to the others, instead of after request_timeout. A server out of the
            run is asked the same: answering again, it is taken back (in the background) once it holds the run's
            weights (pushed again, label checked). None = off (and no server is taken back).
        heartbeat_timeout: seconds a server may take to answer GET /health.
        control_timeout: seconds one control call (reload, version, reset, resume; a pause of
            weight_update: in_flight; a drain's pause may take request_timeout) may take.
        max_concurrency: requests in flight over all servers at once (a request: one prompt's group of n samples).
        weights_dir: where pushed weights are written as safetensors; every server must read it at the
            same path (a shared filesystem for servers on other machines). None = a folder of this
            process in /dev/shm (memory), enough for servers on this machine.
        weight_update: how a server takes new weights. "drain": requests running finish with the old
            weights first (`/pause?mode=wait`), so every token of a completion has one version.
            "in_flight": running requests are frozen (`/pause?mode=keep`), the weights loaded, and they
            go on with the new ones: a completion may be sampled by several versions, each token's
            read from the server's spans (`rollout/multi_version_frac`, the `rollout/token_lag`
            histogram), its staleness its oldest token's. Needs data.schedule.mode: async (the trainer pushes
            while the worker generates; sync generates between steps).
        max_lora_rank: LoRA adapters up to this rank, pushed alone (model.lora.sync: adapter) and loaded
            through the servers' /v1/load_lora_adapter; at most 512. A launched server gets
            --enable-lora --max-lora-rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; servers by URL must
            have been started so (`serve --max-lora-rank`; checked at start). None = off (merged pushes).
            Needs weight_update: drain (an adapter is chosen per request, for its whole length).
        worker_devices: launched server, async mode: the GPUs it runs on (indices as the trainer's process
            numbers them, e.g. [4, 5, 6, 7]; add --tensor-parallel-size to server_args to use several).
            With placement: dedicated, rank 0 launches it there and every rank uses it. None = the rank's
            own devices (colocated; under placement: dedicated, rank 0's, beside its training). Needs
            CUDA: on a machine without it this is an error, not ignored. Async only.
    """

    urls: list[str] | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    seed: int = 0
    port: int | None = None
    server_args: list[str] = field(default_factory=list)
    log_file: str | None = None
    startup_timeout: float = 300.0
    request_timeout: float = 600.0
    control_timeout: float = 120.0
    heartbeat_seconds: float | None = 5.0
    heartbeat_timeout: float = 30.0
    max_concurrency: int = 512
    weights_dir: str | None = None
    weight_update: Literal["drain", "in_flight"] = "drain"
    max_lora_rank: int | None = None
    worker_devices: list[int] | None = None

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype={self.dtype!r} is not one of ('float32', 'bfloat16', 'float16', 'auto')")
        for url in self.urls or []:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"urls: {url!r} is not a base URL such as http://10.0.0.5:8000")
        if self.urls and len(set(self.urls)) != len(self.urls):
            raise ValueError(f"urls lists a server twice: {self.urls}")
        check("VLLMServerConfig.max_model_len", self.max_model_len, ge=2, integer=True, null=True)
        check("VLLMServerConfig.gpu_memory_utilization", self.gpu_memory_utilization, gt=0, le=1, null=True)
        check("VLLMServerConfig.kv_cache_gib", self.kv_cache_gib, gt=0)
        check("VLLMServerConfig.seed", self.seed, ge=0, integer=True)
        check("VLLMServerConfig.port", self.port, ge=1, le=65535, integer=True, null=True)
        if not all(isinstance(a, str) for a in self.server_args):
            raise ValueError(f"VLLMServerConfig.server_args must be strings (command-line flags), got {self.server_args}")
        check("VLLMServerConfig.heartbeat_seconds", self.heartbeat_seconds, gt=0, null=True, hint=" (seconds)")
        for knob in ("startup_timeout", "request_timeout", "control_timeout", "heartbeat_timeout"):
            check(f"VLLMServerConfig.{knob}", getattr(self, knob), gt=0, hint=" (seconds)")
        check("VLLMServerConfig.max_concurrency", self.max_concurrency, ge=1, integer=True)
        if self.weight_update not in ("drain", "in_flight"):
            raise ValueError(f"VLLMServerConfig.weight_update={self.weight_update!r} is not one of ('drain', 'in_flight')")
        check("VLLMServerConfig.max_lora_rank", self.max_lora_rank, ge=1, le=LORA_RANKS[-1], integer=True, null=True)
        if not self.urls and (error := lora_dtype_error(torch.cuda.is_available(), self.max_lora_rank, self.dtype)):
            raise ValueError(error)
        d = self.worker_devices
        if d is not None and (not d or len(set(d)) != len(d) or any(not isinstance(i, int) or i < 0 for i in d)):
            raise ValueError(f"VLLMServerConfig.worker_devices must be distinct device indices >= 0 (or null = the "
                             f"rank's own), got {d}")
        if self.urls and (self.port is not None or self.server_args or self.log_file or d is not None):
            raise ValueError("port, server_args, log_file and worker_devices set a launched server; with urls the "
                             "servers run elsewhere: start them with `python -m lit_ess.engines.serve`")

    def exact_dtype(self) -> str | None:
        if self.dtype == "auto" or any(a.split("=")[0] in ("--quantization", "-q", "--kv-cache-dtype")
                                       for a in self.server_args):
            return None
        return self.dtype          # processed logprobs and this dtype are checked on every server at start

    def model_len(self, model_path: str) -> tuple[int, str] | None:
        return capped_limit(self.max_model_len, model_path)

    def updates_in_flight(self) -> bool:
        return self.weight_update == "in_flight"

    def adapter_error(self, rank: int) -> str | None:
        if self.max_lora_rank is None:
            return ("model.lora.sync: adapter pushes adapters, but the servers are used without LoRA: set "
                    "data.engine.init_args.max_lora_rank to model.lora.rank or more")
        if rank > self.max_lora_rank:
            return (f"model.lora.rank={rank} is above data.engine.init_args.max_lora_rank={self.max_lora_rank}: "
                    f"raise it to model.lora.rank")
        if self.weight_update == "in_flight":
            return ("model.lora.sync: adapter with data.engine.init_args.weight_update: in_flight: a request samples "
                    "with the adapter it started with, so an update cannot reach it in flight: use weight_update: "
                    "drain, or model.lora.sync: merged")
        return None

    def worker_env(self) -> dict[str, str]:
        """The async worker process's environment, which the server it launches inherits: its GPUs."""
        return devices_env(self.worker_devices)

    def weight_transfer(self, in_process: bool) -> WeightTransfer:
        if in_process and self.worker_devices is not None:
            raise ValueError("engine.worker_devices places the launched server beside the async worker process: "
                             "set data.schedule.mode: async, or remove it")
        return super().weight_transfer(in_process)

    def lora_rank_flag(self) -> int | None:
        """--max-lora-rank of a launched server: vLLM 0.32 takes one of LORA_RANKS, the smallest that holds
        max_lora_rank."""
        return None if self.max_lora_rank is None else min(r for r in LORA_RANKS if r >= self.max_lora_rank)

    def build(self, model_path: str) -> "VLLMServerEngine":
        return VLLMServerEngine(model_path, self)


class LeaderConfig(VLLMServerConfig):
    """The engine of rank 0 when its servers are shared by several trainer ranks (`urls` on W ranks, or the
    dedicated placement's one server): it pushes for every rank, and at start labels every server "-1"
    (no step), so that the other ranks never take a label left by an earlier run for this run's weights.
    Made by the rollout layer (lit_ess/rollout/placement.py `engine_for_rank`), never in a config file."""

    def build(self, model_path: str) -> "VLLMServerEngine":
        return VLLMServerEngine(model_path, self, role="leads")


@dataclass
class FollowerConfig(VLLMServerConfig):
    """The engine of a trainer rank > 0 whose servers rank 0 pushes to (see LeaderConfig). It writes no
    weights: loading the weights of step v waits until every server carries v or newer (GET /weight_info),
    and a request's tokens are labelled by the spans as always. `exact`: rank 0's engine's exact_dtype
    (its server_args, e.g. a quantization, are not this config's); `server_log`: the log of the server rank 0
    launches (placement: dedicated), named in this rank's errors too. Made by the rollout layer, never in a
    config file."""
    exact: str | None = None
    server_log: str | None = None

    def build(self, model_path: str) -> "VLLMServerEngine":
        return VLLMServerEngine(model_path, self, role="follows", server_log=self.server_log)

    def weight_transfer(self, in_process: bool) -> WeightTransfer:
        return WeightTransfer("version_only")

    def exact_dtype(self) -> str | None:
        return self.exact


SHARED_ADAPTERS = ("model.lora.sync: adapter with vLLM servers shared by several ranks (engine.urls, or placement: "
                   "dedicated): rank 0 alone pushes to them, and takes full weights only: use model.lora.sync: merged")


def span_versions(spans: list[dict] | None, n: int) -> list[int]:
    """The behaviour version of each of a completion's `n` tokens, from the server's spans
    `[{"version": "3", "start": 0, "end": 111}, {"version": "4", "start": 111, "end": 240}]` (labels are
    optimizer steps, `end` exclusive); ValueError when they are not optimizer steps or do not tile 0..n."""
    out: list[int | None] = [None] * n
    try:
        for sp in spans or []:
            v, a, b = int(sp["version"]), int(sp["start"]), int(sp["end"])
            if not 0 <= a <= b <= n or any(x is not None for x in out[a:b]):
                raise ValueError
            out[a:b] = [v] * (b - a)
    except (TypeError, ValueError, KeyError):
        raise ValueError(f"weight_versions {spans!r} are not optimizer steps over {n} tokens: another client "
                         f"relabelled the server (POST /update_weight_version)") from None
    if None in out:
        raise ValueError(f"weight_versions {spans!r} leave token {out.index(None)} of {n} without a version")
    return out


class VLLMServerEngine(RolloutEngine, PoolOwner):
    """Rollouts on vLLM servers for `model_path` with the settings of `config`."""

    concurrent = True           # generate from any thread: requests go through the client's event loop

    def __init__(self, model_path: str, config: VLLMServerConfig | None = None,
                 role: Literal["alone", "leads", "follows"] = "alone", server_log: str | None = None):
        """`role`: "alone", the servers are this trainer's; "leads" (LeaderConfig), rank 0 of ranks sharing
        them: it labels them "-1" at start and pushes for all; "follows" (FollowerConfig): a rank > 0, it
        writes nothing, and loading waits for rank 0's push. `server_log`: the log of a server another rank
        launched, for this engine's errors."""
        c = self.config = config if config is not None else VLLMServerConfig()
        self.role, self.server_log = role, server_log
        self.model_path, self.version, self.closed = str(model_path), 0, False
        self.startup_seconds, self.pushes = 0.0, 0
        self.weights_path: str | None = None       # the folder the servers loaded last
        self.adapter: tuple[str, int] | None = None          # (name, version) of the adapter requests name
        self.adapters: list[tuple[str, str]] = []            # (name, folder) of the adapters loaded, oldest first
        self.run_id = uuid.uuid4().hex[:8]                   # in adapter names: runs sharing a server never collide
        if c.weights_dir is None:
            remove_orphan_adapter_dirs(adapter_root(), WEIGHTS_PREFIX)     # left by runs killed with kill -9
        self.weights_root = c.weights_dir or tempfile.mkdtemp(prefix=f"{WEIGHTS_PREFIX}{os.getpid()}-", dir=adapter_root())
        os.makedirs(self.weights_root, exist_ok=True)
        self.pool = ServerPool(c, self)            # the HTTP client, on its own thread: callable from any thread
        self.server: LaunchedServer | None = None
        atexit.register(self.close)
        t0 = time.perf_counter()
        try:
            if c.urls:
                self.pool.enlist([u.rstrip("/") for u in c.urls])
            else:
                port = c.port if c.port is not None else free_port()
                self.server = launch(model_path, c, "127.0.0.1", port, c.log_file)
                self.pool.enlist([self.server.url])
                seconds = self.server.wait_ready(c.startup_timeout)
                print(f"lit-ess: vLLM server ready at {self.server.url} after {seconds:.0f} s", file=sys.stderr, flush=True)
            if role == "follows":              # rank 0 may still be launching the server it shares
                self.pool.run_all([self._await_start(u) for u in self.urls])
            self.pool.run_all([self._check_server(u) for u in self.urls])
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.perf_counter() - t0
        self.pool.start_heartbeat()

    @property
    def urls(self) -> list[str]:
        """The servers' base URLs, in the run or out of it."""
        return self.pool.urls

    async def _await_start(self, url: str) -> None:
        """A follower's server: wait up to startup_timeout for its GET /health (rank 0 launches the dedicated
        placement's server while the other ranks start)."""
        t0 = time.monotonic()
        while True:
            try:
                status, _ = await self.pool.request(url, "GET", "/health", None, "startup_timeout", "GET /health", 10.0)
                if status == 200:
                    return
            except ServerGone:
                pass
            if time.monotonic() - t0 > 2 * self.config.startup_timeout:      # rank 0's clock starts later
                raise ServerGone(f"{self.where(url)} did not answer GET /health within {2 * self.config.startup_timeout:g} "
                                 f"s (2 x engine.startup_timeout); rank 0 launches or names it: see rank 0's error")
            await asyncio.sleep(1.0)

    # ---- what the pool asks of the engine (PoolOwner) ----

    def where(self, url: str) -> str:
        if self.server is None or self.server.url != url:
            return f"vLLM server {url}" + (f" (launched by rank 0; server log: {self.server_log})" if self.server_log else "")
        try:                        # a server killed a moment ago resets its connections before it can be reaped
            rc = self.server.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            rc = None
        exited = "" if rc is None else f" (exited with code {rc})"
        return f"vLLM server {url}{exited}; server log: {self.server.log_file}"

    async def restore(self, url: str) -> int:
        """A server out of the run that answers again (the pool takes it back): the start checks, then the run's
        base weights: the last push (`weights_path`; a follower's: rank 0 pushed them), else the model folder's,
        whose label the start checks set; then the adapters a request may name. The step it now holds. A server
        this engine launched whose process exited is never taken back: what answers at its port now is another
        process (another run's server took the port), whose weights a push would overwrite."""
        if self.server is not None and self.server.url == url and (rc := self.server.proc.poll()) is not None:
            raise ServerError(f"{self.where(url)}: the server this run launched there exited (code {rc}), so what "
                              f"answers at its port now is another process's: not taken back")
        await self._check_server(url)
        if self.role == "follows" or self.weights_path is None:
            want = str(self.version) if self.role == "follows" else "-1" if self.role == "leads" else "0"
            if (label := await self._label(url)) != want:
                raise ServerError(f"{self.where(url)} carries weights {label!r}, not those of step {want} this run "
                                  f"samples" + (" (rank 0 pushes them)" if self.role == "follows" else ""))
        else:
            await self._reload(url, self.weights_path, self.version)      # pushes, labels, resets, checks the label
        for name, folder in self.adapters:
            await self.pool.call(url, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder},
                                 text_ok=True, gone_on_5xx=False, what=f"POST /v1/load_lora_adapter from {folder}")
        return self.version

    # ---- start checks ----

    async def _label(self, url: str) -> str:
        """The label of the weights the server holds (GET /weight_info)."""
        _, answer = await self.pool.ask(url, "GET", "/weight_info")
        return str(self.pool.field(url, "GET /weight_info", answer, "weight_version", (str, int)))

    async def _check_server(self, url: str) -> None:
        """Refuse a server lit-ess cannot use, with the flag to add."""
        fix = "start it with `python -m lit_ess.engines.serve --model MODEL_DIR`, or add"
        _, answer = await self.pool.ask(url, "GET", "/version", knob="startup_timeout")
        version = self.pool.field(url, "GET /version", answer, "version", str)
        if not str(version).startswith(VLLM_SERIES):
            raise ServerError(f"{self.where(url)} runs vLLM {version}; lit-ess speaks the routes of vLLM "
                              f"{VLLM_SERIES}x: install that release there (pyproject.toml pins it)")
        status, info = await self.pool.ask(url, "GET", "/server_info?config_format=json", ok=(200, 404))
        if status == 404:
            raise ServerError(f"{self.where(url)} has no dev routes (GET /server_info: 404): {fix} the environment "
                              f"variable VLLM_SERVER_DEV_MODE=1 to its start")
        vc = self.pool.field(url, "GET /server_info", info, "vllm_config")
        m = self.pool.field(url, "GET /server_info", vc, "model_config")
        if (vc.get("device_config") or {}).get("device") == "cpu" and (vc.get("scheduler_config") or {}).get("enable_chunked_prefill"):
            raise ServerError(f"{self.where(url)} splits prefills on CPU, where vLLM 0.32 crashes on seeded requests "
                              f"so split: {fix} --no-enable-chunked-prefill")
        if m.get("logprobs_mode") != "processed_logprobs":
            raise ServerError(f"{self.where(url)} reports {m.get('logprobs_mode')} logprobs, not what it sampled from: "
                              f"{fix} --logprobs-mode processed_logprobs")
        if self.config.dtype != "auto" and m.get("dtype") != f"torch.{self.config.dtype}":
            raise ServerError(f"{self.where(url)} runs {m.get('dtype')}, engine.dtype is {self.config.dtype}: "
                              f"{fix} --dtype {self.config.dtype} (or set engine.dtype to the server's)")
        if self.config.max_model_len is not None and m.get("max_model_len", 0) < self.config.max_model_len:
            raise ServerError(f"{self.where(url)} takes sequences up to {m.get('max_model_len')} tokens, "
                              f"engine.max_model_len is {self.config.max_model_len}: {fix} --max-model-len "
                              f"{self.config.max_model_len}")
        if self.config.max_lora_rank is not None:
            lora = vc.get("lora_config") or {}
            if (lora.get("max_lora_rank") or 0) < self.config.max_lora_rank:
                raise ServerError(f"{self.where(url)} serves LoRA adapters up to rank {lora.get('max_lora_rank')}, "
                                  f"engine.max_lora_rank is {self.config.max_lora_rank}: {fix} --enable-lora "
                                  f"--max-lora-rank {self.config.lora_rank_flag()}")
            # an unknown adapter: vLLM's handler answers {"error": ...}; without the route FastAPI's {"detail": "Not Found"}
            _, answer = await self.pool.ask(url, "POST", "/v1/unload_lora_adapter", {"lora_name": "lit-ess-probe"},
                                            ok=(400, 404))
            if "error" not in answer:
                raise ServerError(f"{self.where(url)} has no /v1/load_lora_adapter route: {fix} the environment "
                                  f"variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 to its start")
        want = served_model_name(self.model_path)
        _, listed = await self.pool.ask(url, "GET", "/v1/models")
        models = self.pool.field(url, "GET /v1/models", listed, "data", list)
        names = [str(d.get("id")) for d in models if isinstance(d, dict)]
        if not any(same_model(name, want) for name in names):
            raise ServerError(f"{self.where(url)} serves {names}, whose config.json and tokenizer are not those of "
                              f"{self.model_path} (or cannot be read here): {fix} --served-model-name {want}")
        probe = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "logprobs": 0}}
        status, _ = await self.pool.call(url, "POST", "/inference/v1/generate", probe, "request_timeout",
                                         ok=(200, 403))
        if status == 403:
            raise ServerError(f"{self.where(url)} refuses token-in token-out requests (POST /inference/v1/generate: "
                              f"403): {fix} --enable-scale-out")
        label = await self._label(url)
        if self.role == "follows":             # rank 0 labels the servers (LeaderConfig)
            return
        if self.role == "leads":               # no step yet: a label of an earlier run never passes for this run's
            await self.pool.call(url, "POST", "/update_weight_version", {"new_version": "-1"})
        elif label == "default":
            await self.pool.call(url, "POST", "/update_weight_version", {"new_version": "0"})   # the weights it started with
        elif self.config.max_lora_rank is not None and label != "0":
            raise ServerError(f"{self.where(url)} holds weights pushed by another run (version {label!r}), not the "
                              f"model's: adapters (model.lora.sync: adapter) apply to the base weights as the model "
                              f"folder has them: restart it")

    # ---- generation ----

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, call_seed: int = 0,
                 prompt_keys: list[int] | None = None) -> list[list[Completion]]:
        """One request per prompt for its n samples (`n`), seeded as the in-process engine seeds them
        (group_seed(seed, call seed, prompt key); vLLM seeds sample j with it + j), all in flight at once up
        to max_concurrency on the client's pooled connections. (vLLM's token route takes one prompt a request;
        /v1/completions takes several but one seed for all, which clones repeated prompts.)"""
        keys = range(len(prompts)) if prompt_keys is None else prompt_keys
        adapter = self.adapter              # one adapter for the call's requests, whatever is pushed meanwhile
        return self.pool.run_all([self._group(list(p), n, group_seed(sampling.seed, call_seed, key), sampling,
                                              f"prompt {key}, {n} sample(s)", adapter)
                                  for key, p in zip(keys, prompts)])

    async def _group(self, prompt: list[int], n: int, seed: int | None, s: SamplingConfig, what: str,
                     adapter: tuple[str, int] | None = None) -> list[Completion]:
        params = {"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": 0.0,
                  "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "max_tokens": s.max_new_tokens, "stop": list(s.stop) or None, "include_stop_str_in_output": True,
                  "detokenize": bool(s.stop), "seed": seed, "logprobs": 0}
        what = f"{what}, {len(prompt)} prompt tokens"
        body = {"token_ids": prompt, "sampling_params": params}
        if adapter is not None:
            body["model"] = adapter[0]
        call = f"POST /inference/v1/generate ({what})"
        url, out = await self.pool.dispatch("/inference/v1/generate", body, call)
        return [self._completion(url, choice, ids, lps, out.get("model"), what, adapter)
                for choice, ids, lps in self._sampled(url, call, out, n)]

    def _completion(self, url: str, choice: dict, ids: list[int], lps: list[float], model: str | None, what: str,
                    adapter: tuple[str, int] | None) -> Completion:
        """One choice of a generate answer: its ids, their logprobs and each token's version (the spans)."""
        if len(lps) != len(ids):
            raise ServerError(f"{self.where(url)}: POST /inference/v1/generate ({what}) returned {len(ids)} tokens "
                              f"with {len(lps)} logprobs")
        try:
            versions = span_versions(choice.get("weight_versions"), len(ids))
        except ValueError as e:
            raise ServerError(f"{self.where(url)}: POST /inference/v1/generate ({what}): {e}") from None
        if adapter is not None:              # sampled by the adapter it named, on the base weights it started with
            if model != adapter[0] or any(v != 0 for v in versions):
                raise ServerError(f"{self.where(url)}: POST /inference/v1/generate ({what}) was sampled by model "
                                  f"{model!r} on base weights {sorted(set(versions))}, not adapter {adapter[0]!r} "
                                  f"on the model's (version 0): another client changes this server")
            versions = [adapter[1]] * len(ids)
        return Completion(ids, lps, "length" if choice.get("finish_reason") == "length" else "stop",
                          min(versions, default=self.version), token_versions=versions)

    def _sampled(self, url: str, call: str, out: dict, n: int) -> list[tuple[dict, list[int], list[float]]]:
        """The n choices of a generate answer in sample order (`index`), each with its token ids and their
        logprobs; one line naming the URL for an answer that is not vLLM's or holds another number of choices."""
        try:
            choices = sorted(out["choices"], key=lambda c: int(c.get("index", 0)))
            parsed = [(c, [int(t) for t in c["token_ids"]],
                       [float(e["logprob"]) for e in (c.get("logprobs") or {}).get("content") or []]) for c in choices]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise self.pool.not_vllm(url, call, out) from None
        if not parsed:
            raise self.pool.not_vllm(url, call, out)
        if len(parsed) != n:
            raise ServerError(f"{self.where(url)}: {call} returned {len(parsed)} choices for n={n}")
        return parsed

    # ---- weights ----

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Write the weights as safetensors into a new folder of weights_dir (renamed into place when
        whole), make every server reload them, label them `version`, reset its prefix cache, check.
        The whole state dict is held in host memory while the file is written (one file).
        A follower writes no tensors: it consumes the iterator (under FSDP2 every rank takes part in the
        gathers rank 0's push makes) and waits until the servers carry `version`. (Never while a server out of
        the run is being taken back: the pool's `fleet` lock.)"""
        if self.role == "follows":
            for _ in named_tensors:
                pass
        with self.pool.fleet:
            self._push(named_tensors, version)

    def _push(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        if self.role == "follows":
            self.pool.run(self._follow(version))
            self.version = version
            return
        it = iter(named_tensors)
        first = next(it, None)
        if first is not None and is_adapter_payload([first[0]]):
            return self._load_adapter(dict([first, *it]), version)
        folder = self._write_weights(([first] if first is not None else []) + list(it), version)
        try:
            live = self.pool.live()
            errors = self.pool.run_all([self._reload(u, folder, version) for u in live], return_exceptions=True)
            self.pool.settle(live, errors)     # a server gone may hold any weights now: it serves no more of this run
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if self.weights_path is not None:
            shutil.rmtree(self.weights_path, ignore_errors=True)      # no server reads it any more
        self.weights_path, self.version = folder, version

    async def _follow(self, version: int) -> None:
        """Wait until every server in the run carries the weights of step `version` or newer. Rank 0 pushes them
        when its own next request needs them, which may wait for its phase in flight and for the followers'
        requests to drain: up to request_timeout + 5 x control_timeout (its write, pause, reload, label, reset).
        A server still behind control_timeout after another carries `version` was put out of the run by rank 0
        (it pushes to it no more): out here too. A server gone is out as in generation."""
        c, t0, ahead_since = self.config, time.monotonic(), None
        limit = c.request_timeout + 5 * c.control_timeout
        while True:
            behind = {}
            for url in self.pool.live():
                try:
                    label = await self._label(url)
                except ServerGone as e:
                    self.pool.put_out(url, e)
                    continue
                if not (label.isdigit() and int(label) >= version):
                    behind[url] = label
            if not behind:
                return
            now = time.monotonic()
            if len(behind) < len(self.pool.live()):
                ahead_since = ahead_since or now
                if now - ahead_since > c.control_timeout:
                    for url, label in behind.items():
                        self.pool.put_out(url, ServerGone(f"{self.where(url)} still carries weights {label!r} "
                                                          f"{c.control_timeout:g} s after another server took those "
                                                          f"of step {version}: rank 0 no longer pushes to it"))
                    continue
            if now - t0 > limit:
                url, label = next(iter(behind.items()))
                raise ServerError(f"{self.where(url)} still carries weights {label!r}, not those of step {version}, "
                                  f"{limit:g} s after this rank asked for them (engine.request_timeout + 5 x "
                                  f"control_timeout): rank 0 pushes the weights of servers its ranks share")
            await asyncio.sleep(0.1)

    def _load_adapter(self, tensors: dict[str, Tensor], version: int) -> None:
        """LoRA adapters (lit_ess.lora.adapter_weights): a peft folder in weights_dir, loaded by every server as
        adapter `lit-ess-<run>-a<n>`, which the next requests name. The adapter before stays loaded (a generate call
        that began before this push names it to its end) and goes at the next push, with its folder."""
        from ..lora import write_adapter

        rank = max(t.shape[0] for n, t in tensors.items() if ".lora_A." in n)
        if (error := self.config.adapter_error(rank)) is not None:
            raise ValueError(error)
        if self.role == "leads":
            raise ValueError(SHARED_ADAPTERS)
        self.pushes += 1
        name = f"lit-ess-{self.run_id}-a{self.pushes}"             # this run's: servers by URL outlive it
        tmp = os.path.join(self.weights_root, f".{name}.tmp")
        try:
            write_adapter(tmp, tensors)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        folder = os.path.join(self.weights_root, name)
        os.rename(tmp, folder)                                      # whole, or not there
        body = {"lora_name": name, "lora_path": folder}
        live = self.pool.live()                                     # vLLM answers 5xx for an adapter it cannot load
        errors = self.pool.run_all([self.pool.call(u, "POST", "/v1/load_lora_adapter", body, text_ok=True,
                                                   gone_on_5xx=False, what=f"POST /v1/load_lora_adapter from {folder}")
                                    for u in live], return_exceptions=True)
        try:
            self.pool.settle(live, errors)
        except BaseException:                                       # the servers that loaded it drop it again
            self._unload(name, [u for u, e in zip(live, errors) if not isinstance(e, BaseException)])
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.adapters.append((name, folder))
        while len(self.adapters) > 2:                               # no request names it any more
            old, old_folder = self.adapters.pop(0)
            self._unload(old, self.pool.live())
            shutil.rmtree(old_folder, ignore_errors=True)
        self.adapter, self.version = (name, version), version

    def _unload(self, name: str, urls: list[str]) -> None:
        """Unload adapter `name` from `urls`, best effort (a server gone, or that never had it, is fine)."""
        self.pool.run_all([self.pool.call(u, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, ok=(200, 404),
                                          text_ok=True) for u in urls], return_exceptions=True)

    def _write_weights(self, named: list[tuple[str, Tensor]], version: int) -> str:
        from safetensors.torch import save_file

        self.pushes += 1
        name = f"v{version}-{self.pushes}"                           # a version may be pushed twice (validation)
        tmp = os.path.join(self.weights_root, f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        seen, tensors = set(), {}
        for k, v in named:
            t = v.detach().to("cpu").contiguous()
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            tensors[k] = t.clone() if key in seen else t             # tied weights: safetensors stores no shared memory
            seen.add(key)
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        final = os.path.join(self.weights_root, name)
        os.rename(tmp, final)
        return final

    async def _reload(self, url: str, folder: str, version: int) -> None:
        keep = self.config.updates_in_flight()
        # drain: the requests running finish first (another rank's, on shared servers): up to request_timeout
        await self.pool.call(url, "POST", "/pause?mode=keep" if keep else "/pause?mode=wait",
                             knob="control_timeout" if keep else "request_timeout")
        try:
            await self.pool.call(url, "POST", "/collective_rpc",
                                 {"method": "reload_weights", "kwargs": {"weights_path": folder}},
                                 what=f"POST /collective_rpc reload_weights from {folder}")
            await self.pool.call(url, "POST", "/update_weight_version", {"new_version": str(version)})
            _, reset = await self.pool.ask(url, "POST", "/reset_prefix_cache?reset_running_requests=true" if keep
                                           else "/reset_prefix_cache")
            if reset.get("success") is not True:
                raise ServerError(f"{self.where(url)}: POST /reset_prefix_cache answered {reset}: the prefix cache of "
                                  f"the old weights would be reused")
        finally:
            await self.pool.call(url, "POST", "/resume")
        label = await self._label(url)
        if label != str(version):
            raise ServerError(f"{self.where(url)}: GET /weight_info says version {label!r} after pushing {version}: "
                              f"another client updates this server")

    def close(self) -> None:
        """Stop the client, the launched server and remove the weights written here (idempotent)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        self.pool.stop_heartbeat()
        if self.server is None and self.pool.running():        # servers by URL go on: unload this run's adapters
            for name, _ in self.adapters:
                self._unload(name, self.pool.live())
        self.pool.close()
        if self.server is not None:
            self.server.stop()
            atexit.unregister(self.server.stop)
        if self.config.weights_dir is None:
            shutil.rmtree(self.weights_root, ignore_errors=True)
        else:
            for path in [self.weights_path, *(folder for _, folder in self.adapters)]:
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
        self.weights_path, self.adapters = None, []
