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


class Peers:
    """The pid and host of every rank, gathered once the process group is up (`record`, a collective),
    so that a failed collective can be explained (`dead`)."""

    ranks: list[tuple[int, str]] = []          # (pid, host) by rank

    @classmethod
    def record(cls) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, (os.getpid(), socket.gethostname()))
        cls.ranks = out

    @classmethod
    def dead(cls) -> list[str]:
        """'rank R (pid P)' for every other rank on this host whose process is gone."""
        me, host = os.getpid(), socket.gethostname()
        return [f"rank {r} (pid {pid})" for r, (pid, h) in enumerate(cls.ranks)
                if pid != me and h == host and not alive(pid)]
