"""The on-disk spool: durable appends, claims that exclude live writers, deletion only when done."""

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


def test_a_torn_last_line_is_skipped(tmp_path):
    spool = Spool(tmp_path)
    spool.append(msgs(2))
    spool.seal()
    [segment] = spool.segments()
    with open(segment, "ab") as f:
        f.write(b'{"topic": "clora.interactions", "key": "ac')  # a crash in the middle of a write
    with spool.claim(segment) as claim:
        assert len(claim.messages) == 2


def test_unsent_segments_survive_a_restart(tmp_path):
    first = Spool(tmp_path)
    first.append(msgs(4))
    first.close()
    again = Spool(tmp_path)
    assert again.pending() == 4
    assert sum(len(c.messages) for c in claimed(again)) == 4
