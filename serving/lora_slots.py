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
  - a request whose adapter has none takes a free slot, or waits for one, in order of (priority, arrival).

The cost is a shorter batch while the adapters ahead drain (a generation or so); the gain, that every tenant
is served in its turn however many share the slots. A waiting request that is cancelled (its client left)
leaves the queue. Base-model requests on a GPU use no adapter and take no slot; on CPU the zero adapter
stands in for the base model and takes one, as it does in vLLM's batch.

Everything runs on the event loop (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator


class LoraSlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self.active: dict[int, int] = {}  # adapter id -> its requests in the engine
        self._waiting: list[tuple[int, int, int, asyncio.Future]] = []  # heap of (priority, arrival, adapter, future)
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for *_, f in self._waiting)

    @contextlib.asynccontextmanager
    async def held(self, adapter_id: int | None, priority: int = 0) -> AsyncIterator[None]:
        """Holds a slot for `adapter_id` (None: no adapter, no slot) while the block runs."""
        if adapter_id is None:
            yield
            return
        await self._enter(adapter_id, priority)
        try:
            yield
        finally:
            self._leave(adapter_id)

    async def _enter(self, adapter_id: int, priority: int) -> None:
        self._drop_cancelled()
        ahead = bool(self._waiting) and self._waiting[0][0] <= priority
        if not ahead and self._fits(adapter_id):
            self.active[adapter_id] = self.active.get(adapter_id, 0) + 1
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrivals), adapter_id, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # admitted as it was cancelled: give the slot back
                self._leave(adapter_id)
            else:
                future.cancel()
                self._wake()  # it may have held up the ones behind it
            raise

    def _fits(self, adapter_id: int) -> bool:
        return adapter_id in self.active or len(self.active) < self.slots

    def _leave(self, adapter_id: int) -> None:
        left = self.active[adapter_id] - 1
        if left:
            self.active[adapter_id] = left
        else:
            del self.active[adapter_id]
        self._wake()

    def _wake(self) -> None:
        """Admits the waiting requests in order while the first of them fits."""
        self._drop_cancelled()
        while self._waiting and self._fits(self._waiting[0][2]):
            _, _, adapter_id, future = heapq.heappop(self._waiting)
            self.active[adapter_id] = self.active.get(adapter_id, 0) + 1
            future.set_result(None)
            self._drop_cancelled()

    def _drop_cancelled(self) -> None:
        while self._waiting and self._waiting[0][3].done():
            heapq.heappop(self._waiting)
