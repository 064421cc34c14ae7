"""LoraSlots: at most `serving.max_loras` distinct adapters have requests in the engine at once, and a
request whose adapter has no slot gets one in its turn.

vLLM batches at most `max_loras` adapters per step, and its scheduler skips a waiting request whose adapter
is not among those of the running requests once that many run: under steady traffic of `max_loras` tenants
their adapters never all leave the batch, and another tenant's requests waited indefinitely (the scheduler
has no deadline for them). So serving admits requests to the engine here first, one adapter slot per
distinct adapter with requests in the engine:

  - a request whose adapter already has requests in the engine goes in at once, unless a request is waiting
    ahead of it (a smaller `priority`, or the same and earlier): then it waits too, so the adapters in the
    engine drain and one of them gives its slot up;
  - a request whose adapter has none takes a free slot, or waits for one, in order of (priority, arrival);
  - a request that has waited AGING_S counts as the most urgent (before any other, in arrival order among
    such): production traffic of the adapters in the engine (priority 0) would otherwise keep them there,
    and a rollout (priority 1) of another adapter would wait for good.

The cost is a shorter batch while the adapters ahead drain (a generation or so); the gain, that every tenant
is served in its turn however many share the slots. A request gives its slot up as soon as the engine has
finished it (Engine.stream), not once its client has read it all: a client that stops reading its stream
must not hold a slot. A waiting request that is cancelled (its client left) leaves the queue. Base-model
requests on a GPU use no adapter and take no slot; on CPU the zero adapter stands in for the base model
and takes one, as it does in vLLM's batch.

Everything runs on the event loop (one thread): no locks. The waiting requests are kept twice, in arrival
order and in a heap by (priority, arrival), and admitted or cancelled ones are skipped when they reach the
front of either: the first of them is found without a look at every one (a scan per enter and leave cost
~0.1 ms per 1,000 waiting, on the event loop every request and stream shares).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

AGING_S = 5.0  # a request waiting this long goes before every other (see the module note)


@dataclass(eq=False)
class _Waiter:
    priority: int
    adapter_id: int
    since: float
    future: asyncio.Future = field(repr=False)  # done: admitted, or its request cancelled (skipped from then on)


class LoraSlots:
    """`on_wait(seconds)` is called with the wait of each request that had to wait for its slot (metrics)."""

    def __init__(self, slots: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self.clock = clock
        self.active: dict[int, int] = {}  # adapter id -> its requests in the engine
        self._arrivals: deque[_Waiter] = deque()  # waiting, in arrival order (the first to age is the first)
        self._ranked: list[tuple[int, int, _Waiter]] = []  # heap of (priority, arrival number, waiter)
        self._numbers = itertools.count()
        self._count = 0  # waiting requests neither admitted nor cancelled
        self.on_wait: Callable[[float], None] = lambda seconds: None

    @property
    def waiting(self) -> int:
        return self._count

    async def enter(self, adapter_id: int, priority: int = 0) -> None:
        """Waits for a slot for `adapter_id` (see the module note); `leave` gives it back."""
        first = self._first()
        ahead = first is not None and self._rank(first) <= priority
        if not ahead and self._fits(adapter_id):
            self.active[adapter_id] = self.active.get(adapter_id, 0) + 1
            return
        waiter = _Waiter(priority, adapter_id, self.clock(), asyncio.get_running_loop().create_future())
        self._arrivals.append(waiter)
        heapq.heappush(self._ranked, (priority, next(self._numbers), waiter))
        self._count += 1
        try:
            await waiter.future
            self.on_wait(self.clock() - waiter.since)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():  # admitted as it was cancelled
                self.leave(adapter_id)
            else:
                waiter.future.cancel()
                self._count -= 1
                self._wake()  # it may have held up the ones behind it
            raise

    def leave(self, adapter_id: int) -> None:
        left = self.active[adapter_id] - 1
        if left:
            self.active[adapter_id] = left
        else:
            del self.active[adapter_id]
        self._wake()

    def _rank(self, waiter: _Waiter) -> float:
        """Its priority, or before every one once it has waited AGING_S."""
        return float("-inf") if self.clock() - waiter.since >= AGING_S else waiter.priority

    def _first(self) -> _Waiter | None:
        """The waiting request to admit next: the oldest once it has aged (the first to age is the oldest),
        else the most urgent, the earliest of equal priority."""
        arrivals, ranked = self._arrivals, self._ranked
        while arrivals and arrivals[0].future.done():
            arrivals.popleft()
        while ranked and ranked[0][2].future.done():
            heapq.heappop(ranked)
        if not arrivals:
            return None
        oldest = arrivals[0]
        return oldest if self._rank(oldest) == float("-inf") else ranked[0][2]

    def _fits(self, adapter_id: int) -> bool:
        return adapter_id in self.active or len(self.active) < self.slots

    def _wake(self) -> None:
        """Admits the waiting requests in order while the first of them fits."""
        while (first := self._first()) is not None and self._fits(first.adapter_id):
            self.active[first.adapter_id] = self.active.get(first.adapter_id, 0) + 1
            self._count -= 1
            first.future.set_result(None)  # done: skipped by `_first` from now on
