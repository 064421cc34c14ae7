"""Ingest metrics: totals for logs, and the Prometheus endpoint when a port is given."""

import urllib.request
from collections import Counter

import pytest

from ingest.batch import Output
from ingest.broker import free_port
from ingest.consumer import batch_file_id
from ingest.metrics import IngestMetrics
from storage.layout import FILE_ID

pytestmark = pytest.mark.unit


def test_totals_and_prometheus_endpoint(caplog):
    import time

    port = free_port()
    metrics = IngestMetrics(port=port)
    before = time.time()
    try:
        out = Output(duplicates=2, reasons=Counter({"not_json": 3, "bad_field": 1}), pending_dropped=Counter({"over_cap": 5}))
        metrics.flushed(10, out, 0.05, pending=4)
        metrics.pending_dropped("expired", 2)
        metrics.dead_letters_not_delivered(0)  # a batch whose dead letters all reached the topic
        metrics.dead_letters_not_delivered(2)
        metrics.set_lag({("clora.interactions", 0): 120_000})
        metrics.set_lag({("clora.interactions", 1): 7})  # partition 0 revoked since: no longer reported
        assert metrics.total["messages"] == 10 and metrics.total["duplicates"] == 2
        assert metrics.reasons == {"not_json": 3, "bad_field": 1}
        assert metrics.dropped == {"over_cap": 5, "expired": 2}
        with caplog.at_level("INFO", logger="ingest.metrics"):
            metrics.log()
        assert "dead letters: bad_field=1, not_json=3 (2 not delivered to the dead-letter topic)" in caplog.text
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'clora_ingest_dead_letters_total{reason="not_json"} 3.0' in body
        assert 'clora_ingest_lag{partition="1",topic="clora.interactions"} 7.0' in body
        assert 'partition="0"' not in body
        assert "clora_ingest_pending_feedback 4.0" in body
        assert 'clora_ingest_pending_feedback_dropped_total{reason="over_cap"} 5.0' in body
        assert 'clora_ingest_pending_feedback_dropped_total{reason="expired"} 2.0' in body
        assert "clora_ingest_messages_total 10.0" in body
        assert "clora_ingest_dead_letters_not_delivered_total 2.0" in body
        for name in ("clora_ingest_last_loop_timestamp_seconds", "clora_ingest_last_flush_timestamp_seconds"):
            (line,) = [line for line in body.splitlines() if line.startswith(name + " ")]
            assert float(line.split()[1]) >= before, line  # set by set_lag and flushed: what liveness alerts read
    finally:
        metrics.close()


def test_batch_file_ids_name_the_ranges_and_the_rows():
    one = {("clora.interactions", 3): (120, 245)}
    fid = batch_file_id(one, [("acme", "a"), ("acme", "b")])
    assert fid.startswith("clora.interactions.3.000000000120-000000000245-")
    assert fid == batch_file_id(one, [("acme", "a"), ("acme", "b")])  # a replay of the same rows
    assert fid != batch_file_id(one, [("acme", "a")])  # other rows from the same range: another file
    many = {("clora.interactions", p): (p, p + 10) for p in range(8)} | {("clora.feedback", 0): (0, 1)}
    assert batch_file_id(many, []) != batch_file_id({**many, ("clora.feedback", 0): (0, 2)}, [])
    for f in (fid, batch_file_id(many, [("t", "x")]), batch_file_id({("_weird", 0): (0, 0)}, [])):
        assert FILE_ID.match(f), f
