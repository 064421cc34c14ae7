"""Storage rows: each NamedTuple matches its Parquet schema, and rows survive a trip through Arrow."""

from datetime import datetime, timezone

import pyarrow.parquet as pq
import pytest

from ingest.consumer import DatasetRows, batch_file_id, write_rows
from ingest.events import DeadLetter, FeedbackEvent, InteractionEvent
from ingest.rows import (
    RAW_PREFIX_BYTES,
    SCHEMA_OF,
    Coords,
    DeadLetterRow,
    InteractionRow,
    TrajectoryRow,
    dead_letter_row,
    epoch_ms,
    feedback_row,
    interaction_row,
    interaction_rows,
    to_table,
    trajectory_row,
)

pytestmark = pytest.mark.unit

AT = Coords("clora.interactions", 2, 41)


@pytest.mark.parametrize("row_type", list(SCHEMA_OF))
def test_row_fields_are_the_schema_columns(row_type):
    assert row_type._fields == tuple(SCHEMA_OF[row_type].names)


def test_interaction_and_trajectory_rows():
    ts = datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc)
    ev = InteractionEvent(id="r", tenant="acme", completion="4", messages=[{"role": "user", "content": "2+2"}],
                          ts=ts, metadata={"k": "v"}, completion_token_ids=[5], completion_logprobs=[-0.25])
    row = interaction_row(ev, AT, ingested_at=1000)
    assert row.ts == epoch_ms(ts) == 1735787045678
    assert row.prompt == "user: 2+2" and row.messages_json == '[{"role":"user","content":"2+2"}]'
    assert row.metadata_json == '{"k":"v"}'
    assert (row.kafka_topic, row.kafka_partition, row.kafka_offset) == AT
    traj = trajectory_row(row, 0.5, "feedback", ingested_at=2000)
    assert traj.reward == 0.5 and traj.reward_source == "feedback" and traj.ingested_at == 2000
    assert traj.completion_token_ids == [5] and traj.kafka_offset == 41
    assert interaction_rows(to_table([row], InteractionRow)) == [row]


def test_a_trajectory_row_carries_every_field_of_its_interaction_row():
    row = InteractionRow(*(f"v{i}" for i in range(len(InteractionRow._fields))))  # a distinct value per field
    traj = trajectory_row(row, 0.5, "src", ingested_at=7)
    shared = [f for f in InteractionRow._fields if f != "ingested_at"]
    assert {f: getattr(traj, f) for f in shared} == {f: getattr(row, f) for f in shared}
    assert (traj.reward, traj.reward_source, traj.ingested_at) == (0.5, "src", 7)


def test_prompt_token_ids_go_to_interaction_and_trajectory_rows():
    ev = InteractionEvent(id="r", tenant="acme", completion="!", prompt="hello", prompt_token_ids=[74, 71, 78, 78, 81],
                          completion_token_ids=[5], completion_logprobs=[-0.25])
    row = interaction_row(ev, AT, ingested_at=1000)
    assert row.prompt == "hello" and row.prompt_token_ids == [74, 71, 78, 78, 81] and row.completion_token_ids == [5]
    traj = trajectory_row(row, 1.0, "inline", ingested_at=2000)
    assert traj.prompt_token_ids == [74, 71, 78, 78, 81] and traj.completion_token_ids == [5]
    assert traj.metadata_json is None and traj.kafka_offset == 41 and traj.ingested_at == 2000
    assert interaction_rows(to_table([row], InteractionRow)) == [row]
    table = to_table([traj], TrajectoryRow)
    assert table.column("prompt_token_ids").to_pylist() == [[74, 71, 78, 78, 81]]
    assert table.schema.field("prompt_token_ids").type == table.schema.field("completion_token_ids").type
    text_only = interaction_row(InteractionEvent(id="t", tenant="acme", completion="!", prompt="hello"), AT, 1000)
    assert text_only.prompt_token_ids is None


def test_feedback_and_dead_letter_rows():
    fb = feedback_row(FeedbackEvent(id="r", tenant="acme", score=-1.0, source="thumbs"), AT, 5)
    assert (fb.score, fb.source, fb.ingested_at) == (-1.0, "thumbs", 5)
    dl = dead_letter_row(DeadLetter("not_json", "bad"), b"x" * (RAW_PREFIX_BYTES + 10), AT, 5)
    assert dl.tenant == "_unknown" and len(dl.raw) == RAW_PREFIX_BYTES
    table = to_table([dl], DeadLetterRow)
    assert table.column("reason").to_pylist() == ["not_json"]


@pytest.mark.parametrize("reason", ["bad_field", "scorer_error", "unknown_tenant"])
def test_a_dead_letter_detail_holding_a_lone_surrogate_is_kept_escaped(reason):
    """Whatever its reason, a detail quoting a lone surrogate could neither go into Arrow's UTF-8 column
    (the batch's write failed, and every replay of it) nor into the dead-letter topic's header."""
    dl = dead_letter_row(DeadLetter(reason, "no number: \ud83d oops, é"), b"{}", AT, 5)
    assert dl.detail == "no number: \\ud83d oops, é"
    assert to_table([dl], DeadLetterRow).column("detail").to_pylist() == [dl.detail]
    assert dl.detail.encode() == b"no number: \\ud83d oops, \xc3\xa9"  # what the clora.detail header carries


def test_write_rows_one_file_per_tenant_with_rows_in_arrival_order(tmp_path):
    def row(tenant, id_, offset):
        ev = InteractionEvent(id=id_, tenant=tenant, completion="c", prompt="p")
        return interaction_row(ev, Coords("clora.interactions", 0, offset), ingested_at=1)

    rows = [row("globex", "g1", 0), row("acme", "a1", 1), row("globex", "g2", 2), row("acme", "a2", 3), row("acme", "a0", 4)]
    part = DatasetRows("interactions", InteractionRow, rows, [(r.tenant, r.id) for r in rows])
    paths = write_rows(str(tmp_path), part, {("clora.interactions", 0): (0, 4)})
    assert [p.parent.name for p in paths] == ["tenant=acme", "tenant=globex"]
    assert [pq.read_table(p).column("id").to_pylist() for p in paths] == [["a1", "a2", "a0"], ["g1", "g2"]]
    assert [p.name for p in paths] == [batch_file_id({("clora.interactions", 0): (0, 4)}, part.keys) + ".parquet"] * 2
