"""The adapter registry: versions "<tenant>@<n>", their files, lineage, metrics and status.

On disk:
    adapters/<tenant>/<n>/            PEFT files (adapter_config.json + adapter_model.safetensors)
    registry/<tenant>/<n>.json        the version's metadata: the source of truth, and its commit point
    registry/<tenant>/index.json      a hint: {"format", "last", "open"} (below)
    registry/HEAD.json                {"format", "generation", "published": {tenant: newest published}}
    locks/registry.lock               serialises writers (number allocation, status changes)

A version exists when its metadata file exists. `create` writes the adapter files into a hidden staging
directory, fsyncs them, renames the directory to adapters/<tenant>/<n>/ and only then writes
registry/<tenant>/<n>.json (atomically, temp + rename). A crash at any point leaves either nothing visible
or a complete version (the next `create` records the number of one cut short as skipped: below). Retiring
goes the other way round: metadata says "retired" first, files are deleted after, so a version whose files
are gone has always already been marked retired.

A number is never used twice, even after a hand edit: serving, and the learner's checkpoints, tell versions by
number, and a reused one would leave them with the old files under the new version's name. `create` takes
the number after the largest that any trace on disk still names: the records, the index hint, the
directories under adapters/<tenant>/ whose names are a number as it is written ("7"; not "07", "7.bak" or
another script's digits) and HEAD.json. Numbers between the newest record and that one (an adapter directory
without metadata, the orphan of a create that crashed before its commit point; or a record deleted by hand)
get a record of their own, status "retired" with the reason, and their files are deleted. So do the numbers
below it that the index hint does not vouch for (past its `last`, or named open) and that have no record (one
deleted by hand, leaving a hole among the newest versions): records stay consecutive past the hint's `last`,
which its probing relies on. The create logs how many and their range.

A trace more than MAX_SKIP (1,000) past the newest record is not taken for a number. A create cut short
leaves one number without a record, and records deleted by hand as many as were deleted; a folder an
operator named by a date (`20250101`), or a hint or HEAD.json edited by hand, can name any number, and each
number skipped costs a fsynced record written under the lock (most of a millisecond: a thousand hold every
writer up for under a second, twenty thousand for 15-20 s). Such a trace is logged once per process and the
create goes on with the number after the others: HEAD.json is rebuilt by that create anyway, the hint is
deleted (readers probing from it would miss every version below it; they list the records until the next
publish or reject writes a new one), and the folder is left as it is: it has no record, so nothing says it
is a version. Refusing the create instead would stop the tenant's learner over a folder it does not need.
The folder is judged afresh by every create, though: should the versions come within MAX_SKIP of it, it
counts like any other trace (its number is skipped and the folder deleted), which is why the warning asks
for it to be moved. A run of consecutive numbers (folders or records: a range restored or copied back) is
taken whole once it starts within MAX_SKIP: each of its numbers is one past the one before, and only a gap
makes what lies past it far. A create is refused, naming the folder or record in the way, only past a run
longer than MAX_SKIP plus the folders there are.

Status moves: candidate -> published | rejected; anything -> retired. `rollback` never rewrites history:
it copies an older version's files into a new, newest, published version whose parent is the old one.
After every publish (and rollback) published versions beyond the newest `keep_last` are retired. After
every reject, the files of rejected versions beyond the newest `keep_last` rejected ones are deleted
(their metadata keeps status "rejected", the reason and the gate's checks, with `retired_at` set): the
newest rejects stay on disk to inspect, and a tenant whose steps the gate keeps refusing does not fill
the disk.

Change notification: `generation()`, a counter in HEAD.json that every change increments, read with one
small-file read (tens of microseconds). Serving polls it (serving.registry_poll_seconds, 0.5 s) and calls
`published()` only when it moved. Chosen over inotify/fsevents because it works the same for several
serving replicas on other hosts over a shared or object-store data dir (inotify does not cross NFS and
object stores have no watches), it needs no daemon or socket, a missed or coalesced event cannot
happen (a poll always sees the latest state), and 0.5 s of extra staleness is small next to a training
step. HEAD.json is derived: every writer rewrites the changed tenant's entry from its version files under
the lock, keeping the others' (rebuilding every tenant's read each tenant's records: ~0.7 s a change at
1,000 tenants, under the one lock), so a writer that crashed between a record and HEAD is repaired by that
tenant's next change, by `repair` (the learner's, as it takes the tenant), or by the full rebuild from every
tenant's records that every FULL_HEAD_EVERY-th change (and any change after HEAD.json is missing or cannot
be read) makes.

A file that cannot be read (edited by hand into bad JSON or missing fields, or written by a clora of another
`format`) is one tenant's problem, never every tenant's. Reading it raises `UnreadableRecord`, naming the
file, to whoever asks about that tenant; readers that list many tenants skip it, and so does `_write_head`,
which keeps that tenant's entry as the old HEAD.json had it (or leaves it out where the old HEAD.json cannot
be read either): changes go on for everyone else, and what the tenant serves does not change until its file
is fixed. Each such file is logged once per process (and again if its reason changes), not on every change.
A HEAD.json that cannot be read is rebuilt by the next change; its old generation is lost, so the new one is
taken from the clock (microseconds since the epoch: past any count of changes), and a reader polling for a
change still sees one.

Every operation costs the same however long a tenant's history grows (the learner publishes a version per
step, forever; metadata is deleted only by retention, `prune`, never the newest). A version is "settled"
once nothing can change it any more: retired, or rejected with its files removed, and its files gone.
Settled versions are all but every one of a long history, and an operation only needs the others. The index
hint names them: `last` (the newest number when it was written) and `open` (every number up to `last` that
was not settled). Writers rewrite it under the lock after every publish, reject and retire; everyone reads it
without a lock, and versions newer than `last` are found by probing `last + 1, last + 2, ...` (numbers are
allocated consecutively, and retention deletes only settled versions older than `last`). A record deleted by
hand leaves a hole there, which the next create fills; until then the probe goes on past it from the newest
directory under adapters/<tenant>/ that has a record, as every version that can still change keeps its files
there (up to MAX_SKIP past the end of the walk: a record with its folder further on, copied there by hand,
is logged once and left out, like a far folder): one listing of a folder that holds a handful of versions'
files, not the history, so a hole hides no version from a reader (nor from HEAD.json, whose entry for the tenant its change rewrites). A hint that is
missing or unreadable means one full listing, which rewrites it. A stale hint (a writer crashed, or a power
loss undid the rename: it is not fsynced) is still right, because a settled version never becomes unsettled:
it only names more than it must.

Readers never lock. This module needs no peft or torch: it moves files and JSON.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from storage.files import (
    FileLock,
    atomic_write_bytes,
    ensure_dir,
    fsync_dir,
    fsync_tree,
    publish_dir,
    remove_stale_hidden,
    remove_tree,
    tmp_name,
)
from storage.layout import TENANT_NAME_RULE, DataDir, StorageError, as_datadir, check_tenant, is_tenant

FORMAT = 1
INDEX_FORMAT = 1
STATUSES = ("candidate", "published", "rejected", "retired")
# The reason of a version `retire` (an operator: `clora adapters retire`) retired, not keep_versions: the
# learner never trains its samples again (it was withdrawn, not outgrown).
RETIRED_BY_HAND = "retired by hand (clora adapters retire)"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
STALE_STAGING_S = 3600.0
SWEEP_RECORDS_S = 600.0  # how often one process looks for crashed writers' temp files among the records
CACHE_VERSIONS = 4096  # parsed version records a Registry keeps (~6 KB each with metrics and gate checks)
FULL_HEAD_EVERY = 100  # every this many generations HEAD.json is rebuilt from every tenant's records (_write_head)
MAX_SKIP = 1000  # how far past the newest record a trace on disk is still taken for a version number (module notes)

logger = logging.getLogger(__name__)

# What parsing a record's fields raises when they are missing or of the wrong type (StorageError: another
# format, a tenant name that is not one).
_BAD_FIELDS = (ValueError, KeyError, TypeError, AttributeError, StorageError)

_VERSION_NAME = re.compile(r"^(?P<tenant>[^@]+)@(?P<number>[0-9]+)$")


class RegistryError(StorageError):
    """A registry operation that cannot be done (bad status move, missing files, bad name)."""


class VersionNotFound(RegistryError, KeyError):
    """The named version does not exist."""

    def __init__(self, tenant: str, number: int):
        super().__init__(f"adapter version {tenant}@{number} does not exist")
        self.tenant, self.number = tenant, number

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class UnreadableRecord(RegistryError):
    """A registry file that cannot be read: not JSON, a field missing or of the wrong type (edited by hand),
    another `format` (written by another clora), or an I/O error other than its absence. Not a KeyError: a
    version whose record cannot be read may well exist."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"registry file {path} cannot be read: {why}")
        self.path, self.why = path, why


def parse_version(name: str) -> tuple[str, int]:
    """"acme@3" -> ("acme", 3)."""
    m = _VERSION_NAME.match(name or "")
    if not m:
        raise RegistryError(f"{name!r} is not a version name; expected <tenant>@<number>, e.g. acme@3")
    return check_tenant(m["tenant"]), int(m["number"])


# ---------------------------------------------------------------------------------------------------------
# The version record


@dataclass(frozen=True)
class AdapterVersion:
    tenant: str
    number: int
    parent: str | None
    status: str
    path: Path
    created_at: datetime
    published_at: datetime | None = None
    metrics: dict = field(default_factory=dict, hash=False)
    trajectory_range: dict = field(default_factory=dict, hash=False)
    gate: dict | None = field(default=None, hash=False)
    reason: str | None = None
    retired_at: datetime | None = None

    @property
    def name(self) -> str:
        return f"{self.tenant}@{self.number}"

    def to_json(self) -> dict[str, Any]:
        """The persisted form. `path` is not stored: it follows from the data dir, which may move."""
        return {
            "format": FORMAT,
            "tenant": self.tenant,
            "number": self.number,
            "name": self.name,
            "parent": self.parent,
            "status": self.status,
            "created_at": _iso(self.created_at),
            "published_at": _iso(self.published_at),
            "retired_at": _iso(self.retired_at),
            "metrics": self.metrics,
            "trajectory_range": self.trajectory_range,
            "gate": self.gate,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], dd: DataDir) -> AdapterVersion:
        fmt = data.get("format")
        if fmt != FORMAT:
            raise RegistryError(f"registry record {data.get('name')!r} has format {fmt!r}; this clora reads {FORMAT}")
        # Fields of the wrong type (a hand edit) make the record unreadable here (ValueError), rather than
        # failing later where they are used: sorting, a table's column, every tenant's listing at once.
        if data["status"] not in STATUSES:
            raise ValueError(f"status {data['status']!r} is none of {', '.join(STATUSES)}")
        if not isinstance(data["tenant"], str):
            raise ValueError("field tenant is not a string")
        for key in ("parent", "reason"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"field {key} is not a string or null")
        for key in ("metrics", "trajectory_range", "gate"):
            if data.get(key) is not None and not isinstance(data[key], dict):
                raise ValueError(f"field {key} is not an object or null")
        return cls(
            tenant=data["tenant"],
            number=int(data["number"]),
            parent=data.get("parent"),
            status=data["status"],
            path=dd.adapter_dir(data["tenant"], data["number"]),
            created_at=_parse_ts(data["created_at"]),
            published_at=_parse_ts(data.get("published_at")),
            metrics=data.get("metrics") or {},
            trajectory_range=data.get("trajectory_range") or {},
            gate=data.get("gate"),
            reason=data.get("reason"),
            retired_at=_parse_ts(data.get("retired_at")),
        )


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _parse_ts(s: str | None) -> datetime | None:
    return None if s is None else datetime.fromisoformat(s)


def _dumps(data: Any) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode()


# ---------------------------------------------------------------------------------------------------------
# The registry


class Registry:
    def __init__(self, root, *, keep_last: int = 5):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.dd = as_datadir(root)
        self.keep_last = keep_last
        self._head = self.dd.registry / "HEAD.json"
        self._lock_path = self.dd.locks / "registry.lock"
        # Parsed metadata by file, with the (inode, mtime, size) it was read at: metadata is replaced by
        # rename, so a changed file has a new stamp, and a read costs a stat, not a parse. At most
        # CACHE_VERSIONS of them (one per step would grow for ever), oldest out first.
        self._metas: dict[Path, tuple[tuple[int, int, int], AdapterVersion]] = {}
        self._logged: dict[object, object] = {}  # what `_log_once` logged: key -> its reason
        self._generation_seen = 0  # the largest generation read or written: one rebuilt from the clock is larger
        self._head_cache: tuple[bytes, dict] | None = None  # HEAD.json's bytes and parse
        # A parse of HEAD.json's entries: (the head, its readable entries, why the others do not read).
        self._entries_cache: tuple[dict, dict[str, AdapterVersion], dict[str, Exception]] | None = None
        self._swept: dict[Path, float] = {}  # records folder -> when this process last swept it (monotonic)
        self.full_head_every = FULL_HEAD_EVERY  # 1: every change rebuilds HEAD.json from every tenant's records
        self._encoded: dict[str, tuple[dict, str]] = {}  # tenant -> (its HEAD.json entry, "tenant":entry): _encode_head

    def __repr__(self) -> str:
        return f"Registry({str(self.dd.root)!r}, keep_last={self.keep_last})"

    # --- reads (lock-free) ----------------------------------------------------------------------------
    def generation(self) -> int:
        """A counter that grows on every change; 0 for an empty registry. One small-file read. Raises
        `UnreadableRecord` while HEAD.json cannot be read (the next change rebuilds it)."""
        head = self._read_head()
        return 0 if head is None else head["generation"]

    def get(self, tenant: str, number: int) -> AdapterVersion:
        """The version's record; `VersionNotFound` if there is none, `UnreadableRecord` if it cannot be read."""
        path = self._meta_path(tenant, number)
        try:
            st = os.stat(path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._metas.get(path)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            raw = path.read_bytes()  # replaced since the stat: the next get reads it again
        except FileNotFoundError:
            raise VersionNotFound(tenant, number) from None
        except OSError as e:
            raise UnreadableRecord(path, str(e)) from e
        v = _parse_record(path, raw, self.dd)
        if (v.tenant, v.number) != (tenant, number):
            raise UnreadableRecord(path, f"it holds {v.name}, not {tenant}@{number}")
        self._logged.pop(path, None)  # readable (again): a later fault is logged anew
        if len(self._metas) >= CACHE_VERSIONS and path not in self._metas:
            try:  # the oldest entry; a listing of a long history cycles through, the live ones come back
                del self._metas[next(iter(self._metas))]
            except (StopIteration, KeyError, RuntimeError):  # emptied or changed by another thread meanwhile
                pass
        self._metas[path] = (stamp, v)
        return v

    def get_name(self, name: str) -> AdapterVersion:
        return self.get(*parse_version(name))

    def versions(self, tenant: str | None = None) -> list[AdapterVersion]:
        """Every version (of one tenant or all), ordered by tenant then number. Of one tenant, a record that
        cannot be read raises `UnreadableRecord`; of all, it is left out (and logged)."""
        out = []
        for t in [check_tenant(tenant)] if tenant is not None else self.tenants():
            for n in self.numbers(t):
                try:
                    out.append(self.get(t, n))
                except VersionNotFound:  # deleted since the listing (retention: `prune`)
                    continue
                except UnreadableRecord as e:
                    if tenant is not None:
                        raise
                    self.log_unreadable(e, "left out of listings of every tenant; fix or remove it")
        return out

    def tenants(self) -> list[str]:
        if not self.dd.registry.is_dir():
            return []
        # A folder left by hand ("_old", "acme backup") is no tenant: naming it would make every registry
        # change fail after its commit point (HEAD lists every tenant's newest version).
        return sorted(p.name for p in self.dd.registry.iterdir() if p.is_dir() and is_tenant(p.name))

    def latest_published(self, tenant: str) -> AdapterVersion | None:
        """`UnreadableRecord` when a record newer than the newest published one cannot be read: it may be
        the one published."""
        for n in reversed(self._live(check_tenant(tenant))[1]):  # newest first: usually the first one or two
            try:
                v = self.get(tenant, n)
            except VersionNotFound:
                continue
            if v.status == "published":
                return v
        return None

    def unsettled(self, tenant: str) -> list[AdapterVersion]:
        """The tenant's versions that can still change, oldest first: candidates, published ones not retired,
        rejected ones that keep their files, and any whose files are being deleted. The index hint names
        them, so this reads a handful of versions however long the history."""
        out = []
        for n in self._live(check_tenant(tenant))[1]:
            try:
                out.append(self.get(tenant, n))
            except VersionNotFound:
                continue
        return out

    def newest_number(self, tenant: str) -> int:
        """The tenant's newest version number, 0 for none (numbers are 1, 2, ...: a number skipped has a record)."""
        return self._live(check_tenant(tenant))[0]

    def candidates(self, tenant: str) -> list[AdapterVersion]:
        """The tenant's versions still waiting for the gate's verdict, oldest first."""
        return [v for v in self.unsettled(tenant) if v.status == "candidate"]

    def published(self) -> dict[str, AdapterVersion]:
        """tenant -> its newest published version, from HEAD.json (one read). Raises `UnreadableRecord` while
        HEAD.json cannot be read, rather than answer without the tenants whose entries are bad. An entry of a
        tenant whose name is not a tenant name (now: an older clora allowed `acme.`) is left out, logged once:
        no config can name that tenant, so nothing serves or trains it, and failing the whole file for it
        left every tenant on the base model."""
        head = self._read_head()
        if head is None:
            return {}
        entries, bad = self._head_entries(head)
        for t, e in bad.items():
            if not is_tenant(t):
                self._log_once(("head-entry", t), "name", logging.WARNING, "registry: HEAD.json names %r, not a valid "
                               "tenant name (%s): its entry is left out; that tenant's adapters are not served",
                               t, TENANT_NAME_RULE)
                continue
            raise UnreadableRecord(self._head, f"an entry of published: {_why(e)}") from e
        return dict(entries)

    # --- writes ---------------------------------------------------------------------------------------
    def create(
        self,
        tenant: str,
        *,
        parent: str | None,
        write: Callable[[Path], None],
        metrics: dict | None = None,
        trajectory_range: dict | None = None,
    ) -> AdapterVersion:
        """A new "candidate" version from the PEFT files `write(staging_dir)` saves."""
        return self._create(
            tenant, parent=parent, write=write, metrics=metrics or {}, trajectory_range=trajectory_range or {}
        )

    def publish(self, tenant: str, number: int, *, gate: dict | None = None, if_parent_served: bool = False) -> AdapterVersion:
        """Publishes a candidate. With `if_parent_served` only if its parent is still what the tenant serves
        (its newest published version, or none for a candidate without a parent); otherwise the candidate is
        rejected as superseded and returned so. The learner publishes this way: a rollback, retire or publish
        made by hand while it trained a step must not be undone by that step's version."""
        with self._locked():
            v = self._expect(tenant, number, "candidate", "publish")
            served = self.latest_published(tenant) if if_parent_served else None
            if if_parent_served and (served.name if served is not None else None) != v.parent:
                reason = (f"superseded: trained from {v.parent or 'the base model'}, but "
                          f"{served.name if served is not None else 'the base model'} is served now "
                          "(a rollback, retire or publish since the step began)")
                v = replace(v, status="rejected", reason=reason, gate=_jsonable(gate, "gate"))
            else:
                v = replace(v, status="published", published_at=_now(), gate=_jsonable(gate, "gate"))
            self._write_meta(v)
            retired = self._enforce_keep_last(tenant)
            self._write_head(tenant)
        self._remove_files(retired)
        return v

    def reject(self, tenant: str, number: int, *, reason: str, gate: dict | None = None) -> AdapterVersion:
        with self._locked():
            v = self._expect(tenant, number, "candidate", "reject")
            v = replace(v, status="rejected", reason=reason, gate=_jsonable(gate, "gate"))
            self._write_meta(v)
            removed = self._enforce_keep_last(tenant)
            self._write_head(tenant)
        self._remove_files(removed)
        return v

    def rollback(self, tenant: str, to_number: int) -> AdapterVersion:
        """Serves `tenant@to_number` again by republishing its files as a new, newest version; refused for the
        version served now."""
        old = self.get(tenant, to_number)
        if old.status == "retired" or old.published_at is None:
            raise RegistryError(
                f"cannot roll back to {old.name}: it is {old.status}"
                + (" and its files are gone" if old.status == "retired" else " and was never published")
            )
        served = self.latest_published(tenant)
        if served is not None and served.number == to_number:
            # A copy would change nothing served, yet supersede the learner's step in flight from it.
            raise RegistryError(f"cannot roll back to {old.name}: it is already the version served for {tenant}")

        def copy(staging: Path) -> None:
            try:  # entry by entry: copytree would give `staging` the old directory's times (see _create)
                for entry in old.path.iterdir():
                    if entry.is_dir():
                        shutil.copytree(entry, staging / entry.name)
                    else:
                        shutil.copy(entry, staging / entry.name)
            except FileNotFoundError as e:
                raise RegistryError(f"cannot roll back to {old.name}: its files vanished ({e})") from e

        return self._create(
            tenant,
            parent=old.name,
            write=copy,
            metrics=old.metrics,
            trajectory_range=old.trajectory_range,
            status="published",
            # the same weights, as far from the base model: the learner's check of the served version's KL
            # against a lowered gate_max_kl must not be cleared by a rollback to a version above it
            gate={"rollback_to": old.name, **{k: v for k, v in (old.gate or {}).items() if k == "kl"}},
            reason=f"rollback to {old.name}",
        )

    def retire(self, tenant: str, number: int) -> AdapterVersion:
        """Deletes the version's files; its metadata stays, with status "retired".

        A version retired otherwise (keep_last) is marked retired by hand too: the learner then trains none
        of its samples (`RETIRED_BY_HAND`). HEAD.json is rewritten even when the version was already retired: a retire killed between its record
        and HEAD left HEAD naming this version, and its retry deletes the files, which serving would then
        load from a HEAD that still names them. The index hint is rewritten before the files are deleted:
        past a hole (a record deleted by hand) readers find the newest versions by their folders, and one whose
        folder is gone must already be within the hint's `last`."""
        with self._locked():
            v = self.get(tenant, number)
            if v.status != "retired" or v.reason != RETIRED_BY_HAND:  # retired by keep_last, or by a clora that
                v = self._mark_retired(v, reason=RETIRED_BY_HAND)  # recorded no reason: withdrawn now, by hand
            removed = self._enforce_keep_last(tenant)
            self._write_head(tenant)
        self._remove_files([v] + [x for x in removed if x.number != v.number])
        return v

    def prune(self, tenant: str, *, before_s: float, dry_run: bool = False) -> int:
        """Deletes the metadata of the tenant's settled versions last written before `before_s` (epoch
        seconds; retention, storage.retention), never the newest; returns how many (would) go. Settled is
        what the index hint says (not named open, at most `last`), so no metadata is parsed: the file's
        mtime, when it was last rewritten (retired, or its files recorded removed), stands for its age.
        Without a hint nothing is settled for sure, and nothing goes."""
        check_tenant(tenant)
        removed = 0
        with nullcontext() if dry_run else self._locked():  # a dry run creates no lock file
            # an index that cannot be read for a reason of the disk's (EACCES, EIO) is an error to report,
            # not "nothing settled": the run would say 0 and succeed while the tenant is never pruned
            index = self._read_index(tenant, errors=True)
            if index is None:
                return 0
            last, open_ = index
            keep = set(open_)
            directory = self.dd.registry / tenant
            for n in self.numbers(tenant):
                if n >= last or n in keep:
                    continue
                path = self._meta_path(tenant, n)
                try:
                    if path.stat().st_mtime >= before_s:
                        continue
                except FileNotFoundError:
                    continue
                removed += 1
                if not dry_run:
                    path.unlink(missing_ok=True)
                    self._metas.pop(path, None)
            if removed and not dry_run:
                fsync_dir(directory)
        return removed

    def repair(self, tenant: str) -> bool:
        """Finishes what a writer that crashed mid-change left of the tenant's last change: rewrites HEAD.json
        when it does not name the tenant's newest published version (serving reads HEAD, and would otherwise
        serve the older version until the next change) and deletes the files of versions marked retired.
        Returns whether anything was repaired. The learner calls it when it takes a tenant over."""
        with self._locked():
            newest = self.latest_published(tenant)
            _, entries = self._old_head()
            entry = None if entries is None else entries.get(tenant)
            stale = entries is None or (newest.to_json() if newest else None) != (entry.to_json() if entry else None)
            removed = self._enforce_keep_last(tenant)
            if stale or removed:
                self._write_head(tenant)
        self._remove_files(removed)
        return stale or bool(removed)

    # --- internals ------------------------------------------------------------------------------------
    def _create(
        self,
        tenant: str,
        *,
        parent: str | None,
        write: Callable[[Path], None],
        metrics: dict,
        trajectory_range: dict,
        status: str = "candidate",
        gate: dict | None = None,
        reason: str | None = None,
    ) -> AdapterVersion:
        check_tenant(tenant)
        if parent is not None:
            self.get_name(parent)  # lineage must point at a real version
        metrics = _jsonable(metrics, "metrics")
        trajectory_range = _jsonable(trajectory_range, "trajectory_range")
        tenant_dir = self.dd.adapters / tenant
        ensure_dir(tenant_dir)
        remove_stale_hidden(tenant_dir, older_than_s=STALE_STAGING_S)
        # The temp files of record and head writes a crash left (nothing else ever looks at them), looked for at
        # a process's first create and then every SWEEP_RECORDS_S: the folders hold a record per version and a
        # folder per tenant, and listing them at every create cost more than the rest of it at 10,000 versions.
        for records in (self.dd.registry / tenant, self.dd.registry):
            if time.monotonic() - self._swept.get(records, -SWEEP_RECORDS_S) >= SWEEP_RECORDS_S:
                remove_stale_hidden(records, older_than_s=STALE_STAGING_S)
                self._swept[records] = time.monotonic()

        # The slow part (saving weights) happens outside the lock, in a hidden directory.
        staging = tenant_dir / f".staging-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            write(staging)
            # Stale-staging cleanup (a concurrent create's remove_stale_hidden) judges age by mtime; a writer
            # that copies old files with their times (rollback's copytree) must not look an hour old.
            os.utime(staging)
            _check_peft_files(staging, tenant)
            fsync_tree(staging)
            with self._locked():
                number, skipped = self._allocate(tenant)
                final = self.dd.adapter_dir(tenant, number)
                publish_dir(staging, final)
                now = _now()
                v = AdapterVersion(
                    tenant=tenant,
                    number=number,
                    parent=parent,
                    status=status,
                    path=final,
                    created_at=now,
                    published_at=now if status == "published" else None,
                    metrics=metrics,
                    trajectory_range=trajectory_range,
                    gate=gate,
                    reason=reason,
                )
                self._write_meta(v)  # the commit point
                retired = skipped + (self._enforce_keep_last(tenant) if status == "published" else [])
                self._write_head(tenant)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        self._remove_files(retired)
        return v

    def _allocate(self, tenant: str) -> tuple[int, list[AdapterVersion]]:
        """Under the lock: the next version number, past every one a trace on disk names up to MAX_SKIP past the
        newest record (see the module notes), and the records written for the numbers skipped (their files
        still to be removed)."""
        index = self._read_index(tenant)
        newest, live = self._live(tenant)
        if newest and not self._meta_path(tenant, newest).exists():
            # The hint names more than there are (edited by hand, or its newest records deleted): one listing.
            newest = max(self.numbers(tenant), default=0)
        folders = set(self._adapter_numbers(tenant))
        traces = [(n, self.dd.adapter_dir(tenant, n)) for n in folders]
        if index is not None:
            traces.append((index[0], self._index_path(tenant)))
        _, head = self._old_head()
        served = (head or {}).get(tenant)
        if served is not None:
            traces.append((served.number, self._head))
        top = max([newest] + [n for n, _ in traces if n <= newest + MAX_SKIP])
        # A run of consecutive folders or records (a range restored or copied back) is taken whole: only a gap
        # makes what lies past it far. Each step is a folder or a record, so the run costs no more than they do.
        for _ in range(len(folders) + MAX_SKIP):
            if top + 1 not in folders and not self._meta_path(tenant, top + 1).exists():
                break
            top += 1
        far = [(n, where) for n, where in traces if n > top]
        for n, where in far:
            self._ignore_far(tenant, n, where, newest, top + 1)
        for in_the_way in (self.dd.adapter_dir(tenant, top + 1), self._meta_path(tenant, top + 1)):
            if in_the_way.exists():  # a run longer than the bound above
                raise RegistryError(f"cannot create {tenant}@{top + 1}: {in_the_way} is in the way, past a run of "
                                    f"{len(folders) + MAX_SKIP} numbers taken; move it out of the registry's folders")
        # A record there (a version past a hole that readers' probe cannot reach) is kept, not overwritten.
        missing = {n for n in range(newest + 1, top + 1) if not self._meta_path(tenant, n).exists()}
        if index is not None:  # the numbers it does not vouch for; without one, `live` is the listing of the records
            missing.update(n for n in live if n <= top and not self._meta_path(tenant, n).exists())
        skipped = []
        for n in sorted(missing):
            now = _now()
            v = AdapterVersion(
                tenant=tenant,
                number=n,
                parent=None,
                status="retired",
                path=self.dd.adapter_dir(tenant, n),
                created_at=now,
                retired_at=now,
                reason=(f"number skipped: {tenant}@{n} had no record when {tenant}@{top + 1} was created (a create "
                        "cut short before its record, or a record deleted by hand); never reused, its files removed"),
            )
            self._write_meta(v)
            skipped.append(v)
        if skipped:
            span = skipped[0].name if len(skipped) == 1 else f"{skipped[0].name} to {skipped[-1].name}"
            logger.warning("registry: %d number(s) of %s had no record (%s: a create cut short before its record, or "
                           "records deleted by hand); numbers are never reused, so they are recorded as retired, "
                           "their files removed, and %s@%d is next", len(skipped), tenant, span, tenant, top + 1)
        return top + 1, skipped

    def _ignore_far(self, tenant: str, number: int, where: Path, newest: int, next_number: int) -> None:
        """A trace too far past the newest record to be a version's (module notes): logged once, and a hint
        naming it deleted."""
        if where == self._index_path(tenant):
            where.unlink(missing_ok=True)  # readers probe from its `last`, past every version there is
            consequence = "the index hint is deleted (readers list the records until a publish or reject rewrites it)"
        elif where == self._head:
            consequence = "HEAD.json is rebuilt from the records"
        else:
            consequence = (f"the folder is left as it is: move it out of {where.parent} (once the versions come within "
                           f"{MAX_SKIP} of it, it is taken for a version's files and deleted)")
        self._log_once((where, number), None, logging.WARNING,
                       "registry: %s names %s@%d, more than %d past the newest record (%s): too far for a create cut "
                       "short or records deleted by hand, so no number is skipped for it and %s@%d is next; %s",
                       where, tenant, number, MAX_SKIP, f"{tenant}@{newest}" if newest else "none",
                       tenant, next_number, consequence)

    def _ignore_far_record(self, tenant: str, number: int, newest: int) -> None:
        """A record and folder too far past the newest version to be one (module notes): logged once."""
        where = self._meta_path(tenant, number)
        self._log_once((where, number), None, logging.WARNING, "registry: %s and its folder name %s@%d, more than %d past the newest version found before it "
                       "(%s): too far for a hole left by records deleted by hand, so readers and creates look no "
                       "further than %s; move them out of the registry's folders", where, tenant, number, MAX_SKIP,
                       f"{tenant}@{newest}" if newest else "none", f"{tenant}@{newest}" if newest else "none")

    def _locked(self):
        return FileLock(self._lock_path)

    def _meta_path(self, tenant: str, number: int) -> Path:
        return self.dd.registry / check_tenant(tenant) / f"{int(number)}.json"

    def numbers(self, tenant: str) -> list[int]:
        """The numbers of the tenant's version records on disk, ascending (none read)."""
        d = self.dd.registry / tenant
        if not d.is_dir():
            return []
        return sorted(int(p.stem) for p in d.iterdir() if p.suffix == ".json" and _is_number(p.stem))

    def _adapter_numbers(self, tenant: str) -> list[int]:
        """The numbers adapters/<tenant>/ has a directory for (one listing; none read)."""
        try:
            with os.scandir(self.dd.adapters / tenant) as entries:
                return [int(e.name) for e in entries if _is_number(e.name) and e.is_dir()]
        except FileNotFoundError:
            return []

    def _index_path(self, tenant: str) -> Path:
        return self.dd.registry / tenant / "index.json"

    def _read_index(self, tenant: str, *, errors: bool = False) -> tuple[int, list[int]] | None:
        """(last, open) from the hint, or None when there is none or it is unreadable (then: a full listing).
        `errors`: an OSError other than a missing file is raised."""
        try:
            data = json.loads(self._index_path(tenant).read_bytes())
            last, open_ = data["last"], data["open"]
            if data.get("format") != INDEX_FORMAT or not _is_count(last) or not all(_is_count(n) for n in open_):
                return None
            return last, sorted(n for n in open_ if n <= last)
        except FileNotFoundError:
            return None
        except OSError:
            if errors:
                raise
            return None
        except (ValueError, TypeError, KeyError):
            return None

    def _live(self, tenant: str) -> tuple[int, list[int]]:
        """(the newest number, every number not known to be settled ascending: the hint's open ones and
        any newer than it). The newest number is 0 for a tenant with no versions."""
        index = self._read_index(tenant)
        if index is None:
            numbers = self.numbers(tenant)
            return max(numbers, default=0), numbers
        last, open_ = index
        newest = self._probe(tenant, last)
        return newest, open_ + list(range(last + 1, newest + 1))

    def _probe(self, tenant: str, last: int) -> int:
        """The newest number from the hint's `last` on: `last + 1, last + 2, ...` while they have records, and on
        past a hole (a record deleted by hand) from the newest adapter directory that has a record (module notes)."""
        last = self._walk(tenant, last)
        try:
            names = os.listdir(self.dd.adapters / tenant)
        except OSError:  # none yet; or one that cannot be listed, which hides only what is past a hole
            return last
        for n in sorted((int(name) for name in names if _is_number(name)), reverse=True):
            if n <= last + 1:
                break
            if not self._meta_path(tenant, n).exists():  # none past last + 1 but for a hole or a folder left by hand
                continue
            if n > last + MAX_SKIP:  # a copy put there by hand: taking it would make the next create skip every
                self._ignore_far_record(tenant, n, last)  # number up to it, under the lock (module notes)
                continue
            return self._walk(tenant, n)
        return last

    def _walk(self, tenant: str, last: int) -> int:
        while self._meta_path(tenant, last + 1).exists():
            last += 1
        return last

    def _write_index(self, tenant: str, last: int, open_: list[int]) -> None:
        """Rename without fsync: a hint a crash undid is an older hint, which is still right. A write that
        fails leaves the older hint too, so it is logged, not raised: the change it follows is committed."""
        path = self._index_path(tenant)
        if not path.parent.is_dir():  # a tenant without versions (a learner's first look): nothing to hint
            return
        tmp = tmp_name(path)
        try:
            tmp.write_bytes(_dumps({"format": INDEX_FORMAT, "last": last, "open": sorted(open_)}))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            logger.warning("registry: could not rewrite the index hint of %s (%s); the older one stays valid", tenant, e)

    def _expect(self, tenant: str, number: int, status: str, action: str) -> AdapterVersion:
        v = self.get(tenant, number)
        if v.status != status:
            raise RegistryError(f"cannot {action} {v.name}: it is {v.status}, not {status}")
        return v

    def _write_meta(self, v: AdapterVersion) -> None:
        atomic_write_bytes(self._meta_path(v.tenant, v.number), _dumps(v.to_json()))

    def _mark_retired(self, v: AdapterVersion, reason: str | None = None) -> AdapterVersion:
        v = replace(v, status="retired", retired_at=_now(), reason=reason if reason is not None else v.reason)
        self._write_meta(v)
        return v

    def _enforce_keep_last(self, tenant: str) -> list[AdapterVersion]:
        """Marks published versions beyond the newest keep_last retired, and records the files of rejected
        versions beyond the newest keep_last rejected ones as removed (`retired_at`; the status stays
        "rejected", with its reason); returns them all (files not yet removed). Also returns versions
        whose files a crashed writer left behind after marking them. Then rewrites the index hint: only
        versions it names as open can be any of these (settled ones have none of it left to do)."""
        newest, live = self._live(tenant)
        versions = []
        for n in live:
            try:
                versions.append(self.get(tenant, n))
            except VersionNotFound:  # a hint naming a number whose metadata was deleted by hand
                continue
            except UnreadableRecord as e:  # not counted, never retired, and it stays open in the hint
                self.log_unreadable(e, f"retention leaves it alone; fix or remove it ({tenant} only is affected)")
        published = [v for v in versions if v.status == "published"]
        excess = published[: max(0, len(published) - self.keep_last)]
        rejected = [v for v in versions if v.status == "rejected" and v.retired_at is None]
        old_rejected = rejected[: max(0, len(rejected) - self.keep_last)]
        leftovers, settled = [], set()
        for v in versions:
            if v.retired_at is not None:
                if v.path.exists():
                    leftovers.append(v)
                else:
                    settled.add(v.number)
        marked = [self._mark_retired(v) for v in excess] + [self._mark_files_removed(v) for v in old_rejected]
        # The marked ones stay open until a later call sees their files gone.
        self._write_index(tenant, newest, [n for n in live if n not in settled])
        return leftovers + marked

    def _mark_files_removed(self, v: AdapterVersion) -> AdapterVersion:
        v = replace(v, retired_at=_now())
        self._write_meta(v)
        return v

    def _remove_files(self, versions: list[AdapterVersion]) -> None:
        for v in versions:
            remove_tree(v.path)

    def _write_head(self, tenant: str) -> None:
        """Rewrites HEAD.json after a change of `tenant` with a larger generation: + 1, or from the clock when
        the old one cannot be read. `tenant`'s entry (and any the old one holds that does not read) is taken
        from its version files, the others' are kept as they were; every FULL_HEAD_EVERY generations, and
        whenever the old one cannot be read, every tenant's is (so it repairs what a writer that crashed
        between a record and HEAD left of another tenant). A tenant whose records cannot be read keeps its
        old entry, if the old HEAD.json has a readable one (see the module notes)."""
        old_generation, old_published = self._old_head()
        old = self._read_head() if old_published is not None else None  # the parse _old_head read (cached)
        # A generation below one this process saw: a copy put back by hand, whose entries may name files
        # deleted since.
        if old is None or old_generation < self._generation_seen or (old_generation + 1) % self.full_head_every == 0:
            tenants, published = self.tenants(), {}
        else:
            # The other tenants' entries as they were (a rebuild read every tenant's records: ~0.7 s a change
            # at 1,000 tenants, under the lock every writer takes).
            entries = old["published"]
            # An entry under a name no tenant can have (edited by hand) is dropped, never looked up.
            published = {t: entries[t] for t in old_published if t != tenant and is_tenant(t)}
            tenants = [tenant, *(t for t in entries if t not in old_published and is_tenant(t))]
        parsed = {t: old_published[t] for t in published}
        for t in tenants:
            try:
                latest = self.latest_published(t)
            except UnreadableRecord as e:
                kept = (old_published or {}).get(t)
                if kept is not None and not self._still_published(kept):
                    kept = None  # retired since (its files go next): HEAD must never name deleted files
                self.log_unreadable(e, (f"HEAD.json keeps {kept.name} for {t}" if kept is not None
                                         else f"HEAD.json names no version of {t} (the old one had none readable, or it was retired)")
                                     + " until it is fixed or removed; the other tenants are unaffected")
                if kept is not None:
                    published[t], parsed[t] = kept.to_json(), kept
                continue
            if latest is not None:
                published[t], parsed[t] = latest.to_json(), latest
            else:
                published.pop(t, None)
                parsed.pop(t, None)
        # Never one this process read or wrote before: the old one may be a copy put back by hand.
        clock = time.time_ns() // 1000
        generation = max(old_generation + 1 if old_generation is not None else clock, self._generation_seen + 1)
        head = {"format": FORMAT, "generation": generation, "published": published}
        atomic_write_bytes(self._head, raw := self._encode_head(head))
        self._generation_seen = generation
        # What this process wrote, as the next read will find it: its next change parses no entry again.
        self._head_cache, self._entries_cache = (raw, head), (head, parsed, {})

    def _encode_head(self, head: dict) -> bytes:
        """`head` as json.dumps(head, sort_keys=True, separators=(",", ":")) writes it: compact (an entry per
        tenant, written at every change and parsed by every serving replica after it), with each entry this
        process encoded for the HEAD.json before it, and kept as it was, not encoded again (~20 ms a change
        at 1,000 tenants)."""
        before, encoded = self._encoded, {}
        for t, entry in sorted(head["published"].items()):
            hit = before.get(t)
            encoded[t] = hit if hit is not None and hit[0] is entry else (entry, f"{_compact(t)}:{_compact(entry)}")
        self._encoded = encoded
        parts = (part for _, part in encoded.values())
        return f'{{"format":{_compact(head["format"])},"generation":{_compact(head["generation"])},' \
               f'"published":{{{",".join(parts)}}}}}'.encode()

    def _still_published(self, v: AdapterVersion) -> bool:
        """Whether the version's own record still says published (True where that record cannot be read)."""
        try:
            return self.get(v.tenant, v.number).status == "published"
        except VersionNotFound:
            return False
        except UnreadableRecord:
            return True

    def _read_head(self) -> dict | None:
        """HEAD.json checked (format, generation, published), or None when there is none yet. Parsed again only
        when its bytes changed: serving polls it every half second, and it holds an entry per tenant (1.5 MB at
        1,000 tenants: its read and comparison cost ~1% of its parse). Not by (inode, mtime, size): a rename
        reuses the inode it freed, two writes can share an mtime tick, and a new generation is often the same
        size. Callers must not change what it returns."""
        try:
            raw = self._head.read_bytes()
            if self._head_cache is not None and self._head_cache[0] == raw:
                return self._head_cache[1]
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UnreadableRecord(self._head, str(e)) from e
        try:
            head = json.loads(raw)
            if not isinstance(head, dict):
                raise ValueError("not a JSON object")
            if head.get("format") != FORMAT:
                raise ValueError(f"format {head.get('format')!r}; this clora reads {FORMAT}")
            if not _is_count(head.get("generation")) or not isinstance(head.get("published"), dict):
                raise ValueError("generation or published is missing or of the wrong type")
        except ValueError as e:
            raise UnreadableRecord(self._head, _why(e)) from e
        self._generation_seen = max(self._generation_seen, head["generation"])
        self._head_cache = (raw, head)
        return head

    def _old_head(self) -> tuple[int | None, dict[str, AdapterVersion] | None]:
        """For a writer rebuilding HEAD.json: its generation and tenant -> its entry (those that read as a
        version); (0, {}) when there is none yet. One that cannot be read (logged) has no entries, and no
        generation unless that field alone still reads (another format's)."""
        try:
            head = self._read_head()
        except UnreadableRecord as e:
            self.log_unreadable(e, "it is rebuilt from the version records")
            try:
                generation = json.loads(self._head.read_bytes())["generation"]
            except (OSError, ValueError, TypeError, KeyError, IndexError):
                generation = None
            return (generation if _is_count(generation) else None), None
        if head is None:
            return 0, {}
        self._logged.pop(self._head, None)
        # An entry that does not read is rebuilt from its records, or left out when those cannot be read either.
        return head["generation"], self._head_entries(head)[0]

    def _head_entries(self, head: dict) -> tuple[dict[str, AdapterVersion], dict[str, Exception]]:
        """HEAD.json's entries as versions, and why those that do not read do not. An entry equal to the one
        the previous parse read is not parsed again: a change rewrites one tenant's entry, and serving reads
        HEAD.json after every change (parsing every entry took ~60 ms at 1,000 tenants). Callers must not
        change what it returns."""
        cache = self._entries_cache
        if cache is not None and cache[0] is head:
            return cache[1], cache[2]
        before, before_raw = (cache[1], cache[0]["published"]) if cache is not None else ({}, {})
        entries, bad = {}, {}
        for t, d in head["published"].items():
            if t in before and before_raw.get(t) == d:
                entries[t] = before[t]
                continue
            try:
                entries[t] = AdapterVersion.from_json(d, self.dd)
            except _BAD_FIELDS as e:
                bad[t] = e
        self._entries_cache = (head, entries, bad)
        return entries, bad

    def log_unreadable(self, e: UnreadableRecord, consequence: str) -> None:
        """Logs a file that cannot be read once per process, not on every change (again when its reason changes)."""
        self._log_once(e.path, e.why, logging.ERROR, "registry: %s; %s", e, consequence)

    def _log_once(self, key: object, reason: object, level: int, message: str, *args) -> None:
        """Logs `message` the first time `key` comes with `reason` in this process (again when its reason changes)."""
        if key in self._logged and self._logged[key] == reason:
            return
        self._logged[key] = reason
        logger.log(level, message, *args)


def _parse_record(path: Path, raw: bytes, dd: DataDir) -> AdapterVersion:
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return AdapterVersion.from_json(data, dd)
    except _BAD_FIELDS as e:
        raise UnreadableRecord(path, _why(e)) from e


def _why(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"field {e} is missing"
    return str(e) or type(e).__name__


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_number(name: str) -> bool:
    """A version number as the registry writes it in a file or folder name: "7", not "07", "+7" or "٧" (which
    int() reads as 7 too) or "0"."""
    return name.isascii() and name.isdigit() and str(int(name)) == name and name != "0"


def _check_peft_files(directory: Path, tenant: str) -> None:
    missing = []
    if not (directory / ADAPTER_CONFIG).is_file():
        missing.append(ADAPTER_CONFIG)
    if not any((directory / w).is_file() for w in ADAPTER_WEIGHTS):
        missing.append(" or ".join(ADAPTER_WEIGHTS))
    if missing:
        raise RegistryError(f"adapter for tenant {tenant!r} is incomplete: write() did not save {', '.join(missing)}")


def _compact(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _jsonable(value: dict | None, what: str) -> dict | None:
    if value is None:
        return None
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise RegistryError(f"{what} must be JSON-serialisable: {e}") from e
