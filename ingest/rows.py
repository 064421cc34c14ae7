"""Storage rows: wire events turned into the rows of storage's Parquet schemas, and rows into Arrow tables.

The three type families never merge (STYLE.md): events.py holds what Kafka carries, this module what
Parquet holds (one NamedTuple per dataset, fields in the schema's column order), and the learner has its
own batches. Timestamps are kept as epoch milliseconds here (cheap to build, exact) and typed as
timestamp[ms, UTC] when the table is made. Events come from `events.decode`, so their JSON parts
(messages, metadata) hold only finite numbers and are re-encoded with the fast encoder.

Not here: deciding which rows to write (batch.py) or writing them (storage.parquet, called by consumer.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from operator import attrgetter
from typing import NamedTuple, Protocol

import pyarrow as pa

from ingest.events import DeadLetter, FeedbackEvent, InteractionEvent, decoded_to_json
from storage.layout import UNKNOWN_TENANT
from storage.schema import DEAD_LETTERS, FEEDBACK, INTERACTIONS, TRAJECTORIES

# How much of a rejected message is kept in dead_letters.raw, and sent to the dead-letter topic when it is
# larger than ingest.max_message_bytes (smaller ones are sent whole).
RAW_PREFIX_BYTES = 4096

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class Coords(NamedTuple):
    """Where a message came from: its Kafka topic, partition and offset."""

    topic: str
    partition: int
    offset: int


class Origin(Protocol):
    """What the rows of a message read of where it came from: a Coords, or the consumed record itself
    (batch.Record, kafka-python's ConsumerRecord), so that no Coords is built per message."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...


class InteractionRow(NamedTuple):
    id: str
    tenant: str
    ts: int  # epoch ms
    prompt: str | None
    messages_json: str | None
    completion: str | None
    adapter_version: str | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    metadata_json: str | None
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None
    ingested_at: int  # epoch ms


class TrajectoryRow(NamedTuple):
    id: str
    tenant: str
    ts: int
    prompt: str | None
    messages_json: str | None
    completion: str | None
    reward: float
    reward_source: str
    adapter_version: str | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    metadata_json: str | None
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None
    ingested_at: int


class FeedbackRow(NamedTuple):
    id: str
    tenant: str
    ts: int
    score: float
    source: str | None
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None
    ingested_at: int


class DeadLetterRow(NamedTuple):
    tenant: str
    reason: str
    detail: str | None
    raw: bytes | None
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None
    ingested_at: int


SCHEMA_OF = {InteractionRow: INTERACTIONS, TrajectoryRow: TRAJECTORIES, FeedbackRow: FEEDBACK, DeadLetterRow: DEAD_LETTERS}

_MS = timedelta(milliseconds=1)


def epoch_ms(ts: datetime) -> int:
    return (ts - EPOCH) // _MS


# ---------------------------------------------------------------------------------------------------------
# Events -> rows


# A NamedTuple's own constructor is a Python function; tuple.__new__ builds the same row from a tuple of
# its fields in order at about half the cost, which counts for the rows built once per message.
_row = tuple.__new__


def interaction_row(ev: InteractionEvent, at: Origin, ingested_at: int) -> InteractionRow:
    return _row(InteractionRow, (
        ev.id,
        ev.tenant,
        epoch_ms(ev.ts),
        ev.rendered_prompt,
        None if ev.messages is None else decoded_to_json(ev.messages),
        ev.completion,
        ev.adapter_version,
        ev.prompt_token_ids,
        ev.completion_token_ids,
        ev.completion_logprobs,
        None if ev.metadata is None else decoded_to_json(ev.metadata),
        at.topic,
        at.partition,
        at.offset,
        ingested_at,
    ))


def trajectory_row(row: InteractionRow, reward: float, source: str, ingested_at: int) -> TrajectoryRow:
    """A scored interaction; it keeps the interaction's Kafka provenance."""
    return _row(TrajectoryRow, row[:6] + (reward, source) + row[6:-1] + (ingested_at,))


# What makes two feedback events one event, the key feedback/ is deduplicated on: a resent event (the
# serving tier's spool resends what Kafka did not acknowledge) comes at a new offset with the same content.
FEEDBACK_KEY_COLUMNS = ("tenant", "id", "ts", "score", "source")
FEEDBACK_KEY = attrgetter(*FEEDBACK_KEY_COLUMNS)  # of a FeedbackRow (ts in epoch ms)


def feedback_key(ev: FeedbackEvent) -> tuple:
    """FEEDBACK_KEY of the row `ev` becomes."""
    return (ev.tenant, ev.id, epoch_ms(ev.ts), ev.score, ev.source)


def feedback_row(ev: FeedbackEvent, at: Origin, ingested_at: int) -> FeedbackRow:
    return _row(FeedbackRow, (ev.id, ev.tenant, epoch_ms(ev.ts), ev.score, ev.source, at.topic, at.partition, at.offset, ingested_at))


def dead_letter_row(dl: DeadLetter, raw: bytes, at: Coords, ingested_at: int) -> DeadLetterRow:
    """The row of a rejected message; every dead letter, whatever its reason, is built here. Its detail is
    made encodable: it can quote a lone surrogate (a scorer's error text, say, about a string json.loads
    made of "\\ud83d"), which neither Arrow's UTF-8 column nor the `clora.detail` Kafka header can hold, and
    whose write would then fail again at every replay. Such a character is kept as its escape, `\\ud83d`."""
    detail = dl.detail.encode("utf-8", "backslashreplace").decode("utf-8")
    return DeadLetterRow(
        dl.tenant or UNKNOWN_TENANT, dl.reason, detail, raw[:RAW_PREFIX_BYTES], at.topic, at.partition, at.offset, ingested_at
    )


# ---------------------------------------------------------------------------------------------------------
# Rows <-> Arrow (tests/ingest/test_rows.py checks each NamedTuple's fields equal its schema's columns)


def to_table(rows: list[NamedTuple], row_type: type) -> pa.Table:
    """Rows of one NamedTuple type -> a table with that dataset's schema."""
    schema = SCHEMA_OF[row_type]
    if not rows:
        return schema.empty_table()
    columns = zip(*rows, strict=True)
    return pa.Table.from_arrays([pa.array(col, type=f.type) for col, f in zip(columns, schema, strict=True)], schema=schema)


def interaction_rows(table: pa.Table) -> list[InteractionRow]:
    """Interaction rows read back from Parquet (timestamps back to epoch ms)."""
    ms = {"ts": table.column("ts").cast(pa.int64()), "ingested_at": table.column("ingested_at").cast(pa.int64())}
    columns = [ms[name].to_pylist() if name in ms else table.column(name).to_pylist() for name in InteractionRow._fields]
    return [InteractionRow(*values) for values in zip(*columns)]
