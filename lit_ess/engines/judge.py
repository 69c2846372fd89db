"""An LLM judge: a reward read from an LLM's reply, through vLLM's OpenAI-compatible API.

Each sample's request is `template` filled with its {prompt}, {completion}, {answer} and any dataset column
by name, sent as one user message (`/v1/chat/completions`) or as the prompt itself (`chat: false`,
`/v1/completions`), at `temperature` 0 by default, `concurrency` requests of a phase at once. The score is
the last match of `score_regex` in the reply (its first group, if it has one), divided by `max_score`:

    reply "... so I give it 7/10. Score: 8"     score_regex -?\\d+(?:\\.\\d+)?, max_score 10  ->  0.8

A reply with no match, a number outside [0, max_score], an HTTP error and a request past
`request_timeout` fail that sample: it scores 0 and is counted in rollout/reward_errors, as any failing
reward (lit_ess.rewards.RewardScorer; data.reward_limits.max_error_rate stops a run whose judge fails too often).

The judge is a server by `url` (shared by every rank), or, with none, a second vLLM server that the process
that scores launches on this machine on its first call: one per rank, on the rank's own GPU
(lit_ess/engines/server_launch.py, as the engine launches its own: port checked, its log in a file, stopped
when that process ends). lit-ess's server token (LIT_ESS_SERVER_TOKEN) goes only to a launched judge or one
on this machine's loopback; another server gets the key `api_key_env` names, or none.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import string
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..knobs import check
from ..model_path import check_model_path
from ..rewards import ModelReward
from .guard import auth_headers

DEFAULT_TEMPLATE = ("Rate how well the response answers the question, from 0 (wrong) to 10 (right and clear).\n\n"
                    "Question: {prompt}\n\nReference answer: {answer}\n\nResponse: {completion}\n\n"
                    "End your reply with 'Score: N'.")

# launched judges of this process: (model, settings) -> (url, served name, server), or the error its launch raised
_SERVERS: dict[tuple[str, JudgeServer], tuple[str, str, object] | Exception] = {}
_LOCK = threading.Lock()
RANK_DEVICE_ENV = "LIT_ESS_RANK_DEVICE"     # a rollout worker process's rank's GPU, set by lit_ess/rollout/placement.py


@dataclass(frozen=True)
class JudgeServer:
    """What server_launch reads of a launched judge's settings (ServerSettings): LLMJudge's, eager, seed 0, no LoRA."""
    dtype: str
    max_model_len: int | None
    gpu_memory_utilization: float | None
    kv_cache_gib: float
    server_args: tuple[str, ...]
    enforce_eager: bool = True
    seed: int = 0
    max_lora_rank: None = None

    def lora_rank_flag(self) -> None:
        return None


def rank_device() -> dict[str, str]:
    """The launched judge's CUDA_VISIBLE_DEVICES: this rank's GPU (a rollout worker process's, as placement
    named it; else this process's current device), not every device this process sees. {} on CPU."""
    import torch

    from .base import visible_devices

    if RANK_DEVICE_ENV in os.environ:
        return {"CUDA_VISIBLE_DEVICES": os.environ[RANK_DEVICE_ENV]}
    if not torch.cuda.is_available():
        return {}
    return {"CUDA_VISIBLE_DEVICES": visible_devices([torch.cuda.current_device()],
                                                    os.environ.get("CUDA_VISIBLE_DEVICES"))}


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class LLMJudge(ModelReward):
    """An LLM judge through vLLM's OpenAI-compatible API; logged as train/reward/judge unless named.

    Args:
        model: the judge model: a server's model name (`url`), or the folder of the model to launch.
        url: a running OpenAI-compatible server (`http://host:port`, its routes under /v1; a trailing /v1
            is dropped), shared by every rank. None = launch a vLLM server for `model` (a folder) on this
            machine, from the process that scores, on its first call: one per rank, on the rank's GPU.
        template: the request, a Python format string of {prompt}, {completion}, {answer} and any dataset
            column by name (write a literal brace twice: {{ }}).
        chat: send the template as a user message to /v1/chat/completions (the judge's chat template);
            false: as the prompt of /v1/completions.
        score_regex: the score is the last match of this regular expression in the reply (its first
            group, if it has one); a reply without one fails the sample.
        max_score: the judge's scale: the score is the number / max_score, and a number outside
            [0, max_score] fails the sample. (> 0)
        max_tokens: tokens of a reply at most (>= 1).
        temperature: the judge's sampling temperature (>= 0; 0 = greedy, the same reply every time).
        concurrency: requests of a phase in flight at once (>= 1).
        request_timeout: seconds one request may take (> 0); a slower one fails its sample.
        extra_body: more fields of each request, as they are, e.g. vLLM's structured outputs
            {structured_outputs: {regex: "Score: [0-9]"}} to make the reply parse.
        api_key_env: the environment variable holding the server's API key (sent as a bearer token; it must
            be set, not empty); None = none (lit-ess's LIT_ESS_SERVER_TOKEN, when set, is sent to a launched
            judge or one on the loopback, never to another host).
        dtype: launched server: its --dtype.
        max_model_len: launched server: its --max-model-len; None = the model's.
        gpu_memory_utilization: launched server: share of device memory (of RAM on CPU) vLLM may take;
            None = 0.1 on CPU, 0.4 on CUDA. Beside the policy's engine on one GPU, the two shares must fit.
        kv_cache_gib: launched server on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).
        server_args: launched server: more command-line flags, as they are.
        startup_timeout: launched server: seconds to wait for it to answer /health (> 0).
    """

    model: str
    url: str | None = None
    template: str = DEFAULT_TEMPLATE
    chat: bool = True
    score_regex: str = r"-?\d+(?:\.\d+)?"
    max_score: float = 10.0
    max_tokens: int = 256
    temperature: float = 0.0
    concurrency: int = 16
    request_timeout: float = 60.0
    extra_body: dict = field(default_factory=dict)
    api_key_env: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_gib: float = 1.0
    server_args: list[str] = field(default_factory=list)
    startup_timeout: float = 300.0

    label = "judge"

    def __post_init__(self):
        check("LLMJudge.max_score", self.max_score, gt=0)
        check("LLMJudge.max_tokens", self.max_tokens, ge=1, integer=True)
        check("LLMJudge.temperature", self.temperature, ge=0)
        check("LLMJudge.concurrency", self.concurrency, ge=1, integer=True)
        check("LLMJudge.request_timeout", self.request_timeout, gt=0)
        check("LLMJudge.startup_timeout", self.startup_timeout, gt=0)
        check("LLMJudge.max_model_len", self.max_model_len, ge=1, integer=True, null=True)
        check("LLMJudge.gpu_memory_utilization", self.gpu_memory_utilization, gt=0, le=1, null=True)
        check("LLMJudge.kv_cache_gib", self.kv_cache_gib, gt=0)
        if self.url is None:
            check_model_path(self.model, "LLMJudge.model")
            if not Path(self.model).is_dir():
                raise ValueError(f"LLMJudge.model={self.model!r} is not a folder: a launched judge (url: null) serves a "
                                 f"model folder (download it first), or give the url of a server that serves it")
        elif not self.url.startswith(("http://", "https://")):
            raise ValueError(f"LLMJudge.url={self.url!r} is not an http(s):// URL")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"LLMJudge.api_key_env={self.api_key_env!r}: that environment variable is unset or "
                             f"empty: export the judge server's key in it, or set api_key_env: null")
        try:
            re.compile(self.score_regex)
        except re.error as e:
            raise ValueError(f"LLMJudge.score_regex={self.score_regex!r} is not a regular expression: {e}") from None
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        except ValueError as e:
            raise ValueError(f"LLMJudge.template is not a format string: {e} (write a literal brace twice: {{{{ }}}})") \
                from None
        if bad := sorted(f for f in fields if not f.isidentifier()):
            raise ValueError(f"LLMJudge.template: {{{bad[0]}}} is not a name: fields are {{prompt}}, {{completion}}, "
                             f"{{answer}} or a dataset column (write a literal brace twice: {{{{ }}}})")

    def check_columns(self, columns: list[str]) -> None:
        """Every field of the template is prompt, completion, answer or one of the dataset's `columns`."""
        fields = [name for _, name, _, _ in string.Formatter().parse(self.template) if name]
        if missing := [f for f in fields if f not in ("prompt", "completion", "answer", *columns)]:
            raise ValueError(f"LLMJudge.template names {{{missing[0]}}}, which is neither prompt, completion, answer "
                             f"nor a column of the dataset (columns: {', '.join(columns) or 'none'})")

    def server(self) -> tuple[str, str]:
        """(base URL, model name): `url` and `model`, or the server launched for `model` by this process."""
        if self.url is not None:
            url = self.url.rstrip("/")
            return url.removesuffix("/v1"), self.model            # the OpenAI base_url form: routes add /v1
        from .server_launch import free_port, launch, served_model_name

        key = JudgeServer(self.dtype, self.max_model_len, self.gpu_memory_utilization, self.kv_cache_gib,
                          tuple(self.server_args))
        with _LOCK:
            if (self.model, key) not in _SERVERS:
                try:
                    server = launch(self.model, key, "127.0.0.1", free_port(), None, env=rank_device())
                    server.wait_ready(self.startup_timeout)
                    _SERVERS[self.model, key] = (server.url, served_model_name(self.model), server)
                except Exception as e:               # kept: every later call fails the same way, no relaunch
                    _SERVERS[self.model, key] = RuntimeError(f"the judge's vLLM server did not start: {e}")
            got = _SERVERS[self.model, key]
        if isinstance(got, Exception):
            raise got
        return got[0], got[1]

    def warm_up(self) -> None:
        self.server()

    def request(self, text: str) -> str:
        """The judge's reply to `text`."""
        url, model = self.server()
        body = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature, **self.extra_body}
        route = "/v1/chat/completions" if self.chat else "/v1/completions"
        body.update({"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text})
        req = urllib.request.Request(url + route, data=json.dumps(body).encode(), headers=self.headers())
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:200]
            raise RuntimeError(f"the judge at {url} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise RuntimeError(f"the judge at {url} did not answer within {self.request_timeout:g} s "
                                   f"(request_timeout)") from None
            if isinstance(reason, ConnectionRefusedError):
                raise RuntimeError(f"the judge at {url} refused the connection: no server listens there") from None
            raise RuntimeError(f"the judge at {url} could not be reached: {reason}") from None
        choice = answer["choices"][0]
        return (choice["message"]["content"] if self.chat else choice["text"]) or ""    # null content: no score

    def headers(self) -> dict[str, str]:
        """The request's headers: the key `api_key_env` names; else lit-ess's token, to a launched judge or one on
        the loopback only (never to another host)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key_env is not None:
            return {**headers, "Authorization": f"Bearer {os.environ.get(self.api_key_env, '')}"}
        if self.url is None or is_loopback(self.url):
            return {**headers, **auth_headers()}
        return headers

    def parse(self, reply: str) -> float:
        """The score of a reply (module docstring); ValueError when it has none in range."""
        reply = reply or ""
        found = list(re.finditer(self.score_regex, reply))
        if not found:
            raise ValueError(f"no score in the judge's reply {reply[-120:]!r} (score_regex {self.score_regex!r})")
        last = found[-1]
        text = last.group(1) if last.re.groups else last.group(0)
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise ValueError(f"the judge's score {text!r} is not a number (score_regex {self.score_regex!r})") from None
        if not 0 <= value <= self.max_score:
            raise ValueError(f"the judge's score {value:g} is outside [0, {self.max_score:g}] (max_score)")
        return value / self.max_score

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str], **columns) -> list:
        """One score per sample, or the exception that failed it."""
        def one(i: int):
            try:
                fields = {k: v[i] for k, v in columns.items()}
                text = self.template.format(**{**fields, "prompt": prompts[i], "completion": completions[i],
                                               "answer": answers[i]})
            except KeyError as e:
                return ValueError(f"LLMJudge.template names {{{e.args[0]}}}, which is neither prompt, completion, "
                                  f"answer nor a column of the dataset (columns: {', '.join(columns) or 'none'})")
            try:
                return self.parse(self.request(text))
            except Exception as e:
                return e

        self.server()                   # a launch happens once, before the requests
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(one, range(len(completions))))
