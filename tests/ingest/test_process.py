"""ingest.process: the ingest section of the config reaches the objects `build` makes (no broker needed)."""

import pytest
from pydantic import ValidationError

from clora.config import Config, IngestConfig
from ingest.metrics import IngestMetrics
from ingest.process import build

pytestmark = pytest.mark.unit


def test_the_caps_reach_the_processor_and_the_store_view(tmp_path):
    cfg = Config(data_dir=tmp_path, ingest=IngestConfig(max_pending_feedback_per_tenant=7, max_pending_feedback=20,
                                                               max_auto_tenants=3))
    ingest = build(cfg, metrics=IngestMetrics())
    assert ingest.processor.max_auto_tenants == 3
    assert ingest.max_pending_per_tenant == 7
    ingest.load_store()
    assert (ingest.store.pending.cap, ingest.store.pending.total) == (7, 20)


@pytest.mark.parametrize("field", ["max_pending_feedback_per_tenant", "max_pending_feedback", "max_auto_tenants"])
def test_the_caps_are_at_least_one(field):
    with pytest.raises(ValidationError, match=field):
        IngestConfig(**{field: 0})


def test_a_member_of_several_is_named_and_serves_its_metrics_on_its_own_port(tmp_path):
    import urllib.request

    from ingest.broker import free_port

    port = free_port()  # member 1's; the configured base port is the one below it
    cfg = Config(data_dir=tmp_path, ingest=IngestConfig(metrics_port=port - 1, processes=2))
    ingest = build(cfg, member=1)
    try:
        assert ingest.name == "ingest-1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"clora_ingest_messages" in r.read()
    finally:
        ingest.metrics.close()
    assert build(Config(data_dir=tmp_path), metrics=IngestMetrics()).name == "ingest"


def test_the_batch_scoring_budget_reaches_the_processor(tmp_path):
    cfg = Config(data_dir=tmp_path, ingest=IngestConfig(max_batch_scoring_seconds=2.5))
    assert build(cfg, metrics=IngestMetrics()).processor.scoring_budget_s == 2.5


@pytest.mark.parametrize("drain_on_stop", [False, True])
def test_the_signal_handler_takes_no_lock(tmp_path, monkeypatch, drain_on_stop):
    """A handler runs in the main thread between two of its bytecodes, perhaps while that thread holds a lock
    (threading.Event.wait's, in the wait for Kafka): threading.Event.set in the handler could deadlock."""
    import signal
    import sys

    import ingest.process as process_module
    from ingest.scorers import ScorerSpecError

    lock_calls = []

    def profile(_frame, event, arg):
        # An RLock (logging's) is re-entrant: the handler may take it while the interrupted code holds it.
        if event == "c_call" and getattr(arg, "__name__", "") in ("acquire", "__enter__", "acquire_lock") \
                and "RLock" not in repr(arg):
            lock_calls.append(repr(arg))

    def build(cfg, member=None):  # the handlers are in place by now: signal, then leave
        handler = signal.getsignal(signal.SIGTERM)
        sys.setprofile(profile)
        try:
            handler(signal.SIGTERM, None)
            handler(signal.SIGTERM, None)  # with --drain-on-stop: the first drains, the second stops
        finally:
            sys.setprofile(None)
        raise ScorerSpecError("stop here")

    monkeypatch.setattr(process_module, "build", build)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert process_module.run(Config(data_dir=tmp_path), drain_on_stop=drain_on_stop) == 2
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert lock_calls == []
