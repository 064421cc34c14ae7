"""learner/scheduler.py: the three policies, skipping idle tenants, and no starvation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.scheduler import KINDS, Ledger, charge, choose

pytestmark = pytest.mark.unit


def picks(kind, backlog, n, ledger=None, cost=None):
    ledger = ledger or Ledger()
    out = []
    for _ in range(n):
        t, ledger = choose(kind, backlog, ledger)
        out.append(t)
        if t is not None:
            ledger = charge(ledger, t, (cost or {}).get(t, 1.0))
    return out, ledger


def test_round_robin_cycles_in_name_order_and_skips_idle_tenants():
    out, _ = picks("round_robin", {"b": 5, "a": 3, "idle": 0, "c": 1}, 7)
    assert out == ["a", "b", "c", "a", "b", "c", "a"]


def test_nothing_pending_means_no_pick_and_an_unchanged_ledger():
    for kind in KINDS:
        ledger = Ledger()
        t, after = choose(kind, {"a": 0, "b": 0}, ledger)
        assert t is None and after == ledger


def test_exclude_leaves_tenants_out_of_one_pass():
    t, ledger = choose("round_robin", {"a": 1, "b": 1}, Ledger(), exclude={"a"})
    assert t == "b"
    assert choose("round_robin", {"a": 1, "b": 1}, ledger, exclude={"a", "b"})[0] is None


def test_most_backlog_prefers_the_biggest_backlog_but_serves_small_ones_within_2n_picks():
    backlog = {"big": 1000, "mid": 500, "small": 1}
    out, _ = picks("most_backlog", backlog, 12)
    assert out[0] == "big"
    # three ready tenants: nobody waits 2 * 3 picks or more
    for t in backlog:
        served_at = [i for i, x in enumerate(out) if x == t]
        gaps = [b - a for a, b in zip([-1, *served_at], served_at)]
        assert served_at and max(gaps) <= 2 * len(backlog), (t, out)


def test_fair_share_balances_time_not_steps():
    # "slow" steps cost 3 s, "fast" ones 1 s: over 8 picks fast is picked 3x as often (6 vs 2), and the
    # times used end up equal (6 s each).
    out, ledger = picks("fair_share", {"fast": 9, "slow": 9}, 8, cost={"fast": 1.0, "slow": 3.0})
    assert out.count("fast") == 6 and out.count("slow") == 2
    assert ledger.seconds["fast"] == ledger.seconds["slow"] == 6.0


def test_fair_share_tenant_returning_from_idle_does_not_monopolise():
    # a and b run for 10 picks (5 s each); c was idle and appears now with no usage. It is lifted to the
    # floor (5 s) when first served, so the next picks alternate instead of giving c 5 picks in a row.
    _, ledger = picks("fair_share", {"a": 9, "b": 9}, 10)
    assert ledger.seconds == {"a": 5.0, "b": 5.0}
    out, ledger = picks("fair_share", {"a": 9, "b": 9, "c": 9}, 6, ledger=ledger)
    assert out.count("c") == 2 and out.count("a") == 2 and out.count("b") == 2


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown scheduler 'lottery'"):
        choose("lottery", {"a": 1}, Ledger())


def test_charge_rejects_negative_time():
    with pytest.raises(ValueError, match="negative time -1"):
        charge(Ledger(), "a", -1)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    n_tenants=st.integers(1, 6),
    growth=st.lists(st.integers(0, 50), min_size=6, max_size=6),
    costs=st.lists(st.floats(0.01, 5.0), min_size=6, max_size=6),
)
def test_no_ready_tenant_starves(kind, n_tenants, growth, costs):
    # every tenant always has work and backlogs grow at different rates; costs differ by up to 500x.
    # Every tenant must be served within a bound: N picks (round_robin), 2N (most_backlog), and for
    # fair_share within the picks it takes the others to spend max_cost/min_cost more time.
    names = [f"t{i}" for i in range(n_tenants)]
    backlog = {t: 1 for t in names}
    cost = dict(zip(names, costs))
    bound = {"round_robin": n_tenants, "most_backlog": 2 * n_tenants}.get(
        kind, int(n_tenants * (max(cost.values()) / min(cost.values()) + 2))
    )
    ledger = Ledger()
    last_seen = {t: -1 for t in names}
    for i in range(bound * 4):
        t, ledger = choose(kind, backlog, ledger)
        ledger = charge(ledger, t, cost[t])
        last_seen[t] = i
        for name, g in zip(names, growth):
            backlog[name] += g
        for name in names:
            assert i - last_seen[name] <= bound, (kind, name, i, last_seen)
