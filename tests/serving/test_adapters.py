"""Hot-swap bookkeeping against a real registry and real validation, with a fake engine that records
what is loaded: newest published version becomes current, leases pin old versions until released,
corrupt versions are refused, explicit versions load on demand."""

import asyncio
import functools
import shutil

import pytest

from make_adapter import write_peft_adapter
from serving.adapter_check import base_linear_shapes, validate_adapter
from serving.adapters import AdapterSet, UnknownVersion, stage_directory
from serving.engine import AdapterHandle
from serving.errors import Unavailable
from serving.metrics import ServingMetrics
from storage.registry import Registry

pytestmark = pytest.mark.unit


class FakeEngine:
    """Records loads/unloads; ids are handed out like the real engine's. A load of an adapter whose name
    `fails(name)` says so raises, as the real engine's transient failures do."""

    def __init__(self):
        self.loaded: dict[int, str] = {}
        self.next_id = 1
        self.fails = lambda name: False

    def new_handle(self, name, path):
        handle = AdapterHandle(name, self.next_id, path)
        self.next_id += 1
        return handle

    async def load_adapter(self, adapter):
        if self.fails(adapter.name):
            raise RuntimeError(f"engine busy: {adapter.name} not loaded")
        self.loaded[adapter.lora_id] = adapter.name

    async def unload_adapter(self, adapter):
        del self.loaded[adapter.lora_id]


@pytest.fixture
def world(tmp_path, tiny_model):
    registry = Registry(tmp_path / "data")
    check = functools.partial(validate_adapter, max_rank=16, base_shapes=base_linear_shapes(tiny_model))
    engine = FakeEngine()
    adapters = AdapterSet(engine, registry, ["acme", "globex"], check, ServingMetrics())

    def publish(tenant, seed, corrupt=False):
        def write(d):
            write_peft_adapter(tiny_model, d, seed=seed, rank=4)
            if corrupt:
                (d / "adapter_model.safetensors").write_bytes(b"not safetensors")
        v = registry.create(tenant, parent=None, write=write)
        registry.publish(tenant, v.number)
        return v.number

    return registry, engine, adapters, publish


def run(coro):
    return asyncio.run(coro)


def test_newest_published_becomes_current_and_old_leaves_when_released(world):
    registry, engine, adapters, publish = world

    async def scenario():
        await adapters.refresh()
        assert adapters.current("acme") == "base"
        base = await adapters.acquire("acme")
        assert base.adapter is None and base.label == "base"

        publish("acme", seed=1)
        await adapters.refresh()
        held = await adapters.acquire("acme")
        assert held.label == "acme@1" and set(engine.loaded.values()) == {"acme@1"}

        publish("acme", seed=2)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@2"
        assert set(engine.loaded.values()) == {"acme@1", "acme@2"}  # acme@1 still has a lease
        fresh = await adapters.acquire("acme")
        assert fresh.label == "acme@2"
        held.release()
        held.release()  # idempotent
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@2"}
        fresh.release()
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@2"}  # current stays loaded
        assert adapters.metrics.adapter_version.labels("acme")._value.get() == 2

    run(scenario())


def test_corrupt_version_is_refused_and_tenant_keeps_its_version(world):
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        await adapters.refresh()
        bad = publish("acme", seed=2, corrupt=True)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@1"
        assert f"acme@{bad}" in adapters.refused()
        assert "cannot be read" in adapters.refused()[f"acme@{bad}"]
        assert adapters.metrics.refused.labels("acme")._value.get() == 1
        with pytest.raises(UnknownVersion, match="cannot be served"):
            await adapters.acquire("acme", bad)
        await adapters.refresh()  # not retried on every poll
        assert adapters.metrics.refused.labels("acme")._value.get() == 1
        publish("acme", seed=3)  # the fix is a new version
        await adapters.refresh()
        assert adapters.current("acme") == "acme@3"

    run(scenario())


def test_a_tenant_added_by_a_config_re_read_is_served_its_adapter_and_one_removed_leaves_the_engine(world):
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        publish("initech", seed=2)  # not one of the set's tenants yet
        await adapters.refresh()
        assert set(engine.loaded.values()) == {"acme@1"} and adapters.current("initech") == "base"
        held = await adapters.acquire("acme")  # a request of acme's still running as it leaves
        await adapters.set_tenants(["globex", "initech"])
        await adapters.refresh()  # no registry change since: the new tenant's versions are read all the same
        assert adapters.current("initech") == "initech@1" and adapters.current("acme") == "base"
        assert set(engine.loaded.values()) == {"acme@1", "initech@1"}, "acme@1 stays for its running request"
        held.release()
        await adapters.drain()
        assert set(engine.loaded.values()) == {"initech@1"}
        metrics = adapters.metrics.render().decode()
        assert 'adapter_version{tenant="initech"} 1.0' in metrics and 'adapter_version{tenant="acme"}' not in metrics
        # initech@1 was published before initech was added: its age is not a publish-to-live time; initech@2's is
        assert 'publish_to_live_seconds_count{tenant="initech"}' not in metrics
        publish("initech", seed=3)
        await adapters.refresh()
        assert 'publish_to_live_seconds_count{tenant="initech"} 1.0' in adapters.metrics.render().decode()

    run(scenario())


def test_only_the_newest_refused_versions_are_remembered(world, monkeypatch):
    """Under a systematic refusal every step adds one; /health shows them all, so they must not pile up."""
    registry, engine, adapters, publish = world
    monkeypatch.setattr("serving.adapters.REFUSED_KEPT", 3)

    async def scenario():
        publish("globex", seed=9, corrupt=True)
        bad = []
        for seed in range(5):
            bad.append(publish("acme", seed=seed, corrupt=True))
            await adapters.refresh()
        assert sorted(adapters.refused()) == sorted([f"acme@{n}" for n in bad[-3:]] + ["globex@1"])
        assert adapters.metrics.refused.labels("acme")._value.get() == 5, "the counter still counts every one"

    run(scenario())


def test_explicit_versions_load_on_demand_and_unknown_ones_are_404(world):
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2)
        await adapters.refresh()
        assert set(engine.loaded.values()) == {"acme@2"}
        old = await adapters.acquire("acme", 1)
        again = await adapters.acquire("acme", 1)
        assert old.label == again.label == "acme@1" and old.adapter == again.adapter
        assert set(engine.loaded.values()) == {"acme@1", "acme@2"}
        old.release()
        again.release()
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@1", "acme@2"}, "kept a while for the next request naming it"
        current = await adapters.acquire("acme", 2)
        assert current.adapter.name == "acme@2"
        for missing in (3, 99):
            with pytest.raises(UnknownVersion, match="does not exist"):
                await adapters.acquire("acme", missing)
        registry.retire("acme", 1)
        await adapters.refresh()  # the watcher sees the registry change
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 1)
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@2"}, "found retired, it leaves at once"

    run(scenario())


def test_a_version_asked_for_by_name_stays_loaded_a_while_after_its_last_request(world):
    """A client comparing versions request by request (`acme@1`, then `acme@1` again) loaded, checked and
    unloaded the version for each request. It now stays until `keep_idle_s` after its last request, at most
    IDLE_PER_TENANT per tenant (the most recently used), and goes at once when its tenant leaves."""
    from serving.adapters import IDLE_PER_TENANT

    registry, engine, adapters, publish = world
    now = [1000.0]
    adapters.monotonic = lambda: now[0]
    loads = []
    load = engine.load_adapter

    async def counted(adapter):
        loads.append(adapter.name)
        await load(adapter)
    engine.load_adapter = counted

    async def ask(number):
        lease = await adapters.acquire("acme", number)
        lease.release()
        await adapters.drain()
        return lease.adapter.lora_id

    async def scenario():
        for seed in range(1, 6):
            publish("acme", seed=seed)
        publish("globex", seed=9)
        await adapters.refresh()  # acme@5 current
        first = await ask(1)
        now[0] += adapters.keep_idle_s - 1
        assert await ask(1) == first and loads.count("acme@1") == 1, "loaded once for both requests"
        now[0] += adapters.keep_idle_s - 1  # within the time kept since the last request, not the first
        await adapters.refresh()
        assert "acme@1" in engine.loaded.values()
        now[0] += 2
        await adapters.refresh()  # a poll past it
        await adapters.drain()
        assert "acme@1" not in engine.loaded.values()

        for number in (1, 2, 3, 2):
            await ask(number)
        assert IDLE_PER_TENANT == 2
        assert set(engine.loaded.values()) == {"acme@2", "acme@3", "acme@5", "globex@1"}, "the two used last"
        assert loads.count("acme@2") == 1
        leases = [await adapters.acquire("globex", 1) for _ in range(2)]
        for lease in leases:
            lease.release()
        await adapters.drain()
        assert "acme@2" in engine.loaded.values(), "another tenant's versions take none of its room"

        running = await adapters.acquire("acme", 2)  # a request still running as its tenant leaves
        await adapters.set_tenants(["globex"])
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@2", "globex@1"}
        running.release()
        await adapters.drain()
        assert set(engine.loaded.values()) == {"globex@1"}, "a tenant that left keeps nothing loaded"

    run(scenario())


def test_an_older_version_that_cannot_be_loaded_now_is_a_503_to_retry_not_a_500(world):
    """An explicit `acme@1` whose load failed for a reason that says nothing about the adapter (its files
    deleted by a retire under way, an I/O error, the engine) was answered "internal error" (500)."""
    from serving.errors import AdapterUnavailable

    registry, engine, adapters, publish = world
    failing = []  # the next load fails while this holds an entry
    engine.fails = lambda name: bool(failing) and bool(failing.pop())

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2)
        await adapters.refresh()  # acme@2 current
        failing.append(True)
        with pytest.raises(AdapterUnavailable) as error:
            await adapters.acquire("acme", 1)
        assert error.value.status == 503 and error.value.headers == {"Retry-After": "1"}
        assert adapters.refused() == {}, "not refused: asked again, it loads"
        lease = await adapters.acquire("acme", 1)
        assert lease.label == "acme@1"
        lease.release()
        await adapters.drain()

    run(scenario())


def test_a_retired_version_is_refused_even_while_a_request_still_holds_it(world):
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2)
        await adapters.refresh()
        held = await adapters.acquire("acme", 1)  # a long request on acme@1 keeps it loaded
        registry.retire("acme", 1)
        await adapters.refresh()  # the watcher sees the registry change
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 1)
        assert held.label == "acme@1"  # the running request keeps its version to the end
        held.release()
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@2"}

    run(scenario())


def test_a_retired_version_is_refused_while_another_tenants_swap_backs_off(world):
    """One tenant's adapter that keeps failing to load (a transient error, retried with back-off) leaves
    the registry's changes unsettled; a version retired meanwhile must still be refused from the next poll."""
    registry, engine, adapters, publish = world
    check = adapters.check

    def globex_unreadable(path):
        if "globex" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return check(path)

    adapters.check = globex_unreadable

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2)
        await adapters.refresh()
        held = await adapters.acquire("acme", 1)  # a long request keeps acme@1 loaded
        publish("globex", seed=3)
        await adapters.refresh()  # globex@1 fails: backing off
        assert adapters.current("globex") == "base"
        registry.retire("acme", 1)
        await adapters.refresh()
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 1)
        assert adapters.current("acme") == "acme@2"
        held.release()

    run(scenario())


def test_a_retired_version_is_not_served_while_the_newest_is_refused(world):
    """The newest published version refused, the current one retired (`clora adapters retire`): neither
    "acme" nor "acme@1" may still get acme@1. Nothing else is published, so the base model serves."""
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        await adapters.refresh()
        publish("acme", seed=2, corrupt=True)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@1" and "acme@2" in adapters.refused()
        registry.retire("acme", 1)
        await adapters.refresh()
        assert adapters.current("acme") == "base"
        assert (await adapters.acquire("acme")).label == "base"
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 1)
        await adapters.drain()
        assert engine.loaded == {}
        assert adapters.metrics.adapter_version.labels("acme")._value.get() == 0

    run(scenario())


def test_a_version_retention_retired_is_not_served_while_the_newer_ones_are_refused(tmp_path, tiny_model):
    """keep_versions (the registry's keep_last) 2: publishing acme@3 retires acme@1, which serves while acme@2
    and acme@3 are refused; it must not serve on."""
    registry = Registry(tmp_path / "data", keep_last=2)
    check = functools.partial(validate_adapter, max_rank=16, base_shapes=base_linear_shapes(tiny_model))
    adapters = AdapterSet(FakeEngine(), registry, ["acme"], check, ServingMetrics())

    def publish(seed, corrupt=False):
        def write(d):
            write_peft_adapter(tiny_model, d, seed=seed, rank=4)
            if corrupt:
                (d / "adapter_model.safetensors").write_bytes(b"not safetensors")
        v = registry.create("acme", parent=None, write=write)
        return registry.publish("acme", v.number)

    async def scenario():
        publish(seed=1)
        await adapters.refresh()
        publish(seed=2, corrupt=True)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@1"
        publish(seed=3, corrupt=True)
        assert registry.get("acme", 1).status == "retired"
        await adapters.refresh()
        assert adapters.current("acme") == "base"
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 1)
        await adapters.drain()

    run(scenario())


def test_a_retired_version_gives_way_to_the_newest_published_one_that_can_be_served(world):
    """acme@3 refused, acme@2 (current) retired: acme@1, still published, serves; a server started now
    serves the same."""
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2)
        await adapters.refresh()
        publish("acme", seed=3, corrupt=True)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@2"
        registry.retire("acme", 2)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@1"
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 2)
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@1"}

        restarted = AdapterSet(FakeEngine(), registry, ["acme"], adapters.check, ServingMetrics())
        await restarted.refresh()
        assert restarted.current("acme") == "acme@1" and "acme@3" in restarted.refused()

    run(scenario())


def test_a_retired_version_is_not_served_while_the_newest_backs_off(world):
    """The newest published version fails to load (transient: tried again, backing off) and the current one
    is retired meanwhile: the base model serves until the newest loads."""
    from serving.adapters import RETRY_FIRST_S

    registry, engine, adapters, publish = world
    now = [0.0]
    adapters.monotonic = lambda: now[0]
    broken = {"acme@2"}
    engine.fails = lambda name: name in broken

    async def scenario():
        publish("acme", seed=1)
        await adapters.refresh()
        publish("acme", seed=2)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@1"  # still published: it serves while acme@2 backs off
        assert adapters.metrics.load_failures.labels("acme")._value.get() == 1  # what an alert on swaps stuck sees
        registry.retire("acme", 1)
        await adapters.refresh()  # acme@2 is still backing off
        assert adapters.current("acme") == "base"
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 1)
        broken.clear()
        now[0] += RETRY_FIRST_S * 4
        await adapters.refresh()
        assert adapters.current("acme") == "acme@2" and not adapters._failing
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@2"}

    run(scenario())


def test_tenants_falling_back_list_their_versions_once_per_registry_change_not_every_poll(world):
    """While one tenant's newest version backs off, the registry change stays unsettled and every poll
    follows every tenant: a tenant whose newest version is refused listed its versions at each poll."""
    registry, engine, adapters, publish = world
    now = [0.0]
    adapters.monotonic = lambda: now[0]
    engine.fails = lambda name: name.startswith("globex@")
    listings = []
    unsettled = registry.unsettled
    registry.unsettled = lambda tenant: listings.append(tenant) or unsettled(tenant)

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2, corrupt=True)  # refused: acme falls back to acme@1
        publish("globex", seed=3)  # backs off for ever
        for _ in range(20):
            await adapters.refresh()
            now[0] += 0.5
        assert adapters.current("acme") == "acme@1" and adapters.current("globex") == "base"
        assert listings.count("acme") == 1, listings
        registry.retire("acme", 1)  # a registry change: looked at again, once
        for _ in range(5):
            await adapters.refresh()
            now[0] += 0.5
        assert adapters.current("acme") == "base" and listings.count("acme") == 2
        await adapters.drain()

    run(scenario())


def test_a_tenant_whose_versions_cannot_be_listed_does_not_stop_the_others(world):
    """An OSError (EIO, ESTALE, EACCES) listing one tenant's versions ended the whole refresh: the tenants after
    it were not swapped, and at start-up the server did not start."""
    registry, engine, adapters, publish = world
    unsettled = registry.unsettled

    def acme_unlistable(tenant):
        if tenant == "acme":
            raise PermissionError(13, "Permission denied", "adapters/acme")
        return unsettled(tenant)

    registry.unsettled = acme_unlistable

    async def scenario():
        publish("acme", seed=1, corrupt=True)  # refused: acme falls back, and its listing fails
        publish("globex", seed=2)
        await adapters.refresh()
        assert adapters.current("acme") == "base" and adapters.current("globex") == "globex@1"
        registry.unsettled = unsettled  # the disk is back: tried again at the next poll
        publish("acme", seed=3, corrupt=True)
        await adapters.refresh()
        assert adapters.current("acme") == "base" and adapters._fell_back.get("acme") is not None
        await adapters.drain()

    run(scenario())


def test_the_current_version_asked_for_by_name_is_refused_once_retired_even_before_a_swap(world, caplog):
    """Naming the current version ("acme@1") is checked against the registry like any other version: a record
    edited by hand keeps the tenant's versions from being listed, so "acme" stays where it is until the
    registry's next change, but "acme@1", retired, is 404 from the next poll on."""
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        await adapters.refresh()
        publish("acme", seed=2, corrupt=True)
        await adapters.refresh()
        (registry.dd.registry / "acme" / "2.json").write_bytes(b"{")
        registry.retire("acme", 1)
        await adapters.refresh()
        with pytest.raises(UnknownVersion, match="retired"):
            await adapters.acquire("acme", 1)
        await adapters.refresh()
        loud = [r for r in caplog.records if "stays on" in r.getMessage()]
        assert len(loud) == 1 and "2.json" in loud[0].getMessage(), "logged once, not at every poll"

    run(scenario())


def test_concurrent_requests_for_one_version_load_it_once(world):
    registry, engine, adapters, publish = world

    async def scenario():
        publish("globex", seed=1)
        publish("globex", seed=2)
        leases = await asyncio.gather(*[adapters.acquire("globex", 1) for _ in range(5)])
        assert len({lease.adapter.lora_id for lease in leases}) == 1
        assert list(engine.loaded.values()) == ["globex@1"]
        for lease in leases:
            lease.release()
        await adapters.drain()
        assert list(engine.loaded.values()) == ["globex@1"], "kept a while for the next request naming it"
        adapters.keep_idle_s = 0.0
        await adapters.refresh()  # a poll past the time kept (it also makes globex@2 current)
        await adapters.drain()
        assert list(engine.loaded.values()) == ["globex@2"]

    run(scenario())


def test_a_transient_failure_is_tried_again_backing_off_and_logged_once(world, caplog):
    """An I/O error while checking, or the engine failing a load, says nothing about the adapter: only a
    validation refusal is for good. Tries are spaced RETRY_FIRST_S, doubling up to RETRY_MAX_S (each one
    validates the adapter again), not made at every poll."""
    from serving.adapters import RETRY_FIRST_S, RETRY_MAX_S

    registry, engine, adapters, publish = world
    check, load = adapters.check, engine.load_adapter
    failures = {"check": 0, "load": 0}
    tries = []
    now = [1000.0]
    adapters.monotonic = lambda: now[0]

    def flaky_check(path):
        tries.append(now[0])
        if failures["check"]:
            failures["check"] -= 1
            raise OSError(5, "Input/output error", str(path))
        return check(path)

    async def flaky_load(adapter):
        if failures["load"]:
            failures["load"] -= 1
            raise RuntimeError(f"the engine did not load adapter {adapter.name}")
        await load(adapter)

    adapters.check, engine.load_adapter = flaky_check, flaky_load

    async def scenario():
        for step, (kind, seed) in enumerate((("check", 1), ("load", 2))):
            failures[kind] = 3
            caplog.clear()
            tries.clear()
            number = publish("acme", seed=seed)
            start = now[0]
            for _ in range(3):  # each failed try, then polls before its back-off has passed: no try
                await adapters.refresh()
                await adapters.refresh()
                assert adapters.current("acme") == ("base" if step == 0 else "acme@1")
                wait = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (len(tries) - 1))
                now[0] += wait - 0.01
                await adapters.refresh()
                now[0] += 0.01
            assert [round(t - start, 6) for t in tries] == [0.0, RETRY_FIRST_S, 3 * RETRY_FIRST_S], tries
            assert adapters.refused() == {} and adapters.metrics.refused.labels("acme")._value.get() == 0
            loud = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
            assert len(loud) == 1 and f"acme@{number}" in loud[0].getMessage(), loud  # not once a try
            await adapters.refresh()  # the error has passed
            assert adapters.current("acme") == f"acme@{number}" and adapters.refused() == {}
        await adapters.drain()
        assert set(engine.loaded.values()) == {"acme@2"}

    run(scenario())


def test_an_error_opening_the_weights_is_tried_again_not_a_refusal(world, monkeypatch):
    """The real check: a failure to open adapter_model.safetensors (EACCES, EMFILE: safetensors calls every one
    "No such file") refused a good adapter for good. It is tried again after its back-off and then serves."""
    import safetensors

    from serving.adapters import RETRY_FIRST_S

    registry, engine, adapters, publish = world
    now = [0.0]
    adapters.monotonic = lambda: now[0]
    real_safe_open = safetensors.safe_open
    failures = [1]

    def fake_safe_open_failing_to_open_once(filename, framework, **kwargs):
        if failures[0] and filename.endswith("adapter_model.safetensors"):
            failures[0] -= 1  # what safetensors raises for any failure to open the file (EACCES, EMFILE)
            raise FileNotFoundError("No such file or directory (os error 2)")
        return real_safe_open(filename, framework=framework, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", fake_safe_open_failing_to_open_once)

    async def scenario():
        publish("acme", seed=1)
        await adapters.refresh()
        assert adapters.current("acme") == "base" and adapters.refused() == {}
        assert adapters.metrics.refused.labels("acme")._value.get() == 0
        now[0] += RETRY_FIRST_S
        await adapters.refresh()
        assert adapters.current("acme") == "acme@1" and adapters.refused() == {}
        await adapters.drain()

    run(scenario())


def test_the_back_off_is_per_version_and_capped(world):
    """A newer version published while one backs off is tried at once; the wait never exceeds RETRY_MAX_S."""
    from serving.adapters import RETRY_MAX_S

    registry, engine, adapters, publish = world
    now = [0.0]
    adapters.monotonic = lambda: now[0]
    broken = {"acme@1"}
    engine.fails = lambda name: name in broken

    async def scenario():
        publish("acme", seed=1)
        for _ in range(12):
            await adapters.refresh()
            now[0] += RETRY_MAX_S
        assert adapters._failing[("acme", 1)].retry_at - now[0] <= RETRY_MAX_S
        publish("acme", seed=2)
        await adapters.refresh()
        assert adapters.current("acme") == "acme@2" and not adapters._failing
        await adapters.drain()

    run(scenario())


def test_an_unreadable_head_keeps_every_tenant_on_its_version_until_the_next_change(world, caplog):
    """HEAD.json edited by hand: serving keeps what it serves (logged once, not at every poll) and follows the
    registry again once its next change rebuilds HEAD.json."""
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        publish("globex", seed=2)
        await adapters.refresh()
        (registry.dd.registry / "HEAD.json").write_bytes(b"{ oops")
        for _ in range(3):
            await adapters.refresh()
        assert (adapters.current("acme"), adapters.current("globex")) == ("acme@1", "globex@1")
        loud = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
        assert len(loud) == 1 and "HEAD.json cannot be read" in loud[0].getMessage(), loud
        publish("acme", seed=3)  # any change rebuilds HEAD.json
        await adapters.refresh()
        assert (adapters.current("acme"), adapters.current("globex")) == ("acme@2", "globex@1")
        await adapters.drain()

    run(scenario())


def test_an_explicit_version_whose_record_cannot_be_read_is_refused_without_its_path(world):
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2)
        await adapters.refresh()
        (registry.dd.registry / "acme" / "1.json").write_bytes(b"{")
        with pytest.raises(UnknownVersion, match="its registry record cannot be read") as e:
            await adapters.acquire("acme", 1)
        assert "1.json" not in str(e.value)

    run(scenario())


def _forget(registry: Registry, tenant: str) -> None:
    """Every trace of the tenant's versions gone, HEAD.json too: a data dir replaced under a running server."""
    shutil.rmtree(registry.dd.registry / tenant)
    shutil.rmtree(registry.dd.adapters / tenant)
    (registry.dd.registry / "HEAD.json").unlink()


def test_a_version_number_shown_again_with_other_files_replaces_the_one_served(world, caplog):
    """The registry never reuses a number, but a data dir replaced (or edited by hand) under a running server
    can show acme@1 again with other files: serving tells them apart by the record's created_at. vLLM tells
    adapters apart by name, so the new acme@1 is loaded once the old one has left the engine."""
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        await adapters.refresh()
        held = await adapters.acquire("acme")  # a request still running on the old acme@1
        old_id = held.adapter.lora_id
        _forget(registry, "acme")
        assert publish("acme", seed=2) == 1
        await adapters.refresh()
        assert adapters.current("acme") == "base", "the old files no longer serve what the registry calls acme@1"
        assert engine.loaded == {old_id: "acme@1"}, "one adapter per name in the engine"
        assert any("acme@1 was replaced in the registry" in r.getMessage() for r in caplog.records)
        with pytest.raises(Unavailable, match="replaced") as replaced:
            await adapters.acquire("acme", 1)
        assert replaced.value.headers == {"Retry-After": "1"}  # served again once the old one's requests end
        await adapters.refresh()
        assert adapters.current("acme") == "base"
        held.release()
        await adapters.drain()
        await adapters.refresh()
        fresh = await adapters.acquire("acme")
        assert fresh.label == "acme@1" and fresh.adapter.lora_id != old_id
        assert list(engine.loaded) == [fresh.adapter.lora_id]
        assert adapters._current["acme"].created == registry.get("acme", 1).created_at
        fresh.release()
        await adapters.drain()

    run(scenario())


def test_a_replaced_version_no_request_runs_on_is_swapped_at_once(world):
    registry, engine, adapters, publish = world

    async def scenario():
        publish("acme", seed=1)
        await adapters.refresh()
        old_id = adapters._current["acme"].handle.lora_id
        _forget(registry, "acme")
        assert publish("acme", seed=2) == 1
        await adapters.refresh()
        await adapters.drain()
        new_id = adapters._current["acme"].handle.lora_id
        assert adapters.current("acme") == "acme@1" and list(engine.loaded) == [new_id] and new_id != old_id

    run(scenario())


def test_versions_load_from_servings_own_copy_which_outlives_the_registrys_files(tmp_path, tiny_model):
    """The registry deletes a retired version's files at once; vLLM reads an evicted adapter again from its
    path. Serving's copy (hard links) keeps the path good until the version leaves the engine."""
    registry = Registry(tmp_path / "data", keep_last=1)
    checked = []

    def check(path):
        checked.append(path)
        validate_adapter(path, max_rank=16, base_shapes=base_linear_shapes(tiny_model))

    engine = FakeEngine()
    stage = stage_directory(tmp_path / "stage")
    adapters = AdapterSet(engine, registry, ["acme"], check, ServingMetrics(), stage_dir=stage)

    def publish(seed):
        v = registry.create("acme", parent=None, write=lambda d: write_peft_adapter(tiny_model, d, seed=seed, rank=4))
        return registry.publish("acme", v.number)

    async def scenario():
        v1 = publish(seed=1)
        await adapters.refresh()
        held = await adapters.acquire("acme")  # a request still running on acme@1
        copy = held.adapter.path
        assert copy.parent == stage and checked == [copy]  # what is loaded is what was checked
        original = (v1.path / "adapter_model.safetensors").read_bytes()
        publish(seed=2)  # keep_last 1: acme@1 is retired and its files deleted
        await adapters.refresh()
        assert not v1.path.exists() and adapters.current("acme") == "acme@2"
        assert (copy / "adapter_model.safetensors").read_bytes() == original  # the engine can still read it
        held.release()
        await adapters.drain()
        assert not copy.exists() and sorted(p.name for p in stage.iterdir()) == [".lock", "acme@2.2"]  # acme@2's copy

    run(scenario())


def test_a_stage_directory_of_a_dead_process_on_this_host_is_removed(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    gone = tmp_path / f"{host}-{int(dead.stdout)}"
    other_host = tmp_path / "elsewhere-1"
    # a host named ours + "-<n>", where n is a dead pid here
    longer_name = tmp_path / f"{host}-{int(dead.stdout)}-{int(dead.stdout)}"
    for d in (gone, other_host, longer_name):
        (d / "7").mkdir(parents=True)
    mine = stage_directory(tmp_path)
    assert mine.name.startswith(f"{host}-{os.getpid()}.") and [p.name for p in mine.iterdir()] == [".lock"]
    # other hosts' processes are not ours to judge (folders named before stage folders had locks)
    assert not gone.exists() and other_host.exists() and longer_name.exists()


def test_a_replica_starting_at_the_same_moment_does_not_remove_a_stage_folder_being_made(tmp_path, monkeypatch):
    """The lock file was created, then locked: a peer's sweep between the two found it free, took it and
    removed the folder, whose replica then served its zero adapter from a folder with no lock (removed by
    the next start, under the running engine)."""
    import fcntl

    from serving import adapters

    real_flock, swept = fcntl.flock, []

    def flock(fd, op):
        if not swept:  # the first lock taken: this replica's own, of its new folder
            swept.append(1)
            adapters._remove_gone_stages(tmp_path)  # a peer starting now sweeps the stage root
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    mine = stage_directory(tmp_path)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert swept and mine.is_dir() and [p.name for p in mine.iterdir()] == [".lock"]
    with open(mine / ".lock", "rb") as lock, pytest.raises(BlockingIOError):  # held by this replica
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_stage_folder_goes_when_its_lock_is_free_whatever_process_id_it_names(tmp_path):
    """Told apart by process id alone, replicas in containers sharing the data dir (each pid 1, one host name)
    deleted one another's adapter copies, the zero adapter every base-model request uses included."""
    import fcntl
    import os
    import socket
    import time

    from serving import adapters

    host = socket.gethostname()
    peer = stage_directory(tmp_path)  # a live replica's (this process holds its lock)
    gone = tmp_path / f"{host}-{os.getpid()}.0badc0de"  # a replica gone, with our pid: its lock is free
    (gone / "_zero").mkdir(parents=True)
    (gone / ".lock").write_bytes(b"")
    dying = tmp_path / f"{host}-1.0000beef"  # died before its lock file: left an hour ago
    dying.mkdir()
    os.utime(dying, (time.time() - 3600, time.time() - 3600))
    with open(peer / ".lock", "rb") as lock, pytest.raises(BlockingIOError):  # held: taking it fails
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    mine = stage_directory(tmp_path)
    assert peer.exists() and mine.exists() and mine != peer
    assert not gone.exists() and not dying.exists()
    assert len(adapters._stage_locks) >= 2


def test_the_ipc_directory_of_a_dead_process_of_this_host_is_removed_and_ours_is_new(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from serving import adapters

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = f"{adapters.IPC_PREFIX}{adapters._host_tag()}-"
    gone = tmp_path / f"{here}{int(dead.stdout)}-x1"
    alive = tmp_path / f"{here}1-x2"  # pid 1 is always there
    elsewhere = tmp_path / f"{adapters.IPC_PREFIX}0badc0de-{int(dead.stdout)}-x3"  # another host's: not ours to judge
    for d in (gone, alive, elsewhere):
        (d / "socket").mkdir(parents=True)
    mine = adapters.ipc_directory()
    assert mine.parent == tmp_path and mine.name.startswith(f"{here}{os.getpid()}-") and list(mine.iterdir()) == []
    assert not gone.exists() and alive.exists() and elsewhere.exists()
    assert adapters.ipc_directory() != mine  # a second one is its own, never a clash with a leftover


def test_versions_that_keep_failing_to_load_are_remembered_a_few_per_tenant(world):
    """An engine that fails every load while the learner publishes a version per step: each version's
    back-off was kept for the process's life."""
    from serving.adapters import REFUSED_KEPT

    registry, engine, adapters, publish = world
    engine.fails = lambda name: True

    async def scenario():
        for seed in range(REFUSED_KEPT + 5):
            publish("acme", seed=seed)
            await adapters.refresh()
        numbers = sorted(n for t, n in adapters._failing if t == "acme")
        assert numbers == list(range(6, REFUSED_KEPT + 6)), numbers  # the newest REFUSED_KEPT
        await adapters.drain()

    run(scenario())


def test_the_back_off_of_a_version_retired_above_the_newest_is_forgotten(world):
    """Versions retired while failing to load stayed in the back-off table, and counted toward the 16 kept
    there, where they could push out the newest version's own back-off."""
    registry, engine, adapters, publish = world
    engine.fails = lambda name: name == "acme@2"

    async def scenario():
        publish("acme", seed=1)
        publish("acme", seed=2)
        await adapters.refresh()
        assert ("acme", 2) in adapters._failing and adapters.current("acme") == "acme@1"
        registry.retire("acme", 2)
        await adapters.refresh()
        assert ("acme", 2) not in adapters._failing and adapters.current("acme") == "acme@1"
        await adapters.drain()

    run(scenario())


def test_a_cancelled_load_is_loaded_again_by_those_waiting_for_it(world):
    """A request that loaded a version by name was cancelled mid-load (its client gone at a stop): the
    CancelledError went to every caller waiting on that load, the registry watcher's poll included, which
    then ended for good (hot-swap stopped) while another request failed with a bare 500."""
    registry, engine, adapters, publish = world
    release = asyncio.Event()
    real_load = engine.load_adapter

    async def slow_load(adapter):
        await release.wait()
        await real_load(adapter)

    engine.load_adapter = slow_load

    async def scenario():
        await adapters.refresh()
        number = publish("acme", seed=1)
        first = asyncio.create_task(adapters.acquire("acme", number))  # loads it, by name
        await asyncio.sleep(0.05)
        poll = asyncio.create_task(adapters.refresh())  # waits on that load
        other = asyncio.create_task(adapters.acquire("acme", number))  # so does another request
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.sleep(0.05)
        release.set()
        await poll
        lease = await other
        assert lease.label == f"acme@{number}" and adapters.current("acme") == f"acme@{number}"
        assert list(engine.loaded.values()) == [f"acme@{number}"]
        lease.release()
        with pytest.raises(asyncio.CancelledError):
            await first

    run(scenario())


def test_a_version_refused_while_several_wait_for_it_is_refused_once(world):
    """Each caller waiting on the load of a corrupt version refused it again: one version, as many log errors
    and counts in clora_serving_adapters_refused_total as callers."""
    registry, engine, adapters, publish = world

    async def scenario():
        await adapters.refresh()
        bad = publish("acme", seed=1, corrupt=True)
        results = await asyncio.gather(adapters.refresh(), *(adapters.acquire("acme", bad) for _ in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, UnknownVersion) for r in results[1:]), results
        assert adapters.metrics.refused.labels("acme")._value.get() == 1

    run(scenario())


def test_swap_latency_is_measured_while_another_tenants_first_version_keeps_failing(world):
    """Every poll counted as the start-up one until all tenants had settled once: one tenant whose first
    version kept failing meant clora_serving_adapter_publish_to_live_seconds was never observed."""
    registry, engine, adapters, publish = world
    engine.fails = lambda name: name.startswith("globex@")

    def observed(tenant):
        adapters.metrics.publish_to_live.labels(tenant)  # its series, observed or not
        return [s.value for s in adapters.metrics.publish_to_live.collect()[0].samples
                if s.name.endswith("_count") and s.labels["tenant"] == tenant]

    async def scenario():
        publish("globex", seed=1)
        publish("acme", seed=1)
        await adapters.refresh()  # start-up: what was published before is not measured
        assert observed("acme") == [0.0]
        publish("acme", seed=2)
        adapters._failing.clear()  # globex's back-off over: tried again, and failing again
        await adapters.refresh()
        assert adapters.current("acme") == "acme@2" and observed("acme") == [1.0]

    run(scenario())


def test_a_tenant_follows_the_registry_while_another_tenants_load_is_slow(world):
    """Tenants were followed one after another: while one tenant's load waited (an engine step, a large adapter
    to check), another's retired version went on serving, and its publishes waited too."""
    registry, engine, adapters, publish = world
    release = asyncio.Event()
    real_load = engine.load_adapter

    async def slow_for_acme(adapter):
        if adapter.name.startswith("acme@"):
            await release.wait()
        await real_load(adapter)

    engine.load_adapter = slow_for_acme

    async def scenario():
        publish("globex", seed=1)
        two = publish("globex", seed=2)
        await adapters.refresh()
        assert adapters.current("globex") == f"globex@{two}"
        publish("acme", seed=1)
        registry.retire("globex", two)
        poll = asyncio.create_task(adapters.refresh())
        for _ in range(500):  # while acme's load waits (up to 10 s)
            if adapters.current("globex") == "globex@1":
                break
            await asyncio.sleep(0.02)
        assert adapters.current("globex") == "globex@1" and not poll.done()
        release.set()
        await poll
        assert adapters.current("acme") == "acme@1"

    run(scenario())


def test_an_engine_load_that_never_answers_fails_after_the_timeout_and_frees_the_poll(world, tiny_model):
    """An engine `add_lora` that never returned held the registry poll (and every tenant's swap) for good."""
    registry, engine, _, publish = world
    check = functools.partial(validate_adapter, max_rank=16, base_shapes=base_linear_shapes(tiny_model))
    adapters = AdapterSet(engine, registry, ["acme", "globex"], check, ServingMetrics(), load_timeout_s=0.2)
    real_load = engine.load_adapter
    hung = set()

    async def hangs_for_acme(adapter):
        if adapter.name.startswith("acme@"):
            hung.add(adapter.name)
            await asyncio.Event().wait()  # never set
        await real_load(adapter)

    engine.load_adapter = hangs_for_acme
    unloads = []

    async def unload(adapter):
        unloads.append(adapter.name)

    engine.unload_adapter = unload

    async def scenario():
        publish("acme", seed=1)
        publish("globex", seed=1)
        await asyncio.wait_for(adapters.refresh(), 10)  # returns: the load timed out
        assert hung == {"acme@1"}
        assert adapters.current("acme") == "base" and adapters.current("globex") == "globex@1"
        assert unloads == ["acme@1"]  # the engine, which may still load it, is asked to drop it
        assert ("acme", 1) in adapters._failing and "within 0.2s" in adapters._failing["acme", 1].error
        with pytest.raises(Unavailable, match="cannot be loaded now"):
            await asyncio.wait_for(adapters.acquire("acme", 1), 10)  # asked for by name: a 503, not a hang
        engine.load_adapter = real_load  # the engine answers again: the back-off's next try serves it
        adapters._failing["acme", 1].retry_at = 0
        await adapters.refresh()
        assert adapters.current("acme") == "acme@1"

    run(scenario())
