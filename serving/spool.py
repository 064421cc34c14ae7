"""The serving tier's on-disk spool: Kafka messages that could not be sent yet, kept until they are.

When the broker is unreachable, serving/events_log.py appends the messages here and sends them later.
A message leaves the spool only after Kafka acknowledged it, so the spool gives at-least-once delivery;
every event carries an idempotency key (tenant, id) that ingest deduplicates on, so what lands in
storage is exactly once.

Layout: one directory of segment files, one JSON object per line
(`{"topic": ..., "key": ..., "value": <the message text>}`), appended, flushed and fsynced per batch:

    <stamp>-<pid>-<rand>.tmp     being created (ignored by everyone)
    <stamp>-<pid>-<rand>.open    the segment a live writer appends to; it holds an exclusive flock on it
    <stamp>-<pid>-<rand>.jsonl   sealed: complete, waiting to be sent

A sender `claim`s a segment by taking a non-blocking exclusive flock: a sealed segment, or an `.open`
one whose writer died (its lock went with it). So several serving processes may share one spool
directory, and the segments a crashed process left behind are sent by whichever process claims them
first. The `.tmp` name exists because a file is locked only after it is created: no sender can claim a
new segment before its writer holds the lock. A claimed segment is deleted once every message in it
was acknowledged; if sending fails half-way the segment stays and is sent again in full later (the
duplicates are harmless, see above). A line torn by a crash in the middle of a write is skipped with
a warning: the batch it belonged to had not been reported as spooled. An append that fails (disk full,
I/O error) is cut off again (the segment truncated to its size before the batch), so the next batch starts
on a line of its own; if even that fails, the segment is sealed as it is (its torn last line is the failed
batch's) and the next batch goes to a new one.

Names sort by creation time, so segments are sent in the order they were written.

Appends and seals take a lock, so one `Spool` may be shared by threads. (The event log writes it from its
own thread only: a request never waits for an fsync.)

Dead letters: a message Kafka refuses for good (larger than the producer's or the broker's limit) would
wedge the spool if it stayed in a segment, so the event log moves it, with its reason, to

    dead/<YYYY-MM-DD>.jsonl      one JSON object per line (UTC day of the refusal), appended and fsynced:
                                 {"version": 1, "at": ISO-8601, "reason": "too_large", "detail": ...,
                                  "topic": ..., "key": ..., "value": <the whole message text>}

The directory has no suffix that `segments()` picks up, so no sender (of this version or an older one)
ever claims it. Dead letters stay until retention deletes a day's file (`clora prune`, storage.retention,
once the whole day is older than `[retention] days`); nothing here reads them again. Writers
of several processes append under an exclusive flock, so their lines never interleave.

What this module does not do: talk to Kafka (events_log.py does) or decide when to spool or what is dead.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 8 << 20
DEAD_DIR = "dead"
DEAD_LETTER_VERSION = 1


@dataclass(frozen=True)
class Message:
    """One Kafka message: topic, key (the tenant) and value (the event's JSON text)."""

    topic: str
    key: str
    value: str

    def to_line(self) -> bytes:
        return json.dumps({"topic": self.topic, "key": self.key, "value": self.value}, ensure_ascii=False).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> Message:
        data = json.loads(line)
        return cls(topic=data["topic"], key=data["key"], value=data["value"])


@dataclass(frozen=True)
class Refused:
    """A message Kafka will never take, with why: `reason` is short and stable ("too_large", the word
    ingest uses for the same cause), `detail` the error as Kafka's client put it."""

    message: Message
    reason: str
    detail: str

    def to_line(self, at: datetime) -> bytes:
        m = self.message
        data = {"version": DEAD_LETTER_VERSION, "at": at.isoformat(), "reason": self.reason, "detail": self.detail,
                "topic": m.topic, "key": m.key, "value": m.value}
        return json.dumps(data, ensure_ascii=False).encode() + b"\n"


class SpoolError(OSError):
    """The spool directory cannot be written."""


class Spool:
    def __init__(self, directory: str | Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self._file = None  # the open segment: an unbuffered binary file object holding its flock
        self._path: Path | None = None
        self._size = 0  # bytes of whole batches in the open segment
        self._lock = threading.Lock()  # the open segment's state, shared by the threads that append
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpoolError(f"cannot create the spool directory {self.directory}: {e}") from e

    # --- writing ------------------------------------------------------------------------------------------
    def append(self, messages: Sequence[Message]) -> None:
        """Appends the messages durably (written, flushed and fsynced before this returns)."""
        if not messages:
            return
        with self._lock:
            self._append(messages)

    def _append(self, messages: Sequence[Message]) -> None:
        if self._file is None:
            self._open_segment()
        data = b"".join(m.to_line() for m in messages)
        fd, path, start = self._file.fileno(), self._path, self._size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            self._cut(start)
            raise SpoolError(f"cannot append {len(messages)} messages to {path}: {e}") from e
        self._size = start + len(data)
        if self._size >= self.segment_bytes:
            self._seal()

    def _cut(self, size: int) -> None:
        """After a failed append: truncates the open segment back to `size` bytes, so no part of the failed
        batch stays in front of the next one; if that fails too, seals the segment as it is."""
        try:
            os.ftruncate(self._file.fileno(), size)
            os.fsync(self._file.fileno())
        except OSError as e:
            logger.warning("spool segment %s: cannot cut off a failed append (%s); sealing it", self._path, e)
            try:
                self._seal()
            except OSError:  # the file is closed and forgotten all the same; a sender claims it as an orphan
                pass

    def seal(self) -> None:
        """Closes the open segment (if any) so it can be claimed and sent."""
        with self._lock:
            self._seal()

    def _seal(self) -> None:
        if self._file is None:
            return
        file, path, size = self._file, self._path, self._size
        self._file = self._path = None
        self._size = 0
        try:
            if size == 0 and os.fstat(file.fileno()).st_size == 0:
                path.unlink()
            else:
                path.rename(path.with_suffix(".jsonl"))
                _fsync_dir(self.directory)
        finally:
            file.close()  # releases the lock only after the rename

    def _open_segment(self) -> None:
        stem = f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp = self.directory / f"{stem}.tmp"
        try:
            file = open(tmp, "ab", buffering=0)  # noqa: SIM115 (kept open: it holds the segment's lock)
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = tmp.with_suffix(".open")
            tmp.rename(path)
            _fsync_dir(self.directory)
        except OSError as e:
            raise SpoolError(f"cannot open a spool segment in {self.directory}: {e}") from e
        self._file, self._path, self._size = file, path, 0

    # --- reading ------------------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        """Segments that may be claimed (sealed ones, and open ones of other writers), oldest first."""
        with self._lock:
            own = self._path
        found = [p for p in self.directory.iterdir() if p.suffix in (".jsonl", ".open") and p != own]
        return sorted(found, key=lambda p: p.name)

    def pending(self) -> int:
        """Messages this process should send: in its own segment, in sealed ones, in orphaned open ones.

        Segments another live writer still appends to are that writer's business and not counted.
        """
        with self._lock:
            own = self._path
        count = 0
        for p in [*self.segments(), *([own] if own else [])]:
            try:
                with open(p, "rb") as f:
                    if p.suffix == ".open" and p != own and not _unlocked(f):
                        continue
                    count += sum(1 for line in f if line.endswith(b"\n"))
            except FileNotFoundError:  # claimed and deleted meanwhile
                continue
        return count

    @contextmanager
    def claim(self, segment: Path) -> Iterator[Claim | None]:
        """Locks `segment` for sending; yields None if another process holds it (or it is gone)."""
        try:
            file = open(segment, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            yield None
            return
        try:
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
            if os.fstat(file.fileno()).st_nlink == 0:  # deleted by a sender that held it before us
                yield None
                return
            yield Claim(segment, _read_messages(segment, file.read()))
        finally:
            file.close()

    def close(self) -> None:
        self.seal()

    # --- dead letters -------------------------------------------------------------------------------------
    def dead_letter(self, refused: Sequence[Refused]) -> Path:
        """Appends the refused messages to today's dead-letter file durably; returns its path.

        A failed append is cut off again (under the lock), so the next one starts on a line of its own.
        """
        at = datetime.now(timezone.utc)
        directory = self.directory / DEAD_DIR
        path = directory / f"{at:%Y-%m-%d}.jsonl"
        data = b"".join(r.to_line(at) for r in refused)
        try:
            directory.mkdir(exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise SpoolError(f"cannot open the dead-letter file {path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # other processes' writers: a few milliseconds at most
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
                _fsync_dir(directory)
            except OSError as e:
                try:
                    os.ftruncate(fd, start)
                except OSError:  # the torn line stays; readers of the file skip what does not parse
                    pass
                raise SpoolError(f"cannot append {len(refused)} dead letters to {path}: {e}") from e
        finally:
            os.close(fd)
        return path


@dataclass
class Claim:
    """A locked segment's messages; `done()` deletes the segment once they are all acknowledged."""

    path: Path
    messages: list[Message]

    def done(self) -> None:
        self.path.unlink(missing_ok=True)
        _fsync_dir(self.path.parent)


def _read_messages(path: Path, data: bytes) -> list[Message]:
    messages = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            messages.append(Message.from_line(line))
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("spool segment %s line %d is torn or corrupt, skipped: %s", path.name, number, e)
    return messages


def _unlocked(file) -> bool:
    """Whether nobody holds the file's lock (tested by taking it; closing the file releases it)."""
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
