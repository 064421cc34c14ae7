"""Wire events for the ingest tests that feed batches without Kafka, stamped at one fixed moment (T0) so that
expiry and ordering are the tests' to set: `inter` builds an interaction, `fb` its feedback."""

from __future__ import annotations

from datetime import datetime, timezone

from ingest.events import FeedbackEvent, InteractionEvent

T0 = datetime(2025, 5, 1, tzinfo=timezone.utc)
NOW_MS = int(T0.timestamp() * 1000)  # the processing time of a batch: when T0's events arrive


def inter(id_: str, tenant: str = "fb", *, ts: datetime = T0, completion: str = "c1", **fields) -> InteractionEvent:
    """An interaction of `tenant` with prompt "p"; `fields` are the event's other fields (reward, metadata...)."""
    return InteractionEvent(id=id_, tenant=tenant, prompt="p", completion=completion, ts=ts, **fields)


def fb(id_: str, score: float = 1.0, tenant: str = "fb", *, ts: datetime = T0, source: str | None = None) -> FeedbackEvent:
    return FeedbackEvent(id=id_, tenant=tenant, score=score, ts=ts, source=source)
