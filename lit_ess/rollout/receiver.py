"""The dedicated placement's data path: one worker process (run by rank 0) generates a whole phase and
sends each rank its own share directly, so rows never pass through rank 0's trainer.

    rank r > 0: ShareReceiver                        worker process (rank 0's WorkerProcess)
    ----------------------------                     ---------------------------------------
    Listener(host, port, authkey) in setup()   <-    Deliveries.send(r, result): connects once, then
    a reader thread: connection -> queue              pickled PhaseResults, phase by phase, in order
    poll(timeout) -> [(-1, PhaseResult)]             (each with the engine's idle/busy clock)

Rank 0 learns every rank's address (one all-gather in setup) and puts them in the WorkerConfig. A
rank > 0 has no engine: it loads no weights (it still consumes the policy's weight iterator, so FSDP2's
gathers run on every rank), submits nothing (rank 0 plans and submits every phase) and reads. When the
worker exits, the connection closes and the reader reports it: `poll` raises on that rank too.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

from .executor import WorkerError

Address = tuple[str, int, bytes]          # host, port, authkey


class ShareReceiver:
    """The executor of a rank > 0 under the dedicated placement (see the module docstring)."""

    def __init__(self, bind: str = "127.0.0.1", host: str = "127.0.0.1", silence_timeout: float = 1800.0):
        """Listen on `bind` (any free port); the worker connects to `host` (this node's address, seen
        from rank 0's node). `silence_timeout`: seconds this rank may wait for its share with nothing
        arriving (rank 0's watchdog covers the worker itself; this covers the path to this rank)."""
        key = os.urandom(16)
        self.silence_timeout, self.waited = silence_timeout, 0.0
        self.worker_pid: int | None = None                    # told by rank 0 once the worker started
        self.listener = Listener((bind, 0), authkey=key)
        self.address: Address = (host, self.listener.address[1], key)
        self.inbox: queue.Queue = queue.Queue()
        self.version = -1
        self.idle_seconds = self.busy_seconds = 0.0
        self.reader: threading.Thread | None = None
        self.closed = self.accepted = False

    def start(self) -> None:
        self.reader = threading.Thread(target=self._read, name="lit-ess-share-reader", daemon=True)
        self.reader.start()

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

    def submit(self, kind: str, payload) -> int:
        raise RuntimeError("placement: dedicated: rank 0 submits every phase; a rank > 0 only receives its share")

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
                out.append((-1, result))
                item = self.inbox.get_nowait()
        except queue.Empty:
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


class Deliveries:
    """The worker process's side: one connection per rank > 0, opened at the first send."""

    def __init__(self, addresses: list[Address | None]):
        self.addresses, self.conns = addresses, {}

    def send(self, rank: int, result, clock: tuple[float, float]) -> None:
        """`result` for `rank`, with the engine's (idle, busy) seconds so far."""
        if rank not in self.conns:
            host, port, key = self.addresses[rank]
            self.conns[rank] = Client((host, port), authkey=key)
        conn: Connection = self.conns[rank]
        conn.send_bytes(pickle.dumps((result, clock)))

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
