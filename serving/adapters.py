"""Hot-swap: which adapter version each tenant's requests get, kept in step with the registry.

`AdapterSet.refresh()` reads the registry's change counter (`Registry.generation()`, one small file) and, when
it moved, each configured tenant's newest published version. A version that differs from the tenant's current
one is validated (serving/adapter_check.py, in a worker thread), loaded into the engine under a fresh int id,
and only then made current. A version validation refuses (`AdapterRejected`) is refused for good: the reason
is logged, `adapters_refused_total` counts it, and it is not retried (publishing a new one is the fix). A
failure that says nothing about the adapter (an I/O error while checking it, the engine failing the load or
not answering within LOAD_TIMEOUT_S) leaves the registry's change unseen, so a later poll tries again, backing
off per version (RETRY_FIRST_S doubling up to RETRY_MAX_S: each try validates the adapter again); it is logged
once, not on every try. While its newest published version cannot be served, a tenant is served its newest
published version below that one that can be (`_fall_back`): the version it has, unless a newer one loads, but
never one the registry no longer has as published (retired by an operator, or by `keep_versions`), which gives
way to an older published version, or to the base model when none can be served. A server that starts then
does the same, so a restart serves what a running server would. A HEAD.json that cannot be read (edited by
hand) leaves every tenant on what it serves until the registry's next change rebuilds it, logged once.
`watch()` calls `refresh()` every `poll_seconds` until stopped.

A version is told apart by its number and its record's `created_at`: the registry never uses a number twice,
but one edited by hand, or a data dir replaced under a running server, can show a number again with other
files, and numbers alone would keep the old files serving under the new version's name. A version published
under the number of the one a tenant serves, with another `created_at`, replaces it. As
vLLM tells adapters apart by name (two with one name in a batch are one), the new one is loaded only once the
old one has left the engine: from the moment the change is seen until the requests still running on the old
one end, the tenant is served as while a newest version cannot be (an older published version, or the base
model).

Requests take a `Lease` (`acquire`) for the whole generation and give it back when the response is done
(`release`): a generation never changes adapter mid-way, because the engine request carries its own
`AdapterHandle`. Every loaded version counts its leases; a version that is no longer current leaves the
engine when its last lease is released (or at once if it had none). Explicitly requested older
versions (`<tenant>@<n>`) are loaded on demand the same way. A version asked for by name stays loaded for
`keep_idle_s` (IDLE_KEEP_S) after its last request ends, at most IDLE_PER_TENANT of them per tenant (the
most recently used), so that a client comparing versions request by request does not pay a copy, a
validation and an engine load for each (nor make the engine drop and read the adapter again); idle ones go
at the next poll or release past that time, at once when found retired or replaced. A version asked for by
name, the current one included, is served only while the registry had it published at its last read
(`checked`, against `_seen`): retired, it is refused from the next poll on, even while it still serves.

Each version is loaded from serving's own copy of its files (`stage_dir`, hard links where the file system
allows, one directory per load), made before it is checked, so what is checked is what is loaded.
The registry deletes a retired version's files at once, while the engine may still need them: vLLM keeps
`max_cpu_loras` adapters in memory and reads an evicted one again from its path when a request wants it
(a leased old version, an explicit `<tenant>@<n>`, a current version an operator just retired), and a
missing path there fails the engine step, for every tenant. The copy goes when the version leaves the
engine; `stage_directory` gives each serving process its own directory, locked while it runs, and removes
those of processes gone.

Everything here runs on the event loop (one thread), so the tables need no locks; the slow parts
(registry reads, validation) go to worker threads and the engine calls are awaited.

What this module does not do: decide who may ask for what (auth.py), or which adapters' requests the engine
takes at once (lora_slots.py: at most `max_loras` of them, each other one in its turn).
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol

from clora.processes import running
from serving.adapter_check import AdapterRejected
from serving.engine import AdapterHandle
from serving.errors import AdapterUnavailable, ModelNotFound, ServingError, Unavailable
from serving.metrics import ServingMetrics
from storage.files import FileLock, HeldLock, LockBusy

logger = logging.getLogger(__name__)

REFUSED_KEPT = 16  # refused versions remembered per tenant (and shown by /health)
RETRY_FIRST_S = 0.5  # a transient load failure is tried again after this, then after twice as long each time
RETRY_MAX_S = 30.0
# An engine load that has not answered by then fails like any transient load failure (backing off, tried
# again): one that never returned held the registry poll, and with it every tenant's swap, for good.
LOAD_TIMEOUT_S = 120.0
IDLE_KEEP_S = 60.0  # how long a version asked for by name stays loaded after its last request (see above)
IDLE_PER_TENANT = 2  # idle versions asked for by name kept per tenant, the most recently used
IPC_PREFIX = "clora-vllm-ipc-"  # + host hash, pid and a random part: ipc_directory

_Outcome = Literal["served", "refused", "failing"]  # of one version's swap: see AdapterSet._swap_in


class AdapterEngine(Protocol):
    def new_handle(self, name: str, path: Path) -> AdapterHandle: ...
    async def load_adapter(self, adapter: AdapterHandle) -> None: ...
    async def unload_adapter(self, adapter: AdapterHandle) -> None: ...


class VersionSource(Protocol):
    """The part of `storage.registry.Registry` serving reads."""

    def generation(self) -> int: ...  # raises UnreadableRecord while HEAD.json cannot be read
    def published(self) -> dict: ...  # tenant -> AdapterVersion (newest published); UnreadableRecord as above
    def unsettled(self, tenant: str) -> list: ...  # its published versions among others; UnreadableRecord
    def get(self, tenant: str, number: int): ...  # AdapterVersion; VersionNotFound (a KeyError), UnreadableRecord


class UnknownVersion(ModelNotFound):
    """`<tenant>@<n>` names a version that does not exist or cannot be served (never published, retired)."""


@dataclass
class _Loaded:
    tenant: str
    number: int
    handle: AdapterHandle
    created: datetime | None = None  # the record's created_at: what tells it from another version of its number
    leases: int = 0
    current: bool = False
    checked: int | None = None  # registry generation at which it was last found published (refresh, or a request)
    asked: bool = False  # asked for by name (`<tenant>@<n>`): kept a while once idle


@dataclass
class _Failing:
    created: datetime | None  # of the version whose swap failed
    error: str
    tries: int
    retry_at: float  # monotonic seconds


@dataclass
class Lease:
    """The adapter one request runs on (None: the base model) and its label for headers and events."""

    adapter: AdapterHandle | None
    label: str
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        """Gives the adapter back; idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release()


class AdapterSet:
    def __init__(
        self,
        engine: AdapterEngine,
        registry: VersionSource,
        tenants: Iterable[str],
        check: Callable[[Path], object],
        metrics: ServingMetrics,
        *,
        base_name: str = "base",
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        stage_dir: Path | None = None,
        load_timeout_s: float = LOAD_TIMEOUT_S,
        keep_idle_s: float = IDLE_KEEP_S,
    ) -> None:
        """`check(path)` validates an adapter directory and raises `AdapterRejected` (adapter_check.py);
        `base_name` (the config's `model.name`) labels what the base model serves, so a client can send the
        label back as `model`; `stage_dir` (this process's, from `stage_directory`) holds the copies versions
        are loaded from (None: loaded from the registry's files, for tests whose registry deletes nothing);
        `load_timeout_s`: how long the engine may take to load one version before the load counts as failed;
        `keep_idle_s`: how long a version asked for by name stays loaded once no request runs on it."""
        self.engine = engine
        self.load_timeout_s = load_timeout_s
        self.keep_idle_s = keep_idle_s
        self.stage_dir = stage_dir
        self._staged = 0  # copies made: each has its own directory, so a copy is never reused
        self.base_name = base_name
        self.registry = registry
        self.tenants = tuple(tenants)
        self.check = check
        self.metrics = metrics
        self.clock = clock
        self.monotonic = monotonic
        self._loaded: dict[tuple[str, int], _Loaded] = {}
        self._current: dict[str, _Loaded] = {}
        self._refused: dict[tuple[str, int], tuple[str, datetime | None]] = {}  # -> (why, the version's created_at)
        self._failing: dict[tuple[str, int], _Failing] = {}  # version -> its swap to try again, and when
        self._loading: dict[tuple[str, int], asyncio.Future] = {}
        self._idle: dict[tuple[str, int], float] = {}  # versions asked for by name, no request on them -> since when
        self._generation: int | None = None  # the registry generation every tenant's swap has settled at
        self._started = False  # a refresh has run: what it found was published before this process
        # The registry generation last read, settled or not (a swap backing off keeps _generation behind): what
        # an explicit version's published status is checked against (a retired one must be refused from the
        # next poll on, whatever another tenant's swap is doing).
        self._seen: int | None = None
        self._unreadable: str | None = None  # why the registry's HEAD.json could not be read, logged once
        self._unlisted: dict[str, str] = {}  # tenant -> why its versions could not be listed, logged once
        self._added_at: dict[str, float] = {}  # tenant added by a config re-read -> when (clock())
        # tenant -> the registry generation at which its fall-back (its newest version not servable) settled:
        # not looked at again, nor its versions listed, until the registry changes
        self._fell_back: dict[str, int] = {}
        self._refresh_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        for tenant in self.tenants:
            metrics.adapter_version.labels(tenant).set(0)

    async def set_tenants(self, tenants: Iterable[str]) -> None:
        """The tenants from now on (a config re-read). A new one's newest published version is loaded by the
        next refresh; one that left stops being served (its adapter leaves the engine once its last request
        ends) and forgets its back-offs and refusals."""
        async with self._refresh_lock:
            tenants = tuple(tenants)
            gone = [t for t in self.tenants if t not in tenants]
            added = [t for t in tenants if t not in self.tenants]
            self.tenants = tenants
            for tenant in gone:
                self._set_current(tenant, None)
                for key in [k for k in self._idle if k[0] == tenant]:
                    self._unload_idle(key)
                self._forget_failures(tenant)
                self._fell_back.pop(tenant, None)
                self._unlisted.pop(tenant, None)
                for key in [k for k in self._refused if k[0] == tenant]:
                    del self._refused[key]
                try:
                    self.metrics.adapter_version.remove(tenant)
                except KeyError:
                    pass
            for tenant in gone:
                self._added_at.pop(tenant, None)
            for tenant in added:
                self.metrics.adapter_version.labels(tenant).set(0)
                self._added_at[tenant] = self.clock()
            if added:
                self._generation = None  # the next refresh reads what is published, for them too

    # --- what requests see --------------------------------------------------------------------------------
    def current(self, tenant: str) -> str:
        """The label of what "<tenant>" serves now: "acme@3", or the base model's name."""
        loaded = self._current.get(tenant)
        return loaded.handle.name if loaded else self.base_name

    def refused(self) -> dict[str, str]:
        """version name -> why it was refused."""
        return {f"{t}@{n}": reason for (t, n), (reason, _) in self._refused.items()}

    def refusal(self, tenant: str, number: int) -> str | None:
        """Why version `number` of `tenant` was refused; None when it was not (or is forgotten, REFUSED_KEPT)."""
        refused = self._refused.get((tenant, number))
        return None if refused is None else refused[0]

    def base_lease(self) -> Lease:
        return Lease(None, self.base_name)

    async def acquire(self, tenant: str, version: int | None = None) -> Lease:
        """A lease on the tenant's current version (`version` None) or on version `version` of the tenant."""
        if version is None:
            loaded = self._current.get(tenant)
            if loaded is None:
                return self.base_lease()
            return self._lease(loaded)
        loaded = self._loaded.get((tenant, version))
        if loaded is None or loaded.checked != self._seen:
            # Loaded (the current version too), but the registry changed since it was last found published (it
            # may be retired now): ask the registry again, once per registry change.
            loaded = await self._load_explicit(tenant, version)
        loaded.asked = True
        return self._lease(loaded)  # no await since the load: nothing can unload it in between

    def _lease(self, loaded: _Loaded) -> Lease:
        loaded.leases += 1
        self._idle.pop((loaded.tenant, loaded.number), None)
        return Lease(loaded.handle, loaded.handle.name, lambda: self._release(loaded))

    def _release(self, loaded: _Loaded) -> None:
        loaded.leases -= 1
        self._maybe_unload(loaded)

    # --- keeping up with the registry ---------------------------------------------------------------------
    async def watch(self, poll_seconds: float, stop: asyncio.Event) -> None:
        """Calls `refresh` every `poll_seconds` until `stop` is set; an error is logged and retried next poll."""
        while not stop.is_set():
            try:
                await self.refresh()
            except Exception:  # a broken registry read must not stop hot-swap for good
                logger.exception("adapter refresh failed; retrying in %.1fs", poll_seconds)
            try:
                await asyncio.wait_for(stop.wait(), timeout=poll_seconds)
            except asyncio.TimeoutError:
                pass

    async def refresh(self) -> None:
        """Makes every tenant's newest published version current (validated and loaded first)."""
        from storage.registry import UnreadableRecord

        self._sweep_idle()
        async with self._refresh_lock:
            try:
                generation = await asyncio.to_thread(self.registry.generation)
                self._seen = generation
                if generation == self._generation:
                    return
                published = await asyncio.to_thread(self.registry.published)
            except UnreadableRecord as e:  # edited by hand: a poll every 0.5 s must not log it every time
                if self._unreadable != str(e):
                    logger.error("%s; every tenant stays on what it serves until the registry's next change "
                                 "rebuilds it", e)
                    self._unreadable = str(e)
                return
            self._unreadable = None
            # Versions published before this process have no swap latency. Not `_generation is None`: one tenant
            # whose first version keeps failing would keep every later poll a start-up one.
            startup, self._started = not self._started, True
            # Side by side: one tenant's slow load (an engine step to wait for, a large adapter to check) held
            # every other tenant's swap, a retired version's retreat included, for as long as it took.
            outcomes = await asyncio.gather(
                *(self._follow(tenant, published.get(tenant), generation, startup=startup) for tenant in self.tenants),
                return_exceptions=True,
            )
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:  # each follow has ended: the next refresh starts on a quiet set
                raise failed
            settled = all(outcomes)
            if settled:  # a transient failure leaves the generation unseen, so the next poll tries again
                self._generation = generation

    async def _follow(self, tenant: str, version, generation: int, *, startup: bool) -> bool:
        """Serves the tenant its newest published version (`version`, None: it has none), or, while that one
        cannot be served, what `_fall_back` finds; False while something is worth trying again."""
        current = self._current.get(tenant)
        if version is None:
            if current is not None:
                logger.warning("tenant %s has no published adapter any more (every version retired); serving the "
                               "base model", tenant)
                self._set_current(tenant, None)
            self._forget_failures(tenant)
            self._fell_back.pop(tenant, None)
            return True
        key, created = (tenant, version.number), _created(version)
        for above in [k for k in self._failing if k[0] == tenant and k[1] > version.number]:
            del self._failing[above]  # retired or rejected since it failed: never tried again
        if current is not None and current.number == version.number:
            if current.created == created:
                current.checked = generation
                return True
            logger.warning("adapter %s was replaced in the registry (created %s, not %s: its number was "
                           "used again after a hand edit); tenant %s is not served it again until the old "
                           "one has left the engine", current.handle.name, created, current.created, tenant)
            self._set_current(tenant, None)
        refused = key in self._refused and self._refused[key][1] == created
        if not refused:
            if self._waiting(key, created):
                outcome = "failing"
            else:
                outcome = await self._swap_in(tenant, version, generation, publish_lag=not startup)
            if outcome == "served":
                self._fell_back.pop(tenant, None)
                return True
            refused = outcome == "refused"
        if self._fell_back.get(tenant) == generation:  # settled at this registry state: nothing to list again
            return refused
        settled = await self._fall_back(tenant, version.number, generation)
        if settled:
            self._fell_back[tenant] = generation
        return settled and refused  # refused for good: nothing to try again; failing: tried again later

    async def _fall_back(self, tenant: str, newest: int, generation: int) -> bool:
        """The tenant's newest published version (number `newest`) cannot be served now (refused, or failing
        to load): the tenant is served its newest published version below it that can be (its current one
        stays, unless a newer one loads), or the base model when none can. Its current version is never kept
        once the registry no longer has it published (retired by an operator or by retention). At most
        REFUSED_KEPT - 1 versions are tried. False while a version newer than the one chosen is worth trying
        again."""
        from storage.layout import StorageError
        from storage.registry import UnreadableRecord

        try:
            listed = await asyncio.to_thread(self.registry.unsettled, tenant)  # every published one, not the history
        except UnreadableRecord as e:  # edited by hand: like an unreadable HEAD.json, logged once
            if self._unlisted.get(tenant) != str(e):
                logger.error("%s; tenant %s stays on %s until the registry's next change", e, tenant,
                             self.current(tenant))
                self._unlisted[tenant] = str(e)
            return True
        except (OSError, StorageError) as e:  # the disk now (EIO, ESTALE): this tenant only, tried at the next poll
            if self._unlisted.get(tenant) != str(e):
                logger.error("tenant %s's adapter versions cannot be listed (%s: %s); it stays on %s, tried again",
                             tenant, type(e).__name__, e, self.current(tenant))
                self._unlisted[tenant] = str(e)
            return False
        self._unlisted.pop(tenant, None)
        below = sorted((v for v in listed if v.status == "published" and v.number < newest),
                       key=lambda v: v.number, reverse=True)
        settled = True
        # Tried newest first, at most as many as the refusals remembered (with the newest), so that a long run of
        # refused versions is not validated again at every registry change; the current one is kept below that.
        for version in below[: REFUSED_KEPT - 1]:
            key, created = (tenant, version.number), _created(version)
            current = self._current.get(tenant)
            if current is not None and (current.number, current.created) == (version.number, created):
                break
            if key in self._refused and self._refused[key][1] == created:
                continue
            if self._waiting(key, created):
                settled = False
                continue
            outcome = await self._swap_in(tenant, version, generation, publish_lag=False)
            if outcome == "served":
                return settled
            settled &= outcome == "refused"
        current = self._current.get(tenant)
        if current is None:
            return settled
        if any((v.number, _created(v)) == (current.number, current.created) for v in below):
            current.checked = generation
        else:
            logger.warning("adapter %s is no longer published, and none of tenant %s's newest published versions "
                           "can be served now; serving the base model", current.handle.name, tenant)
            self._set_current(tenant, None)
        return settled

    def _waiting(self, key: tuple[str, int], created: datetime | None) -> bool:
        """Whether version `key` (created `created`) must wait before it is tried: its swap is backing off,
        or another version of its number is still in the engine (see the module notes)."""
        old = self._loaded.get(key)
        if old is not None and old.created != created:
            self._unload_idle(key)  # kept only for requests naming it: the registry's new files win
            return True
        failing = self._failing.get(key)
        return failing is not None and failing.created == created and self.monotonic() < failing.retry_at

    def _forget_failures(self, tenant: str, up_to: int | None = None) -> None:
        """Drops the back-off of the tenant's versions (numbered `up_to` or less): no longer wanted."""
        for key in [k for k in self._failing if k[0] == tenant and (up_to is None or k[1] <= up_to)]:
            del self._failing[key]

    async def _swap_in(self, tenant: str, version, generation: int, *, publish_lag: bool) -> _Outcome:
        """Validates, loads and makes current: "served"; "refused" when validation refused it (for good);
        "failing" when it failed for a reason worth retrying (backing off). `publish_lag`: record the time from
        its publish (not for a version published before this process, or before a config re-read added the
        tenant, or an older one fallen back to)."""
        started = time.monotonic()
        key, created = (tenant, version.number), _created(version)
        name = f"{tenant}@{version.number}"
        try:
            loaded = await self._load(tenant, version.number, Path(version.path), created)
        except AdapterRejected as e:  # the adapter itself is bad: trying again cannot help
            self._failing.pop(key, None)
            self._refuse(tenant, version.number, created, e)
            return "refused"
        except Exception as e:  # an I/O error while checking, the engine's load errors (no common type): may pass
            error = f"{type(e).__name__}: {e}"
            self.metrics.load_failures.labels(tenant).inc()
            failing = self._failing.get(key)
            same = failing is not None and failing.created == created
            tries = failing.tries + 1 if same else 1
            delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (tries - 1))
            if not same or failing.error != error:  # once, not each try
                logger.warning("adapter %s could not be loaded (tried again, backing off up to %.0fs); meanwhile "
                               "tenant %s is served its newest published version that can be", name, RETRY_MAX_S,
                               tenant, exc_info=True)
            else:
                logger.debug("adapter %s still could not be loaded (try %d, next in %.1fs): %s", name, tries, delay, error)
            self._failing[key] = _Failing(created, error, tries, self.monotonic() + delay)
            # versions that keep failing while newer ones are published (an engine that fails every load)
            # must not pile up for the process's life
            _keep_newest(self._failing, tenant)
            return "failing"
        self._forget_failures(tenant, up_to=version.number)
        loaded.checked = generation
        self._set_current(tenant, loaded)
        published_at = getattr(version, "published_at", None)
        lag = None
        if publish_lag and isinstance(published_at, datetime) and published_at.timestamp() >= self._added_at.get(
                tenant, float("-inf")):
            lag = self.clock() - published_at.timestamp()
        self.metrics.swapped(tenant, version.number, time.monotonic() - started, lag)
        logger.info(
            "tenant %s now served by %s (swap %.3fs%s)",
            tenant, loaded.handle.name, time.monotonic() - started,
            f", {lag:.3f}s after publish" if lag is not None else "",
        )
        return "served"

    def _set_current(self, tenant: str, loaded: _Loaded | None) -> None:
        old = self._current.pop(tenant, None)
        if loaded is not None:
            loaded.current = True
            self._current[tenant] = loaded
            self._idle.pop((tenant, loaded.number), None)
        else:
            self.metrics.adapter_version.labels(tenant).set(0)
        if old is not None and old is not loaded:
            old.current = False
            self._maybe_unload(old)

    def _refuse(self, tenant: str, number: int, created: datetime | None, rejected: AdapterRejected) -> None:
        known = self._refused.get((tenant, number))
        if known is not None and known[1] == created:  # refused already: each caller waiting on its load says so
            return
        self._refused[(tenant, number)] = (rejected.reason, created)  # tenants read it: no path, which the log has
        # The newest few per tenant: under a systematic refusal (a rank above max_lora_rank) every step adds
        # one. An older one forgotten is only tried again if a request names it, and refused again.
        _keep_newest(self._refused, tenant)
        self.metrics.refused.labels(tenant).inc()
        logger.error("adapter %s@%d refused (never served, not tried again): %s", tenant, number, rejected)

    # --- loading and unloading ----------------------------------------------------------------------------
    async def _load(self, tenant: str, number: int, path: Path, created: datetime | None) -> _Loaded:
        """Validates and loads one version (once, however many callers ask at the same time). `Unavailable`
        while another version of its number (another `created`) is loaded: see the module notes."""
        key = (tenant, number)
        if key in self._loaded:
            loaded = self._loaded[key]
            if loaded.created != created:
                self._unload_idle(key)  # kept only for requests naming it: the registry's new files win
            return _same(loaded, created)
        pending = self._loading.get(key)
        if pending is not None:
            loaded = await asyncio.shield(pending)
            if loaded is not None and self._loaded.get(key) is loaded:
                return _same(loaded, created)
            # Its loader was cancelled (None), or it was used and unloaded while we waited: load it again.
            return await self._load(tenant, number, path, created)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        source = path
        if self.stage_dir is not None:
            self._staged += 1
            path = self.stage_dir / f"{tenant}@{number}.{self._staged}"
        try:
            if path != source:
                await asyncio.to_thread(_stage, source, path)
            await asyncio.to_thread(self.check, path)
            handle = self.engine.new_handle(f"{tenant}@{number}", path)
            try:
                await asyncio.wait_for(self.engine.load_adapter(handle), self.load_timeout_s)
            except TimeoutError:  # its id is never used again; the engine may still load it: asked to drop it
                self._spawn(self._unload(handle))
                raise TimeoutError(f"the engine did not load adapter {handle.name} within "
                                   f"{self.load_timeout_s:g}s") from None
            loaded = _Loaded(tenant, number, handle, created)
            self._loaded[key] = loaded
            future.set_result(loaded)
            return loaded
        except asyncio.CancelledError:
            # The caller that loads it was cancelled (its request ended): not the load's failure, so not the
            # waiters' either. Handed on, it ended the registry watcher for good and failed other requests.
            self._discard_stage(path)
            future.set_result(None)  # each waiter loads it again, the first of them for all
            raise
        except BaseException as e:
            self._discard_stage(path)
            future.set_exception(e)
            future.exception()  # mark retrieved: concurrent waiters (if any) re-raise it themselves
            raise
        finally:
            del self._loading[key]

    async def _load_explicit(self, tenant: str, number: int) -> _Loaded:
        """Loads `<tenant>@<number>` on request; UnknownVersion unless it is published and intact."""
        from storage.registry import UnreadableRecord, VersionNotFound

        name = f"{tenant}@{number}"
        generation = self._seen  # what the status read below is at least as new as
        try:
            version = await asyncio.to_thread(self.registry.get, tenant, number)
        except VersionNotFound:
            raise UnknownVersion(f"model {name!r} does not exist") from None
        except UnreadableRecord as e:  # the path is the operator's to read, not the tenant's (logged once)
            self.registry.log_unreadable(e, f"model {name!r} cannot be served until it is mended")
            raise UnknownVersion(f"model {name!r} cannot be served: its registry record cannot be read") from None
        if version.status != "published":
            loaded = self._loaded.get((tenant, number))
            if loaded is not None:  # not kept once idle: no request may have it again
                loaded.asked = False
                self._unload_idle((tenant, number))
            raise UnknownVersion(f"model {name!r} is {version.status}, not published")
        created = _created(version)
        refused = self._refused.get((tenant, number))
        if refused is not None and refused[1] == created:
            raise UnknownVersion(f"model {name!r} cannot be served: {refused[0]}")
        try:
            loaded = await self._load(tenant, number, Path(version.path), created)
            loaded.checked = generation
            return loaded
        except AdapterRejected as e:
            self._refuse(tenant, number, created, e)
            raise UnknownVersion(f"model {name!r} cannot be served: {e.reason}") from e
        except ServingError:  # _load's own answer (a replaced version's old one still in the engine)
            raise
        except Exception as e:  # an I/O error, files a retire is deleting, the engine's load: may pass
            logger.warning("model %r asked for could not be loaded: %s: %s", name, type(e).__name__, e)
            raise AdapterUnavailable(f"model {name!r} cannot be loaded now; try again shortly") from e

    def _maybe_unload(self, loaded: _Loaded) -> None:
        if loaded.current or loaded.leases > 0:
            return
        key = (loaded.tenant, loaded.number)
        if self._loaded.get(key) is not loaded:
            return
        if loaded.asked and self.keep_idle_s > 0 and loaded.tenant in self.tenants:
            self._idle.pop(key, None)
            self._idle[key] = self.monotonic()
            kept = [k for k in self._idle if k[0] == loaded.tenant]  # in the order they became idle
            for oldest in kept[:-IDLE_PER_TENANT]:
                self._unload_idle(oldest)
            self._sweep_idle()
            return
        del self._loaded[key]
        self._spawn(self._unload(loaded.handle))

    def _unload_idle(self, key: tuple[str, int]) -> None:
        """Unloads version `key` now if it is only kept idle (no request on it, not current)."""
        if self._idle.pop(key, None) is None:
            return
        loaded = self._loaded.get(key)
        if loaded is not None and not loaded.current and loaded.leases == 0:
            del self._loaded[key]
            self._spawn(self._unload(loaded.handle))

    def _sweep_idle(self) -> None:
        """Unloads the versions kept idle for `keep_idle_s` or longer."""
        now = self.monotonic()
        for key in [k for k, since in self._idle.items() if now - since >= self.keep_idle_s]:
            self._unload_idle(key)

    async def _unload(self, handle: AdapterHandle) -> None:
        try:
            await self.engine.unload_adapter(handle)
            logger.info("adapter %s (id %d) left the engine", handle.name, handle.lora_id)
        except Exception:  # the engine drops it on eviction anyway; nothing else to do
            logger.exception("could not unload adapter %s (id %d)", handle.name, handle.lora_id)
        self._discard_stage(handle.path)  # its id is never used again, so the engine never reads the copy again

    def _discard_stage(self, path: Path) -> None:
        if self.stage_dir is not None and path.parent == self.stage_dir:
            shutil.rmtree(path, ignore_errors=True)

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Waits for pending unloads (tests and shutdown)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def snapshot(self) -> dict[str, dict]:
        """For /health and tests: every loaded version with its lease count."""
        return {
            v.handle.name: {"lora_id": v.handle.lora_id, "leases": v.leases, "current": v.current}
            for v in self._loaded.values()
        }


def _keep_newest(table: dict, tenant: str) -> None:
    """Drops all but the tenant's newest REFUSED_KEPT versions from `table` (keyed by (tenant, number))."""
    for n in sorted(n for t, n in table if t == tenant)[:-REFUSED_KEPT]:
        del table[(tenant, n)]


def _created(version) -> datetime | None:
    return getattr(version, "created_at", None)


def _same(loaded: _Loaded, created: datetime | None) -> _Loaded:
    if loaded.created != created:
        raise Unavailable(f"model {loaded.handle.name!r} was replaced in the registry; the new one is served once "
                          "the requests still running on the old one end")
    return loaded


# ---------------------------------------------------------------------------------------------------------
# Serving's copies of adapter files


def stage_directory(root: Path) -> Path:
    """This process's directory under `root` for the adapter copies it loads (empty), after removing those
    of serving processes that are gone (a crash leaves its copies behind).

    `<host>-<pid>.<random>`, holding a `.lock` file whose flock this process keeps until it ends, however it
    ends: a free lock is a process gone. Not its process id: replicas in containers sharing the data dir may
    all be pid 1, with one host name, and the start of one deleted the copies, the zero adapter included,
    that another was serving from. A folder of a version before the lock (`<host>-<pid>`) goes when no
    process of its id runs on this host."""
    host = socket.gethostname()
    root.mkdir(parents=True, exist_ok=True)
    _remove_gone_stages(root)
    _remove_dead(root, f"{host}-")
    mine = root / f"{host}-{os.getpid()}.{uuid.uuid4().hex[:8]}"
    mine.mkdir()
    # Locked under another name, then given its own: a peer starting at the same moment sweeps folders by
    # their lock (`_remove_gone_stages`), and would find it created but not yet locked, and remove this one.
    fresh = mine / f"{STAGE_LOCK}-new"
    held = HeldLock.try_acquire(fresh)
    if held is None:  # a file new in a new folder: nobody else can hold it
        raise RuntimeError(f"the lock {fresh} of a folder just made is held by another process")
    fresh.rename(mine / STAGE_LOCK)
    _stage_locks.append(held)
    return mine


STAGE_LOCK = ".lock"
_LOCKED_STAGE = re.compile(r"\.[0-9a-f]{8}$")  # <host>-<pid>.<random>; one before the lock ends in -<pid>
STALE_UNLOCKED_STAGE_S = 60.0  # a stage folder without its lock file this old: its process died making it
_stage_locks: list[HeldLock] = []  # this process's stage folders' locks, held for its life


def _remove_gone_stages(root: Path) -> None:
    """Removes the stage folders whose lock is free (their process is gone), and those left without one."""
    for d in root.iterdir():
        if not _LOCKED_STAGE.search(d.name) or not d.is_dir():
            continue  # not a locked stage folder (a folder of a version before the lock, if anything)
        try:
            with FileLock(d / STAGE_LOCK, blocking=False, create=False):
                shutil.rmtree(d, ignore_errors=True)
        except LockBusy:  # its process runs
            continue
        except FileNotFoundError:
            try:
                if time.time() - d.stat().st_mtime > STALE_UNLOCKED_STAGE_S:
                    shutil.rmtree(d, ignore_errors=True)
            except FileNotFoundError:
                pass


def ipc_directory() -> Path:
    """A new directory of this process's in the system temp dir for vLLM's IPC sockets (what
    VLLM_RPC_BASE_PATH names), after removing those of this host's processes that are gone. vLLM puts a
    few sockets with random names in /tmp at each start and never removes them: hundreds piled up. Named by
    a hash of the host name (containers sharing /tmp see each other's, with other pids) and the pid, plus a
    random part; short, as a Unix socket's path has ~107 bytes."""
    root = Path(tempfile.gettempdir())
    mine = f"{IPC_PREFIX}{_host_tag()}-"
    _remove_dead(root, mine, tail=True)
    return Path(tempfile.mkdtemp(prefix=f"{mine}{os.getpid()}-", dir=root))


def _remove_dead(root: Path, prefix: str, *, tail: bool = False) -> None:
    """Removes what is in `root` named `prefix` + the pid of a process that is gone: the pid is the rest of the
    name or, with `tail`, the rest up to its first "-" (a random part follows)."""
    for d in root.glob(f"{glob.escape(prefix)}*"):
        pid = d.name[len(prefix):]
        if tail:
            pid = pid.partition("-")[0]
        if pid.isdigit() and not running(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _stage(source: Path, target: Path) -> None:
    """`target`: the adapter directory `source`'s files, hard-linked (copied across file systems). The
    registry never rewrites a file in place (it writes new ones and renames), so a link is a snapshot."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, target, copy_function=link)  # `target` is new: each load has its own
