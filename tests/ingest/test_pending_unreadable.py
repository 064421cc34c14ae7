"""ingest.pending: a stored file that cannot be read is left out of the store's load, with what that costs,
instead of keeping ingest from starting for every tenant."""

import pytest
from event_builders import NOW_MS, fb, inter

from ingest.batch import Processor, Record
from ingest.consumer import write_output
from ingest.events import FeedbackEvent, encode
from ingest.pending import PendingStore
from storage import parquet
from storage.compact import compact

pytestmark = pytest.mark.unit

EXPIRY_MS = 72 * 3_600_000


def _ingest(root, events) -> PendingStore:
    """Writes `events` as ingest does, one batch per event (a file per batch and tenant)."""
    processor = Processor({"fa": "feedback", "fb": "feedback"}, unknown_tenant="create", max_message_bytes=10_000)
    store = PendingStore.load(root, expiry_ms=EXPIRY_MS, now_ms=NOW_MS)
    for offset, e in enumerate(events):
        record = Record("f" if isinstance(e, FeedbackEvent) else "i", 0, offset, encode(e))
        write_output(str(root), store, processor.process([record], store, NOW_MS))
    return store


def _damage(path) -> None:
    path.write_bytes(path.read_bytes()[:-100])  # its footer cut off: a bad copy, a failing disk


def test_a_damaged_file_is_left_out_of_the_load_and_the_other_files_are_indexed(data_dir, caplog):
    _ingest(data_dir, [inter("a0", "fa"), inter("a1", "fa"), inter("b0", "fb"), fb("b9", tenant="fb")])
    damaged = sorted((data_dir / "interactions" / "tenant=fa").glob("*.parquet"))[0]
    first_ids = parquet.read_file(parquet.as_datadir(data_dir), str(damaged), columns=["id"]).column("id").to_pylist()
    _damage(damaged)

    with caplog.at_level("WARNING", logger="ingest.pending"):
        store = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS)
    assert store.unreadable == {str(damaged)}
    assert str(damaged) in caplog.text and "stored a second time" in caplog.text
    kept = {"a0", "a1"} - set(first_ids)
    assert all(("fa", i) in store.interactions for i in kept) and ("fb", "b0") in store.interactions
    assert not any(("fa", i) in store.interactions for i in first_ids)
    assert ("fb", "b9") in store.pending, "the other tenant's pending feedback is loaded"


def test_a_compacted_file_whose_footer_cannot_be_read_is_reported_and_the_rest_loads(data_dir, caplog):
    _ingest(data_dir, [inter("a0", "fa"), inter("a1", "fa"), inter("b0", "fb")])
    compact(data_dir, "interactions", grace_s=0)
    (merged,) = (data_dir / "interactions" / "tenant=fa").glob("compacted-*.parquet")
    _damage(merged)
    parquet._indexes.clear()  # as a process started now

    with caplog.at_level("WARNING", logger="ingest.pending"):
        store = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS)
    assert store.unreadable == {str(merged)}
    assert "stored a second time" in caplog.text
    assert ("fb", "b0") in store.interactions and ("fa", "a0") not in store.interactions


@pytest.mark.parametrize("error", [MemoryError(), OSError(24, "Too many open files")])
def test_trouble_of_this_process_is_not_taken_for_a_damaged_file(data_dir, monkeypatch, error):
    """Memory or file handles running out pass; taken for damage, a good file's keys would be left out (and
    its events stored twice) until the next load. The load fails instead, and ingest is restarted."""
    import ingest.pending as pending

    _ingest(data_dir, [inter("a0", "fa")])

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(pending, "read_file", failing)
    with pytest.raises(type(error)):
        PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS)


def test_what_counts_as_damage():
    import errno

    import pyarrow as pa

    assert parquet.damaged(pa.ArrowInvalid("Parquet magic bytes not found in footer"))
    assert parquet.damaged(OSError("Corrupt snappy compressed data"))  # Arrow's own: no errno
    assert parquet.damaged(OSError(errno.EIO, "Input/output error"))  # a failing disk
    assert parquet.damaged(ValueError("clora.supersedes in the footer is not a list of file names"))
    assert not parquet.damaged(MemoryError())
    assert not parquet.damaged(OSError(errno.EMFILE, "Too many open files"))
    assert not parquet.damaged(PermissionError(errno.EACCES, "Permission denied"))
