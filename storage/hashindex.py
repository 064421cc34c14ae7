"""HashIndex: a set of string keys, or a map from them to int32 values, that holds only 128-bit hashes.

Two storage indexes keep many strings they only ever ask about, never read back: the learner's trained
trajectory ids (cursors.py: is this stored row trained?) and the file names a partition's compacted files
supersede (parquet.py: is this name superseded, and by which file?). Both keep them here, as hashes in
sorted numpy arrays, instead of as Python strings (~50-110 bytes each).

Costs, for n keys:
  - memory: 16 bytes per key, 20 with values. A merge briefly holds the run it grows twice: the largest
    run, about the whole index, each time the index grows by 1/16.
  - hashing (`hash_strings`): an encode and two `hash()` calls, ~0.4 µs per key (blake2b, ~1.7).
  - lookups (`find`, `contains`: numpy batches of queries): one binary search per run, and there are few
    runs: each is at least 16 times the next and at least MIN_MERGE keys, so at most 2 up to ~1M keys and
    3 up to ~16M.
  - inserts (`add`, `assign`): a batch is sorted and becomes the last run, merged into the one before it
    while that one is under 16 times its size or under MIN_MERGE keys. A merge copies at most 17 keys per
    key it moves up, and a key moves up about log16(n / MIN_MERGE) times: amortised, ~34 copies per key at
    16M keys; while the runs are small a call also copies up to MIN_MERGE keys (~0.3 ms).

The hashes are Python's `hash()` of the string's UTF-8 bytes and of the string with "\\x00" appended: two
SipHash values, keyed per process (unless PYTHONHASHSEED fixes the key). Not `hash()` of the string twice:
that hashes its internal buffer, which two different strings can share ("AA" and "\\u4141"), a collision
anyone can build whatever the key. They mean nothing in another process, so an index
lives in memory only and is rebuilt from the strings when a process starts; neither user writes them
anywhere. A query is taken for a member it is not only if both 64-bit halves match a member's: about
n / 2**128 per query, 3e-30 at a billion keys (and two keys share both, so that one stands for the other,
with probability about n**2 / 2**129). Keys whose first halves alone match (about n**2 / 2**65 pairs: the
first at ~6 billion keys) lie side by side in a run and are told apart by the second half.

Removing is by value only (`remove_values`: parquet.py's names owned by compacted files that were deleted),
a pass over every run. It does not know what the strings or values mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_MERGE = 65536  # a run smaller than this takes in every later insert: few runs while the index is small
GROWTH = 16  # a run is merged into the one before it once it reaches 1/GROWTH of its size

ABSENT = -1  # what `find` answers for a key not in the index (values are >= 0)


def hash_strings(values: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(h1, h2): two 64-bit hashes of each string, as int64 arrays (salted per process: see the module note)."""
    n = len(values)
    # The first of the UTF-8 bytes: a str's hash() is of its internal buffer, which two strings can share
    # ("AA" in one-byte storage, "\u4141" in two-byte storage), so hash(str) collides by construction.
    h1 = np.fromiter((hash(v.encode("utf-8", "surrogatepass")) for v in values), dtype=np.int64, count=n)
    h2 = np.fromiter((hash(v + "\x00") for v in values), dtype=np.int64, count=n)
    return h1, h2


class _Run:
    """Keys sorted by h1 (keys sharing an h1 side by side), with their values if the index has any."""

    __slots__ = ("h1", "h2", "values")

    def __init__(self, h1: np.ndarray, h2: np.ndarray, values: np.ndarray | None) -> None:
        self.h1, self.h2, self.values = h1, h2, values

    def __len__(self) -> int:
        return len(self.h1)

    def locate(self, q1: np.ndarray, q2: np.ndarray) -> np.ndarray:
        """The position of each query in this run, -1 where absent."""
        at = np.minimum(np.searchsorted(self.h1, q1), len(self.h1) - 1)
        first = self.h1[at] == q1
        hit = first & (self.h2[at] == q2)
        pos = np.where(hit, at, -1)
        for i in np.flatnonzero(first & ~hit).tolist():  # the other keys sharing this h1 (~never any)
            j = int(at[i]) + 1
            while j < len(self.h1) and self.h1[j] == q1[i]:
                if self.h2[j] == q2[i]:
                    pos[i] = j
                    break
                j += 1
        return pos

    def merge(self, other: _Run) -> _Run:
        """This run with `other`'s keys (none of them in this run) inserted in order."""
        at = np.searchsorted(self.h1, other.h1)
        values = None if self.values is None else np.insert(self.values, at, other.values)
        return _Run(np.insert(self.h1, at, other.h1), np.insert(self.h2, at, other.h2), values)


class HashIndex:
    """A set of 128-bit keys (h1, h2), or with `values=True` a map from them to int32 values >= 0.

    Kept in a few runs, largest first, each sorted by h1; no key is in two runs (see the module note).
    """

    def __init__(self, *, values: bool = False) -> None:
        self.has_values = values
        self._runs: list[_Run] = []

    def __len__(self) -> int:
        return sum(len(run) for run in self._runs)

    @property
    def nbytes(self) -> int:
        return sum(
            run.h1.nbytes + run.h2.nbytes + (0 if run.values is None else run.values.nbytes) for run in self._runs
        )

    # --- asking --------------------------------------------------------------------------------------
    def contains(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        """For each queried key, whether it is in the index."""
        hit = np.zeros(len(h1), dtype=bool)
        if len(h1):
            for run in self._runs:
                hit |= run.locate(h1, h2) >= 0
        return hit

    def find(self, h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
        """Each queried key's value (int32), ABSENT (-1) where it is not in the index (0 for members of a set)."""
        out = np.full(len(h1), ABSENT, dtype=np.int32)
        if len(h1):
            for run in self._runs:
                pos = run.locate(h1, h2)
                hit = pos >= 0
                out[hit] = 0 if run.values is None else run.values[pos[hit]]
        return out

    # --- changing ------------------------------------------------------------------------------------
    def add(self, h1: np.ndarray, h2: np.ndarray, values: np.ndarray | None = None) -> None:
        """Adds the keys not yet in the index; a key already there keeps its value, and a key given twice
        takes its first value. `values` (one per key) only for an index with values."""
        if (values is not None) != self.has_values:
            raise ValueError(f"values given: {values is not None}, but this index has_values={self.has_values}")
        if values is not None and len(values) != len(h1):
            raise ValueError(f"{len(h1)} keys but {len(values)} values")
        if not len(h1):
            return
        new = ~self.contains(h1, h2)
        self._insert(h1[new], h2[new], None if values is None else np.asarray(values, dtype=np.int32)[new])

    def assign(self, h1: np.ndarray, h2: np.ndarray, value: int) -> np.ndarray:
        """Sets every key's value to `value`, adding the keys not yet in the index; returns the value each
        key had before, ABSENT where it was not there (a key given twice answers for both)."""
        if not self.has_values:
            raise ValueError("assign needs an index with values")
        if value < 0:
            raise ValueError(f"values must be >= 0, got {value}")
        before = np.full(len(h1), ABSENT, dtype=np.int32)
        if not len(h1):
            return before
        for run in self._runs:
            pos = run.locate(h1, h2)
            hit = pos >= 0
            before[hit] = run.values[pos[hit]]
            run.values[pos[hit]] = value
        new = before == ABSENT
        self._insert(h1[new], h2[new], np.full(int(new.sum()), value, dtype=np.int32))
        return before

    def remove_values(self, values: Sequence[int]) -> int:
        """Removes every key whose value is one of `values`; returns how many went."""
        if not self.has_values:
            raise ValueError("remove_values needs an index with values")
        doomed = np.asarray(sorted(set(values)), dtype=np.int32)
        removed, runs = 0, []
        for run in self._runs:
            keep = ~np.isin(run.values, doomed)
            kept = int(keep.sum())
            removed += len(run) - kept
            if kept == len(run):
                runs.append(run)
            elif kept:
                runs.append(_Run(run.h1[keep], run.h2[keep], run.values[keep]))
        # Runs that shrank may no longer be GROWTH times the next: merged as an insert would merge them. Into
        # a list of its own, so that a failure part way (memory) leaves the index as it was.
        settled: list[_Run] = []
        for run in runs:
            settled.append(run)
            _settle(settled)
        self._runs = settled
        return removed

    def _insert(self, h1: np.ndarray, h2: np.ndarray, values: np.ndarray | None) -> None:
        """Inserts keys none of which is in the index (a key given twice is kept once, with its first value)."""
        if not len(h1):
            return
        order = np.argsort(h1, kind="stable")
        h1, h2 = h1[order], h2[order]
        values = None if values is None else values[order]
        if (h1[1:] == h1[:-1]).any():  # a repeated key, or two sharing h1: drop the repeats
            order = np.lexsort((h2, h1))  # stable: of a repeated key, its first occurrence comes first
            h1, h2 = h1[order], h2[order]
            keep = np.ones(len(h1), dtype=bool)
            keep[1:] = (h1[1:] != h1[:-1]) | (h2[1:] != h2[:-1])
            h1, h2 = h1[keep], h2[keep]
            values = None if values is None else values[order][keep]
        self._runs.append(_Run(h1, h2, values))
        _settle(self._runs)


def _settle(runs: list[_Run]) -> None:
    """Merges the last run into the one before it while that one is under GROWTH times its size."""
    while len(runs) > 1 and len(runs[-2]) < max(MIN_MERGE, GROWTH * len(runs[-1])):
        small = runs.pop()
        runs.append(runs.pop().merge(small))
