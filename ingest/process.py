"""The ingest process: `main()` (python -m ingest) and `run_from_args` (clora ingest) -> `run(cfg)`.

This is the only place that reads the config: it builds the Processor, the metrics and the Ingest loop
from it (and reads its tenants again while ingest runs: TenantFollower), installs SIGTERM/SIGINT handlers that ask the loop to stop after its current poll (the buffer is
then flushed and committed; with --drain-on-stop the first signal means "read to the end, then stop"),
and runs. Exit code 0 on a clean stop, 2 when a tenant's scorer cannot be built.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from clora.config import Config, ConfigRereads, load_config, resolve_config_path
from clora.metrics_endpoint import MetricsPortError
from clora.up import StopFlag
from ingest.batch import UNBUILT_MEANS, Processor
from ingest.broker import BrokerError, ensure_topics, wait_until_reachable
from ingest.cli import member_name
from ingest.consumer import Ingest
from ingest.metrics import IngestMetrics
from ingest.scorers import ScorerSpecError

logger = logging.getLogger(__name__)


RETRY_UNBUILT_S = 60.0  # how often a tenant's scorer that could not be built is tried again
KAFKA_WAIT_S = 30.0  # how long start-up waits for an unreachable broker (say, one starting beside it)
SWITCH_INTERVAL_S = 0.0005


def tune_runtime() -> None:
    """Process-wide settings for ingest's one busy Python thread and its writer threads (consumer.py).

    Garbage collection: ingest allocates ~20 container objects per message (decoded JSON, events, rows);
    with the default gen-0 threshold of 700 the collector runs every ~35 messages and costs ~20% of
    throughput, while nothing ingest allocates forms cycles that need prompt collection. The collector
    now runs ~70x less often, and objects alive at start (modules, the Kafka clients) are frozen out of
    every later collection. Not rarer still: 200,000 saved another ~10% of Processor.process's time, but
    kafka-python leaves cyclic garbage (caught timeout errors with their tracebacks and frames, among
    others), which then lived longer: the peak RSS of `clora bench ingest`'s 200,000-event run rose from
    ~270 to 320-370 MB.

    GIL switching: the writer threads spend most of their time in Arrow, zstd and fsync without the GIL,
    but need it back for a moment between those calls; with the default 5 ms switch interval each such
    moment can wait 5 ms behind the busy loop thread. 0.5 ms lets them through promptly.

    Arrow's allocator: the system allocator rather than mimalloc, whose per-thread heaps kept ~50 MB
    more resident with several writer threads, for no measurable gain in speed here.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    pa.set_memory_pool(pa.system_memory_pool())


class TenantFollower:
    """Called by the ingest loop every second or so: reads the config again (`rereads`: a change counts once
    two reads in a row agree; a config that does not load and other changed settings, which take effect at
    the next start, are logged there) and hands its tenants' scorers to the processor (Processor.follow).
    Logs what changed, and a change that waits for a restart and a scorer that cannot be built (once each).
    Every RETRY_UNBUILT_S it tries again to build the scorers that could not be built (a module installed
    since), whether or not the file changed; `rereads` None: that alone."""

    def __init__(self, rereads: ConfigRereads | None, processor: Processor, cfg: Config, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rereads = rereads
        self.processor = processor
        self.applied = cfg
        self.logged: set[tuple[str, str]] = set()  # (tenant, what) said already: at_restart, or a scorer error
        self.clock = clock
        self.retry_at = clock() + RETRY_UNBUILT_S

    def __call__(self) -> None:
        if self.clock() >= self.retry_at:
            self.retry_at = self.clock() + RETRY_UNBUILT_S
            for tenant in self.processor.retry_unbuilt():
                logger.info("tenant %r: its scorer builds now; its interactions are scored from here on", tenant)
        for tenant in self.processor.settle_leaving():
            logger.info("tenant %r removed from the config %.0f s ago: its events are dead-lettered as unknown_tenant "
                        "from now on", tenant, self.processor.removal_grace_s)
        cfg = None if self.rereads is None else self.rereads.follow()
        if cfg is None or cfg is self.applied:  # not settled, or the file unchanged since it was applied
            return
        self.applied = cfg
        done = self.processor.follow(*_scorers(cfg))
        changes = [f"{what} {', '.join(names)}" for what, names in
                   (("added", done.added), ("scorer changed for", done.rescored), ("removed", done.removed),
                    (f"removed (its events still stored for {self.processor.removal_grace_s:g} s: serving may "
                     "still answer it)", done.leaving)) if names]
        if changes:
            logger.info("config re-read: %s", "; ".join(changes))
        said = set()
        for tenant in done.at_restart:
            said.add((tenant, ""))
            if (tenant, "") not in self.logged:
                logger.warning("tenant %r: its change in the config (from a scorer function to feedback, or removed) "
                               "takes effect when ingest starts again (feedback that waits for its interactions "
                               "is loaded then); until then it is scored as before", tenant)
        for tenant, error in done.errors.items():
            said.add((tenant, error))
            if (tenant, error) in self.logged:
                continue
            if tenant in done.added:
                logger.error("tenant %r: its scorer cannot be built (%s): %s", tenant, UNBUILT_MEANS, error)
            else:
                logger.error("tenant %r: its scorer cannot be built, so its change in the config is not applied until "
                             "it can (tried again every minute): %s", tenant, error)
        self.logged = said


def _at_restart(cfg: Config) -> tuple:
    """The settings ingest reads only when it starts."""
    return cfg.ingest, cfg.kafka, cfg.data_dir


def _scorers(cfg: Config) -> tuple[dict[str, str], dict[str, float]]:
    """The config's tenants' scorers and their time limits, as the Processor takes them."""
    return {t.name: t.scorer for t in cfg.tenants}, {t.name: t.scorer_time_limit_s for t in cfg.tenants}


def build(cfg: Config, metrics: IngestMetrics | None = None, *, member: int | None = None,
          config_file: Path | None = None) -> Ingest:
    """The Ingest loop the config describes; `member` K (of several in one group) marks itself ready as
    ingest-K and serves its metrics on ingest.metrics_port + K. `config_file`: the file `cfg` was read from,
    followed for its tenants while ingest runs (TenantFollower); None: nothing is followed."""
    scorers, time_limits = _scorers(cfg)
    processor = Processor(
        scorers,
        unknown_tenant=cfg.ingest.unknown_tenant,
        max_message_bytes=cfg.ingest.max_message_bytes,
        max_auto_tenants=cfg.ingest.max_auto_tenants,
        removal_grace_s=cfg.ingest.removed_tenant_grace_seconds,
        time_limits=time_limits,
        scoring_budget_s=cfg.ingest.max_batch_scoring_seconds,
    )
    rereads = None
    if config_file is not None:
        rereads = ConfigRereads(lambda: load_config(config_file), cfg, path=config_file, service="ingest",
                                at_restart=(_at_restart, "the [ingest] or [kafka] settings or data_dir"))
    follow = TenantFollower(rereads, processor, cfg)
    base = cfg.ingest.metrics_port
    if metrics is None:
        port = base + (member or 0) if base else 0
        setting = f"ingest.metrics_port {base} + member {member} (port {port})" if member else None
        metrics = IngestMetrics(port=port, host=cfg.ingest.metrics_host, setting=setting)
    return Ingest(
        root=str(cfg.data_dir),
        bootstrap=cfg.kafka.bootstrap,
        interactions_topic=cfg.kafka.interactions_topic,
        feedback_topic=cfg.kafka.feedback_topic,
        dead_letter_topic=cfg.kafka.dead_letter_topic,
        group_id=cfg.kafka.group_id,
        processor=processor,
        flush_rows=cfg.ingest.flush_rows,
        flush_seconds=cfg.ingest.flush_seconds,
        max_batch_bytes=cfg.ingest.max_batch_bytes,
        expiry_ms=int(cfg.ingest.pending_expiry_hours * 3_600_000),
        max_pending_per_tenant=cfg.ingest.max_pending_feedback_per_tenant,
        max_pending=cfg.ingest.max_pending_feedback,
        session_timeout_ms=cfg.kafka.session_timeout_ms,
        heartbeat_interval_ms=cfg.kafka.heartbeat_interval_ms,
        metrics=metrics,
        name=member_name(member),
        client_options=cfg.kafka.client_options(),
        follow=follow,
    )


def run(cfg: Config, *, once: bool = False, max_seconds: float | None = None, drain_on_stop: bool = False,
        member: int | None = None, config_file: Path | None = None) -> int:
    # Not threading.Events: their set() from a signal handler can deadlock against the main thread's wait().
    stop, drain = StopFlag(), StopFlag()

    def on_signal(signum: int, frame: object) -> None:
        if drain_on_stop and not drain.is_set():
            logger.info("ingest: draining the topics before stopping (signal again to stop now)")
            drain.set()
        else:
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        ingest = build(cfg, member=member, config_file=config_file)
    except (ScorerSpecError, MetricsPortError) as e:
        logger.error("clora ingest: %s", e)
        return 2
    # Before the clients: kafka-python's constructors block ~30 s on an unreachable bootstrap, deaf to
    # Ctrl-C, logging every attempt, and then raise. Within --max-seconds, which counts from here.
    started = time.monotonic()
    wait_s = KAFKA_WAIT_S if max_seconds is None else min(KAFKA_WAIT_S, max_seconds)
    why = wait_until_reachable(cfg.kafka.bootstrap, stop, wait_s)
    if stop.is_set():
        ingest.metrics.close()
        logger.info("ingest stopped before Kafka answered")
        return 0
    if why is not None:
        ingest.metrics.close()
        logger.error("clora ingest: cannot reach Kafka at %s (kafka.bootstrap) within %.0f s: %s; is the broker "
                     "running?", cfg.kafka.bootstrap, wait_s, why)
        return 2
    try:  # ingest sends its dead letters there: a cluster that creates no topic on first use would refuse them
        ensure_topics(cfg.kafka.bootstrap, [cfg.kafka.dead_letter_topic], cfg.kafka.partitions,
                      replication_factor=cfg.kafka.replication_factor, client=cfg.kafka.client_options())
    except Exception as e:  # noqa: BLE001 - kafka-python's errors, an ACL; the topic may exist or come later
        logger.warning("could not check the dead-letter topic %s at %s: %s; continuing (dead letters are in Parquet "
                       "either way)", cfg.kafka.dead_letter_topic, cfg.kafka.bootstrap, e)
    tune_runtime()
    try:
        left = None if max_seconds is None else max(0.0, max_seconds - (time.monotonic() - started))
        ingest.run(stop, once=once, max_seconds=left, drain=drain)
    except BrokerError as e:
        logger.error("clora ingest: %s", e)
        return 2
    finally:
        ingest.metrics.close()
    logger.info("ingest stopped")
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args

    cfg = config_from_args(args, writes_data_dir=True)
    return run(cfg, once=args.once, max_seconds=args.max_seconds, drain_on_stop=args.drain_on_stop, member=args.member,
               config_file=resolve_config_path(getattr(args, "config_path", None)))


def main(argv: list[str] | None = None) -> int:
    from clora.cli import common_parser, keep_the_current_directory_off_the_path
    from ingest.cli import add_ingest_arguments

    keep_the_current_directory_off_the_path()  # nothing there shadows clora or an installed module

    parser = argparse.ArgumentParser(
        prog="python -m ingest",
        parents=[common_parser()],
        description="Consume interaction and feedback events from Kafka into Parquet (same as `clora ingest`).",
    )
    add_ingest_arguments(parser)
    return run_from_args(parser.parse_args(argv))
