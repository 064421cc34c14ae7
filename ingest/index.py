"""KeyIndex: which keys the store already holds, in 12 bytes per key, for deduplication across the whole store.

Ingest must know, for every event, whether its key ((tenant, id) for interactions and trajectories;
(tenant, id, ts, score, source) for feedback; (topic, partition, offset) for dead letters) is already on
disk. A Python set of tuples costs ~200 bytes per key; this index keeps a 64-bit hash per key in a sorted
numpy array (plus an int32 value, which the interactions index uses to say which file holds the row), and
recent additions in a small dict that is merged into the array once it grows past 1/16 of it (each merge
is linear, so the amortised cost per key stays constant). Memory is therefore 12 bytes per stored row in
the arrays, plus up to 1/16 as many recent keys at ~100 bytes each in the dict: 12 to ~18 bytes per row,
not a function of throughput. A merge briefly holds the old and the new arrays (twice the arrays' size).

Hashes are `key_hash(key)`, the one function every entry point uses: `hash()` of the key tuple with each
non-ASCII str part replaced by its UTF-8 bytes. 64 bits, salted per process, which is fine because the
index lives only in memory and is rebuilt from the Parquet datasets at every start (nothing here is written
anywhere). Not `hash()` of the key as it is: a str hashes its internal buffer, which two different strings
can share ("AA" in one-byte storage, "\u4141" in two-byte storage: the same bytes), so anyone could make
two ids of one hash, in every process whatever PYTHONHASHSEED says, and a new interaction was dropped as
stored. An ASCII str stays as it is (its buffer is its UTF-8 bytes, and its hash is cached); any other
string's UTF-8 bytes hold a byte over 0x7f, so they never equal an ASCII string's. Cost per key, measured
against hash() of the key (~90 ns): +80-100 ns for a (tenant, id) of ASCII strings, +160 ns for a feedback
key, +500-600 ns with a non-ASCII string; a load hashes 1M keys in 0.20 s (was 0.12).

Two different keys then share a hash only by chance, about n / 2**64 per lookup (n keys stored): ~5e-12 for
100 million keys. Numbers still hash by value (hash(1.0) == hash(2**-61), hash(-1) == hash(-2)), which only
a tenant's own feedback events with purpose-built scores or timestamps can meet (the second then reads as a
resend of the first). A collision makes ingest treat a new key as already stored (a feedback join that then
does not find its id waits, as feedback does before its interaction: batch.py); at that rate we accept it.

Not storage/hashindex.py's HashIndex (the 128-bit index cursors.py and parquet.py share): ingest asks single
keys per event and adds a batch at a time, which the recent dict serves in O(1) (a lookup at 1M keys:
2.6 µs here, 12.7 µs there) in 12 bytes a key instead of 20.

What this module leaves to others: which keys to load (pending.py) and what a hit means (batch.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MIN_MERGE = 65536


def key_hash(key: tuple) -> int:
    """hash() of `key` with every non-ASCII str part as its UTF-8 bytes (see the module note): two different
    strings never share a hash by construction. Every KeyIndex entry point hashes through this."""
    for part in key:
        if type(part) is str and not part.isascii():
            # surrogatepass: a lone surrogate (decode refuses them; Parquet cannot hold them) hashes, not raises.
            return hash(tuple([p.encode("utf-8", "surrogatepass") if type(p) is str else p for p in key]))
    return hash(key)


class KeyIndex:
    """A map key -> int32 value (0 when unused) holding only each key's 64-bit hash."""

    def __init__(self) -> None:
        self._hashes = np.empty(0, dtype=np.int64)  # sorted, unique
        self._values = np.empty(0, dtype=np.int32)
        self._recent: dict[int, int] = {}

    @classmethod
    def from_keys(cls, keys: Iterable[tuple], values: Iterable[int] | None = None) -> KeyIndex:
        hashes = np.fromiter(map(key_hash, keys), dtype=np.int64)
        vals = np.zeros(len(hashes), dtype=np.int32) if values is None else np.fromiter(values, dtype=np.int32)
        return cls.from_hashes(hashes, vals)

    @classmethod
    def from_hashes(cls, hashes: np.ndarray, values: np.ndarray) -> KeyIndex:
        """From `key_hash(key)` values (int64, e.g. `hash_keys` file by file) and their int32 values."""
        if len(values) != len(hashes):
            raise ValueError(f"{len(hashes)} keys but {len(values)} values")
        index = cls()
        # np.unique keeps the first occurrence's index: the earliest file wins for a key stored twice.
        index._hashes, first = np.unique(hashes.astype(np.int64, copy=False), return_index=True)
        index._values = values.astype(np.int32, copy=False)[first]
        return index

    @staticmethod
    def hash_keys(columns: list[list]) -> np.ndarray:
        """key_hash() of each row's key tuple, the key's parts given column by column."""
        return np.fromiter(map(key_hash, zip(*columns)), dtype=np.int64, count=len(columns[0]))

    def __len__(self) -> int:
        return len(self._hashes) + len(self._recent)

    @property
    def nbytes(self) -> int:
        """Approximate memory held (the recent dict counted at ~100 bytes per entry)."""
        return self._hashes.nbytes + self._values.nbytes + 100 * len(self._recent)

    def _find(self, h: int) -> int:
        i = int(np.searchsorted(self._hashes, h))
        return i if i < len(self._hashes) and self._hashes[i] == h else -1

    def get(self, key: tuple) -> int | None:
        """The value stored with `key`, or None if the key is absent."""
        h = key_hash(key)
        v = self._recent.get(h)
        if v is not None:
            return v
        i = self._find(h)
        return None if i < 0 else int(self._values[i])

    def __contains__(self, key: tuple) -> bool:
        return self.get(key) is not None

    def _in_sorted(self, hashes: np.ndarray) -> np.ndarray:
        """For each int64 hash, whether the sorted array holds it (one vectorised search)."""
        if not len(self._hashes):
            return np.zeros(len(hashes), dtype=bool)
        at = np.minimum(np.searchsorted(self._hashes, hashes), len(self._hashes) - 1)
        return self._hashes[at] == hashes

    def _hits(self, hashes: list[int]) -> list[bool]:
        """For each hash, whether it is in the index."""
        base = self._in_sorted(np.fromiter(hashes, dtype=np.int64, count=len(hashes))).tolist()
        recent = self._recent
        return [hit or h in recent for h, hit in zip(hashes, base)]

    def present(self, keys: Iterable[tuple], hashes: list[int] | None = None) -> set:
        """The subset of `keys` in the index (what a batch asks first, all at once). `hashes`: their
        `key_hash` values, when the caller has them (a batch asks two indexes about the same keys)."""
        keys = list(keys)
        if hashes is None:
            hashes = list(map(key_hash, keys))
        return {k for k, hit in zip(keys, self._hits(hashes), strict=True) if hit}

    def add(self, key: tuple, value: int = 0) -> None:
        """Adds `key` (a key already present keeps its value)."""
        self.add_many([key], [value])

    def add_many(self, keys: Iterable[tuple], values: Iterable[int] | None = None) -> None:
        """Adds every key (one already present keeps its value; of one key given twice, the first value
        is kept). A batch's keys at a time, so the work is done by dict and numpy operations that loop in C,
        not by a Python statement per key (the consumer's loop thread adds every key it writes)."""
        hashes = list(map(key_hash, keys))
        if values is None:
            fresh = dict.fromkeys(hashes, 0)
        else:
            values = list(values)
            if len(values) != len(hashes):
                raise ValueError(f"{len(hashes)} keys but {len(values)} values")
            fresh = dict(zip(reversed(hashes), reversed(values)))  # built from the end: the first value wins
        if fresh:
            new = np.fromiter(fresh, dtype=np.int64, count=len(fresh))
            for h in new[self._in_sorted(new)].tolist():
                del fresh[h]
        for h in fresh.keys() & self._recent.keys():
            del fresh[h]
        self._recent.update(fresh)
        if len(self._recent) >= max(MIN_MERGE, len(self._hashes) >> 4):
            self._merge()

    def _merge(self) -> None:
        new = np.fromiter(self._recent.keys(), dtype=np.int64, count=len(self._recent))
        vals = np.fromiter(self._recent.values(), dtype=np.int32, count=len(self._recent))
        order = np.argsort(new)
        new, vals = new[order], vals[order]
        at = np.searchsorted(self._hashes, new)
        self._hashes = np.insert(self._hashes, at, new)
        self._values = np.insert(self._values, at, vals)
        self._recent = {}
