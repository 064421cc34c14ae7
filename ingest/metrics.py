"""What the ingest process reports about itself: a log line every LOG_EVERY_S seconds, and Prometheus metrics.

Reported: events/s, rows written per dataset, duplicates skipped, dead letters by reason, consumer lag per
partition, pending feedback, pending feedback dropped from memory by reason (`over_cap`: the tenant's cap,
ingest.max_pending_feedback_per_tenant, or the total cap made room for newer feedback; `per_id`: its id
already had 8 feedback events waiting; `expired`: waited longer than ingest.pending_expiry_hours; in each
case the event stays in feedback/), dead letters the dead-letter topic never acknowledged (given up after
consumer.DEAD_LETTER_ATTEMPTS sends; the topic is best effort, they are in dead_letters/), flush time, and
when the poll loop last went round and a batch was last written (liveness).
Prometheus metrics live in a registry of their own (so several Ingest objects in one test process do not
collide) and are served on 127.0.0.1:`port` when the port is non-zero (config `ingest.metrics_port`).

Not here: how the numbers are produced (consumer.py calls `flushed` and `lag`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from prometheus_client import CollectorRegistry, Counter as PromCounter, Gauge, Histogram

from clora.metrics_endpoint import serve_metrics, stop_metrics
from ingest.batch import Output

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0


class IngestMetrics:
    def __init__(self, *, port: int = 0, host: str = "127.0.0.1", setting: str | None = None) -> None:
        """`setting`: how the config names `port`, for the error when it cannot be used (default
        "ingest.metrics_port <port>")."""
        self.registry = CollectorRegistry()
        self.messages = PromCounter("clora_ingest_messages", "Kafka messages processed", registry=self.registry)
        self.rows = PromCounter("clora_ingest_rows", "Rows written, by dataset", ["dataset"], registry=self.registry)
        self.duplicates = PromCounter("clora_ingest_duplicates", "Messages already stored, skipped", registry=self.registry)
        self.dead = PromCounter("clora_ingest_dead_letters", "Dead letters, by reason", ["reason"], registry=self.registry)
        self.not_delivered_counter = PromCounter(
            "clora_ingest_dead_letters_not_delivered",
            "Dead letters the dead-letter topic did not acknowledge after every attempt (they are in dead_letters/)",
            registry=self.registry,
        )
        self.lag_gauge = Gauge("clora_ingest_lag", "Consumer lag, by topic and partition", ["topic", "partition"], registry=self.registry)
        self.pending_gauge = Gauge("clora_ingest_pending_feedback", "Feedback waiting for its interaction", registry=self.registry)
        self.dropped_counter = PromCounter(
            "clora_ingest_pending_feedback_dropped",
            "Pending feedback dropped from memory (still in feedback/), by reason: over_cap, per_id, expired",
            ["reason"], registry=self.registry,
        )
        # To 2 minutes: a batch's time includes its scoring, up to ingest.max_batch_scoring_seconds (30 s).
        self.flush_seconds = Histogram("clora_ingest_flush_seconds", "Time to write one batch", registry=self.registry,
                                       buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))
        # Liveness: a loop that stopped going round (hung) stops the first; one that goes round but stores
        # nothing (a broker away, traffic stopped) stops the second while the lag (or the producers) says why.
        self.last_loop = Gauge("clora_ingest_last_loop_timestamp_seconds", "When the poll loop last went round "
                               "(updated every ~10 s), Unix time", registry=self.registry)
        self.last_flush = Gauge("clora_ingest_last_flush_timestamp_seconds", "When a batch was last written, Unix time",
                                registry=self.registry)
        self.loop_alive()  # from the start: 0 (1970) would read as a loop stopped long ago
        self.total = Counter()  # the same counts as plain numbers, for logs, --once summaries and tests
        self.reasons: Counter = Counter()
        self.dropped: Counter = Counter()  # pending feedback dropped from memory, by reason
        self.lag: dict[tuple[str, int], int] = {}
        self.pending = 0
        self._last_log = time.monotonic()
        self._last_messages = 0
        self.server = None
        if port:
            self.server = serve_metrics(self.registry, port=port, host=host,
                                        setting=setting or f"ingest.metrics_port {port}", what="ingest")

    def flushed(self, messages: int, out: Output, seconds: float, pending: int) -> None:
        self.messages.inc(messages)
        self.total["messages"] += messages
        for dataset, n in (
            ("interactions", len(out.interactions)),
            ("trajectories", len(out.trajectories)),
            ("feedback", len(out.feedback)),
            ("dead_letters", len(out.dead_letters)),
        ):
            self.rows.labels(dataset).inc(n)
            self.total[dataset] += n
        self.duplicates.inc(out.duplicates)
        self.total["duplicates"] += out.duplicates
        for reason, n in out.reasons.items():
            self.dead.labels(reason).inc(n)
        self.reasons.update(out.reasons)
        for reason, n in out.pending_dropped.items():
            self.pending_dropped(reason, n)
        self.flush_seconds.observe(seconds)
        self.last_flush.set(time.time())
        self.set_pending(pending)

    def dead_letters_not_delivered(self, n: int) -> None:
        """`n` dead letters of a batch (replayed ones included) were given up on by the dead-letter topic."""
        self.not_delivered_counter.inc(n)
        self.total["dead_letters_not_delivered"] += n

    def pending_dropped(self, reason: str, n: int) -> None:
        self.dropped_counter.labels(reason).inc(n)
        self.dropped[reason] += n

    def set_pending(self, n: int) -> None:
        self.pending = n
        self.pending_gauge.set(n)

    def set_lag(self, lag: dict[tuple[str, int], int]) -> None:
        """Each assigned partition's lag (called from the poll loop every LOG_EVERY_S: the loop is alive)."""
        self.loop_alive()
        self.lag = lag
        self.lag_gauge.clear()  # partitions revoked since (another process reports them now)
        for (topic, partition), n in lag.items():
            self.lag_gauge.labels(topic, str(partition)).set(n)

    def loop_alive(self) -> None:
        """The poll loop went round now (clora_ingest_last_loop_timestamp_seconds)."""
        self.last_loop.set_to_current_time()

    def due(self) -> bool:
        return time.monotonic() - self._last_log >= LOG_EVERY_S

    def log(self) -> None:
        now = time.monotonic()
        rate = (self.total["messages"] - self._last_messages) / max(now - self._last_log, 1e-9)
        self._last_log, self._last_messages = now, self.total["messages"]
        lag = ", ".join(f"{t}:{p}={n}" for (t, p), n in sorted(self.lag.items())) or "-"
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(self.reasons.items())) or "none"
        if undelivered := self.total["dead_letters_not_delivered"]:
            reasons += f" ({undelivered} not delivered to the dead-letter topic)"
        dropped = ", ".join(f"{r}={n}" for r, n in sorted(self.dropped.items())) or "none"
        logger.info(
            "ingest: %.0f events/s; totals: %d messages, %d interactions, %d trajectories, %d feedback, "
            "%d duplicates; dead letters: %s; pending feedback: %d (dropped: %s); lag: %s",
            rate, self.total["messages"], self.total["interactions"], self.total["trajectories"],
            self.total["feedback"], self.total["duplicates"], reasons, self.pending, dropped, lag,
        )

    def close(self) -> None:
        stop_metrics(self.server)
        self.server = None
