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
import threading
from multiprocessing.connection import Client, Connection, Listener

from .executor import WorkerError

Address = tuple[str, int, bytes]          # host, port, authkey


class ShareReceiver:
    """The executor of a rank > 0 under the dedicated placement (see the module docstring)."""

    def __init__(self, bind: str = "127.0.0.1", host: str = "127.0.0.1"):
        """Listen on `bind` (any free port); the worker connects to `host` (this node's name, seen
        from rank 0's node)."""
        key = os.urandom(16)
        self.listener = Listener((bind, 0), authkey=key)
        self.address: Address = (host, self.listener.address[1], key)
        self.inbox: queue.Queue = queue.Queue()
        self.version = -1
        self.idle_seconds = self.busy_seconds = 0.0
        self.reader: threading.Thread | None = None
        self.closed = False

    def start(self) -> None:
        self.reader = threading.Thread(target=self._read, name="lit-ess-share-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            conn = self.listener.accept()
        except OSError:
            return                                            # closed before the worker connected
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
        out = []
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
            while True:
                kind, result = item
                if kind == "gone":
                    raise WorkerError("the dedicated rollout worker (run by rank 0) closed its connection to this "
                                      "rank: it exited")
                result, (self.idle_seconds, self.busy_seconds) = result     # the one engine's clock
                out.append((-1, result))
                item = self.inbox.get_nowait()
        except queue.Empty:
            return out

    def close(self) -> None:
        self.closed = True
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
