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
    <stamp>-<pid>-<rand>.acked   a segment's progress: {"version": 1, "offset": <bytes>}, the length of its
                                 prefix Kafka acknowledged (only while the segment is being drained)
    <stamp>-<pid>-<rand>.acked-tmp   the next progress record, being written (then renamed over .acked)
    <pid>-<rand>.writer          a writer's liveness: the Spool whose segments carry <rand> holds an exclusive
                                 flock on it while it has segments (made as <pid>-<rand>.writer-tmp, locked,
                                 then renamed); free, its writer is gone, however it ended, and a live peer
                                 sends what it left (`left_behind`). Deleted once none of its writer's
                                 segments is left: by the writer itself, or by anyone once the writer is
                                 gone (a process id cannot tell that: replicas in containers may all be
                                 pid 1, and ids are reused)

A sender `claim`s a segment by taking a non-blocking exclusive flock: a sealed segment, or an `.open`
one whose writer died (its lock went with it). So several serving processes may share one spool
directory, and the segments a crashed process left behind are sent by whichever process claims them
first. The `.tmp` name exists because a file is locked only after it is created: no sender can claim a
new segment before its writer holds the lock. A claimed segment is deleted once every message in it
was acknowledged. Before that, the sender records how far it got (`Claim.acked`): the byte length of the
segment's acknowledged prefix, in the segment's `.acked` file, written whole to `.acked-tmp`, fsynced and
renamed over it. A later claim (by any process, after any crash) yields only the messages after that
prefix, so a broker that acknowledges less than a segment per try (up but slow) still drains the spool,
a piece per try, instead of being sent the same segment from its start for ever. The record only ever
names messages Kafka acknowledged (or that were dead-lettered), and a record lost in a crash, or one that
does not fit its segment (not at a line's end, past its size, unreadable), only means the segment is sent
from its start again: duplicates, harmless (see above), never a loss. Progress records whose segment is
gone (the sender died between the two deletions, or a sender of a version before them drained the
segment) are deleted by `segments()`. A spool written before progress records existed has none: its
segments are sent from their start, as then; a sender of that version ignores the records (it sends
segments in full and leaves the record, deleted later as above).

A line torn by a crash in the middle of a write is skipped with a warning: the batch it belonged to had
not been reported as spooled. An append that fails (disk full, I/O error) is cut off again (the segment
truncated to its size before the batch), so the next batch starts on a line of its own; if even that
fails, the segment is sealed as it is (its torn last line is the failed batch's) and the next batch goes
to a new one.

No segment grows past `segment_bytes` (a single message larger than that fills one of its own): an append
that does not fit in what is left of the open segment seals it and goes on in a new one, a piece per
segment, each piece written and fsynced before the next. So a large append (the event log moving its
whole queue here) makes several segments, each drained and deleted on its own. Should a piece fail, the
pieces before it stay in the spool, and `SpoolError.spooled` says how many messages (from the first) they
hold.

Names sort by creation time, so segments are sent in the order they were written.

Appends and seals take a lock, so one `Spool` may be shared by threads. (The event log writes it from its
own thread only: a request never waits for an fsync.)

Dead letters: a message Kafka refuses for good (larger than the producer's or the broker's limit) would
wedge the spool if it stayed in a segment, so the event log moves it, with its reason, to the file below;
so does a claim's `done()` with the lines of its segment that do not read as a message (reason
"unreadable": torn by a crash mid-write, or written by another version), before it deletes the segment:

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

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from storage.files import FileLock, LockBusy, ensure_dir

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 8 << 20
PROGRESS = ".acked"  # a segment's acknowledged prefix, beside it: <stem>.acked
PROGRESS_TMP = ".acked-tmp"
PROGRESS_VERSION = 1
WRITER = ".writer"  # <pid>-<writer id>.writer: locked for as long as the Spool that writes that id's segments lives
WRITER_TMP = ".writer-tmp"
STALE_WRITER_TMP_S = 60.0
DEAD_DIR = "dead"
UNREADABLE = ".unreadable"  # a segment that cannot be read: <name>.unreadable, out of every listing
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
        message = cls(topic=data["topic"], key=data["key"], value=data["value"])
        if not all(isinstance(v, str) for v in (message.topic, message.key, message.value)):
            raise TypeError("topic, key and value must be strings")
        return message


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
    """The spool directory cannot be written.

    `spooled`: of the messages given to the `append` that failed, how many (from the first) are in the
    spool all the same, in the segments filled before the failing piece; 0 for any other failure.
    """

    spooled = 0


class Spool:
    def __init__(self, directory: str | Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self._file = None  # the open segment: an unbuffered binary file object holding its flock
        self._path: Path | None = None
        self._size = 0  # bytes of whole batches in the open segment
        self._lock = threading.Lock()  # the open segment's state, shared by the threads that append
        self.id = uuid.uuid4().hex[:8]  # in the name of every segment this Spool writes
        self._writer = None  # its <pid>-<id>.writer file, locked, while it has segments
        self._writer_path: Path | None = None
        self._set_aside: set[Path] = set()  # segments this process cannot read or delete: out of its listings
        try:
            ensure_dir(self.directory)  # its entry made durable too: a fsynced segment in a lost directory is lost
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
        """Fills the open segment up to `segment_bytes`, then new ones: a piece per segment, each fsynced."""
        lines = [m.to_line() for m in messages]
        done = 0  # messages in the spool so far
        try:
            while done < len(lines):
                if self._file is None:
                    self._open_segment()
                room, end, size = self.segment_bytes - self._size, done, 0
                while end < len(lines) and (size + len(lines[end]) <= room or (end == done and self._size == 0)):
                    size += len(lines[end])  # whole lines only; one alone may overfill an empty segment
                    end += 1
                if end == done:  # the next line does not fit: it starts a new segment
                    self._seal()
                    continue
                self._write(b"".join(lines[done:end]), end - done)
                done = end
                if self._size >= self.segment_bytes:
                    self._seal()
        except SpoolError as e:
            e.spooled = done
            raise
        except OSError as e:  # sealing a full segment failed: it stays `.open`, an orphan that a sender claims
            error = SpoolError(f"cannot seal a full spool segment in {self.directory}: {e}")
            error.spooled = done
            raise error from e

    def _write(self, data: bytes, count: int) -> None:
        """Appends `data` (`count` whole lines) to the open segment, fsynced; cut off again if that fails."""
        fd, path, start = self._file.fileno(), self._path, self._size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            self._cut(start)
            raise SpoolError(f"cannot append {count} messages to {path}: {e}") from e
        self._size = start + len(data)

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
        stem = f"{time.time_ns():020d}-{os.getpid()}-{self.id}"
        tmp = self.directory / f"{stem}.tmp"
        file, name = None, tmp
        try:
            if self._writer is None:
                self._writer = self._announce()
            file = open(tmp, "ab", buffering=0)  # noqa: SIM115 (kept open: it holds the segment's lock)
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = tmp.with_suffix(".open")
            name = tmp.rename(path)
            _fsync_dir(self.directory)
        except OSError as e:
            if file is not None:  # nothing is in it yet: it goes, under whichever name it has (none is swept)
                file.close()
                with contextlib.suppress(OSError):
                    name.unlink(missing_ok=True)
            raise SpoolError(f"cannot open a spool segment in {self.directory}: {e}") from e
        self._file, self._path, self._size = file, path, 0

    def _announce(self):
        """Creates this Spool's writer file and holds its lock, which goes when the process does (however it
        ends): how a peer tells that this writer's segments are left behind. Locked before it gets its name,
        as a segment is, so no peer finds it unlocked while this process lives."""
        name = f"{os.getpid()}-{self.id}"
        tmp = self.directory / f"{name}{WRITER_TMP}"
        file = open(tmp, "ab", buffering=0)  # noqa: SIM115 (kept open: it holds the lock)
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._writer_path = tmp.rename(tmp.with_suffix(WRITER))
        except OSError:
            file.close()
            raise
        return file

    # --- reading ------------------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        """Segments that may be claimed (sealed ones, and open ones of other writers), oldest first.

        Deletes the progress records whose segment is gone (see the module docstring), and the writer files
        of writers that are gone and left no segment.
        """
        with self._lock:
            own = self._path
            names = list(self.directory.iterdir())
            found = [p for p in names if p.suffix in (".jsonl", ".open") and p != own and p not in self._set_aside]
            if own is None and self.id not in {_writer_id(p) for p in found}:
                self._let_writer_go()  # its segments are all sent: nothing for a peer to tell about it
        # A set-aside segment keeps its progress record: renamed back by an operator, it resumes after it.
        aside = {Path(p.name[: -len(UNREADABLE)]).stem for p in names if p.name.endswith(UNREADABLE)}  # any process's
        stems = {p.stem for p in found} | ({own.stem} if own else set()) | {p.stem for p in self._set_aside} | aside
        writers = {_writer_id(p) for p in found} | {self.id}
        for p in names:
            if p.suffix in (PROGRESS, PROGRESS_TMP) and p.stem not in stems:
                p.unlink(missing_ok=True)  # its segment was deleted: nobody reads it again
            elif p.suffix == WRITER and _writer_id(p) not in writers:
                _remove_if_unlocked(p)  # its writer is gone, and so are its segments
            elif p.suffix == WRITER_TMP and _writer_id(p) not in writers and _older_than(p, STALE_WRITER_TMP_S):
                _remove_if_unlocked(p)  # a writer that died making it (a new one is unlocked for a moment)
        return sorted(found, key=lambda p: p.name)

    def pending(self) -> int:
        """Messages this process should send: in its own segment, in sealed ones, in orphaned open ones.

        Segments another live process holds (a writer appending to its open one, a sender draining one) are
        that process's business and not counted.
        """
        with self._lock:
            own = self._path
        return self._count([*self.segments(), *([own] if own else [])], own)

    def left_behind(self) -> int:
        """`pending`'s messages in the segments whose writer has gone: the lock on its writer file is free
        (its process ended, however: a process id says nothing across containers, where every serving may
        be pid 1), or there is no such file (a writer makes it before its first segment, and it is deleted
        only once the writer is gone and so are its segments). A live writer sends its own segments, in its
        own order. A segment of a version before writer files has none: it counts as left behind."""
        with self._lock:
            own = self._path
        return self._count([p for p in self.segments() if not self._writer_lives(p)], own)

    def _writer_lives(self, segment: Path) -> bool:
        writer_id = _writer_id(segment)
        if writer_id == self.id:
            return True
        try:
            with FileLock(self.directory / f"{_writer_pid(segment)}-{writer_id}{WRITER}", blocking=False, create=False):
                return False
        except LockBusy:
            return True
        except FileNotFoundError:
            return False

    def _count(self, paths: list[Path], own: Path | None) -> int:
        count = 0
        for p in paths:
            try:
                with open(p, "rb") as f:
                    if p != own and not _unlocked(f):
                        continue
                    f.seek(_acked_offset(p, f))  # what Kafka acknowledged already is not pending
                    count += sum(chunk.count(b"\n") for chunk in iter(partial(f.read, 1 << 20), b""))
            except FileNotFoundError:  # claimed and deleted meanwhile
                continue
            except OSError as e:  # no permission, an I/O error: every pass would fail on it
                if p == own:
                    raise
                self._unreadable(p, e, "read")
        return count

    def _unreadable(self, segment: Path, e: OSError, doing: str) -> None:
        """A segment that failed to open or read: set aside when the fault is the file's (`_the_files_fault`);
        this process's own trouble (too many open files, no memory) is raised, the segment tried again later."""
        if not _the_files_fault(e):
            raise e
        self.set_aside(segment, f"cannot be {doing}: {e}")

    def set_aside(self, segment: Path, why: str, *, sent: bool = False) -> None:
        """Takes a segment this process cannot read (or, `sent`, cannot delete once sent) out of the way of the
        others, which would wait behind it for ever (every pass failing on it, new events spooled behind it):
        one that cannot be read is renamed `<name>.unreadable` (out of every listing: an operator may mend it
        and rename it back), and either is left out of this process's listings. Logged once."""
        if segment in self._set_aside:
            return
        self._set_aside.add(segment)
        what = "it was sent but stays (sent again by a later start: duplicates)" if sent else \
            "left where it is, out of this process's sending"
        if not sent:
            try:
                segment.rename(segment.with_name(segment.name + UNREADABLE))
                what = f"renamed {segment.name}{UNREADABLE}: its events are not sent"
            except FileNotFoundError:
                return  # claimed and deleted by another process meanwhile
            except OSError:
                pass
        logger.error("spool segment %s %s; %s", segment, why, what)

    @contextmanager
    def claim(self, segment: Path) -> Iterator[Claim | None]:
        """Locks `segment` for sending; yields None if another process holds it (or it is gone). The claim
        holds the messages after the segment's recorded progress (all of them if none is recorded)."""
        try:
            file = open(segment, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            yield None
            return
        except OSError as e:
            self._unreadable(segment, e, "opened")
            yield None
            return
        try:
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
            if not _still_named(segment, os.fstat(file.fileno())):  # deleted by a sender that held it before
                yield None  # us, or sealed (renamed .jsonl) by its writer since we opened it: claimed by that name
                return
            try:
                offset = _acked_offset(segment, file)
                file.seek(offset)
                data = file.read()
            except OSError as e:
                self._unreadable(segment, e, "read")
                yield None
                return
            messages, ends, unreadable = _read_messages(segment, data, offset)
            yield Claim(segment, messages, ends, unreadable, self.dead_letter)
        finally:
            file.close()

    def close(self) -> None:
        """Seals the open segment and lets the writer file go: deleted when none of this writer's segments
        is left, else left unlocked, so that a peer sends them (and the next look at the spool after they
        are gone deletes it)."""
        self.seal()
        try:
            self.segments()  # deletes the writer file if none of its segments is left
        except OSError:  # the spool cannot be listed: the file stays, for a later look to delete
            pass
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def _let_writer_go(self) -> None:
        """Deletes this Spool's writer file (under self._lock, with no segment of its own left); the next
        segment makes a new one."""
        if self._writer is not None:
            self._writer_path.unlink(missing_ok=True)
            self._writer.close()
            self._writer = None

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
            ensure_dir(directory)
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
    """A locked segment's messages not yet acknowledged, in order; `acked(n)` records that the first n of
    them were, `done()` deletes the segment once they all are."""

    path: Path
    messages: list[Message]
    ends: list[int]  # where each message's line ends in the segment (bytes from its start)
    # Lines that do not read as a message (torn by a crash, or written by another version), kept by `keep`
    # (the spool's dead letters) when the segment is deleted, never deleted with it.
    unreadable: list[Refused] = field(default_factory=list)
    keep: Callable[[Sequence[Refused]], object] | None = None

    def acked(self, count: int) -> None:
        """Records durably that the first `count` of `messages` were acknowledged (or dead-lettered): a later
        claim of the segment starts after them. Call it only for messages Kafka acknowledged."""
        if count <= 0:
            return
        path = self.path.with_suffix(PROGRESS)
        tmp = self.path.with_suffix(PROGRESS_TMP)
        data = json.dumps({"version": PROGRESS_VERSION, "offset": self.ends[count - 1]}).encode()
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)  # whole or not at all; a crash before the rename keeps the last record
        except OSError as e:
            raise SpoolError(f"cannot record the progress of {self.path.name} ({count} messages): {e}") from e

    def done(self) -> None:
        if self.unreadable and self.keep is not None:
            self.keep(self.unreadable)  # raises SpoolError: the segment stays, and is claimed again
        self.path.unlink(missing_ok=True)
        # After the segment: a crash in between leaves a record without its segment (segments() deletes it),
        # never a segment that lost its progress.
        self.path.with_suffix(PROGRESS).unlink(missing_ok=True)
        self.path.with_suffix(PROGRESS_TMP).unlink(missing_ok=True)
        _fsync_dir(self.path.parent)


def _read_messages(path: Path, data: bytes, offset: int) -> tuple[list[Message], list[int], list[Refused]]:
    """The messages of `data` (the segment from byte `offset` on), where each one's line ends, and the lines
    that do not read as one (as dead letters, reason `unreadable`)."""
    messages, ends, unreadable = [], [], []
    start = 0
    while start < len(data):
        newline = data.find(b"\n", start)
        end = len(data) if newline < 0 else newline + 1
        line = data[start:end]
        if line.strip():
            try:
                messages.append(Message.from_line(line))
                ends.append(offset + end)
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("spool segment %s: the line at byte %d is torn or corrupt, skipped (kept in %s/ "
                               "when the segment goes): %s", path.name, offset + start, DEAD_DIR, e)
                unreadable.append(Refused(Message("", "", line.decode("utf-8", errors="replace").rstrip("\n")),
                                          "unreadable", f"spool segment {path.name}, byte {offset + start}: {e}"))
        start = end
    return messages, ends, unreadable


def _the_files_fault(e: OSError) -> bool:
    """Whether an error reading a segment is about the file (its permissions, a disk error, something else in
    its place), not about this process (too many open files, no memory), which passes: a sound segment set
    aside for that would never be sent."""
    return e.errno in (errno.EACCES, errno.EPERM, errno.EIO, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EROFS)


def _still_named(path: Path, st: os.stat_result) -> bool:
    """Whether `path` still names the open file whose stat is `st` (not deleted, renamed or replaced)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_nlink > 0 and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)


def _acked_offset(segment: Path, file) -> int:
    """The recorded length of `segment`'s acknowledged prefix (`file` is the segment, open); 0 if none is
    recorded, or if the record does not fit the segment: then it is sent from its start (duplicates, no loss)."""
    record = segment.with_suffix(PROGRESS)
    try:
        data = json.loads(record.read_bytes())
        version, offset = data["version"], data["offset"]
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("spool progress record %s is unreadable (%s); %s is sent from its start", record.name, e,
                       segment.name)
        return 0
    size = os.fstat(file.fileno()).st_size
    fits = version == PROGRESS_VERSION and type(offset) is int and 0 <= offset <= size
    if fits and 0 < offset < size:
        file.seek(offset - 1)
        fits = file.read(1) == b"\n"  # a prefix ends at a line's end
    if not fits:
        logger.warning("spool progress record %s (version %r, offset %r) does not fit %s (%d bytes); it is sent "
                       "from its start", record.name, version, offset, segment.name, size)
        return 0
    return offset


def _writer_id(path: Path) -> str | None:
    """The writer id in a segment's or writer file's name (<stamp>-<pid>-<id>, <pid>-<id>), None if none."""
    parts = path.stem.split("-")
    return parts[-1] if len(parts) >= 2 else None


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except FileNotFoundError:
        return False


def _remove_if_unlocked(path: Path) -> None:
    try:
        with FileLock(path, blocking=False, create=False):
            path.unlink(missing_ok=True)
    except (LockBusy, FileNotFoundError):
        pass


def _writer_pid(segment: Path) -> int | None:
    """The process id in a segment's name (<stamp>-<pid>-<rand>), None if it holds none."""
    try:
        return int(segment.name.split("-")[1])
    except (IndexError, ValueError):
        return None


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
