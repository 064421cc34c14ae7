"""KeyIndex: a set/map of keys that holds only their hashes."""

import numpy as np
import pytest

import ingest.index as index_module
from ingest.index import KeyIndex, key_hash

pytestmark = pytest.mark.unit


def test_add_get_and_first_value_wins():
    ix = KeyIndex()
    assert ("a", "1") not in ix and ix.get(("a", "1")) is None
    ix.add(("a", "1"), 7)
    ix.add(("a", "1"), 9)
    assert ix.get(("a", "1")) == 7 and len(ix) == 1
    assert ("a", "2") not in ix and ("b", "1") not in ix


def test_add_many_keeps_the_first_value_of_a_key_in_the_batch_the_array_or_the_recent_keys():
    ix = KeyIndex.from_keys([("t", "stored")], [1])  # in the sorted array
    ix.add(("t", "recent"), 2)  # in the recent dict
    ix.add_many([("t", "new"), ("t", "stored"), ("t", "recent"), ("t", "new"), ("t", "other")], [3, 4, 5, 6, 7])
    assert [ix.get(("t", k)) for k in ("stored", "recent", "new", "other")] == [1, 2, 3, 7]
    assert len(ix) == 4
    ix.add_many([("t", "x"), ("t", "x")])  # no values: 0
    assert ix.get(("t", "x")) == 0 and len(ix) == 5
    ix.add_many([], [])
    assert len(ix) == 5
    with pytest.raises(ValueError, match="values"):
        ix.add_many([("t", "y")], [1, 2])


def test_from_keys_deduplicates_keeping_the_first_value():
    ix = KeyIndex.from_keys([("t", "x"), ("t", "y"), ("t", "x")], [1, 2, 3])
    assert len(ix) == 2 and ix.get(("t", "x")) == 1 and ix.get(("t", "y")) == 2
    with pytest.raises(ValueError, match="values"):
        KeyIndex.from_keys([("t", "x")], [1, 2])


def test_merges_keep_every_key(monkeypatch):
    monkeypatch.setattr(index_module, "MIN_MERGE", 64)
    ix = KeyIndex.from_keys([("t", str(i)) for i in range(0, 1000, 2)], range(0, 1000, 2))
    for i in range(1, 1000, 2):
        ix.add(("t", str(i)), i)
    assert len(ix) == 1000
    assert all(ix.get(("t", str(i))) == i for i in range(1000))
    assert ("t", "1000") not in ix
    assert ix.nbytes < 1000 * 12 + 64 * 100  # 12 bytes a key once merged


def test_strings_sharing_a_str_hash_are_different_keys_at_every_entry_point():
    """hash("AA") == hash("䅁") in every process (the same bytes in one-byte and two-byte storage)."""
    a, b = ("t", "AA"), ("t", "䅁")
    assert hash(a) == hash(b) and key_hash(a) != key_hash(b)
    ix = KeyIndex()
    ix.add(a, 1)
    assert b not in ix and ix.present([a, b]) == {a}
    ix.add_many([b], [2])
    assert ix.get(a) == 1 and ix.get(b) == 2 and len(ix) == 2
    loaded = KeyIndex.from_hashes(KeyIndex.hash_keys([["t", "t"], ["AA", "䅁"]]), np.array([1, 2], np.int32))
    assert loaded.get(a) == 1 and loaded.get(b) == 2  # what a load from Parquet hashes, a lookup hashes
    assert KeyIndex.from_keys([b]).present([a, b]) == {b}
    # keys of other shapes: non-ASCII parts anywhere, numbers and None beside them
    fb = ("t", "AA", 1_746_057_600_000, 0.5, "䅁")
    assert key_hash(fb) != key_hash(("t", "AA", 1_746_057_600_000, 0.5, "AA"))
    other = ("t", "x", 1, 0.5, None)
    assert KeyIndex.from_keys([fb, other]).present([fb, other, ("t", "x", 1, 0.5, "")]) == {fb, other}
    assert key_hash(("t", "\ud800")) != key_hash(("t", "\ud801"))  # a lone surrogate hashes, not raises
