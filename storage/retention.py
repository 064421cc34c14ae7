"""Retention: deletes stored data older than a cutoff, a whole Parquet file at a time.

Ingest keeps every interaction, feedback event, trajectory and dead letter, so a tenant's data grows for
ever (~8.6 GB a day at 100 interactions a second). `prune` deletes, in interactions/, feedback/,
trajectories/ and dead_letters/, every file whose rows were all ingested before the cutoff (`ingested_at`,
read from the footer's statistics: parquet.newest_ms). A file holding newer rows too stays until its newest
row is old. Compaction never merges files of different UTC days (see compact.py), so a file's rows span a
day at most (plus an ingest flush's, for a file written across midnight), and a closed day's files are never
merged again: a row is deleted at most a day after it passes the cutoff, at the next prune. (A file
compacted before that rule may span many days; it goes when its newest row is old.)

What pruning gives up, and why it is safe within limits the config enforces:
  - idempotency: ingest recognises a replayed or resent event by its key indexes, built from the rows on
    disk when it starts. A running ingest still knows a pruned event's key; after a restart, an event older
    than the retention that Kafka delivered again would be stored again. Kafka replays only uncommitted
    offsets, which are recent; keep the retention above the topics' `retention.ms`, so nothing older can
    come back;
  - the feedback join: feedback for a pruned interaction finds nothing (ingest treats a file that is gone
    without a compacted successor as pruned), so the retention must be at least
    `ingest.pending_expiry_hours` (config.py refuses less), plus the ingest lag to tolerate: the join
    window counts event times, retention ingest times;
  - training: trajectories the learner has not reached within the retention are never trained.

Deleting is safe while others run. The partition's compaction lock is held, so no merge runs beside it. A
reader that listed the files before finds one gone and lists again (parquet.retry_vanished). Superseded
inputs still waiting for their grace period are deleted before the files superseding them, so none becomes
live again, and with them whatever their own footer says (an unreadable one too). `prune_registry` deletes
the records of settled adapter versions (retired, or rejected with
their files gone; `learner.keep_versions` deletes the files) last written before the cutoff, never a
tenant's newest. `forget_trained` makes each learner cursor forget the ids of steps committed before the
cutoff (16 bytes each in every learner, and a cold start's read), and leave trajectories ingested before
it out of the backlog (storage.cursors, `Cursors.forget`). `prune_spool_dead` deletes the serving tier's
dead-letter files (`state/serving-spool/dead/<YYYY-MM-DD>.jsonl`, events Kafka refused for good) whose whole
UTC day is older than the cutoff. Not here: train_steps/ (a row per step, small).

A part that fails (a partition, a dataset that cannot be listed, a tenant's registry records or cursor) is
the caller's to report, from the result's `error` or the PartlyDone raised (`clora prune`: a line on
stderr); its traceback is logged at DEBUG only, as in compaction.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from storage import parquet
from storage.compact import file_key, partition_lock
from storage.files import LockBusy, fsync_dir
from storage.layout import StorageError, as_datadir, check_dataset
from storage.parquet import partition_listing, partition_tenants
from storage.schema import INGESTED_AT

logger = logging.getLogger(__name__)

PRUNED_DATASETS = ("interactions", "feedback", "trajectories", "dead_letters")
TIME_COLUMN = INGESTED_AT
DAY_S = 86_400


@dataclass
class PruneResult:
    dataset: str
    tenant: str
    files: int = 0  # files deleted (or, with dry_run, that would be)
    rows: int = 0
    bytes: int = 0
    unreadable: int = 0  # files whose footer or time column could not be read (left alone, logged)
    skipped: str | None = None
    error: str | None = None  # why pruning failed here (its traceback logged at DEBUG); the others went on

    @property
    def where(self) -> str:
        return f"{self.dataset}/tenant={self.tenant}" if self.tenant else self.dataset

    def __str__(self) -> str:
        where = self.where
        if self.error:
            return f"{where}: failed: {self.error}"
        if self.skipped:
            return f"{where}: skipped ({self.skipped})"
        bad = f"; {self.unreadable} unreadable files left alone" if self.unreadable else ""
        return f"{where}: {self.files} files, {self.rows} rows, {self.bytes / 1e6:.1f} MB{bad}"


# partition directory -> {compact.file_key: newest_ms} of its files at its last prune in this process; each
# prune replaces its partition's entry whole. The
# compactor's loop prunes every run: without this it read every stored file's footer every time, which
# costs a partition's whole history (a compacted file's footer lists every name it supersedes).
_dated: dict[str, dict[tuple[str, int, int], tuple[int | None, int]]] = {}


def newest_ms(root, path: str) -> tuple[int | None, int]:
    """(the newest `ingested_at` in a file as epoch ms, its row count), from the footer's statistics; the
    column is read only when a row group has none. (None, 0) for a file without rows."""
    return parquet.newest_ms(root, path, TIME_COLUMN)


def _cutoff_s(older_than_s: float, now_s: float | None) -> float:
    if not 0 < older_than_s < math.inf:
        raise ValueError(f"older_than_s must be a finite number above 0, got {older_than_s}")
    return (time.time() if now_s is None else now_s) - older_than_s


def prune(
    root,
    *,
    older_than_s: float,
    dataset: str | None = None,
    tenant: str | None = None,
    dry_run: bool = False,
    now_s: float | None = None,
) -> list[PruneResult]:
    """Deletes every file whose rows were all ingested more than `older_than_s` ago, in each partition of
    the pruned datasets (one dataset / one tenant if given); see the module note. A partition that fails (a
    disk or permission error), or a dataset whose tenants cannot be listed (a file in its directory's place),
    has its result's `error` set (the tenant "" for a dataset) for the caller to report; the others are
    pruned all the same, as in compaction: one bad directory must not turn retention off for every tenant."""
    cutoff_ms = round(_cutoff_s(older_than_s, now_s) * 1000)
    dd = as_datadir(root)
    if dataset is not None and check_dataset(dataset) not in PRUNED_DATASETS:
        raise ValueError(f"{dataset} is not pruned; pruned datasets: {', '.join(PRUNED_DATASETS)}")
    results = []
    for ds in [dataset] if dataset else PRUNED_DATASETS:
        try:
            tenants = [tenant] if tenant else partition_tenants(dd, ds)
        except OSError as e:
            logger.debug("retention: listing the tenants of %s failed", ds, exc_info=True)
            results.append(PruneResult(ds, "", error=f"{type(e).__name__}: {e}"))
            continue
        for t in tenants:
            results.append(prune_partition(dd, ds, t, cutoff_ms, dry_run=dry_run))
    return results


def prune_spool_dead(root, *, older_than_s: float, dry_run: bool = False, now_s: float | None = None) -> int:
    """How many of serving's dead-letter day files were (or, with dry_run, would be) deleted: those whose
    whole UTC day ended before the cutoff. A file whose name is not a date is left alone."""
    cutoff_s = _cutoff_s(older_than_s, now_s)
    directory = as_datadir(root).serving_spool_dead
    try:
        names = sorted(p.name for p in directory.iterdir() if p.suffix == ".jsonl")
    except FileNotFoundError:
        return 0
    deleted = 0
    for name in names:
        try:
            day = datetime.strptime(name.removesuffix(".jsonl"), "%Y-%m-%d").replace(tzinfo=timezone.utc)
        except ValueError:
            continue
        if day.timestamp() + DAY_S > cutoff_s:
            continue
        if not dry_run:
            (directory / name).unlink(missing_ok=True)
        deleted += 1
    if deleted and not dry_run:
        fsync_dir(directory)
    return deleted


class PartlyDone(StorageError):
    """Some tenants' part of a retention step failed (each logged); `done` holds what the others did."""

    def __init__(self, message: str, done: dict[str, int]):
        super().__init__(message)
        self.done = done


def _per_tenant(what: str, tenants, run) -> dict[str, int]:
    """`run(tenant)` for each tenant, each on its own: one that fails (a disk or permission error, a damaged
    file) does not stop the others; PartlyDone at the end names the failed ones, with their errors."""
    done, failed = {}, []
    for t in tenants:
        try:
            done[t] = run(t)
        except Exception as e:  # noqa: BLE001 - a damaged file raises pyarrow's own errors, not only OSError
            logger.debug("retention: %s of tenant %s failed", what, t, exc_info=True)
            failed.append(f"{t} ({type(e).__name__}: {e})")
    if failed:
        raise PartlyDone(f"{what} failed for {', '.join(failed)}", done)
    return done


def prune_registry(root, *, older_than_s: float, tenant: str | None = None, dry_run: bool = False,
                   now_s: float | None = None) -> dict[str, int]:
    """tenant -> how many settled adapter-version records (retired or rejected, files gone) last written
    before the cutoff were (or, with dry_run, would be) deleted (Registry.prune): a tenant's learner makes
    one per step, tens of thousands a day in one directory. A tenant that fails does not stop the others
    (PartlyDone)."""
    from storage.registry import Registry

    before_s = _cutoff_s(older_than_s, now_s)
    registry = Registry(root)
    return _per_tenant("pruning adapter records", [tenant] if tenant else registry.tenants(),
                       lambda t: registry.prune(t, before_s=before_s, dry_run=dry_run))


def forget_trained(root, *, older_than_s: float, tenant: str | None = None, dry_run: bool = False,
                   now_s: float | None = None) -> dict[str, int]:
    """tenant -> how many trained ids its learner cursor forgot (or, with dry_run, would): the steps committed
    before the cutoff, whose trajectories were all ingested before it (Cursors.forget). A tenant that fails
    (an unreadable cursor, a disk error) does not stop the others (PartlyDone)."""
    from storage.cursors import Cursors

    cutoff_ms = round(_cutoff_s(older_than_s, now_s) * 1000)
    cursors = Cursors(root)
    return _per_tenant("forgetting trained ids", [tenant] if tenant else cursors.tenants(),
                       lambda t: cursors.forget(t, cutoff_ms, dry_run=dry_run))


def prune_partition(root, dataset: str, tenant: str, cutoff_ms: int, *, dry_run: bool = False) -> PruneResult:
    dd = as_datadir(root)
    result = PruneResult(dataset, tenant)
    try:
        # A dry run only reads: no lock (taking one would create its file), so it counts while a compaction runs.
        with nullcontext() if dry_run else partition_lock(dd, dataset, tenant):
            listing = partition_listing(dd, dataset, tenant)
            superseded = listing.superseded
            doomed, unreadable = [], []
            partition = str(dd.partition(dataset, tenant))
            known, dated = _dated.get(partition, {}), {}
            _dated[partition] = dated  # a run that fails midway keeps what it dated
            for info in listing.on_disk:
                key = file_key(info)
                try:
                    newest, rows = dated[key] = known[key] if key in known else newest_ms(dd, info.path)
                except FileNotFoundError:
                    continue
                except Exception as e:  # noqa: BLE001 (one unreadable file must not stop the partition's retention)
                    unreadable.append((info, e))
                    continue
                if newest is None or newest < cutoff_ms:
                    doomed.append(info)
                    if info.base_name not in superseded:  # a superseded file's rows are counted in its successor
                        result.files, result.rows = result.files + 1, result.rows + rows
                    result.bytes += info.size
            # A superseded file goes with the file holding its rows now, whatever its own footer says: left on
            # disk, it would be live again once that file is gone (and an unreadable one would fail every read).
            going = {i.base_name for i in doomed}
            with_successor = [i for i in listing.on_disk if i.base_name not in going
                              and i.base_name in superseded and superseded[i.base_name].by in going]
            doomed += with_successor
            result.bytes += sum(i.size for i in with_successor)
            going.update(i.base_name for i in with_successor)
            for info, e in unreadable:
                if info.base_name not in going:
                    logger.warning("retention: %s is unreadable, left alone: %s: %s", info.path, type(e).__name__, e)
                    result.unreadable += 1
            if not dry_run and doomed:
                # Superseded inputs first, made durable before their compacted successor goes: were the
                # successor's deletion on disk and not theirs after a crash, they would be live again.
                directory = dd.partition(dataset, tenant)
                for inputs in (True, False):
                    for info in doomed:
                        if (info.base_name in superseded) == inputs:
                            Path(info.path).unlink(missing_ok=True)
                    fsync_dir(directory)
    except LockBusy:
        result.skipped = "a compaction holds this partition"
    except Exception as e:  # noqa: BLE001 (one partition must not stop the others' retention; what went stands)
        logger.debug("retention: pruning %s/tenant=%s failed", dataset, tenant, exc_info=True)
        result.error = f"{type(e).__name__}: {e}"
    logger.debug("pruned %s", result)  # the caller reports it (`clora prune` prints each result that did something)
    return result
