"""storage.cursors: trained ids committed atomically with the checkpoint, untrained/backlog, compaction."""

from __future__ import annotations

import pyarrow as pa
import pytest

from storage.compact import compact
from storage.cursors import CursorError, Cursors
from storage.parquet import live_files, write_dataset

pytestmark = pytest.mark.unit


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
        "trained-00000000000000000005.parquet",
    ]
    assert Cursors(data_dir).trained_ids("acme") == expected
    assert cursors.trained_ids("acme") == expected
    assert cursors.latest_checkpoint("acme")[0] == 5
    cursors.commit("acme", step=6, ids=["id6"], checkpoint=_checkpoint("s6"))
    assert Cursors(data_dir).trained_ids("acme") == expected | {"id6"}
    with pytest.raises(CursorError):
        cursors.commit("acme", step=5, ids=["old"], checkpoint=_checkpoint("old"))


def test_duplicate_trajectory_rows_are_trained_once(data_dir, make_trajectories):
    write_dataset(data_dir, "trajectories", make_trajectories(["x", "y"], "acme"), file_id="a")
    write_dataset(data_dir, "trajectories", make_trajectories(["x"], "acme", start=5), file_id="b")
    cursors = Cursors(data_dir)
    assert cursors.untrained("acme").column("id").to_pylist() == ["x", "y"]
    assert cursors.backlog() == {"acme": 2}
    assert isinstance(cursors.untrained("nobody"), pa.Table) and cursors.untrained("nobody").num_rows == 0
