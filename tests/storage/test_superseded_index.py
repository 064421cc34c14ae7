"""The superseded-names index of a partition, kept up to date as compacted files come and go, answers as an
index built afresh from the files on disk would; and a compacted file deleted (retention's daily deletes)
costs the footers of the files older than it only, not every footer of the partition.

The files are real (empty Parquet files with the names compaction gives them); what each footer lists is
set by the test (a stand-in for `read_supersedes`), so that any history of merges can be drawn."""

from __future__ import annotations

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import parquet
from storage.layout import as_datadir

pytestmark = pytest.mark.unit


@pytest.fixture
def partition(tmp_path, monkeypatch):
    """(directory, footers, reads): footers maps a compacted file's name to the names it lists."""
    directory = tmp_path / "trajectories" / "tenant=acme"
    directory.mkdir(parents=True)
    footers: dict[str, tuple[str, ...]] = {}
    reads: list[str] = []

    def read_supersedes(fs, path):
        name = os.path.basename(path)
        reads.append(name)
        return footers[name]

    monkeypatch.setattr(parquet, "read_supersedes", read_supersedes)
    return directory, footers, reads


def put(directory, name: str, mtime_s: int) -> None:
    pq.write_table(pa.table({"x": [1]}), directory / name)
    os.utime(directory / name, ns=(mtime_s * 10**9, mtime_s * 10**9))


def answers(index, dd, directory, names):
    index.update(dd, parquet._list_partition(dd, directory))
    return {n: index.superseded(n) for n in names}, {n: index.on_disk.get(n) for n in os.listdir(directory)}


def history(directory, footers, rng: random.Random, days: int):
    """Each day: some fresh files, then a compacted file merging them, and sometimes an earlier compacted file
    (carrying what that one superseded), whose merged inputs stay on disk for a while (the grace period)."""
    names = []
    for day in range(days):
        fresh = [f"d{day:02d}f{i:03d}.parquet" for i in range(rng.randint(1, 6))]
        for name in fresh:
            put(directory, name, 1000 + day)
        names += fresh
        merged = list(fresh)
        earlier = [n for n in footers if n in os.listdir(directory)]
        if earlier and rng.random() < 0.4:
            carried = rng.choice(earlier)
            merged += [carried, *footers[carried]]
        name = f"{parquet.COMPACTED_PREFIX}{day:04d}.parquet"
        footers[name] = tuple(sorted(set(merged)))
        put(directory, name, 1000 + day)
        for gone in fresh:
            if rng.random() < 0.7:  # most inputs deleted after the grace period
                os.unlink(directory / gone)
    return names + list(footers)


@pytest.mark.parametrize("seed", range(12))
def test_deleting_compacted_files_answers_as_a_fresh_index_would(partition, seed):
    directory, footers, reads = partition
    rng = random.Random(seed)
    dd = as_datadir(directory.parent.parent)
    names = history(directory, footers, rng, days=8)
    kept = parquet._SupersededIndex()
    kept.update(dd, parquet._list_partition(dd, directory))
    compacted = sorted(n for n in footers)
    for _ in range(3):
        on_disk = [n for n in compacted if (directory / n).exists()]
        if not on_disk:
            break
        for name in rng.sample(on_disk, k=rng.randint(1, min(2, len(on_disk)))):
            os.unlink(directory / name)
        got, want = answers(kept, dd, directory, names), answers(parquet._SupersededIndex(), dd, directory, names)
        for g, w in zip(got, want):
            assert {n: s and s.by for n, s in g.items()} == {n: s and s.by for n, s in w.items()}
            # Superseded since: the first compacted file this process saw naming it, which may be gone now
            # (a fresh index knows only the files on disk): never later than a fresh index says.
            assert [(n, s, w[n]) for n, s in g.items() if s is not None and s.since_ns > w[n].since_ns] == []


def test_deleting_the_oldest_compacted_file_reads_no_footer_again(partition):
    """Retention deletes the oldest day first: no file older than it can name its names."""
    directory, footers, reads = partition
    dd = as_datadir(directory.parent.parent)
    for day in range(5):
        put(directory, f"d{day}.parquet", 1000 + day)
        footers[f"{parquet.COMPACTED_PREFIX}{day:04d}.parquet"] = (f"d{day}.parquet",)
        put(directory, f"{parquet.COMPACTED_PREFIX}{day:04d}.parquet", 1000 + day)
    index = parquet._SupersededIndex()
    index.update(dd, parquet._list_partition(dd, directory))
    assert index.superseded("d0.parquet").by == f"{parquet.COMPACTED_PREFIX}0000.parquet"
    reads.clear()
    for day in range(2):
        os.unlink(directory / f"{parquet.COMPACTED_PREFIX}{day:04d}.parquet")
        os.unlink(directory / f"d{day}.parquet")
    index.update(dd, parquet._list_partition(dd, directory))
    assert reads == []
    assert index.superseded("d0.parquet") is None and index.superseded("d2.parquet").by.endswith("0002.parquet")
    os.unlink(directory / f"{parquet.COMPACTED_PREFIX}0003.parquet")  # a middle day: only the older file is read
    index.update(dd, parquet._list_partition(dd, directory))
    assert reads == [f"{parquet.COMPACTED_PREFIX}0002.parquet"]
