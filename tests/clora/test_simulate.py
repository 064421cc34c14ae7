"""Simulated user preferences and the per-tenant summary (pure logic)."""

import math

import pytest

from clora.simulate import (
    Record,
    SimTenant,
    likes_digits,
    likes_json,
    likes_short_answers,
    likes_upper_case,
    summarise,
)

pytestmark = pytest.mark.unit


def test_preferences_by_hand():
    assert likes_digits("a1 b2") == pytest.approx(2 / 4)  # spaces are ignored: a,1,b,2
    assert likes_digits("") == 0.0
    assert likes_upper_case("ABc d") == pytest.approx(2 / 4)
    assert likes_short_answers("hello") == 1.0
    assert likes_short_answers("x" * 42) == pytest.approx(1 - 30 / 100)
    assert likes_short_answers("x" * 112) == pytest.approx(0.0)
    assert likes_short_answers("x" * 200) == 0.0
    assert likes_json('{"a": 1}') == 1.0
    assert likes_json("[1, 2]") < 1.0  # valid JSON but not an object
    assert likes_json("plain words") == 0.0
    assert 0.3 <= likes_json('{"a": ') < 1.0


def test_summary_windows_and_versions():
    t = SimTenant("a", "k" * 8, "digits")
    recs = [Record(i, "a", f"r{i}", "base" if i < 4 else "a@1", i / 10, "", True) for i in range(8)]
    recs.append(Record(9, "a", "", "", 0.0, "", False, "boom"))
    s = summarise(recs, [t], window=0.25)["a"]
    assert s["requests"] == 9 and s["failed"] == 1
    assert s["reward_base"] == pytest.approx((0.0 + 0.1 + 0.2 + 0.3) / 4)  # the base model's answers
    assert s["reward_last"] == pytest.approx((0.6 + 0.7) / 2)
    assert s["versions_seen"] == ["base", "a@1"]
    # Without a base-model answer (every one came from an adapter): the first window.
    adapted = [Record(i, "a", f"r{i}", "a@1", i / 10, "", True) for i in range(8)]
    assert summarise(adapted, [t], window=0.25)["a"]["reward_base"] == pytest.approx((0.0 + 0.1) / 2)
    empty = summarise([], [t])["a"]
    assert empty["requests"] == 0 and math.isnan(empty["reward_base"])
