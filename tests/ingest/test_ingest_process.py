"""`python -m ingest` against the real broker: exactly once under SIGKILL, the feedback join across
restarts, and two processes sharing one consumer group.

Each test uses its own topics and consumer group (so tests never see each other's events) and runs the
ingest process as a subprocess with a temporary config file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from ingest.broker import ensure_topics
from ingest.events import FeedbackEvent, InteractionEvent, encode
from storage.parquet import read_dataset

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 4


class Setup:
    """Topics, a group and a config file for one test; starts ingest processes and stops them by pid."""

    def __init__(self, broker, tmp_path: Path, data_dir: Path, *, flush_rows=500, flush_seconds=0.3, tenants=()):
        tag = uuid.uuid4().hex[:8]
        self.bootstrap = broker.bootstrap
        self.interactions, self.feedback, self.dead = f"t-{tag}.i", f"t-{tag}.f", f"t-{tag}.d"
        self.group = f"g-{tag}"
        ensure_topics(self.bootstrap, [self.interactions, self.feedback, self.dead], PARTITIONS)
        self.data_dir = data_dir
        self.tmp = tmp_path
        self.tenants = tenants
        self.config = tmp_path / "clora.toml"
        self.write_config(flush_rows, flush_seconds)
        self.producer = KafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=10)
        self.procs: list[subprocess.Popen] = []

    def write_config(self, flush_rows: int, flush_seconds: float) -> None:
        lines = [
            f'data_dir = "{self.data_dir}"',
            "[kafka]",
            f'bootstrap = "{self.bootstrap}"',
            f'interactions_topic = "{self.interactions}"',
            f'feedback_topic = "{self.feedback}"',
            f'dead_letter_topic = "{self.dead}"',
            f'group_id = "{self.group}"',
            "[ingest]",
            f"flush_rows = {flush_rows}",
            f"flush_seconds = {flush_seconds}",
        ]
        for name, scorer in self.tenants:
            lines += ["[[tenants]]", f'name = "{name}"', f'api_key = "key-{name}-0123"', f'scorer = "{scorer}"']
        self.config.write_text("\n".join(lines) + "\n")

    def send(self, event_or_bytes, tenant=None, topic=None):
        if isinstance(event_or_bytes, bytes):
            value, key, topic = event_or_bytes, (tenant or "x").encode(), topic or self.interactions
        else:
            value, key = encode(event_or_bytes), event_or_bytes.tenant.encode()
            topic = self.feedback if isinstance(event_or_bytes, FeedbackEvent) else self.interactions
        return self.producer.send(topic, key=key, value=value)

    def start(self, *args: str, name="ingest") -> subprocess.Popen:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 (closed by the child's end)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ingest", "--config", str(self.config), *args],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        proc.log_path = Path(log.name)
        log.close()
        self.procs.append(proc)
        return proc

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.producer.close()

    def count(self, dataset: str) -> int:
        return read_dataset(self.data_dir, dataset).num_rows


def wait_for(condition, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"ingest exited with {p.returncode} while waiting for {what}:\n{p.log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assignments(proc) -> list[str]:
    return [line.split("assigned partitions ")[1].strip() for line in proc.log_path.read_text().splitlines() if "assigned partitions" in line]


@pytest.fixture
def setup_factory(broker, tmp_path, data_dir):
    made = []

    def make(**kw):
        s = Setup(broker, tmp_path, data_dir, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop_all()


def read_topic(bootstrap: str, topic: str) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    consumer.assign(tps)
    consumer.seek_to_beginning()
    ends = consumer.end_offsets(tps)
    got = []
    deadline = time.monotonic() + 60
    # To the end offsets, then on until a poll comes back empty: the embedded broker's end offset can lag
    # records it has acknowledged (seen after a producer was SIGKILLed mid-send while another wrote to the
    # same partition), and those records are fetched all the same.
    while True:
        assert time.monotonic() < deadline, f"could not read {topic} to its end offsets {ends} within 60 s"
        polled = consumer.poll(500)
        for records in polled.values():
            got.extend(records)
        if not polled and all(consumer.position(tp) >= ends[tp] for tp in tps):
            break
    consumer.close()
    return got


# ---------------------------------------------------------------------------------------------------------


MALFORMED = [
    (lambda i: f"not json {i}".encode(), "not_json"),
    (lambda i: b"\xff\xfe" + str(i).encode(), "not_utf8"),
    (lambda i: json.dumps({"type": "interaction", "id": f"m{i}", "ts": 0, "prompt": "p", "completion": "c"}).encode(), "missing_tenant"),
    (lambda i: json.dumps({"type": "click", "id": f"m{i}", "tenant": "acme", "ts": 0}).encode(), "unknown_type"),
    (lambda i: json.dumps({"type": "interaction", "id": f"m{i}", "tenant": "acme", "ts": 0, "prompt": "p"}).encode(), "missing_completion"),
]


def test_exactly_once_with_sigkill_at_three_random_moments(setup_factory):
    s = setup_factory(flush_rows=300, flush_seconds=0.2, tenants=[("acme", "digits"), ("beta", "feedback")])
    rng = random.Random(os.environ.get("CLORA_TEST_SEED", "ingest-sigkill"))
    tenants = ["acme", "beta", "gamma", "delta", "eps", "zeta"]
    valid: set[tuple[str, str]] = set()
    malformed: dict[bytes, str] = {}
    for i in range(20_000):
        if i % 20 == 7:
            make, why = MALFORMED[(i // 20) % len(MALFORMED)]
            value = make(i)
            malformed[value] = why
            s.send(value, tenant=tenants[i % 6])
        else:
            tenant = tenants[i % 6]
            s.send(InteractionEvent(id=f"req-{i}", tenant=tenant, prompt=f"question {i}", completion=f"answer {i % 97} {'x' * 700}"))
            valid.add((tenant, f"req-{i}"))
    s.producer.flush()
    assert len(malformed) == 1000 and len(valid) == 19_000
    assert len(set(malformed.values())) == len(MALFORMED)

    for round_ in range(3):
        # Another batch size each time: replays then cut the offsets differently, so the file names differ
        # and only the (tenant, id) / offset indexes stand between a replay and a duplicate.
        s.write_config(flush_rows=rng.choice([97, 163, 251, 307]), flush_seconds=0.2)
        proc = s.start()
        wait_for(lambda: assignments(proc), 60, "a partition assignment", [proc])
        before = s.count("interactions")
        time.sleep(rng.uniform(0.3, 2.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        print(f"kill {round_}: interactions {before} -> {s.count('interactions')}")

    s.write_config(flush_rows=500, flush_seconds=0.2)
    proc = s.start("--once")
    assert proc.wait(timeout=120) == 0, proc.log_path.read_text()[-3000:]

    inter = read_dataset(s.data_dir, "interactions")
    keys = list(zip(inter.column("tenant").to_pylist(), inter.column("id").to_pylist()))
    assert len(keys) == len(set(keys)) == 19_000
    assert set(keys) == valid
    traj = read_dataset(s.data_dir, "trajectories")
    tkeys = list(zip(traj.column("tenant").to_pylist(), traj.column("id").to_pylist()))
    assert len(tkeys) == len(set(tkeys)) == sum(1 for t, _ in valid if t == "acme")  # digits scores every acme event
    dead = read_dataset(s.data_dir, "dead_letters")
    got = dict(zip(dead.column("raw").to_pylist(), dead.column("reason").to_pylist()))
    assert dead.num_rows == len(got) == 1000
    assert_same_reasons(got, malformed, "dead_letters/")
    # The dead-letter topic is at least once: every malformed message is there, with its reason.
    dlq = {r.value: dict(r.headers)["clora.reason"].decode() for r in read_topic(s.bootstrap, s.dead)}
    assert_same_reasons(dlq, malformed, "the dead-letter topic")


def assert_same_reasons(got: dict, expected: dict, where: str):
    wrong = {raw: (reason, got.get(raw)) for raw, reason in expected.items() if got.get(raw) != reason}
    extra = set(got) - set(expected)
    assert not wrong and not extra, (
        f"{where}: {len(wrong)} malformed messages missing or with another reason, e.g. "
        f"{list(wrong.items())[:3]}; {len(extra)} unexpected, e.g. {list(extra)[:3]}"
    )


def test_feedback_before_after_and_across_a_restart(setup_factory):
    s = setup_factory(flush_rows=100, flush_seconds=0.2, tenants=[("acme", "feedback")])
    proc = s.start()
    wait_for(lambda: assignments(proc), 60, "a partition assignment", [proc])

    def rows(dataset, id_):
        t = read_dataset(s.data_dir, dataset)
        return [r for r in t.to_pylist() if r["id"] == id_]

    # Feedback before its interaction; feedback keyed by another tenant is a dead letter, not a join.
    s.producer.send(s.feedback, key=b"other", value=encode(FeedbackEvent(id="before", tenant="acme", score=0.25)))
    s.send(FeedbackEvent(id="before", tenant="acme", score=-0.5))
    s.producer.flush()
    wait_for(lambda: rows("feedback", "before"), 30, "the early feedback row", [proc])
    s.send(InteractionEvent(id="before", tenant="acme", prompt="p", completion="c"))
    # Feedback after its interaction.
    s.send(InteractionEvent(id="after", tenant="acme", prompt="p", completion="c"))
    s.producer.flush()
    wait_for(lambda: rows("interactions", "after"), 30, "the interaction row", [proc])
    s.send(FeedbackEvent(id="after", tenant="acme", score=0.75, source="thumbs"))
    # Feedback after an ingest restart.
    s.send(InteractionEvent(id="restart", tenant="acme", prompt="p", completion="c"))
    s.producer.flush()
    wait_for(lambda: rows("trajectories", "after") and rows("interactions", "restart"), 30, "the second join", [proc])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    s.send(FeedbackEvent(id="restart", tenant="acme", score=1.0))
    s.send(FeedbackEvent(id="after", tenant="acme", score=-1.0))  # a later score does not replace the first
    s.producer.flush()
    proc = s.start("--once")
    assert proc.wait(timeout=90) == 0, proc.log_path.read_text()[-3000:]

    traj = read_dataset(s.data_dir, "trajectories").to_pylist()
    got = sorted((r["id"], r["reward"], r["reward_source"]) for r in traj)
    assert got == [("after", 0.75, "thumbs"), ("before", -0.5, "feedback"), ("restart", 1.0, "feedback")]
    assert s.count("feedback") == 4
    (dead,) = read_dataset(s.data_dir, "dead_letters").to_pylist()
    assert (dead["tenant"], dead["reason"], dead["detail"]) == ("acme", "key_mismatch", "message key 'other' is not the tenant 'acme'")


def test_two_processes_share_the_group_and_survive_a_kill(setup_factory):
    s = setup_factory(flush_rows=200, flush_seconds=0.2, tenants=[("t0", "digits")])
    a, b = s.start(name="a"), s.start(name="b")

    def both_assigned():
        la, lb = assignments(a), assignments(b)
        return la and lb and la[-1] != "none" and lb[-1] != "none"

    wait_for(both_assigned, 60, "both processes to hold partitions", [a, b])
    first_a, first_b = set(assignments(a)[-1].split(",")), set(assignments(b)[-1].split(","))
    assert not first_a & first_b and len(first_a | first_b) == 2 * PARTITIONS

    tenants = [f"t{i}" for i in range(16)]
    expected = set()
    stop_producing = threading.Event()

    def produce():
        for i in range(6000):
            tenant = tenants[i % len(tenants)]
            s.send(InteractionEvent(id=f"r{i}", tenant=tenant, prompt="p", completion=f"{i} {'y' * 300}"))
            expected.add((tenant, f"r{i}"))
            if i % 200 == 199:
                s.producer.flush()
                time.sleep(0.1)
        s.producer.flush()
        stop_producing.set()

    producer = threading.Thread(target=produce)
    producer.start()
    wait_for(lambda: s.count("interactions") >= 1500, 60, "progress before the kill", [a, b])
    a.send_signal(signal.SIGKILL)
    a.wait()
    producer.join()
    wait_for(lambda: s.count("interactions") >= 6000, 90, "the survivor to finish", [b])
    time.sleep(1.0)  # anything still in flight would show up as a duplicate
    b.send_signal(signal.SIGTERM)
    assert b.wait(timeout=30) == 0
    assert set(assignments(b)[-1].split(",")) == first_a | first_b  # the survivor took every partition

    inter = read_dataset(s.data_dir, "interactions")
    keys = list(zip(inter.column("tenant").to_pylist(), inter.column("id").to_pylist()))
    assert len(keys) == len(set(keys)) and set(keys) == expected
    traj = read_dataset(s.data_dir, "trajectories")
    tkeys = list(zip(traj.column("tenant").to_pylist(), traj.column("id").to_pylist()))
    assert len(tkeys) == len(set(tkeys)) == sum(1 for t, _ in expected if t == "t0")


def test_drain_on_stop_reads_everything_before_exiting(setup_factory):
    s = setup_factory(flush_rows=200, flush_seconds=0.2)
    for i in range(4000):
        s.send(InteractionEvent(id=f"r{i}", tenant=f"t{i % 5}", prompt="p", completion="c" * 500))
    s.producer.flush()
    proc = s.start("--drain-on-stop")
    wait_for(lambda: assignments(proc), 60, "a partition assignment", [proc])
    proc.send_signal(signal.SIGTERM)  # at once: without draining, most events would still be unread
    assert proc.wait(timeout=60) == 0, proc.log_path.read_text()[-3000:]
    assert "drained" in proc.log_path.read_text()
    assert s.count("interactions") == 4000


def test_max_seconds_stops_the_process_on_its_own(setup_factory):
    """`clora ingest --max-seconds N`: consumes, then exits 0 once N seconds have passed (no signal, no --once)."""
    s = setup_factory(flush_rows=100, flush_seconds=0.2)
    proc = s.start("--max-seconds", "3")
    try:
        code = proc.wait(timeout=60)  # a deadline that is ignored: still consuming a minute later
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running long after --max-seconds 3:\n{proc.log_path.read_text()[-3000:]}") from None
    log = proc.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "--max-seconds reached" in log and "ingest stopped" in log
