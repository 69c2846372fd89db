"""WorkerProcess: a RolloutWorker in its own OS process, so generation runs beside training.

    trainer process                                   worker process (spawn)
    ---------------                                   ----------------------
    load_weights(state, v) -> transport.push(...)     requests.get() -> Transport(msg): transport.receive
        messages it sends go on the request queue      -> a Submit naming newer weights: transport.load
    submit(request) -> requests.put(Submit(...))      -> worker.sample(request)     (engine)
    poll(timeout) -> [(id, result)]                   -> scoring thread: worker.score(...) (rewards)
                                                         -> results.put(Result(pickled))

The messages are small frozen dataclasses, one per kind, pickled through the queues and matched by
type: to the worker Submit, Restore, Transport, Stop; back Ready, Stage, Loaded, Result, Failed (each
but Failed stamped with when it was sent, for the watchdog below).

Weights travel by the engine config's transport (lit_ess/rollout/transport.py): shared memory by
default (the trainer copies into a slot no queued request names; the worker's engine reads it with
`reload_weights`, then resets and checks its prefix cache), or vLLM's NCCL weight transfer on GPUs.
Transport messages share the request queue, so the worker applies them in order with the requests.

In-flight updates (an engine whose `updates_in_flight()` is true, e.g. VLLMServerConfig with
`weight_update: in_flight`): every push also goes, as its ticket, on a second queue that a thread of
the worker reads while the main thread samples, so the engine takes the weights while the phase's
requests run (and they go on with them). One such load is outstanding at a time: the worker answers
each with Loaded(version), and the next push first waits for that answer (a load takes a fraction
of a second; the slots in use are then those of the queued requests only).
The worker process gets the engine config's `worker_env()` (e.g. CUDA_VISIBLE_DEVICES for an engine
on GPUs of its own, or for the server it launches). It exits when told to, and the kernel stops it when the trainer process ends (lit_ess.lifetime).

A progress watchdog: the worker reports each stage it begins (loading weights, sampling, scoring a
request) and each result. When a request is in flight and the worker has sent nothing for
`progress_timeout` seconds (a hung engine or reward, a stopped or swapped-out process), `poll`
kills it and raises a WorkerError that names its pid, its last reported stage and the requests in
flight, instead of waiting forever. The clock starts at the later of the last message and the
submission that gave an idle worker work, so time the worker spent idle never counts. With several
ranks each rank's watchdog watches its own worker: the rank whose worker stalls raises, and the others
stop in the same round (lit_ess/rollout/ranks.py `in_step`).
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass

import torch

from lit_ess.engines.base import EngineFault
from lit_ess.rewards import RewardError

from .executor import WorkerError, check_request
from .transport import Ticket, build_transport
from .worker import EvalRequest, RolloutRequest, RolloutWorker, WorkerConfig


# ---------------------------------------------------------------------- trainer -> worker (requests queue)
@dataclass(frozen=True)
class Submit:
    """Sample and score `request` with the weights `weights` (None: those the engine holds)."""
    rid: int
    request: RolloutRequest | EvalRequest
    weights: Ticket | None


@dataclass(frozen=True)
class Restore:
    """A resumed run's failure counters (RolloutWorker.counters)."""
    counters: dict


@dataclass(frozen=True)
class Transport:
    """A message of the weight transport's trainer side for its engine side, applied in order with the requests."""
    msg: object


@dataclass(frozen=True)
class Stop:
    """Exit now (the queued requests are skipped)."""


# ---------------------------------------------------------------------- worker -> trainer (results queue)
@dataclass(frozen=True)
class Ready:
    """The engine is built."""
    sent: float                    # time.monotonic() in the worker (the same clock as the trainer's)


@dataclass(frozen=True)
class Stage:
    """The worker begins a stage (e.g. "sampling phase 3"), for the watchdog's message."""
    stage: str
    sent: float


@dataclass(frozen=True)
class Loaded:
    """An in-flight weight load (the updates queue) is done."""
    version: int
    sent: float


@dataclass(frozen=True)
class Result:
    """Request `rid`'s result, pickled (a PhaseResult or an EvalResult), and the engine's clock when it was sent."""
    rid: int
    payload: bytes
    idle_seconds: float
    busy_seconds: float
    weight_load_seconds: float
    sent: float


@dataclass(frozen=True)
class Failed:
    """The worker failed (on request `rid`; -1: outside one): a RewardError or EngineFault to raise as it is
    (its one line), else the traceback as text."""
    rid: int
    error: BaseException | str


def cpu_sharing_env() -> dict[str, str]:
    """Environment for a worker that shares the CPU cores with the trainer: vLLM must not pin its
    OpenMP threads to cores (VLLM_CPU_OMP_THREADS_BIND=nobind) and idle OpenMP threads must sleep, not
    spin (OMP_WAIT_POLICY=PASSIVE); the measurements behind this are in docs/measurements.md. A
    variable the user already set is kept."""
    wanted = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
    return {k: v for k, v in wanted.items() if k not in os.environ}


class WorkerProcess:
    def __init__(self, config: WorkerConfig, start_timeout: float = 600.0, env: dict[str, str] | None = None,
                 progress_timeout: float = 1800.0):
        self.config = config
        self.transport = build_transport(config.engine.weight_transfer(in_process=False))   # errors before the spawn
        self.env = {**(cpu_sharing_env() if not torch.cuda.is_available() else {}), **config.engine.worker_env(),
                    **(env or {})}
        self.proc = None
        self.start_timeout, self.progress_timeout = start_timeout, progress_timeout
        self.submitted_at: dict[int, float] = {}             # request id -> when it was queued
        self.started = False
        self._pending: list[tuple[int, object]] = []           # results read while waiting for the start
        self.current: Ticket | None = None                    # the newest weights pushed
        self.in_flight: dict[int, Ticket | None] = {}          # request id -> the weights it names
        self.requested: dict[int, str] = {}                    # request id -> what it asks, in words
        self.next_id = 0
        self.version = -1
        self.updates_in_flight = config.engine.updates_in_flight()
        self.update_sent: Ticket | None = None                 # in flight: the load the worker has not answered
        self.idle_seconds = self.busy_seconds = self.weight_load_seconds = 0.0

    def start(self) -> None:
        """Spawn the worker process; it builds its engine while the trainer sets up."""
        ctx = torch.multiprocessing.get_context("spawn")
        self.requests, self.results, self.updates, self.stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=_child_main, args=(self.config, self.requests, self.results, self.stop, os.getpid(),
                                                          self.updates), name="lit-ess-rollout-worker")
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)              # read by the child's OpenMP and vLLM when they load
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        atexit.register(self.close)                           # before multiprocessing joins its children
        self.t_created = self.last_heard = time.monotonic()
        self.stage = "starting its engine"

    def restore(self, reward_counters: dict) -> None:
        """A resumed run's failure counters (RolloutWorker.counters), applied before any request queued after them."""
        if reward_counters:
            self.requests.put(Restore(reward_counters))

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors, version: int) -> None:
        if (version == self.version and self.current is not None) or not self.proc.is_alive():
            # it has them, or it is gone (an NCCL push would wait for it for ever; the next poll, which
            # every rank reaches together, reports the death): FSDP2's gathers still run on every rank
            for _ in named_tensors:
                pass
            return
        read, self._pending, t0 = self._pending, [], time.monotonic()
        while self.update_sent is not None:                    # in flight: one load outstanding at a time
            read.extend(self.poll(timeout=0.05))
            if self.update_sent is not None and time.monotonic() - t0 > self.progress_timeout:
                self.proc.kill()
                raise WorkerError(f"the rollout worker (pid {self.proc.pid}) did not load the weights of step "
                                  f"{self.update_sent.version} in flight within {self.progress_timeout:g} s "
                                  f"(data.schedule.worker_timeout) while {self.stage}; it was stopped")
        self._pending = read + self._pending                   # results read meanwhile, for the next poll
        in_use = [t for t in self.in_flight.values() if t is not None]
        first, self.current = self.current is None, self.transport.push(named_tensors, version, self._send, in_use)
        self.version = version
        if self.updates_in_flight and not first:    # (the first: nothing runs yet, and the transport's set-up
            self.update_sent = self.current         # messages go first, on the request queue, with the request)
            self.updates.put(self.current)

    def _send(self, msg) -> None:
        self.requests.put(Transport(msg))

    # ------------------------------------------------------------------ requests
    def submit(self, request: RolloutRequest | EvalRequest) -> int:
        """Queue a request (a RolloutRequest: a phase; an EvalRequest: held-out prompts); it runs with
        the newest weights pushed before it."""
        check_request(request)
        rid, self.next_id = self.next_id, self.next_id + 1
        self.submitted_at[rid] = time.monotonic()            # silence before a request is not a stall
        self.in_flight[rid] = self.current
        self.requested[rid] = _what(request)
        self.requests.put(Submit(rid, request, self.current))
        return rid

    def poll(self, timeout: float, _from_wait: bool = False) -> list[tuple[int, object]]:
        """Finished requests as (id, result); waits up to `timeout` s for the first one."""
        out, deadline = [], time.monotonic() + timeout
        if not _from_wait and self._pending:
            out, self._pending = self._pending, []
        while True:
            if _from_wait and self.started:
                return out
            wait = deadline - time.monotonic() if not out else 0.0
            try:
                msg = self.results.get(timeout=max(wait, 0.0)) if wait > 0 else self.results.get_nowait()
            except queue.Empty:
                if not self.proc.is_alive():
                    raise WorkerError(f"the rollout worker process (pid {self.proc.pid}) died: "
                                      f"{_exit_cause(self.proc.exitcode)}") from None
                if not self.started and time.monotonic() - self.t_created > self.start_timeout:
                    raise WorkerError(f"the rollout worker did not start its engine within {self.start_timeout:.0f} s") from None
                self._check_progress()
                return out
            if isinstance(msg, Failed):
                if isinstance(msg.error, (RewardError, EngineFault)):
                    raise msg.error              # bad input, or a server that is gone: the same one line as sync
                raise WorkerError(f"the rollout worker failed:\n{msg.error}")
            self.last_heard = max(self.last_heard, msg.sent)
            match msg:
                case Ready():
                    self.started, self.stage = True, "idle"
                case Stage(stage=stage):
                    self.stage = stage
                case Loaded():                                     # an in-flight load is done
                    self.update_sent = None
                case Result(rid=rid):
                    self.idle_seconds, self.busy_seconds = msg.idle_seconds, msg.busy_seconds
                    self.weight_load_seconds = msg.weight_load_seconds
                    self.in_flight.pop(rid, None)
                    self.submitted_at.pop(rid, None)
                    self.stage = f"between requests (last finished: {self.requested.pop(rid, '?')})"
                    out.append((rid, pickle.loads(msg.payload)))

    def _check_progress(self) -> None:
        """The watchdog: stop a worker that has sent nothing for progress_timeout s with work in flight."""
        if not self.started or not self.in_flight:
            return
        # silent since the later of its last message and the oldest request it has not answered (a result
        # read late, after a long training step, was sent long ago but says nothing about the new request)
        silent = time.monotonic() - max(self.last_heard, min(self.submitted_at[r] for r in self.in_flight))
        if silent <= self.progress_timeout:
            return
        self.proc.kill()
        waiting = ", ".join(self.requested[r] for r in sorted(self.in_flight))
        raise WorkerError(f"the rollout worker (pid {self.proc.pid}) sent nothing for {silent:.0f} s while {self.stage} "
                          f"(requested: {waiting}); it was stopped. If a stage legitimately takes this long, raise "
                          f"data.schedule.worker_timeout (now {self.progress_timeout:g} s)")

    def ready(self) -> bool:
        """Whether the worker has built its engine; waits up to a second (raises its error, or after start_timeout)."""
        if not self.started:
            self._pending.extend(self.poll(timeout=1.0, _from_wait=True))
        return self.started

    def wait_ready(self, timeout: float) -> None:
        """Block until the worker has built its engine (or raise its error)."""
        deadline = time.monotonic() + timeout
        while not self.started and time.monotonic() < deadline:
            self._pending.extend(self.poll(timeout=min(0.2, max(deadline - time.monotonic(), 0.0)), _from_wait=True))
        if not self.started:
            raise WorkerError(f"the rollout worker did not start within {timeout:.0f} s")

    def close(self, grace: float = 60.0) -> None:
        """Stop the worker: it finishes the request it is on, skips the queued ones, and exits; unread
        results are drained meanwhile (a child cannot exit while its queue's pipe is full). After `grace`
        seconds (an interrupted run: 1) it is killed."""
        atexit.unregister(self.close)
        if self.proc is None:
            return
        self.stop.set()
        self.requests.put(Stop())                                  # wakes a worker waiting for requests
        deadline = time.monotonic() + grace
        while self.proc.is_alive() and time.monotonic() < deadline:
            try:
                self.results.get(timeout=0.1)
            except queue.Empty:
                pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return os.getppid() == pid


def _child_main(config: WorkerConfig, requests, results, stop, parent_pid: int, updates=None) -> None:
    """The worker process: the main thread samples (engine), a second thread scores (rewards,
    batching) and sends results, so phase p is scored while phase p + 1 is sampled. Results leave in
    request order (one scoring thread, FIFO). In-flight engines: a third thread loads the weights
    named on `updates` while the main thread samples, and weights only move forward: a request that
    names weights older than those the thread loaded since it was queued samples with the newer ones."""
    import threading

    from lit_ess.console import quiet_console
    from lit_ess.lifetime import die_with_parent

    die_with_parent()                    # a trainer killed or stopped takes its worker with it at once
    quiet_console()                      # the same console rules as the trainer (LIT_ESS_VERBOSE=1: all)
    try:
        # the engine side of the weight transport, before the engine: fails fast
        transport = build_transport(config.engine.weight_transfer(in_process=False))
        worker = RolloutWorker(config)
    except EngineFault as e:             # e.g. a server refused at start: its one line
        results.put(Failed(-1, e))
        return
    except BaseException:
        results.put(Failed(-1, traceback.format_exc()))
        return
    results.put(Ready(time.monotonic()))

    def report(stage: str) -> None:
        results.put(Stage(stage, time.monotonic()))
    to_score: queue.Queue = queue.Queue()
    clock = {"idle": 0.0, "busy": 0.0, "weights": 0.0}       # of the engine (main thread)

    def score_loop():
        try:                                     # first: the rewards' models, beside the first phase's sampling
            report("warming up the rewards (model rewards, the reward worker)")
            worker.warm_up()
        except RewardError as e:
            results.put(Failed(-1, e))
            return
        except BaseException:
            results.put(Failed(-1, traceback.format_exc()))
            return
        while (item := to_score.get()) is not None:
            if stop.is_set():
                continue                         # closing: nobody will read it
            sub, sampled = item
            req = sub.request
            try:
                report(f"scoring {_what(req)} (rewards)")
                out = worker.score(req, *sampled) if isinstance(req, RolloutRequest) else worker.score_eval(req, *sampled)
                results.put(Result(sub.rid, pickle.dumps(out), clock["idle"], clock["busy"], clock["weights"],
                                   time.monotonic()))
            except RewardError as e:
                results.put(Failed(sub.rid, e))
                return
            except BaseException:
                results.put(Failed(sub.rid, traceback.format_exc()))
                return

    scorer = threading.Thread(target=score_loop, name="lit-ess-scorer", daemon=True)
    scorer.start()
    held = {"ticket": None}                  # the weights the engine holds (a Ticket), under `weights_lock`
    weights_lock = threading.Lock()
    in_flight = config.engine.updates_in_flight()

    def load(ticket, stage: str) -> None:
        with weights_lock:
            have = held["ticket"]
            if ticket != have and not (in_flight and have is not None and ticket.version < have.version):
                t0 = time.perf_counter()
                report(f"{stage} {ticket.version}")
                transport.load(worker.engine, ticket)
                held["ticket"] = ticket
                clock["weights"] += time.perf_counter() - t0

    def update_loop():
        while (ticket := updates.get()) is not None and not stop.is_set():
            try:
                load(ticket, "loading in flight the weights of step")
            except BaseException:
                results.put(Failed(-1, traceback.format_exc()))
                return
            results.put(Loaded(ticket.version, time.monotonic()))

    updater = None
    if in_flight:
        updater = threading.Thread(target=update_loop, name="lit-ess-weights-in-flight", daemon=True)
        updater.start()
    try:
        while True:
            t0 = time.perf_counter()
            try:
                msg = requests.get(timeout=1.0)
            except queue.Empty:
                clock["idle"] += time.perf_counter() - t0
                if not _parent_alive(parent_pid) or not scorer.is_alive():
                    return
                continue
            clock["idle"] += time.perf_counter() - t0
            if isinstance(msg, Stop) or stop.is_set() or not _parent_alive(parent_pid):
                return                           # (a killed trainer: skip what it had queued)
            t1 = time.perf_counter()
            match msg:
                case Restore(counters=counters):
                    worker.load_counters(counters)
                case Transport(msg=payload):
                    report("receiving weights")
                    transport.receive(worker.engine, payload)
                    clock["weights"] += time.perf_counter() - t1
                case Submit(rid=rid, request=req, weights=weights):
                    if weights is not None:
                        load(weights, "loading the weights of step")
                    report(f"sampling {_what(req)}")
                    try:
                        sampled = worker.sample(req) if isinstance(req, RolloutRequest) else worker.sample_eval(req)
                    except RewardError as e:     # an environment that cannot play or fails too often (EnvError): bad
                        results.put(Failed(rid, e))        # input, one line, as the scorer's in score_loop
                        return
                    clock["busy"] += time.perf_counter() - t1
                    to_score.put((msg, sampled))
                case _:
                    raise TypeError(f"the rollout worker got a {type(msg).__name__}, not a request message")
    except EngineFault as e:
        results.put(Failed(-1, e))
    except BaseException:
        results.put(Failed(-1, traceback.format_exc()))
    finally:
        to_score.put(None)
        scorer.join(timeout=60)
        if updater is not None:
            updates.put(None)
            updater.join(timeout=60)
        worker.close()
        if stop.is_set():
            results.cancel_join_thread()         # exit even if unread results fill the pipe


def _exit_cause(code: int | None) -> str:
    """A process's exit code in words: -9 is SIGKILL (kill -9, or the kernel's out-of-memory killer)."""
    import signal

    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = " (kill -9, or the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"exit code {code}, killed by {name}{why}"
    return f"exit code {code}"


def _what(request: RolloutRequest | EvalRequest) -> str:
    return f"phase {request.phase}" if isinstance(request, RolloutRequest) else f"{len(request.prompts)} held-out prompts"
