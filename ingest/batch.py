"""One batch of Kafka records -> the rows to write: decode, check the tenant, score, deduplicate, join.

`Processor.process(records, store, now_ms)` reads top to bottom, one record at a time, in Kafka order:

    bytes --decode--> DeadLetter                      -> dead_letters (unless that offset is stored)
                   -> tenant not configured, and "reject" or the cap on tenants created on the fly
                      reached                         -> dead_letters, reason unknown_tenant
                   -> InteractionEvent -> interactions (unless (tenant, id) is stored)
                                       -> trajectories when it has a reward and (tenant, id) is not scored:
                                          the tenant's scorer function, else its inline `reward`, else
                                          pending feedback for it; a scorer failure dead-letters the event
                                          (on a replay of that offset, the scorer is not run again)
                   -> FeedbackEvent    -> feedback (unless the same event is stored: same tenant, id,
                                          ts, score and source; a resent event comes at a new offset)
                                       -> trajectories when its interaction is in this batch or stored and
                                          not scored yet, and their times are within the expiry (stored
                                          ones are read back after the loop, then tried with all of the
                                          batch's feedback for them); otherwise it waits in the store's
                                          `pending`, which holds a few rows per id and at most a cap per
                                          tenant: the oldest waiting row leaves memory (counted in
                                          `pending_dropped`; the row is in feedback/ still)

A batch whose scorer functions have run past the processor's `scoring_budget_s` ends before its next scorer
call (`Output.cut`): the records from there on are left out of the output entirely, for the loop to read
again as its next batch.

Every decision consults the store *and* this batch, so replaying any range of offsets (after a crash, or
when another process takes a partition over) writes nothing twice and misses nothing: each dataset is
deduplicated on its own key, and a trajectory is derived again if its write was the one lost. An
interaction already stored and scored is counted as a duplicate before any row is built, so a replay
costs little more than its decoding.
Which reward wins for one interaction: a scorer function (the tenant's config decides), else the inline
reward, else the first feedback in partition order whose event time is within the expiry of the
interaction's, however the batches were cut: one outside it does not stop a later one from joining
(pending.py says how the feedback that waits is bounded). Feedback for a function-scored tenant is kept
in `feedback/` but scores nothing.

Tenants not in the config: any Kafka producer can name any tenant, and each tenant gets a partition in
every dataset (and a learner adapter), so names must not mint directories without limit. With
ingest.unknown_tenant = "create", at most `max_auto_tenants` tenants the config does not list are created,
counting those already on disk (the store lists the tenant partitions at load); tenants on disk are always
served, new ones beyond the cap are dead-lettered. A dead letter is filed under its tenant's partition only
when that tenant is configured or was created (now or before); otherwise under `_unknown`, the name it
claimed kept in the detail, so neither "reject" nor a flood of malformed events makes a directory per name.
With several ingest processes each counts the tenants on disk at its last load plus those it created, so
the total can exceed the cap by what they create between loads.

Nothing here touches Kafka or writes files; the store is read (and its `pending` map updated) only.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from ingest.events import DeadLetter, FeedbackEvent, InteractionEvent, decode, key_mismatch
from ingest.index import key_hash
from ingest.pending import SCORER_ERROR, SCORER_FAILED, Key, PendingStore
from ingest.rows import (
    Coords,
    DeadLetterRow,
    FeedbackRow,
    InteractionRow,
    TrajectoryRow,
    dead_letter_row,
    FEEDBACK_KEY,
    feedback_key,
    feedback_row,
    interaction_row,
    trajectory_row,
)
from ingest.scorers import (
    DEFAULT_TIME_LIMIT_S,
    Scorer,
    ScorerError,
    ScorerSpecError,
    Unbuilt,
    apply,
    build_scorer,
    is_function,
)

logger = logging.getLogger(__name__)

DEFAULT_SCORER = "feedback"  # the scorer of tenants created on the fly (ingest.unknown_tenant = "create")
MAX_AUTO_TENANTS = 64  # the default of ingest.max_auto_tenants


class Record(NamedTuple):
    """One consumed Kafka message (value None for a tombstone; key None for a message without one).

    `process` reads these five fields by name only, so the consumer hands it kafka-python's ConsumerRecords
    as they come (they have the same fields, and more) rather than building one of these per message."""

    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None = None


@dataclass
class Rejected:
    """A dead letter with what the dead-letter topic needs: the full message and where it came from."""

    row: DeadLetterRow
    raw: bytes
    at: Coords


@dataclass
class Output:
    interactions: list[InteractionRow] = field(default_factory=list)
    trajectories: list[TrajectoryRow] = field(default_factory=list)
    feedback: list[FeedbackRow] = field(default_factory=list)
    dead_letters: list[Rejected] = field(default_factory=list)
    replayed_dead_letters: list[Rejected] = field(default_factory=list)  # stored before; for the topic only
    duplicates: int = 0  # messages already stored (replayed offsets, or an id sent twice)
    reasons: Counter = field(default_factory=Counter)  # dead letters by reason
    pending_dropped: Counter = field(default_factory=Counter)  # pending feedback dropped from memory, by reason
    ranges: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # (topic, partition) -> first, last
    # Set when the batch's scoring ran past its time budget: the records from this index on were not
    # processed (nothing of them is in this output, `ranges` included); the loop reads them again.
    cut: int | None = None

    @property
    def rows(self) -> int:
        return len(self.interactions) + len(self.trajectories) + len(self.feedback) + len(self.dead_letters)


@dataclass
class Followed:
    """What `Processor.follow` did with a config read again: tenants added (new to the config), rescored
    (their scorer changed) and removed; changes it left for a restart; scorers that could not be built."""

    added: list[str] = field(default_factory=list)
    rescored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    at_restart: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    leaving: list[str] = field(default_factory=list)  # removed, with "reject": still stored for removal_grace_s


def offset_ranges(records: Iterable[Record]) -> dict[tuple[str, int], tuple[int, int]]:
    """(topic, partition) -> (first offset, last offset) of `records` (each partition's in offset order)."""
    ranges: dict[tuple[str, int], tuple[int, int]] = {}
    for rec in records:
        tp = (rec.topic, rec.partition)
        first_last = ranges.get(tp)
        ranges[tp] = (rec.offset if first_last is None else first_last[0], rec.offset)
    return ranges


UNBUILT_MEANS = "its interactions are dead-lettered as scorer_error until it can; tried again every minute"


def _build(tenant: str, spec: str, limit: float, *, log: bool = True) -> Scorer:
    """`spec`'s function for `tenant`, or an Unbuilt saying why it cannot be built (logged with `log`)."""
    try:
        return build_scorer(spec, time_limit_s=limit)
    except ScorerSpecError as e:
        if log:
            logger.error("tenant %r: its scorer cannot be built (%s): %s", tenant, UNBUILT_MEANS, e)
        return Unbuilt(spec, str(e))


class Processor:
    """Holds what does not change between batches: the tenants' scorers and the edge limits, and which
    tenants not in the config were created on the fly."""

    def __init__(
        self,
        scorers: dict[str, str],
        *,
        unknown_tenant: Literal["reject", "create"],
        max_message_bytes: int,
        max_auto_tenants: int = MAX_AUTO_TENANTS,
        time_limits: dict[str, float] | None = None,
        scoring_budget_s: float | None = None,
        removal_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`scorers`: tenant -> scorer spec; `time_limits`: tenant -> its scorer's time limit per call
        (scorers.DEFAULT_TIME_LIMIT_S for a tenant not in it); `scoring_budget_s`: once a batch has taken
        this long, it ends before its next scorer call (Output.cut), so that slow scorers (a judge model
        behind a python: scorer) still let the loop write, commit and poll within Kafka's poll interval."""
        self.specs = dict(scorers)
        self.clock = clock
        self.removal_grace_s = removal_grace_s
        self.leaving: dict[str, float] = {}  # tenant removed (with "reject") -> when it stops being stored
        self.waiting_specs: dict[str, tuple[str, float]] = {}  # tenant -> a changed scorer that could not be built
        self.scoring_budget_s = scoring_budget_s
        self.configured = frozenset(scorers)
        self.unknown_tenant = unknown_tenant
        self.max_message_bytes = max_message_bytes
        self.max_auto_tenants = max_auto_tenants
        self.auto: set[str] = set()  # tenants not configured that exist: created here or found on disk ("create")
        self._merged: frozenset[str] | None = None  # the store's tenants_on_disk last added to `auto`
        self._cap_logged = False
        # Built once. One that cannot be built (a python scorer whose module does not import) is an Unbuilt:
        # that tenant's interactions are dead-lettered saying so, and `retry_unbuilt` tries again; it stopped
        # ingest for every tenant at each start.
        self.functions: dict[str, Scorer] = {}  # tenant -> its scorer function (tenants scored by one)
        self.limits = {t: (time_limits or {}).get(t, DEFAULT_TIME_LIMIT_S) for t in self.specs}
        built: dict[tuple[str, float], Scorer] = {}
        for tenant, spec in sorted(self.specs.items()):
            if is_function(spec):
                limit = self.limits[tenant]
                if (spec, limit) not in built:
                    built[spec, limit] = _build(tenant, spec, limit)
                self.functions[tenant] = built[spec, limit]

    def unbuilt(self) -> dict[str, str]:
        """tenant -> why its scorer cannot be built (its interactions are dead-lettered meanwhile)."""
        return {t: f.error for t, f in self.functions.items() if isinstance(f, Unbuilt)}

    def retry_unbuilt(self) -> list[str]:
        """Tries again to build the scorers that could not be built; returns the tenants whose scorer now is."""
        import importlib

        importlib.invalidate_caches()  # a module installed since: its file is found
        fixed = []
        for tenant, function in sorted(self.functions.items()):
            if isinstance(function, Unbuilt):
                self.functions[tenant] = _build(tenant, function.spec, self.limits[tenant], log=False)
                if not isinstance(self.functions[tenant], Unbuilt):
                    fixed.append(tenant)
        for tenant, (spec, limit) in sorted(self.waiting_specs.items()):  # a change left as it was: applied now
            function = _build(tenant, spec, limit, log=False)
            if not isinstance(function, Unbuilt):
                del self.waiting_specs[tenant]
                self.functions[tenant], self.specs[tenant], self.limits[tenant] = function, spec, limit
                fixed.append(tenant)
        return fixed

    def follow(self, scorers: dict[str, str], time_limits: dict[str, float]) -> Followed:
        """Takes the tenants and scorers of a config read again (`scorers`, `time_limits`: as for the
        constructor) where that changes nothing a restart would do differently: a tenant new to the config
        is served from its next event (one created on the fly, with the default scorer, is configured now);
        a scorer changed is used from the next event (an event read again after a crash is scored by it, as
        after a restart); a tenant removed is dead-lettered as unknown from its next event once
        `removal_grace_s` have passed (`settle_leaving`; see there), or, with unknown_tenant = "create", goes on
        as a tenant created on the fly at once. Two changes wait for a restart:
        a tenant scored by a function before and by feedback now (the feedback that came while it was
        scored by a function is not waiting in memory; a restart loads it), and one removed so (with
        "create"). A scorer that cannot be built leaves its tenant as it was."""
        done = Followed()
        for tenant in [t for t in self.leaving if t in scorers]:  # back before it left: as if never removed
            del self.leaving[tenant]
        self.waiting_specs.clear()  # what this read asks for replaces what an earlier one asked for
        for tenant, spec in sorted(scorers.items()):
            limit = time_limits.get(tenant, DEFAULT_TIME_LIMIT_S)
            old = self.specs.get(tenant, DEFAULT_SCORER if tenant in self.auto else None)
            if tenant in self.configured and (old, self.limits.get(tenant)) == (spec, limit):
                continue
            if old is not None and is_function(old) and not is_function(spec):
                done.at_restart.append(tenant)
                continue
            if is_function(spec):
                function = _build(tenant, spec, limit, log=False)
                if isinstance(function, Unbuilt):
                    done.errors[tenant] = function.error
                    if tenant in self.configured or tenant in self.auto:
                        self.waiting_specs[tenant] = (spec, limit)  # tried again with the other unbuilt ones
                        continue  # its scorer stays as it was until then
                self.functions[tenant] = function  # a tenant new to the config: its interactions say why
            (done.rescored if tenant in self.configured else done.added).append(tenant)
            self.specs[tenant], self.limits[tenant] = spec, limit
            self.auto.discard(tenant)
        for tenant in sorted(self.configured - set(scorers)):
            if self.unknown_tenant == "create" and tenant in self.functions:
                done.at_restart.append(tenant)
                continue
            if self.unknown_tenant == "reject" and self.removal_grace_s > 0:  # stored a while yet: settle_leaving
                if tenant not in self.leaving:
                    self.leaving[tenant] = self.clock() + self.removal_grace_s
                    done.leaving.append(tenant)
                continue
            self._remove(tenant)
            done.removed.append(tenant)
        self.configured = (self.configured | set(done.added)) - set(done.removed)
        return done

    def settle_leaving(self) -> list[str]:
        """Removes the tenants whose `removal_grace_s` since their removal from the config is over; returns them
        (with "reject": serving reads the config again later than ingest, every 5 s against every second,
        answering the tenant meanwhile, and its requests running then end later still; their events would be
        dead-lettered as a tenant unknown)."""
        now = self.clock()
        gone = sorted(t for t, at in self.leaving.items() if now >= at)
        for tenant in gone:
            del self.leaving[tenant]
            self._remove(tenant)
        self.configured -= set(gone)
        return gone

    def _remove(self, tenant: str) -> None:
        """A tenant no longer in the config: from its next event, unknown (or created on the fly, "create")."""
        self.functions.pop(tenant, None)
        self.limits.pop(tenant, None)
        del self.specs[tenant]
        if self.unknown_tenant == "create":  # as at a restart: a tenant that exists, with the default scorer
            self.specs[tenant] = DEFAULT_SCORER
            self.auto.add(tenant)

    def admit(self, tenant: str) -> str | None:
        """None when events of `tenant` may be stored (a tenant not configured is created when the mode and
        the cap allow; see the module docstring); otherwise why not, for the dead letter."""
        if tenant in self.specs:
            return None
        if self.unknown_tenant == "reject":
            return f'tenant {tenant!r} is not configured (ingest.unknown_tenant = "reject")'
        if tenant not in self.auto:
            twin = self._case_twin(tenant)
            if twin is not None:
                return (f"tenant {tenant!r} is not configured, and differs from tenant {twin!r} only in case (one "
                        "directory on a case-insensitive disk, as the config refuses for its tenants)")
            if len(self.auto) >= self.max_auto_tenants:
                if not self._cap_logged:  # once: each refused event is counted as an unknown_tenant dead letter
                    self._cap_logged = True
                    logger.warning(
                        "ingest.max_auto_tenants (%d) reached (%d tenants not in the config exist): events of further "
                        "new tenants are dead-lettered (unknown_tenant), the first of them %r",
                        self.max_auto_tenants, len(self.auto), tenant,
                    )
                return (f"tenant {tenant!r} is not configured, and ingest.max_auto_tenants ({self.max_auto_tenants}) "
                        f"tenants were created on the fly already")
            self.auto.add(tenant)
        logger.info("tenant %r is not configured; serving it with scorer %r (%d tenants not in the config, "
                    "ingest.max_auto_tenants = %d)", tenant, DEFAULT_SCORER, len(self.auto), self.max_auto_tenants)
        self.specs[tenant] = DEFAULT_SCORER
        return None

    def _case_twin(self, tenant: str) -> str | None:
        """A configured or existing tenant whose name differs from `tenant`'s only in case, if any."""
        folded = tenant.casefold()
        return next((t for t in (*self.configured, *self.auto) if t.casefold() == folded), None)

    def _known(self, tenant: str) -> bool:
        """Whether `tenant` has (or may have) partitions of its own: configured, or created on the fly."""
        return tenant in self.specs or tenant in self.auto

    def process(self, records: Sequence[Record], store: PendingStore, now_ms: int) -> Output:
        budget = self.scoring_budget_s
        deadline = None if budget is None else time.monotonic() + budget
        out = Output()
        if self.unknown_tenant == "create" and store.tenants_on_disk is not self._merged:  # a view (re)loaded
            self.auto |= store.tenants_on_disk - self.configured
            self._merged = store.tenants_on_disk
        out.ranges = offset_ranges(records)

        # Pass 1: decode, then ask the store about every key of the batch at once (vectorised lookups).
        # Dead-letter offsets are looked up one by one when a record is rejected (a few percent of them).
        max_bytes = self.max_message_bytes
        values = [r.value or b"" for r in records]
        events = [decode(raw, max_bytes=max_bytes) for raw in values]
        for i, (rec, ev) in enumerate(zip(records, events)):
            key = rec.key
            if key is not None and type(ev) is not DeadLetter and key != ev.tenant.encode():
                events[i] = key_mismatch(key, ev)
        keys = list({(ev.tenant, ev.id): None for ev in events if type(ev) is not DeadLetter})
        hashes = list(map(key_hash, keys))  # once for both indexes
        stored_interactions = store.interactions.present(keys, hashes)
        scored = store.trajectories.present(keys, hashes)  # grows with this batch's trajectories
        stored_feedback = store.feedback.present(feedback_key(ev) for ev in events if type(ev) is FeedbackEvent)
        batch_feedback: set = set()  # this batch's feedback keys so far: a resend within one batch

        new_interactions: dict[Key, InteractionRow] = {}
        to_fetch: dict[Key, list[FeedbackRow]] = {}  # feedback whose interaction is on disk, in stream order

        def score(row: InteractionRow, reward: float, source: str) -> None:
            out.trajectories.append(trajectory_row(row, reward, source, now_ms))
            scored.add((row.tenant, row.id))
            store.pending.pop((row.tenant, row.id))

        def wait(fb: FeedbackRow) -> None:
            """Feedback whose interaction has not arrived waits for it, within the caps."""
            if reason := store.pending.add(fb):
                out.pending_dropped[reason] += 1

        def first_within(waiting: Iterable[FeedbackRow], row: InteractionRow) -> FeedbackRow | None:
            """The feedback that scores `row`: the first (in stream order) within the expiry of it."""
            return next((fb for fb in waiting if store.within_expiry(fb.ts, row.ts)), None)

        def reject(dl: DeadLetter, raw: bytes, rec: Record) -> None:
            # tuple.__new__ builds the NamedTuple at half the cost of Coords(...). Only a rejected record
            # needs one (its key in dead_letters/); rows read a record's coordinates from the record itself.
            at = tuple.__new__(Coords, (rec.topic, rec.partition, rec.offset))
            if dl.tenant is not None and not self._known(dl.tenant):  # no partition for a name anyone can claim
                detail = dl.detail if dl.reason == "unknown_tenant" else f"{dl.detail} (tenant {dl.tenant!r}, not configured)"
                dl = DeadLetter(dl.reason, detail, None, dl.id)
            raw = bytes(raw)  # a SkippedBatch's plain bytes (the producer takes no subclass); a bytes is itself
            rejected = Rejected(dead_letter_row(dl, raw, at, now_ms), raw, at)
            if at in store.dead_letters:
                # In dead_letters/ already: a replay after a crash that may have come before this batch's
                # dead letters reached the topic, so they are sent again (the topic is best effort, and
                # may get one twice).
                out.duplicates += 1
                out.replayed_dead_letters.append(rejected)
                return
            out.dead_letters.append(rejected)
            out.reasons[dl.reason] += 1

        # Pass 2: one decision per record, in Kafka order.
        specs, functions = self.specs, self.functions
        for i, (rec, raw, ev) in enumerate(zip(records, values, events)):
            if type(ev) is DeadLetter:
                reject(ev, raw, rec)
                continue
            spec = specs.get(ev.tenant)
            if spec is None:
                why = self.admit(ev.tenant)
                if why is not None:
                    reject(DeadLetter("unknown_tenant", why, ev.tenant, ev.id), raw, rec)
                    continue
                spec = specs[ev.tenant]
            key = (ev.tenant, ev.id)
            function = functions.get(ev.tenant)

            if type(ev) is InteractionEvent:
                stored = key in new_interactions or key in stored_interactions
                if stored and key in scored:  # a replay or a resend: nothing left to derive
                    out.duplicates += 1
                    continue
                try:
                    row = interaction_row(ev, rec, now_ms)
                except RecursionError:  # parsed near the parser's depth limit, too deep to write back from here
                    reject(DeadLetter("bad_field", "messages or metadata are nested too deeply to store", ev.tenant,
                                      ev.id), raw, rec)
                    continue
                reward = None
                if function is not None and key not in scored:
                    if not stored and store.dead_letters.get((rec.topic, rec.partition, rec.offset)) == SCORER_FAILED:
                        # Its scorer failed at this offset before (a replay): not run again. A scorer that
                        # ran out of time would cost its whole limit again per event, for every replay of
                        # the batch; the stored dead letter has the first run's detail. (An offset rejected
                        # for another reason, an unknown tenant since configured, say, is scored.)
                        reject(DeadLetter(SCORER_ERROR, f"scorer {spec!r} failed on this event before; not run "
                                          "again on a replay (dead_letters/ holds the first failure)", ev.tenant,
                                          ev.id), raw, rec)
                        continue
                    if deadline is not None and i and time.monotonic() >= deadline:
                        out.cut = i  # before anything of record i is decided: the rest is read again
                        break
                    try:
                        reward = apply(function, row.completion, row.prompt)
                    except ScorerError as e:
                        reject(DeadLetter(SCORER_ERROR, f"scorer {spec!r}: {e}", ev.tenant, ev.id), raw, rec)
                        continue
                if stored:
                    out.duplicates += 1
                else:
                    out.interactions.append(row)
                    new_interactions[key] = row
                if key in scored:
                    continue
                if reward is not None:
                    score(row, reward, spec)
                elif ev.reward is not None:
                    score(row, ev.reward, "inline")
                elif function is None and (waiting := store.pending.get(key)):
                    fb = first_within(waiting, row)
                    if fb is not None:
                        score(row, fb.score, fb.source or "feedback")

            else:
                fb = feedback_row(ev, rec, now_ms)
                fkey = FEEDBACK_KEY(fb)
                if fkey in stored_feedback or fkey in batch_feedback:
                    out.duplicates += 1
                else:
                    out.feedback.append(fb)
                    batch_feedback.add(fkey)
                if key in scored or function is not None:
                    continue
                row = new_interactions.get(key)
                if row is not None:
                    if store.within_expiry(fb.ts, row.ts):
                        score(row, fb.score, fb.source or "feedback")
                elif key in stored_interactions:
                    to_fetch.setdefault(key, []).append(fb)  # all of them: the first may be outside the expiry
                else:
                    wait(fb)

        if out.cut is not None:
            out.ranges = offset_ranges(records[: out.cut])
        if to_fetch:
            stored = store.fetch_interactions(to_fetch)
            for key, waiting in to_fetch.items():
                row = stored.get(key)
                if key in scored:
                    continue
                if row is None:  # indexed but not found (a hash collision): wait like any early feedback
                    for fb in waiting:
                        wait(fb)
                elif (fb := first_within(waiting, row)) is not None:
                    score(row, fb.score, fb.source or "feedback")
        return out
