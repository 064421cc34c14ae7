"""Which tenant the learner trains next: round_robin, most_backlog or fair_share (`learner.scheduler`).

The learner trains one tenant at a time on one base model, so the scheduler decides how the learner's time
is shared. It is pure: `choose` takes the tenants' pending work (`backlog`: tenant -> trajectories not yet
trained) and a `Ledger` (what the scheduler remembers) and returns a tenant and the next ledger; `charge`
books the seconds a step took. Tenants whose backlog is 0 are never picked, so a tenant with nothing new
costs nothing beyond its entry in the backlog map.

The policies, and why none of them starves a tenant:
- round_robin   Ready tenants in name order, continuing after the last one served. A ready tenant waits at
                most one round (N - 1 picks).
- most_backlog  The tenant with the most pending trajectories (drains hot tenants first), except that a
                ready tenant that has waited N picks or more (N = ready tenants now) goes first, longest
                wait first. That bounds every wait to about 2N picks however the backlogs grow.
- fair_share    The ready tenant that has used the least learner time (steps on big batches or long
                completions cost more time, so this is fairer than counting steps). A tenant that returns
                after idling, or appears for the first time, starts at the current minimum ("floor") rather
                than at its old or zero total, so it cannot monopolise the learner to catch up (the rule of
                Linux's CFS for a waking task). Time grows with every step, so every ready tenant reaches
                the minimum in turn.

Ties break by longest wait, then by name, so a run is deterministic given the same inputs.

Deliberately not here: how backlog is measured (storage.cursors), what a step does (loop.py), and backing
off tenants whose steps fail (loop.py leaves them out of `backlog` for a while).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

SchedulerKind = Literal["round_robin", "most_backlog", "fair_share"]
KINDS: tuple[str, ...] = ("round_robin", "most_backlog", "fair_share")


def _frozen(d: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Ledger:
    """What the scheduler remembers between picks (immutable; `choose` and `charge` return new ones)."""

    picks: int = 0  # how many picks so far
    last: str | None = None  # the tenant picked last
    last_served: Mapping[str, int] = field(default_factory=_frozen)  # tenant -> pick number it was last served at
    seconds: Mapping[str, float] = field(default_factory=_frozen)  # tenant -> learner seconds used (fair_share)
    floor: float = 0.0  # fair_share: least usage among the tenants ready at the last pick

    def waited(self, tenant: str) -> int:
        """Picks since `tenant` was last served (picks so far if it never was)."""
        return self.picks - self.last_served.get(tenant, 0)


def choose(
    kind: str, backlog: Mapping[str, int], ledger: Ledger, *, exclude: Collection[str] = ()
) -> tuple[str | None, Ledger]:
    """The next tenant to train (None when no tenant outside `exclude` has pending work) and the ledger
    that records the pick."""
    ready = sorted(t for t, n in backlog.items() if n > 0 and t not in exclude)
    if not ready:
        return None, ledger
    if kind == "round_robin":
        after = [t for t in ready if ledger.last is not None and t > ledger.last]
        pick = (after or ready)[0]
    elif kind == "most_backlog":
        overdue = [t for t in ready if ledger.waited(t) >= len(ready)]
        if overdue:
            pick = min(overdue, key=lambda t: (-ledger.waited(t), t))
        else:
            pick = min(ready, key=lambda t: (-backlog[t], -ledger.waited(t), t))
    elif kind == "fair_share":
        usage = {t: max(ledger.seconds.get(t, ledger.floor), ledger.floor) for t in ready}
        pick = min(ready, key=lambda t: (usage[t], -ledger.waited(t), t))
        seconds = dict(ledger.seconds)
        seconds[pick] = usage[pick]  # a returning or new tenant is lifted to the floor when it is served
        ledger = replace(ledger, seconds=_frozen(seconds), floor=min(usage.values()))
    else:
        raise ValueError(f"unknown scheduler {kind!r}; expected one of {', '.join(KINDS)}")
    served = dict(ledger.last_served)
    served[pick] = ledger.picks + 1
    return pick, replace(ledger, picks=ledger.picks + 1, last=pick, last_served=_frozen(served))


def after_round(ledger: Ledger, backlog: Mapping[str, int], round_: Sequence[str]) -> Ledger:
    """The ledger once `round_` (the main pick, then its partners, each picked by `choose`) is chosen:
    round_robin's turn goes on at the first ready tenant after the main pick that the round left out. Left at
    the last partner, which wraps round the tenants that may be partners to just before the main pick, it
    made the main pick the same tenant every round, and a tenant that cannot be a partner (one scored by
    feedback: no gate probe to batch) never had its turn again. A round of every ready tenant leaves it at
    the last partner, so the next round starts where this one ended."""
    ready = sorted(t for t, n in backlog.items() if n > 0)
    first = round_[0]
    after = [t for t in ready if t > first] + [t for t in ready if t < first]
    left_out = [t for t in after if t not in round_]
    if not left_out:
        return replace(ledger, last=round_[-1])
    position = ready.index(left_out[0])
    return replace(ledger, last=ready[position - 1] if position else None)


def charge(ledger: Ledger, tenant: str, seconds: float) -> Ledger:
    """Books `seconds` of learner time to `tenant` (what fair_share balances)."""
    if seconds < 0:
        raise ValueError(f"cannot charge negative time {seconds} to tenant {tenant!r}")
    used = dict(ledger.seconds)
    used[tenant] = max(used.get(tenant, ledger.floor), ledger.floor) + seconds
    return replace(ledger, seconds=_frozen(used))
