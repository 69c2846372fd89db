"""Checkpoints that are whole or absent, and a resume that never starts from a torn one.

Writing. Lightning's TorchCheckpointIO writes through an fsspec transaction: the bytes go to a temp
file in the system temp folder, then `shutil.move` puts it in place. When the checkpoint folder is on
another filesystem (a shared filesystem for multi-node runs, tmpfs), that move is a copy into the
target itself: a kill -9 or a full disk during it leaves a truncated `last.ckpt`, and the intact
previous one is already gone. `AtomicCheckpointIO` writes `<target>.tmp` in the target's own folder,
fsyncs it, and `os.replace`s it onto the target (one rename on one filesystem), then fsyncs the folder.
A failed write removes its temp file and leaves the previous checkpoint as it was. The CLI installs it
in place of Lightning's default TorchCheckpointIO; remote URLs (s3://, ...) keep Lightning's writer.

Folders (a Hugging Face export: `lit-ess-export`, lit_ess.callbacks.ExportHF) are written the same way:
`atomic_folder` gives a temp folder beside the target, renamed onto it when every file is written; a
failed write (a full disk) removes it, names the target in one line, and leaves no half-written folder
that would look like a model. Temp names carry the writer's pid, so two writers never share one.

One run per checkpoint folder. `lock_folder` puts a lock file (pid and host) beside each
ModelCheckpoint folder when a run starts and removes it when the process exits; a second run into the
folder refuses to start with one line naming the folder and the first run's pid. A lock whose process
is gone (a run killed with kill -9) is taken over with a notice. A process on another host cannot be
checked (a run requeued on another node, a new container): the holder refreshes its lock's mtime every
LOCK_REFRESH_S, and a lock from another host not refreshed for LOCK_STALE_S is taken over.

Sharded checkpoints (ModelParallelStrategy, a folder of DCP shards and `meta.pt`) do not go through
a CheckpointIO: torch.distributed.checkpoint writes the shards in place, renames its `.metadata` into
place, and rank 0 writes `meta.pt` last. So `readable` judges such a folder by its parts instead: a
whole `meta.pt`, a `.metadata`, and no shard newer than `meta.pt` (a newer shard means the folder was
being rewritten when the run stopped, and its shards may mix two steps).

Resuming. `resolve_resume` turns `--ckpt_path last` into the newest readable checkpoint of the
ModelCheckpoint folders (Lightning's choice, the newest `last*.ckpt`, when it is whole), and says in one
line when it had to pass over a torn one. An explicit path that is not readable is an error that lists
the readable checkpoints beside it. Readable means the zip archive that torch.save writes is whole: its
directory (at the end of the file) opens, every member lies inside the file, and the pickle member
passes its CRC. That costs a few reads, not a load of the weights.
"""
from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import socket
import threading
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from .lifetime import alive

TMP_SUFFIX = ".tmp"
LOCK_REFRESH_S = 60.0              # a held lock's mtime is refreshed this often (seconds)
LOCK_STALE_S = 600.0               # a lock of another host not refreshed for this long is taken over
SHARDED_META = "meta.pt"           # Lightning's name for the non-tensor state of a sharded checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose local writes are atomic on every filesystem: a temp file beside the
    target, fsync, os.replace, fsync of the folder."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, Path(path))


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save `obj` to `path` so that `path` is always either the previous file or the new one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_SUFFIX}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        cause = e if isinstance(e, OSError) else e.__context__      # torch.save re-raises a failed write
        if isinstance(cause, KeyboardInterrupt):                     # Ctrl-C during the write: a Ctrl-C
            raise KeyboardInterrupt from e
        if isinstance(cause, OSError):                                # as a RuntimeError about positions
            raise OSError(cause.errno, f"checkpoint {path} not written ({cause.strerror}); the previous one "
                                       f"is kept") from e
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` survive a power loss; some filesystems (network, FUSE) and systems
    (Windows) cannot sync a folder: the file is written either way."""
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


@contextmanager
def atomic_folder(out: str | Path, what: str = "folder") -> Iterator[Path]:
    """Yield a temp folder beside `out` to write into; when the block ends it replaces `out` whole (an
    existing `out` is moved aside, then removed). A failure removes the temp folder and leaves `out` as
    it was; a failed write (OSError, or safetensors' error wrapping one) becomes one OSError naming
    `what` and `out`."""
    from safetensors import SafetensorError

    out = Path(out)
    if (why := not_replaceable(out)) is not None:
        raise ValueError(f"{what} {out}: {why}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (out.with_name(f".{out.name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        if isinstance(e, (OSError, SafetensorError)):
            code = e.errno if isinstance(e, OSError) else _os_error(str(e))      # safetensors: "... (os error 28)"
            why = os.strerror(code) if code else str(e).splitlines()[0]
            kept = " (the previous one is kept)" if out.exists() else ""
            raise OSError(code or errno.EIO, f"{what} {out} not written ({why}); nothing was left there{kept}") from e
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync_folder(out.parent)


def not_replaceable(out: Path) -> str | None:
    """Why `atomic_folder` must not replace `out` (it removes the old folder whole): a file, or a folder
    holding files that are not a previous export (no config.json, no adapter_config.json: a run folder,
    a checkpoint folder); None when it may."""
    if out.is_file():
        return "is an existing file: give a folder"
    if not out.is_dir() or not any(out.iterdir()) or (out / "config.json").is_file() \
            or (out / "adapter_config.json").is_file():
        return None
    return "is a folder holding other files (not a model folder), which writing the model would delete: give an empty or new folder"


def _os_error(message: str) -> int | None:
    """The errno in a Rust I/O error's text ("... (os error 28)"), or None."""
    found = re.search(r"os error (\d+)", message)
    return int(found.group(1)) if found else None


def lock_folder(folder: str | Path) -> str | None:
    """Hold `folder` for this run: `.<name>.lit-ess.lock` beside it (pid and host; beside, not inside,
    where Lightning would call the folder not empty), removed when this process exits. Raises ValueError
    naming the folder and the other run's pid when a live process holds it; returns a notice when it
    takes over the lock of a process that is gone, else None."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock, me = folder.with_name(f".{folder.name}.lit-ess.lock"), f"{os.getpid()} {socket.gethostname()}"
    try:                                             # a fresh lock: created only if none exists
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, (me + "\n").encode())
        os.close(fd)
        _hold(lock, me)
        return None
    except FileExistsError:
        pass
    try:
        pid_text, host = lock.read_text().split(maxsplit=1)
        pid, host = int(pid_text), host.strip()
    except (OSError, ValueError):                    # unreadable or half-written: nobody holds it
        pid = host = None
    notice = None
    if pid is not None and f"{pid} {host}" != me:
        if host != socket.gethostname():
            idle = _idle(lock)
            if idle < LOCK_STALE_S:
                raise ValueError(f"checkpoint folder {folder} is in use by another run (pid {pid} on {host}; {lock}, "
                                 f"refreshed {idle:.0f} s ago): give this run its own output_dir (or dirpath), or "
                                 f"remove the lock if that run is gone (it is taken over {LOCK_STALE_S:.0f} s after its "
                                 f"last refresh)")
            notice = (f"checkpoint folder {folder}: taking over the lock of pid {pid} on {host}, not refreshed for "
                      f"{idle:.0f} s")
        elif alive(pid):
            raise ValueError(f"checkpoint folder {folder} is in use by another run (pid {pid}): give this run its own "
                             f"output_dir (or dirpath), or stop that run first")
        else:
            notice = f"checkpoint folder {folder}: taking over the lock of pid {pid}, which is no longer running"
    tmp = lock.with_name(f"{lock.name}.{os.getpid()}")
    tmp.write_text(me + "\n")
    os.replace(tmp, lock)
    _hold(lock, me)
    return notice


def _idle(lock: Path) -> float:
    """Seconds since `lock` was last refreshed (0 when it cannot be read)."""
    try:
        return max(0.0, time.time() - lock.stat().st_mtime)
    except OSError:
        return 0.0


_held: set[Path] = set()           # the locks this process holds (refreshed by one thread each)


def _hold(lock: Path, me: str) -> None:
    """Remove `lock` when this process exits; meanwhile refresh its mtime every LOCK_REFRESH_S (a daemon
    thread that stops once the lock is no longer this process's)."""
    if lock in _held:
        return
    _held.add(lock)
    atexit.register(_unlock, lock, me)

    def refresh() -> None:
        while True:
            time.sleep(LOCK_REFRESH_S)
            try:
                if lock.read_text().strip() != me:
                    break
                os.utime(lock)
            except OSError:
                break
        _held.discard(lock)

    threading.Thread(target=refresh, name="lit-ess-lock-refresh", daemon=True).start()


def _unlock(lock: Path, me: str) -> None:
    try:
        if lock.read_text().strip() == me:
            lock.unlink()
    except OSError:
        pass


def unreadable(path: str | Path) -> str | None:
    """None when `path` is a whole checkpoint (a torch.save file, or a folder of DCP shards with its
    meta.pt), else the reason, in a few words."""
    path = Path(path)
    if path.is_dir():
        meta = path / SHARDED_META
        if not meta.is_file():
            return f"a folder without {SHARDED_META}"
        if not (path / ".metadata").is_file():
            return "a folder of shards without .metadata"
        if reason := _zip_unreadable(meta):
            return f"{SHARDED_META}: {reason}"
        newer = [p.name for p in path.glob("*.distcp") if p.stat().st_mtime_ns > meta.stat().st_mtime_ns]
        return f"shard {newer[0]} is newer than {SHARDED_META} (rewritten when the run stopped)" if newer else None
    if not path.is_file():
        return "missing"
    return _zip_unreadable(path)


def _zip_unreadable(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            end = max((i.header_offset + i.compress_size for i in infos), default=0)
            if end > size:
                return f"truncated ({size} of at least {end} bytes)"
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if not pickles:
                return "not a torch checkpoint (no data.pkl)"
            z.read(pickles[0])         # checks its CRC
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        return f"torn or not a checkpoint ({size} bytes: {e})"
    return None


def candidates(dirs: list[Path], extra: list[Path] = ()) -> list[Path]:
    """The checkpoints (files and shard folders named *.ckpt) in `dirs`, and `extra`, newest first."""
    found = {p for d in dirs if d.is_dir() for p in d.glob("*.ckpt")} | {p for p in extra if p.exists()}
    return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def _is_last(p: Path) -> bool:
    stem = p.name[:-len(".ckpt")]
    return stem == "last" or (stem.startswith("last-") and stem[5:].lstrip("v").isdigit())


def resolve_resume(ckpt_path: str, dirs: list[Path], hpc: list[Path] = ()) -> tuple[str | None, str | None]:
    """The checkpoint to resume from and a one-line notice (None when there is nothing to say).

    `ckpt_path` "last": Lightning's choice (the newest last*.ckpt) or the newest of `hpc` (checkpoints
    Lightning's Slurm requeue path names hpc_ckpt_N.ckpt, saved when a job was preempted), whichever is
    newer, when it is readable; else the newest readable checkpoint of `dirs` and `hpc`; None when there
    is none (a fresh start, as in Lightning).
    Any other value is a path, returned as is when readable. Raises ValueError, naming the checkpoints
    and why each was passed over, when none can be used."""
    if ckpt_path != "last":
        if (reason := unreadable(ckpt_path)) is None:
            return ckpt_path, None
        ok = [str(p) for p in candidates([Path(ckpt_path).parent]) if unreadable(p) is None]
        hint = f"readable beside it: {', '.join(ok)}" if ok else "no readable checkpoint beside it"
        raise ValueError(f"--ckpt_path {ckpt_path}: {reason}; {hint}")
    found = candidates(dirs, hpc)
    if not found:
        return None, f"--ckpt_path last: no checkpoint in {', '.join(map(str, dirs)) or 'any ModelCheckpoint folder'}: starting from scratch"
    ordered = [p for p in found if _is_last(p) or p in hpc][:1] + found
    skipped = []
    for p in ordered:
        if (reason := unreadable(p)) is None:
            if not skipped:
                return str(p), None
            why = "; ".join(f"{q.name} is unreadable ({r})" for q, r in skipped)
            return str(p), f"--ckpt_path last: {why}: resuming from {p}"
        if all(q != p for q, _ in skipped):
            skipped.append((p, reason))
    raise ValueError("--ckpt_path last: no readable checkpoint: " + "; ".join(f"{q} ({r})" for q, r in skipped))


def saved_settings(ckpt_path: str | None) -> dict | None:
    """The non-tensor part of a local checkpoint (a file, read through mmap so its weights are not read; or a
    folder of shards' meta.pt); None for no path or a remote one."""
    if not ckpt_path or "://" in str(ckpt_path):
        return None
    path = Path(ckpt_path)
    if path.is_dir():
        meta = path / SHARDED_META
        return torch.load(meta, map_location="cpu", weights_only=False) if meta.is_file() else None
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False) if path.is_file() else None


def resume_changes(saved: dict, now: dict, free: frozenset[str] = frozenset(), prefix: str = "model") -> list[str]:
    """'model.KNOB OLD -> NEW' for each hyper-parameter in `now` (the module's, from the config) that differs
    from its value in `saved` (the checkpoint's `hyper_parameters`); the knobs in `free` (a key, or a field of
    a group: "compute.logprob_chunk"), Lightning's own (`_...`) and those the checkpoint does not hold are left
    out. A dataclass knob of the same class (an objective, a group of settings) is compared field by field."""
    out = []
    for key in sorted(now):
        if not key.startswith("_") and key not in free and key in saved:
            out += [d for d in _differences(f"{prefix}.{key}", saved[key], now[key])
                    if not any(d.startswith(f"{prefix}.{f} ") or d.startswith(f"{prefix}.{f}.") for f in free)]
    return out


def _differences(name: str, old: Any, new: Any) -> list[str]:
    """The differences of one knob: a typed config (a dataclass, or its {class_path, init_args} as LightningCLI
    saves it) of the same class field by field, another class by its name."""
    import dataclasses

    if dataclasses.is_dataclass(old) and type(old) is type(new):
        old, new = dataclasses.asdict(old), dataclasses.asdict(new)
    if isinstance(old, dict) and isinstance(new, dict):
        if old.get("class_path") != new.get("class_path"):
            return [f"{name} {_shown(old)} -> {_shown(new)}"]
        old, new = ({**d.get("init_args", {}), **{k: v for k, v in d.items() if k not in ("class_path", "init_args")}}
                    for d in (old, new))
        return [d for k in sorted(set(old) | set(new)) for d in _differences(f"{name}.{k}", old.get(k), new.get(k))]
    same = list(old) == list(new) if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) else old == new
    return [] if same else [f"{name} {_shown(old)} -> {_shown(new)}"]


def _shown(value: Any) -> str:
    import dataclasses

    if isinstance(value, dict) and "class_path" in value:
        return str(value["class_path"]).rsplit(".", 1)[-1]
    return type(value).__name__ if dataclasses.is_dataclass(value) else repr(value)
