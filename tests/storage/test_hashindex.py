"""HashIndex and hash_strings: keys held as 128-bit hashes, with or without int32 values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from storage import hashindex
from storage.hashindex import ABSENT, HashIndex, hash_strings

pytestmark = pytest.mark.unit


def _keys(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.integers(-(2**63), 2**63 - 1, n), rng.integers(-(2**63), 2**63 - 1, n)


def _check_runs(index: HashIndex) -> None:
    """Each run sorted by h1; each at least MIN_MERGE keys and 16 times the next (but the last)."""
    runs = index._runs
    for run in runs:
        assert (run.h1[1:] >= run.h1[:-1]).all()
    for big, small in zip(runs, runs[1:]):
        assert len(big) >= max(hashindex.MIN_MERGE, hashindex.GROWTH * len(small))


def test_hash_strings_gives_two_independent_halves_that_repeat_within_the_process():
    h1, h2 = hash_strings(["a", "b", "a"])
    assert h1.dtype == h2.dtype == np.int64
    assert h1[0] == h1[2] and h2[0] == h2[2]
    assert (h1[0], h2[0]) != (h1[1], h2[1]) and h1[0] != h2[0]
    assert [len(h) for h in hash_strings([])] == [0, 0]


def test_a_set_answers_membership():
    index = HashIndex()
    h1, h2 = hash_strings([f"id-{i}" for i in range(100)])
    index.add(h1[:60], h2[:60])
    assert index.contains(h1, h2).tolist() == [True] * 60 + [False] * 40
    assert index.find(h1[58:62], h2[58:62]).tolist() == [0, 0, ABSENT, ABSENT]
    assert len(index) == 60 and index.nbytes == 16 * 60
    assert not HashIndex().contains(h1, h2).any()
    assert index.contains(h1[:0], h2[:0]).tolist() == []


def test_values_are_kept_per_key_and_assign_reports_the_previous_ones():
    index = HashIndex(values=True)
    h1, h2 = hash_strings([f"name-{i}" for i in range(10)])
    index.add(h1[:5], h2[:5], np.arange(5))
    index.add(h1[3:8], h2[3:8], np.full(5, 9))  # 3 and 4 keep their values
    assert index.find(h1, h2).tolist() == [0, 1, 2, 3, 4, 9, 9, 9, ABSENT, ABSENT]
    before = index.assign(h1[6:], h2[6:], 7)
    assert before.tolist() == [9, 9, ABSENT, ABSENT]
    assert index.find(h1, h2).tolist() == [0, 1, 2, 3, 4, 9, 7, 7, 7, 7]
    assert len(index) == 10 and index.nbytes == 20 * 10


def test_misuse_is_refused():
    h1, h2 = hash_strings(["x"])
    with pytest.raises(ValueError, match="has_values"):
        HashIndex().add(h1, h2, np.array([1]))
    with pytest.raises(ValueError, match="has_values"):
        HashIndex(values=True).add(h1, h2)
    with pytest.raises(ValueError, match="1 keys but 2 values"):
        HashIndex(values=True).add(h1, h2, np.array([1, 2]))
    with pytest.raises(ValueError, match="assign needs"):
        HashIndex().assign(h1, h2, 1)
    with pytest.raises(ValueError, match="-1"):
        HashIndex(values=True).assign(h1, h2, -1)


def test_keys_sharing_their_first_64_bits_are_told_apart(monkeypatch):
    """Every key's first half forced to one value (a 64-bit collision for each pair): the second half
    alone tells them apart, within a run and across runs and merges."""
    monkeypatch.setattr(hashindex, "MIN_MERGE", 4)
    real = hashindex.hash_strings
    monkeypatch.setattr(hashindex, "hash_strings", lambda values: (np.full(len(values), 42, np.int64), real(values)[1]))
    names = [f"file-{i}" for i in range(50)]
    index = HashIndex(values=True)
    for start in range(0, 40, 5):  # several runs, merged along the way
        index.add(*hashindex.hash_strings(names[start : start + 5]), np.arange(start, start + 5))
    _check_runs(index)
    h1, h2 = hashindex.hash_strings(names)
    assert index.find(h1, h2).tolist() == list(range(40)) + [ABSENT] * 10
    assert index.contains(h1, h2).tolist() == [True] * 40 + [False] * 10
    assert index.assign(h1[35:45], h2[35:45], 99).tolist() == [35, 36, 37, 38, 39] + [ABSENT] * 5
    assert index.find(h1, h2).tolist() == list(range(35)) + [99] * 10 + [ABSENT] * 5
    assert not index.contains(np.full(3, 42, np.int64), np.array([1, 2, 3])).any()


def test_many_inserts_keep_every_key_in_order_in_few_runs(monkeypatch):
    monkeypatch.setattr(hashindex, "MIN_MERGE", 64)
    rng = np.random.default_rng(0)
    index = HashIndex(values=True)
    all1, all2, all_values = [], [], []
    for step, size in enumerate([1, 5, 3, 64, 64, 1, 200, 7, 1000, 3, 3, 3, 5000, 2, 17] * 3):
        h1, h2 = _keys(rng, size)
        index.add(h1, h2, np.full(size, step))
        all1.append(h1), all2.append(h2), all_values.append(np.full(size, step))
        _check_runs(index)
    h1, h2, values = np.concatenate(all1), np.concatenate(all2), np.concatenate(all_values)
    assert len(index) == len(h1)
    assert len(index._runs) <= math.log(len(h1) / 64, hashindex.GROWTH) + 2
    assert (index.find(h1, h2) == values).all()
    assert not index.contains(h1, h2 + 1).any()
    assert not index.contains(*_keys(rng, 1000)).any()


def test_duplicate_keys_are_kept_once_with_their_first_value():
    index = HashIndex(values=True)
    h1, h2 = hash_strings(["a", "b", "a", "c", "b", "a"])
    index.add(h1, h2, np.array([1, 2, 3, 4, 5, 6]))
    assert len(index) == 3
    assert index.find(h1, h2).tolist() == [1, 2, 1, 4, 2, 1]
    index.add(h1, h2, np.full(6, 9))
    assert len(index) == 3, "keys already present are not added again"
    before = index.assign(*hash_strings(["d", "d", "a"]), 7)
    assert before.tolist() == [ABSENT, ABSENT, 1] and len(index) == 4
    assert index.find(*hash_strings(["a", "b", "c", "d"])).tolist() == [7, 2, 4, 7]
    members = HashIndex()
    members.add(*hash_strings(["x", "x", "y"]))
    assert len(members) == 2 and members.nbytes == 32


def test_strings_sharing_an_internal_buffer_are_different_keys():
    """hash("AA") == hash("\u4141") in CPython whatever the key: both hash the same two bytes."""
    assert hash("AA") == hash("\u4141")
    a, b = hash_strings(["AA"]), hash_strings(["\u4141"])
    assert a[0][0] != b[0][0] and a[1][0] != b[1][0], "neither half may collide by construction"
    index = HashIndex()
    index.add(*hash_strings(["AA"]))
    assert index.contains(*hash_strings(["AA", "\u4141"])).tolist() == [True, False]


def test_remove_values_drops_exactly_the_keys_with_those_values(monkeypatch):
    monkeypatch.setattr(hashindex, "MIN_MERGE", 64)
    rng = np.random.default_rng(1)
    index = HashIndex(values=True)
    keys = []
    for value, size in enumerate([5000, 300, 20, 3, 900, 1]):
        h1, h2 = _keys(rng, size)
        index.add(h1, h2, np.full(size, value))
        keys.append((h1, h2))
    assert index.remove_values([1, 4, 99]) == 300 + 900
    _check_runs(index)
    for value, (h1, h2) in enumerate(keys):
        assert (index.find(h1, h2) == (ABSENT if value in (1, 4) else value)).all()
    assert len(index) == 5000 + 20 + 3 + 1
    assert index.remove_values([0, 2, 3, 5]) == 5024 and len(index) == 0 and index._runs == []
    with pytest.raises(ValueError):
        HashIndex().remove_values([0])
