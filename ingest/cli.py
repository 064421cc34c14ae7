"""Command-line surface of the ingest package: `clora broker` (the embedded Kafka broker) and `clora ingest`.

Only argparse is imported here; the commands import their heavy modules when they run.
"""

from __future__ import annotations

import argparse

from clora.argtypes import non_negative_int, port, positive


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "broker",
        parents=[common],
        help="run the embedded Kafka-compatible broker (for tests, the demo and trials)",
        description="Starts the embedded Kafka-compatible broker, creates clora's topics and runs until "
        "Ctrl-C/SIGTERM. Topics live in memory: use a real Kafka cluster in production.",
    )
    p.add_argument("--host", default=None, help="address to bind (default: broker.host from the config, 127.0.0.1)")
    p.add_argument("--port", type=port, default=None, help="port to listen on (default: broker.port, 9092)")
    p.set_defaults(func=run_broker)

    p = sub.add_parser(
        "ingest",
        parents=[common],
        help="consume interaction and feedback events from Kafka into Parquet",
        description="Consumes clora's interaction and feedback topics into the data directory: validates, "
        "scores, joins feedback to interactions, dead-letters bad messages, commits offsets only after the "
        "Parquet write is durable. Run several (same kafka.group_id) to split the partitions.",
    )
    add_ingest_arguments(p)
    p.set_defaults(func=run_ingest)


def add_ingest_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `clora ingest`, shared with `python -m ingest`."""
    parser.add_argument(
        "--once", action="store_true", help="exit once every assigned partition is read to its end (tests, the demo)"
    )
    parser.add_argument("--max-seconds", type=positive, default=None, metavar="N", help="exit after N seconds")
    parser.add_argument(
        "--member", type=non_negative_int, default=None, metavar="K",
        help="this is ingest process K of several in one group (as `clora up` starts them with ingest.processes): "
        "it marks itself ready as ingest-K and serves its metrics on ingest.metrics_port + K",
    )
    parser.add_argument(
        "--drain-on-stop",
        action="store_true",
        help="on the first Ctrl-C/SIGTERM, read every assigned partition to its end before exiting (a second "
        "one stops at once); for brokers that keep topics in memory only, such as the embedded one",
    )


def member_name(member: int | None) -> str:
    """What an ingest process calls itself (its ready mark, `clora up`'s child): ingest, or ingest-K."""
    return "ingest" if member is None else f"ingest-{member}"


def run_ingest(args: argparse.Namespace) -> int:
    from ingest.process import run_from_args

    return run_from_args(args)


# Tansu's in-memory store keeps every message of every topic until the broker stops (it applies no retention):
# measured ~1 MB per 1,000 events of ~1 KB, so a broker fed 100 events/s grows by ~8 GB a day.
MEMORY_NOTE = ("note: the embedded broker keeps every event in memory until it stops (about 1 MB per 1,000 events "
               "of 1 KB; topic retention does not apply): for long runs use an external Kafka (broker.embedded = "
               "false, kafka.bootstrap)")


def run_broker(args: argparse.Namespace) -> int:
    import signal
    import sys

    from clora.cli import config_from_args
    from clora.up import StopFlag
    from ingest.broker import BrokerError, EmbeddedBroker

    cfg = config_from_args(args)
    broker = EmbeddedBroker(args.host or cfg.broker.host, args.port or cfg.broker.port)
    topics = [cfg.kafka.interactions_topic, cfg.kafka.feedback_topic, cfg.kafka.dead_letter_topic]
    stop = StopFlag()  # not a threading.Event: its set() in a handler can deadlock against the loop's wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        broker.start(topics, cfg.kafka.partitions)
    except BrokerError as e:
        print(f"clora broker: {e}", file=sys.stderr)
        return 1
    print(f"broker ready at {broker.bootstrap} (topics: {', '.join(topics)}); Ctrl-C to stop", flush=True)
    print(MEMORY_NOTE, flush=True)
    try:
        while not stop.wait(0.5):
            if broker.process is None or broker.process.poll() is not None:
                print("clora broker: the broker process exited unexpectedly", file=sys.stderr)
                return 1
    finally:
        broker.stop()
    print("broker stopped", flush=True)
    return 0
