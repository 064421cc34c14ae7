"""storage.compact: fewer files, same rows, even while ingest writes and readers read, and across crashes."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from storage import hashindex, parquet
from storage.compact import compact, compact_partition
from storage.parquet import live_files, read_dataset, read_ids, write_dataset
from storage.query import query
from storage.schema import SchemaMismatch

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_floor_on_the_grace(request, monkeypatch):
    """These tests time the grace period themselves (0.3 s, 0); the floor under it has its own test."""
    if "floor" not in request.node.name:
        monkeypatch.setattr("storage.compact.MIN_GRACE_S", 0.0)


def _write_files(data_dir, make_trajectories, n_files: int, per_file: int = 4, tenant: str = "acme", prefix: str = "f"):
    ids = []
    for f in range(n_files):
        batch = [f"{prefix}{f:04d}-{k}" for k in range(per_file)]
        write_dataset(data_dir, "trajectories", make_trajectories(batch, tenant, start=f * per_file), file_id=f"{prefix}{f:04d}")
        ids += batch
    return ids


def _files_on_disk(data_dir, tenant="acme"):
    return sorted(p.name for p in (data_dir / "trajectories" / f"tenant={tenant}").iterdir())


def test_compaction_merges_files_and_keeps_rows(data_dir, make_trajectories):
    ids = _write_files(data_dir, make_trajectories, 10)
    _write_files(data_dir, make_trajectories, 3, tenant="globex")
    before = read_dataset(data_dir, "trajectories").sort_by("id")

    results = compact(data_dir, grace_s=0)
    merged = {(r.dataset, r.tenant): r for r in results}
    assert merged[("trajectories", "acme")].inputs == 10 and merged[("trajectories", "acme")].rows == 40
    assert merged[("trajectories", "globex")].inputs == 3
    names = _files_on_disk(data_dir)
    assert len(names) == 1 and names[0].startswith("compacted-")
    assert read_dataset(data_dir, "trajectories").sort_by("id").equals(before)
    assert {i for _, i in read_ids(data_dir, "trajectories", "acme")} == set(ids)

    # A replay of a compacted batch (ingest crashed before committing its offsets) is still a no-op.
    again = write_dataset(data_dir, "trajectories", make_trajectories(ids[:4], "acme"), file_id="f0000")
    assert again == [data_dir / "trajectories" / "tenant=acme" / names[0]]
    assert _files_on_disk(data_dir) == names
    assert read_dataset(data_dir, "trajectories", "acme").num_rows == 40

    # Nothing left to do the second time.
    assert sum(r.inputs for r in compact(data_dir, grace_s=0)) == 0


def test_compacting_compacted_files_keeps_replays_idempotent(data_dir, make_trajectories):
    _write_files(data_dir, make_trajectories, 3, prefix="a")
    compact(data_dir, "trajectories", grace_s=0)
    _write_files(data_dir, make_trajectories, 2, prefix="b")
    compact(data_dir, "trajectories", grace_s=0)
    assert len(_files_on_disk(data_dir)) == 1
    # a0001 went into the first compacted file, which went into the second: still recognised.
    write_dataset(data_dir, "trajectories", make_trajectories(["a0001-0"], "acme"), file_id="a0001")
    assert len(_files_on_disk(data_dir)) == 1
    assert read_dataset(data_dir, "trajectories").num_rows == 20


def test_a_compacted_footer_lists_its_superseded_names_once_and_in_the_parquet_metadata_only(data_dir,
                                                                                            make_trajectories):
    """Put in the table's schema metadata, the list was written twice (the serialized Arrow schema in the
    footer holds that metadata too): a day's merged file of a busy partition carried ~13 MB of footer."""
    import pyarrow.parquet as pq

    _write_files(data_dir, make_trajectories, 3, prefix="a")
    compact(data_dir, "trajectories", grace_s=0)
    _write_files(data_dir, make_trajectories, 2, prefix="b")
    compact(data_dir, "trajectories", grace_s=0)
    (name,) = _files_on_disk(data_dir)
    path = data_dir / "trajectories" / "tenant=acme" / name
    footer = pq.read_metadata(path).metadata
    first = parquet.read_supersedes(parquet.as_datadir(data_dir).filesystem, str(path))
    assert {n for n in first if not n.startswith("compacted-")} == {f"{p}{f:04d}.parquet" for p, f in
                                                                    (("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1))}
    import base64

    import pyarrow as pa

    stored_schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(footer[b"ARROW:schema"])))
    assert parquet.SUPERSEDES_KEY not in (stored_schema.metadata or {})
    assert read_dataset(data_dir, "trajectories").num_rows == 20


def test_a_large_merged_file_waits_until_the_files_beside_it_come_to_half_its_size(data_dir, make_trajectories,
                                                                                   monkeypatch):
    """Merged with whatever arrived since, a day's merged file (and train_steps', never closed) was rewritten
    whole at every run: a partition's history a run. Files now merge by tiers of size."""
    from types import SimpleNamespace

    from storage.compact import _worth_merging

    def files(*sizes):
        return [SimpleNamespace(base_name=f"f{i}", size=size) for i, size in enumerate(sizes)]

    assert [i.base_name for i in _worth_merging(files(1000, 10, 10))] == ["f1", "f2"]
    assert [i.base_name for i in _worth_merging(files(1000, 300, 200))] == ["f0", "f1", "f2"]
    assert [i.base_name for i in _worth_merging(files(1000, 100, 10, 10))] == ["f2", "f3"]  # tier by tier
    assert [i.base_name for i in _worth_merging(files(10, 12, 9))] == ["f0", "f1", "f2"]

    big = [f"big-{k}" for k in range(5000)]
    write_dataset(data_dir, "trajectories", make_trajectories(big), file_id="big")
    _write_files(data_dir, make_trajectories, 2, prefix="a")
    compact(data_dir, "trajectories", grace_s=0)
    merged = {r.dataset: r for r in compact(data_dir, "trajectories", grace_s=0)}
    assert "big.parquet" in _files_on_disk(data_dir) and len(_files_on_disk(data_dir)) == 2
    assert merged["trajectories"].inputs == 0  # nothing new: the two files stay as they are
    assert read_dataset(data_dir, "trajectories").num_rows == 5000 + 8

    # A file of two thirds of the target or more is no candidate at all: the rest of a batch could never
    # come to half of it, and its footer was read at every run for nothing.
    import storage.compact as compact_module

    size = (data_dir / "trajectories" / "tenant=acme" / "big.parquet").stat().st_size
    read = []
    real = compact_module._footer_of
    monkeypatch.setattr(compact_module, "_footer_of", lambda dd, ds, info: read.append(info.base_name) or real(dd, ds, info))
    _write_files(data_dir, make_trajectories, 2, prefix="b")
    compact_partition(data_dir, "trajectories", "acme", grace_s=0, target_bytes=size * 3 // 2)
    assert "big.parquet" not in read and {"b0000.parquet", "b0001.parquet"} <= set(read)


def test_inputs_stay_for_the_grace_period_but_are_not_read(data_dir, make_trajectories):
    _write_files(data_dir, make_trajectories, 4)
    first = compact_partition(data_dir, "trajectories", "acme", grace_s=3600)
    assert (first.inputs, first.removed, first.waiting) == (4, 0, 4)
    assert len(_files_on_disk(data_dir)) == 5
    assert read_dataset(data_dir, "trajectories").num_rows == 16
    assert query(data_dir, "select count(*) as n from trajectories").to_pylist() == [{"n": 16}]
    later = compact_partition(data_dir, "trajectories", "acme", grace_s=0)
    assert (later.inputs, later.removed, later.waiting) == (0, 4, 0)
    assert len(_files_on_disk(data_dir)) == 1


def test_inputs_go_no_sooner_than_the_floor_after_their_merge_even_with_no_grace(data_dir, make_trajectories):
    """A reader lists a partition by reading the directory, then looking at each entry: deleted at once with
    grace 0, the inputs of a merge were gone by its looks, and the merged file, renamed in after its reading,
    was not there either. `clora compact --grace 0` still returns with them gone, MIN_GRACE_S later."""
    from storage.compact import MIN_GRACE_S

    _write_files(data_dir, make_trajectories, 4)
    one = compact_partition(data_dir, "trajectories", "acme", grace_s=0)
    assert (one.inputs, one.removed, one.waiting) == (4, 0, 4) and len(_files_on_disk(data_dir)) == 5
    _write_files(data_dir, make_trajectories, 3, prefix="g")
    started = time.monotonic()
    (run,) = [r for r in compact(data_dir, "trajectories", grace_s=0) if r.tenant == "acme"]
    assert time.monotonic() - started >= MIN_GRACE_S
    assert (run.removed, run.waiting) == (4 + 4, 0) and len(_files_on_disk(data_dir)) == 1
    assert read_dataset(data_dir, "trajectories").num_rows == 28


def test_grace_period_counts_from_the_first_merge(data_dir, make_trajectories):
    """Each run re-merges the (small) compacted file with new files; that must not postpone deletes for ever."""
    _write_files(data_dir, make_trajectories, 3, prefix="a")
    first = compact_partition(data_dir, "trajectories", "acme", grace_s=0.3)
    assert (first.inputs, first.removed, first.waiting) == (3, 0, 3)
    _write_files(data_dir, make_trajectories, 2, prefix="b")
    time.sleep(0.35)
    second = compact_partition(data_dir, "trajectories", "acme", grace_s=0.3)
    # a* have been superseded since the first run: deleted; the first merged file and b* only just now.
    assert (second.inputs, second.removed, second.waiting) == (3, 3, 3)
    assert read_dataset(data_dir, "trajectories").num_rows == 20


def test_target_size_splits_output_and_skips_large_files(data_dir, make_trajectories):
    _write_files(data_dir, make_trajectories, 8)
    size = max(p.stat().st_size for p in (data_dir / "trajectories" / "tenant=acme").glob("f*.parquet"))
    result = compact_partition(data_dir, "trajectories", "acme", target_bytes=size * 4 + 1)
    assert result.inputs == 8 and len(result.outputs) == 2
    assert read_dataset(data_dir, "trajectories").num_rows == 32


# ---------------------------------------------------------------------------------------------------------
# one UTC day per merged file (what lets retention delete a quiet partition's old rows)

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)  # conftest.trajectories(start=s): row k is ingested at T0 + s + k s
DAY = 86_400


def _days_of_live_files(data_dir, tenant="acme") -> dict[str, set[int]]:
    """live file name -> the UTC days (since T0) of its rows."""
    base = round(T0.timestamp() * 1000)
    out = {}
    for path in live_files(data_dir, "trajectories", tenant):
        at = parquet.read_file(parquet.as_datadir(data_dir), path, ["ingested_at"]).column(0).cast("int64").to_pylist()
        out[path.rsplit("/", 1)[1]] = {(ms - base) // (DAY * 1000) for ms in at}
    return out


def test_files_of_two_days_are_merged_per_day_never_across(data_dir, make_trajectories):
    # In name order the days alternate; e0 spans midnight (T0 + 1 day - 2 s .. + 1 s): it belongs to day 1,
    # the day of its newest row.
    for name, start in (("a0", 0), ("a1", DAY + 10), ("a2", 100), ("a3", DAY + 200), ("e0", DAY - 2)):
        write_dataset(data_dir, "trajectories", make_trajectories([f"{name}-{k}" for k in range(4)], start=start), file_id=name)
    (r,) = compact(data_dir, "trajectories", grace_s=0)
    assert (r.inputs, len(r.outputs), r.rows) == (5, 2, 20)
    days = _days_of_live_files(data_dir)
    assert sorted(days.values(), key=min) == [{0}, {0, 1}]
    day0 = next(n for n, d in days.items() if d == {0})
    day0_ids = parquet.read_file(parquet.as_datadir(data_dir), str(data_dir / "trajectories" / "tenant=acme" / day0), ["id"])
    assert sorted(day0_ids.column(0).to_pylist()) == [f"{n}-{k}" for n in ("a0", "a2") for k in range(4)]

    # A new file of day 1 is merged with day 1's file only; day 0's is left as it is, for good.
    write_dataset(data_dir, "trajectories", make_trajectories(["b0-0"], start=DAY + 500), file_id="b0")
    (r,) = compact(data_dir, "trajectories", grace_s=0)
    assert (r.inputs, len(r.outputs)) == (2, 1)
    assert day0 in _days_of_live_files(data_dir) and len(live_files(data_dir, "trajectories")) == 2
    assert sum(r.inputs for r in compact(data_dir, "trajectories", grace_s=0)) == 0
    assert read_dataset(data_dir, "trajectories").num_rows == 21


def test_a_file_without_statistics_is_dated_by_its_rows_and_one_without_rows_joins_the_newest_day(
    data_dir, make_trajectories, caplog
):
    import pyarrow.parquet as pq

    directory = data_dir / "trajectories" / "tenant=acme"
    write_dataset(data_dir, "trajectories", make_trajectories(["a0-0", "a0-1"], start=0), file_id="a0")
    write_dataset(data_dir, "trajectories", make_trajectories(["b0-0", "b0-1"], start=DAY), file_id="b0")
    pq.write_table(make_trajectories(["n-0", "n-1"], start=50), directory / "nostats.parquet", write_statistics=False)
    pq.write_table(make_trajectories(["x"], start=3 * DAY).slice(0, 0), directory / "empty.parquet")
    (directory / "broken.parquet").write_bytes(b"PAR1 not really")

    (r,) = compact(data_dir, "trajectories", grace_s=0)
    assert (r.inputs, len(r.outputs), r.rows, r.left_out) == (4, 2, 6, 1)
    assert "1 files left out" in str(r)
    assert "broken.parquet" in caplog.text and "tenant=acme" in caplog.text
    # a0 + nostats (day 0) and b0 + empty (the newest day) were merged; broken is left where it was
    on_disk = _files_on_disk(data_dir)
    assert on_disk[0] == "broken.parquet" and len(on_disk) == 3
    (directory / "broken.parquet").unlink()
    assert sorted(_days_of_live_files(data_dir).values(), key=min) == [{0}, {1}]
    assert sorted(read_dataset(data_dir, "trajectories").column("id").to_pylist()) == ["a0-0", "a0-1", "b0-0", "b0-1", "n-0", "n-1"]


def test_datasets_without_an_ingest_time_are_merged_by_size_alone(data_dir, make_train_steps):
    """train_steps (the learner's) has no ingested_at and is not pruned: its days may share a file."""
    for step in (1, 2, 3):
        write_dataset(data_dir, "train_steps", make_train_steps("acme", [step * DAY]), file_id=f"step-{step:020d}")
    (r,) = compact(data_dir, "train_steps", grace_s=0)
    assert (r.inputs, len(r.outputs), r.rows) == (3, 1, 3)


def test_each_footer_is_read_once_per_process(data_dir, make_trajectories, monkeypatch):
    """A day's compacted files stay under the target (zstd makes them smaller than their inputs) and are
    candidates at every run: their footers are read once, not at every run."""
    from storage import compact as compact_module

    opened = []
    real = compact_module._footer_of
    monkeypatch.setattr(compact_module, "_footer_of", lambda dd, dataset, info: opened.append(info.base_name) or real(dd, dataset, info))
    _write_files(data_dir, make_trajectories, 3, prefix="a")
    compact(data_dir, "trajectories", grace_s=0)
    assert len(opened) == 3
    _write_files(data_dir, make_trajectories, 1, prefix="b")
    compact(data_dir, "trajectories", grace_s=0)
    assert len(opened) == 3 + 2  # the first run's merged file and b0000
    compact(data_dir, "trajectories", grace_s=0)
    assert len(opened) == 3 + 2 + 1  # the second run's merged file


def test_files_a_newer_clora_wrote_are_left_out_not_stripped_of_what_this_version_does_not_know(
    data_dir, make_trajectories, caplog
):
    """A rolling upgrade: a newer clora added a nullable column (or bumped the schema version). Merging its
    files here would drop what this version cannot carry, for good once the inputs are deleted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage.schema import SCHEMA_VERSION, TRAJECTORIES, VERSION_KEY, conform

    directory = data_dir / "trajectories" / "tenant=acme"
    _write_files(data_dir, make_trajectories, 2, prefix="old")
    newer = conform(make_trajectories(["n-0", "n-1"], start=10), TRAJECTORIES)
    newer = newer.append_column("judge_notes", pa.array(["fine", "terse"]))
    pq.write_table(newer, directory / "newcol.parquet")
    bumped = conform(make_trajectories(["v-0"], start=20), TRAJECTORIES)
    pq.write_table(bumped.replace_schema_metadata({VERSION_KEY: str(SCHEMA_VERSION + 1).encode()}), directory / "v2.parquet")

    for run in range(2):
        caplog.clear()
        (r,) = compact(data_dir, "trajectories", grace_s=0)
        assert (r.inputs, r.left_out) == ((2, 2), (0, 2))[run]
        warnings = [m.getMessage() for m in caplog.records if m.levelname == "WARNING"]
        assert len(warnings) == 2, "once per file and run"
        assert any("trajectories/tenant=acme" in w and "newcol.parquet" in w and "judge_notes" in w for w in warnings)
        assert any("trajectories/tenant=acme" in w and "v2.parquet" in w and "schema version 2" in w for w in warnings)
    assert pq.read_table(directory / "newcol.parquet").column("judge_notes").to_pylist() == ["fine", "terse"]
    assert {p.rsplit("/", 1)[1] for p in live_files(data_dir, "trajectories")} >= {"newcol.parquet", "v2.parquet"}
    with pytest.raises(SchemaMismatch, match="v2.parquet: schema version 2 is newer than this version's 1.*upgrade "
                                             "this clora"):
        read_dataset(data_dir, "trajectories")  # a breaking change: not read as if it were this version's
    (directory / "v2.parquet").unlink()
    assert read_dataset(data_dir, "trajectories").num_rows == 8 + 2, "a newer file's added column is only dropped"


CRASH_BETWEEN_RENAME_AND_DELETE = r"""
import os, pathlib, sys
import storage.compact
from storage.compact import compact_partition

storage.compact.MIN_GRACE_S = 0.0  # deleted in this run: it dies there

unlink = pathlib.Path.unlink

def die(self, missing_ok=False):    # the merged file is in place; the process dies before deleting an input
    if not self.name.startswith("."):
        os._exit(9)
    unlink(self, missing_ok=missing_ok)

pathlib.Path.unlink = die
compact_partition(sys.argv[1], "trajectories", "acme", grace_s=0)
"""


def test_crash_between_merge_and_delete_double_counts_nothing(data_dir, make_trajectories, python_subprocess, monkeypatch):
    run, _ = python_subprocess
    ids = _write_files(data_dir, make_trajectories, 5)
    result = run(CRASH_BETWEEN_RENAME_AND_DELETE, str(data_dir))
    assert result.returncode == 9, result.stderr
    on_disk = _files_on_disk(data_dir)
    assert len(on_disk) == 6 and on_disk[0].startswith("compacted-"), "merged file and all inputs are on disk"

    # Every reader counts each row once.
    assert live_files(data_dir, "trajectories") == [str(data_dir / "trajectories" / "tenant=acme" / on_disk[0])]
    assert read_dataset(data_dir, "trajectories").num_rows == len(ids)
    assert query(data_dir, "select count(*) as n, count(distinct id) as d from trajectories").to_pylist() == [
        {"n": len(ids), "d": len(ids)}
    ]

    # More data arrives; a compaction that (say) crashes again before cleaning up merges the old merged
    # file with it: the new file must also supersede the leftovers of the first one.
    more = _write_files(data_dir, make_trajectories, 2, prefix="g")
    with monkeypatch.context() as patched:
        patched.setattr("storage.compact._remove_superseded", lambda *args: (0, 0))
        compact_partition(data_dir, "trajectories", "acme", grace_s=0)
    assert len(live_files(data_dir, "trajectories")) == 1
    assert len(_files_on_disk(data_dir)) == 1 + 1 + 5 + 2, "both merged files and every input are on disk"
    assert {i for _, i in read_ids(data_dir, "trajectories")} == set(ids + more)
    assert read_dataset(data_dir, "trajectories").num_rows == len(ids + more)

    # The next run deletes the leftovers.
    cleaned = compact_partition(data_dir, "trajectories", "acme", grace_s=0)
    assert cleaned.removed == 5 + 3, "the first run's inputs and the second run's"
    assert len(_files_on_disk(data_dir)) == 1
    assert read_dataset(data_dir, "trajectories").num_rows == len(ids + more)


def test_compaction_under_concurrent_writes_loses_and_duplicates_nothing(data_dir, make_trajectories):
    """Ingest writes (and replays) files, a compactor runs in a loop, readers check every snapshot."""
    n_files, per_file = 120, 5
    written: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def ingest():
        try:
            for f in range(n_files):
                batch = [f"id{f:04d}-{k}" for k in range(per_file)]
                tenant = "acme" if f % 3 else "globex"
                write_dataset(data_dir, "trajectories", make_trajectories(batch, tenant, start=f), file_id=f"b{f:04d}")
                written.extend((tenant, i) for i in batch)
                if f % 7 == 0 and f:  # a replay of an earlier batch, which may be compacted by now
                    g = f // 3  # old enough to be compacted and, after the grace period, deleted
                    old = make_trajectories([f"id{g:04d}-{k}" for k in range(per_file)], "acme" if g % 3 else "globex", start=g)
                    write_dataset(data_dir, "trajectories", old, file_id=f"b{g:04d}")
                time.sleep(0.002)
        except BaseException as e:
            errors.append(e)

    compactions = []

    def compactor():
        try:
            while not stop.is_set():
                compactions.extend(compact(data_dir, "trajectories", min_files=2, grace_s=0.2))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=ingest), threading.Thread(target=compactor)]
    for t in threads:
        t.start()
    checks = 0
    previous: set = set()
    try:
        while threads[0].is_alive():
            table = read_dataset(data_dir, "trajectories")
            keys = list(zip(table.column("tenant").to_pylist(), table.column("id").to_pylist()))
            assert len(keys) == len(set(keys)), "a reader saw a row twice"
            assert previous <= set(keys), "a reader lost rows it had seen before"
            previous = set(keys)
            counts = query(data_dir, "select count(*) as n, count(distinct tenant || '/' || id) as d from trajectories")
            n, d = counts.column("n")[0].as_py(), counts.column("d")[0].as_py()
            assert n == d and n >= len(previous), "a query saw a row twice or lost one"
            checks += 1
    finally:
        threads[0].join()
        stop.set()
        threads[1].join()
    assert not errors, errors
    assert checks > 5

    assert sum(r.removed for r in compactions) > 0, "inputs were deleted while readers were reading"
    compact(data_dir, "trajectories", grace_s=0)
    assert read_ids(data_dir, "trajectories") == set(written)
    assert read_dataset(data_dir, "trajectories").num_rows == n_files * per_file
    for tenant in ("acme", "globex"):  # every merged input is gone; what is left is live (merging goes by tiers:
        # a merged file waits for the small files beside it to come to half its size, so it may stand beside one)
        live = sorted(Path(p).name for p in live_files(data_dir, "trajectories", tenant))
        assert _files_on_disk(data_dir, tenant) == live and any(n.startswith("compacted-") for n in live)


# ---------------------------------------------------------------------------------------------------------
# what a write costs once the partition has a history


class _CountedNames(tuple):
    """A footer's names that count how often they are gone through."""

    passes = 0

    def __iter__(self):
        type(self).passes += 1
        return super().__iter__()


def test_writes_and_listings_after_compaction_do_not_go_through_the_superseded_names(data_dir, make_trajectories, monkeypatch):
    """Each write checks that no compacted file supersedes its name: a lookup, not a pass over every name the
    partition's compacted files list (which grows with every file ever written there)."""
    real = parquet.read_supersedes
    reads: dict[str, int] = {}

    def counted(fs, path):
        reads[path] = reads.get(path, 0) + 1
        return _CountedNames(real(fs, path))

    monkeypatch.setattr(parquet, "read_supersedes", counted)
    for round_ in range(3):  # each compacted file is merged into the next one
        _write_files(data_dir, make_trajectories, 4, prefix=f"r{round_}f")
        compact(data_dir, "trajectories", grace_s=0)
    assert len(_files_on_disk(data_dir)) == 1
    assert max(reads.values()) <= 2, "a footer is read once by the index (and once more when merged)"

    _CountedNames.passes = 0
    for f in range(30):
        write_dataset(data_dir, "trajectories", make_trajectories([f"new{f}"], "acme"), file_id=f"new{f:04d}")
        assert len(live_files(data_dir, "trajectories", "acme")) == f + 2
    assert _CountedNames.passes == 0
    assert read_dataset(data_dir, "trajectories").num_rows == 3 * 4 * 4 + 30
    # A replay of a name the last compacted file carries over from the first is still recognised.
    again = write_dataset(data_dir, "trajectories", make_trajectories(["r0f0001-0"], "acme"), file_id="r0f0001")
    assert again[0].name.startswith("compacted-") and read_dataset(data_dir, "trajectories").num_rows == 3 * 4 * 4 + 30


def test_superseded_names_are_told_apart_even_when_their_hashes_partly_collide(data_dir, make_trajectories, monkeypatch):
    """Names whose first 64 hash bits collide (here: all of them) are still told apart by the other 64, and
    the index's small array is merged into its large one along the way."""
    real = parquet.hash_strings
    monkeypatch.setattr(parquet, "hash_strings", lambda names: (np.zeros(len(names), dtype=np.int64), real(names)[1]))
    monkeypatch.setattr(hashindex, "MIN_MERGE", 2)
    ids = []
    for round_ in range(3):
        ids += _write_files(data_dir, make_trajectories, 3, prefix=f"r{round_}f")
        compact(data_dir, "trajectories", grace_s=0)
        assert len(_files_on_disk(data_dir)) == 1
    # every old name is a no-op; a new one is written and read
    for round_ in range(3):
        for f in range(3):
            write_dataset(data_dir, "trajectories", make_trajectories([f"r{round_}f{f:04d}-0"], "acme"), file_id=f"r{round_}f{f:04d}")
    assert len(_files_on_disk(data_dir)) == 1
    write_dataset(data_dir, "trajectories", make_trajectories(["fresh"], "acme"), file_id="r0f0003")
    assert len(live_files(data_dir, "trajectories", "acme")) == 2
    assert {i for _, i in read_ids(data_dir, "trajectories")} == set(ids) | {"fresh"}


def test_superseded_by_names_the_compacted_file_holding_a_deleted_files_rows(data_dir, make_trajectories):
    _write_files(data_dir, make_trajectories, 3)
    gone = data_dir / "trajectories" / "tenant=acme" / "f0001.parquet"
    compact(data_dir, "trajectories", grace_s=0)
    assert not gone.exists()
    (merged,) = live_files(data_dir, "trajectories", "acme")
    assert parquet.superseded_by(data_dir, gone) == merged
    assert parquet.superseded_by(data_dir, gone.with_name("never-written.parquet")) is None
    assert parquet.superseded_by(data_dir, merged) is None


def test_a_stray_directory_among_the_cursors_does_not_stop_the_others_folding(data_dir):
    from storage.cursors import Cursors

    (data_dir / "cursors" / "_stray copy").mkdir(parents=True)  # not a tenant name
    cursors = Cursors(data_dir, keep_checkpoints=1)
    for s in (1, 2):
        cursors.commit("zeta", step=s, ids=[f"z{s}"], checkpoint=lambda d: (d / "w").write_text("x"))
    compact(data_dir)
    assert [p.name for p in (data_dir / "cursors" / "zeta").iterdir() if p.name.startswith("trained-")]


def _damage(path) -> bytes:
    """Cuts the footer off `path` (a bad copy, a failing disk); returns the bytes it had."""
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    return data


def test_a_compacted_file_that_cannot_be_read_stops_no_one_and_double_counts_nothing_once_restored(
    data_dir, make_trajectories, caplog
):
    """Its footer used to be read by every listing and write of its partition, and its error stopped them
    all: ingest's start (every tenant), every query and the whole compaction run."""
    acme = _write_files(data_dir, make_trajectories, 3, prefix="a")
    globex = _write_files(data_dir, make_trajectories, 2, tenant="globex")
    compact(data_dir, "trajectories", grace_s=3600)  # inputs stay on disk for the grace period
    (merged,) = (data_dir / "trajectories" / "tenant=acme").glob("compacted-*.parquet")
    original = _damage(merged)
    parquet._indexes.clear()  # as a process started now

    with caplog.at_level("WARNING", logger="storage.parquet"):
        assert sorted(read_ids(data_dir, "trajectories")) == sorted(
            [("acme", i) for i in acme] + [("globex", i) for i in globex]
        ), "its inputs, still on disk, are read in its place"
        live_files(data_dir, "trajectories")
    logged = [r.getMessage() for r in caplog.records if merged.name in r.getMessage()]
    assert len(logged) == 1 and "cannot be read" in logged[0], "logged once, not at every listing"
    assert str(merged) not in live_files(data_dir, "trajectories")
    assert parquet.unreadable_files(data_dir, "trajectories") == [str(merged)]
    assert query(data_dir, "select count(*) as n from trajectories").to_pylist() == [{"n": 20}]

    time.sleep(0.05)  # written after it: files it cannot hold
    late = _write_files(data_dir, make_trajectories, 2, prefix="late")
    results = {r.tenant: r for r in compact(data_dir, "trajectories", grace_s=0)}
    # Nothing merged, the late files included: its time cannot tell which files it holds (a restore with
    # other times, a clock moved; with the inputs merged again, a restore would count their rows twice).
    assert results["acme"].inputs == 0 and results["acme"].left_out == 6, "it, its 3 inputs and the 2 late files"
    assert results["globex"].inputs == 0 and not results["globex"].skipped
    assert len(read_ids(data_dir, "trajectories", "acme")) == 3 * 4 + 2 * 4

    merged.write_bytes(original)  # restored from a backup
    ids = read_dataset(data_dir, "trajectories", "acme").column("id").to_pylist()
    assert sorted(ids) == sorted(acme + late), "each row once: nothing it holds was merged again"
    results = {r.tenant: r for r in compact(data_dir, "trajectories", grace_s=0)}
    assert results["acme"].left_out == 0 and results["acme"].inputs == 1 + 2, "it and the late files merge once back"
    assert results["acme"].rows == 20 and results["acme"].removed == 3 + 1 + 2, "its inputs, then what was merged"
    assert sorted(read_dataset(data_dir, "trajectories", "acme").column("id").to_pylist()) == sorted(acme + late)


def test_a_compacted_file_that_goes_bad_in_place_is_dropped_from_what_a_process_knows(data_dir, make_trajectories):
    ids = _write_files(data_dir, make_trajectories, 3)
    compact(data_dir, "trajectories", grace_s=3600)
    assert len(live_files(data_dir, "trajectories")) == 1  # this process has read its footer
    (merged,) = (data_dir / "trajectories" / "tenant=acme").glob("compacted-*.parquet")
    _damage(merged)
    assert sorted(read_ids(data_dir, "trajectories")) == sorted(("acme", i) for i in ids)
    assert len(live_files(data_dir, "trajectories")) == 3


def test_a_full_disk_still_frees_what_earlier_runs_merged_and_fails_each_partition_on_its_own(
    data_dir, make_trajectories, monkeypatch
):
    """The merge came before the deletes, and the first partition's error ended the run: a full disk kept
    every superseded input of every partition on disk."""
    import errno

    for tenant in ("acme", "globex"):
        _write_files(data_dir, make_trajectories, 3, tenant=tenant, prefix="a")
        compact_partition(data_dir, "trajectories", tenant, grace_s=3600)  # merged; inputs wait for their grace
        _write_files(data_dir, make_trajectories, 2, tenant=tenant, prefix="b")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("storage.compact.pq.ParquetWriter", full)
    results = {r.tenant: r for r in compact(data_dir, "trajectories", grace_s=0)}
    for tenant in ("acme", "globex"):
        assert results[tenant].removed == 3 and results[tenant].inputs == 0
        assert "No space left on device" in results[tenant].error and "failed" in str(results[tenant])
        assert len(_files_on_disk(data_dir, tenant)) == 1 + 2, "the merged file and the new ones"
        assert len(read_ids(data_dir, "trajectories", tenant)) == 5 * 4
    monkeypatch.undo()
    assert all(r.error is None and r.inputs == 3 for r in compact(data_dir, "trajectories", grace_s=0))


def test_an_input_whose_rows_cannot_be_read_is_left_out_and_the_rest_merged_now_and_later(
    data_dir, make_trajectories, caplog
):
    """Its footer reads, so it passed the footer checks, and the merge of its batch failed at every run."""
    import struct

    ids = _write_files(data_dir, make_trajectories, 4)
    damaged = data_dir / "trajectories" / "tenant=acme" / "f0001.parquet"
    data = bytearray(damaged.read_bytes())
    data_end = len(data) - 8 - struct.unpack("<I", data[-8:-4])[0]
    data[4:data_end] = b"\xab" * (data_end - 4)  # its pages, not its footer
    damaged.write_bytes(bytes(data))

    first = compact_partition(data_dir, "trajectories", "acme", grace_s=0)
    assert (first.inputs, first.left_out, first.error) == (3, 1, None)
    more = _write_files(data_dir, make_trajectories, 2, prefix="g")
    with caplog.at_level("WARNING", logger="storage.compact"):
        second = compact_partition(data_dir, "trajectories", "acme", grace_s=0)
    assert (second.inputs, second.left_out, second.error) == (3, 1, None), "the merged file and g*; not it"
    assert "f0001.parquet is unreadable, left out" in caplog.text
    merged, left = _files_on_disk(data_dir)
    assert left == "f0001.parquet" and merged == second.outputs[0]
    rows = parquet.read_file(parquet.as_datadir(data_dir), str(data_dir / "trajectories" / "tenant=acme" / merged))
    assert sorted(rows.column("id").to_pylist()) == sorted(ids[:4] + ids[8:] + more)


def test_a_cursor_that_cannot_be_folded_does_not_stop_the_others(data_dir, monkeypatch):
    from storage.cursors import Cursors

    cursors = Cursors(data_dir, keep_checkpoints=1)
    for tenant in ("acme", "globex"):
        for s in (1, 2):
            cursors.commit(tenant, step=s, ids=[f"{tenant}{s}"], checkpoint=lambda d: (d / "w").write_text("x"))
    fold = Cursors.compact

    def fails_for_acme(self, tenant):
        if tenant == "acme":
            raise OSError(28, "No space left on device")
        return fold(self, tenant)

    monkeypatch.setattr(Cursors, "compact", fails_for_acme)
    (failed,) = [r for r in compact(data_dir) if r.error]
    assert (failed.dataset, failed.tenant) == ("cursors", "acme") and "No space left" in str(failed)
    assert [p.name for p in (data_dir / "cursors" / "globex").iterdir() if p.name.startswith("trained-")]


def test_a_dataset_whose_tenants_cannot_be_listed_does_not_stop_the_others(data_dir, make_trajectories):
    """A file in the place of a dataset's directory (or EACCES, EIO on it) is that dataset's error: the
    datasets after it are compacted and the cursors folded all the same."""
    import shutil

    from storage.cursors import Cursors

    interactions = data_dir / "interactions"  # the first dataset compacted
    if interactions.exists():
        shutil.rmtree(interactions)
    interactions.write_text("not a directory")
    _write_files(data_dir, make_trajectories, 3)
    cursors = Cursors(data_dir, keep_checkpoints=1)
    for s in (1, 2):
        cursors.commit("acme", step=s, ids=[f"acme{s}"], checkpoint=lambda d: (d / "w").write_text("x"))

    results = compact(data_dir, grace_s=0)
    (failed,) = [r for r in results if r.error]
    assert (failed.dataset, failed.tenant) == ("interactions", "") and "NotADirectoryError" in failed.error
    assert str(failed).startswith("interactions: failed: NotADirectoryError")
    assert {(r.dataset, r.tenant): r.inputs for r in results}[("trajectories", "acme")] == 3
    assert [p.name for p in (data_dir / "cursors" / "acme").iterdir() if p.name.startswith("trained-")], \
        "the cursor was folded"


def test_the_grace_period_counts_from_when_the_merged_file_appeared_not_from_its_first_byte(
    data_dir, make_trajectories, monkeypatch
):
    import os

    import pyarrow.parquet as pq

    _write_files(data_dir, make_trajectories, 3)
    write = pq.write_table

    def slow(table, where, **kwargs):  # as if writing it had taken an hour
        write(table, where, **kwargs)
        os.utime(where, (time.time() - 3600, time.time() - 3600))

    monkeypatch.setattr("storage.compact.pq.write_table", slow)
    assert compact_partition(data_dir, "trajectories", "acme", grace_s=60).inputs == 3
    monkeypatch.undo()
    later = compact_partition(data_dir, "trajectories", "acme", grace_s=60)
    assert (later.removed, later.waiting) == (0, 3), "readers that listed before it appeared keep their files"


def test_failures_are_the_callers_to_report_with_their_tracebacks_logged_at_debug(
        data_dir, make_trajectories, monkeypatch, caplog):
    """`clora compact` prints each failed result on stderr; an ERROR log with a traceback above it (each run
    of the compactor loop) buried that line, and logging the result too said it twice."""
    from storage import compact as compact_module
    from storage.cursors import Cursors

    (data_dir / "interactions").write_text("not a directory")
    _write_files(data_dir, make_trajectories, 2)
    cursors = Cursors(data_dir, keep_checkpoints=1)
    for s in (1, 2):
        cursors.commit("acme", step=s, ids=[f"acme{s}"], checkpoint=lambda d: (d / "w").write_text("x"))

    def no_space(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compact_module, "_merge", no_space)
    monkeypatch.setattr(Cursors, "compact", no_space)
    caplog.set_level("DEBUG", logger="storage.compact")
    failed = [r.where for r in compact(data_dir, grace_s=0) if r.error]
    assert failed == ["interactions", "trajectories/tenant=acme", "cursors/tenant=acme"]
    with_traceback = [r.getMessage() for r in caplog.records if r.exc_info]
    assert with_traceback == ["listing the tenants of interactions failed",
                              "compaction of trajectories/tenant=acme failed", "folding the cursor of acme failed"]
    assert all(r.levelname == "DEBUG" for r in caplog.records if r.exc_info or "failed" in r.getMessage())
