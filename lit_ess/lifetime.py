"""Every process of a run ends with it, and a stopped run says why in one line.

    die_with_parent()     the kernel signals this process when its parent dies (Linux prctl
                          PR_SET_PDEATHSIG): rollout workers, reward workers and trainer ranks started by
                          the launcher never outlive the process that started them (kill -9 included)
    alive(pid)            a process that runs (a zombie, dead but not yet reaped, does not)
    Peers                 every rank's pid and host, gathered when the run starts, so that a rank whose
                          collective fails can name the peer that died instead of the backend's error
"""
from __future__ import annotations

import os
import signal
import socket
import sys


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; elsewhere nothing).
    If the parent is already gone, exit now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent == 1 or not alive(parent):
        os._exit(1)


def alive(pid: int) -> bool:
    """True when process `pid` runs: it exists (another user's counts) and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def node_rank() -> int:
    """This process's node: torchrun's GROUP_RANK, Lightning's NODE_RANK, Slurm's SLURM_NODEID, else 0."""
    for key in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


class Peers:
    """The pid, host and node of every rank, gathered once the process group is up (`record`, a
    collective), and a heartbeat of every rank in the process group's store, so that a failed collective
    can name the rank that died (`dead`): by its pid on this host, by its stopped heartbeat on another."""

    ranks: list[tuple[int, str]] = []          # (pid, host) by rank
    nodes: list[int] = []                      # node rank by rank
    me: int = 0                                # this process's rank
    BEAT_S = 0.5                               # heartbeat period

    @classmethod
    def record(cls) -> None:
        import threading

        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, (os.getpid(), socket.gethostname(), node_rank()))
        cls.ranks, cls.nodes = [(pid, host) for pid, host, _ in out], [node for _, _, node in out]
        cls.me = dist.get_rank()
        if any(host != socket.gethostname() for _, host in cls.ranks) or len(set(cls.nodes)) > 1:
            threading.Thread(target=cls._beat, args=(dist.get_rank(),), daemon=True, name="lit-ess-heartbeat").start()

    @staticmethod
    def _store():
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()

    @classmethod
    def _beat(cls, rank: int) -> None:
        """Count up `lit_ess/beat/RANK` in the store every BEAT_S seconds, until the store is gone."""
        import time

        store, n = cls._store(), 0
        while True:
            try:
                store.set(f"lit_ess/beat/{rank}", str(n))
            except Exception:                  # noqa: BLE001 -- the store's host is gone: nothing to beat to
                return
            n += 1
            time.sleep(cls.BEAT_S)

    @classmethod
    def _name(cls, r: int) -> str:
        pid, host = cls.ranks[r]
        node = f"node {cls.nodes[r]} " if len(set(cls.nodes)) > 1 else ""
        return f"{node}rank {r} (pid {pid}" + ("" if host == socket.gethostname() else f" on {host}") + ")"

    @classmethod
    def dead(cls) -> list[str]:
        """'[node N] rank R (pid P [on HOST])' for every other rank whose process is gone: on this host by its
        pid; on other nodes (when there are several) by a heartbeat that did not move in 6 periods. A store that
        no longer answers names rank 0, whose launcher holds it."""
        import time

        host = socket.gethostname()
        others = [r for r in range(len(cls.ranks)) if r != cls.me]
        local = [r for r in others if cls.ranks[r][1] == host and not alive(cls.ranks[r][0])]
        remote = [r for r in others if r not in local and (cls.ranks[r][1] != host or cls.nodes[r] != cls.nodes[cls.me])]
        if local or not remote:
            return [cls._name(r) for r in local]
        try:
            store = cls._store()
            store.set_timeout(__import__("datetime").timedelta(seconds=2))
            first = {r: store.get(f"lit_ess/beat/{r}") for r in remote}
            time.sleep(6 * cls.BEAT_S)
            return [cls._name(r) for r in remote if store.get(f"lit_ess/beat/{r}") == first[r]]
        except Exception:                      # noqa: BLE001 -- the store (on rank 0's node) is gone
            return [] if 0 not in remote else [cls._name(0) + ", which held the rendezvous store,"]
