"""ingest.pending: the store view follows compaction: a join reads the compacted file that replaced its
interaction's file (not the tenant's whole dataset), and the file list stays near the live files. Pending
feedback keeps the first rows of each id in the order they came, the caps counting rows, live and reloaded."""

from datetime import timedelta

import pytest
from event_builders import NOW_MS, T0, fb, inter

import ingest.pending as pending
from ingest.batch import Processor, Record
from ingest.consumer import write_output
from ingest.events import FeedbackEvent, encode
from ingest.pending import PendingStore
from ingest.rows import FeedbackRow
from storage.compact import compact
from storage.parquet import live_files, read_dataset

pytestmark = pytest.mark.unit

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
    ing.feed(fb("a1", tenant="fa"), fb("a2", tenant="fa"), fb("a3", tenant="fa"), fb("b2", tenant="fb"))
    assert ing.rewarded() == {("fa", "a1"), ("fa", "a2"), ("fa", "a3"), ("fb", "b2")}
    (merged,) = live_files(data_dir, "interactions", "fa")
    assert ing.store.files[number] == merged, "remembered where a1 went"
    assert reads.count(merged) == 1, "three files' rows, now in one compacted file: read once"
    # compacted again, together with newer files: followed again
    ing.feed(inter("a9", "fa"))
    compact(data_dir, "interactions", grace_s=0)
    ing.feed(fb("a0", tenant="fa"), fb("a9", tenant="fa"))
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
    ing.feed(*(fb(i, tenant=t) for t, i in ids))
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


# ---------------------------------------------------------------------------------------------------------
# PendingFeedback: several rows may wait for one id (the first may turn out outside its interaction's expiry).


def row(id_, n, tenant="fa", ts=None, ingested_at=NOW_MS):
    """Feedback row `n` (its offset; each a different event: its ts is NOW_MS + n unless given)."""
    return FeedbackRow(id_, tenant, NOW_MS + n if ts is None else ts, 0.5, None, "f", 0, n, ingested_at)


def offsets(waiting: pending.PendingFeedback, key):
    return [r.kafka_offset for r in waiting.get(key)]


def test_rows_of_one_id_wait_in_the_order_they_came_up_to_the_limit_per_id():
    waiting = pending.PendingFeedback(cap=100)
    assert [waiting.add(row("a", n)) for n in range(pending.MAX_WAITING_PER_ID + 2)] == [None] * 8 + ["per_id"] * 2
    assert offsets(waiting, ("fa", "a")) == list(range(pending.MAX_WAITING_PER_ID))  # the later ones are left out
    assert len(waiting) == pending.MAX_WAITING_PER_ID and list(waiting) == [("fa", "a")]
    assert waiting.get(("fa", "nope")) == () and waiting.pop(("fa", "nope")) == ()
    assert len(waiting.pop(("fa", "a"))) == pending.MAX_WAITING_PER_ID and not waiting and len(waiting) == 0


def test_the_same_feedback_event_again_takes_one_place_in_the_join():
    """A replay after a restart (the view loaded it from disk) or a resend adds the same event again: it
    took a second place and, near the cap, pushed another interaction's feedback out of the join."""
    waiting = pending.PendingFeedback(cap=2)
    assert waiting.add(row("a", 0)) is None and waiting.add(row("b", 1)) is None
    assert waiting.add(row("b", 1)) is None and waiting.add(row("b", 7, ts=NOW_MS + 1)) is None  # the same event, re-read
    assert offsets(waiting, ("fa", "a")) == [0] and offsets(waiting, ("fa", "b")) == [1] and waiting.held == {"fa": 2}


def test_the_caps_count_rows_and_drop_the_oldest_rows_first():
    waiting = pending.PendingFeedback(cap=3, total=4)
    waiting.add(row("a", 0)), waiting.add(row("b", 1)), waiting.add(row("a", 2))
    assert waiting.add(row("c", 3)) == "over_cap"  # the tenant's oldest row goes: a's first; a keeps its place
    assert list(waiting) == [("fa", "a"), ("fa", "b"), ("fa", "c")] and offsets(waiting, ("fa", "a")) == [2]
    assert waiting.add(row("x", 4, tenant="fb")) is None and waiting.add(row("y", 5, tenant="fb")) == "over_cap"  # past 4 in all
    assert len(waiting) == 4 and offsets(waiting, ("fa", "a")) == []  # fa held the most: its oldest went
    assert waiting.held == {"fa": 2, "fb": 2}


def test_expiry_drops_old_rows_and_an_id_left_with_newer_ones_moves_back():
    waiting = pending.PendingFeedback(cap=100)
    waiting.add(row("a", 0, ingested_at=NOW_MS))
    waiting.add(row("b", 1, ingested_at=NOW_MS + 1))
    waiting.add(row("a", 2, ingested_at=NOW_MS + 5))
    assert waiting.expire(NOW_MS + 2) == 2  # a's first row and b
    assert list(waiting) == [("fa", "a")] and offsets(waiting, ("fa", "a")) == [2] and len(waiting) == 1
    waiting.add(row("c", 3, ingested_at=NOW_MS + 6))
    assert waiting.expire(NOW_MS + 6) == 1 and list(waiting) == [("fa", "c")]


def test_a_restart_loads_the_first_rows_of_each_id_in_the_order_they_came(data_dir):
    """A flood of feedback for one id on disk becomes at most MAX_WAITING_PER_ID Python rows."""
    ing = Ingest(data_dir)
    ing.feed(*(fb("a", tenant="fa", ts=T0 + timedelta(seconds=s)) for s in range(20)),
             fb("b", tenant="fa"), fb("b", -1.0, tenant="fa"))
    live = {key: ing.store.pending.get(key) for key in ing.store.pending}
    again = PendingStore.load(data_dir, expiry_ms=72 * 3_600_000, now_ms=NOW_MS)
    assert {key: again.pending.get(key) for key in again.pending} == live
    assert [r.ts for r in live[("fa", "a")]] == [NOW_MS + 1000 * s for s in range(pending.MAX_WAITING_PER_ID)]
    assert [r.score for r in live[("fa", "b")]] == [1.0, -1.0]


EXPIRY_MS = 72 * 3_600_000


def _feed(root, processor, store, *events, now_ms=NOW_MS, first_offset=0):
    records = [Record("f" if isinstance(e, FeedbackEvent) else "i", 0, first_offset + k, encode(e))
               for k, e in enumerate(events)]
    write_output(str(root), store, processor.process(records, store, now_ms))


def test_a_restart_leaves_out_the_feedback_of_tenants_scored_by_a_function(data_dir):
    """Their feedback scores nothing, and batch.py never lets it wait: loaded, it only took memory and room
    under the caps, here the total's, which cut the feedback of a tenant it does score."""
    processor = Processor({"fa": "feedback", "fx": "digits"}, unknown_tenant="reject", max_message_bytes=10_000)
    store = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS, max_pending=2,
                              function_scored=processor.functions)
    _feed(data_dir, processor, store, fb("a0", tenant="fa"), fb("a1", tenant="fa"),
          *(fb(f"x{i}", tenant="fx") for i in range(3)))
    assert sorted(store.pending) == [("fa", "a0"), ("fa", "a1")]
    again = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS, max_pending=2,
                              function_scored=processor.functions)
    assert sorted(again.pending) == [("fa", "a0"), ("fa", "a1")]


def test_a_tenant_moved_from_a_function_to_feedback_joins_its_stored_feedback_after_the_restart(data_dir):
    """The config of each start decides: feedback stored while a function scored the tenant waits once
    feedback scores it, within the expiry, for the interactions not scored yet."""
    before = Processor({"fx": "digits"}, unknown_tenant="reject", max_message_bytes=10_000)
    store = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS, function_scored=before.functions)
    _feed(data_dir, before, store, fb("old", tenant="fx"), now_ms=NOW_MS - EXPIRY_MS - 1)
    _feed(data_dir, before, store, inter("a", "fx"), fb("a", tenant="fx"), fb("b", tenant="fx"), first_offset=1)
    assert not store.pending

    after = Processor({"fx": "feedback"}, unknown_tenant="reject", max_message_bytes=10_000)
    store = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS, function_scored=after.functions)
    assert list(store.pending) == [("fx", "b")]  # a was scored by the function; old was ingested too long ago
    _feed(data_dir, after, store, inter("b", "fx"), inter("old", "fx"), first_offset=4)
    t = read_dataset(data_dir, "trajectories")
    assert sorted(zip(t.column("id").to_pylist(), t.column("reward_source").to_pylist())) == [
        ("a", "digits"), ("b", "feedback")]


def test_each_process_loads_the_pending_feedback_of_its_own_partitions_and_every_row_loads_once(data_dir):
    """Several ingest processes in a group: each loads the pending feedback of its own partitions, the
    feedback that reaches it live; the others' would take its memory and room under its caps (the total's
    cut here would leave out its own tenants' rows). A row of no partition, or of one past the topic's
    count, is loaded by partition 0's reader."""
    import pyarrow as pa

    from ingest.pending import OwnedPartitions

    processor = Processor({"fa": "feedback", "fb": "feedback"}, unknown_tenant="reject", max_message_bytes=10_000)
    store = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS)
    placed = {"p0": 0, "p1": 1, "p1b": 1, "p2": 2, "p7": 7}  # 7: beyond the topic's 3 partitions now
    records = [Record("f", partition, k, encode(fb(id_, tenant="fa" if k % 2 else "fb")))
               for k, (id_, partition) in enumerate(placed.items())]
    write_output(str(data_dir), store, processor.process(records, store, NOW_MS))

    def loaded(*partitions, total=None):
        owned = OwnedPartitions(frozenset(partitions), 3)
        again = PendingStore.load(data_dir, expiry_ms=EXPIRY_MS, now_ms=NOW_MS, owned=owned, max_pending=total)
        return sorted(id_ for _, id_ in again.pending)

    assert loaded(1) == ["p1", "p1b"] and loaded(2) == ["p2"] and loaded(0) == ["p0", "p7"]
    assert loaded(0, 1, 2) == sorted(placed) == sorted(id_ for _, id_ in store.pending)
    assert loaded(1, total=2) == ["p1", "p1b"], "the other partitions' rows take no room under the total"

    column = pa.chunked_array([pa.array([0, 1, 2, None, 7, -1], pa.int32())])
    assert OwnedPartitions(frozenset({1}), 3).mask(column).to_pylist() == [False, True, False, False, False, False]
    assert OwnedPartitions(frozenset({0, 2}), 3).mask(column).to_pylist() == [True, False, True, True, True, True]
