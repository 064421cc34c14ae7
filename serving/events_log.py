"""Every finished request and every HTTP feedback becomes an event on Kafka, without ever slowing serving.

Request handlers call `EventLog.log(event)`, which only puts the event on an in-memory queue (or drops
it, past the bound on memory below). One
background thread owns the Kafka producer (kafka-python, whose `send` and `flush` may block for
seconds when the broker is away) and works the queue:

- broker reachable, spool empty: send the batch, wait for the acknowledgements (bounded), done;
- a send fails or times out: the unacknowledged messages go to the spool (serving/spool.py, on disk,
  fsynced) and the producer is closed, so it cannot deliver them behind our back;
- broker unreachable, or the spool not empty: new messages are appended to the spool too (so they stay
  behind the older ones; with the broker unreachable, the whole queue each time, so what a kill would lose
  is what came since), and `retry_seconds` after each failed attempt the thread reconnects and sends the spool's
  segments oldest first, each a batch at a time (cut as the queue is). After each batch it records how
  far the segment is acknowledged (its acknowledged prefix: serving/spool.py's progress record), and the
  next try starts after that prefix, not at the segment's start: a broker that is up but slow (that
  acknowledges less than a segment, or a batch, per `ack_timeout`) drains the spool a piece per try
  instead of being sent its first segment for ever. A segment is deleted once all its messages were
  acknowledged. Before each segment after the first it moves what was queued meanwhile to the spool, behind the backlog (so a
  long backlog does not hold the queue in memory); after the last it leaves the queue where it is. Those
  messages are newer than every spooled one, so once the spool is empty they are sent straight, in
  order, and the thread is back to the first case. (Moving them too would leave the spool non-empty after
  every pass that saw one request: under steady traffic it would never empty again, and every event
  would cost a segment's fsync, create and delete.)

While its own spool is empty, the thread also looks every `retry_seconds` for segments another serving
process sharing the spool directory left behind (it died, or stopped while Kafka was away: the lock on its
writer file is free, spool.py), and sends them.

Delivery is therefore at-least-once: a message whose acknowledgement was lost is sent again. The prefix
recorded ends at the first message not acknowledged (Kafka acknowledges each partition on its own), so a
resend repeats only what was acknowledged behind that one, within one batch; a crash repeats at most the
batch of a segment in flight. It is exactly-once in storage because every event carries its idempotency
key: ingest stores an event once per (tenant, id) however often it arrives (design.md, "Contracts").
Interaction ids are the response ids, unique per request.

Messages Kafka refuses for good. A resend cannot fix a message larger than the producer's
`max_request_size` (kafka-python refuses it in `send`) or than the broker's limit (the broker refuses it
later, in the send's answer), nor one the broker finds invalid. Such a message would block the spool
forever if it stayed there, so it is dead-lettered instead: logged at error level with its tenant and id,
counted (`clora_serving_events_total{outcome="dead"}`), and written whole, with its reason, to the
spool directory's `dead/` file (serving/spool.py); the messages around it go on. Only errors about the
message itself count: kafka-python marks other errors not `retriable` too (authorization, an unsupported
version, an unknown server error, a closed producer), but those hold for every message and pass once the
cluster is fixed, so those messages stay in the spool and are resent. A message of a spool segment is
dead-lettered only once every message before it in the segment got through, just before the segment's
recorded progress moves past it; until then it stays in the segment. The reason "too_large" is the word
ingest uses for messages over `ingest.max_message_bytes` (1 MB by default): an event that big would be
dead-lettered by ingest anyway.

Memory is bounded. `log` costs the request the event's encoding and an append to a deque under a lock,
nothing else: it never touches the disk or Kafka (it runs on the server's event loop). Past `queue_bytes`
of queued events (a broker that takes seconds per answer, a long backlog), the thread moves the whole
queue to the spool (one append, fsynced a spool segment at a time, so it makes several segments of at
most 8 MiB, each drained on its own: 0.24 s for 32 MiB), behind the batch in flight, and the queue
starts empty again. Should the spool fail part-way, the segments written stay spooled and only the rest
goes back to the queue. It looks before taking each batch and between the slices of every wait for
acknowledgements, so within ACK_SLICE even while Kafka is slow; it is the only one that takes messages
off the queue, so nothing newer is sent or spooled before them. The batch in flight goes first because it
is older: should its send fail, its own spooling would come behind the queue; it may then reach Kafka as
well as the spool, a duplicate, harmless like any other. Until the thread gets there (and while it
writes), `log` keeps accepting events up to twice `queue_bytes` in all; past that it drops the new event,
counted (`clora_serving_events_total{outcome="dropped"}`) and logged at error level (at most once per
SPILL_RETRY), and returns False: the API answers feedback so with a 503 the client can retry, while a
completion's event is lost (its answer has been sent). Over-admitting instead would keep them only until memory ran out, and a serving process
killed for memory loses everything it holds and every request it is serving: the bound is what stands
between a slow broker plus a failing disk and that. If the spool refuses the queue (disk full), the queue
stays in memory, in order, to be sent as Kafka allows (none of it is dropped), and the thread tries
the spool again only SPILL_RETRY seconds later, so a full disk does not cost a 32 MiB write per batch.

What can be lost: events still in memory when the process is killed without a chance to stop
(SIGKILL, power loss) — a few milliseconds' worth, at most twice `queue_bytes` plus the batch in flight
(BATCH_MAX events and about BATCH_BYTES) and a spool segment being resent; while Kafka is slow
or away and the spool cannot take events (a full disk: they stay queued, retried every SPILL_RETRY
seconds), the events `log` drops past twice `queue_bytes`; and at a stop, what the spool then refuses (an
event logged once the thread has stopped, by a request that ended during the stop, is spooled by `log`
itself). A
normal stop (`close(timeout)`) drains the queue to Kafka or to the spool first, within its timeout: from the stop on,
every wait for acknowledgements ends by a deadline a little before the timeout, the spool's backlog is
left for the next start, and whatever is still queued at the deadline goes to the spool (a local append),
so a slow or hanging broker cannot keep a queued event in memory past the stop.

What this module does not do: build the events (api.py does, with ingest/events.py's types and `encode`)
or decide their content.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.events import Event, FeedbackEvent, InteractionEvent, encode
from serving.metrics import ServingMetrics
from serving.spool import Claim, Message, Refused, Spool, SpoolError

logger = logging.getLogger(__name__)

BATCH_MAX = 512
BATCH_BYTES = 4 << 20  # a batch in flight stops growing past this (it is held on top of the queue)
QUEUE_BYTES = 32 << 20  # events (their JSON text) queued; past this the thread spools them, past twice this log() drops
REQUEUE_PAUSE = 0.1  # the thread's pause after the spool refused events while Kafka is up (no spinning)
AWAY_LOG_EVERY_S = 60.0  # while Kafka stays unreachable, one line this often (an attempt is made every retry_seconds)
SPILL_RETRY = 5.0  # seconds after the spool refused the queue before the thread tries again (a full disk)
STOP_MARGIN = 2.0  # seconds of a stop's timeout kept for spooling what is left at the deadline
ACK_SLICE = 0.5  # acknowledgements are awaited in slices this long, so a stop's deadline cuts a wait short
# kafka-python's default, written out: it matches Apache Kafka's default broker limit (message.max.bytes,
# 1 MiB) and is above ingest's default max_message_bytes (1 MB), so every event ingest would store fits.
MAX_REQUEST_BYTES = 1 << 20


def kafka_producer(bootstrap: str, *, max_request_size: int = MAX_REQUEST_BYTES, client: dict | None = None) -> Any:
    """A kafka-python producer that fails fast: nothing here may wait a minute for a missing broker.

    Raise `max_request_size` (with `functools.partial`) only together with the broker's limit and
    ingest's `max_message_bytes`; a message over it is dead-lettered here, not sent. `client`: the
    connection's kafka-python options (KafkaConfig.client_options: TLS, SASL).
    """
    from kafka import KafkaProducer

    return KafkaProducer(
        **{"bootstrap_servers": bootstrap, **(client or {})},
        acks="all",
        linger_ms=5,
        max_block_ms=2000,
        request_timeout_ms=5000,
        delivery_timeout_ms=8000,
        bootstrap_timeout_ms=2000,
        reconnect_backoff_max_ms=1000,
        max_request_size=max_request_size,
    )


def close_producer(producer: Any, timeout: float) -> None:
    """Closes a kafka-python producer within about `timeout` seconds, whatever its broker does. Its own close()
    flushes first and, where messages are still unacknowledged at the timeout, raises before it stops its I/O
    thread: that thread would go on resending them behind the spool's back, holding its sockets, for ever (one
    more per such close). So the thread is then stopped here (its unsent messages fail), and close() ends."""
    try:
        producer.close(timeout=timeout)
        return
    except Exception:  # noqa: BLE001 - a broker gone or hanging: the producer must stop all the same
        logger.debug("closing the Kafka producer raised; stopping its I/O thread", exc_info=True)
    sender = getattr(producer, "_sender", None)  # kafka-python's I/O thread: no public way to stop it
    if sender is not None:
        sender.force_close()
        sender.join(1.0)
    try:
        producer.close(timeout=0)
    except Exception:  # noqa: BLE001 - stopped above: what is left to close holds nothing
        logger.debug("closing the Kafka producer after stopping its I/O thread raised", exc_info=True)


def refusal_reason(error: BaseException | None) -> str | None:
    """The dead-letter reason for an error about the message itself, which no resend fixes; None for any
    other error (a resend, perhaps after the cluster is fixed, may get the message through)."""
    from kafka.errors import InvalidRecordError, MessageSizeTooLargeError, RecordListTooLargeError

    if isinstance(error, (MessageSizeTooLargeError, RecordListTooLargeError)):
        return "too_large"
    if isinstance(error, InvalidRecordError):
        return "invalid_record"
    return None


@dataclass
class Delivery:
    """What became of the messages of one `_send`, each list in the order they were given."""

    acked: list[Message] = field(default_factory=list)
    failed: list[Message] = field(default_factory=list)  # not acknowledged: a resend may get them through
    refused: list[Refused] = field(default_factory=list)  # refused for good: dead letters


class EventLog:
    def __init__(
        self,
        *,
        bootstrap: str,
        interactions_topic: str,
        feedback_topic: str,
        spool_dir: str | Path,
        metrics: ServingMetrics,
        producer_factory: Callable[[str], Any] = kafka_producer,
        retry_seconds: float = 2.0,
        ack_timeout: float = 10.0,
        queue_bytes: int = QUEUE_BYTES,
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = {InteractionEvent: interactions_topic, FeedbackEvent: feedback_topic}
        self.spool = Spool(spool_dir)
        self.metrics = metrics
        self.producer_factory = producer_factory
        self.retry_seconds = retry_seconds
        self.ack_timeout = ack_timeout
        self.queue_bytes = queue_bytes
        # Shared with the request side, under the lock.
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: deque[Message] = deque()
        self._queued_bytes = 0
        self._spilling_bytes = 0  # taken off the queue by the thread, being written to the spool
        self._stopping = False
        self._closed = False  # the thread took its last batch: what is logged later goes to the spool at once
        self._unreported_drops = 0  # dropped by log() since its last error line
        self._next_drop_report = 0.0
        # The thread's own.
        self._in_flight: list[Message] = []  # taken from the queue, not yet in Kafka or the spool
        self._spill_after = 0.0  # after a failed spill: not before then
        self._producer: Any = None
        self._next_connect = 0.0
        self._away_since: float | None = None  # when connecting began to fail (logged then, and once a minute)
        self._away_logged = 0.0
        self._next_look = 0.0  # when to look for segments other processes left (_look_for_left_segments)
        self._deadline: float | None = None  # set by close(): sends end by then, the rest is spooled
        try:
            self._spooled = self.spool.pending()  # left by an earlier run (or another process)
        except OSError as e:  # the spool cannot be listed: serving answers all the same
            logger.error("cannot read the spool at %s (%s); what it holds is sent once it can be read (looked at "
                         "every %g s)", self.spool.directory, e, self.retry_seconds)
            self._spooled = 0  # _look_for_left_segments finds what an earlier run left, once it can
        self.metrics.spool_events.set(self._spooled)
        self._thread = threading.Thread(target=self._run, name="clora-event-log", daemon=True)

    # --- the request side: never waits for Kafka, never touches the disk ----------------------------------
    def log(self, event: Event) -> bool:
        """Queues `event` for Kafka (or the spool); False when it was dropped: twice `queue_bytes` of events are
        in memory already (Kafka slow and the spool failing or behind)."""
        try:
            message = Message(self.topics[type(event)], event.tenant, encode(event).decode("utf-8"))
        except ValueError as e:  # a value JSON cannot carry (a non-finite log-prob from a broken adapter)
            kind = "feedback" if isinstance(event, FeedbackEvent) else "interaction"
            self.metrics.events.labels(kind, "dropped").inc()
            logger.error("dropped %s event %s of tenant %s: it cannot be encoded as JSON (%s)", kind, event.id,
                         event.tenant, e)
            return False
        size = len(message.value)
        with self._lock:
            if self._closed:
                return self._spool_late(message)
            held = self._queued_bytes + self._spilling_bytes
            if not held or held + size <= 2 * self.queue_bytes:  # an event alone is always taken
                self._queue.append(message)
                self._queued_bytes += size
                self._ready.notify()
                return True
            self._unreported_drops += 1
            now = time.monotonic()
            report = 0
            if now >= self._next_drop_report:
                report, self._unreported_drops, self._next_drop_report = self._unreported_drops, 0, now + SPILL_RETRY
        self._count([message], "dropped")
        if report:
            logger.error("dropped %d events: %d bytes of events in memory, twice queue_bytes, and the spool has "
                         "not taken them (Kafka is slow and the spool is failing, or behind)", report, held)
        return False

    def _spool_late(self, message: Message) -> bool:
        """An event logged once the thread has stopped (a request that ended during the stop, after the server
        gave up waiting for it): nothing would take it from the queue, so it goes to the spool here, for the
        next start (or a live peer sharing the spool) to send. Under the lock: late ones land in order."""
        try:
            self.spool.append([message])
        except SpoolError:
            logger.exception("an event logged after the stop could not be spooled; it is lost")
            self._count([message], "dropped")
            return False
        self._spooled_now([message])
        try:
            self.spool.close()  # sealed and let go at once: a peer sharing the spool may send it before our exit
        except OSError:  # left `.open`: the next start claims it once this process is gone
            logger.warning("could not seal the spool segment of an event logged after the stop", exc_info=True)
        return True

    def start(self) -> EventLog:
        self._thread.start()
        return self

    def close(self, timeout: float = 15.0) -> None:
        """Sends (or spools) everything logged so far, then stops the thread and the producer."""
        if not self._thread.is_alive():
            return
        self._deadline = time.monotonic() + max(0.0, timeout - STOP_MARGIN)
        with self._lock:
            self._stopping = True
            self._ready.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the event log did not stop within %.0fs; unsent events stay in memory", timeout)

    @property
    def spooled(self) -> int:
        """Messages waiting in the spool."""
        return self._spooled

    @property
    def connected(self) -> bool:
        return self._producer is not None

    # --- the background thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._take(block_seconds=0.2)
            try:
                if batch:
                    self._handle(batch)
                if self._spooled and self._deadline is None and self._connect():
                    self._send_spool()
                elif not self._spooled and self._deadline is None:
                    self._look_for_left_segments()
            except Exception:  # the thread must survive anything; a lost batch would be logged below
                logger.exception("event log iteration failed")
        self._shutdown()

    def _take(self, block_seconds: float, *, close_if_empty: bool = False) -> tuple[list[Message], bool]:
        """Up to BATCH_MAX queued messages (and about BATCH_BYTES), now the batch in flight; and whether the thread should stop
        (a stop was asked for and the queue is empty). `close_if_empty`: with nothing queued, this was the last
        take (log() spools what comes after it itself)."""
        self._spill_if_full()
        with self._ready:
            if not self._queue and not self._stopping and block_seconds > 0:
                self._ready.wait(block_seconds)
            batch = [self._queue.popleft() for _ in range(_batch_end(self._queue, 0))]
            self._queued_bytes -= sum(len(m.value) for m in batch)
            stopping = self._stopping and not self._queue
            if close_if_empty and not batch:
                self._closed = True
        self._in_flight = batch
        return batch, stopping

    def _landed(self) -> None:
        """The batch in flight is in Kafka, in the spool or dead-lettered: a spill no longer writes it."""
        self._in_flight = []

    def _handle(self, batch: list[Message]) -> None:
        """The batch in flight goes to Kafka (or the spool, or the dead letters); then it has landed."""
        try:
            if self._past_deadline():
                self._to_spool(batch, wait=0)
                return
            connected = self._connect()
            if self._spooled or not connected:
                # Should the spool refuse it: with Kafka away, wait until the next connection attempt; with
                # Kafka back, the backlog's resend (right after this) frees the disk: only pause against spinning.
                spooled = self._to_spool(batch, wait=self.retry_seconds if not connected else REQUEUE_PAUSE)
                if spooled and not connected:
                    self._queue_to_spool()  # Kafka away: all that is queued goes to disk now, not a batch per attempt
                return
            delivery = self._send(batch)
            self._count(delivery.acked, "sent")
            if delivery.refused and not self._dead_letter(delivery.refused):
                self._to_spool([r.message for r in delivery.refused], wait=REQUEUE_PAUSE)  # sent again, refused again, later
            if delivery.failed:
                self._to_spool(delivery.failed, wait=REQUEUE_PAUSE)
        finally:
            self._landed()

    def _shutdown(self) -> None:
        while True:
            leftovers, _ = self._take(block_seconds=0, close_if_empty=True)
            if not leftovers:
                break
            self._handle(leftovers)
        self._disconnect(flush=True)
        self.spool.close()  # a backlog in the spool is sent by the next start (of this or another process)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _await_acks(self, producer: Any) -> None:
        """`producer.flush()` for at most `ack_timeout`, in slices, ending early at a stop's deadline (and
        spooling the queue between slices if it outgrew its bound); raises TimeoutError if the messages were
        not all acknowledged by then."""
        from kafka.errors import KafkaTimeoutError

        end = time.monotonic() + self.ack_timeout
        looked = False
        while True:
            self._spill_if_full()  # a slow broker must not hold the queue past its bound
            wait = min(ACK_SLICE, end - time.monotonic(), self._ack_wait())
            if wait <= 0 and looked:  # the answers that came meanwhile are looked at once, however late
                raise TimeoutError("not acknowledged in time")
            wait, looked = max(wait, 0.0), True
            try:
                producer.flush(timeout=wait)
                return
            except (KafkaTimeoutError, TimeoutError):
                continue

    def _ack_wait(self) -> float:
        """How long to wait for acknowledgements now: `ack_timeout`, or less when a stop's deadline is nearer."""
        if self._deadline is None:
            return self.ack_timeout
        return max(0.0, min(self.ack_timeout, self._deadline - time.monotonic()))

    # --- Kafka ----------------------------------------------------------------------------------------------
    def _connect(self) -> bool:
        if self._producer is not None:
            return True
        if time.monotonic() < self._next_connect or self._deadline is not None:
            return False  # stopping: a connection attempt (seconds, Kafka away) would eat the stop's time
        try:
            self._producer = self.producer_factory(self.bootstrap)
        except Exception as e:  # kafka-python raises NoBrokersAvailable, KafkaError or OSError here
            # Counted from the failure, not the attempt: a failed attempt takes about as long as
            # retry_seconds itself, and the thread must get to spool between attempts.
            now = time.monotonic()
            self._next_connect = now + self.retry_seconds
            if self._away_since is None:
                self._away_since, self._away_logged = now, now
                logger.warning("Kafka at %s unreachable (%s); events go to the spool at %s", self.bootstrap, e,
                               self.spool.directory)
            elif now - self._away_logged >= AWAY_LOG_EVERY_S:  # a line a minute, not one per attempt
                self._away_logged = now
                logger.warning("Kafka at %s still unreachable after %.0f s (%s); %d events in the spool",
                               self.bootstrap, now - self._away_since, e, self._spooled)
            return False
        if self._away_since is not None:
            logger.info("connected to Kafka at %s again after %.0f s", self.bootstrap, time.monotonic() - self._away_since)
            self._away_since = None
        else:
            logger.info("connected to Kafka at %s", self.bootstrap)
        return True

    def _disconnect(self, *, flush: bool = False) -> None:
        producer, self._producer = self._producer, None
        if producer is None:
            return
        close_producer(producer, self._ack_wait() if flush else 0)

    def _send(self, messages: Sequence[Message]) -> Delivery:
        """Sends and waits for the acknowledgements; says which messages were acknowledged, which may be
        sent again and which Kafka refused for good."""
        producer = self._producer
        futures: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}  # refused in send() itself
        try:
            for m in messages:
                try:
                    futures[id(m)] = producer.send(m.topic, key=m.key.encode(), value=m.value.encode())
                except Exception as e:  # over max_request_size: refused here, before any I/O
                    if refusal_reason(e) is None:
                        raise
                    errors[id(m)] = e
            if futures:
                self._await_acks(producer)
        except Exception as e:  # KafkaTimeoutError, KafkaError; the futures below say what got through
            logger.warning("sending %d events to Kafka failed: %s", len(messages), e)
        delivery = Delivery()
        for m in messages:
            future, error = futures.get(id(m)), errors.get(id(m))
            if future is not None and future.is_done:
                if future.succeeded():
                    delivery.acked.append(m)
                    continue
                error = future.exception  # refused by the broker: too large for its limit, invalid
            reason = refusal_reason(error)
            if reason is None:
                delivery.failed.append(m)
            else:
                detail = str(error) if type(error).__name__ in str(error) else f"{type(error).__name__}: {error}"
                delivery.refused.append(Refused(m, reason, detail[:1000]))
        if delivery.failed:
            logger.warning("%d of %d events not acknowledged by Kafka", len(delivery.failed), len(messages))
            self._disconnect()  # stop its retries: the spool owns these messages now
        return delivery

    # --- the spool ------------------------------------------------------------------------------------------
    def _to_spool(self, messages: list[Message], *, wait: float) -> bool:
        """Appends `messages` to the spool. If the spool refuses them (a full disk), they (those after the
        segments it filled before failing) go back to the front of the queue (they are older than anything
        queued), no spool write is tried for SPILL_RETRY seconds (meanwhile they go straight back), and the
        thread waits up to `wait` seconds before it goes on; so log()'s bound is what drops events, not
        this. Only at a stop are they lost."""
        refusing = time.monotonic() < self._spill_after
        try:
            if refusing:
                raise SpoolError("the spool refused the last write; not tried again yet")
            self.spool.append(messages)
        except SpoolError as e:
            self._spooled_now(messages[:e.spooled])  # in the segments it filled before it failed
            messages = messages[e.spooled:]
            if self._stopping:
                logger.exception("could not spool %d events at the stop; they are lost", len(messages))
                self._count(messages, "dropped")
                return False
            if not refusing:
                logger.exception("could not spool %d events; they stay queued, the next try in %.0fs", len(messages),
                                 SPILL_RETRY)
                self._spill_after = time.monotonic() + SPILL_RETRY
            with self._ready:
                self._queue.extendleft(reversed(messages))
                self._queued_bytes += sum(len(m.value) for m in messages)
                if wait > 0:
                    self._ready.wait_for(lambda: self._stopping, timeout=wait)
            return False
        self._spooled_now(messages)
        return True

    def _spooled_now(self, messages: Sequence[Message], *, in_flight: int = 0) -> None:
        """`messages` are in the spool now; they count as spooled, all but the first `in_flight` (of the batch
        in flight, whose outcome is counted when it lands)."""
        self._spooled += len(messages)
        self.metrics.spool_events.set(self._spooled)
        self._count(messages[in_flight:], "spooled")

    def _send_spool(self) -> None:
        """Sends the backlog, oldest segment first. What is queued meanwhile goes to the spool before each
        segment after the first, and stays queued after the last: see the module docstring."""
        self.spool.seal()
        for n, segment in enumerate(self.spool.segments()):
            if self._deadline is not None:  # stopping: the backlog waits for the next start
                break
            if n:
                self._queue_to_spool()
            with self.spool.claim(segment) as claim:
                if claim is None:
                    continue
                if not self._send_segment(claim):
                    break  # the rest of the segment is sent next time, after its acknowledged prefix
        # 0 unless something was spooled meanwhile or a segment fell short: then another pass. Counted again,
        # not kept by subtraction: segments left by other processes were sent too, and counted nowhere.
        self._spooled = self.spool.pending()
        self.metrics.spool_events.set(self._spooled)
        self._next_look = time.monotonic() + self.retry_seconds

    def _look_for_left_segments(self) -> None:
        """Every `retry_seconds` while this process's spool is empty: whether another process sharing the
        spool directory left segments (it died, or stopped while Kafka was away), for the next pass to send.
        A directory listing; a segment's lines are read only when its writer is gone. The segments of a
        live process are left to it (it sends them in its order), and so is one it is draining."""
        if time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + self.retry_seconds
        self._spooled = self.spool.left_behind()  # the pass that sends them counts the whole spool again
        if self._spooled:
            logger.info("%d events another serving process left in the spool at %s: sending them", self._spooled,
                        self.spool.directory)
            self.metrics.spool_events.set(self._spooled)

    def _send_segment(self, claim: Claim) -> bool:
        """Sends a claimed segment's messages a batch at a time, recording after each batch how far the
        segment got through; deletes it once all of it did. False if a batch fell short (or a stop began):
        the rest waits for the next try."""
        messages, through = claim.messages, 0
        while through < len(messages):
            if through and self._deadline is not None:  # stopping: the rest waits for the next start
                return False
            batch = messages[through:_batch_end(messages, through)]
            got = self._through(batch, self._send(batch))
            through += got
            self._spooled = max(0, self._spooled - got)
            self.metrics.spool_events.set(self._spooled)
            if got < len(batch):
                logger.info("sent %d of the %d spooled events left in %s; the rest next time", through, len(messages),
                            claim.path.name)
                self._record_progress(claim, through)
                return False
            if through < len(messages):
                self._record_progress(claim, through)
        try:
            claim.done()
        except SpoolError:  # its unreadable lines could not be kept: it stays, and is claimed again
            raise
        except OSError as e:  # a read-only spool: sent again at every pass, for ever
            self.spool.set_aside(claim.path, f"could not be deleted once sent ({e})", sent=True)
        logger.info("sent %d spooled events from %s", len(messages), claim.path.name)
        return True

    def _through(self, batch: list[Message], delivery: Delivery) -> int:
        """How many of a segment's `batch`, from its first, got through: acknowledged, or refused for good and
        dead-lettered (the prefix ends at the first message that did neither, for a later try). Counts them."""
        position = {id(m): i for i, m in enumerate(batch)}
        through = position[id(delivery.failed[0])] if delivery.failed else len(batch)
        refused = [r for r in delivery.refused if position[id(r.message)] < through]
        if refused and not self._dead_letter(refused):
            through = position[id(refused[0].message)]  # nowhere to keep the refused ones: they stay in the segment
        self._count([m for m in delivery.acked if position[id(m)] < through], "resent")
        return through

    def _record_progress(self, claim: Claim, through: int) -> None:
        """Records that the first `through` of the claim's messages got through; a failure costs duplicates only."""
        try:
            claim.acked(through)
        except SpoolError:  # a full disk: the next try sends the acknowledged part again, nothing is lost
            logger.exception("could not record the progress of spool segment %s", claim.path.name)

    def _queue_to_spool(self) -> None:
        """While the backlog is sent: what requests logged meanwhile goes to the spool, behind the backlog,
        so the queue stays short. Not while the spool refuses writes (a full disk: the segments being sent
        are what frees it), when the queue stays in memory, within log()'s bound."""
        while time.monotonic() >= self._spill_after:
            batch, _ = self._take(block_seconds=0)
            if not batch:
                return
            try:
                if not self._to_spool(batch, wait=0):
                    return  # back in the queue: the segments go on, the queue waits
            finally:
                self._landed()

    def _spill_if_full(self) -> None:
        """Past `queue_bytes` queued, the whole queue goes to the spool, behind the batch in flight. The
        queue is swapped out under the lock and written outside it, so log() goes on meanwhile; if the
        spool refuses it, what it did not take (all of it, or what came after the segments it filled) goes
        back in front of what was queued since, and no spill is tried for SPILL_RETRY seconds."""
        if self._queued_bytes <= self.queue_bytes or time.monotonic() < self._spill_after:  # read unlocked: a hint
            return
        with self._lock:
            queued, self._queue = self._queue, deque()
            self._spilling_bytes, self._queued_bytes = self._queued_bytes, 0
        logger.warning("more than %d bytes of events queued (Kafka is slow); spooling %d of them", self.queue_bytes,
                       len(queued))
        in_flight = self._in_flight
        messages = [*in_flight, *queued]
        spooled = len(messages)
        try:
            self.spool.append(messages)
        except Exception as e:  # SpoolError, or anything else: the queue must not be lost with it (at worst doubled)
            spooled = e.spooled if isinstance(e, SpoolError) else 0  # the segments filled before it failed
            logger.exception("could not spool %d queued events (%d went in); the rest stay queued, the next try in "
                             "%.0fs", len(queued), max(0, spooled - len(in_flight)), SPILL_RETRY)
            self._spill_after = time.monotonic() + SPILL_RETRY
        self._in_flight = in_flight[spooled:]  # in the spool now, ahead of the rest: the next spill need not write it
        taken = max(0, spooled - len(in_flight))  # of the queue
        rest = deque(messages[len(in_flight) + taken:])
        with self._lock:
            self._spilling_bytes = 0
            if rest:
                self._queued_bytes += sum(len(m.value) for m in rest)
                rest.extend(self._queue)  # what log() queued meanwhile is newer
                self._queue = rest
        self._spooled_now(messages[:spooled], in_flight=len(in_flight))

    def _dead_letter(self, refused: list[Refused]) -> bool:
        """Records messages Kafka refused for good in the spool's dead-letter file; False if it could not."""
        try:
            path = self.spool.dead_letter(refused)
        except SpoolError:
            logger.exception("could not dead-letter %d events Kafka refused (%s); they stay in the spool",
                             len(refused), refused[0].detail)
            return False
        for r in refused:
            logger.error("event %s of tenant %s dead-lettered to %s: Kafka refused it for good (%s, %d bytes): %s",
                         _event_id(r.message), r.message.key, path, r.reason, len(r.message.value.encode()),
                         r.detail)
        self._count([r.message for r in refused], "dead")
        return True

    def _count(self, messages: Sequence[Message], outcome: str) -> None:
        for m in messages:
            kind = "feedback" if m.topic == self.topics[FeedbackEvent] else "interaction"
            self.metrics.events.labels(kind, outcome).inc()


def _batch_end(messages: Sequence[Message], start: int) -> int:
    """Where a batch of `messages` from `start` ends: BATCH_MAX messages and about BATCH_BYTES (by count and
    by bytes: events can be ~1 MB each), for the queue (`_take`) and a spooled segment alike."""
    end, size = start, 0
    while end < len(messages) and end - start < BATCH_MAX and (end == start or size < BATCH_BYTES):
        size += len(messages[end].value)
        end += 1
    return end


def _event_id(message: Message) -> str:
    """The event's id, for a log line (the message holds the event's JSON text)."""
    try:
        return str(json.loads(message.value)["id"])
    except (ValueError, KeyError, TypeError):
        return "(unreadable id)"
