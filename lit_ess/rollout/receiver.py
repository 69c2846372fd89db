"""The dedicated placement: one worker process (run by rank 0) generates a whole phase and sends each
rank its own share directly, so rows never pass through rank 0's trainer.

    rank r > 0: ShareReceiver                        worker process (rank 0's DedicatedWorker)
    ----------------------------                     -----------------------------------------
    Listener(host, port, authkey) in setup()   <-    process.Deliveries.send(r, result): connects once, then
    a reader thread: connection -> queue              pickled results, request by request, in order
    poll(timeout) -> [(rid, result)]                 (each with the engine's idle/busy clock)

`dedicated_executor` (every rank, in setup) exchanges the addresses: rank 0 learns every rank's and
hands them to its worker process; then rank 0 tells the others its worker's pid (for their errors).
On CPU cores the worker gets every rank's threads (`dedicated_threads`): it generates for all of them.
* Phases: rank 0 plans and submits every phase with every rank's share (`PhaseShares`, sampled in one
  engine call, scored share by share). A rank > 0 has no engine: it loads no weights (it still consumes
  the policy's weight iterator, so FSDP2's gathers run on every rank), plans nothing and reads.
* Held-out evaluation: every rank submits its prompts; rank 0 gathers them (one all-gather) into one
  request (`EvalShares`) and the worker sends each rank its own rows.
* Before a checkpoint, `drain`: every rank reads the shares already sent to it, up to the newest phase
  any rank has read, so that the phases in flight (rank 0's requests, regenerated for every rank after a
  resume) are the same for all ranks.
When the worker exits, the connection closes and the reader reports it: `poll` raises on that rank too.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import threading
import time
from collections import deque
from multiprocessing.connection import Listener

import torch

from .executor import WorkerError
from .process import Address, WorkerProcess
from .ranks import Ranks, TorchRanks, in_step
from .worker import EvalShares, PhaseResult, PhaseShares, RolloutRequest, WorkerConfig



def dedicated_executor(config: WorkerConfig, ranks: Ranks, worker_timeout: float) -> "DedicatedWorker | ShareReceiver":
    """This rank's executor under the dedicated placement: rank 0's worker process, a receiver elsewhere.
    Every rank calls it (two all-gathers: the nodes' addresses, then the receivers')."""
    nodes = ranks.all_gather(node_address())
    one_node = len(set(nodes)) == 1
    receiver = None
    if ranks.rank > 0:
        receiver = ShareReceiver(bind="127.0.0.1" if one_node else "0.0.0.0", host="127.0.0.1" if one_node
                                 else nodes[ranks.rank], silence_timeout=worker_timeout, ranks=ranks)
    addresses = ranks.all_gather(receiver.address if receiver is not None else None)
    return receiver or DedicatedWorker(config, ranks, addresses, progress_timeout=worker_timeout,
                                       env=dedicated_threads(ranks.world, config.engine.worker_env()))


def dedicated_threads(world: int, engine_env: dict[str, str]) -> dict[str, str]:
    """On CPU cores the one worker generates what `world` ranks' engines would: it gets their threads,
    OMP_NUM_THREADS = world x this process's torch threads (with 1 thread per rank and 2 ranks, 2, not
    1 thread for twice the work). None on GPUs (the worker's devices are its own), nor where the engine
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


def drain(executor: "DedicatedWorker | ShareReceiver", ranks: Ranks) -> list[tuple[int, object]]:
    """Poll until every rank has read the same phases (`executor.received`: 1 + the newest phase read in
    this session; phases arrive in order, so equal counts are equal phases). A rank that is behind may
    read past the newest phase another rank had: repeat until all agree. Returns what was read."""
    out: list[tuple[int, object]] = []
    while len(set(received := ranks.all_gather(executor.received))) > 1:
        newest = max(received)
        in_step(ranks, lambda: True if executor.received >= newest else out.extend(executor.poll(timeout=1.0)))
    return out


def _newest(received: int, results: list[tuple[int, object]]) -> int:
    return max([received, *(r.phase + 1 for _, r in results if isinstance(r, PhaseResult))])


class DedicatedWorker(WorkerProcess):
    """The executor of rank 0 under the dedicated placement: the one worker process, generating every
    rank's share (see the module docstring)."""

    def __init__(self, config: WorkerConfig, ranks: Ranks, deliver_to: list[Address | None], **kw):
        super().__init__(config, deliver_to=deliver_to, **kw)
        self.ranks, self.received = ranks, 0

    def start(self) -> None:
        super().start()
        self.ranks.all_gather(self.proc.pid)                 # the receivers name the worker in their errors

    def phase_request(self, phase: int, shares: list[RolloutRequest]) -> PhaseShares:
        return PhaseShares(phase, shares)

    def submit(self, kind: str, payload) -> int:
        """A phase (every rank's share), or this rank's held-out prompts: with every rank's (the others
        submit theirs at the same time), evaluated as one request."""
        if kind == "evaluate":
            payload = EvalShares(self.ranks.all_gather(payload))
        return super().submit(kind, payload)

    def poll(self, timeout: float, _from_wait: bool = False) -> list[tuple[int, object]]:
        out = super().poll(timeout, _from_wait)
        self.received = _newest(self.received, out)
        return out

    def drain(self) -> list[tuple[int, object]]:
        return drain(self, self.ranks)


class ShareReceiver:
    updates_in_flight = False                # no engine here: rank 0's worker takes them
    """The executor of a rank > 0 under the dedicated placement (see the module docstring)."""
    plans = False

    def __init__(self, bind: str = "127.0.0.1", host: str = "127.0.0.1", silence_timeout: float = 1800.0,
                 ranks: Ranks = TorchRanks()):
        """Listen on `bind` (any free port); the worker connects to `host` (this node's address, seen
        from rank 0's node). `silence_timeout`: seconds this rank may wait for its share with nothing
        arriving (rank 0's watchdog covers the worker itself; this covers the path to this rank)."""
        key = os.urandom(16)
        self.ranks = ranks
        self.silence_timeout, self.waited = silence_timeout, 0.0
        self.worker_pid: int | None = None                    # told by rank 0 once the worker started
        self.listener = Listener((bind, 0), authkey=key)
        self.address: Address = (host, self.listener.address[1], key)
        self.inbox: queue.Queue = queue.Queue()
        self.evaluations: deque[int] = deque()                # ids of the held-out requests not yet answered
        self.next_id = self.received = 0
        self.version = -1
        self.idle_seconds = self.busy_seconds = 0.0
        self.reader: threading.Thread | None = None
        self.closed = self.accepted = False

    def start(self) -> None:
        self.reader = threading.Thread(target=self._read, name="lit-ess-share-reader", daemon=True)
        self.reader.start()
        self.worker_pid = self.ranks.all_gather(None)[0]

    def _read(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
                break
            except OSError:
                return                                        # the listener was closed
            except Exception:                                 # noqa: BLE001 - a failed handshake: a stray
                if self.closed:                               # connection (wrong key, a port scan), or close()
                    return                                    # waking this thread up
        self.accepted = True
        try:
            while True:
                self.inbox.put(("result", pickle.loads(conn.recv_bytes())))      # (PhaseResult, engine clock)
        except (EOFError, OSError):
            if not self.closed:
                self.inbox.put(("gone", None))
        finally:
            conn.close()

    def load_weights(self, named_tensors, version: int) -> None:
        for _ in named_tensors:                               # FSDP2: take part in every gather
            pass
        self.version = version

    def restore(self, reward_counters: dict) -> None:
        """Rank 0's worker holds the reward counters."""

    def phase_request(self, phase: int, shares: list[RolloutRequest]) -> PhaseShares:
        raise RuntimeError("placement: dedicated: rank 0 plans every phase; a rank > 0 only receives its share")

    def submit(self, kind: str, payload) -> int:
        """This rank's held-out prompts, handed to rank 0 (which submits every rank's at the same time);
        the worker sends this rank its rows."""
        if kind != "evaluate":
            raise RuntimeError("placement: dedicated: rank 0 submits every phase; a rank > 0 only receives its share")
        self.ranks.all_gather(payload)
        rid, self.next_id = self.next_id, self.next_id + 1
        self.evaluations.append(rid)
        return rid

    def drain(self) -> list[tuple[int, object]]:
        return drain(self, self.ranks)

    def poll(self, timeout: float) -> list[tuple[int, object]]:
        """Shares that arrived; a poll with `timeout` > 0 waits for one (the data module needs it), and
        waiting `silence_timeout` s in total with nothing arriving raises."""
        out = []
        try:
            t0 = time.monotonic()
            try:
                item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
            except queue.Empty:
                self.waited += time.monotonic() - t0 if timeout > 0 else 0.0
                if self.waited > self.silence_timeout:
                    raise WorkerError(f"this rank received nothing from the dedicated rollout worker (pid "
                                      f"{self.worker_pid}, run by rank 0) for {self.waited:.0f} s while waiting for "
                                      f"its share; raise worker_timeout if a phase legitimately takes this long") from None
                raise
            self.waited = 0.0
            while True:
                kind, result = item
                if kind == "gone":
                    raise WorkerError(f"the dedicated rollout worker (pid {self.worker_pid}, run by rank 0) closed its "
                                      f"connection to this rank: it exited (rank 0 reports its exit cause)")
                result, (self.idle_seconds, self.busy_seconds) = result     # the one engine's clock
                out.append((self.evaluations.popleft() if isinstance(result, dict) else -1, result))   # a phase, or held-out rows
                item = self.inbox.get_nowait()
        except queue.Empty:
            self.received = _newest(self.received, out)
            return out

    def close(self, grace: float = 60.0) -> None:
        """Stop listening. A reader still waiting for the worker to connect is woken by a bare connection
        (its handshake fails, it sees `closed`); one reading a connection ends when the worker closes it
        (a daemon thread: it never holds the process)."""
        self.closed = True
        if not self.accepted:
            try:
                socket.create_connection(self.address[:2], timeout=5).close()
            except OSError:
                pass
        self.listener.close()
