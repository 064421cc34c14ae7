"""Every finished request and every HTTP feedback becomes an event on Kafka, without ever slowing serving.

Request handlers call `EventLog.log(event)`, which only puts the event on an in-memory queue. One
background thread owns the Kafka producer (kafka-python, whose `send` and `flush` may block for
seconds when the broker is away) and works the queue:

- broker reachable, spool empty: send the batch, wait for the acknowledgements (bounded), done;
- a send fails or times out: the unacknowledged messages go to the spool (serving/spool.py, on disk,
  fsynced) and the producer is closed, so it cannot deliver them behind our back;
- broker unreachable, or the spool not empty: new messages are appended to the spool too (so they stay
  behind the older ones), and every `retry_seconds` the thread reconnects and sends the spool's
  segments oldest first, deleting each segment only after all its messages were acknowledged.

Delivery is therefore at-least-once: a message whose acknowledgement was lost is sent again. It is
exactly-once in storage because every event carries its idempotency key: ingest stores an event once
per (tenant, id) however often it arrives (design.md, "Contracts"). Interaction ids are the response
ids, unique per request.

What can be lost: events still in the in-memory queue when the process is killed without a chance to
stop (SIGKILL, power loss) — a few milliseconds' worth. A normal stop (`close(timeout)`) drains the queue to
Kafka or to the spool first, within its timeout: from the stop on, every wait for acknowledgements ends by
a deadline a little before the timeout, the spool's backlog is left for the next start, and whatever is
still queued at the deadline goes to the spool (a local append), so a slow or hanging broker cannot keep
a queued event in memory past the stop.

What this module does not do: build the events (api.py does, with ingest/events.py's types and `encode`)
or decide their content.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ingest.events import Event, FeedbackEvent, InteractionEvent, encode
from serving.metrics import ServingMetrics
from serving.spool import Message, Spool, SpoolError

logger = logging.getLogger(__name__)

BATCH_MAX = 512
_STOP = object()
STOP_MARGIN = 2.0  # seconds of a stop's timeout kept for spooling what is left at the deadline
ACK_SLICE = 0.5  # acknowledgements are awaited in slices this long, so a stop's deadline cuts a wait short


def kafka_producer(bootstrap: str) -> Any:
    """A kafka-python producer that fails fast: nothing here may wait a minute for a missing broker."""
    from kafka import KafkaProducer

    return KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=5,
        max_block_ms=2000,
        request_timeout_ms=5000,
        delivery_timeout_ms=8000,
        bootstrap_timeout_ms=2000,
        reconnect_backoff_max_ms=1000,
    )


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
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = {InteractionEvent: interactions_topic, FeedbackEvent: feedback_topic}
        self.spool = Spool(spool_dir)
        self.metrics = metrics
        self.producer_factory = producer_factory
        self.retry_seconds = retry_seconds
        self.ack_timeout = ack_timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._producer: Any = None
        self._next_connect = 0.0
        self._deadline: float | None = None  # set by close(): sends end by then, the rest is spooled
        self._spooled = self.spool.pending()  # left by an earlier run (or another process)
        self.metrics.spool_events.set(self._spooled)
        self._thread = threading.Thread(target=self._run, name="clora-event-log", daemon=True)

    # --- the request side: never blocks -------------------------------------------------------------------
    def log(self, event: Event) -> None:
        self._queue.put(Message(self.topics[type(event)], event.tenant, encode(event).decode("utf-8")))

    def start(self) -> EventLog:
        self._thread.start()
        return self

    def close(self, timeout: float = 15.0) -> None:
        """Sends (or spools) everything logged so far, then stops the thread and the producer."""
        if not self._thread.is_alive():
            return
        self._deadline = time.monotonic() + max(0.0, timeout - STOP_MARGIN)
        self._queue.put(_STOP)
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
            except Exception:  # the thread must survive anything; a lost batch would be logged below
                logger.exception("event log iteration failed")
        self._shutdown()

    def _take(self, block_seconds: float) -> tuple[list[Message], bool]:
        batch: list[Message] = []
        try:
            item = self._queue.get(timeout=block_seconds)
        except queue.Empty:
            return batch, False
        while True:
            if item is _STOP:
                return batch, True
            batch.append(item)
            if len(batch) >= BATCH_MAX:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False

    def _handle(self, batch: list[Message]) -> None:
        if self._spooled or self._past_deadline() or not self._connect():
            self._to_spool(batch)
            return
        failed = self._send(batch)
        unsent = {id(m) for m in failed}
        self._count([m for m in batch if id(m) not in unsent], "sent")
        if failed:
            self._to_spool(failed)

    def _shutdown(self) -> None:
        leftovers, _ = self._take(block_seconds=0)
        if leftovers:
            self._handle(leftovers)
        self._disconnect(flush=True)
        self.spool.close()  # a backlog in the spool is sent by the next start (of this or another process)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _await_acks(self, producer: Any) -> None:
        """`producer.flush()` for at most `ack_timeout`, in slices, ending early at a stop's deadline;
        raises TimeoutError if the messages were not all acknowledged by then."""
        from kafka.errors import KafkaTimeoutError

        end = time.monotonic() + self.ack_timeout
        while True:
            wait = min(ACK_SLICE, end - time.monotonic(), self._ack_wait())
            if wait <= 0:
                raise TimeoutError("not acknowledged in time")
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
        now = time.monotonic()
        if now < self._next_connect:
            return False
        self._next_connect = now + self.retry_seconds
        try:
            self._producer = self.producer_factory(self.bootstrap)
        except Exception as e:  # kafka-python raises NoBrokersAvailable, KafkaError or OSError here
            logger.warning("Kafka at %s unreachable (%s); events go to the spool at %s", self.bootstrap, e,
                           self.spool.directory)
            return False
        logger.info("connected to Kafka at %s", self.bootstrap)
        return True

    def _disconnect(self, *, flush: bool = False) -> None:
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.close(timeout=self._ack_wait() if flush else 0)
        except Exception:  # closing a producer whose broker is gone may raise; it is gone either way
            logger.debug("closing the Kafka producer raised", exc_info=True)

    def _send(self, messages: Sequence[Message]) -> list[Message]:
        """Sends and waits for the acknowledgements; returns the messages not acknowledged."""
        producer = self._producer
        futures = []
        try:
            for m in messages:
                futures.append((m, producer.send(m.topic, key=m.key.encode(), value=m.value.encode())))
            self._await_acks(producer)
        except Exception as e:  # KafkaTimeoutError, KafkaError; the futures below say what got through
            logger.warning("sending %d events to Kafka failed: %s", len(messages), e)
        acked = {id(m) for m, future in futures if future.is_done and future.succeeded()}
        failed = [m for m in messages if id(m) not in acked]
        if failed:
            logger.warning("%d of %d events not acknowledged by Kafka; spooling them", len(failed), len(messages))
            self._disconnect()  # stop its retries: the spool owns these messages now
        return failed

    # --- the spool ------------------------------------------------------------------------------------------
    def _to_spool(self, messages: list[Message]) -> None:
        try:
            self.spool.append(messages)
        except SpoolError:
            logger.exception("could not spool %d events; they are lost", len(messages))
            self._count(messages, "dropped")
            return
        self._spooled += len(messages)
        self.metrics.spool_events.set(self._spooled)
        self._count(messages, "spooled")

    def _send_spool(self) -> None:
        self.spool.seal()
        for segment in self.spool.segments():
            if self._deadline is not None:  # stopping: the backlog waits for the next start
                break
            with self.spool.claim(segment) as claim:
                if claim is None:
                    continue
                failed = self._send(claim.messages) if claim.messages else []
                if failed:
                    return  # the segment stays; it is sent again, in full, next time
                claim.done()
                self._count(claim.messages, "resent")
                logger.info("sent %d spooled events from %s", len(claim.messages), segment.name)
        self._spooled = self.spool.pending()
        self.metrics.spool_events.set(self._spooled)

    def _count(self, messages: Sequence[Message], outcome: str) -> None:
        for m in messages:
            kind = "feedback" if m.topic == self.topics[FeedbackEvent] else "interaction"
            self.metrics.events.labels(kind, outcome).inc()
