"""KeyIndex: a set/map of keys that holds only their hashes."""

import pytest

import ingest.index as index_module
from ingest.index import KeyIndex

pytestmark = pytest.mark.unit


def test_add_get_and_first_value_wins():
    ix = KeyIndex()
    assert ("a", "1") not in ix and ix.get(("a", "1")) is None
    ix.add(("a", "1"), 7)
    ix.add(("a", "1"), 9)
    assert ix.get(("a", "1")) == 7 and len(ix) == 1
    assert ("a", "2") not in ix and ("b", "1") not in ix


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
