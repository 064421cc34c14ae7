"""What the learner committed, read straight from its cursor files (storage/cursors.py's layout): the
trajectory ids of each `cursors/<tenant>/step-<step>/` directory still there. Shared by the learner tests
(through learner_support) and the end-to-end tests in tests/clora, which cannot import tests/learner."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq


def committed_ids(data_dir, tenant: str) -> dict[int, list[str]]:
    """The trajectory ids committed at each step whose directory is still there, by step, oldest first
    (compaction folds older steps into a snapshot; the newest keep their checkpoint, and with it their
    directory)."""
    d = Path(data_dir) / "cursors" / tenant
    return {int(p.name.split("-")[1]): pq.read_table(p / "ids.parquet").column("id").to_pylist()
            for p in sorted(d.glob("step-*"))}
