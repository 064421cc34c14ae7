"""Durable, atomic file operations on the local data directory: the only place that knows POSIX rules.

Every write in storage/ follows one pattern: build the thing under a hidden temporary name in the same
directory, fsync it, rename it into place (a rename within one directory is atomic), then fsync the
directory so the rename itself survives a power cut. Readers never take locks; they see the old state or
the new one. Hidden names start with "." so neither our listings nor hive readers (which skip "." and "_"
prefixes) ever pick up a half-written file.

The advisory `FileLock` (flock) only serialises *writers* that must not interleave (registry number
allocation, one compactor per partition, one cursor committer per tenant); `HeldLock` is the same lock held
across calls (one learner process per tenant). A lock dies with its process, so a SIGKILLed writer never
leaves it held.

Moving to object storage (S3, GCS) changes this module and little else:
- `write_new_file` becomes one PUT with `If-None-Match: *` (objects appear atomically; no temp, no fsync);
- `atomic_write_bytes` becomes a plain PUT (last writer wins, which is what its callers assume);
- directory renames are not available, so `publish_dir` would upload under the final prefix and rely on
  the commit marker its callers already write last (registry metadata JSON, cursor commit.json);
- `FileLock` and `HeldLock` need a lease (conditional PUT on a lock object, or an external lock service).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

TMP_PREFIX = "."


def tmp_name(final: Path, tag: str = "tmp") -> Path:
    """A hidden, unique sibling of `final` (same directory, so the later rename is atomic)."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{uuid.uuid4().hex[:12]}.{tag}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under `root` (callbacks such as PEFT's save do not fsync)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replaces `path` with `data` atomically and durably."""
    ensure_dir(path.parent)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def ensure_dir(directory: Path) -> None:
    """`mkdir -p` whose new directories survive a power loss: each one it creates is fsynced in its parent
    (a file fsynced into a directory whose own entry was never made durable can vanish with it)."""
    if directory.is_dir():
        return
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    if not d.is_dir():  # a file where a folder of the path should be
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # a concurrent creator: it fsyncs it too, but so may we
            pass
        fsync_dir(d.parent)


def write_new_file(path: Path, write: Callable[[Path], None]) -> bool:
    """Creates `path` by calling `write(tmp)` and moving tmp into place, only if `path` does not exist yet.

    Returns False (and writes nothing) when `path` already exists. The final step is a hard link, which
    fails instead of replacing, so a concurrent creator can never clobber a file a reader already opened.
    The file's mtime is set just before it appears.
    """
    if path.exists():
        fsync_dir(path.parent)  # a replay after a crash between the link and the fsync: make it durable now
        return False
    ensure_dir(path.parent)
    tmp = tmp_name(path)
    try:
        write(tmp)
        fsync_file(tmp)
        # Its mtime says when it appeared, not when its bytes began: compaction's grace period counts from a
        # merged file's mtime, and a large merge takes a while to write and fsync.
        os.utime(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            fsync_dir(path.parent)
            return False
        except OSError as e:  # file systems without hard links
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            if path.exists():  # as for a link that found it: the other creator's entry made durable too
                fsync_dir(path.parent)
                return False
            os.rename(tmp, path)  # (a creator racing this one between the check and the rename is replaced)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def publish_dir(staging: Path, final: Path) -> None:
    """Renames a fully written (and fsynced) staging directory to `final`; `final` must not exist."""
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    os.rename(staging, final)
    fsync_dir(final.parent)


def remove_tree(path: Path) -> None:
    """Deletes a directory so that no reader ever sees it half-deleted under its own name: rename to a
    hidden trash name first (atomic), then delete the trash at leisure."""
    if not path.exists():
        return
    trash = tmp_name(path, "trash")
    try:
        os.rename(path, trash)
    except FileNotFoundError:  # another remover renamed it between our exists() and rename(): its job now
        return
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale_hidden(directory: Path, *, older_than_s: float, keep: Callable[[Path], bool] = lambda p: False) -> int:
    """Deletes hidden leftovers (temp files, staging and trash dirs) of crashed writers; returns how many.

    Only entries older than `older_than_s` go, so a writer that is still busy keeps its temp file.
    """
    removed = 0
    cutoff = time.time() - older_than_s
    try:
        with os.scandir(directory) as entries:  # names first: a registry folder holds a record per version
            hidden = [directory / e.name for e in entries if e.name.startswith(TMP_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in hidden:
        if keep(entry):
            continue
        try:
            if entry.lstat().st_mtime > cutoff:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
        except FileNotFoundError:
            continue
    return removed


class LockBusy(Exception):
    """A non-blocking FileLock found the lock held by another process."""


def _locked_fd(path: Path, *, blocking: bool, create: bool = True) -> int | None:
    """A descriptor of `path` (created if needed, unless not `create`: FileNotFoundError then) holding an
    exclusive flock; None if not `blocking` and another holder has it (flock locks belong to open files, so
    also within one process)."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if create else os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def FileLock(path: Path, *, blocking: bool = True, create: bool = True) -> Iterator[int]:  # noqa: N802 (reads like a class)
    """An exclusive advisory lock on `path` (created if needed; with `create` false, FileNotFoundError if it
    is missing: a lock file whose holder's life it tells), held for the `with` block, which gets the
    descriptor holding it: a child process given it (subprocess's `pass_fds`) holds the lock too, until
    the last holder closes it or exits."""
    fd = _locked_fd(path, blocking=blocking, create=create)
    if fd is None:
        raise LockBusy(f"{path} is held by another process")
    try:
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class HeldLock:
    """An exclusive advisory lock held until `release()` (or the process ends), for ownership that outlives
    a `with` block: a learner process owns a tenant for as long as it trains it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._finalizer = weakref.finalize(self, os.close, fd)  # a lock dropped unreleased is still let go

    @classmethod
    def try_acquire(cls, path: Path) -> HeldLock | None:
        """The lock, or None when another holder has it."""
        fd = _locked_fd(path, blocking=False)
        return None if fd is None else cls(path, fd)

    def release(self) -> None:
        self._finalizer()  # closes the descriptor once, however often it is called


# ---------------------------------------------------------------------------------------------------------
# Readiness: a long-running process says "I am ready" (model loaded, store loaded) with its pid, so a
# supervisor tells this life of the process from an earlier one that left its file behind. A process that
# stops cleanly takes its mark away again: a mark whose pid no longer runs is then one that did not (killed,
# crashed), which `clora status` could not otherwise tell from a Ctrl-C.


def mark_ready(state_dir: Path, process: str) -> None:
    """Records that this process (`learner`, `ingest`, ...) is ready: <state>/ready/<process>.json. Its clean
    stop calls `clear_ready`."""
    atomic_write_bytes(Path(state_dir) / "ready" / f"{process}.json", json.dumps({"pid": os.getpid(), "at": time.time()}).encode())


def clear_ready(state_dir: Path, process: str) -> bool:
    """Removes this process's ready mark as it stops cleanly; returns whether there was one to remove. A mark
    another process wrote since (a restart of it, ready already) is left alone, and so is one that cannot be
    removed (a data dir gone read-only): a stop stays clean either way."""
    if ready_pid(state_dir, process) != os.getpid():
        return False
    try:
        (Path(state_dir) / "ready" / f"{process}.json").unlink()
    except OSError:
        return False
    return True


def ready_pid(state_dir: Path, process: str) -> int | None:
    """The pid of the last `process` that marked itself ready, or None."""
    try:
        return int(json.loads((Path(state_dir) / "ready" / f"{process}.json").read_bytes())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
