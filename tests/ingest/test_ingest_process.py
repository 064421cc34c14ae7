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
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from ingest.broker import ensure_topics
from ingest.events import FeedbackEvent, InteractionEvent, encode
from storage.files import ready_pid
from storage.layout import DataDir
from storage.parquet import live_rows, read_dataset

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 4


class Setup:
    """Topics, a group and a config file for one test; starts ingest processes and stops them by pid."""

    def __init__(self, broker, tmp_path: Path, data_dir: Path, *, flush_rows=500, flush_seconds=0.3, tenants=(),
                 max_message_bytes=None, ingest_settings=()):
        tag = uuid.uuid4().hex[:8]
        self.bootstrap = broker.bootstrap
        self.interactions, self.feedback, self.dead = f"t-{tag}.i", f"t-{tag}.f", f"t-{tag}.d"
        self.group = f"g-{tag}"
        ensure_topics(self.bootstrap, [self.interactions, self.feedback, self.dead], PARTITIONS)
        self.data_dir = data_dir
        self.tmp = tmp_path
        self.tenants = tenants
        self.max_message_bytes = max_message_bytes
        self.ingest_settings = ingest_settings  # more [ingest] lines
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
        if self.max_message_bytes is not None:
            lines.append(f"max_message_bytes = {self.max_message_bytes}")
        lines += self.ingest_settings
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
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(self.tmp)])},  # tmp: a test's scorer module
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


MAX_MESSAGE_BYTES = 8192  # the valid events are ~0.8 KB; a too_large one is ~9 KB

# (message for number i, its reason, the key its dead letter gets: the tenant, when a configured one is named)
MALFORMED = [
    (lambda i: f"not json {i}".encode(), "not_json", "_unknown"),
    (lambda i: b"\xff\xfe" + str(i).encode(), "not_utf8", "_unknown"),
    (lambda i: json.dumps({"type": "interaction", "id": f"m{i}", "ts": 0, "prompt": "p", "completion": "c"}).encode(), "missing_tenant", "_unknown"),
    (lambda i: json.dumps({"type": "click", "id": f"m{i}", "tenant": "acme", "ts": 0}).encode(), "unknown_type", "acme"),
    (lambda i: json.dumps({"type": "interaction", "id": f"m{i}", "tenant": "acme", "ts": 0, "prompt": "p"}).encode(), "missing_completion", "acme"),
    (lambda i: json.dumps({"type": "interaction", "id": f"m{i}", "tenant": "acme", "prompt": "p", "completion": "z" * 9000}).encode(),
     "too_large", "_unknown"),
]
RAW_PREFIX = 4096  # what is kept of a too_large message (README, "Dead letters")


class Malformed(NamedTuple):
    value: bytes
    reason: str
    key: str


def test_exactly_once_with_sigkill_at_three_random_moments(setup_factory):
    s = setup_factory(flush_rows=300, flush_seconds=0.2, tenants=[("acme", "digits"), ("beta", "feedback")],
                      max_message_bytes=MAX_MESSAGE_BYTES)
    rng = random.Random(os.environ.get("CLORA_TEST_SEED", "ingest-sigkill"))
    tenants = ["acme", "beta", "gamma", "delta", "eps", "zeta"]
    messages: list[tuple[bytes, str, Malformed | None]] = []  # (value, key, what its dead letter must be)
    for i in range(20_000):
        tenant = tenants[i % 6]
        if i % 20 == 7:
            make, why, dl_key = MALFORMED[(i // 20) % len(MALFORMED)]
            messages.append((make(i), tenant, Malformed(make(i), why, dl_key)))
        else:
            event = InteractionEvent(id=f"req-{i}", tenant=tenant, prompt=f"question {i}", completion=f"answer {i % 97} {'x' * 700}")
            messages.append((encode(event), tenant, None))
    valid = {(key, json.loads(value)["id"]) for value, key, bad in messages if bad is None}
    assert len(valid) == 19_000 and sum(1 for *_, bad in messages if bad) == 1000
    assert {bad.reason for *_, bad in messages if bad} == {why for _, why, _ in MALFORMED}

    # Four slices: one produced during each of three ingest processes, each SIGKILLed while its slice is still
    # coming in; the last one read by `--once`.
    slices = [messages[k * 5000:(k + 1) * 5000] for k in range(4)]
    sources: dict[str, Malformed] = {}  # "topic:partition:offset" of each malformed message

    def produce(part, paced: bool):
        futures = []
        for n, (value, key, bad) in enumerate(part):
            future = s.send(value, tenant=key)
            if bad is not None:
                futures.append((future, bad))
            if paced and n % 100 == 99:  # ~2,000 messages a second: a slice takes 2.5 s or more
                s.producer.flush()
                time.sleep(0.05)
        s.producer.flush()
        for future, bad in futures:
            meta = future.get(timeout=30)
            sources[f"{meta.topic}:{meta.partition}:{meta.offset}"] = bad

    def stored() -> int:
        return live_rows(s.data_dir, "interactions")

    produced_valid = 0
    for round_, part in enumerate(slices[:3]):
        # Another batch size each time: replays then cut the offsets differently, so the file names differ
        # and only the (tenant, id) / offset indexes stand between a replay and a duplicate.
        s.write_config(flush_rows=rng.choice([97, 163, 251, 307]), flush_seconds=0.2)
        proc = s.start()
        wait_for(lambda: assignments(proc), 60, "a partition assignment", [proc])
        before = stored()
        producer = threading.Thread(target=produce, args=(part, True))
        producer.start()
        try:
            wait_for(lambda: stored() > before, 60, "ingest to store part of the slice", [proc])
            time.sleep(rng.uniform(0.0, 0.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            producer.join()
        produced_valid += sum(1 for *_, bad in part if bad is None)
        after = stored()
        print(f"kill {round_}: interactions {before} -> {after} of {produced_valid} produced")
        assert before < after < produced_valid, (
            f"round {round_}: the kill did not land while the slice was being stored ({before} -> {after} of {produced_valid})")

    produce(slices[3], paced=False)
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

    # dead_letters/: exactly once, filed by where the message came from
    assert len(sources) == 1000
    dead = read_dataset(s.data_dir, "dead_letters").to_pylist()
    by_source = {f"{d['kafka_topic']}:{d['kafka_partition']}:{d['kafka_offset']}": d for d in dead}
    assert len(dead) == len(by_source) == 1000 and set(by_source) == set(sources)
    for source, bad in sources.items():
        row = by_source[source]
        kept = bad.value[:RAW_PREFIX] if bad.reason == "too_large" else bad.value
        assert (row["reason"], row["tenant"], row["raw"]) == (bad.reason, bad.key, kept), source
        if bad.reason == "too_large":
            assert row["detail"] == f"{len(bad.value)} bytes is more than the limit of {MAX_MESSAGE_BYTES}", source

    # The dead-letter topic is best effort (a crash can send one twice; one it never acknowledges is given up).
    # With the topic up throughout, every malformed message is there, keyed by its tenant (or _unknown), with
    # its reason, detail and source; a too_large one as its first 4 KB.
    letters: dict[str, list] = {}
    for record in read_topic(s.bootstrap, s.dead):
        headers = {k: v.decode() for k, v in record.headers}
        letters.setdefault(headers["clora.source"], []).append((record.key.decode(), record.value, headers))
    assert set(letters) == set(sources), f"{len(set(sources) - set(letters))} missing, {len(set(letters) - set(sources))} unknown"
    for source, copies in letters.items():
        bad, row = sources[source], by_source[source]
        kept = bad.value[:RAW_PREFIX] if bad.reason == "too_large" else bad.value
        for key, value, headers in copies:
            assert (key, value) == (bad.key, kept), source
            assert headers == {"clora.reason": bad.reason, "clora.detail": (row["detail"] or "")[:1000], "clora.source": source}


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
    a, b = s.start("--member", "0", name="a"), s.start("--member", "1", name="b")  # as `clora up` starts them

    def both_assigned():
        la, lb = assignments(a), assignments(b)
        return la and lb and la[-1] != "none" and lb[-1] != "none"

    wait_for(both_assigned, 60, "both processes to hold partitions", [a, b])
    state = DataDir(s.data_dir).state  # each marked itself ready by its own name (`clora up` waits on both)
    wait_for(lambda: (ready_pid(state, "ingest-0"), ready_pid(state, "ingest-1")) == (a.pid, b.pid), 30,
             "both ready marks", [a, b])
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


def test_batches_compressed_with_every_kafka_codec_are_ingested(setup_factory):
    """A producer (or a topic's compression.type) may compress batches with any of Kafka's codecs: one ingest
    could not read stopped at the first such batch, and again at every restart."""
    s = setup_factory()
    codecs = ("gzip", "snappy", "lz4", "zstd")
    for codec in codecs:
        producer = KafkaProducer(bootstrap_servers=s.bootstrap, compression_type=codec, linger_ms=10)
        for i in range(50):
            producer.send(s.interactions, key=b"acme", value=encode(
                InteractionEvent(id=f"{codec}-{i}", tenant="acme", prompt="p", completion=f"{codec} " * 40)))
        producer.flush()
        producer.close()
    proc = s.start("--once")
    assert proc.wait(timeout=120) == 0, proc.log_path.read_text()[-3000:]
    ids = read_dataset(s.data_dir, "interactions").column("id").to_pylist()
    assert sorted(ids) == sorted(f"{codec}-{i}" for codec in codecs for i in range(50))


def test_batches_past_max_batch_bytes_or_unreadable_are_one_dead_letter_each_and_ingest_goes_on(setup_factory, monkeypatch):
    """A decompression bomb (kafka-python decompressed a batch whole: ingest died of it at every start), and
    batches the embedded broker stored as a producer sent them (data that is not zstd's, a wrong checksum;
    kafka-python raised at their offset at every start): each is one dead letter at its last offset, holding
    the batch as stored, and the events around them are ingested once. The damaged batches come from
    kafka-python's own producer with its zstd encoder or its checksum replaced while it writes them."""
    from kafka.record import default_records

    s = setup_factory(max_message_bytes=8192, ingest_settings=["max_batch_bytes = 200000"])

    def one_batch(values: list[bytes], **replaced) -> list:
        for name, function in replaced.items():
            monkeypatch.setattr(default_records, name, function)
        producer = KafkaProducer(bootstrap_servers=s.bootstrap, compression_type="zstd", linger_ms=2000,
                                 batch_size=4 << 20, max_request_size=4 << 20)
        futures = [producer.send(s.interactions, key=b"acme", value=value) for value in values]
        producer.flush()
        producer.close()
        monkeypatch.undo()
        return [f.get(timeout=10) for f in futures]

    def valid(tag: str) -> list[bytes]:
        return [encode(InteractionEvent(id=f"{tag}-{i}", tenant="acme", prompt="p", completion="c")) for i in range(10)]

    one_batch(valid("before"))
    bomb = one_batch([b'{"tenant": "acme", "x": "' + b"a" * 50_000 + b'"}'] * 40)  # 2 MB in a few KB
    garbage = one_batch(valid("garbage")[:3], zstd_encode=lambda data: b"\x28\xb5\x2f\xfdjunk")
    checksum = one_batch(valid("checksum")[:3], calc_crc32c=lambda data: 12345)
    one_batch(valid("after"))
    assert len({m.partition for m in bomb + garbage + checksum}) == 1

    proc = s.start("--once")
    assert proc.wait(timeout=120) == 0, proc.log_path.read_text()[-3000:]
    ids = read_dataset(s.data_dir, "interactions").column("id").to_pylist()
    assert sorted(ids) == sorted(f"{tag}-{i}" for tag in ("before", "after") for i in range(10))
    dead = sorted(read_dataset(s.data_dir, "dead_letters").to_pylist(), key=lambda d: d["kafka_offset"])
    expected = [(bomb, "batch_too_large", "decompress to more than ingest.max_batch_bytes (200000)"),
                (garbage, "bad_batch", "does not parse"), (checksum, "bad_batch", "failed its CRC-32C checksum")]
    assert len(dead) == len(expected)
    for row, (metas, reason, said) in zip(dead, expected):
        first, last = metas[0].offset, metas[-1].offset
        assert (row["reason"], row["kafka_offset"], row["tenant"]) == (reason, last, "_unknown")
        assert row["detail"].startswith(f"the record batch at offsets {first}..{last}: ") and said in row["detail"]
        base_offset, _, _, magic = struct.unpack_from(">qiib", row["raw"])  # the batch as stored (v2 format)
        assert (base_offset, magic) == (first, 2)
    letters = {int(dict(r.headers)["clora.source"].decode().rsplit(":", 1)[1]): r for r in read_topic(s.bootstrap, s.dead)}
    assert sorted(letters) == [row["kafka_offset"] for row in dead]
    for row in dead:
        letter = letters[row["kafka_offset"]]
        assert letter.value[:4096] == row["raw"] and dict(letter.headers)["clora.reason"].decode() == row["reason"]

    again = s.start("--once")  # committed past them: nothing is read twice
    assert again.wait(timeout=120) == 0, again.log_path.read_text()[-3000:]
    assert (s.count("interactions"), s.count("dead_letters")) == (20, 3)


def test_a_slow_scorer_cuts_batches_at_the_scoring_budget_and_every_event_lands_once(setup_factory, tmp_path):
    """A python: scorer taking 20 ms a call and a budget of 0.3 s a batch: batches end early, what they did is
    written and committed, the rest is read again from the broker; in the end every event is stored once and
    every offset committed."""
    (tmp_path / "clora_slow_scorer.py").write_text("import time\n\ndef score(completion, prompt):\n"
                                                   "    time.sleep(0.02)\n    return 1.0\n")
    s = setup_factory(flush_rows=1000, flush_seconds=5, tenants=[("slow", "python:clora_slow_scorer:score"),
                                                                 ("fb", "feedback")],
                      ingest_settings=["max_batch_scoring_seconds = 0.3"])
    for i in range(100):
        s.send(InteractionEvent(id=f"s{i}", tenant="slow", prompt="p", completion="c"))
        s.send(InteractionEvent(id=f"f{i}", tenant="fb", prompt="p", completion="c"))
        s.send(FeedbackEvent(id=f"f{i}", tenant="fb", score=0.5))
    s.producer.flush()
    proc = s.start("--once")
    assert proc.wait(timeout=120) == 0, proc.log_path.read_text()[-3000:]
    log = proc.log_path.read_text()
    assert log.count("reading the other") >= 3, log[-3000:]  # 100 calls of 20 ms against 0.3 s a batch
    totals = [line.split("totals: ")[1].split(" messages")[0] for line in log.splitlines() if "totals: " in line]
    assert totals[-1] == "300", log[-3000:]  # each message counted once, however often it was read
    ids = read_dataset(s.data_dir, "interactions").column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 200
    trajectories = read_dataset(s.data_dir, "trajectories").to_pylist()
    assert sorted((r["id"], r["reward"]) for r in trajectories) == sorted(
        [(f"s{i}", 1.0) for i in range(100)] + [(f"f{i}", 0.5) for i in range(100)])
    consumer = KafkaConsumer(bootstrap_servers=s.bootstrap, group_id=s.group, enable_auto_commit=False)
    try:
        for topic in (s.interactions, s.feedback):
            ends = {}  # what the topic holds: past its last record, per partition
            for rec in read_topic(s.bootstrap, topic):
                ends[rec.partition] = max(ends.get(rec.partition, 0), rec.offset + 1)
            assert {p: consumer.committed(TopicPartition(topic, p)) or 0 for p in ends} == ends
    finally:
        consumer.close()


@pytest.mark.parametrize("topics_file", ["kept", "deleted", "damaged"])
def test_a_broker_that_starts_again_with_its_topics_made_anew_loses_no_event(tmp_path, data_dir, topics_file):
    """The embedded broker keeps its topics in memory: started again, it makes them anew, offsets from 0, and
    the data dir is the same. A valid event at an offset where the old topic's message was dead-lettered was
    taken for a replay of it and lost; a new malformed one there was never stored, nor (its file named like the
    stored one's) one alone in a batch of the same range. So too when the file that records the topics' ids
    was lost or damaged (state/ deleted by hand): every stored dead letter was then taken for the new topic's."""
    from ingest.broker import EmbeddedBroker, free_port

    topics = ["a.i", "a.f", "a.d"]

    def ingest_once(*values: bytes) -> str:
        broker = EmbeddedBroker("127.0.0.1", free_port())
        broker.start(topics, 1)
        try:
            config = tmp_path / "clora.toml"
            config.write_text("\n".join([
                f'data_dir = "{data_dir}"', "[kafka]", f'bootstrap = "{broker.bootstrap}"',
                'interactions_topic = "a.i"', 'feedback_topic = "a.f"', 'dead_letter_topic = "a.d"',
                'group_id = "g"', "[ingest]", "flush_seconds = 0.3",
                "[[tenants]]", 'name = "dig"', 'api_key = "key-dig-0123"', 'scorer = "digits"']) + "\n")
            producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
            for value in values:
                producer.send("a.i", key=b"dig", value=value)
            producer.flush()
            producer.close()
            done = subprocess.run([sys.executable, "-m", "ingest", "--config", str(config), "--once"], cwd=REPO,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            return done.stdout + done.stderr
        finally:
            broker.stop()

    ingest_once(b"not json")  # a.i:0:0
    state = data_dir / "state" / "ingest-topics.json"
    assert state.exists()
    if topics_file != "kept":
        if topics_file == "deleted":
            state.unlink()
        else:
            state.write_text('{"a.i": {"id": "')
        ingest_once(b"fresh junk")  # a.i:0:0 of the new topic: not the stored dead letter's replay
        assert sorted(read_dataset(data_dir, "dead_letters").column("raw").to_pylist()) == [b"fresh junk", b"not json"]
        return
    log = ingest_once(encode(InteractionEvent(id="d0", tenant="dig", prompt="p", completion="12ab")), b"also bad")
    assert "topic a.i was made again" in log
    assert read_dataset(data_dir, "interactions").column("id").to_pylist() == ["d0"]
    assert read_dataset(data_dir, "trajectories").column("reward").to_pylist() == [0.5]
    assert sorted(read_dataset(data_dir, "dead_letters").column("raw").to_pylist()) == [b"also bad", b"not json"]
    ingest_once(b"other junk")  # a.i:0:0 once more, alone in its batch as b"not json" was
    assert sorted(read_dataset(data_dir, "dead_letters").column("raw").to_pylist()) == [b"also bad", b"not json", b"other junk"]


def test_a_running_ingest_reads_topics_made_anew_by_a_broker_started_again_from_their_start(tmp_path, data_dir):
    """The embedded broker restarted under a running ingest (as `clora up` restarts it) makes its topics anew,
    offsets from 0: ingest rejoined the group with its partitions' old positions and skipped as many of the
    new topic's first messages as the old one had held."""
    from ingest.broker import EmbeddedBroker, free_port

    topics, port = ["b.i", "b.f", "b.d"], free_port()
    config = tmp_path / "clora.toml"
    config.write_text("\n".join([
        f'data_dir = "{data_dir}"', "[kafka]", f'bootstrap = "127.0.0.1:{port}"', 'interactions_topic = "b.i"',
        'feedback_topic = "b.f"', 'dead_letter_topic = "b.d"', 'group_id = "g"', "[ingest]", "flush_seconds = 0.3"])
        + "\n")

    def send(prefix: str, n: int) -> None:
        producer = KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}")
        for i in range(n):
            producer.send("b.i", key=b"acme", value=encode(InteractionEvent(id=f"{prefix}{i}", tenant="acme",
                                                                             prompt="p", completion="c")))
        producer.flush()
        producer.close()

    def stored() -> set:
        try:
            return set(read_dataset(data_dir, "interactions").column("id").to_pylist())
        except Exception:  # nothing written yet
            return set()

    log = open(tmp_path / "ingest.log", "wb")  # noqa: SIM115 (closed below)
    broker = EmbeddedBroker("127.0.0.1", port)
    broker.start(topics, 1)
    proc = subprocess.Popen([sys.executable, "-m", "ingest", "--config", str(config)], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    proc.log_path = Path(log.name)
    try:
        send("old", 5)
        wait_for(lambda: stored() == {f"old{i}" for i in range(5)}, 60, "the first topic's events", [proc])
        broker.stop()
        broker = EmbeddedBroker("127.0.0.1", port)
        broker.start(topics, 1)
        send("new", 8)
        wait_for(lambda: {f"new{i}" for i in range(8)} <= stored(), 120, "every event of the new topic", [proc])
        assert "b.i:0 is read from the beginning: its topic was made again" in proc.log_path.read_text()
    finally:
        proc.kill()
        proc.wait()
        log.close()
        broker.stop()


def test_topics_of_different_partition_counts_are_said_to_break_the_join(broker, tmp_path, data_dir):
    """The group splits each topic on its own: with more than one process, feedback then reaches another
    process than its interaction. Nothing said so; it only waited and expired."""
    tag = uuid.uuid4().hex[:8]
    ensure_topics(broker.bootstrap, [f"m-{tag}.i", f"m-{tag}.d"], 2)
    ensure_topics(broker.bootstrap, [f"m-{tag}.f"], 4)
    config = tmp_path / "clora.toml"
    config.write_text("\n".join([
        f'data_dir = "{data_dir}"', "[kafka]", f'bootstrap = "{broker.bootstrap}"',
        f'interactions_topic = "m-{tag}.i"', f'feedback_topic = "m-{tag}.f"', f'dead_letter_topic = "m-{tag}.d"',
        f'group_id = "g-{tag}"']) + "\n")
    done = subprocess.run([sys.executable, "-m", "ingest", "--config", str(config), "--once"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ERROR ingest.consumer: ingest: m-{tag}.i has 2 partitions but m-{tag}.f has 4" in done.stderr


def test_ingest_creates_its_dead_letter_topic_where_it_is_missing(broker, tmp_path, data_dir):
    """Serving creates the two event topics, nobody the dead-letter one: on a cluster that creates no topic on
    first use every dead letter was refused (kept in Parquet only)."""
    from kafka import KafkaAdminClient

    tag = uuid.uuid4().hex[:8]
    ensure_topics(broker.bootstrap, [f"d-{tag}.i", f"d-{tag}.f"], 2)
    config = tmp_path / "clora.toml"
    config.write_text("\n".join([
        f'data_dir = "{data_dir}"', "[kafka]", f'bootstrap = "{broker.bootstrap}"', "partitions = 2",
        f'interactions_topic = "d-{tag}.i"', f'feedback_topic = "d-{tag}.f"', f'dead_letter_topic = "d-{tag}.d"',
        f'group_id = "g-{tag}"']) + "\n")
    done = subprocess.run([sys.executable, "-m", "ingest", "--config", str(config), "--once"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        (topic,) = admin.describe_topics([f"d-{tag}.d"])
    finally:
        admin.close()
    assert topic["error_code"] == 0 and len(topic["partitions"]) == 2


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


def test_a_tenant_added_to_the_config_is_ingested_with_its_scorer_without_a_restart(setup_factory):
    """Serving and the learner follow the config's tenants; ingest read them only at its start, so a tenant
    added was dead-lettered (unknown_tenant = "reject") or scored by feedback ("create") until a restart."""
    s = setup_factory(flush_rows=100, flush_seconds=0.2, tenants=[("acme", "feedback")],
                      ingest_settings=['unknown_tenant = "reject"', "removed_tenant_grace_seconds = 3"])
    proc = s.start()

    def dead_letters() -> list:
        return read_dataset(s.data_dir, "dead_letters").to_pylist() if (s.data_dir / "dead_letters").exists() else []

    s.send(InteractionEvent(id="l0", tenant="late", prompt="p", completion="yes"))
    s.producer.flush()
    wait_for(lambda: len(dead_letters()) == 1, 60, "late's event dead-lettered", [proc])
    assert dead_letters()[0]["reason"] == "unknown_tenant"
    s.tenants = [("acme", "feedback"), ("late", "contains:yes")]
    s.write_config(100, 0.2)
    wait_for(lambda: "added late" in proc.log_path.read_text(), 30, "ingest to read the config again", [proc])
    s.send(InteractionEvent(id="l1", tenant="late", prompt="p", completion="oh yes"))
    s.send(InteractionEvent(id="l2", tenant="late", prompt="p", completion="no"))
    s.producer.flush()
    rewards = lambda: sorted((r["id"], r["reward"], r["reward_source"]) for r in  # noqa: E731
                             (read_dataset(s.data_dir, "trajectories").to_pylist()
                              if (s.data_dir / "trajectories").exists() else []))
    wait_for(lambda: len(rewards()) == 2, 60, "late's events scored", [proc])
    assert rewards() == [("l1", 1.0, "contains:yes"), ("l2", 0.0, "contains:yes")]
    assert len(dead_letters()) == 1
    s.tenants = [("late", "contains:yes")]  # acme removed: "reject" dead-letters its events once the grace is over
    s.write_config(100, 0.2)
    wait_for(lambda: "removed (its events still stored for 3 s" in proc.log_path.read_text(), 30, "acme's removal",
             [proc])
    wait_for(lambda: "tenant 'acme' removed from the config 3 s ago" in proc.log_path.read_text(), 30,
             "acme's grace to end", [proc])
    s.send(InteractionEvent(id="a0", tenant="acme", prompt="p", completion="c"))
    s.producer.flush()
    wait_for(lambda: len(dead_letters()) == 2, 60, "acme's event dead-lettered", [proc])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.log_path.read_text()[-3000:]
