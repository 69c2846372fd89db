"""Launching a vLLM server lit-ess can use, on this machine: its command, its environment, its port and its process.

The command (`server_command`, also what `python -m lit_ess.engines.serve` runs) has the flags the client
checks at start: processed logprobs, the token route (`--enable-scale-out`), lit-ess's guard middleware and a
model name that carries the model's fingerprint (`served_model_name`), so that a server by URL is known to
serve the trainer's model. `launch` refuses a port another process holds and a host other machines reach
without the shared token, then starts the server (`LaunchedServer`) in its own process group, tied to this
process (it gets SIGTERM when the thread that launched it dies, even by kill -9), its output in a log file;
its readiness check reads back the id it was launched with, so no other process listening on the port is
taken for it. The HTTP client of the servers is lit_ess/engines/server_pool.py; the engine and its config,
lit_ess/engines/vllm_server.py.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Protocol

import torch

from .guard import ID_ENV, ID_HEADER, exposure_error, listener, port_holder
from .server_pool import ServerError

# config.json keys that do not change what the network computes, left out of the fingerprint
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "name_or_path"}


class ServerSettings(Protocol):
    """What launching reads of a server's settings (`VLLMServerConfig` has them all)."""

    dtype: str
    max_model_len: int | None
    gpu_memory_utilization: float | None
    kv_cache_gib: float
    enforce_eager: bool
    seed: int
    max_lora_rank: int | None
    server_args: list[str]

    def lora_rank_flag(self) -> int | None: ...


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


def server_command(model_path: str, c: ServerSettings, host: str, port: int) -> list[str]:
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


def server_env(c: ServerSettings) -> dict[str, str]:
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


def launch(model_path: str, c: ServerSettings, host: str, port: int, log_file: str | None,
           serve: bool = False, env: dict[str, str] | None = None) -> LaunchedServer:
    """Launch a server for `model_path` on `host`:`port` (vLLM's last --host in `c.server_args` wins) once it
    is known to be lit-ess's alone: the port is free, and a host other machines reach has the shared token (one
    line naming the knob otherwise: `serve`'s flags, or the engine's); it is given a new id, which its
    readiness check reads back (lit_ess/engines/guard.py). `env`: more of its environment (its devices)."""
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
    return LaunchedServer(cmd, dict(server_env(c), **(env or {}), **{ID_ENV: server_id}), log_file, f"http://{local}:{port}",
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
