"""The HTTP client of a run's vLLM servers: calls, failover, the heartbeat, and taking a server back in.

Every call goes through one aiohttp session on an event loop of its own thread (callable from any thread),
over kept-alive connections, with the shared token of lit_ess/engines/guard.py. A call that finds its
kept-alive connection closed by the server goes once more on a new one; one that gets no answer within the
seconds of its knob, or a refused or reset connection, raises ServerGone, whose line names the server, the
call and the knob. A generate request (`dispatch`) goes to the live server with the fewest outstanding
requests; a server gone is out of the run and the same request (its seed: the same tokens) goes to another.
The heartbeat asks each busy server GET /health and puts out one that misses twice, so its requests go
elsewhere at once; a server out that answers again is taken back by a thread of its own, once the pool's
owner (the engine, through `PoolOwner`) has brought it to the run's weights. The pool keeps its own record
of the servers (in the run, out and why, busy); it knows nothing of weights or models: the owner does.
The engine is lit_ess/engines/vllm_server.py; launching a server, lit_ess/engines/server_launch.py.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Protocol

from .base import EngineFault
from .guard import auth_headers, unauthorized_hint

VLLM_SERIES = "0.32."       # the vLLM release lit-ess is written against (pyproject.toml pins it)


class ServerError(EngineFault):
    """A failed HTTP call to a server: one line with the URL, the call and what came back."""


class ServerGone(ServerError):
    """A server that did not answer (connection refused or reset, no answer within the timeout) or failed
    inside (HTTP 5xx): it is out of the run, and its requests go to the other servers."""


class PoolKnobs(Protocol):
    """The engine knobs the pool reads (`VLLMServerConfig` has them): seconds a call may take, named in errors
    as `engine.<knob>`, the heartbeat's period, and how many generate requests may be in flight at once."""

    startup_timeout: float
    request_timeout: float
    control_timeout: float
    heartbeat_seconds: float | None
    heartbeat_timeout: float
    max_concurrency: int


class PoolOwner(ABC):
    """What the pool asks of the engine it serves: how to name a server in an error, and how to bring a
    server that answers again back to the run's weights before it takes requests."""

    @abstractmethod
    def where(self, url: str) -> str:
        """The server at `url` as every error names it ("vLLM server URL", with the log of a launched one)."""

    @abstractmethod
    async def restore(self, url: str) -> int:
        """Check the server at `url` as at start and give it the run's weights and label (on the pool's loop);
        the optimizer step whose weights it now holds. A ServerError says why it cannot be taken back."""


class ServerPool:
    """The client of the servers `urls` (`enlist`): one session on its own event loop, the servers in the run
    and out of it, generate requests spread by least outstanding requests, the heartbeat and the take-back."""

    def __init__(self, knobs: PoolKnobs, owner: PoolOwner):
        self.knobs, self.owner, self.closed = knobs, owner, False
        self.loop = asyncio.new_event_loop()       # the HTTP client's, in its own thread: callable from any thread
        self.thread = threading.Thread(target=self.loop.run_forever, name="lit-ess-vllm-server-client", daemon=True)
        self.thread.start()
        self.client = self.run(self._make_client())
        self.heartbeat = None                      # the heartbeat task's future, once the servers passed their checks
        self.fleet = threading.Lock()      # a push and the taking back of a server are never interleaved
        self.enlist([])

    def enlist(self, urls: list[str]) -> None:
        """The servers of the run, all in it."""
        self.urls = urls
        self.outstanding = {u: 0 for u in self.urls}
        self.gone: dict[str, str] = {}     # servers out of the run, with the error that put them out
        self.silence = {u: asyncio.Event() for u in self.urls}  # set when the heartbeat puts it out
        self.answered = {u: 0.0 for u in self.urls}              # when it last answered a generate request
        self.back: set[str] = set()        # servers out of the run that answer GET /health again (`_probe`)
        self.probes: dict[str, asyncio.Future] = {}               # the probes of servers out, running
        self.refusals: dict[str, str] = {}                        # why a server back was not taken back
        self.retry_at: dict[str, tuple[float, float]] = {}        # a refused one: (next probe time, its wait)

    async def _make_client(self):
        import aiohttp

        self.slots = asyncio.Semaphore(self.knobs.max_concurrency)
        # idle connections close before uvicorn's 5 s keep-alive does: reusing one it has closed fails the request.
        # No connection limit: `slots` bounds the generate requests, and a control call must never queue behind
        # them (an in-flight update's /pause would wait for the very requests it should freeze)
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
                                     headers=auth_headers())     # the fleet's shared token (lit_ess/engines/guard.py)

    def run(self, coro):
        """Run `coro` on the client's event loop (its own thread) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def run_all(self, coros, return_exceptions: bool = False) -> list:
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

        return self.run(gather())

    # ---- calls ----

    async def request(self, url: str, method: str, route: str, body: dict | None, knob: str, call: str,
                      seconds: float | None = None) -> tuple[int, str]:
        """One HTTP call: its status and text, or a ServerError naming the URL and the call. It may take the
        seconds of the engine knob `knob` (`seconds` when given), which a timeout names."""
        import aiohttp

        timeout = getattr(self.knobs, knob) if seconds is None else seconds

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
            raise ServerGone(f"{self.owner.where(url)}: {call} got no answer in {timeout:.0f} s "
                             f"(engine.{knob})") from None
        except aiohttp.ClientError as e:
            raise ServerGone(f"{self.owner.where(url)}: {call} failed: {type(e).__name__}: {e}") from None

    async def call(self, url: str, method: str, route: str, body: dict | None = None, knob: str = "control_timeout",
                   what: str | None = None, ok: tuple[int, ...] = (200,), text_ok: bool = False,
                   gone_on_5xx: bool = True) -> tuple[int, dict]:
        """One HTTP call whose status must be in `ok`, within the seconds of the engine knob `knob`: its status
        and JSON body ({} when empty; {"text": ...} for a plain-text answer where `text_ok`). HTTP 5xx puts the
        server out (`gone_on_5xx`), or is an error of the call (a load that failed inside: the server is fine)."""
        call = what or f"{method} {route}"
        status, text = await self.request(url, method, route, body, knob, call)
        if status == 401 and 401 not in ok:
            raise ServerError(f"{self.owner.where(url)}: {call} answered HTTP 401 (unauthorized): "
                              f"{unauthorized_hint()}")
        if status not in ok:
            error = ServerGone if status >= 500 and gone_on_5xx else ServerError
            raise error(f"{self.owner.where(url)}: {call} answered HTTP {status}: {text[:300]!r}")
        if text_ok and text and not text.lstrip().startswith(("{", "[")):
            return status, {"text": text}
        try:
            return status, json.loads(text) if text else {}
        except json.JSONDecodeError:
            raise ServerError(f"{self.owner.where(url)}: {call} answered no JSON: {text[:300]!r}") from None

    async def ask(self, url: str, method: str, route: str, body: dict | None = None, **kwargs) -> tuple[int, dict]:
        """`call` for an answer lit-ess reads: a JSON object, else one line naming the URL and the answer."""
        status, answer = await self.call(url, method, route, body, **kwargs)
        if not isinstance(answer, dict):
            raise self.not_vllm(url, kwargs.get("what") or f"{method} {route}", answer)
        return status, answer

    def not_vllm(self, url: str, call: str, answer) -> ServerError:
        return ServerError(f"{self.owner.where(url)}: {call} answered {json.dumps(answer)[:200]}, not what vLLM "
                           f"{VLLM_SERIES}x answers: is {url} a vLLM server (python -m lit_ess.engines.serve)?")

    def field(self, url: str, call: str, answer: dict, key: str, kind: type = dict):
        """answer[key], which vLLM answers as a `kind`; else one line naming the URL and the answer."""
        value = answer.get(key)
        if not isinstance(value, kind):
            raise self.not_vllm(url, call, answer)
        return value

    # ---- the servers in the run ----

    def live(self) -> list[str]:
        return [u for u in self.urls if u not in self.gone]

    def put_out(self, url: str, error: ServerGone) -> None:
        """Take `url` out of the run for `error`; when no server is left, raise `error` saying so."""
        if url not in self.gone:
            self.gone[url] = str(error)
            if live := self.live():
                print(f"lit-ess: warning: {error}; its requests go to the other {len(live)} server(s) from now on",
                      file=sys.stderr, flush=True)
        if not self.live():
            before = [u for u in self.gone if u != url]
            raise ServerGone(f"{error}; no other server is left ({len(self.urls)} in engine.urls; out before: "
                             f"{', '.join(before)})" if before else str(error)) from None

    def settle(self, urls: list[str], results: list) -> None:
        """After a call to each of `urls` (`results`: each one's result or exception): the servers gone are out of
        the run (raising when none is left), and the first other error is raised."""
        for url, e in zip(urls, results):
            if isinstance(e, ServerGone):
                self.put_out(url, e)
        if e := next((e for e in results if isinstance(e, BaseException) and not isinstance(e, ServerGone)), None):
            raise e

    async def dispatch(self, route: str, body: dict, call: str) -> tuple[str, dict]:
        """POST `body` to `route` of the live server with the fewest outstanding requests, within request_timeout
        and one of max_concurrency slots: the server that answered and its answer. A server gone is out of the
        run, and the same request goes to another (with its seed: the same tokens)."""
        async with self.slots:
            while True:                     # a server that is gone: the same request (same seed) to another
                if not (live := self.live()):
                    raise ServerGone(f"no vLLM server is left: {' | '.join(self.gone.values())}")
                url = min(live, key=self.outstanding.__getitem__)               # least outstanding requests
                self.outstanding[url] += 1
                try:
                    _, out = await self._watched(url, self.ask(url, "POST", route, body, knob="request_timeout",
                                                               what=call))
                    return url, out
                except ServerGone as e:
                    self.put_out(url, e)
                finally:
                    self.outstanding[url] -= 1

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

    # ---- the heartbeat and the take-back ----

    def start_heartbeat(self) -> None:
        """Watch the servers every heartbeat_seconds (`_heartbeat`), unless that knob is None."""
        if self.knobs.heartbeat_seconds is not None:
            self.heartbeat = asyncio.run_coroutine_threadsafe(self._heartbeat(), self.loop)
            self.heartbeat.add_done_callback(self._heartbeat_ended)

    async def _heartbeat(self) -> None:
        """Every heartbeat_seconds, GET /health of each server with requests in flight. A server that misses
        two in a row (no answer within heartbeat_timeout, an error or a 5xx), answering no generate request
        meanwhile, is out of the run at once: its requests give up (`_watched`) and go to the other servers
        with their seeds, which request_timeout would do much later. vLLM answers /health from its API
        process, so this finds an API server stopped or cut off, not a hung engine core."""
        c, misses = self.knobs, {u: 0 for u in self.urls}
        while True:
            await asyncio.sleep(c.heartbeat_seconds)
            for url in list(self.gone):        # out of the run: does it answer again? (a call then takes it back)
                misses[url] = 0
                if url not in self.probes and url not in self.back and time.monotonic() >= self.retry_at.get(url, (0, 0))[0]:
                    self.probes[url] = asyncio.ensure_future(self._probe(url))
            busy = [u for u in self.live() if self.outstanding[u] > 0]
            t0 = time.monotonic()
            answers = await asyncio.gather(*(self.request(u, "GET", "/health", None, "heartbeat_timeout",
                                                          "GET /health (heartbeat)") for u in busy),
                                           return_exceptions=True)
            for url, a in zip(busy, answers):
                if isinstance(a, tuple) and a[0] < 500 or self.answered[url] > t0:
                    misses[url] = 0
                    continue
                misses[url] += 1
                if misses[url] >= 2 and url in self.live():
                    why = f"HTTP {a[0]}" if isinstance(a, tuple) else str(a).removeprefix(f"{self.owner.where(url)}: ")
                    self.gone[url] = (f"{self.owner.where(url)}: GET /health (heartbeat) failed twice in a row with "
                                      f"{self.outstanding[url]} request(s) in flight (engine.heartbeat_timeout "
                                      f"{c.heartbeat_timeout:g} s): {why}")
                    if live := self.live():
                        print(f"lit-ess: warning: {self.gone[url]}; its requests go to the other {len(live)} "
                              f"server(s) from now on", file=sys.stderr, flush=True)
                    self.silence[url].set()

    def _heartbeat_ended(self, future) -> None:
        """The heartbeat never ends but by close(): say so when it does, since servers then go unwatched."""
        if not future.cancelled() and future.exception() is not None:
            print(f"lit-ess: warning: the vLLM server heartbeat stopped: {future.exception()!r}; silent servers are "
                  f"now found after engine.request_timeout only", file=sys.stderr, flush=True)

    async def _probe(self, url: str) -> None:
        """GET /health of a server out of the run, within heartbeat_timeout: answering 200 (restarted, or reachable
        again), it is taken back by a thread of its own (`_take_back`), while the run goes on without it."""
        try:
            if (await self.request(url, "GET", "/health", None, "heartbeat_timeout", "GET /health (probe)"))[0] == 200:
                self.back.add(url)
                threading.Thread(target=self._take_back, name="lit-ess-vllm-server-take-back", daemon=True).start()
        except ServerError:
            pass
        finally:
            self.probes.pop(url, None)

    def _take_back(self) -> None:
        """Take back into the run each server out of it that answers again (the heartbeat's probe), once the owner
        restored it (start checks, the run's weights and their label), all within control_timeout. One that fails
        stays out, the reason said once. Never while the owner holds `fleet` (a push, which waits at most
        control_timeout): the server gets the weights of the last push that ended."""
        with self.fleet:
            urls, self.back = [u for u in self.back if u in self.gone], set()
            if self.closed or not urls:
                return
            rejoins = [asyncio.wait_for(self._rejoin(u), self.knobs.control_timeout) for u in urls]
            for url, result in zip(urls, self.run_all(rejoins, return_exceptions=True)):
                if isinstance(result, asyncio.TimeoutError):
                    result = ServerError(f"{self.owner.where(url)}: taking it back (checks, weights, label) took more "
                                         f"than {self.knobs.control_timeout:g} s (engine.control_timeout)")
                if not isinstance(result, BaseException):
                    print(f"lit-ess: vLLM server {url} is back: it holds the weights of step {result} again "
                          f"and takes requests from now on", file=sys.stderr, flush=True)
                    continue
                self._back_off(url)
                if self.refusals.get(url) != str(result):
                    self.refusals[url] = str(result)
                    print(f"lit-ess: warning: vLLM server {url} answers again but stays out of the run: {result}",
                          file=sys.stderr, flush=True)

    def _back_off(self, url: str) -> None:
        """A server refused: probe it again after twice the last wait (from heartbeat_seconds, at most 60 s), so a
        server that keeps failing its take-back does not hold the fleet lock, which pushes wait for, at every beat."""
        wait = min(60.0, 2 * self.retry_at.get(url, (0, (self.knobs.heartbeat_seconds or 5.0) / 2))[1])
        self.retry_at[url] = (time.monotonic() + wait, wait)

    async def _rejoin(self, url: str) -> int:
        """The owner restores the server, then it is in the run again (on the client's loop, where generation reads
        `gone`); the step whose weights it holds."""
        step = await self.owner.restore(url)
        self.silence[url] = asyncio.Event()
        self.refusals.pop(url, None)
        self.retry_at.pop(url, None)
        del self.gone[url]
        return step

    # ---- closing ----

    def stop_heartbeat(self) -> None:
        """No more heartbeats, probes or servers taken back (the first step of closing)."""
        self.closed = True
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        for probe in list(self.probes.values()):
            self.loop.call_soon_threadsafe(probe.cancel)

    def running(self) -> bool:
        """Whether calls can still be made (the session is open, its loop runs)."""
        return self.client is not None and self.loop.is_running()

    def close(self) -> None:
        """Close the session and stop the loop's thread."""
        if self.running():
            self.run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
