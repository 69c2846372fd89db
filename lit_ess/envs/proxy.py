"""The OpenAI-compatible URL users' agents call (lit_ess/envs/agent.py): one HTTP server on 127.0.0.1 for
a runner, one base URL per episode, `http://127.0.0.1:PORT/<episode token>/v1`, with

    POST /chat/completions   {"messages": [...], "tools"?, "max_tokens"?, "stop"?, "logprobs"?}
    POST /completions        {"prompt": text or token ids, "max_tokens"?, "stop"?, "logprobs"?}
    GET  /models

Answers are OpenAI's, with vLLM's `return_token_ids` fields always on (`prompt_token_ids`, each choice's
`token_ids`): the ids the policy saw and sampled. A request lit-ess cannot serve exactly answers HTTP 400
with OpenAI's error body, one line naming the knob; an episode that is over answers 404. The episode
token is random: a timed-out agent's thread cannot post into another episode.

Requests are translated here and served by the episode's session (lit_ess.envs.agent.Session: `chat`,
`complete`, `sampling`) in a thread of the proxy's pool (the engine call blocks); the event loop runs in
a thread of its own. Answers are made from the session's lit_ess.envs.agent.Call records.
"""
from __future__ import annotations

import asyncio
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from lit_ess.sampling import SamplingConfig

MODEL_NAME = "policy"


# sampling knobs of OpenAI's and vLLM's APIs that the run's sampling does not have: served at these values only
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {},
           "min_tokens": 0}


class RequestError(ValueError):
    """A request that cannot be served exactly: HTTP 400, one line."""


def request_sampling(body: dict, run: SamplingConfig) -> SamplingConfig:
    """The run's sampling with a request's max_tokens (capped by the run's) and stop strings; a request
    that asks for other temperature, top_p or top_k, penalties, biases or floors (NEUTRAL), several samples
    or streaming is refused."""
    for knob, off in (("temperature", None), ("top_p", None), ("top_k", (0, -1))):
        v, want = body.get(knob), getattr(run, knob)
        if v is not None and v != want and not (off and v in off and want in off):
            raise RequestError(f"{knob}={v}: lit-ess samples with the run's data.sampling.{knob}={want} (the trainer "
                               f"scores the tokens with it): leave {knob} out of the request or set data.sampling.{knob}")
    for knob, neutral in NEUTRAL.items():
        v = body.get(knob)
        if v is not None and v != neutral:
            raise RequestError(f"{knob}={v!r}: lit-ess samples with the run's data.sampling, which has no {knob} (the "
                               f"trainer scores the tokens as sampled): leave {knob} out of the request")
    if body.get("n", 1) not in (1, None):
        raise RequestError(f"n={body['n']}: one sample per call (data.batch.samples_per_prompt plays each example that "
                           f"many times)")
    if body.get("stream"):
        raise RequestError("stream: true is not served: ask without streaming")
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise RequestError(f"max_tokens={cap!r} is not an integer >= 1")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise RequestError(f"stop={stop!r} is not a string or a list of strings")
    return replace(run, max_new_tokens=min(cap or run.max_new_tokens, run.max_new_tokens),
                   stop=run.stop if stop is None else [stop] if isinstance(stop, str) else list(stop))


def chat_messages(body: dict) -> list[dict]:
    """A request's messages, each content as text (a list of text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role', 'content'}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"message {m!r} has no role")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RequestError(f"message {str(m)[:200]} has no text content (tool calls are text the agent parses)")
        out.append({**m, "content": content})
    return out


def _usage(call) -> dict:
    p, c = len(call.prompt_ids), len(call.sample.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chat_answer(call, tokenizer, logprobs: bool, rid: str) -> dict:
    s = call.sample
    lps = None
    if logprobs:
        lps = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                           for t, lp in zip(tokenizer.convert_ids_to_tokens(s.token_ids), s.logprobs)]}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": MODEL_NAME,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": call.text}, "logprobs": lps,
                         "finish_reason": s.finish_reason, "token_ids": list(s.token_ids)}],
            "prompt_token_ids": list(call.prompt_ids), "usage": _usage(call)}


def completion_answer(call, tokenizer, logprobs: bool, rid: str) -> dict:
    s = call.sample
    lps = None
    if logprobs:
        lps = {"tokens": tokenizer.convert_ids_to_tokens(s.token_ids), "token_logprobs": list(s.logprobs),
               "top_logprobs": None, "text_offset": None}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": MODEL_NAME,
            "choices": [{"index": 0, "text": call.text, "logprobs": lps, "finish_reason": s.finish_reason,
                         "prompt_token_ids": list(call.prompt_ids), "token_ids": list(s.token_ids)}],
            "usage": _usage(call)}


def serve_chat(session, body: dict, tokenizer, rid: str) -> dict:
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not served (the sampled token's logprob is: logprobs: true)")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools={tools!r} is not a list of tool schemas")
    call = session.chat(chat_messages(body), tools, request_sampling(body, session.sampling))
    return chat_answer(call, tokenizer, bool(body.get("logprobs")), rid)


def serve_completion(session, body: dict, tokenizer, rid: str) -> dict:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                   # a batch of one
    if not (isinstance(prompt, str) and prompt or isinstance(prompt, list) and prompt and
            all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise RequestError("prompt must be a non-empty text or list of token ids (one prompt per call)")
    if body.get("logprobs") not in (None, 0, 1, True, False):
        raise RequestError(f"logprobs={body['logprobs']}: only the sampled token's logprob is served (logprobs: 1)")
    if body.get("echo"):
        raise RequestError("echo is not served: the answer's prompt_token_ids are the prompt's ids")
    call = session.complete(prompt, request_sampling(body, session.sampling))
    return completion_answer(call, tokenizer, body.get("logprobs") not in (None, False), rid)


class Proxy:
    """The HTTP server of a runner's episodes (started at construction, on a free port of 127.0.0.1)."""

    def __init__(self, tokenizer, threads: int = 256):
        from aiohttp import web

        self.tokenizer = tokenizer
        self.sessions: dict = {}                    # episode token -> its Session
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="lit-ess-agent-call")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lit-ess-agent-proxy", daemon=True)
        self.thread.start()
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/{sid}/v1/chat/completions", lambda r: self._serve(r, serve_chat))
        app.router.add_post("/{sid}/v1/completions", lambda r: self._serve(r, serve_completion))
        app.router.add_get("/{sid}/v1/models", self._models)
        self.app_runner = web.AppRunner(app, access_log=None)

        async def start():
            await self.app_runner.setup()
            site = web.TCPSite(self.app_runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self.calls = 0

    def open(self, session) -> str:
        """A new episode's base URL."""
        sid = secrets.token_hex(8)
        self.sessions[sid] = session
        return f"http://127.0.0.1:{self.port}/{sid}/v1"

    def close_session(self, url: str) -> None:
        self.sessions.pop(url.rstrip("/").split("/")[-2], None)

    @staticmethod
    def _error(status: int, message: str, kind: str = "invalid_request_error"):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    async def _models(self, request):
        from aiohttp import web

        if request.match_info["sid"] not in self.sessions:
            return self._error(404, "no such episode (it is over)", "not_found_error")
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "lit-ess"}]})

    async def _serve(self, request, serve):
        from aiohttp import web

        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return self._error(404, "no such episode (it is over)", "not_found_error")
        try:
            body = await request.json()
        except ValueError:
            return self._error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return self._error(400, "the request body is not a JSON object")
        self.calls += 1
        rid = f"lit-ess-{request.match_info['sid']}-{self.calls}"
        try:
            out = await self.loop.run_in_executor(self.pool, serve, session, body, self.tokenizer, rid)
        except RequestError as e:
            return self._error(400, str(e))
        except Exception as e:          # noqa: BLE001 - the engine's failure, told to the agent in one line
            return self._error(500, f"{type(e).__name__}: {e}", "server_error")
        return web.json_response(out)

    def close(self) -> None:
        """Stop the server and its threads (idempotent)."""
        if not self.loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self.app_runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.pool.shutdown(wait=False, cancel_futures=True)
