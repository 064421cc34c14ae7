"""storage.cursors: trained ids committed atomically with the checkpoint, untrained/backlog, compaction."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.compute as pc
import pytest

import storage.cursors as cursors_module
from storage.compact import compact
from storage.cursors import CursorError, Cursors
from storage.hashindex import HashIndex
from storage.parquet import live_files, read_dataset, write_dataset

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_fold_grace(request, monkeypatch):
    """These tests look at a fold's result at once; the grace before its replaced files go has its own test."""
    if "fold_grace" not in request.node.name:
        monkeypatch.setattr(cursors_module, "FOLD_GRACE_S", 0.0)

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)  # conftest.trajectories(): row k is ingested at T0 + start + k seconds


def _checkpoint(tag: str):
    def write(d):
        (d / "adapter_model.safetensors").write_bytes(tag.encode())
        (d / "optimizer.pt").write_bytes(b"adam " + tag.encode())

    return write


def _ingest(data_dir, make_trajectories, tenant: str, n_files: int, per_file: int = 3) -> list[str]:
    """Writes n_files small trajectory files (ingested in id order); returns all ids."""
    ids = []
    for f in range(n_files):
        batch = [f"{tenant}-{f * per_file + k:03d}" for k in range(per_file)]
        write_dataset(data_dir, "trajectories", make_trajectories(batch, tenant, start=f * per_file), file_id=f"f{f:03d}")
        ids += batch
    return ids


def test_untrained_is_oldest_first_and_excludes_trained(data_dir, make_trajectories):
    ids = _ingest(data_dir, make_trajectories, "acme", 4)
    cursors = Cursors(data_dir)
    untrained = cursors.untrained("acme")
    assert untrained.column("id").to_pylist() == ids
    assert untrained.column("completion").to_pylist()[0] == f"completion {ids[0]}", "whole rows, not just ids"
    assert cursors.untrained("acme", limit=5).column("id").to_pylist() == ids[:5]

    cursors.commit("acme", step=1, ids=ids[:5], checkpoint=_checkpoint("s1"))
    assert cursors.trained_ids("acme") == set(ids[:5])
    assert cursors.untrained("acme", limit=4).column("id").to_pylist() == ids[5:9]
    assert cursors.untrained("acme").column("id").to_pylist() == ids[5:]
    assert Cursors(data_dir).untrained("acme").column("id").to_pylist() == ids[5:], "a fresh process agrees"


def test_backlog_counts_untrained_per_tenant(data_dir, make_trajectories):
    acme = _ingest(data_dir, make_trajectories, "acme", 3)
    _ingest(data_dir, make_trajectories, "globex", 1)
    cursors = Cursors(data_dir)
    assert cursors.backlog() == {"acme": 9, "globex": 3}
    cursors.commit("acme", step=1, ids=acme[:4], checkpoint=_checkpoint("s1"))
    assert cursors.backlog() == {"acme": 5, "globex": 3}
    write_dataset(data_dir, "trajectories", make_trajectories(["late"], "globex", start=100), file_id="late")
    assert cursors.backlog() == {"acme": 5, "globex": 4}, "new files are seen by the same instance"


def test_a_shard_asks_only_for_its_own_tenants_backlog(data_dir, make_trajectories):
    _ingest(data_dir, make_trajectories, "acme", 3)
    _ingest(data_dir, make_trajectories, "globex", 1)
    cursors = Cursors(data_dir)
    assert cursors.backlog() == {"acme": 9, "globex": 3}
    assert cursors.backlog(include=lambda t: t == "globex") == {"globex": 3}
    assert set(cursors._backlogs) == {"globex"}, "what it kept of acme is let go"
    assert cursors.backlog() == {"acme": 9, "globex": 3}, "and read again when asked for"


def test_commit_returns_checkpoint_and_latest_checkpoint_finds_it(data_dir):
    cursors = Cursors(data_dir, keep_checkpoints=2)
    assert cursors.latest_checkpoint("acme") is None
    dirs = [cursors.commit("acme", step=s, ids=[f"id{s}"], checkpoint=_checkpoint(f"s{s}")) for s in (1, 2, 3)]
    assert cursors.latest_checkpoint("acme") == (3, dirs[-1])
    assert (dirs[-1] / "optimizer.pt").read_bytes() == b"adam s3"
    assert not dirs[0].exists() and dirs[1].exists(), "only the newest keep_checkpoints checkpoints stay"
    assert cursors.trained_ids("acme") == {"id1", "id2", "id3"}, "pruning a checkpoint keeps its ids"
    with pytest.raises(CursorError, match="step 3 is already committed"):
        cursors.commit("acme", step=3, ids=["x"], checkpoint=_checkpoint("again"))


def test_an_ids_file_of_another_cursor_format_is_refused_not_misread(data_dir, make_trajectories):
    """A step's ids.parquet says its format in its metadata; one a newer clora wrote (another layout of the
    ids, say) must stop the reader with a clear error, not count a wrong set of ids as trained."""
    from storage.layout import StorageError

    ids = _ingest(data_dir, make_trajectories, "acme", 3)
    step = Cursors(data_dir).commit("acme", step=1, ids=ids[:2], checkpoint=_checkpoint("s1")).parent
    assert Cursors(data_dir).trained_ids("acme") == set(ids[:2])
    table = pq.read_table(step / "ids.parquet")
    pq.write_table(table.replace_schema_metadata({b"clora.cursor_format": b"2"}), step / "ids.parquet")
    with pytest.raises(StorageError, match=r"ids.parquet has cursor format '2'; this clora reads 1"):
        Cursors(data_dir).untrained("acme")


def test_failed_checkpoint_commits_nothing(data_dir):
    cursors = Cursors(data_dir)
    cursors.commit("acme", step=1, ids=["a"], checkpoint=_checkpoint("s1"))

    def broken(d):
        (d / "adapter_model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cursors.commit("acme", step=2, ids=["b"], checkpoint=broken)
    assert cursors.trained_ids("acme") == {"a"}
    assert cursors.latest_checkpoint("acme")[0] == 1


def test_pruning_that_fails_does_not_undo_a_commit(data_dir, monkeypatch):
    import storage.cursors as cursors_module

    cursors = Cursors(data_dir, keep_checkpoints=1)
    cursors.commit("acme", step=1, ids=["a"], checkpoint=_checkpoint("s1"))

    def broken(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cursors_module, "remove_tree", broken)
    directory = cursors.commit("acme", step=2, ids=["b"], checkpoint=_checkpoint("s2"))  # no error: committed
    assert cursors.latest_checkpoint("acme") == (2, directory)
    assert cursors.trained_ids("acme") == {"a", "b"}
    monkeypatch.undo()
    cursors.commit("acme", step=3, ids=["c"], checkpoint=_checkpoint("s3"))  # pruning catches up
    assert [s for s, path in cursors._steps("acme") if (path / "checkpoint").exists()] == [3]


CRASH_BEFORE_RENAME = r"""
import os, sys
import storage.cursors
from storage.cursors import Cursors

def crash(staging, final):           # everything is written and fsynced; the process dies before the rename
    os._exit(9)

storage.cursors.publish_dir = crash
def checkpoint(d):
    (d / "adapter_model.safetensors").write_bytes(b"step 2")
Cursors(sys.argv[1]).commit("acme", step=2, ids=["b", "c"], checkpoint=checkpoint)
"""


def test_crash_before_rename_leaves_neither_ids_nor_checkpoint(data_dir, python_subprocess):
    run, _ = python_subprocess
    cursors = Cursors(data_dir)
    first = cursors.commit("acme", step=1, ids=["a"], checkpoint=_checkpoint("s1"))
    result = run(CRASH_BEFORE_RENAME, str(data_dir))
    assert result.returncode == 9, result.stderr
    leftovers = [p.name for p in (data_dir / "cursors" / "acme").iterdir() if p.name.startswith(".")]
    assert leftovers, "the crashed commit left its staging directory (hidden)"

    fresh = Cursors(data_dir)
    assert fresh.trained_ids("acme") == {"a"}
    assert fresh.latest_checkpoint("acme") == (1, first)
    # The learner restarts from step 1 and commits step 2 for real; the dead staging dir is cleared.
    second = fresh.commit("acme", step=2, ids=["b", "c"], checkpoint=_checkpoint("s2"))
    assert fresh.trained_ids("acme") == {"a", "b", "c"}
    assert fresh.latest_checkpoint("acme") == (2, second)
    assert not [p for p in (data_dir / "cursors" / "acme").iterdir() if p.name.startswith(".")]


def test_cursor_survives_compaction_of_trajectories(data_dir, make_trajectories):
    ids = _ingest(data_dir, make_trajectories, "acme", 6)
    cursors = Cursors(data_dir)
    cursors.commit("acme", step=1, ids=ids[:7], checkpoint=_checkpoint("s1"))
    before = cursors.untrained("acme")
    assert len(live_files(data_dir, "trajectories", "acme")) == 6

    results = compact(data_dir, "trajectories")
    assert sum(r.inputs for r in results) == 6
    assert len(live_files(data_dir, "trajectories", "acme")) == 1

    after = cursors.untrained("acme")
    assert after.column("id").to_pylist() == before.column("id").to_pylist() == ids[7:]
    assert after.equals(before)
    assert cursors.backlog() == {"acme": len(ids) - 7}
    assert Cursors(data_dir).untrained("acme").column("id").to_pylist() == ids[7:]


def test_a_compaction_between_reads_of_the_cursor_loses_no_trained_id(data_dir, monkeypatch):
    """Compaction writes a snapshot, then deletes the steps it covers. A reader (with the older snapshot
    cached) that lists the cursor while that happens must still see every trained id."""
    import os

    import storage.cursors as cursors_module

    reader = Cursors(data_dir, keep_checkpoints=1)
    for s in (1, 2):
        reader.commit("acme", step=s, ids=[f"id{s}"], checkpoint=_checkpoint(f"s{s}"))
    assert reader.compact("acme") == 2  # snapshot at step 2, cached by the reader below
    assert reader.trained_ids("acme") == {"id1", "id2"}
    for s in (3, 4, 5):
        reader.commit("acme", step=s, ids=[f"id{s}"], checkpoint=_checkpoint(f"s{s}"))

    real_listdir, compacted = os.listdir, []

    def listdir_then_compact(path):
        names = real_listdir(path)
        if not compacted and str(path).endswith("acme"):
            compacted.append(None)  # once (the compaction lists the directory too)
            compacted[0] = Cursors(data_dir, keep_checkpoints=1).compact("acme")  # another process, right now
        return names

    monkeypatch.setattr(cursors_module.os, "listdir", listdir_then_compact)
    assert reader.trained_ids("acme") == {f"id{s}" for s in range(1, 6)}
    assert compacted == [3]
    assert Cursors(data_dir).trained_ids("acme") == {f"id{s}" for s in range(1, 6)}


def test_cursor_snapshot_keeps_every_trained_id(data_dir):
    cursors = Cursors(data_dir, keep_checkpoints=1)
    for s in range(1, 6):
        cursors.commit("acme", step=s, ids=[f"id{s}a", f"id{s}b"], checkpoint=_checkpoint(f"s{s}"))
    expected = {f"id{s}{x}" for s in range(1, 6) for x in "ab"}
    assert cursors.compact("acme") == 5
    tenant_dir = data_dir / "cursors" / "acme"
    assert sorted(p.name for p in tenant_dir.iterdir()) == [
        "step-00000000000000000005",
        "trained-00000000000000000000-00000000000000000005.parquet",
    ]
    assert Cursors(data_dir).trained_ids("acme") == expected
    assert cursors.trained_ids("acme") == expected
    assert cursors.latest_checkpoint("acme")[0] == 5
    cursors.commit("acme", step=6, ids=["id6"], checkpoint=_checkpoint("s6"))
    assert Cursors(data_dir).trained_ids("acme") == expected | {"id6"}
    with pytest.raises(CursorError):
        cursors.commit("acme", step=5, ids=["old"], checkpoint=_checkpoint("old"))


def test_what_a_fold_replaced_goes_at_a_later_compaction_after_the_fold_grace(data_dir):
    """A listing is read a piece at a time: one that read past the new snapshot's name before it appeared and
    reached the step files it replaced after they went saw neither, and a learner starting then trained those
    ids again for as long as it ran. They stay until the snapshot is FOLD_GRACE_S old."""
    cursors = Cursors(data_dir, keep_checkpoints=1)
    for s in range(1, 6):
        cursors.commit("acme", step=s, ids=[f"id{s}"], checkpoint=_checkpoint(f"s{s}"))
    assert cursors.compact("acme") == 5
    tenant_dir = data_dir / "cursors" / "acme"
    snapshot = tenant_dir / "trained-00000000000000000000-00000000000000000005.parquet"
    names = sorted(p.name for p in tenant_dir.iterdir() if not p.name.startswith("."))
    assert names == [f"step-{s:020d}" for s in range(1, 6)] + [snapshot.name], "the replaced step files stay"
    assert Cursors(data_dir).trained_ids("acme") == {f"id{s}" for s in range(1, 6)}
    assert cursors.compact("acme") == 0 and len(list(tenant_dir.glob("step-*"))) == 5, "not old enough yet"
    past = snapshot.stat().st_mtime - cursors_module.FOLD_GRACE_S
    os.utime(snapshot, (past, past))
    assert cursors.compact("acme") == 0
    assert sorted(p.name for p in tenant_dir.iterdir() if not p.name.startswith(".")) == [
        "step-00000000000000000005", snapshot.name]  # the newest step keeps its checkpoint
    assert Cursors(data_dir).trained_ids("acme") == {f"id{s}" for s in range(1, 6)}


def test_duplicate_trajectory_rows_are_trained_once(data_dir, make_trajectories):
    write_dataset(data_dir, "trajectories", make_trajectories(["x", "y"], "acme"), file_id="a")
    write_dataset(data_dir, "trajectories", make_trajectories(["x"], "acme", start=5), file_id="b")
    cursors = Cursors(data_dir)
    assert cursors.untrained("acme").column("id").to_pylist() == ["x", "y"]
    assert cursors.backlog() == {"acme": 2}
    assert isinstance(cursors.untrained("nobody"), pa.Table) and cursors.untrained("nobody").num_rows == 0


# ---------------------------------------------------------------------------------------------------------
# The backlog is kept up to date from what changed: it must answer what reading everything again answers


def _expected_untrained(data_dir, tenant: str, trained: set[str]) -> list[str]:
    """What `untrained` must answer, the slow way: every live row, oldest first (ties in file, then row
    order), without trained ids and without repeats."""
    rows = read_dataset(data_dir, "trajectories", tenant)
    ids, at = rows.column("id").to_pylist(), rows.column("ingested_at").to_pylist()
    out, seen = [], set(trained)
    for i in sorted(range(len(ids)), key=lambda i: (at[i], i)):
        if ids[i] not in seen:
            seen.add(ids[i])
            out.append(ids[i])
    return out


def test_backlog_follows_new_files_commits_compaction_and_restarts(data_dir, make_trajectories):
    reader = Cursors(data_dir)  # lives through everything below, like the learner's
    trained: set[str] = set()

    def check():
        expected = _expected_untrained(data_dir, "acme", trained)
        assert reader.backlog() == {"acme": len(expected)}
        assert reader.untrained("acme").column("id").to_pylist() == expected
        restarted = Cursors(data_dir)  # a new process, after a crash
        assert restarted.backlog() == {"acme": len(expected)}
        assert restarted.untrained("acme").column("id").to_pylist() == expected

    def commit(ids):
        step = (reader.latest_step("acme") or 0) + 1
        reader.commit("acme", step=step, ids=ids, checkpoint=_checkpoint(f"s{step}"))
        trained.update(ids)

    ids = _ingest(data_dir, make_trajectories, "acme", 6)  # f000..f005, 3 rows each
    check()
    commit(ids[:4])  # f000 trained, f001 partly
    check()
    # Between two passes: a compaction replaces trained, partly trained and untrained files by one file;
    # a step is committed; ingest writes a file repeating a trained and an untrained id, at tied times.
    assert sum(r.inputs for r in compact(data_dir, "trajectories")) == 6
    commit(ids[4:6])
    write_dataset(data_dir, "trajectories", make_trajectories([ids[0], ids[10], "late"], "acme", start=2), file_id="g000")
    check()
    # An id trained before it is stored (a step committed it, the file came later) is never untrained.
    commit(["early", *ids[6:8]])
    write_dataset(data_dir, "trajectories", make_trajectories(["early", "later"], "acme", start=30), file_id="g001")
    check()
    # The compacted file is merged again with the newer ones; its inputs are deleted at once.
    compact(data_dir, "trajectories", grace_s=0)
    assert len(live_files(data_dir, "trajectories", "acme")) == 1
    check()
    commit(reader.untrained("acme").column("id").to_pylist())
    check()
    assert reader.backlog() == {"acme": 0}


def test_a_snapshot_folding_steps_the_reader_never_saw_hides_their_ids(data_dir, make_trajectories):
    ids = _ingest(data_dir, make_trajectories, "acme", 4)
    reader = Cursors(data_dir)
    reader.commit("acme", step=1, ids=ids[:2], checkpoint=_checkpoint("s1"))
    assert reader.backlog() == {"acme": 10}
    other = Cursors(data_dir, keep_checkpoints=1)  # another process, while the reader does not look
    for s in (2, 3, 4):
        other.commit("acme", step=s, ids=ids[2 * s - 2 : 2 * s], checkpoint=_checkpoint(f"s{s}"))
    assert other.compact("acme") == 4
    assert sorted(p.name for p in (data_dir / "cursors" / "acme").iterdir()) == [
        "step-00000000000000000004",
        "trained-00000000000000000000-00000000000000000004.parquet",
    ], "steps 2 and 3 are only in the snapshot now"
    assert reader.backlog() == {"acme": 4}
    assert reader.untrained("acme").column("id").to_pylist() == ids[8:]


def test_a_cursor_deleted_by_hand_counts_everything_again(data_dir, make_trajectories):
    ids = _ingest(data_dir, make_trajectories, "acme", 2)
    reader = Cursors(data_dir)
    reader.commit("acme", step=1, ids=ids[:4], checkpoint=_checkpoint("s1"))
    assert reader.backlog() == {"acme": 2}
    shutil.rmtree(data_dir / "cursors" / "acme")
    assert reader.backlog() == {"acme": 6}
    assert reader.untrained("acme").column("id").to_pylist() == ids


def test_a_file_vanishing_during_a_pass_leaves_the_backlog_right(data_dir, make_trajectories, monkeypatch):
    ids = _ingest(data_dir, make_trajectories, "acme", 3)
    reader = Cursors(data_dir)
    assert reader.backlog() == {"acme": 9}
    reader.commit("acme", step=1, ids=ids[:2], checkpoint=_checkpoint("s1"))
    write_dataset(data_dir, "trajectories", make_trajectories(["late"], "acme", start=50), file_id="g000")
    real_read_file, vanished = cursors_module.read_file, []

    def read_file(dd, path, **kwargs):  # g000 "vanishes" once, after the pass took in the new step
        if path.endswith("g000.parquet") and not vanished:
            vanished.append(path)
            raise FileNotFoundError(path)
        return real_read_file(dd, path, **kwargs)

    monkeypatch.setattr(cursors_module, "read_file", read_file)
    assert reader.backlog() == {"acme": 8}
    assert vanished, "the pass was retried"
    assert reader.untrained("acme").column("id").to_pylist() == [*ids[2:], "late"]


@pytest.mark.parametrize("seed", range(3))
def test_backlog_matches_a_full_read_through_random_histories(data_dir, make_trajectories, seed):
    rng = random.Random(seed)
    reader, trained, stored, numbers = Cursors(data_dir), set(), [], iter(range(10**6))

    def commit(cursors, ids):
        step = (cursors.latest_step("acme") or 0) + 1
        cursors.commit("acme", step=step, ids=ids, checkpoint=_checkpoint(f"s{step}"))
        trained.update(ids)

    for _ in range(40):
        op = rng.choice(["ingest", "ingest", "commit", "commit", "compact", "fold", "elsewhere", "restart"])
        if op == "ingest":  # new ids; now and then a repeat of a stored id, or of a trained one
            n = next(numbers)
            ids = [f"t{n}-{k}" for k in range(rng.randint(1, 4))]
            if stored and rng.random() < 0.3:
                ids.append(rng.choice(stored))
            if trained and rng.random() < 0.3:
                ids.append(rng.choice(sorted(trained)))
            table = make_trajectories(ids, "acme", start=rng.randint(0, 20))
            write_dataset(data_dir, "trajectories", table, file_id=f"f{n:04d}")
            stored += ids
        elif op == "commit":  # the oldest untrained, as the learner takes them, maybe with an id not stored yet
            ids = _expected_untrained(data_dir, "acme", trained)[: rng.randint(0, 5)]
            commit(reader, ids + ([f"early{next(numbers)}"] if rng.random() < 0.3 else []))
        elif op == "compact":
            compact(data_dir, "trajectories", grace_s=rng.choice([0, 60]))
        elif op == "fold":
            reader.compact("acme")
        elif op == "elsewhere":  # another process commits and folds steps while the reader does not look
            other = Cursors(data_dir, keep_checkpoints=1)
            for _ in range(rng.randint(1, 3)):
                commit(other, _expected_untrained(data_dir, "acme", trained)[: rng.randint(1, 3)])
            other.compact("acme")
        elif op == "restart":
            reader = Cursors(data_dir)
        expected = _expected_untrained(data_dir, "acme", trained)
        assert reader.backlog().get("acme", 0) == len(expected), op
        assert reader.untrained("acme").column("id").to_pylist() == expected, op


def test_a_pass_costs_the_backlog_and_the_new_files_not_the_history(data_dir, make_trajectories, monkeypatch):
    """After a step, no trajectories file is read again and only the untrained rows are checked against
    the step's ids; a new file is read once and only its rows are checked against the trained ids."""
    ids = _ingest(data_dir, make_trajectories, "acme", 20, per_file=50)  # 1000 rows in 20 files
    reader = Cursors(data_dir)
    reader.commit("acme", step=1, ids=ids[:960], checkpoint=_checkpoint("s1"))
    assert reader.backlog() == {"acme": 40}
    assert reader._backlogs["acme"].pending.num_rows == 40, "nothing kept of the 19 fully trained files"

    reads, checked = [], []
    real_read_file, real_is_in, real_contains = cursors_module.read_file, pc.is_in, HashIndex.contains

    def read_file(dd, path, **kwargs):
        reads.append(path)
        return real_read_file(dd, path, **kwargs)

    def is_in(values, *args, **kwargs):  # how the previous version filtered every stored row at every step
        checked.append(len(values))
        return real_is_in(values, *args, **kwargs)

    def contains(self, hi, lo):
        checked.append(len(hi))
        return real_contains(self, hi, lo)

    monkeypatch.setattr(cursors_module, "read_file", read_file)
    monkeypatch.setattr(pc, "is_in", is_in)
    monkeypatch.setattr(HashIndex, "contains", contains)

    reader.commit("acme", step=2, ids=ids[960:970], checkpoint=_checkpoint("s2"))
    assert reader.backlog() == {"acme": 30}
    # The 40 pending rows against the step's 10 ids; the step's ids (twice at most) as they are added.
    assert reads == [] and sum(checked) <= 40 + 2 * 10, (reads, checked)

    reads.clear(), checked.clear()
    late = write_dataset(data_dir, "trajectories", make_trajectories(["late"] * 5, "acme", start=2000), file_id="late")
    assert reader.backlog() == {"acme": 31}
    assert reads == [str(late[0])] and sum(checked) <= 5, (reads, checked)

    reads.clear(), checked.clear()
    assert reader.backlog() == {"acme": 31}
    assert reads == [] and checked == [], "nothing moved: nothing read or checked"


def test_ids_whose_first_64_hash_bits_collide_are_still_told_apart(data_dir, make_trajectories, monkeypatch):
    """With every id's first fingerprint half forced to 0, the second half alone tells trained from not."""
    real = cursors_module.hash_strings
    monkeypatch.setattr(cursors_module, "hash_strings", lambda ids: (np.zeros(len(ids), dtype=np.int64), real(ids)[1]))
    ids = _ingest(data_dir, make_trajectories, "acme", 4, per_file=5)
    reader = Cursors(data_dir)
    reader.commit("acme", step=1, ids=ids[:7], checkpoint=_checkpoint("s1"))
    assert reader.untrained("acme").column("id").to_pylist() == ids[7:]
    reader.commit("acme", step=2, ids=ids[7:12], checkpoint=_checkpoint("s2"))
    write_dataset(data_dir, "trajectories", make_trajectories(ids[:3] + ["late"], "acme", start=1000), file_id="late")
    assert reader.backlog() == {"acme": 9}
    assert reader.untrained("acme").column("id").to_pylist() == ids[12:] + ["late"]


# ---------------------------------------------------------------------------------------------------------
# Tiered snapshots: a compaction costs the steps it folds, not the history


def _snapshot_names(data_dir) -> list[str]:
    return sorted(p.name for p in (data_dir / "cursors" / "acme").iterdir() if p.name.startswith("trained-"))


def test_compaction_rewrites_each_id_a_few_times_not_the_history_every_time(data_dir, monkeypatch):
    written = []
    real = cursors_module._write_ids

    def counting(final, sources, newest_commit_ms):
        real(final, sources, newest_commit_ms)
        written.append(cursors_module._rows(final))

    monkeypatch.setattr(cursors_module, "_write_ids", counting)
    cursors = Cursors(data_dir, keep_checkpoints=1)
    expected = set()
    for s in range(1, 401):
        ids = [f"id{s}a", f"id{s}b"]
        cursors.commit("acme", step=s, ids=ids, checkpoint=_checkpoint(f"s{s}"))
        expected.update(ids)
        if s % 10 == 0:
            cursors.compact("acme")
    # 800 ids in 40 compactions: rewriting the history each time would write 16,400 ids; a binary counter
    # writes each id about log2(40) + 1 times.
    assert sum(written) <= (math.log2(40) + 1) * len(expected), sum(written)
    assert len(_snapshot_names(data_dir)) <= math.log2(40) + 1, _snapshot_names(data_dir)
    assert Cursors(data_dir).trained_ids("acme") == expected
    assert cursors.trained_ids("acme") == expected and cursors.latest_step("acme") == 400


def test_a_snapshot_an_older_version_wrote_is_the_chain_from_step_zero(data_dir, make_trajectories):
    ids = _ingest(data_dir, make_trajectories, "acme", 2)
    tenant_dir = data_dir / "cursors" / "acme"
    tenant_dir.mkdir(parents=True)
    pq.write_table(pa.table({"id": pa.array(ids[:3], pa.string())}, schema=cursors_module._IDS_SCHEMA),
                   tenant_dir / "trained-00000000000000000007.parquet")
    cursors = Cursors(data_dir, keep_checkpoints=1)
    assert cursors.latest_step("acme") == 7 and cursors.trained_ids("acme") == set(ids[:3])
    assert cursors.backlog() == {"acme": 3}
    cursors.commit("acme", step=8, ids=ids[3:5], checkpoint=_checkpoint("s8"))
    cursors.commit("acme", step=9, ids=ids[5:], checkpoint=_checkpoint("s9"))
    assert cursors.compact("acme") == 2
    assert _snapshot_names(data_dir) == ["trained-00000000000000000000-00000000000000000009.parquet"]
    assert Cursors(data_dir).trained_ids("acme") == set(ids) and cursors.backlog() == {"acme": 0}


def test_a_crash_between_a_merge_and_its_deletions_is_read_right_and_cleaned_up(data_dir, make_trajectories,
                                                                                   monkeypatch):
    ids = _ingest(data_dir, make_trajectories, "acme", 2)
    cursors = Cursors(data_dir, keep_checkpoints=1)
    for s in (1, 2):
        cursors.commit("acme", step=s, ids=[ids[s - 1]], checkpoint=_checkpoint(f"s{s}"))
    cursors.compact("acme")  # 0..2
    for s in (3, 4):
        cursors.commit("acme", step=s, ids=[ids[s - 1]], checkpoint=_checkpoint(f"s{s}"))
    real_unlink = Path.unlink

    def crash_on_snapshots(self, *args, **kwargs):
        if self.name.startswith("trained-"):
            raise SystemExit("killed")
        return real_unlink(self, *args, **kwargs)

    with monkeypatch.context() as patched, pytest.raises(SystemExit):
        patched.setattr(Path, "unlink", crash_on_snapshots)
        cursors.compact("acme")  # folds 3..4, merges with 0..2 (as many ids), dies before deleting
    assert _snapshot_names(data_dir) == [
        "trained-00000000000000000000-00000000000000000002.parquet",
        "trained-00000000000000000000-00000000000000000004.parquet",
        "trained-00000000000000000003-00000000000000000004.parquet",
    ]
    fresh = Cursors(data_dir, keep_checkpoints=1)
    assert fresh.trained_ids("acme") == set(ids[:4]) and fresh.backlog() == {"acme": 2}
    fresh.commit("acme", step=5, ids=[ids[4]], checkpoint=_checkpoint("s5"))
    fresh.compact("acme")
    assert _snapshot_names(data_dir) == [  # the leftovers are gone; 5..5 is smaller than 0..4, so not merged
        "trained-00000000000000000000-00000000000000000004.parquet",
        "trained-00000000000000000005-00000000000000000005.parquet",
    ]
    assert Cursors(data_dir).trained_ids("acme") == set(ids[:5])


def test_the_learners_own_compaction_does_not_make_its_next_pass_read_the_snapshot(data_dir, make_trajectories,
                                                                                     monkeypatch):
    ids = _ingest(data_dir, make_trajectories, "acme", 4)
    cursors = Cursors(data_dir, keep_checkpoints=1)
    for s in range(1, 5):
        assert cursors.backlog() == {"acme": 12 - 2 * (s - 1)}
        cursors.commit("acme", step=s, ids=ids[2 * s - 2 : 2 * s], checkpoint=_checkpoint(f"s{s}"))
        cursors.compact("acme")  # as the learner does every 100 steps, right after a commit
    hashed = []
    real = cursors_module.hash_strings
    monkeypatch.setattr(cursors_module, "hash_strings", lambda values: hashed.append(len(values)) or real(values))
    assert cursors.backlog() == {"acme": 4}
    assert hashed == [], "the steps it folded were read before they were folded, not read again from the snapshot"


# ---------------------------------------------------------------------------------------------------------
# Retention: forgetting old steps


def _commit_at(cursors, data_dir, step: int, ids: list[str], when: datetime) -> None:
    """Commits `ids` at `step`, then dates the commit `when` (as if the learner had committed it then)."""
    cursors.commit("acme", step=step, ids=ids, checkpoint=_checkpoint(f"s{step}"))
    meta_path = data_dir / "cursors" / "acme" / f"step-{step:020d}" / "commit.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "created_at": when.isoformat()}))


def test_forget_drops_old_steps_and_leaves_rows_older_than_the_cutoff_out(data_dir, make_trajectories):
    day = 86_400
    # o0..o5 ingested on T0 (2025-01-01); n0..n2 on T0 + 31 days
    write_dataset(data_dir, "trajectories", make_trajectories([f"o{k}" for k in range(6)]), file_id="old")
    write_dataset(data_dir, "trajectories", make_trajectories([f"n{k}" for k in range(3)], start=31 * day), file_id="new")
    cursors = Cursors(data_dir, keep_checkpoints=1)
    _commit_at(cursors, data_dir, 1, ["o0", "o1"], T0 + timedelta(days=1))
    _commit_at(cursors, data_dir, 2, ["o2"], T0 + timedelta(days=2))
    cursors.compact("acme")  # snapshot 1..2, newest commit T0 + 2 days
    _commit_at(cursors, data_dir, 3, ["o3"], T0 + timedelta(days=10))
    cursors.compact("acme")  # snapshot 3..3, newest commit T0 + 10 days
    live = Cursors(data_dir)
    assert live.backlog() == {"acme": 5}  # o4, o5, n0, n1, n2

    cutoff_ms = int((T0 + timedelta(days=5)).timestamp() * 1000)
    assert cursors.forget("acme", cutoff_ms, dry_run=True) == 3 and cursors.horizon("acme").through == -1
    assert cursors.forget("acme", cutoff_ms) == 3  # o0, o1, o2: steps 1..2, committed before the cutoff
    assert cursors.horizon("acme") == cursors_module.Horizon(2, cutoff_ms)
    assert cursors.trained_ids("acme") == {"o3"}
    assert sorted(p.name for p in (data_dir / "cursors" / "acme").glob("trained-*")) == [
        "trained-00000000000000000003-00000000000000000003.parquet"
    ]
    # Rows ingested before the cutoff are left out, trained or not; a learner that had read the old
    # cursor starts over and holds only what is left.
    assert live.backlog() == {"acme": 3} and sorted(live.untrained("acme").column("id").to_pylist()) == ["n0", "n1", "n2"]
    assert len(live._backlogs["acme"].trained) == 1
    assert Cursors(data_dir).backlog() == {"acme": 3}
    # Steps go on from where they were; a forgotten step number cannot be committed again.
    assert cursors.latest_step("acme") == 3 and cursors.latest_checkpoint("acme")[0] == 3
    with pytest.raises(CursorError):
        cursors.commit("acme", step=2, ids=["n0"], checkpoint=_checkpoint("again"))
    cursors.commit("acme", step=4, ids=["n0"], checkpoint=_checkpoint("s4"))
    assert live.backlog() == {"acme": 2} and cursors.compact("acme") == 1
    assert cursors.trained_ids("acme") == {"o3", "n0"}
    assert cursors.forget("acme", cutoff_ms) == 0  # nothing more is that old

    # Everything forgotten (steps 3 and 4 committed long ago by now): the horizon holds the step count.
    assert cursors.forget("acme", int((T0 + timedelta(days=800)).timestamp() * 1000)) == 2
    assert cursors.trained_ids("acme") == set() and cursors.latest_step("acme") == 4
    assert live.backlog() == {"acme": 0}


def test_a_dry_run_forget_lists_again_past_a_snapshot_a_compaction_deleted(data_dir, monkeypatch):
    """A dry run takes no lock, so a learner's cursor compaction can delete a snapshot it has listed: that was
    a FileNotFoundError out of `clora prune --dry-run`."""
    cursors = Cursors(data_dir, keep_checkpoints=1)
    _commit_at(cursors, data_dir, 1, ["o0", "o1"], T0 + timedelta(days=1))
    _commit_at(cursors, data_dir, 2, ["o2"], T0 + timedelta(days=2))
    cursors.compact("acme")  # snapshot 1..2
    _commit_at(cursors, data_dir, 3, ["o3"], T0 + timedelta(days=10))
    cursors.compact("acme")  # snapshot 3..3
    rows, vanished = cursors_module._rows, []

    def first_read_vanishes(path):
        if not vanished:
            vanished.append(path)
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return rows(path)

    monkeypatch.setattr(cursors_module, "_rows", first_read_vanishes)
    cutoff_ms = int((T0 + timedelta(days=5)).timestamp() * 1000)
    assert cursors.forget("acme", cutoff_ms, dry_run=True) == 3 and vanished


def test_snapshots_of_different_days_are_never_merged_so_forget_keeps_the_retention_not_more(data_dir):
    # Ten days of a learner that commits four steps a day and compacts after each: the binary counter runs
    # within a day, the next day's first compaction merges the day before into one snapshot.
    cursors = Cursors(data_dir, keep_checkpoints=1)
    expected, step = {}, 0
    for day in range(10):
        for k in range(4):
            step += 1
            expected[step] = [f"d{day}s{k}a", f"d{day}s{k}b"]
            _commit_at(cursors, data_dir, step, expected[step], T0 + timedelta(days=day, hours=6 * k))
            cursors.compact("acme")
    names = _snapshot_names(data_dir)
    days = [(int(n[8:28]), int(n[29:49])) for n in names]
    assert days == [(0, 4), (5, 8), (9, 12), (13, 16), (17, 20), (21, 24), (25, 28), (29, 32), (33, 36), (37, 40)], names
    assert Cursors(data_dir).trained_ids("acme") == {i for ids in expected.values() for i in ids}

    # A cutoff at day 5, 18:30: days 0..4 go; day 5's last commit (18:00) is within the hour's margin before
    # it, so day 5 stays whole. What is kept beyond the cutoff is at most that one day.
    cutoff = T0 + timedelta(days=5, hours=18, minutes=30)
    assert cursors.forget("acme", int(cutoff.timestamp() * 1000)) == 5 * 4 * 2
    assert cursors.horizon("acme").through == 20
    kept = cursors.trained_ids("acme")
    assert kept == {i for s in range(21, 41) for i in expected[s]}


def test_a_snapshot_without_its_commit_time_is_dated_by_its_file_not_a_mtime_set_back(data_dir, tmp_path):
    path = tmp_path / "trained-00000000000000000000-00000000000000000001.parquet"
    pq.write_table(pa.table({"id": ["a"]}), path)  # written before the commit time was recorded
    os.utime(path, (1_000, 1_000))  # a restore that kept an old mtime: the ctime is the change's
    assert cursors_module._newest_commit_ms(path) == int(path.stat().st_ctime * 1000) > 1_000_000


def test_an_unreadable_horizon_is_a_clear_error_and_retention_goes_on_with_the_other_tenants(data_dir):
    from storage.layout import StorageError
    from storage.retention import PartlyDone, forget_trained

    cursors = Cursors(data_dir)
    for tenant in ("acme", "globex"):
        cursors.commit(tenant, step=1, ids=["a"], checkpoint=_checkpoint("s1"))
    (data_dir / "cursors" / "acme" / "horizon.json").write_text('{"format": 9, "through": 1, "before_ms": 0}')
    with pytest.raises(StorageError, match="horizon.json is unreadable .*format 9"):
        cursors.latest_step("acme")
    with pytest.raises(PartlyDone, match="forgetting trained ids failed for acme") as failed:
        forget_trained(data_dir, older_than_s=1.0)
    assert failed.value.done == {"globex": 0}


def test_a_damaged_checkpoint_set_aside_leaves_the_step_committed_and_few_are_kept(data_dir):
    cursors = Cursors(data_dir, keep_checkpoints=10)
    for step in range(1, 6):
        cursors.commit("acme", step=step, ids=[f"i{step}"], checkpoint=_checkpoint(f"s{step}"))
    aside = [cursors.set_aside_checkpoint("acme", step) for step in (5, 4, 3, 2)]
    assert cursors.latest_checkpoint("acme")[0] == 1 and cursors.latest_step("acme") == 5
    assert cursors.trained_ids("acme") == {f"i{k}" for k in range(1, 6)}  # every step still committed
    # the three set aside last are kept (each is a whole checkpoint)
    assert sorted(aside[0].parent.iterdir()) == sorted(aside[1:])
    assert (aside[-1] / "optimizer.pt").read_bytes() == b"adam s2"


def test_a_damaged_checkpoint_is_set_aside_when_state_is_on_another_filesystem(data_dir, monkeypatch):
    """os.rename cannot cross filesystems (EXDEV): with state/ mounted apart from cursors/, setting a damaged
    checkpoint aside raised, and the learner with it, at every start."""
    import errno
    import os

    import storage.cursors as cursors_module

    cursors = Cursors(data_dir, keep_checkpoints=10)
    for step in (1, 2):
        cursors.commit("acme", step=step, ids=[f"i{step}"], checkpoint=_checkpoint(f"s{step}"))
    real_rename = os.rename

    def rename(source, target):
        if "cursors" in str(source) and "damaged-checkpoints" in str(target):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(source, target)

    monkeypatch.setattr(cursors_module.os, "rename", rename)
    aside = cursors.set_aside_checkpoint("acme", 2)
    assert (aside / "optimizer.pt").read_bytes() == b"adam s2" and cursors.latest_checkpoint("acme")[0] == 1
    assert [p.name for p in aside.parent.iterdir()] == [aside.name]  # no partial copy left beside it


@pytest.mark.parametrize("damage", ["truncated", "corrupt page"])
def test_a_damaged_trajectories_file_is_left_out_and_read_again_once_restored_in_place(data_dir, make_trajectories,
                                                                                       damage):
    """A file whose content cannot be read left its tenant's whole backlog unknown for good (compaction and
    retention leave it alone): its rows are left out, the others counted; restored where it was, it is read."""
    ids = _ingest(data_dir, make_trajectories, "acme", 2, per_file=40)
    first = sorted((data_dir / "trajectories" / "tenant=acme").glob("*.parquet"))[0]
    good = first.read_bytes()
    if damage == "truncated":
        first.write_bytes(good[:100])
    else:  # the footer reads, the id column's data page does not (Arrow's error carries no errno)
        column = pq.ParquetFile(first).metadata.row_group(0).column(0)
        assert column.path_in_schema == "id"
        at = column.data_page_offset + 16
        first.write_bytes(good[:at] + bytes(b ^ 0xFF for b in good[at:at + 64]) + good[at + 64:])
        with pytest.raises(OSError) as e:
            pq.read_table(first, columns=["id"])
        assert e.value.errno is None, e.value
    cursors = Cursors(data_dir)
    assert cursors.backlog() == {"acme": 40} and cursors.backlog_errors == {}
    assert cursors.damaged_files() == {"acme": [str(first)]}
    assert cursors.untrained("acme").column("id").to_pylist() == ids[40:]
    first.write_bytes(good)  # restored in place: same name, the listing unchanged
    assert cursors.backlog() == {"acme": 80} and cursors.damaged_files() == {}
