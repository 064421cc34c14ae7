"""The join and the dedup, without Kafka: batches of records -> Parquet through the real store view.

Covers: feedback before / after its interaction, across a restart (the view rebuilt from the datasets),
days apart within and beyond the expiry; the first feedback within the expiry wins however the batches are
cut; the per-tenant cap on pending feedback (also after a restart);
the first score wins; inline rewards and scorer functions; integers too large for a float (in an event, or
from a scorer) dead-lettered without stopping the batch;
scorer failures and unknown tenants dead-lettered (under `_unknown`), the cap on tenants created on the fly; replays of any range write nothing twice; a batch
decided while the previous one is still being written (consumer.py's pipelining) decides the same.
"""

import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from event_builders import NOW_MS, T0, fb, inter
from hypothesis import given, settings
from hypothesis import strategies as st

import ingest.index as index_module
import ingest.pending as pending_module
from ingest.batch import Processor, Record
from ingest.consumer import BatchWrite, write_output
from ingest.events import FeedbackEvent, encode
from ingest.pending import PendingStore
from storage.parquet import read_dataset

pytestmark = pytest.mark.unit

HOUR_MS = 3_600_000


def bad_scorer(completion, prompt):
    raise ZeroDivisionError("scorer bug")


def huge_scorer(completion, prompt):
    return 10**400


SCORER_CALLS = []


def slow_scorer(completion, prompt):
    """Takes 50 ms per call: a judge model behind a python: scorer, in miniature."""
    time.sleep(0.05)
    return 1.0


def counted_bad_scorer(completion, prompt):
    SCORER_CALLS.append(completion)
    raise ZeroDivisionError("scorer bug")


def allocating_scorer(completion, prompt):
    """Asks numpy for an array no machine holds: numpy raises its MemoryError subclass at once."""
    import numpy as np

    return float(np.ones(2**62, dtype=np.uint8).sum())


LONE_SURROGATE = json.loads('"\\ud83d oops"')  # JSON's escape of half an emoji: a str no UTF-8 encodes


def surrogate_error_scorer(completion, prompt):
    raise ValueError(f"no number: {LONE_SURROGATE}")


class Harness:
    """Feeds records through Processor + write_output as consumer.py does, one call per batch."""

    def __init__(self, root, *, scorers=None, unknown_tenant="create", expiry_hours=72, max_pending_per_tenant=100_000,
                 max_pending=None, max_auto_tenants=64):
        self.root = str(root)
        self.expiry_ms = int(expiry_hours * HOUR_MS)
        self.max_pending = max_pending_per_tenant
        self.max_pending_total = max_pending
        self.processor = Processor(
            scorers or {"fb": "feedback", "inl": "inline", "dig": "digits"},
            unknown_tenant=unknown_tenant, max_message_bytes=10_000, max_auto_tenants=max_auto_tenants,
        )
        self.offsets: dict[str, int] = {}
        self.log: list[Record] = []
        self.restart()

    def restart(self, now_ms=NOW_MS, topics_since=None):
        self.store = PendingStore.load(
            self.root, expiry_ms=self.expiry_ms, now_ms=now_ms, max_pending_per_tenant=self.max_pending,
            max_pending=self.max_pending_total, function_scored=self.processor.functions, topics_since=topics_since,
        )

    def record(self, event_or_bytes) -> Record:
        topic = "f" if isinstance(event_or_bytes, FeedbackEvent) else "i"
        value = event_or_bytes if isinstance(event_or_bytes, bytes) else encode(event_or_bytes)
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        rec = Record(topic, 0, offset, value)
        self.log.append(rec)
        return rec

    def feed(self, *events, now_ms=NOW_MS):
        return self.replay([self.record(e) for e in events], now_ms=now_ms)

    def replay(self, records, now_ms=NOW_MS):
        out = self.processor.process(list(records), self.store, now_ms)
        write_output(self.root, self.store, out)
        return out

    def table(self, dataset):
        return read_dataset(self.root, dataset)

    def rewards(self):
        t = self.table("trajectories")
        return sorted(zip(t.column("id").to_pylist(), t.column("reward").to_pylist(), t.column("reward_source").to_pylist()))


@pytest.fixture
def h(data_dir):
    return Harness(data_dir)


def test_feedback_after_its_interaction_in_a_later_batch(h):
    h.feed(inter("a"))
    assert h.rewards() == []
    h.feed(fb("a", 0.5, source="thumbs"))
    assert h.rewards() == [("a", 0.5, "thumbs")]
    assert h.table("interactions").num_rows == 1 and h.table("feedback").num_rows == 1


def test_feedback_before_its_interaction(h):
    h.feed(fb("a", -1.0))
    assert len(h.store.pending) == 1
    h.feed(inter("a"))
    assert h.rewards() == [("a", -1.0, "feedback")] and not h.store.pending


def test_both_in_one_batch_either_order(h):
    h.feed(fb("a", 1.0), inter("a"), inter("b"), fb("b", 0.25))
    assert h.rewards() == [("a", 1.0, "feedback"), ("b", 0.25, "feedback")]


def test_feedback_after_a_restart_finds_the_stored_interaction(h):
    h.feed(inter("a"), inter("b"))
    h.restart()
    h.feed(fb("b", 0.75))
    assert h.rewards() == [("b", 0.75, "feedback")]


def test_feedback_for_a_pruned_interaction_waits_and_the_file_is_not_read_again(h, monkeypatch):
    """Retention deleted the file holding "a": its feedback waits as for an interaction not seen (neither a
    crash nor a read of the tenant's whole dataset), and the replayed interaction is still a duplicate."""
    from storage.retention import prune

    h.feed(inter("a"), inter("b"))
    h.feed(inter("c"), now_ms=NOW_MS + 10 * HOUR_MS)
    (pruned,) = prune(h.root, older_than_s=5 * 3600, dataset="interactions", now_s=NOW_MS / 1000 + 6 * 3600)
    assert (pruned.files, pruned.rows) == (1, 2)
    reads, read_ids = [], type(h.store)._read_ids
    monkeypatch.setattr(type(h.store), "_read_ids", lambda self, path, ids: reads.append(path) or read_ids(self, path, ids))
    out = h.feed(fb("a", 1.0))
    assert not out.trajectories and ("fb", "a") in h.store.pending
    assert len(reads) == 1  # found gone once...
    h.feed(fb("b", 1.0))
    assert len(reads) == 1 and ("fb", "b") in h.store.pending  # ...and not looked for again
    # Sent again, "a" is a duplicate to the index (not stored again), but it carries its own content: the
    # waiting feedback joins it.
    assert h.feed(inter("a")).duplicates == 1
    assert h.rewards() == [("a", 1.0, "feedback")]


def test_after_retention_the_key_indexes_shrink_to_the_rows_stored(h):
    """A process that runs for months would otherwise hold a key for every row it ever stored."""
    from storage.retention import prune

    h.feed(*(inter(f"a{i}", tenant="inl", reward=0.5) for i in range(4)), fb("x", 1.0), b"nope")
    h.feed(inter("late", tenant="inl", reward=1.0), now_ms=NOW_MS + 10 * HOUR_MS)
    store = h.store
    assert (len(store.trajectories), len(store.feedback), len(store.dead_letters)) == (5, 1, 1)
    prune(h.root, older_than_s=5 * 3600, now_s=NOW_MS / 1000 + 6 * 3600)
    store._look_at = 0  # the loop looks after a commit once the file list has grown enough
    store.shrink_files()
    assert (len(store.trajectories), len(store.feedback), len(store.dead_letters)) == (1, 0, 0)
    assert h.feed(inter("late", tenant="inl", reward=1.0)).duplicates == 1  # what is stored is still known
    # An index within twice its stored rows is left as it is.
    store._look_at = 0
    before = store.trajectories
    store.shrink_files()
    assert store.trajectories is before


def test_feedback_whose_id_the_index_confuses_with_a_stored_one_waits_instead_of_crashing(h, monkeypatch):
    """A hash collision (1 in 2**64 by chance; forced here) makes the index say "AA" is stored, and the
    file it names has no such id: the read of no rows raised (array_take on a null array), ingest exited,
    and every restart replayed the batch into the same crash. Before key_hash, "AA" and "䅁" collided so
    in every process."""
    real = index_module.key_hash
    monkeypatch.setattr(index_module, "key_hash", lambda key: real(tuple("AA" if p == "䅁" else p for p in key)))
    h.feed(inter("䅁"))
    h.feed(fb("AA", 1.0))
    assert set(h.store.pending) == {("fb", "AA")} and h.rewards() == []
    assert h.table("feedback").column("id").to_pylist() == ["AA"]
    h.restart()  # what the crash loop did: the feedback's offsets replayed on a view rebuilt from disk
    h.replay(h.log[-1:])
    assert set(h.store.pending) == {("fb", "AA")} and h.table("feedback").num_rows == 1 and h.rewards() == []


def test_ids_whose_str_hash_collides_are_different_interactions(h):
    """"AA" and "䅁" share hash() in every process (CPython hashes a str's internal buffer: "AA" in one-byte
    storage, "䅁" in two-byte storage, the same bytes); the index told them apart only by chance, so the
    second to arrive was dropped as a duplicate."""
    assert hash(("fb", "AA")) == hash(("fb", "䅁"))
    h.feed(inter("AA"))
    h.feed(inter("䅁"), inter("BB"))
    h.restart()  # the index rebuilt from Parquet hashes as the one built batch by batch did
    h.feed(inter("䉂"), inter("BB"))  # "䉂" shares hash() with "BB", stored before the restart
    assert sorted(h.table("interactions").column("id").to_pylist()) == ["AA", "BB", "䅁", "䉂"]
    h.feed(fb("䅁", -0.5), fb("AA", 0.5), fb("BB", 0.25), fb("䉂", -0.25))
    assert h.rewards() == [("AA", 0.5, "feedback"), ("BB", 0.25, "feedback"), ("䅁", -0.5, "feedback"),
                           ("䉂", -0.25, "feedback")]
    assert not h.store.pending


def test_pending_feedback_survives_a_restart(h):
    h.feed(fb("a", 0.2))
    h.restart()
    assert set(h.store.pending) == {("fb", "a")}
    h.feed(inter("a"))
    assert h.rewards() == [("a", 0.2, "feedback")]


def test_days_apart_within_and_beyond_the_expiry(h):
    h.feed(inter("near", ts=T0), inter("far", ts=T0))
    h.feed(fb("near", 1.0, ts=T0 + timedelta(days=2)), fb("far", 1.0, ts=T0 + timedelta(days=4)))
    assert h.rewards() == [("near", 1.0, "feedback")]
    assert h.table("feedback").num_rows == 2  # every feedback event is kept


# One interaction X and two feedback events for it, expiry 24 h: F1 30 days off X (score -1), then F2 one hour off
# (score +1). The first feedback within the expiry of X wins, wherever the batches were cut: F2, reward 1.0.
# F1 alone was remembered when it came first (for a stored X, or waiting for X), so F2 was never tried.
LAYOUTS = {
    "[X] [F1, F2]": [["X"], ["F1", "F2"]],
    "[F1, F2] [X]": [["F1", "F2"], ["X"]],
    "[X] [F1] [F2]": [["X"], ["F1"], ["F2"]],
    "[X, F1, F2]": [["X", "F1", "F2"]],
    "[F1] [F2] [X]": [["F1"], ["F2"], ["X"]],
    "[F1, F2, X]": [["F1", "F2", "X"]],
    "[F1, X, F2]": [["F1", "X", "F2"]],
    "[F1, F2] restart [X]": [["F1", "F2"], "restart", ["X"]],
    "[F1] restart [F2] [X]": [["F1"], "restart", ["F2"], ["X"]],
    "[X] restart [F1, F2]": [["X"], "restart", ["F1", "F2"]],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_first_feedback_within_the_expiry_wins_however_the_batches_are_cut(data_dir, layout):
    h = Harness(data_dir, expiry_hours=24)
    x_ts = T0 + timedelta(days=40)
    events = {"X": inter("a", ts=x_ts), "F1": fb("a", -1.0, ts=x_ts - timedelta(days=30)),
              "F2": fb("a", 1.0, ts=x_ts + timedelta(hours=1))}
    for batch in LAYOUTS[layout]:
        if batch == "restart":
            h.restart()
        else:
            h.feed(*(events[name] for name in batch))
    assert h.rewards() == [("a", 1.0, "feedback")]
    assert not h.store.pending and h.table("feedback").num_rows == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([-50, -30, -24, -1, 0, 12, 25, 40]), st.sampled_from([-1.0, 0.0, 0.5, 1.0])),
                min_size=1, max_size=pending_module.MAX_WAITING_PER_ID),
       st.data())
def test_the_reward_does_not_depend_on_where_batches_are_cut_or_restarts_fall(feedback, data):
    """Any order of one interaction and its feedback (hours off it, expiry 24 h), cut into batches anyhow,
    with restarts anywhere: the reward is the first feedback in stream order within 24 h of it, or none."""
    stream = [fb("a", score, ts=T0 + timedelta(hours=hours)) for hours, score in feedback]
    stream.insert(data.draw(st.integers(0, len(stream)), label="where X comes"), inter("a", ts=T0))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(stream) - 1)), label="cuts")) if len(stream) > 1 else []
    restarts = data.draw(st.lists(st.booleans(), min_size=len(cuts), max_size=len(cuts)), label="restarts")
    with tempfile.TemporaryDirectory() as root:
        h = Harness(root, expiry_hours=24)
        for start, end, restart in zip([0, *cuts], [*cuts, len(stream)], [False, *restarts]):
            if restart:
                h.restart()
            h.feed(*stream[start:end])
        expected = next((score for hours, score in feedback if abs(hours) <= 24), None)
        assert h.rewards() == ([] if expected is None else [("a", expected, "feedback")])


def test_pending_feedback_leaves_memory_after_the_expiry(h):
    h.feed(fb("a", 0.5))
    assert h.store.expire(NOW_MS + 71 * HOUR_MS) == 0
    assert h.store.expire(NOW_MS + 73 * HOUR_MS) == 1 and not h.store.pending
    h.restart(now_ms=NOW_MS + 73 * HOUR_MS)  # nor is it reloaded
    assert not h.store.pending


def test_pending_feedback_is_capped_per_tenant_and_the_oldest_leaves_memory_first(data_dir):
    """A flood of feedback for ids that never arrive (any API key can send it) holds at most the cap per
    tenant in memory; what leaves is still in feedback/, and counted."""
    h = Harness(data_dir, max_pending_per_tenant=3)
    out = h.feed(*(fb(f"x{i}", 0.5) for i in range(5)), fb("y", 0.5, tenant="inl"))
    assert out.pending_dropped == {"over_cap": 2}
    assert sorted(h.store.pending) == [("fb", "x2"), ("fb", "x3"), ("fb", "x4"), ("inl", "y")]
    assert len(h.store.pending) == 4
    out = h.feed(fb("x5", 0.5))
    assert out.pending_dropped == {"over_cap": 1} and ("fb", "x2") not in h.store.pending
    assert h.table("feedback").num_rows == 7  # every feedback event is kept
    # A dropped one no longer scores its late interaction; one still waiting does.
    h.feed(inter("x0"), inter("x5"))
    assert h.rewards() == [("x5", 0.5, "feedback")]


def test_a_ninth_feedback_event_for_one_waiting_id_is_counted_as_per_id_not_over_cap(data_dir):
    h = Harness(data_dir)
    out = h.feed(*(fb("x", 0.5, ts=T0 + timedelta(seconds=i)) for i in range(9)))  # nine events for one id
    assert out.pending_dropped == {"per_id": 1}
    assert len(h.store.pending) == 8 and h.table("feedback").num_rows == 9  # every feedback event is kept


def test_the_cap_holds_after_a_restart_keeping_the_newest(data_dir, monkeypatch):
    monkeypatch.setattr("ingest.pending.LOAD_CHUNK", 2)  # ids are checked for a trajectory a chunk at a time
    h = Harness(data_dir, max_pending_per_tenant=3)
    for i in range(5):  # one batch each, ingested a minute apart
        h.feed(fb(f"x{i}", 0.5), now_ms=NOW_MS + i * 60_000)
    h.feed(fb("x4", -1.0), inter("x3"), now_ms=NOW_MS + 5 * 60_000)  # x3 joined: not pending any more
    h.restart(now_ms=NOW_MS + 6 * 60_000)
    # The cap counts rows: x4's two take two of the three places, the newest id before it the third.
    assert sorted(h.store.pending) == [("fb", "x2"), ("fb", "x4")] and len(h.store.pending) == 3
    assert [f.score for f in h.store.pending.get(("fb", "x4"))] == [0.5, -1.0]  # in the order they came
    h.feed(inter("x4"), inter("x0"))
    assert h.rewards() == [("x3", 0.5, "feedback"), ("x4", 0.5, "feedback")]


def test_past_the_total_cap_the_tenant_holding_the_most_makes_room(data_dir):
    """One tenant's flood must not take the room of the others: past the total, the oldest entry of whoever
    holds the most goes (the flooding tenant itself, once it is the largest)."""
    h = Harness(data_dir, max_pending_per_tenant=100, max_pending=6)
    h.feed(fb("a1", 0.5, tenant="inl"), fb("a2", 0.5, tenant="inl"))
    out = h.feed(*(fb(f"x{i}", 0.5) for i in range(7)))
    assert out.pending_dropped == {"over_cap": 3}
    assert sorted(h.store.pending) == [("fb", "x3"), ("fb", "x4"), ("fb", "x5"), ("fb", "x6"), ("inl", "a1"), ("inl", "a2")]
    h.feed(inter("a1", tenant="inl"), inter("x0"), inter("x6"))
    assert h.rewards() == [("a1", 0.5, "feedback"), ("x6", 0.5, "feedback")]


def test_levelling_to_the_total_keeps_exactly_the_total_the_remainder_going_to_the_largest():
    from ingest.pending import PendingFeedback
    from ingest.rows import FeedbackRow

    pending = PendingFeedback(cap=100, total=5)
    for tenant, n in (("a", 3), ("b", 3), ("c", 4)):
        for i in range(n):
            pending.add(FeedbackRow(f"{tenant}{i}", tenant, NOW_MS, 1.0, None, "f", 0, i, NOW_MS), hold_total=False)
    assert pending.fit_total() == 5 and len(pending) == 5
    # an even share of 5 over three is 1, remainder 2: the two largest (b, then c, by size) keep 2 each
    assert sorted(pending) == [("a", "a2"), ("b", "b1"), ("b", "b2"), ("c", "c2"), ("c", "c3")]


def test_the_total_cap_holds_after_a_restart_levelling_the_largest_tenants(data_dir):
    # Pending per tenant: fb2 1, inl 2, fb 5 (8 in all). A total of 6: fb2's 1 is under an even share (6 // 3),
    # so is inl's 2 (5 left, 5 // 2), and fb, the only one above, keeps its newest 3 (what is left). dig's
    # feedback (a function scores dig) never waits, at a restart either.
    h = Harness(data_dir, scorers={"fb": "feedback", "fb2": "feedback", "inl": "inline", "dig": "digits"},
                max_pending_per_tenant=100)
    for i in range(5):
        h.feed(fb(f"x{i}", 0.5), now_ms=NOW_MS + i * 60_000)
    h.feed(fb("a1", 0.5, tenant="inl"), fb("a2", 0.5, tenant="inl"), fb("d1", 0.5, tenant="fb2"),
           fb("g1", 0.5, tenant="dig"))
    h.max_pending_total = 6
    h.restart(now_ms=NOW_MS + 6 * 60_000)
    assert sorted(h.store.pending) == [("fb", "x2"), ("fb", "x3"), ("fb", "x4"), ("fb2", "d1"), ("inl", "a1"), ("inl", "a2")]


def test_the_cap_never_drops_feedback_whose_interaction_has_arrived(data_dir):
    """Feedback for an interaction stored (or in the same batch) joins at once: it is never pending."""
    h = Harness(data_dir, max_pending_per_tenant=2)
    h.feed(inter("a"))
    h.feed(*(fb(f"flood{i}", 1.0) for i in range(5)), fb("a", 0.25), *(fb(f"more{i}", 1.0) for i in range(5)))
    h.feed(inter("b"), *(fb(f"again{i}", 1.0) for i in range(5)), fb("b", -0.25))
    assert h.rewards() == [("a", 0.25, "feedback"), ("b", -0.25, "feedback")]
    assert len(h.store.pending) == 2


def test_first_score_wins(h):
    h.feed(inter("a"))
    h.feed(fb("a", 1.0))
    h.feed(fb("a", -1.0))
    h.feed(fb("b", 0.5), fb("b", -0.5))
    h.restart()
    h.feed(inter("b"))
    assert h.rewards() == [("a", 1.0, "feedback"), ("b", 0.5, "feedback")]
    assert h.table("feedback").num_rows == 4


def test_inline_reward_beats_earlier_feedback(h):
    h.feed(fb("a", -1.0, tenant="inl"))
    h.feed(inter("a", tenant="inl", reward=0.9), inter("b", tenant="inl"))
    h.feed(fb("b", 0.3, tenant="inl"))
    assert h.rewards() == [("a", 0.9, "inline"), ("b", 0.3, "feedback")]


def test_scorer_function_scores_at_ingest_and_feedback_scores_nothing(h):
    h.feed(inter("a", tenant="dig", completion="a1b2", reward=-1.0), fb("a", 1.0, tenant="dig"), fb("z", 1.0, tenant="dig"))
    assert h.rewards() == [("a", 0.5, "digits")]
    assert not h.store.pending


def test_scorer_failure_and_unknown_tenant_are_dead_letters(data_dir):
    h = Harness(data_dir, scorers={"bad": f"python:{__name__}:bad_scorer", "fb": "feedback"}, unknown_tenant="reject")
    out = h.feed(inter("a", tenant="bad"), inter("b", tenant="stranger"), inter("c"), b"nope")
    assert out.reasons == {"scorer_error": 1, "unknown_tenant": 1, "not_json": 1}
    dl = h.table("dead_letters")
    by_reason = dict(zip(dl.column("reason").to_pylist(), dl.column("detail").to_pylist()))
    assert "ZeroDivisionError" in by_reason["scorer_error"] and "scorer bug" in by_reason["scorer_error"]
    assert sorted(dl.column("tenant").to_pylist()) == ["_unknown", "_unknown", "bad"]
    assert h.table("interactions").column("id").to_pylist() == ["c"]


def test_an_event_too_deep_to_write_back_is_a_dead_letter_and_ingest_goes_on(data_dir, monkeypatch):
    """JSON nested just under the parser's depth limit parses, but its row's JSON cannot always be written
    back from deeper in the stack (a band of a few levels, where the RecursionError went up out of the
    batch: ingest stopped, and again at every replay). Here the row builder is wrapped by a fake that
    raises as that band does, for one event."""
    import ingest.batch as batch_module

    real = batch_module.interaction_row
    monkeypatch.setattr(batch_module, "interaction_row",
                        lambda ev, *a: (_ for _ in ()).throw(RecursionError("maximum recursion depth exceeded"))
                        if ev.id == "deep" else real(ev, *a))
    h = Harness(data_dir)
    out = h.feed(inter("deep"), inter("b"), fb("b", 0.5))
    assert out.reasons == {"bad_field": 1}
    (detail,) = h.table("dead_letters").column("detail").to_pylist()
    assert "nested too deeply" in detail
    assert h.rewards() == [("b", 0.5, "feedback")]


def test_a_scorer_out_of_memory_is_a_dead_letter_and_ingest_goes_on(data_dir):
    """numpy's "Unable to allocate" (a MemoryError) went up out of the batch: ingest stopped, and again at
    every replay of it."""
    h = Harness(data_dir, scorers={"big": f"python:{__name__}:allocating_scorer", "fb": "feedback"})
    out = h.feed(inter("a", tenant="big"), inter("b"), fb("b", 0.5))
    assert out.reasons == {"scorer_error": 1}
    (detail,) = h.table("dead_letters").column("detail").to_pylist()
    assert "MemoryError: Unable to allocate 4.00 EiB" in detail
    assert h.rewards() == [("b", 0.5, "feedback")]


def test_a_scorer_error_quoting_a_lone_surrogate_is_stored_escaped(data_dir):
    """The error text went into the dead letter's detail as it was: Arrow refused to encode it, the batch's
    write failed, and so did every replay of it."""
    h = Harness(data_dir, scorers={"sur": f"python:{__name__}:surrogate_error_scorer", "fb": "feedback"})
    h.feed(inter("a", tenant="sur"), inter("b"))
    (detail,) = h.table("dead_letters").column("detail").to_pylist()
    assert "ValueError: no number: \\ud83d oops" in detail
    assert h.table("interactions").column("id").to_pylist() == ["b"]


def test_a_replay_does_not_run_a_scorer_again_on_an_event_it_failed(data_dir):
    """A scorer that ran out of time would cost its whole limit again per event on every replay of the batch,
    which could keep a partition from ever being committed."""
    SCORER_CALLS.clear()
    h = Harness(data_dir, scorers={"bad": f"python:{__name__}:counted_bad_scorer", "fb": "feedback"})
    first = h.feed(inter("a", tenant="bad"), inter("b"))
    assert first.reasons == {"scorer_error": 1} and SCORER_CALLS == ["c1"]
    h.restart()
    again = h.replay(h.log)  # after a crash before the commit
    assert SCORER_CALLS == ["c1"], "the scorer ran again"
    assert again.dead_letters == [] and again.duplicates == 2
    (resent,) = again.replayed_dead_letters  # sent to the dead-letter topic again, as any replayed dead letter
    assert resent.row.reason == "scorer_error" and "not run again on a replay" in resent.row.detail
    assert h.table("dead_letters").num_rows == 1 and "ZeroDivisionError" in h.table("dead_letters").column("detail")[0].as_py()


@pytest.mark.parametrize("restart", [False, True], ids=["same process", "after a restart"])
def test_an_offset_dead_lettered_for_another_reason_is_scored_when_read_again(data_dir, restart):
    """Every stored dead letter at an offset was taken for "its scorer failed here": an event of a tenant
    not configured then, read again once the tenant was (offsets reset, or a replay), was dead-lettered as a
    scorer_error its scorer never ran on."""
    h = Harness(data_dir, scorers={"fb": "feedback"}, unknown_tenant="reject")
    assert h.feed(inter("a", tenant="newco", completion="12")).reasons == {"unknown_tenant": 1}
    h.processor = Processor({"fb": "feedback", "newco": "digits"}, unknown_tenant="reject", max_message_bytes=10_000)
    if restart:
        h.restart()
    again = h.replay(h.log)
    assert again.dead_letters == [] and again.replayed_dead_letters == []
    assert h.rewards() == [("a", 1.0, "digits")]


def test_feedback_for_a_stored_interaction_outside_its_expiry_is_not_pending_after_a_restart(h):
    h.feed(inter("a"))
    h.feed(fb("a", 0.9, ts=T0 + timedelta(days=10)))  # outside the 72 h expiry: joins nothing
    assert not h.store.pending
    h.restart()
    assert not h.store.pending, "loaded as waiting for an interaction that is stored already"
    assert h.rewards() == []


def test_a_joined_trajectory_whose_write_was_lost_is_derived_again_after_a_restart(h):
    """Feedback first; its interaction joins it in a later batch, and a crash lands after that batch's
    interactions file and before its trajectories file (uncommitted: it is read again). The restart did not
    load the feedback to wait (its interaction is stored), so the replayed interaction found nothing and the
    reward was lost for good."""
    from ingest.consumer import batch_datasets, write_rows

    h.feed(fb("a", 0.9))
    interaction = h.record(inter("a"))
    out = h.processor.process([interaction], h.store, NOW_MS)
    assert len(out.trajectories) == 1
    (part,) = [p for p in batch_datasets(out) if p.dataset == "interactions"]
    write_rows(h.root, part, out.ranges)  # ... and the crash: no trajectories file, nothing committed
    h.restart()
    h.replay([interaction])
    assert h.rewards() == [("a", 0.9, "feedback")]
    assert not h.store.pending


def test_integers_too_large_for_a_float_are_dead_letters_and_ingest_goes_on(data_dir):
    """A reward of 1 and 400 zeros raised OverflowError out of decode, and a python scorer returning 10**400
    out of apply: the batch was never written nor committed, and its replay crashed the same way for ever."""
    h = Harness(data_dir, scorers={"huge": f"python:{__name__}:huge_scorer", "fb": "feedback"})
    big = b"1" + b"0" * 400
    out = h.feed(
        b'{"type": "interaction", "id": "r", "tenant": "fb", "ts": 0, "prompt": "p", "completion": "c", "reward": ' + big + b"}",
        b'{"type": "feedback", "id": "a", "tenant": "fb", "ts": 0, "score": ' + big + b"}",
        b'{"type": "feedback", "id": "a", "tenant": "fb", "ts": ' + big + b', "score": 1}',
        inter("s", tenant="huge"), inter("a"), fb("a", 0.5),
    )
    assert out.reasons == {"reward_not_finite": 1, "score_out_of_range": 1, "bad_field": 1, "scorer_error": 1}
    detail = {r.row.reason: r.row.detail for r in out.dead_letters}["scorer_error"]
    assert "scorer returned an integer of 1329 bits, outside [-1, 1]" in detail
    assert h.rewards() == [("a", 0.5, "feedback")]
    assert h.table("interactions").column("id").to_pylist() == ["a"]


def test_a_message_keyed_by_another_tenant_is_a_dead_letter_and_one_without_a_key_is_accepted(h):
    keyed = [Record("i", 0, 0, encode(inter("a")), b"fb"), Record("i", 0, 1, encode(inter("b")), b"inl"),
             Record("i", 0, 2, encode(inter("c")), None), Record("i", 0, 3, encode(inter("d")), b"\xff"),
             Record("f", 0, 0, encode(fb("a", 1.0)), b"inl")]
    out = h.replay(keyed)
    assert out.reasons == {"key_mismatch": 3}
    assert h.rewards() == [] and not h.table("feedback").num_rows  # the mis-keyed feedback joined nothing
    dl = sorted((r for r in h.table("dead_letters").to_pylist() if r["kafka_topic"] == "i"), key=lambda r: r["kafka_offset"])
    assert [(r["kafka_offset"], r["tenant"], r["reason"]) for r in dl] == [(1, "fb", "key_mismatch"), (3, "fb", "key_mismatch")]
    assert dl[0]["detail"] == "message key 'inl' is not the tenant 'fb'"
    assert dl[1]["detail"] == "message key '\\\\xff' is not the tenant 'fb'"  # a key that is not UTF-8, escaped
    assert sorted(h.table("interactions").column("id").to_pylist()) == ["a", "c"]


def test_dead_letters_of_tenants_not_configured_go_under_unknown_naming_the_claimed_tenant(data_dir):
    """Any producer can claim any tenant name: its dead letters must not make a directory per name."""
    h = Harness(data_dir, scorers={"fb": "feedback"}, unknown_tenant="reject")
    missing_completion = b'{"type": "interaction", "id": "x", "tenant": "ghost", "ts": 0, "prompt": "p"}'
    out = h.feed(inter("a", tenant="stranger"), fb("a", 1.0, tenant="stranger"), missing_completion,
                 b'{"type": "interaction", "id": "y", "tenant": "fb", "ts": 0}')
    assert out.reasons == {"unknown_tenant": 2, "missing_completion": 2}
    dl = h.table("dead_letters")
    rows = sorted(zip(dl.column("tenant").to_pylist(), dl.column("reason").to_pylist(), dl.column("detail").to_pylist()))
    assert [(t, r) for t, r, _ in rows] == [("_unknown", "missing_completion"), ("_unknown", "unknown_tenant"),
                                            ("_unknown", "unknown_tenant"), ("fb", "missing_completion")]
    assert "'ghost'" in rows[0][2] and all("'stranger'" in d for _, _, d in rows[1:3])
    assert sorted(p.name for p in (data_dir / "dead_letters").iterdir()) == ["tenant=_unknown", "tenant=fb"]
    assert [r.row.tenant for r in out.dead_letters] == ["_unknown"] * 3 + ["fb"]  # the dead-letter topic's key


def test_unknown_tenant_created_with_feedback_scoring(h):
    h.feed(inter("a", tenant="newcomer"), fb("a", 0.5, tenant="newcomer"))
    assert h.rewards() == [("a", 0.5, "feedback")]


def test_a_tenant_differing_from_another_only_in_case_is_not_created(data_dir):
    """The config refuses tenants whose names differ only in case (one directory on a case-insensitive disk);
    a tenant created on the fly went unchecked, and would have shared its twin's partitions and adapter."""
    h = Harness(data_dir)
    out = h.feed(inter("a", tenant="FB"), inter("b", tenant="newcomer"), inter("c", tenant="NewComer"),
                 inter("d", tenant="newcomer"))
    assert out.reasons == {"unknown_tenant": 2}
    details = sorted(d.row.detail for d in out.dead_letters)
    assert "'FB'" in details[0] and "differs from tenant 'fb' only in case" in details[0]
    assert "'NewComer'" in details[1] and "differs from tenant 'newcomer' only in case" in details[1]
    again = Harness(data_dir)  # a new process finds `newcomer` on disk
    again.offsets = dict(h.offsets)
    assert again.feed(inter("e", tenant="NEWCOMER")).reasons == {"unknown_tenant": 1}
    assert again.feed(inter("f", tenant="newcomer")).reasons == {}


def test_tenants_created_on_the_fly_are_capped_also_across_a_restart(data_dir):
    h = Harness(data_dir, max_auto_tenants=2)
    out = h.feed(inter("a", tenant="new1"), fb("a", 0.5, tenant="new2"), inter("b", tenant="new3"), inter("c"),
                 b'{"type": "interaction", "id": "d", "tenant": "new4", "ts": 0}')
    assert out.reasons == {"unknown_tenant": 1, "missing_completion": 1}
    (refused,) = [d.row for d in out.dead_letters if d.row.reason == "unknown_tenant"]
    assert refused.tenant == "_unknown" and "'new3'" in refused.detail and "ingest.max_auto_tenants (2)" in refused.detail
    assert h.feed(inter("e", tenant="new1"), inter("f", tenant="new2")).reasons == {}  # created ones go on
    assert sorted(p.name for p in (data_dir / "dead_letters").iterdir()) == ["tenant=_unknown"]
    assert "tenant=new3" not in {p.name for d in data_dir.iterdir() for p in d.iterdir()}

    # A new process counts the tenants on disk that the config does not list (configured ones do not count).
    again = Harness(data_dir, max_auto_tenants=2)
    again.offsets = dict(h.offsets)
    out = again.feed(inter("g", tenant="new5"), inter("h", tenant="new2"), inter("i", tenant="inl"))
    assert out.reasons == {"unknown_tenant": 1} and "'new5'" in out.dead_letters[0].row.detail
    # ... and more of them on disk than the cap (say, from before it was lowered) are all still served
    lower = Harness(data_dir, max_auto_tenants=1)
    lower.offsets = dict(again.offsets)
    assert lower.feed(inter("j", tenant="new1"), inter("k", tenant="new2")).reasons == {}
    assert lower.feed(inter("l", tenant="new6")).reasons == {"unknown_tenant": 1}


def test_replays_write_nothing_twice(h):
    h.feed(inter("a"), fb("a", 1.0), inter("b"), inter("c", tenant="dig", completion="1"), b"junk", fb("d", 0.5))
    h.feed(inter("d"), inter("e", tenant="inl", reward=0.1), fb("b", -0.5))
    before = {d: h.table(d).num_rows for d in ("interactions", "feedback", "trajectories", "dead_letters")}
    # Replays after a crash: the whole log, cut differently; once with the view as it was, once rebuilt.
    out = h.replay(h.log)
    assert out.rows == 0 and out.duplicates == len(h.log)
    # ... but the replayed dead letter goes to the topic again: its first send may not have been acknowledged
    assert [r.raw for r in out.replayed_dead_letters] == [b"junk"] and out.dead_letters == []
    h.restart()
    for i in range(0, len(h.log), 2):
        assert h.replay(h.log[i:i + 2]).rows == 0
    after = {d: h.table(d).num_rows for d in before}
    assert after == before == {"interactions": 5, "feedback": 3, "trajectories": 5, "dead_letters": 1}
    assert h.rewards() == [("a", 1.0, "feedback"), ("b", -0.5, "feedback"), ("c", 1.0, "digits"),
                           ("d", 0.5, "feedback"), ("e", 0.1, "inline")]


def test_a_lost_trajectory_write_is_derived_again_on_replay(h):
    """A crash after the interactions and feedback files landed but before the trajectories file."""
    records = [h.record(inter("a")), h.record(fb("a", 0.5))]
    out = h.processor.process(records, h.store, NOW_MS)
    out.trajectories.clear()  # the trajectories write never happened
    write_output(h.root, h.store, out)
    h.restart()
    assert h.rewards() == []
    h.replay(records)
    assert h.rewards() == [("a", 0.5, "feedback")]
    assert h.table("interactions").num_rows == 1 and h.table("feedback").num_rows == 1


def test_same_id_sent_twice_is_stored_once(h):
    h.feed(inter("a"), inter("a"))
    h.feed(inter("a", completion="other"))
    ids = h.table("interactions").column("completion").to_pylist()
    assert ids == ["c1"]


def test_a_resent_feedback_event_is_stored_once(h):
    """The serving tier resends an event Kafka did not acknowledge: the same content at a new offset."""
    h.feed(inter("a"), fb("a", 0.5, source="thumbs"), fb("a", 0.5, source="thumbs"))  # resent within a batch
    h.feed(fb("a", 0.5, source="thumbs"))  # ... in a later batch
    h.restart()
    h.feed(fb("a", 0.5, source="thumbs"))  # ... after a restart (the view rebuilt from feedback/)
    assert h.table("feedback").num_rows == 1
    # other events about the same interaction are kept: another score, source or time
    h.feed(fb("a", -0.5, source="thumbs"), fb("a", 0.5), fb("a", 0.5, source="thumbs", ts=T0 + timedelta(seconds=1)))
    h.restart()
    h.feed(fb("a", -0.5, source="thumbs"))
    assert h.table("feedback").num_rows == 4
    assert h.rewards() == [("a", 0.5, "thumbs")]


def test_a_scorer_that_cannot_be_built_dead_letters_its_tenants_interactions_until_it_can(data_dir, tmp_path,
                                                                                          monkeypatch, caplog):
    """One tenant's python scorer whose module does not import stopped ingest at every start, for every tenant
    (`clora up` restarting it in a loop). Now that tenant's interactions are dead-lettered as a failing
    scorer's are, naming the import error, the others go on, and once the module can be imported it scores."""
    with caplog.at_level("ERROR", logger="ingest.batch"):
        h = Harness(data_dir, scorers={"judged": "python:clora_judge_later:score", "dig": "digits"},
                    unknown_tenant="reject")
    assert "tenant 'judged': its scorer cannot be built" in caplog.text
    assert list(h.processor.unbuilt()) == ["judged"]
    out = h.feed(inter("a", tenant="judged"), inter("b", tenant="dig", completion="42"))
    assert out.reasons == {"scorer_error": 1}
    (detail,) = h.table("dead_letters").column("detail").to_pylist()
    assert "the scorer cannot be built" in detail and "clora_judge_later" in detail
    assert h.rewards() == [("b", 1.0, "digits")]
    assert h.processor.retry_unbuilt() == []  # still not there
    (tmp_path / "clora_judge_later.py").write_text("def score(completion, prompt):\n    return 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert h.processor.retry_unbuilt() == ["judged"] and h.processor.unbuilt() == {}
    assert h.feed(inter("c", tenant="judged")).reasons == {}
    assert ("c", 0.25, "python:clora_judge_later:score") in h.rewards()
    # A change to a scorer that cannot be built yet leaves the old one scoring, and is applied once it can be.
    done = h.processor.follow({"judged": "python:clora_judge_v2:score", "dig": "digits"}, {})
    assert list(done.errors) == ["judged"] and h.processor.specs["judged"] == "python:clora_judge_later:score"
    assert h.processor.retry_unbuilt() == []
    (tmp_path / "clora_judge_v2.py").write_text("def score(completion, prompt):\n    return 0.5\n")
    assert h.processor.retry_unbuilt() == ["judged"] and h.processor.specs["judged"] == "python:clora_judge_v2:score"
    assert h.feed(inter("d", tenant="judged")).reasons == {}
    assert ("d", 0.5, "python:clora_judge_v2:score") in h.rewards()


# ---------------------------------------------------------------------------------------------------------
# Pipelining: batch N+1 is decided while batch N is still being written (consumer.py).


def test_a_batch_decided_while_the_previous_one_is_written_decides_the_same(h):
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as executor:
        executor.submit(gate.wait, 30)  # holds the one writer thread: batch 1 cannot land yet
        try:
            first = h.processor.process([h.record(inter("a")), h.record(inter("b")), h.record(fb("c", 0.1))], h.store, NOW_MS)
            write = BatchWrite(h.root, h.store, first, executor)
            assert not write.done() and h.table("interactions").num_rows == 0
            # Feedback for an interaction still in flight joins it (read from memory); a replayed message
            # and a resent id are duplicates; the interaction that waiting feedback was for is scored.
            second = h.processor.process(
                [h.record(fb("a", 0.5)), h.log[1], h.record(inter("c")), h.record(inter("b", completion="again"))],
                h.store, NOW_MS,
            )
            assert sorted((t.id, t.reward) for t in second.trajectories) == [("a", 0.5), ("c", 0.1)]
            assert second.duplicates == 2 and [r.id for r in second.interactions] == ["c"]
        finally:
            gate.set()
        write.wait()
        BatchWrite(h.root, h.store, second, executor).wait()
    assert h.rewards() == [("a", 0.5, "feedback"), ("c", 0.1, "feedback")]
    assert h.table("interactions").num_rows == 3 and h.table("feedback").num_rows == 2
    h.restart()  # the view rebuilt from disk agrees: a replay of everything writes nothing
    assert h.replay(h.log).rows == 0


@pytest.mark.parametrize("variant", ["earlier feedback", "inline reward"])
def test_a_crash_between_a_batchs_files_never_leaves_an_interaction_without_its_trajectory(h, monkeypatch, variant):
    """The datasets' files were written concurrently, in no order: a crash could leave a batch's interaction
    on disk without the trajectory decided for it, and its replay (the batch was not committed) was scored
    otherwise: by feedback read before it instead of the feedback that had waited, or by feedback instead
    of its inline reward. The interactions file is now written only once the trajectories file is durable."""
    from ingest import consumer

    real = consumer.write_rows

    def killed_before_the_trajectories_landed(root, part, ranges):
        if part.dataset == "trajectories":
            time.sleep(0.2)  # the other files have every chance to land first
            raise OSError("killed")
        return real(root, part, ranges)

    if variant == "earlier feedback":
        h.feed(fb("x", -1.0))  # a committed batch: it waits for its interaction
        batch, later, expected = [h.record(inter("x"))], fb("x", 0.5), [("x", -1.0, "feedback")]
    else:
        batch, later, expected = [h.record(inter("x", tenant="inl", reward=0.1))], fb("x", -1.0, tenant="inl"), [
            ("x", 0.1, "inline")]
    out = h.processor.process(batch, h.store, NOW_MS)
    assert len(out.trajectories) == 1
    monkeypatch.setattr(consumer, "write_rows", killed_before_the_trajectories_landed)
    with ThreadPoolExecutor(max_workers=4) as executor, pytest.raises(OSError, match="killed"):
        BatchWrite(h.root, h.store, out, executor).wait()
    monkeypatch.undo()
    assert h.table("interactions").num_rows == 0, "the interaction landed without its trajectory"
    h.restart(now_ms=NOW_MS + 1000)  # nothing was committed: the batch is read again, after later feedback
    h.feed(later, now_ms=NOW_MS + 2000)
    h.replay(batch, now_ms=NOW_MS + 3000)
    assert h.rewards() == expected


def test_a_failed_batch_write_raises_when_waited_for(data_dir):
    h = Harness(data_dir)
    out = h.processor.process([h.record(inter("a"))], h.store, NOW_MS)
    not_a_dir = data_dir / "interactions"
    not_a_dir.write_text("a file where the dataset directory should be")
    with ThreadPoolExecutor(max_workers=2) as executor:
        write = BatchWrite(h.root, h.store, out, executor)
        with pytest.raises(OSError):
            write.wait()


def test_a_scorer_past_its_time_limit_dead_letters_its_event_and_ingest_goes_on(data_dir):
    """A catastrophic regex held the loop for as long as it backtracked (here ~2^40 steps): now the tenant's
    scorer_time_limit_s stops it, that event is a scorer_error, and the next events are scored."""
    h = Harness(data_dir, scorers={"re": r"regex:(a+)+$"})
    h.processor = Processor({"re": r"regex:(a+)+$"}, unknown_tenant="reject", max_message_bytes=10_000,
                            time_limits={"re": 0.2})
    out = h.feed(inter("slow", tenant="re", completion="a" * 40 + "b"), inter("fast", tenant="re", completion="aaaa"))
    assert out.reasons == {"scorer_error": 1}
    detail = h.table("dead_letters").column("detail").to_pylist()
    assert len(detail) == 1 and "stopped after 0.2 s" in detail[0]
    assert h.rewards() == [("fast", 1.0, r"regex:(a+)+$")]
    assert sorted(h.table("interactions").column("id").to_pylist()) == ["fast"]


def test_a_batch_whose_scorers_run_past_the_budget_is_cut_and_the_rest_is_read_again_exactly_once(data_dir):
    """Slow scorer calls (50 ms each) with a budget of 0.2 s: the batch ends before the call that would run
    past it. What was processed, and only that, is in the output and in its offset ranges; the rest, fed again
    as the loop reads it again, lands once."""
    h = Harness(data_dir)
    h.processor = Processor({"slow": f"python:{__name__}:slow_scorer", "fb": "feedback"}, unknown_tenant="reject",
                            max_message_bytes=10_000, scoring_budget_s=0.2)
    records = []
    for i in range(12):  # interactions of both tenants on partition 0, interleaved with feedback
        records.append(h.record(inter(f"s{i}", tenant="slow")))
        records.append(h.record(inter(f"f{i}")))
        records.append(h.record(fb(f"f{i}", 0.5)))
    rounds, rest = 0, records
    while rest:
        out = h.replay(rest)
        rounds += 1
        if out.cut is None:
            break
        assert 0 < out.cut < len(rest)
        done, rest = rest[: out.cut], rest[out.cut:]
        assert out.ranges == {(t, 0): (min(r.offset for r in done if r.topic == t), max(r.offset for r in done if r.topic == t))
                              for t in {r.topic for r in done}}
        assert {r.id for r in out.interactions} == {json.loads(r.value)["id"] for r in done if r.topic == "i"}
        assert rest[0].topic == "i" and json.loads(rest[0].value)["tenant"] == "slow"  # cut before a scorer call
    assert rounds >= 3  # 12 calls of 50 ms against 0.2 s a batch
    ids = h.table("interactions").column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 24
    assert h.rewards() == sorted([(f"s{i}", 1.0, f"python:{__name__}:slow_scorer") for i in range(12)]
                                 + [(f"f{i}", 0.5, "feedback") for i in range(12)])
    assert h.table("feedback").num_rows == 12


def test_a_topic_made_again_numbers_its_offsets_anew_and_its_messages_are_not_taken_for_replays(data_dir):
    """The embedded broker keeps topics in memory: each start makes them again, offsets from 0, while the
    data dir stays. Dead letters stored at the old topic's offsets made a valid event at the same offset a
    "replay" of a failed scorer call (lost), and a new malformed one a duplicate (never stored)."""
    h = Harness(data_dir, scorers={"dig": "digits"})
    h.feed(b"not json", now_ms=NOW_MS)  # i:0:0, dead-lettered
    h.restart(now_ms=NOW_MS + 60_000, topics_since={"i": NOW_MS + 60_000, "f": NOW_MS + 60_000})
    h.offsets = {}  # the topic made again: offsets from 0
    out = h.feed(inter("d0", tenant="dig", completion="12ab"), b"also not json", now_ms=NOW_MS + 60_000)
    assert (out.duplicates, out.reasons) == (0, {"not_json": 1})
    assert h.rewards() == [("d0", 0.5, "digits")]
    assert sorted(h.table("dead_letters").column("raw").to_pylist()) == [b"also not json", b"not json"]
    # the same incarnation replayed after a restart: still each once
    h.restart(now_ms=NOW_MS + 120_000, topics_since={"i": NOW_MS + 60_000, "f": NOW_MS + 60_000})
    assert h.replay(h.log[1:]).rows == 0


def test_another_message_rejected_at_a_stored_offset_of_a_topic_made_again_is_stored(data_dir):
    """A topic made again numbers its offsets from 0: a new malformed message at the offset of a stored dead
    letter, in a batch of the same range, got the stored file's name, so its write was taken as done already
    and the row never stored. The same messages written again still land on the same name."""
    h = Harness(data_dir, scorers={"dig": "digits"})
    h.feed(b"not json")  # i:0:0, dead-lettered
    h.restart(now_ms=NOW_MS + 60_000, topics_since={"i": NOW_MS + 60_000, "f": NOW_MS + 60_000})
    h.offsets = {}  # the topic made again: offsets from 0
    out = h.feed(b"other junk", now_ms=NOW_MS + 60_000)  # i:0:0 again, alone in its batch, as before
    assert out.reasons == {"not_json": 1}
    assert sorted(h.table("dead_letters").column("raw").to_pylist()) == [b"not json", b"other junk"]
    write_output(h.root, h.store, out)  # the same batch's write, again: a no-op
    assert h.table("dead_letters").num_rows == 2


def test_a_config_read_again_adds_rescores_and_removes_tenants_from_their_next_event(data_dir):
    h = Harness(data_dir, scorers={"fb": "feedback", "dig": "digits"}, unknown_tenant="reject")
    assert h.feed(inter("a", tenant="late")).reasons == {"unknown_tenant": 1}
    done = h.processor.follow({"fb": "feedback", "dig": "contains:x", "late": "contains:y"}, {})
    assert (done.added, done.rescored, done.removed, done.at_restart, done.errors) == (["late"], ["dig"], [], [], {})
    assert h.feed(inter("b", tenant="late", completion="yy"), inter("c", tenant="dig", completion="x1"),
                  inter("d", tenant="dig", completion="11")).reasons == {}
    assert h.rewards() == [("b", 1.0, "contains:y"), ("c", 1.0, "contains:x"), ("d", 0.0, "contains:x")]
    assert h.processor.follow({"fb": "feedback", "dig": "contains:x", "late": "contains:y"}, {}) == type(done)()
    # Removed: serving reads the config later, answering fb meanwhile, and requests running then end later
    # still; their events are stored for REMOVAL_GRACE_S yet, then dead-lettered as a tenant unknown.
    now = [0.0]
    h.processor.clock = lambda: now[0]
    h.processor.removal_grace_s = REMOVAL_GRACE_S = 300.0  # ingest.removed_tenant_grace_seconds' default
    done = h.processor.follow({"dig": "contains:x", "late": "contains:y"}, {})
    assert (done.removed, done.leaving) == ([], ["fb"])
    assert h.processor.follow({"dig": "contains:x", "late": "contains:y"}, {}) == type(done)(), "once"
    now[0] = REMOVAL_GRACE_S - 1
    assert h.processor.settle_leaving() == [] and h.feed(inter("e")).reasons == {}, "serving may still answer fb"
    now[0] = REMOVAL_GRACE_S
    assert h.processor.settle_leaving() == ["fb"] and "fb" not in h.processor.configured
    assert h.feed(inter("f")).reasons == {"unknown_tenant": 1}, "fb is not configured any more"
    done = h.processor.follow({"dig": "contains:x", "late": "contains:y", "fb": "feedback"}, {})
    assert done.added == ["fb"]
    h.processor.follow({"dig": "contains:x", "late": "contains:y"}, {})  # removed again, and back before it left:
    assert h.processor.follow({"dig": "contains:x", "late": "contains:y", "fb": "feedback"}, {}) == type(done)()
    now[0] += REMOVAL_GRACE_S
    assert h.processor.settle_leaving() == [] and h.feed(inter("g")).reasons == {}


def test_a_config_read_again_leaves_for_a_restart_what_a_restart_would_do_differently(data_dir):
    h = Harness(data_dir, scorers={"dig": "digits"})  # unknown_tenant = "create"
    h.feed(inter("a", tenant="newcomer"), fb("a", 0.5, tenant="newcomer"))  # created with the feedback scorer
    done = h.processor.follow({"dig": "digits", "newcomer": "feedback"}, {})
    assert done.added == ["newcomer"] and "newcomer" in h.processor.configured and not h.processor.auto
    # From a function to feedback: the feedback that came meanwhile was not kept waiting (a restart loads it).
    done = h.processor.follow({"dig": "feedback", "newcomer": "contains:z"}, {})
    assert (done.rescored, done.at_restart) == (["newcomer"], ["dig"])
    assert h.processor.specs["dig"] == "digits"
    done = h.processor.follow({"newcomer": "contains:z"}, {})  # dig removed: with "create", feedback-scored
    assert (done.removed, done.at_restart) == ([], ["dig"])
    done = h.processor.follow({"newcomer": "contains:z", "dig": "digits", "broken": "python:no_such_module_xyz:f"}, {})
    assert list(done.errors) == ["broken"] and "no_such_module_xyz" in done.errors["broken"]
    assert done.added == ["broken"] and list(h.processor.unbuilt()) == ["broken"]  # configured, not fed to feedback
    out = h.feed(inter("b", tenant="newcomer", completion="zz"), inter("c", tenant="broken"),
                 fb("c", -0.5, tenant="broken"))
    assert out.reasons == {"scorer_error": 1}  # its interaction, saying why (its feedback is kept)
    assert h.rewards() == [("a", 0.5, "feedback"), ("b", 1.0, "contains:z")]
    done = h.processor.follow({"newcomer": "contains:z"}, {})  # "create": a removed tenant goes on as created
    assert (done.removed, done.at_restart) == ([], ["broken", "dig"])  # but both were scored by a function
    assert h.processor.configured == {"newcomer", "dig", "broken"}
