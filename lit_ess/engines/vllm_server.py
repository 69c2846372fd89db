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
start, with the vLLM version, processed logprobs, the dtype and the model (`model_fingerprint`), and a
server that fails a check is refused with the flag to add. The dev routes are not guarded by
`--api-key`; every server lit-ess starts runs lit_ess/engines/guard.py's middleware: with
LIT_ESS_SERVER_TOKEN set (required on a non-loopback host) every route but /health wants that token,
which this client sends. A launched server listens on 127.0.0.1, on a port checked free, and its
readiness check reads back the id it was launched with: no other process is taken for it.

Faults: a server that refuses connections, resets them, gives no answer within its timeout
(startup_timeout for a server by URL's first answer, request_timeout for generation and a drain's pause,
control_timeout for the rest; the error names the knob), or answers HTTP 5xx is out of the run (ServerGone): the
request goes again, with its seed, to the server with the fewest outstanding requests among the
others, and weight pushes skip it. A server out that answers GET /health again (the heartbeat asks) is
taken back by the next call once the start checks pass, the last pushed weights are loaded and its label
is the run's, while the run goes on (`_take_back`). When none is left the call fails with one line naming the URL, the request,
the servers out before it and, for a launched server, its exit code and log (an EngineFault: the CLI
prints that line).

A server for other machines: `python -m lit_ess.engines.serve --model DIR --port P` (lit_ess/engines/serve.py).
"""
from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal

import torch
from torch import Tensor

from ..knobs import check
from ..lora import is_adapter_payload
from ..sampling import Completion, SamplingConfig, group_seed
from .base import EngineConfig, EngineFault, RolloutEngine, WeightTransfer, capped_limit, devices_env
from .guard import ID_ENV, ID_HEADER, auth_headers, exposure_error, listener, port_holder, unauthorized_hint
from .vllm_engine import LORA_RANKS, adapter_root, lora_dtype_error, remove_orphan_adapter_dirs

VLLM_SERIES = "0.32."       # the vLLM release lit-ess is written against (pyproject.toml pins it)
WEIGHTS_PREFIX = "lit-ess-weights-"
# config.json keys that do not change what the network computes, left out of the fingerprint
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "name_or_path"}


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
            histogram), its staleness its oldest token's. Needs data.mode: async (the trainer pushes
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
                             "set data.mode: async, or remove it")
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


def model_fingerprint(model_path: str) -> str:
    """What a served model must share with the trainer's: a short hash of its config.json (less the keys
    that change no computation) and of its tokenizer's vocabulary. Weights are not in it: the trainer
    pushes its own before the first rollout."""
    folder = Path(model_path)
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items()
              if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=6)
    tok = folder / "tokenizer.json"
    if tok.exists():
        h.update(json.dumps(json.loads(tok.read_text()).get("model", {}).get("vocab"), sort_keys=True).encode())
    return h.hexdigest()


def served_model_name(model_path: str) -> str:
    """The --served-model-name lit-ess gives a server: the folder's name and its `model_fingerprint`."""
    return f"{Path(model_path).resolve().name}@{model_fingerprint(model_path)}"


def same_model(served: str, want: str) -> bool:
    """Whether a server's model name `served` is the model of `served_model_name` `want`: the same
    fingerprint after its "@", or a model folder readable here with that fingerprint (a server started
    by hand on this machine)."""
    if "@" in served:
        return served.rpartition("@")[2] == want.rpartition("@")[2]
    try:
        return model_fingerprint(served) == want.rpartition("@")[2]
    except (OSError, ValueError):
        return False


def server_command(model_path: str, c: VLLMServerConfig, host: str, port: int) -> list[str]:
    """The command that starts a server lit-ess can use (also `serve`'s)."""
    gmu = c.gpu_memory_utilization
    if gmu is None:
        gmu = 0.4 if torch.cuda.is_available() else 0.1
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
           "--served-model-name", served_model_name(model_path), "--dtype", c.dtype,
           "--gpu-memory-utilization", str(gmu), "--seed", str(c.seed), "--logprobs-mode", "processed_logprobs",
           "--enable-scale-out", "--generation-config", "vllm", "--middleware", "lit_ess.engines.guard.Guard",
           "--host", host, "--port", str(port)]
    if c.max_model_len is not None:
        cmd += ["--max-model-len", str(c.max_model_len)]
    if c.enforce_eager:
        cmd += ["--enforce-eager"]
    if c.max_lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(c.lora_rank_flag()), "--max-loras", "2"]
    if not torch.cuda.is_available():
        # as the in-process engine: vLLM 0.32 on CPU crashes on seeded requests whose prefill is split,
        # and its default 128-token KV blocks make short RL sequences read mostly padding
        cmd += ["--no-enable-chunked-prefill", "--block-size", "32"]
    return cmd + list(c.server_args)


def server_env(c: VLLMServerConfig) -> dict[str, str]:
    """The launched server's environment: dev routes on, one OpenMP thread unless the caller set more, and
    this lit-ess first on the path (the server imports its guard middleware)."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = str(Path(__file__).resolve().parents[2])            # the folder holding this lit_ess package
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    if c.max_lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"             # the /v1/load_lora_adapter route
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, c.kv_cache_gib))))
    env.pop("VLLM_DIST_IDENT", None)           # set by an in-process CPU engine of this process, unknown to the server
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the server when the process (the thread) that launched it dies, even by kill -9."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG


STARTUP_PROGRESS_S = 15.0      # a console line every this many seconds while a launched server starts


def launch(model_path: str, c: VLLMServerConfig, host: str, port: int, log_file: str | None,
           serve: bool = False) -> LaunchedServer:
    """Launch a server for `model_path` on `host`:`port` (vLLM's last --host in `c.server_args` wins) once it
    is known to be lit-ess's alone: the port is free, and a host other machines reach has the shared token (one
    line naming the knob otherwise: `serve`'s flags, or the engine's); it is given a new id, which its
    readiness check reads back (lit_ess/engines/guard.py)."""
    cmd = server_command(model_path, c, host, port)
    host = _last_host(cmd)
    where = f"--host {host}" if serve or host == "127.0.0.1" else f"engine.server_args --host {host}"
    if (error := exposure_error(host, where)) is not None:
        raise ValueError(error)
    fix = "pass another --port" if serve else ("a launched server needs a port of its own: set another engine.port, "
                                               "or port: null for a free one")
    if (held := port_holder(host, port)) is not None:
        raise ValueError(f"{'--port' if serve else 'engine.port'} {port}: {held}: {fix}")
    local = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    server_id = uuid.uuid4().hex
    return LaunchedServer(cmd, dict(server_env(c), **{ID_ENV: server_id}), log_file, f"http://{local}:{port}",
                          server_id, fix)


def _last_host(cmd: list[str]) -> str:
    """The host a server command listens on: its last `--host X` or `--host=X` (argparse's rule)."""
    last = max(i for i, a in enumerate(cmd) if a == "--host" or a.startswith("--host="))
    return cmd[last + 1] if cmd[last] == "--host" and last + 1 < len(cmd) else cmd[last].partition("=")[2]


class LaunchedServer:
    """A vLLM server process on this machine, in its own process group, its output in `log_file`. With a
    `server_id` (`launch`), readiness is a /health answer carrying that id; `fix` ends the error when another
    process answers instead."""

    def __init__(self, cmd: list[str], env: dict, log_file: str | None, url: str, server_id: str | None = None,
                 fix: str = ""):
        self.url, self.server_id, self.fix = url, server_id, fix
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix=f"lit-ess-vllm-server-{os.getpid()}-", suffix=".log")
            os.close(fd)
        self.log_file = str(log_file)
        Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        atexit.register(self.stop)
        print(f"lit-ess: starting a vLLM server at {self.url} (log: {self.log_file})", file=sys.stderr, flush=True)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until GET /health answers 200 (with this server's id, when it has one); one-line errors if
        the process exits, another process answers, or time runs out."""
        import urllib.error
        import urllib.parse
        import urllib.request

        t0 = said = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if time.perf_counter() - said >= STARTUP_PROGRESS_S:      # the console: still waiting, and how long
                said = time.perf_counter()
                print(f"lit-ess: waiting for the vLLM server at {self.url}: {said - t0:.0f} s "
                      f"(engine.startup_timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
            if (rc := self.proc.poll()) is not None:
                raise RuntimeError(f"the vLLM server for {self.url} exited with code {rc} during start-up: "
                                   f"{self.last_line()!r} (log: {self.log_file})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    ready, answered_by = r.status == 200, r.headers.get(ID_HEADER)
            except (urllib.error.URLError, OSError):
                ready = False
            if ready and self.server_id in (None, answered_by):
                return time.perf_counter() - t0
            if ready:                   # not the server launched: another process listens on its port
                self.stop()
                at = urllib.parse.urlsplit(self.url)
                raise ServerError(f"vLLM server {self.url}; server log: {self.log_file}: GET /health answered 200 from "
                                  f"another process than the server launched (pid {self.proc.pid}): "
                                  f"{at.hostname}:{at.port} is in use by {listener(at.port)}: {self.fix}")
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the vLLM server for {self.url} was not ready after {timeout:.0f} s (engine.startup_timeout; "
                           f"log: {self.log_file})")

    def last_line(self) -> str:
        try:
            lines = [ln for ln in Path(self.log_file).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][-300:] if lines else ""

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's process group (the API server and its engine core), SIGKILL it after `grace` s."""
        if self.proc.poll() is not None:          # killed alone (kill -9): its engine core may outlive it
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:                                       # children that outlived the API server
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


SHARED_ADAPTERS = ("model.lora.sync: adapter with vLLM servers shared by several ranks (engine.urls, or placement: "
                   "dedicated): rank 0 alone pushes to them, and takes full weights only: use model.lora.sync: merged")


class ServerError(EngineFault):
    """A failed HTTP call to a server: one line with the URL, the call and what came back."""


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


class ServerGone(ServerError):
    """A server that did not answer (connection refused or reset, no answer within the timeout) or failed
    inside (HTTP 5xx): it is out of the run, and its requests go to the other servers."""


class VLLMServerEngine(RolloutEngine):
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
        self.loop = asyncio.new_event_loop()       # the HTTP client's, in its own thread: callable from any thread
        self.thread = threading.Thread(target=self.loop.run_forever, name="lit-ess-vllm-server-client", daemon=True)
        self.thread.start()
        self.client = self._run(self._make_client())
        self.server: LaunchedServer | None = None
        self.heartbeat = None                      # the heartbeat task's future, once the servers passed their checks
        atexit.register(self.close)
        t0 = time.perf_counter()
        try:
            if c.urls:
                self.urls = [u.rstrip("/") for u in c.urls]
            else:
                port = c.port if c.port is not None else free_port()
                self.server = launch(model_path, c, "127.0.0.1", port, c.log_file)
                self.urls = [self.server.url]
                seconds = self.server.wait_ready(c.startup_timeout)
                print(f"lit-ess: vLLM server ready at {self.server.url} after {seconds:.0f} s", file=sys.stderr, flush=True)
            self.outstanding = {u: 0 for u in self.urls}
            self.gone: dict[str, str] = {}     # servers out of the run, with the error that put them out
            self.silence = {u: asyncio.Event() for u in self.urls}  # set when the heartbeat puts it out
            self.answered = {u: 0.0 for u in self.urls}              # when it last answered a generate request
            self.back: set[str] = set()        # servers out of the run that answer GET /health again (`_probe`)
            self.probes: dict[str, asyncio.Future] = {}               # the probes of servers out, running
            self.refusals: dict[str, str] = {}                        # why a server back was not taken back
            self.fleet = threading.Lock()      # a push and the taking back of a server are never interleaved
            if role == "follows":              # rank 0 may still be launching the server it shares
                self._run_all([self._await_start(u) for u in self.urls])
            self._run_all([self._check_server(u) for u in self.urls])
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.perf_counter() - t0
        if c.heartbeat_seconds is not None:
            self.heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeat(), self.loop)
            self.heartbeat.add_done_callback(self._heartbeat_ended)

    async def _await_start(self, url: str) -> None:
        """A follower's server: wait up to startup_timeout for its GET /health (rank 0 launches the dedicated
        placement's server while the other ranks start)."""
        t0 = time.monotonic()
        while True:
            try:
                if (await self._request(url, "GET", "/health", None, "startup_timeout", "GET /health", 10.0))[0] == 200:
                    return
            except ServerGone:
                pass
            if time.monotonic() - t0 > 2 * self.config.startup_timeout:      # rank 0's clock starts later
                raise ServerGone(f"{self._where(url)} did not answer GET /health within {2 * self.config.startup_timeout:g} "
                                 f"s (2 x engine.startup_timeout); rank 0 launches or names it: see rank 0's error")
            await asyncio.sleep(1.0)

    async def _heartbeat(self) -> None:
        """Every heartbeat_seconds, GET /health of each server with requests in flight. A server that misses
        two in a row (no answer within heartbeat_timeout, an error or a 5xx), answering no generate request
        meanwhile, is out of the run at once: its requests give up (`_watched`) and go to the other servers
        with their seeds, which request_timeout would do much later. vLLM answers /health from its API
        process, so this finds an API server stopped or cut off, not a hung engine core."""
        c, misses = self.config, {u: 0 for u in self.urls}
        while True:
            await asyncio.sleep(c.heartbeat_seconds)
            for url in list(self.gone):        # out of the run: does it answer again? (a call then takes it back)
                misses[url] = 0
                if url not in self.probes and url not in self.back:
                    self.probes[url] = asyncio.ensure_future(self._probe(url))
            busy = [u for u in self._live() if self.outstanding[u] > 0]
            t0 = time.monotonic()
            answers = await asyncio.gather(*(self._request(u, "GET", "/health", None, "heartbeat_timeout",
                                                           "GET /health (heartbeat)") for u in busy),
                                           return_exceptions=True)
            for url, a in zip(busy, answers):
                if isinstance(a, tuple) and a[0] < 500 or self.answered[url] > t0:
                    misses[url] = 0
                    continue
                misses[url] += 1
                if misses[url] >= 2 and url in self._live():
                    why = f"HTTP {a[0]}" if isinstance(a, tuple) else str(a).removeprefix(f"{self._where(url)}: ")
                    self.gone[url] = (f"{self._where(url)}: GET /health (heartbeat) failed twice in a row with "
                                      f"{self.outstanding[url]} request(s) in flight (engine.heartbeat_timeout "
                                      f"{c.heartbeat_timeout:g} s): {why}")
                    if live := self._live():
                        print(f"lit-ess: warning: {self.gone[url]}; its requests go to the other {len(live)} "
                              f"server(s) from now on", file=sys.stderr, flush=True)
                    self.silence[url].set()

    async def _probe(self, url: str) -> None:
        """GET /health of a server out of the run, within heartbeat_timeout: answering 200 (restarted, or reachable
        again), it is taken back by a thread of its own (`_take_back`), while the run goes on without it."""
        try:
            if (await self._request(url, "GET", "/health", None, "heartbeat_timeout", "GET /health (probe)"))[0] == 200:
                self.back.add(url)
                threading.Thread(target=self._take_back, name="lit-ess-vllm-server-take-back", daemon=True).start()
        except ServerError:
            pass
        finally:
            self.probes.pop(url, None)

    def _take_back(self) -> None:
        """Take back into the run each server out of it that answers again (the heartbeat's probe), once it passes
        the start checks, holds the run's weights (pushed again; a follower's: rank 0 pushed them) and carries their
        label, all within control_timeout. One that fails stays out, the reason said once. Never during a push (the
        push waits, at most control_timeout): the server gets the weights of the last push that ended."""
        with self.fleet:
            urls, self.back = [u for u in self.back if u in self.gone], set()
            if self.closed or not urls:
                return
            rejoins = [asyncio.wait_for(self._rejoin(u), self.config.control_timeout) for u in urls]
            for url, e in zip(urls, self._run_all(rejoins, return_exceptions=True)):
                if isinstance(e, asyncio.TimeoutError):
                    e = ServerError(f"{self._where(url)}: taking it back (checks, weights, label) took more than "
                                    f"{self.config.control_timeout:g} s (engine.control_timeout)")
                if not isinstance(e, BaseException):
                    print(f"lit-ess: vLLM server {url} is back: it holds the weights of step {self.version} again "
                          f"and takes requests from now on", file=sys.stderr, flush=True)
                elif self.refusals.get(url) != str(e):
                    self.refusals[url] = str(e)
                    print(f"lit-ess: warning: vLLM server {url} answers again but stays out of the run: {e}",
                          file=sys.stderr, flush=True)

    async def _rejoin(self, url: str) -> None:
        """Bring a server back to the run's weights and label, then into the run (on the client's loop, where
        generation reads `gone`). Its base weights: the last push (`weights_path`), else the model folder's, whose
        label the start checks set; then the adapters a request may name."""
        await self._check_server(url)
        if self.role == "follows" or self.weights_path is None:
            want = str(self.version) if self.role == "follows" else "-1" if self.role == "leads" else "0"
            if (label := await self._label(url)) != want:
                raise ServerError(f"{self._where(url)} carries weights {label!r}, not those of step {want} this run "
                                  f"samples" + (" (rank 0 pushes them)" if self.role == "follows" else ""))
        else:
            await self._reload(url, self.weights_path, self.version)      # pushes, labels, resets, checks the label
        for name, folder in self.adapters:
            await self._call(url, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder},
                             text_ok=True, gone_on_5xx=False, what=f"POST /v1/load_lora_adapter from {folder}")
        self.silence[url] = asyncio.Event()
        self.refusals.pop(url, None)
        del self.gone[url]

    async def _watched(self, url: str, coro):
        """Await `coro`, a call to `url`; raise ServerGone instead as soon as the heartbeat puts `url` out."""
        call, silent = asyncio.ensure_future(coro), asyncio.ensure_future(self.silence[url].wait())
        try:
            done, _ = await asyncio.wait({call, silent}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            silent.cancel()
            if not call.done():
                call.cancel()
        if call in done:
            self.answered[url] = time.monotonic()
            return call.result()
        raise ServerGone(self.gone[url])

    def _heartbeat_ended(self, future) -> None:
        """The heartbeat never ends but by close(): say so when it does, since servers then go unwatched."""
        if not future.cancelled() and future.exception() is not None:
            print(f"lit-ess: warning: the vLLM server heartbeat stopped: {future.exception()!r}; silent servers are "
                  f"now found after engine.request_timeout only", file=sys.stderr, flush=True)

    async def _make_client(self):
        import aiohttp

        self.slots = asyncio.Semaphore(self.config.max_concurrency)
        # idle connections close before uvicorn's 5 s keep-alive does: reusing one it has closed fails the request.
        # No connection limit: `slots` bounds the generate requests, and a control call must never queue behind
        # them (an in-flight update's /pause would wait for the very requests it should freeze)
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                                     headers=auth_headers())     # the fleet's shared token (lit_ess/engines/guard.py)

    def _run(self, coro):
        """Run `coro` on the client's event loop (its own thread) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _run_all(self, coros, return_exceptions: bool = False) -> list:
        """Run the coroutines concurrently on the client's event loop; their results in order. The first
        error cancels the others (unless `return_exceptions`: the errors in place of results)."""
        async def gather():
            tasks = [asyncio.ensure_future(c) for c in coros]
            try:
                return await asyncio.gather(*tasks, return_exceptions=return_exceptions)
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise

        return self._run(gather())

    def _where(self, url: str) -> str:
        if self.server is None or self.server.url != url:
            return f"vLLM server {url}" + (f" (launched by rank 0; server log: {self.server_log})" if self.server_log else "")
        rc = self.server.proc.poll()
        exited = "" if rc is None else f" (exited with code {rc})"
        return f"vLLM server {url}{exited}; server log: {self.server.log_file}"

    def _live(self) -> list[str]:
        return [u for u in self.urls if u not in self.gone]

    def _put_out(self, url: str, error: ServerGone) -> None:
        """Take `url` out of the run for `error`; when no server is left, raise `error` saying so."""
        if url not in self.gone:
            self.gone[url] = str(error)
            if live := self._live():
                print(f"lit-ess: warning: {error}; its requests go to the other {len(live)} server(s) from now on",
                      file=sys.stderr, flush=True)
        if not self._live():
            before = [u for u in self.gone if u != url]
            raise ServerGone(f"{error}; no other server is left ({len(self.urls)} in engine.urls; out before: "
                             f"{', '.join(before)})" if before else str(error)) from None

    async def _request(self, url: str, method: str, route: str, body: dict | None, knob: str, call: str,
                       seconds: float | None = None) -> tuple[int, str]:
        """One HTTP call: its status and text, or a ServerError naming the URL and the call. It may take the
        seconds of the engine knob `knob` (`seconds` when given), which a timeout names."""
        import aiohttp

        timeout = getattr(self.config, knob) if seconds is None else seconds

        async def once():
            async with self.client.request(method, url + route, json=body,
                                           timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status, await r.text()

        try:
            try:
                return await once()
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # a kept-alive connection the server closed as the request left: once more, on a new one
                # (every call here may run twice: a seeded sample comes back the same, a reload loads the same)
                return await once()
        except asyncio.TimeoutError:
            raise ServerGone(f"{self._where(url)}: {call} got no answer in {timeout:.0f} s (engine.{knob})") from None
        except aiohttp.ClientError as e:
            raise ServerGone(f"{self._where(url)}: {call} failed: {type(e).__name__}: {e}") from None

    async def _call(self, url: str, method: str, route: str, body: dict | None = None, knob: str = "control_timeout",
                    what: str | None = None, ok: tuple[int, ...] = (200,), text_ok: bool = False,
                    gone_on_5xx: bool = True) -> tuple[int, dict]:
        """One HTTP call whose status must be in `ok`, within the seconds of the engine knob `knob`: its status
        and JSON body ({} when empty; {"text": ...} for a plain-text answer where `text_ok`). HTTP 5xx puts the
        server out (`gone_on_5xx`), or is an error of the call (a load that failed inside: the server is fine)."""
        call = what or f"{method} {route}"
        status, text = await self._request(url, method, route, body, knob, call)
        if status == 401 and 401 not in ok:
            raise ServerError(f"{self._where(url)}: {call} answered HTTP 401 (unauthorized): {unauthorized_hint()}")
        if status not in ok:
            error = ServerGone if status >= 500 and gone_on_5xx else ServerError
            raise error(f"{self._where(url)}: {call} answered HTTP {status}: {text[:300]!r}")
        if text_ok and text and not text.lstrip().startswith(("{", "[")):
            return status, {"text": text}
        try:
            return status, json.loads(text) if text else {}
        except json.JSONDecodeError:
            raise ServerError(f"{self._where(url)}: {call} answered no JSON: {text[:300]!r}") from None

    async def _ask(self, url: str, method: str, route: str, body: dict | None = None, **kwargs) -> tuple[int, dict]:
        """`_call` for an answer lit-ess reads: a JSON object, else one line naming the URL and the answer."""
        status, answer = await self._call(url, method, route, body, **kwargs)
        if not isinstance(answer, dict):
            raise self._not_vllm(url, kwargs.get("what") or f"{method} {route}", answer)
        return status, answer

    def _not_vllm(self, url: str, call: str, answer) -> ServerError:
        return ServerError(f"{self._where(url)}: {call} answered {json.dumps(answer)[:200]}, not what vLLM {VLLM_SERIES}x "
                           f"answers: is {url} a vLLM server (python -m lit_ess.engines.serve)?")

    def _field(self, url: str, call: str, answer: dict, key: str, kind: type = dict):
        """answer[key], which vLLM answers as a `kind`; else one line naming the URL and the answer."""
        value = answer.get(key)
        if not isinstance(value, kind):
            raise self._not_vllm(url, call, answer)
        return value

    async def _label(self, url: str) -> str:
        """The label of the weights the server holds (GET /weight_info)."""
        _, answer = await self._ask(url, "GET", "/weight_info")
        return str(self._field(url, "GET /weight_info", answer, "weight_version", (str, int)))

    async def _check_server(self, url: str) -> None:
        """Refuse a server lit-ess cannot use, with the flag to add."""
        fix = "start it with `python -m lit_ess.engines.serve --model MODEL_DIR`, or add"
        _, answer = await self._ask(url, "GET", "/version", knob="startup_timeout")
        version = self._field(url, "GET /version", answer, "version", str)
        if not str(version).startswith(VLLM_SERIES):
            raise ServerError(f"{self._where(url)} runs vLLM {version}; lit-ess speaks the routes of vLLM "
                              f"{VLLM_SERIES}x: install that release there (pyproject.toml pins it)")
        status, info = await self._ask(url, "GET", "/server_info?config_format=json", ok=(200, 404))
        if status == 404:
            raise ServerError(f"{self._where(url)} has no dev routes (GET /server_info: 404): {fix} the environment "
                              f"variable VLLM_SERVER_DEV_MODE=1 to its start")
        vc = self._field(url, "GET /server_info", info, "vllm_config")
        m = self._field(url, "GET /server_info", vc, "model_config")
        if (vc.get("device_config") or {}).get("device") == "cpu" and (vc.get("scheduler_config") or {}).get("enable_chunked_prefill"):
            raise ServerError(f"{self._where(url)} splits prefills on CPU, where vLLM 0.32 crashes on seeded requests "
                              f"so split: {fix} --no-enable-chunked-prefill")
        if m.get("logprobs_mode") != "processed_logprobs":
            raise ServerError(f"{self._where(url)} reports {m.get('logprobs_mode')} logprobs, not what it sampled from: "
                              f"{fix} --logprobs-mode processed_logprobs")
        if self.config.dtype != "auto" and m.get("dtype") != f"torch.{self.config.dtype}":
            raise ServerError(f"{self._where(url)} runs {m.get('dtype')}, engine.dtype is {self.config.dtype}: "
                              f"{fix} --dtype {self.config.dtype} (or set engine.dtype to the server's)")
        if self.config.max_model_len is not None and m.get("max_model_len", 0) < self.config.max_model_len:
            raise ServerError(f"{self._where(url)} takes sequences up to {m.get('max_model_len')} tokens, "
                              f"engine.max_model_len is {self.config.max_model_len}: {fix} --max-model-len "
                              f"{self.config.max_model_len}")
        if self.config.max_lora_rank is not None:
            lora = vc.get("lora_config") or {}
            if (lora.get("max_lora_rank") or 0) < self.config.max_lora_rank:
                raise ServerError(f"{self._where(url)} serves LoRA adapters up to rank {lora.get('max_lora_rank')}, "
                                  f"engine.max_lora_rank is {self.config.max_lora_rank}: {fix} --enable-lora "
                                  f"--max-lora-rank {self.config.lora_rank_flag()}")
            # an unknown adapter: vLLM's handler answers {"error": ...}; without the route FastAPI's {"detail": "Not Found"}
            _, answer = await self._ask(url, "POST", "/v1/unload_lora_adapter", {"lora_name": "lit-ess-probe"},
                                        ok=(400, 404))
            if "error" not in answer:
                raise ServerError(f"{self._where(url)} has no /v1/load_lora_adapter route: {fix} the environment "
                                  f"variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 to its start")
        want = served_model_name(self.model_path)
        models = self._field(url, "GET /v1/models", (await self._ask(url, "GET", "/v1/models"))[1], "data", list)
        names = [str(d.get("id")) for d in models if isinstance(d, dict)]
        if not any(same_model(name, want) for name in names):
            raise ServerError(f"{self._where(url)} serves {names}, whose config.json and tokenizer are not those of "
                              f"{self.model_path} (or cannot be read here): {fix} --served-model-name {want}")
        probe = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "logprobs": 0}}
        status, _ = await self._call(url, "POST", "/inference/v1/generate", probe, "request_timeout",
                                     ok=(200, 403))
        if status == 403:
            raise ServerError(f"{self._where(url)} refuses token-in token-out requests (POST /inference/v1/generate: "
                              f"403): {fix} --enable-scale-out")
        label = await self._label(url)
        if self.role == "follows":             # rank 0 labels the servers (LeaderConfig)
            return
        if self.role == "leads":               # no step yet: a label of an earlier run never passes for this run's
            await self._call(url, "POST", "/update_weight_version", {"new_version": "-1"})
        elif label == "default":
            await self._call(url, "POST", "/update_weight_version", {"new_version": "0"})   # the weights it started with
        elif self.config.max_lora_rank is not None and label != "0":
            raise ServerError(f"{self._where(url)} holds weights pushed by another run (version {label!r}), not the "
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
        return self._run_all([self._group(list(p), n, group_seed(sampling.seed, call_seed, key), sampling,
                                          f"prompt {key}, {n} sample(s)", adapter)
                              for key, p in zip(keys, prompts)])

    async def _group(self, prompt: list[int], n: int, seed: int | None, s: SamplingConfig, what: str,
                     adapter: tuple[str, int] | None = None) -> list[Completion]:
        params = {"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": 0.0,
                  "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "max_tokens": s.max_new_tokens, "stop": list(s.stop) or None, "include_stop_str_in_output": True,
                  "detokenize": bool(s.stop), "seed": seed, "logprobs": 0}
        what = f"{what}, {len(prompt)} prompt tokens"
        async with self.slots:
            while True:                     # a server that is gone: the same request (same seed) to another
                if not (live := self._live()):
                    raise ServerGone(f"no vLLM server is left: {' | '.join(self.gone.values())}")
                url = min(live, key=self.outstanding.__getitem__)               # least outstanding requests
                self.outstanding[url] += 1
                try:
                    body = {"token_ids": prompt, "sampling_params": params}
                    if adapter is not None:
                        body["model"] = adapter[0]
                    _, out = await self._watched(url, self._ask(
                        url, "POST", "/inference/v1/generate", body, knob="request_timeout",
                        what=f"POST /inference/v1/generate ({what})"))
                    break
                except ServerGone as e:
                    self._put_out(url, e)
                finally:
                    self.outstanding[url] -= 1
        return [self._completion(url, choice, ids, lps, out.get("model"), what, adapter)
                for choice, ids, lps in self._sampled(url, f"POST /inference/v1/generate ({what})", out, n)]

    def _completion(self, url: str, choice: dict, ids: list[int], lps: list[float], model: str | None, what: str,
                    adapter: tuple[str, int] | None) -> Completion:
        """One choice of a generate answer: its ids, their logprobs and each token's version (the spans)."""
        if len(lps) != len(ids):
            raise ServerError(f"{self._where(url)}: POST /inference/v1/generate ({what}) returned {len(ids)} tokens "
                              f"with {len(lps)} logprobs")
        try:
            versions = span_versions(choice.get("weight_versions"), len(ids))
        except ValueError as e:
            raise ServerError(f"{self._where(url)}: POST /inference/v1/generate ({what}): {e}") from None
        if adapter is not None:              # sampled by the adapter it named, on the base weights it started with
            if model != adapter[0] or any(v != 0 for v in versions):
                raise ServerError(f"{self._where(url)}: POST /inference/v1/generate ({what}) was sampled by model "
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
            raise self._not_vllm(url, call, out) from None
        if not parsed:
            raise self._not_vllm(url, call, out)
        if len(parsed) != n:
            raise ServerError(f"{self._where(url)}: {call} returned {len(parsed)} choices for n={n}")
        return parsed

    # ---- weights ----

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Write the weights as safetensors into a new folder of weights_dir (renamed into place when
        whole), make every server reload them, label them `version`, reset its prefix cache, check.
        The whole state dict is held in host memory while the file is written (one file).
        A follower gets no tensors: it waits until the servers carry `version`. (Never while a server out of the
        run is being taken back: `_take_back`.)"""
        with self.fleet:
            self._push(named_tensors, version)

    def _push(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        if self.role == "follows":
            self._run(self._follow(version))
            self.version = version
            return
        it = iter(named_tensors)
        first = next(it, None)
        if first is not None and is_adapter_payload([first[0]]):
            return self._load_adapter(dict([first, *it]), version)
        folder = self._write_weights(([first] if first is not None else []) + list(it), version)
        try:
            live = self._live()
            errors = self._run_all([self._reload(u, folder, version) for u in live], return_exceptions=True)
            self._settle(live, errors)     # a server gone may hold any weights now: it serves no more of this run
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
            for url in self._live():
                try:
                    label = await self._label(url)
                except ServerGone as e:
                    self._put_out(url, e)
                    continue
                if not (label.isdigit() and int(label) >= version):
                    behind[url] = label
            if not behind:
                return
            now = time.monotonic()
            if len(behind) < len(self._live()):
                ahead_since = ahead_since or now
                if now - ahead_since > c.control_timeout:
                    for url, label in behind.items():
                        self._put_out(url, ServerGone(f"{self._where(url)} still carries weights {label!r} "
                                                      f"{c.control_timeout:g} s after another server took those of "
                                                      f"step {version}: rank 0 no longer pushes to it"))
                    continue
            if now - t0 > limit:
                url, label = next(iter(behind.items()))
                raise ServerError(f"{self._where(url)} still carries weights {label!r}, not those of step {version}, "
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
        live = self._live()                                         # vLLM answers 5xx for an adapter it cannot load
        errors = self._run_all([self._call(u, "POST", "/v1/load_lora_adapter", body, text_ok=True, gone_on_5xx=False,
                                           what=f"POST /v1/load_lora_adapter from {folder}") for u in live],
                               return_exceptions=True)
        try:
            self._settle(live, errors)
        except BaseException:                                       # the servers that loaded it drop it again
            self._unload(name, [u for u, e in zip(live, errors) if not isinstance(e, BaseException)])
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.adapters.append((name, folder))
        while len(self.adapters) > 2:                               # no request names it any more
            old, old_folder = self.adapters.pop(0)
            self._unload(old, self._live())
            shutil.rmtree(old_folder, ignore_errors=True)
        self.adapter, self.version = (name, version), version

    def _settle(self, urls: list[str], results: list) -> None:
        """After a push to `urls` (`results`: each one's result or exception): the servers gone are out of the
        run (raising when none is left), and the first other error is raised."""
        for url, e in zip(urls, results):
            if isinstance(e, ServerGone):
                self._put_out(url, e)
        if e := next((e for e in results if isinstance(e, BaseException) and not isinstance(e, ServerGone)), None):
            raise e

    def _unload(self, name: str, urls: list[str]) -> None:
        """Unload adapter `name` from `urls`, best effort (a server gone, or that never had it, is fine)."""
        self._run_all([self._call(u, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, ok=(200, 404),
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
        await self._call(url, "POST", "/pause?mode=keep" if keep else "/pause?mode=wait",
                         knob="control_timeout" if keep else "request_timeout")
        try:
            await self._call(url, "POST", "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": folder}},
                             what=f"POST /collective_rpc reload_weights from {folder}")
            await self._call(url, "POST", "/update_weight_version", {"new_version": str(version)})
            _, reset = await self._ask(url, "POST", "/reset_prefix_cache?reset_running_requests=true" if keep
                                       else "/reset_prefix_cache")
            if reset.get("success") is not True:
                raise ServerError(f"{self._where(url)}: POST /reset_prefix_cache answered {reset}: the prefix cache of "
                                  f"the old weights would be reused")
        finally:
            await self._call(url, "POST", "/resume")
        label = await self._label(url)
        if label != str(version):
            raise ServerError(f"{self._where(url)}: GET /weight_info says version {label!r} after pushing {version}: "
                              f"another client updates this server")

    def close(self) -> None:
        """Stop the client, the launched server and remove the weights written here (idempotent)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        for probe in list(getattr(self, "probes", {}).values()):
            self.loop.call_soon_threadsafe(probe.cancel)
        if self.client is not None and self.loop.is_running():
            if self.server is None:                                # servers by URL go on: unload this run's adapters
                for name, _ in self.adapters:
                    self._unload(name, self._live())
            self._run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
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
