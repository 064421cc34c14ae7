"""The Parquet schemas of the five datasets: the storage rows of clora.

These are storage rows only: wire events (what Kafka carries) live in ingest/, training batches in learner/;
the three never merge. Each schema carries `clora.schema_version` and `clora.dataset` in its metadata, and
every file written through storage.parquet keeps that metadata in its footer, so a reader can always tell
which version wrote a file.

Evolution rule (what keeps old files readable): add nullable columns, never rename, retype or drop one.
`conform` fills columns a file lacks with nulls, so readers always get the current schema. A change that
breaks the rule bumps SCHEMA_VERSION and adds a converter in `conform`. The other way round, a file a newer
clora wrote may hold columns this code does not know, which a non-strict `conform` drops: fine for a reader,
not for whatever rewrites the file (compaction), which asks `conform_loses` first. A file of a newer
SCHEMA_VERSION is refused by readers too (SchemaMismatch: upgrade this clora).

Timestamps are timestamp[ms, UTC] everywhere; token ids and logprobs are list<int32> / list<float32> so a
trajectory can be re-scored without a tokenizer.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
VERSION_KEY = b"clora.schema_version"

TS = pa.timestamp("ms", tz="UTC")


class SchemaMismatch(ValueError):
    """A table does not fit a dataset's schema; the message names the column."""


def _schema(name: str, fields: list[pa.Field]) -> pa.Schema:
    return pa.schema(
        fields,
        metadata={VERSION_KEY: str(SCHEMA_VERSION).encode(), b"clora.dataset": name.encode()},
    )


def _f(name: str, type_: pa.DataType, nullable: bool = True) -> pa.Field:
    return pa.field(name, type_, nullable=nullable)


# When ingest stored a row: what retention deletes by, and the day compaction keeps each merged file to.
# Every dataset fed from Kafka has it; train_steps (the learner's, never pruned) does not.
INGESTED_AT = "ingested_at"

# Provenance columns shared by every dataset fed from Kafka: where the row came from and when it landed.
_KAFKA = [
    _f("kafka_topic", pa.string()),
    _f("kafka_partition", pa.int32()),
    _f("kafka_offset", pa.int64()),
    _f(INGESTED_AT, TS, nullable=False),
]

_INTERACTION = [
    _f("id", pa.string(), nullable=False),
    _f("tenant", pa.string(), nullable=False),
    _f("ts", TS, nullable=False),
    _f("prompt", pa.string()),  # the rendered prompt text the completion continued
    _f("messages_json", pa.string()),  # the chat messages as sent, JSON (null for plain-prompt requests)
    _f("completion", pa.string()),
    _f("adapter_version", pa.string()),  # "<tenant>@<n>" that produced the completion; null = base model
    # the prompt as the model saw it, when it was sent as token ids (null otherwise: the text re-tokenizes
    # to what was served). Added after version 1's first files: older files lack it and read as nulls.
    _f("prompt_token_ids", pa.list_(pa.int32())),
    _f("completion_token_ids", pa.list_(pa.int32())),
    _f("completion_logprobs", pa.list_(pa.float32())),
    _f("metadata_json", pa.string()),
]

INTERACTIONS = _schema("interactions", [*_INTERACTION, *_KAFKA])

TRAJECTORIES = _schema(
    "trajectories",
    [
        *_INTERACTION[:6],  # id .. completion
        _f("reward", pa.float64(), nullable=False),
        # "inline", the scorer spec, or the joined feedback's source ("feedback" when it has none)
        _f("reward_source", pa.string(), nullable=False),
        *_INTERACTION[6:],
        *_KAFKA,
    ],
)

FEEDBACK = _schema(
    "feedback",
    [
        _f("id", pa.string(), nullable=False),  # the interaction's id
        _f("tenant", pa.string(), nullable=False),
        _f("ts", TS, nullable=False),
        _f("score", pa.float64(), nullable=False),
        _f("source", pa.string()),
        *_KAFKA,
    ],
)

DEAD_LETTERS = _schema(
    "dead_letters",
    [
        _f("tenant", pa.string(), nullable=False),  # "_unknown" when the message named no usable tenant
        _f("reason", pa.string(), nullable=False),  # short machine-readable cause, e.g. "invalid_json"
        _f("detail", pa.string()),  # the human-readable error
        _f("raw", pa.binary()),  # the message bytes (a prefix of them when large)
        *_KAFKA,
    ],
)

TRAIN_STEPS = _schema(
    "train_steps",
    [
        _f("tenant", pa.string(), nullable=False),
        _f("step", pa.int64(), nullable=False),
        _f("version", pa.string()),  # adapter version the step started from ("<tenant>@<n>"), null = fresh
        _f("mode", pa.string()),  # "logs" or "rollouts"
        _f("reward_mean", pa.float64()),
        _f("loss", pa.float64()),
        _f("kl", pa.float64()),
        _f("clip_frac", pa.float64()),
        _f("tokens", pa.int64()),
        _f("seconds", pa.float64()),
        _f("n_trajectories", pa.int64()),
        _f("ts", TS, nullable=False),
        _f("n_dropped", pa.int64()),  # samples left out for their version (stale, foreign) or having no tokens
        _f("n_score_failed", pa.int64()),  # rollouts: samples the scorer failed on
    ],
)

SCHEMAS: dict[str, pa.Schema] = {
    "interactions": INTERACTIONS,
    "feedback": FEEDBACK,
    "trajectories": TRAJECTORIES,
    "dead_letters": DEAD_LETTERS,
    "train_steps": TRAIN_STEPS,
}

# ---------------------------------------------------------------------------------------------------------
# Casting a table to a schema


def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return f"list<{_kind(t.value_type)}>"
    if pa.types.is_null(t):
        return "null"
    return str(t)


# Which source kinds may be cast to which target kinds. Anything else is a mismatch, even where arrow could
# cast (say float -> string): silently stringifying a number is how bad rows get in.
_COMPATIBLE = {
    "int": {"int", "null"},
    "float": {"float", "int", "null"},
    "string": {"string", "binary", "null"},
    "binary": {"binary", "string", "null"},
    "timestamp": {"timestamp", "null"},
    "list<int>": {"list<int>", "list<null>", "null"},
    "list<float>": {"list<float>", "list<int>", "list<null>", "null"},
}


def _cast_column(name: str, column: pa.ChunkedArray, target: pa.Field) -> pa.ChunkedArray:
    src, dst = column.type, target.type
    if src == dst:
        return column
    if _kind(src) not in _COMPATIBLE.get(_kind(dst), {_kind(dst)}):
        raise SchemaMismatch(f"column {name!r} has type {src}, expected {dst}")
    try:
        if _kind(src) == "timestamp":
            # Arrow stores instants as UTC, so this only relabels (a naive timestamp is taken to be UTC);
            # sub-millisecond precision is dropped, by design.
            return column.cast(dst, safe=False)
        return column.cast(dst, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaMismatch(f"column {name!r} cannot be cast from {src} to {dst}: {e}") from e


def conform(table: pa.Table, schema: pa.Schema, *, strict: bool = True, what: str = "table") -> pa.Table:
    """Returns `table` cast to `schema`: columns in schema order, missing nullable columns as nulls.

    strict (writes): unknown columns, missing required columns, nulls in required columns and
    incompatible types raise SchemaMismatch naming the column. Not strict (reads of old files): unknown
    columns are dropped and missing columns become nulls whatever their nullability; a table whose metadata
    names a newer SCHEMA_VERSION (a breaking change, by the rule above: a column renamed would read as
    nulls) raises SchemaMismatch.
    """
    if not strict and (newer := _newer_version(table.schema)) is not None:
        raise SchemaMismatch(f"{what}: {newer}; it was written by a newer clora, which this one cannot read: "
                             f"upgrade this clora")
    if strict:
        extra = [c for c in table.column_names if schema.get_field_index(c) < 0]
        if extra:
            raise SchemaMismatch(f"{what}: column {extra[0]!r} is not in the schema (columns: {', '.join(schema.names)})")
    columns = []
    for field in schema:
        if field.name in table.column_names:
            col = _cast_column(field.name, table.column(field.name), field)
            if strict and not field.nullable and col.null_count:
                raise SchemaMismatch(f"{what}: column {field.name!r} is required but has {col.null_count} null(s)")
        elif strict and not field.nullable:
            raise SchemaMismatch(f"{what}: required column {field.name!r} is missing")
        else:
            col = pa.chunked_array([pa.nulls(len(table), field.type)])
        columns.append(col)
    # Built from arrays + schema: the nullability flags and the version metadata come with the schema.
    return pa.Table.from_arrays(columns, schema=schema)


def conform_loses(file_schema: pa.Schema, schema: pa.Schema) -> str | None:
    """Why `conform(strict=False)` would lose part of a file whose footer schema is `file_schema` (columns
    `schema` lacks, or a newer SCHEMA_VERSION, whose converter this code does not have), or None. A newer
    clora writes such files during a rolling upgrade; reading them without those columns is fine, rewriting
    them without (and deleting the original) loses the columns for good."""
    unknown = [n for n in file_schema.names if schema.get_field_index(n) < 0]
    if unknown:
        return f"columns not in this version's schema: {', '.join(unknown)}"
    return _newer_version(file_schema)


def _newer_version(schema: pa.Schema) -> str | None:
    """Why a file of `schema` is not of this SCHEMA_VERSION or an older one, or None."""
    version = (schema.metadata or {}).get(VERSION_KEY)
    if version is None:
        return None  # not written by clora; nothing in it is unknown
    try:
        number = int(version)
    except ValueError:
        return f"schema version {version!r} is not a number"
    if number > SCHEMA_VERSION:
        return f"schema version {number} is newer than this version's {SCHEMA_VERSION}"
    return None
