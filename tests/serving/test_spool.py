"""The on-disk spool: durable appends, claims that exclude live writers, deletion only when done; progress
through a segment that later claims start after; no segment past its size, however large the append."""

import os

import pytest

from serving.spool import Message, Spool

pytestmark = pytest.mark.unit


def msgs(n, start=0):
    return [Message("clora.interactions", "acme", f'{{"id":"i{i}"}}') for i in range(start, start + n)]


def claimed(spool):
    out = []
    for segment in spool.segments():
        with spool.claim(segment) as claim:
            if claim is not None:
                out.append(claim)
    return out


def test_append_seal_claim_done(tmp_path):
    spool = Spool(tmp_path)
    spool.append(msgs(3))
    spool.append(msgs(2, start=3))
    assert spool.pending() == 5
    assert spool.segments() == []  # the open segment is this writer's own
    spool.seal()
    [segment] = spool.segments()
    assert segment.suffix == ".jsonl"
    with spool.claim(segment) as claim:
        assert [m.value for m in claim.messages] == [f'{{"id":"i{i}"}}' for i in range(5)]
        claim.done()
    assert spool.pending() == 0 and list(tmp_path.iterdir()) == []


def test_segments_rotate_by_size_and_keep_order(tmp_path):
    spool = Spool(tmp_path, segment_bytes=200)
    for i in range(10):
        spool.append(msgs(1, start=i))
    spool.seal()
    values = [m.value for c in claimed(spool) for m in c.messages]
    assert values == [f'{{"id":"i{i}"}}' for i in range(10)]
    assert len(spool.segments()) > 1


def test_a_live_writers_segment_cannot_be_claimed_but_an_orphan_can(tmp_path):
    writer, sender = Spool(tmp_path), Spool(tmp_path)
    writer.append(msgs(2))
    [open_segment] = sender.segments()
    assert open_segment.suffix == ".open"
    with sender.claim(open_segment) as claim:
        assert claim is None  # the writer holds its lock
    assert sender.pending() == 0  # not the sender's to count

    writer._file.close()  # the writer dies without sealing: its lock goes with it
    writer._file = writer._path = None
    assert sender.pending() == 2
    [claim] = claimed(sender)
    assert len(claim.messages) == 2


def test_a_torn_last_line_is_skipped_and_kept_in_dead_when_its_segment_goes(tmp_path):
    """Lines that do not read as a message (torn by a crash, another version's, a value not a string) were
    skipped and then deleted with their segment."""
    import json

    spool = Spool(tmp_path)
    spool.append(msgs(2))
    spool.seal()
    [segment] = spool.segments()
    with open(segment, "ab") as f:
        f.write(b'{"topic": "t", "key": "acme", "value": {"id": "x"}}\n')  # a value that is no string
        f.write(b'{"topic": "clora.interactions", "key": "ac')  # a crash in the middle of a write
    with spool.claim(segment) as claim:
        assert len(claim.messages) == 2 and not list((tmp_path / "dead").glob("*"))
        claim.acked(2)
        claim.done()
    assert not segment.exists()
    (day,) = (tmp_path / "dead").glob("*.jsonl")
    kept = [json.loads(line) for line in day.read_text().splitlines()]
    assert [(k["reason"], k["value"]) for k in kept] == [
        ("unreadable", '{"topic": "t", "key": "acme", "value": {"id": "x"}}'),
        ("unreadable", '{"topic": "clora.interactions", "key": "ac')]
    assert all(f"spool segment {segment.name}, byte " in k["detail"] for k in kept)


def test_unsent_segments_survive_a_restart(tmp_path):
    first = Spool(tmp_path)
    first.append(msgs(4))
    first.close()
    again = Spool(tmp_path)
    assert again.pending() == 4
    assert sum(len(c.messages) for c in claimed(again)) == 4


def _values(spool):
    spool.seal()
    return [m.value for c in claimed(spool) for m in c.messages]


def _failing(real, *, after_bytes=None):
    """A stand-in for os.write that writes `after_bytes` of the data (if given) and then fails, once."""
    state = {"failed": False}

    def write(fd, data):
        if state["failed"]:
            return real(fd, data)
        state["failed"] = True
        if after_bytes is not None:
            real(fd, bytes(data[:after_bytes]))
        raise OSError(28, "No space left on device")

    return write


@pytest.mark.parametrize("written", [None, 0, 7, 40])
def test_a_failed_append_leaves_nothing_in_front_of_the_next_batch(tmp_path, monkeypatch, written):
    import os

    import serving.spool as spool_module
    from serving.spool import SpoolError

    spool = Spool(tmp_path)
    spool.append(msgs(2))
    monkeypatch.setattr(spool_module.os, "write", _failing(os.write, after_bytes=written))
    with pytest.raises(SpoolError, match="No space left"):
        spool.append(msgs(3, start=10))  # part of it reached the file before the disk filled
    spool.append(msgs(2, start=20))
    assert _values(spool) == [f'{{"id":"i{i}"}}' for i in (0, 1, 20, 21)]


def test_a_failed_fsync_cuts_the_batch_off_too(tmp_path, monkeypatch):
    import os

    import serving.spool as spool_module
    from serving.spool import SpoolError

    spool = Spool(tmp_path)
    spool.append(msgs(1))
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(spool_module.os, "fsync", fsync)
    with pytest.raises(SpoolError, match="Input/output"):
        spool.append(msgs(1, start=5))  # reported failed: it must not be sent
    spool.append(msgs(1, start=9))
    assert _values(spool) == ['{"id":"i0"}', '{"id":"i9"}']


def test_when_the_cut_fails_the_segment_is_sealed_and_the_next_batch_starts_a_new_one(tmp_path, monkeypatch):
    import os

    import serving.spool as spool_module
    from serving.spool import SpoolError

    spool = Spool(tmp_path)
    spool.append(msgs(2))
    monkeypatch.setattr(spool_module.os, "write", _failing(os.write, after_bytes=9))

    def ftruncate(fd, size):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(spool_module.os, "ftruncate", ftruncate)
    with pytest.raises(SpoolError):
        spool.append(msgs(3, start=10))
    assert len(spool.segments()) == 1  # sealed, with the torn line at its end
    spool.append(msgs(1, start=20))
    assert _values(spool) == ['{"id":"i0"}', '{"id":"i1"}', '{"id":"i20"}']  # the torn line is skipped


def test_appends_from_two_threads_keep_every_line_whole(tmp_path):
    import threading

    spool = Spool(tmp_path, segment_bytes=2000)  # rotating often, while the other thread appends

    def writer(start):
        for i in range(start, start + 200, 4):
            spool.append(msgs(4, start=i))

    threads = [threading.Thread(target=writer, args=(s,)) for s in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spool.seal()
    values = [m.value for c in claimed(spool) for m in c.messages]
    assert sorted(values) == sorted(f'{{"id":"i{i}"}}' for s in (0, 1000) for i in range(s, s + 200))
    mine = [v for v in values if int(v[8:-2]) < 1000]
    assert mine == sorted(mine, key=lambda v: int(v[8:-2]))  # each writer's order is kept


def test_dead_letters_are_kept_whole_with_their_reason_and_never_claimed(tmp_path):
    import json

    from serving.spool import Refused

    spool = Spool(tmp_path)
    big = Message("clora.interactions", "acme", '{"id":"big","completion":"' + "x" * 100_000 + '"}')
    path = spool.dead_letter([Refused(big, "too_large", "MessageSizeTooLargeError: over 1048576 bytes")])
    spool.dead_letter([Refused(msgs(1)[0], "invalid_record", "InvalidRecordError")])
    assert path.parent == tmp_path / "dead"
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [(d["version"], d["reason"], d["key"], d["topic"]) for d in lines] == [
        (1, "too_large", "acme", "clora.interactions"), (1, "invalid_record", "acme", "clora.interactions"),
    ]
    assert lines[0]["value"] == big.value and "1048576" in lines[0]["detail"]
    assert spool.segments() == [] and spool.pending() == 0


# --- draining a segment a piece at a time, and segments of bounded size ------------------------------------


def test_progress_is_recorded_and_a_later_claim_starts_after_it(tmp_path):
    """A sender that got part of a segment through records it; the next claim (of any process) yields the rest."""
    spool = Spool(tmp_path)
    spool.append(msgs(10))
    spool.seal()
    [segment] = spool.segments()
    with spool.claim(segment) as claim:
        claim.acked(4)  # Kafka acknowledged i0..i3, then the try ended
    assert spool.pending() == 6
    again = Spool(tmp_path)  # another process, or this one after a crash
    with again.claim(segment) as claim:
        assert [m.value for m in claim.messages] == [f'{{"id":"i{i}"}}' for i in range(4, 10)]
        claim.acked(3)  # counted from the first message it holds
    with again.claim(segment) as claim:
        assert [m.value for m in claim.messages] == [f'{{"id":"i{i}"}}' for i in range(7, 10)]
        claim.done()
    spool.pending()  # the writer's next look deletes its writer file: none of its segments is left
    assert list(tmp_path.iterdir()) == []  # the segment and its progress record


@pytest.mark.parametrize("record", [
    b'{"version": 1, "offset": 7}',  # not at a line's end
    b'{"version": 1, "offset": 100000}',  # past the segment's end
    b'{"version": 2, "offset": 0}',  # a version this one does not know
    b'{"version": 1, "off',  # unreadable
])
def test_a_progress_record_that_does_not_fit_its_segment_means_a_resend_from_the_start(tmp_path, record, caplog):
    spool = Spool(tmp_path)
    spool.append(msgs(3))
    spool.seal()
    [segment] = spool.segments()
    segment.with_suffix(".acked").write_bytes(record)
    with caplog.at_level("WARNING", logger="serving.spool"), spool.claim(segment) as claim:
        assert len(claim.messages) == 3  # duplicates at worst, never a message skipped
    assert segment.name in caplog.text


def test_a_progress_record_whose_segment_is_gone_is_deleted(tmp_path):
    """Left by a sender that died between deleting a segment and its record, or drained by an older version."""
    spool = Spool(tmp_path)
    spool.append(msgs(2))
    spool.seal()
    (tmp_path / "00000000000000000001-1-deadbeef.acked").write_bytes(b'{"version": 1, "offset": 10}')
    (tmp_path / "00000000000000000001-1-deadbeef.acked-tmp").write_bytes(b"")
    [segment] = spool.segments()
    assert sorted(p.name for p in tmp_path.iterdir()) == [segment.name, f"{os.getpid()}-{spool.id}.writer"]


def test_an_append_larger_than_a_segment_makes_several_segments(tmp_path):
    """One append (the event log moving its queue here) may be far larger than a segment; none grows past it."""
    spool = Spool(tmp_path, segment_bytes=200)
    spool.append(msgs(2))
    spool.append(msgs(20, start=2))  # about 1,500 bytes
    spool.seal()
    segments = spool.segments()
    assert len(segments) >= 6
    assert all(p.stat().st_size <= 200 for p in segments), [p.stat().st_size for p in segments]
    assert _values(spool) == [f'{{"id":"i{i}"}}' for i in range(22)]


def test_a_message_larger_than_a_segment_fills_one_of_its_own(tmp_path):
    spool = Spool(tmp_path, segment_bytes=200)
    big = Message("clora.interactions", "acme", '{"id":"big","completion":"' + "x" * 500 + '"}')
    spool.append([*msgs(1), big, *msgs(1, start=1)])
    spool.seal()
    assert [len(c.messages) for c in claimed(spool)] == [1, 1, 1]


def test_an_append_that_fails_part_way_keeps_the_segments_it_filled_and_says_so(tmp_path, monkeypatch):
    import os

    import serving.spool as spool_module
    from serving.spool import SpoolError

    spool = Spool(tmp_path, segment_bytes=200)
    per_segment = 200 // len(msgs(1)[0].to_line())  # 2 (73 bytes a line)
    real_write, writes = os.write, []

    def write(fd, data):  # the disk fills at the second piece
        writes.append(len(data))
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(spool_module.os, "write", write)
    with pytest.raises(SpoolError, match="No space left") as failed:
        spool.append(msgs(10))
    assert failed.value.spooled == per_segment  # the first segment's; the second piece was cut off
    monkeypatch.undo()
    spool.append(msgs(1, start=20))
    assert _values(spool) == [f'{{"id":"i{i}"}}' for i in [*range(per_segment), 20]]


def test_a_writer_file_being_made_is_left_to_its_writer_and_a_dead_ones_goes(tmp_path):
    """A new writer's file is unlocked for a moment before it is renamed: a peer's look at the spool deleted it
    then, and the writer's first segment failed to open."""
    import time

    peer = Spool(tmp_path)
    making = tmp_path / f"{os.getpid()}-0000aaaa.writer-tmp"
    left = tmp_path / f"{os.getpid()}-0000bbbb.writer-tmp"
    for f in (making, left):
        f.write_bytes(b"")
    an_hour_ago = time.time() - 3600
    os.utime(left, (an_hour_ago, an_hour_ago))
    peer.segments()
    assert making.exists() and not left.exists()


def test_a_spool_path_that_is_a_file_is_refused_at_start(tmp_path):
    """Taken at start, such a spool failed only at its first append: when Kafka is away and it is needed."""
    from serving.spool import SpoolError

    (tmp_path / "spool").write_text("")
    with pytest.raises(SpoolError, match="cannot create the spool directory"):
        Spool(tmp_path / "spool")
    with pytest.raises(SpoolError, match="cannot create the spool directory"):
        Spool(tmp_path / "spool" / "below")


@pytest.mark.parametrize("fails", ["rename", "fsync"])
def test_a_segment_that_cannot_be_opened_leaves_no_file_behind(tmp_path, monkeypatch, fails):
    """A `.tmp` segment (or an empty `.open` one) whose opening failed stayed until the writer's end: no one
    sweeps them."""
    from pathlib import Path

    import serving.spool as spool_module
    from serving.spool import SpoolError

    spool = Spool(tmp_path)
    before = set(tmp_path.iterdir())
    if fails == "rename":
        real = Path.rename
        monkeypatch.setattr(Path, "rename", lambda self, target: (_ for _ in ()).throw(OSError(5, "Input/output error"))
                            if self.suffix == ".tmp" else real(self, target))
    else:
        monkeypatch.setattr(spool_module, "_fsync_dir",
                            lambda d: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(SpoolError, match="cannot open a spool segment"):
        spool.append(msgs(1))
    assert {p.suffix for p in set(tmp_path.iterdir()) - before} <= {".writer"}
    monkeypatch.undo()
    spool.append(msgs(1))  # the next append opens one
    spool.seal()
    assert len(spool.segments()) == 1


def test_a_segment_sealed_between_a_senders_open_and_its_lock_is_not_claimed_by_its_old_name(tmp_path, monkeypatch):
    """The sender opened `X.open`, the writer sealed it (renamed to `X.jsonl`, lock let go), the sender's lock
    then succeeded: it sent the messages, and its `done()` removed `X.open` (gone) and not `X.jsonl`, whose
    messages were sent again by the next claim."""
    import fcntl

    import serving.spool as spool_module

    writer, sender = Spool(tmp_path), Spool(tmp_path)
    writer.append([Message("t", "acme", '{"id":"e%d"}' % i) for i in range(3)])
    (segment,) = [p for p in sender.segments() if p.suffix == ".open"]
    real_flock, sealed = fcntl.flock, []

    def flock(fd, op):
        if not sealed:
            sealed.append(1)
            writer.seal()  # right between the sender's open() and its flock()
        return real_flock(fd, op)

    monkeypatch.setattr(spool_module.fcntl, "flock", flock)
    with sender.claim(segment) as claim:
        assert claim is None, "claimed under a name the segment no longer has"
    monkeypatch.setattr(spool_module.fcntl, "flock", real_flock)
    (sealed_segment,) = [p for p in sender.segments() if p.suffix == ".jsonl"]
    with sender.claim(sealed_segment) as claim:
        assert len(claim.messages) == 3
        claim.done()
    assert sender.segments() == []


def test_a_segment_is_set_aside_only_for_its_own_fault_not_for_this_processs(tmp_path, monkeypatch):
    """Too many open files (an overload) is this process's trouble: a sound segment renamed .unreadable for it
    would never be sent. A file's own fault (here a directory in its place) sets it aside."""
    import errno

    import serving.spool as spool_module

    writer, sender = Spool(tmp_path), Spool(tmp_path)
    writer.append(msgs(2))
    writer.seal()
    [segment] = sender.segments()

    def no_more_files(path, mode="r", *args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files", str(path))

    monkeypatch.setattr(spool_module, "open", no_more_files, raising=False)
    with pytest.raises(OSError, match="Too many open files"):
        with sender.claim(segment):
            pass
    with pytest.raises(OSError, match="Too many open files"):
        sender.pending()
    monkeypatch.undo()
    assert sender.segments() == [segment] and sender.pending() == 2, "still there, and sent once files can be opened"
    blocked = segment.with_name("0" + segment.name)
    blocked.mkdir()
    progress = blocked.with_suffix(".acked")
    progress.write_text('{"version": 1, "offset": 0}')
    assert sender.pending() == 2 and blocked.with_name(blocked.name + ".unreadable").is_dir()
    assert sender.segments() == [segment]
    assert Spool(tmp_path).segments() == [segment] and progress.exists(), \
        "a set-aside segment keeps its progress record, for any process (renamed back, it resumes after it)"
