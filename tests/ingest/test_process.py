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
    import ingest.process as process_module
    from ingest.scorers import ScorerSpecError
    from signal_support import handlers_restored, locks_taken_by_handler

    lock_calls = []

    def build(cfg, member=None, config_file=None):  # the handlers are in place by now: signal, then leave
        # twice: with --drain-on-stop the first drains, the second stops
        lock_calls.extend(locks_taken_by_handler(times=2))
        raise ScorerSpecError("stop here")

    monkeypatch.setattr(process_module, "build", build)
    with handlers_restored():
        assert process_module.run(Config(data_dir=tmp_path), drain_on_stop=drain_on_stop) == 2
    assert lock_calls == []


@pytest.mark.parametrize("refusal, named", [
    ("InvalidSessionTimeoutError", "kafka.session_timeout_ms 10000: it must lie between the broker's "
                                   "group.min.session.timeout.ms and group.max.session.timeout.ms"),
    ("InconsistentGroupProtocolError", "consumer group 'clora-ingest' (kafka.group_id) has members of another"),
    ("GroupAuthorizationFailedError", "not authorised to use consumer group 'clora-ingest'"),
    # a batch that cannot be read: every start would stop at it again
    ("UnsupportedCodecError", "compressed with a codec this installation cannot read"),
    ("CorruptRecordError", "the topic's log is damaged there"),
])
def test_a_group_the_broker_refuses_for_good_ends_ingest_naming_the_setting(tmp_path, monkeypatch, caplog, refusal, named):
    """kafka-python raises these from `poll` and never retries them: the process ends with status 2 and a
    message that says what to change, not a traceback. (The embedded broker enforces none of them, so the
    clients are stand-ins here.)"""
    import kafka.errors

    import ingest.consumer as consumer_module
    import ingest.process as process_module
    from kafka_fakes import FakeConsumer

    built = []

    class Refused(FakeConsumer):
        def __init__(self, **settings):
            super().__init__()
            self.settings = settings
            built.append(settings)

        def subscribe(self, topics, listener=None):
            pass

        def poll(self, timeout_ms=0, max_records=None):
            raise getattr(kafka.errors, refusal)()

    class Producer:
        def __init__(self, **settings):
            pass

        def close(self):
            pass

    monkeypatch.setattr(consumer_module, "KafkaConsumer", Refused)
    monkeypatch.setattr(consumer_module, "KafkaProducer", Producer)
    monkeypatch.setattr(process_module, "wait_until_reachable", lambda *args: None)
    monkeypatch.setattr(process_module, "ensure_topics", lambda *args, **kwargs: None)  # no broker: ~30 s each
    monkeypatch.setattr(process_module, "tune_runtime", lambda: None)
    cfg = Config(data_dir=tmp_path, kafka={"session_timeout_ms": 10000, "group_id": "clora-ingest"})
    from signal_support import handlers_restored

    with handlers_restored(), caplog.at_level("ERROR"):
        assert process_module.run(cfg) == 2
    assert any(named in r.getMessage() and r.getMessage().startswith("clora ingest: ") for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    # An aborted transaction's events are never stored (the embedded broker does not filter them, so only
    # the setting is checked): Kafka's default, read_uncommitted, took them.
    assert [(b["isolation_level"], b["enable_auto_commit"]) for b in built] == [("read_committed", False)]


def test_a_scorer_that_could_not_be_built_is_tried_again_every_minute_without_a_config_change(tmp_path, monkeypatch,
                                                                                              caplog):
    """Installing the module a tenant's python scorer names fixed nothing until ingest restarted: the config
    was only read again when its file changed."""
    from ingest.batch import Processor
    from ingest.process import RETRY_UNBUILT_S, TenantFollower

    processor = Processor({"judged": "python:clora_judge_soon:score"}, unknown_tenant="reject", max_message_bytes=100)
    now = [0.0]
    follow = TenantFollower(None, processor, Config(data_dir=tmp_path), clock=lambda: now[0])
    (tmp_path / "clora_judge_soon.py").write_text("def score(completion, prompt):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    follow()
    assert list(processor.unbuilt()) == ["judged"], "not before its minute"
    now[0] = RETRY_UNBUILT_S
    with caplog.at_level("INFO", logger="ingest.process"):
        follow()
    assert processor.unbuilt() == {} and "tenant 'judged': its scorer builds now" in caplog.text
