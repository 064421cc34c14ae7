"""LoraSlots: at most `slots` distinct adapters with requests in the engine; a request for another adapter
waits for a slot in its turn, and requests behind it wait too, so that the adapters in the engine drain.
Pure logic on an event loop (no engine)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from serving.lora_slots import LoraSlots

pytestmark = pytest.mark.unit


@contextlib.asynccontextmanager
async def held(slots: LoraSlots, adapter: int | None, priority: int = 0):
    """A slot for `adapter` while the block runs (None: no adapter, no slot), as Engine.stream takes one."""
    if adapter is None:
        yield
        return
    await slots.enter(adapter, priority)
    try:
        yield
    finally:
        slots.leave(adapter)


class Held:
    """Requests that each hold their slot until released: `start(adapter)` -> the name of a running task."""

    def __init__(self, slots: LoraSlots):
        self.slots, self.inside, self.order, self.release, self.tasks = slots, set(), [], {}, {}

    def start(self, name: str, adapter: int | None, priority: int = 0) -> None:
        self.release[name] = asyncio.Event()

        async def request():
            async with held(self.slots, adapter, priority):
                self.inside.add(name)
                self.order.append(name)
                await self.release[name].wait()
                self.inside.discard(name)

        self.tasks[name] = asyncio.create_task(request())

    async def settle(self):
        for _ in range(5):
            await asyncio.sleep(0)

    def done(self, name):
        self.release[name].set()


def run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_adapter_without_a_slot_gets_one_once_an_adapter_in_the_engine_drains():
    """Under steady traffic of two tenants on two slots, a third tenant's request went in only when one of
    their adapters happened to leave the batch; new requests of those adapters now wait behind it."""
    async def scenario():
        slots = LoraSlots(2)
        h = Held(slots)
        h.start("a1", 1)
        h.start("b1", 2)
        await h.settle()
        h.start("c1", 3)  # no slot free
        await h.settle()
        h.start("a2", 1)  # adapter 1 is in the engine, but c1 waits ahead of it
        await h.settle()
        assert h.inside == {"a1", "b1"} and slots.waiting == 2
        h.done("a1")  # adapter 1 drains: its slot goes to c1, then a2 needs one again
        await h.settle()
        assert h.inside == {"b1", "c1"} and slots.active == {2: 1, 3: 1}
        h.done("b1")
        await h.settle()
        assert h.inside == {"c1", "a2"}
        h.done("c1"), h.done("a2")
        await h.settle()
        assert slots.active == {} and slots.waiting == 0
        assert h.order == ["a1", "b1", "c1", "a2"]

    run(scenario)


def test_requests_of_an_adapter_in_the_engine_go_in_at_once_while_nobody_waits():
    async def scenario():
        slots = LoraSlots(1)
        h = Held(slots)
        for i in range(5):
            h.start(f"a{i}", 7)
        h.start("base", None)  # no adapter (a GPU's base model): no slot
        await h.settle()
        assert h.inside == {"a0", "a1", "a2", "a3", "a4", "base"} and slots.active == {7: 5}
        for name in list(h.release):
            h.done(name)
        await h.settle()
        assert slots.active == {}

    run(scenario)


def test_a_more_urgent_request_goes_ahead_of_waiting_ones_and_equal_ones_keep_their_order():
    async def scenario():
        slots = LoraSlots(1)
        h = Held(slots)
        h.start("a", 1)
        await h.settle()
        h.start("rollout", 2, priority=5)
        h.start("b", 3)
        await h.settle()
        h.start("a-more", 1, priority=0)  # b (priority 0) waits ahead of it: it waits
        h.start("a-urgent", 1, priority=-1)  # nobody as urgent waits: in at once
        await h.settle()
        assert h.inside == {"a", "a-urgent"}
        h.done("a"), h.done("a-urgent")
        await h.settle()
        assert h.inside == {"b"}
        h.done("b")
        await h.settle()
        assert h.inside == {"a-more"}
        h.done("a-more")
        await h.settle()
        assert h.inside == {"rollout"} and h.order[-1] == "rollout"
        h.done("rollout")

    run(scenario)


def test_a_waiting_request_whose_client_leaves_frees_the_ones_behind_it():
    async def scenario():
        slots = LoraSlots(1)
        h = Held(slots)
        h.start("a1", 1)
        await h.settle()
        h.start("c", 2)  # waits for the slot
        await h.settle()
        h.start("a2", 1)  # waits behind c
        await h.settle()
        assert h.inside == {"a1"}
        h.tasks["c"].cancel()  # its client left
        await h.settle()
        assert h.inside == {"a1", "a2"} and slots.waiting == 0
        h.done("a1"), h.done("a2")
        await h.settle()
        assert slots.active == {}

    run(scenario)


def test_a_request_admitted_as_it_is_cancelled_gives_its_slot_back():
    async def scenario():
        slots = LoraSlots(1)
        await slots.enter(1, 0)  # "a" holds the slot

        async def b():
            async with held(slots, 2):
                raise AssertionError("b was cancelled before it ran")

        task = asyncio.create_task(b())
        await asyncio.sleep(0)
        assert slots.waiting == 1
        slots.leave(1)  # "a" ends: b is admitted (its future resolved)...
        assert slots.active == {2: 1}
        task.cancel()  # ...and cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slots.active == {} and slots.waiting == 0

    run(scenario)


def test_a_request_that_has_waited_long_goes_before_more_urgent_ones():
    """Production requests (priority 0) of the adapters in the engine kept them there, and a rollout
    (priority 1) of another adapter waited for good; past AGING_S it goes first."""
    from serving import lora_slots

    now = [0.0]

    async def scenario():
        slots = LoraSlots(1, clock=lambda: now[0])
        h = Held(slots)
        h.start("a1", 1)
        await h.settle()
        h.start("rollout", 2, priority=1)
        await h.settle()
        h.start("a2", 1, priority=0)  # more urgent than the rollout, and its adapter is in: in at once
        await h.settle()
        assert h.inside == {"a1", "a2"}
        now[0] = lora_slots.AGING_S  # the rollout has waited long enough
        h.start("a3", 1, priority=0)  # now waits behind it
        await h.settle()
        assert h.inside == {"a1", "a2"} and slots.waiting == 2
        h.done("a1"), h.done("a2")
        await h.settle()
        assert h.inside == {"rollout"}
        h.done("rollout")
        await h.settle()
        assert h.inside == {"a3"}
        h.done("a3")

    run(scenario)


def test_each_wait_for_a_slot_is_reported_once_admitted_and_no_admission_at_once_is():
    from serving.metrics import ServingMetrics

    now = [0.0]

    async def scenario():
        slots = LoraSlots(1, clock=lambda: now[0])
        metrics = ServingMetrics()
        metrics.watch_slots(slots)
        h = Held(slots)
        h.start("a", 1)
        await h.settle()
        h.start("b", 2)
        await h.settle()
        assert "clora_serving_lora_slot_waiting 1.0" in metrics.render().decode()
        assert metrics.slot_wait._sum.get() == 0, "admitted at once: no wait reported"
        now[0] = 1.5
        h.done("a")
        await h.settle()
        assert h.inside == {"b"} and "clora_serving_lora_slot_waiting 0.0" in metrics.render().decode()
        h.done("b")
        await h.settle()
        return metrics.render().decode()

    text = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert "clora_serving_lora_slot_wait_seconds_count 1.0" in text and "clora_serving_lora_slot_wait_seconds_sum 1.5" in text
