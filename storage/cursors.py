"""The learner's per-tenant cursor: which trajectories it has trained on, committed with its checkpoint.

On disk, per tenant:
    cursors/<tenant>/step-<step>/commit.json     {"format", "tenant", "step", "n_ids", "created_at"}
    cursors/<tenant>/step-<step>/ids.parquet     the trajectory ids trained at that step
    cursors/<tenant>/step-<step>/checkpoint/     what the learner's checkpoint(dir) wrote (adapter + optimizer)
    cursors/<tenant>/trained-<step>.parquet      optional snapshot: every id trained at steps <= <step>

`commit` builds a step directory under a hidden staging name (checkpoint files, ids, commit.json), fsyncs
it and renames it into place: the ids and the checkpoint become visible together or not at all. Only the
newest `keep_checkpoints` step directories keep their checkpoint/; older ones keep just their ids.

The cursor is a set of trajectory *ids*, never file names or offsets, so compaction of the trajectory
files (which renames and merges them) cannot move it. `compact` folds the per-step id files into one
snapshot so a learner restart reads a few files, not one per step ever taken.

Reads are lock-free; `commit` and `compact` take a per-tenant lock (one learner owns a tenant at a time).
What this module does not do: decide what to train (the learner's scheduler) or read checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.files import FileLock, ensure_dir, fsync_tree, publish_dir, remove_stale_hidden, remove_tree, write_new_file
from storage.layout import StorageError, as_datadir, check_tenant
from storage.parquet import live_files, partition_tenants, read_file, read_rows, retry_vanished
from storage.schema import TRAJECTORIES, conform

logger = logging.getLogger(__name__)

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{20})$")
_SNAPSHOT = re.compile(r"^trained-(\d{20})\.parquet$")
_INDEX_SCHEMA = pa.schema([TRAJECTORIES.field("id"), TRAJECTORIES.field("ingested_at")])
_IDS_SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False)], metadata={b"clora.cursor_format": b"1"})


class CursorError(StorageError):
    """A commit that would break the cursor (a step that is not newer than the last one)."""


def _step_name(step: int) -> str:
    return f"step-{step:020d}"


class Cursors:
    def __init__(self, root, *, keep_checkpoints: int = 2):
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {keep_checkpoints}")
        self.dd = as_datadir(root)
        self.keep_checkpoints = keep_checkpoints
        # Caches keyed by file path: data files are never rewritten in place (only replaced by new names),
        # so a path that is still listed still holds what was cached.
        self._file_ids: dict[str, pa.Table] = {}  # trajectory file -> its (id, ingested_at) columns
        self._id_files: dict[str, pa.Array] = {}  # cursor ids file -> its ids
        # tenant -> (its files and cursor files, untrained index, distinct untrained ids)
        self._index_cache: dict[str, tuple[tuple, pa.Table, int]] = {}

    def __repr__(self) -> str:
        return f"Cursors({str(self.dd.root)!r})"

    # --- reading the cursor ---------------------------------------------------------------------------
    def trained_ids(self, tenant: str) -> set[str]:
        return set(self._trained(tenant))

    def latest_checkpoint(self, tenant: str) -> tuple[int, Path] | None:
        """(step, checkpoint dir) of the newest committed step; None before the first commit."""
        for step, path in reversed(self._steps(tenant)):
            if (path / "checkpoint").is_dir():
                return step, path / "checkpoint"
        return None

    def latest_step(self, tenant: str) -> int | None:
        snapshots, steps = self._listing(tenant)
        return max([s for s, _ in steps] + [s for s, _ in snapshots], default=None)

    def untrained(self, tenant: str, limit: int | None = None) -> pa.Table:
        """Trajectories of `tenant` not yet trained, oldest first by ingested_at (TRAJECTORIES schema)."""
        check_tenant(tenant)

        def read() -> pa.Table:
            index, paths = self._untrained_index(tenant)
            if index.num_rows == 0:
                return TRAJECTORIES.empty_table()
            # Oldest first; a trajectory stored twice (in two files) counts once, at its first position.
            order = pc.sort_indices(
                index, sort_keys=[("ingested_at", "ascending"), ("file", "ascending"), ("row", "ascending")]
            )
            ranked = index.take(order).append_column("rank", pa.array(range(index.num_rows), pa.int64()))
            firsts = ranked.group_by("id", use_threads=False).aggregate([("rank", "min")]).column("rank_min")
            firsts = pc.take(firsts, pc.sort_indices(firsts))
            chosen = ranked.take(firsts if limit is None else firsts[:limit])
            # Read only the files that hold chosen rows, each once, then restore the order.
            by_file: dict[int, list[tuple[int, int]]] = {}
            for pos, (f, r) in enumerate(zip(chosen.column("file").to_pylist(), chosen.column("row").to_pylist())):
                by_file.setdefault(f, []).append((r, pos))
            parts = []
            for f, wanted in by_file.items():
                part = conform(read_rows(self.dd, paths[f], [r for r, _ in wanted]), TRAJECTORIES, strict=False)
                parts.append(part.append_column("_pos", pa.array([pos for _, pos in wanted], pa.int64())))
            merged = pa.concat_tables(parts)
            return merged.take(pc.sort_indices(merged.column("_pos"))).drop_columns(["_pos"])

        return retry_vanished(read, f"reading untrained trajectories of {tenant}")

    def backlog(self) -> dict[str, int]:
        """tenant -> number of its trajectories not yet trained (distinct ids)."""

        def read() -> dict[str, int]:
            out = {}
            for tenant in partition_tenants(self.dd, "trajectories"):
                try:
                    check_tenant(tenant)
                except StorageError:
                    continue
                self._untrained_index(tenant)
                out[tenant] = self._index_cache[tenant][2]
            return out

        return retry_vanished(read, "computing backlog")

    # --- writing the cursor ---------------------------------------------------------------------------
    def commit(self, tenant: str, *, step: int, ids: list[str], checkpoint: Callable[[Path], None]) -> Path:
        """Records `ids` as trained at `step` together with `checkpoint(dir)`'s files; returns the checkpoint dir.

        After a crash at any point either both the ids and the checkpoint are visible or neither is.
        """
        check_tenant(tenant)
        step = int(step)
        if step < 0:
            raise CursorError(f"step must be >= 0, got {step}")
        tenant_dir = self.dd.tenant_cursors(tenant)
        with FileLock(self._lock_path(tenant)):
            last = self.latest_step(tenant)
            if last is not None and step <= last:
                raise CursorError(f"cannot commit step {step} for tenant {tenant!r}: step {last} is already committed")
            ensure_dir(tenant_dir)
            remove_stale_hidden(tenant_dir, older_than_s=0)  # we hold the lock: hidden entries are dead leftovers
            staging = tenant_dir / f".staging-{uuid.uuid4().hex}"
            (staging / "checkpoint").mkdir(parents=True)
            try:
                checkpoint(staging / "checkpoint")
                ids_table = pa.table({"id": pa.array(list(ids), pa.string())}, schema=_IDS_SCHEMA)
                pq.write_table(ids_table, staging / "ids.parquet")
                meta = {
                    "format": FORMAT,
                    "tenant": tenant,
                    "step": step,
                    "n_ids": len(ids),
                    "created_at": datetime.now(timezone.utc).isoformat(),
                }
                (staging / "commit.json").write_text(json.dumps(meta, indent=1))
                fsync_tree(staging)
                final = tenant_dir / _step_name(step)
                publish_dir(staging, final)  # the commit point
            finally:
                if staging.exists():
                    remove_tree(staging)
            try:  # housekeeping: the step is committed whatever happens here
                self._prune_checkpoints(tenant)
            except OSError as e:
                logger.warning("tenant %s: step %d committed, but pruning old checkpoints failed: %s", tenant, step, e)
        return final / "checkpoint"

    def compact(self, tenant: str) -> int:
        """Folds the per-step id files into one snapshot; returns how many step files it folded (0: nothing to do)."""
        check_tenant(tenant)
        tenant_dir = self.dd.tenant_cursors(tenant)
        with FileLock(self._lock_path(tenant)):
            snapshots = self._snapshots(tenant)
            base = snapshots[-1][0] if snapshots else -1
            newer = [(s, p) for s, p in self._steps(tenant) if s > base]
            if not newer or (len(newer) == 1 and not snapshots):
                return 0
            top = newer[-1][0]
            table = pa.table({"id": pc.unique(self._trained_array(tenant))}, schema=_IDS_SCHEMA)
            write_new_file(tenant_dir / f"trained-{top:020d}.parquet", lambda tmp: pq.write_table(table, tmp))
            # The snapshot covers everything up to `top`: older snapshots and checkpoint-less step dirs go.
            for _, path in snapshots:
                path.unlink(missing_ok=True)
            for s, path in self._steps(tenant):
                if s <= top and not (path / "checkpoint").exists():
                    remove_tree(path)
            return len(newer)

    # --- internals ------------------------------------------------------------------------------------
    def _lock_path(self, tenant: str) -> Path:
        return self.dd.locks / f"cursors-{tenant}.lock"

    def _steps(self, tenant: str) -> list[tuple[int, Path]]:
        return self._listing(tenant)[1]

    def _snapshots(self, tenant: str) -> list[tuple[int, Path]]:
        return self._listing(tenant)[0]

    def _listing(self, tenant: str) -> tuple[list[tuple[int, Path]], list[tuple[int, Path]]]:
        """(snapshots, step directories) of the tenant's cursor, each by number, from one read of the directory."""
        d = self.dd.tenant_cursors(tenant)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return [], []
        snapshots = sorted((int(m[1]), d / n) for n in names if (m := _SNAPSHOT.match(n)))
        steps = sorted((int(m[1]), d / n) for n in names if (m := _STEP_DIR.match(n)))
        return snapshots, steps

    def _trained(self, tenant: str) -> frozenset[str]:
        return frozenset(self._trained_array(tenant).to_pylist())

    def _trained_array(self, tenant: str) -> pa.Array:
        return retry_vanished(
            lambda: self._read_trained(self._trained_sources(tenant), tenant), f"reading the cursor of {tenant}"
        )

    def _trained_sources(self, tenant: str) -> list[Path]:
        """The files that hold the cursor: the newest snapshot, then the ids of every later step. From one
        listing: a compaction running meanwhile writes a snapshot and then deletes the steps it covers, so a
        snapshot listed before it and steps listed after it would miss those steps' ids."""
        snapshots, steps = self._listing(tenant)
        base, sources = -1, []
        if snapshots:
            base, path = snapshots[-1]
            sources.append(path)
        return sources + [p / "ids.parquet" for s, p in steps if s > base]

    def _read_trained(self, sources: list[Path], tenant: str) -> pa.Array:
        """Every id in `sources` (duplicates possible). Each file is read once per instance, so the cursor
        moving by one step costs one small file read."""
        keys = {str(p) for p in sources}
        prefix = f"{self.dd.tenant_cursors(tenant)}/"
        for stale in [k for k in self._id_files if k.startswith(prefix) and k not in keys]:
            del self._id_files[stale]
        arrays = []
        for path in sources:
            ids = self._id_files.get(str(path))
            if ids is None:
                ids = self._id_files[str(path)] = pq.read_table(path, columns=["id"]).column("id").combine_chunks()
            arrays.append(ids)
        return pa.concat_arrays(arrays) if arrays else pa.array([], pa.string())

    def _untrained_index(self, tenant: str) -> tuple[pa.Table, list[str]]:
        """(id, ingested_at, file, row) of every not yet trained trajectory of `tenant`, and the file paths
        that `file` indexes.

        Cheap when nothing moved (a directory listing and a cache hit): the result is kept until the file
        list or the cursor changes, and each file's (id, ingested_at) is read once per instance.
        """
        paths = live_files(self.dd, "trajectories", tenant)
        sources = self._trained_sources(tenant)
        key = (tuple(paths), tuple(str(p) for p in sources))
        cached = self._index_cache.get(tenant)
        if cached is not None and cached[0] == key:
            return cached[1], paths

        live = set(paths)
        prefix = f"{self.dd.dataset('trajectories')}/tenant={tenant}/"
        for stale in [p for p in self._file_ids if p.startswith(prefix) and p not in live]:
            del self._file_ids[stale]
        parts = []
        for f, path in enumerate(paths):
            cols = self._file_ids.get(path)
            if cols is None:
                cols = conform(read_file(self.dd, path, columns=["id", "ingested_at"]), _INDEX_SCHEMA, strict=False)
                self._file_ids[path] = cols
            n = cols.num_rows
            parts.append(
                cols.append_column("file", pa.array(np.full(n, f, np.int32))).append_column("row", pa.array(np.arange(n)))
            )
        if parts:
            index = pa.concat_tables(parts)
            trained = self._read_trained(sources, tenant)
            if len(trained):
                index = index.filter(pc.invert(pc.is_in(index.column("id"), value_set=trained)))
        else:
            index = pa.schema([*_INDEX_SCHEMA, pa.field("file", pa.int32()), pa.field("row", pa.int64())]).empty_table()
        distinct = pc.count_distinct(index.column("id")).as_py() if index.num_rows else 0
        self._index_cache[tenant] = (key, index, distinct)
        return index, paths

    def _prune_checkpoints(self, tenant: str) -> None:
        with_checkpoint = [p for _, p in self._steps(tenant) if (p / "checkpoint").exists()]
        for path in with_checkpoint[: max(0, len(with_checkpoint) - self.keep_checkpoints)]:
            remove_tree(path / "checkpoint")
