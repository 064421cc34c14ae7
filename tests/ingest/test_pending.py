"""ingest.pending: the store view follows compaction: a join reads the compacted file that replaced its
interaction's file (not the tenant's whole dataset), and the file list stays near the live files."""

from datetime import datetime, timezone

import pytest

import ingest.pending as pending
from ingest.batch import Processor, Record
from ingest.consumer import write_output
from ingest.events import FeedbackEvent, InteractionEvent, encode
from ingest.pending import PendingStore
from storage.compact import compact
from storage.parquet import live_files, read_dataset

pytestmark = pytest.mark.unit

T0 = datetime(2025, 5, 1, tzinfo=timezone.utc)
NOW_MS = int(T0.timestamp() * 1000)
TENANTS = ("fa", "fb")


class Ingest:
    """Processor + write_output as consumer.py runs them, one call per batch."""

    def __init__(self, root):
        self.root = str(root)
        self.processor = Processor({t: "feedback" for t in TENANTS}, unknown_tenant="create", max_message_bytes=10_000)
        self.store = PendingStore.load(self.root, expiry_ms=72 * 3_600_000, now_ms=NOW_MS)
        self.offset = 0

    def feed(self, *events):
        records = []
        for e in events:
            records.append(Record("f" if isinstance(e, FeedbackEvent) else "i", 0, self.offset, encode(e)))
            self.offset += 1
        write_output(self.root, self.store, self.processor.process(records, self.store, NOW_MS))

    def rewarded(self) -> set[tuple[str, str]]:
        t = read_dataset(self.root, "trajectories")
        return set(zip(t.column("tenant").to_pylist(), t.column("id").to_pylist()))


def inter(id_, tenant):
    return InteractionEvent(id=id_, tenant=tenant, prompt="p", completion="c", ts=T0)


def fb(id_, tenant):
    return FeedbackEvent(id=id_, tenant=tenant, score=1.0, ts=T0)


def test_a_join_after_compaction_reads_the_compacted_file_that_replaced_the_interactions_file(data_dir, monkeypatch):
    ing = Ingest(data_dir)
    for i in range(4):
        ing.feed(inter(f"a{i}", "fa"), inter(f"b{i}", "fb"))
    number = ing.store.interactions.get(("fa", "a1"))
    gone = ing.store.files[number]
    compact(data_dir, "interactions", grace_s=0)
    assert not (data_dir / gone).exists()

    reads = []
    real = pending.read_file
    monkeypatch.setattr(pending, "read_file", lambda dd, path, columns=None: (reads.append(path), real(dd, path, columns))[1])
    ing.feed(fb("a1", "fa"), fb("a2", "fa"), fb("a3", "fa"), fb("b2", "fb"))
    assert ing.rewarded() == {("fa", "a1"), ("fa", "a2"), ("fa", "a3"), ("fb", "b2")}
    (merged,) = live_files(data_dir, "interactions", "fa")
    assert ing.store.files[number] == merged, "remembered where a1 went"
    assert reads.count(merged) == 1, "three files' rows, now in one compacted file: read once"
    # compacted again, together with newer files: followed again
    ing.feed(inter("a9", "fa"))
    compact(data_dir, "interactions", grace_s=0)
    ing.feed(fb("a0", "fa"), fb("a9", "fa"))
    assert ing.rewarded() == {("fa", "a0"), ("fa", "a1"), ("fa", "a2"), ("fa", "a3"), ("fb", "b2"), ("fa", "a9")}


def test_the_file_list_stays_near_the_live_files_and_joins_still_find_their_rows(data_dir, monkeypatch):
    """Looked at after every RELOAD_MIN_FILES new numbers (here: 8) at the least, the list stays within three
    times the live files plus that, however many batches are written (the old list grew by one per tenant per
    batch: 200 here)."""
    monkeypatch.setattr(pending, "RELOAD_MIN_FILES", 8)
    ing = Ingest(data_dir)
    ids, longest, most_live, shrank = [], 0, 0, 0
    for i in range(100):
        before = len(ing.store.files)
        ing.feed(*(inter(f"{t}{i}", t) for t in TENANTS))
        ids += [(t, f"{t}{i}") for t in TENANTS]
        shrank += len(ing.store.files) < before
        if i % 5 == 4:
            compact(data_dir, "interactions", grace_s=0)
        longest = max(longest, len(ing.store.files))
        most_live = max(most_live, len(live_files(data_dir, "interactions")))
    assert shrank and longest <= 3 * most_live + pending.RELOAD_MIN_FILES + len(TENANTS), (longest, most_live)
    ing.feed(*(fb(i, t) for t, i in ids))
    assert ing.rewarded() == set(ids)


def test_without_compaction_the_index_is_not_rebuilt(data_dir, monkeypatch):
    monkeypatch.setattr(pending, "RELOAD_MIN_FILES", 4)
    loads = []
    real = PendingStore._load_interactions
    monkeypatch.setattr(PendingStore, "_load_interactions", lambda self: (loads.append(1), real(self))[1])
    ing = Ingest(data_dir)
    for i in range(30):
        ing.feed(inter(f"a{i}", "fa"))
    assert len(loads) == 1 and len(ing.store.files) == 30
