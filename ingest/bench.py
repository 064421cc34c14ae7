"""`clora bench ingest`: Kafka -> Parquet ingest rate against a bare kafka-python consumer, and memory over a
10x longer stream.

    clora bench ingest --events 20000 --out bench-results

What it does, all in one run on one embedded broker it starts on a free port:
  1. produces --events realistic ~1 KB messages (chat interactions of 8 tenants with several scorers,
     feedback for 10% of them, 5% malformed) to fresh topics;
  2. --rounds times (default 3), on that same message set: (a) a bare kafka-python consumer reads them
     all (same fetch settings, no processing); (b) clora's Ingest (in this process, a fresh consumer
     group and data dir each round) decodes, scores, joins and writes them durably. Both rates are
     messages / (last record handled - first poll with partitions assigned), so connection and group
     join are left out and the first fetch is in; for ingest, "handled" means durable and committed.
     Alternating the two sides within one run exposes both to the same machine state; the table gives
     the median and the best round of each, and the ratio of the medians. Both run with the interpreter
     settings of `python -m ingest` (process.tune_runtime). Each side's process CPU time per message
     (all threads; the broker is another process) is reported too: on a shared machine it moves much
     less than the rates do. Targets: ingest >= 0.7 x bare, and >= 20,000 events/s. With --processes K
     (default 2), each round then also runs (c) K bare consumers, each reading every K-th partition, and
     (d) K clora ingest processes in one consumer group and one data dir, which is how ingest scales: all
     their messages over the union of their windows, once every process is ready (assigned, for ingest);
     CPU summed over them. The K ingest processes must write the same rows as one does;
  3. produces 10x as many to other topics and runs `python -m ingest --once` on the short and on the long
     stream, sampling each process's RSS (Linux /proc) every 0.2 s: memory must not grow with the stream.

Prints a table; writes ingest.json and ingest.png under --out. Timings on a shared machine are compared
as ratios within one run. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from clora.argtypes import int_between, positive_int
from clora.bench import BenchError
from ingest.events import FeedbackEvent, InteractionEvent, encode

logger = logging.getLogger(__name__)

TENANTS = {  # tenant -> scorer
    "acme": "digits",
    "globex": "feedback",
    "initech": "inline",
    "umbrella": "length:200",
    "hooli": "contains:sure",
    "stark": "json_valid",
    "wayne": "feedback",
    "wonka": "uppercase",
}
PARTITIONS = 4
ROW_KINDS = ("interactions", "trajectories", "feedback", "dead_letters")
WORDS = (
    "the model answer question tenant adapter learn reward user assistant data query result value "
    "context system prompt token batch stream kafka parquet feedback score quick brown fox lazy dog"
).split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=positive_int, default=20_000, help="messages in the rate test (default 20000)")
    parser.add_argument("--rss-factor", type=positive_int, default=10, help="the long stream is this many times longer (default 10)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="bare consumer / ingest rounds on the same messages (default 3)")
    parser.add_argument("--processes", type=int_between(0, 2 * PARTITIONS), default=2,
                        help="each round also runs this many bare consumers and this many ingest processes in one "
                             f"group (default 2, at most {2 * PARTITIONS}: one per partition of the two topics; 0 "
                             "leaves it out)")


# ---------------------------------------------------------------------------------------------------------
# Workload


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(n: int, seed: int = 0):
    """n Kafka messages as (topic kind, key, value): interactions, 10% feedback, 5% malformed."""
    rng = random.Random(seed)
    names = list(TENANTS)
    malformed = [  # one of each: the reasons show up by name in the results
        lambda i: b'{"type":"interaction","id":"req-%d","tenant":' % i,
        lambda i: b"\xff\xfe" + str(i).encode(),
        lambda i: json.dumps({"type": "interaction", "id": f"req-{i}", "ts": 0, "prompt": "p", "completion": "c"}).encode(),
        lambda i: json.dumps({"type": "click", "id": f"req-{i}", "tenant": "acme", "ts": 0}).encode(),
        lambda i: json.dumps({"type": "feedback", "id": f"req-{i}", "tenant": "acme", "ts": 0, "score": 5}).encode(),
    ]
    for i in range(n):
        tenant = names[i % len(names)]
        if i % 20 == 10:
            yield "interactions", tenant, malformed[(i // 20) % len(malformed)](i)
        elif i % 10 == 5:
            yield "feedback", tenant, encode(FeedbackEvent(id=f"req-{i - 5:09d}", tenant=tenant, score=rng.choice([-1.0, 0.5, 1.0]), source="thumbs"))
        else:
            ev = InteractionEvent(
                id=f"req-{i:09d}",
                tenant=tenant,
                messages=[
                    {"role": "system", "content": "You are a helpful assistant for " + tenant + "."},
                    {"role": "user", "content": _text(rng, 40)},
                ],
                completion=_text(rng, 70) + f" {rng.randint(0, 10**6)}",
                adapter_version=f"{tenant}@{rng.randint(1, 9)}",
                reward=rng.random() if tenant == "initech" else None,
                metadata={"app": "bench", "latency_ms": rng.randint(20, 900), "model": tenant},
            )
            yield "interactions", tenant, encode(ev)


def produce(bootstrap: str, topics: dict[str, str], n: int, seed: int) -> int:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=512 * 1024, acks=1)
    size = 0
    for kind, tenant, value in workload(n, seed):
        producer.send(topics[kind], key=tenant.encode(), value=value)
        size += len(value)
    producer.flush()
    producer.close()
    return size


# ---------------------------------------------------------------------------------------------------------
# The two consumers


def bare_consumer(bootstrap: str, topics: list[str], *, share: tuple[int, int] = (0, 1), start=None) -> dict:
    """Reads every message of the topics' partitions (of every `share[1]`-th partition from the
    `share[0]`-th, when several consumers split them) to the end offsets. `start`, when given, is called
    once the consumer is ready and before its window opens (the processes' barrier)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        max_poll_records=5000,
        fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    k, of = share
    partitions = [TopicPartition(t, p) for t in topics for p in range(PARTITIONS)][k::of]
    consumer.assign(partitions)
    consumer.seek_to_beginning()
    for tp in partitions:  # metadata, connections and offset resets before the window, as ingest's group join is
        consumer.position(tp)
    n = sum(consumer.end_offsets(partitions).values()) - sum(consumer.beginning_offsets(partitions).values())
    if start is not None:
        start()
    got = 0
    first, first_cpu = time.monotonic(), time.process_time()
    deadline = first + 600
    while got < n and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500, max_records=5000).values():
            got += len(records)
    last, last_cpu = time.monotonic(), time.process_time()
    consumer.close()
    return {"messages": got, "seconds": last - first, "rate": got / (last - first), "cpu_us": (last_cpu - first_cpu) / got * 1e6,
            "window": (first, last), "cpu_s": last_cpu - first_cpu}


def clora_ingest(bootstrap: str, topics: dict[str, str], root: Path, *, group_id: str | None = None, start=None) -> dict:
    """clora's Ingest in this process, `--once` on the topics into `root`. With `group_id`, one member of
    that group (others may share `root`); `start`, when given, is called once this member is in the group
    with its partitions and before its window opens (the processes' barrier)."""
    from ingest.batch import Processor
    from ingest.consumer import Ingest
    from ingest.metrics import IngestMetrics

    class Member(Ingest):
        def _mark_ready(self) -> None:
            if start is not None:
                start()
            super()._mark_ready()

    metrics = IngestMetrics()
    ingest = Member(
        root=str(root),
        bootstrap=bootstrap,
        interactions_topic=topics["interactions"],
        feedback_topic=topics["feedback"],
        dead_letter_topic=topics["dead"],
        group_id=group_id or f"bench-{os.getpid()}-{time.time_ns()}",
        processor=Processor(TENANTS, unknown_tenant="create", max_message_bytes=1_000_000),
        flush_rows=5000,
        flush_seconds=1.0,
        expiry_ms=72 * 3_600_000,
        session_timeout_ms=6000,
        heartbeat_interval_ms=2000,
        metrics=metrics,
    )
    ingest.run(threading.Event(), once=True, max_seconds=600)
    messages = metrics.total["messages"]
    if not messages:  # a group member left without partitions
        return {"messages": 0, "seconds": 0.0, "rate": 0.0, "cpu_us": 0.0, "window": None, "cpu_s": 0.0,
                "rows": {d: 0 for d in ROW_KINDS}, "dead_letter_reasons": {}}
    seconds = ingest.last_flush_at - ingest.assigned_at
    cpu = ingest.last_flush_cpu - ingest.assigned_cpu
    return {
        "messages": messages,
        "seconds": seconds,
        "rate": messages / seconds,
        "cpu_us": cpu / messages * 1e6,
        "window": (ingest.assigned_at, ingest.last_flush_at),
        "cpu_s": cpu,
        "rows": {d: metrics.total[d] for d in ROW_KINDS},
        "dead_letter_reasons": dict(metrics.reasons),
    }


# ---------------------------------------------------------------------------------------------------------
# Several processes


def _member(side: str, k: int, of: int, bootstrap: str, topics: dict[str, str], root: str, group_id: str,
            barrier, ready, go, results) -> None:
    """One benchmark process: imports, says it is ready, waits for the go, runs its side once."""
    from ingest.process import tune_runtime

    tune_runtime()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    together = [True]

    def start() -> None:  # every member ready (assigned) before any window opens
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            together[0] = False
            logger.warning("bench: %s process %d went on without the others (the barrier timed out)", side, k)

    try:
        import kafka  # noqa: F401  (imported before the go, so import time is not in anyone's window)

        import ingest.consumer  # noqa: F401

        ready.put(k)
        go.wait(timeout=120)
        if side == "bare":
            result = bare_consumer(bootstrap, [topics["interactions"], topics["feedback"]], share=(k, of), start=start)
        else:
            result = clora_ingest(bootstrap, topics, Path(root), group_id=group_id, start=start)
        results.put((k, {**result, "together": together[0]}, None))
    except BaseException as e:  # reported to the parent, which raises it
        results.put((k, None, f"{type(e).__name__}: {e}"))


def in_processes(side: str, processes: int, bootstrap: str, topics: dict[str, str], root: Path) -> dict:
    """Runs `processes` bare consumers (side "bare", each reading its share of the partitions) or clora
    ingest processes (side "ingest", one consumer group, one data dir) at once. The rate is all their
    messages over the union of their windows; CPU is summed over them."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    barrier, ready, go, results = ctx.Barrier(processes), ctx.Queue(), ctx.Event(), ctx.Queue()
    group_id = f"bench-{side}-{os.getpid()}-{time.time_ns()}"
    procs = [
        ctx.Process(target=_member, args=(side, k, processes, bootstrap, topics, str(root), group_id, barrier, ready, go, results),
                    name=f"bench-{side}-{k}")
        for k in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        got: dict[int, dict] = {}
        deadline = time.monotonic() + 600
        while len(got) < processes:
            try:
                k, result, error = results.get(timeout=1)
            except queue.Empty:
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode]
                if dead or time.monotonic() > deadline:
                    raise BenchError(f"benchmark processes {', '.join(dead) or 'timed out'}") from None
                continue
            if error is not None:
                raise BenchError(f"benchmark process {side} {k}: {error}")
            got[k] = result
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    members = [got[k] for k in range(processes)]
    windows = [m["window"] for m in members if m["window"] is not None]
    messages = sum(m["messages"] for m in members)
    seconds = max(w[1] for w in windows) - min(w[0] for w in windows)
    combined = {
        "messages": messages,
        "seconds": seconds,
        "rate": messages / seconds,
        "cpu_us": sum(m["cpu_s"] for m in members) / messages * 1e6,
        "members": [{key: m[key] for key in ("messages", "seconds", "rate", "cpu_us")} for m in members],
        # False when a member's window opened without the others (the barrier timed out): the windows do not
        # line up, and a rebalance inside them may have counted a replayed batch twice.
        "synchronised": all(m["together"] for m in members),
    }
    if side == "ingest":
        combined["rows"] = {d: sum(m["rows"][d] for m in members) for d in ROW_KINDS}
    return combined


# ---------------------------------------------------------------------------------------------------------
# Memory over a long stream


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def rss_run(bootstrap: str, topics: dict[str, str], workdir: Path, name: str) -> dict:
    """Runs `python -m ingest --once` on the topics; samples its RSS every 0.2 s."""
    config = workdir / f"{name}.toml"
    config.write_text(
        "\n".join(
            [
                f'data_dir = "{workdir / name}"',
                'log_level = "WARNING"',
                "[kafka]",
                f'bootstrap = "{bootstrap}"',
                f'interactions_topic = "{topics["interactions"]}"',
                f'feedback_topic = "{topics["feedback"]}"',
                f'dead_letter_topic = "{topics["dead"]}"',
                f'group_id = "bench-rss-{name}-{time.time_ns()}"',
                *[f'[[tenants]]\nname = "{t}"\napi_key = "bench-key-{t}"\nscorer = "{s}"' for t, s in TENANTS.items()],
            ]
        )
        + "\n"
    )
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "ingest", "--config", str(config), "--once"], env=env)
    samples = []
    while proc.poll() is None:
        rss = _rss_mb(proc.pid)
        if rss is not None:
            samples.append((round(time.monotonic() - started, 2), round(rss, 1)))
        time.sleep(0.2)
    if proc.returncode != 0:
        raise BenchError(f"python -m ingest exited with {proc.returncode} on the {name} stream")
    return {"samples": samples, "peak_mb": max(r for _, r in samples), "seconds": time.monotonic() - started}


# ---------------------------------------------------------------------------------------------------------


def _summary(rounds: list[dict]) -> dict:
    rates = [r["rate"] for r in rounds]
    return {
        "rounds": rounds,
        "rate": statistics.median(rates),
        "best": max(rates),
        "worst": min(rates),
        "cpu_us": statistics.median(r["cpu_us"] for r in rounds),
    }


def run(args: argparse.Namespace) -> int:
    from ingest.broker import EmbeddedBroker, ensure_topics, free_port
    from ingest.process import tune_runtime

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n, factor = args.events, args.rss_factor
    short = {"interactions": "bench.short.i", "feedback": "bench.short.f", "dead": "bench.short.d"}
    long = {"interactions": "bench.long.i", "feedback": "bench.long.f", "dead": "bench.long.d"}
    tune_runtime()  # both sides run as `python -m ingest` would
    with EmbeddedBroker("127.0.0.1", free_port()) as broker, tempfile.TemporaryDirectory(prefix="clora-bench-") as tmp:
        broker.start()
        ensure_topics(broker.bootstrap, [*short.values(), *long.values()], PARTITIONS)
        t = time.monotonic()
        size = produce(broker.bootstrap, short, n, seed=0)
        print(f"produced {n} messages ({size / n:.0f} bytes each on average) in {time.monotonic() - t:.1f}s", flush=True)
        bare_rounds, ingest_rounds, bare_k_rounds, ingest_k_rounds = [], [], [], []
        K = args.processes
        for i in range(args.rounds):
            bare_rounds.append(bare_consumer(broker.bootstrap, [short["interactions"], short["feedback"]]))
            ingest_rounds.append(clora_ingest(broker.bootstrap, short, Path(tmp) / f"rate-{i}"))
            line = (f"round {i + 1}: bare consumer {bare_rounds[-1]['rate']:.0f} messages/s, "
                    f"clora ingest {ingest_rounds[-1]['rate']:.0f} messages/s")
            if K:
                bare_k_rounds.append(in_processes("bare", K, broker.bootstrap, short, Path(tmp) / f"bare-{i}"))
                ingest_k_rounds.append(in_processes("ingest", K, broker.bootstrap, short, Path(tmp) / f"group-{i}"))
                line += (f"; {K} bare consumers {bare_k_rounds[-1]['rate']:.0f}, "
                         f"{K} ingest processes {ingest_k_rounds[-1]['rate']:.0f}")
            print(line, flush=True)
        bare, ingest = _summary(bare_rounds), _summary(ingest_rounds)
        produce(broker.bootstrap, long, n * factor, seed=1)
        rss_short = rss_run(broker.bootstrap, short, Path(tmp), "short")
        rss_long = rss_run(broker.bootstrap, long, Path(tmp), "long")

    ratio = ingest["rate"] / bare["rate"]
    last = ingest_rounds[-1]
    result = {
        "events": n,
        "mean_message_bytes": size / n,
        "bare_consumer": bare,
        "clora_ingest": ingest,
        "ratio": ratio,
        "round_ratios": [i["rate"] / b["rate"] for b, i in zip(bare_rounds, ingest_rounds)],
        "targets": {"ratio": 0.7, "events_per_s": 20_000},
        "meets_ratio": ratio >= 0.7,
        "meets_rate": ingest["rate"] >= 20_000,
        "rss": {"short": {"events": n, **rss_short}, "long": {"events": n * factor, **rss_long}},
        "cpus": os.cpu_count(),
        "processes": K,
    }
    if K:
        bare_k, ingest_k = _summary(bare_k_rounds), _summary(ingest_k_rounds)
        result.update(
            bare_consumers=bare_k,
            clora_ingest_processes=ingest_k,
            processes_ratio=ingest_k["rate"] / bare["rate"],
            processes_round_ratios=[g["rate"] / b["rate"] for b, g in zip(bare_rounds, ingest_k_rounds)],
            processes_rows_match=all(g["rows"] == r["rows"] for g, r in zip(ingest_k_rounds, ingest_rounds)),
            processes_synchronised=all(r["synchronised"] for r in bare_k_rounds + ingest_k_rounds),
        )
    (out / "ingest.json").write_text(json.dumps(result, indent=2))
    _plot(result, out / "ingest.png")

    print()
    print(f"{'':28}{'median msg/s':>14}{'best':>10}{'worst':>10}{'CPU us/msg':>12}")
    sides = [("bare kafka-python consumer", bare), ("clora ingest -> Parquet", ingest)]
    if K:
        sides += [(f"{K} bare consumers", result["bare_consumers"]), (f"{K} clora ingest processes", result["clora_ingest_processes"])]
    for name, side in sides:
        print(f"{name:28}{side['rate']:>14.0f}{side['best']:>10.0f}{side['worst']:>10.0f}{side['cpu_us']:>12.1f}")
    print(f"ratio of medians ingest / bare: {ratio:.2f} (target 0.70: {'met' if result['meets_ratio'] else 'NOT met'}); "
          f"per round: {', '.join(f'{r:.2f}' for r in result['round_ratios'])}; "
          f"rate target 20000/s: {'met' if result['meets_rate'] else 'NOT met'}")
    if K:
        print(f"{K} ingest processes in one group / one bare consumer: {result['processes_ratio']:.2f} "
              f"(per round: {', '.join(f'{r:.2f}' for r in result['processes_round_ratios'])}); "
              f"{K} processes / one: {result['clora_ingest_processes']['rate'] / ingest['rate']:.2f}x; "
              f"rows the same as one process's: {'yes' if result['processes_rows_match'] else 'NO'}")
        if not result["processes_synchronised"]:
            print("warning: in some round a process's window opened without the others (logged above): its "
                  "rates with several processes are not comparable")
    print(f"rows (last round): {last['rows']}; dead letters by reason: {last['dead_letter_reasons']}")
    print(f"peak RSS of python -m ingest: {rss_short['peak_mb']:.0f} MB over {n} events, "
          f"{rss_long['peak_mb']:.0f} MB over {n * factor} events")
    print(f"wrote {out / 'ingest.json'} and {out / 'ingest.png'}")
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["bare consumer", "clora ingest"]
    sides = [result["bare_consumer"], result["clora_ingest"]]
    if result.get("processes"):
        names += [f"{result['processes']} bare", f"{result['processes']} ingest"]
        sides += [result["bare_consumers"], result["clora_ingest_processes"]]
    rates = [side["rate"] for side in sides]
    spread = [[side["rate"] - side["worst"] for side in sides], [side["best"] - side["rate"] for side in sides]]
    ax1.bar(names, rates, yerr=spread, capsize=6, color=["#999999", "#1f77b4", "#cccccc", "#6baed6"][: len(names)])
    ax1.axhline(0.7 * rates[0], color="red", linestyle="--", label="0.7 x bare")
    ax1.axhline(20_000, color="orange", linestyle=":", label="20,000/s")
    ax1.set_ylabel(f"messages / s (median, best-worst of {len(sides[0]['rounds'])} rounds)")
    ax1.set_title(f"{result['events']} messages of ~{result['mean_message_bytes']:.0f} B")
    ax1.legend()
    for key in ("short", "long"):
        r = result["rss"][key]
        xs, ys = zip(*r["samples"]) if r["samples"] else ((), ())
        ax2.plot(xs, ys, label=f"{r['events']} events (peak {r['peak_mb']:.0f} MB)")
    ax2.set_xlabel("seconds since start")
    ax2.set_ylabel("RSS (MB)")
    ax2.set_title("python -m ingest --once: memory")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
