"""The learner's loop: pick a tenant, train it one step on its new data, gate, publish or reject, commit.

    while not stopped:
        backlog  = untrained trajectories per tenant             (storage.cursors; tenants with 0 are skipped)
        tenant   = scheduler.choose(backlog)                      (scheduler.py)
        step(tenant):
            finish what a crash interrupted                      (see "Crash safety")
            follow the registry if an operator rolled back        (the adapter becomes the published one)
            work     = logs: oldest untrained trajectories | rollouts: prompts + sampled groups
            parent   = snapshot of adapter + optimizer; probe reward of the parent (gate.py)
            update   = one importance-weighted policy-gradient step (logs_mode.py / rollouts.py -> update.py)
            decision = gate(update, rewards, probe reward)        (gate.py)
            Registry.create(candidate)        -> version n ("candidate", never served)
            reject? restore parent adapter + optimizer
            Cursors.commit(step, ids, checkpoint = adapter + optimizer + learner.json)   <- the commit point
            Registry.publish(n) | Registry.reject(n, reason)
            train_steps row

Crash safety (SIGKILL at any instant; nothing is trained twice or skipped):
- Before the commit nothing durable says the batch was trained: a restart loads the previous checkpoint
  and trains the same untrained trajectories again. A candidate version created before the crash is
  referenced by no checkpoint; at start (`Learner.recover`) the learner rejects it as "abandoned"
  (candidates are never served). One left by a `Registry.create` that raised after writing its record (an
  error, not a kill) is rejected at once.
- The commit writes the trajectory ids, the adapter, the optimizer state and `learner.json` in one atomic
  rename (storage.cursors). `learner.json` records what must follow: which version to publish or reject
  and the train_steps row.
- After the commit, a restart finds that record (at start, for every tenant, whether or not it has new
  data) and completes it: publish or reject the version if it is still a candidate, write the row if it
  is missing (rows are files named by step, written only once).
So every committed step's ids are in exactly one step directory, the adapter the learner continues from
is the one the registry publishes, and publishing is at-least-once but idempotent. Publishing after the
commit (not before) matters: a version published before its commit could be served and then, after a
crash, retrained from its parent, serving one batch's effect twice in two lineages.

Errors are per tenant: a step that raises is logged with its traceback, the tenant's status records it
(also in <data_dir>/state/learner/status.json), its in-memory adapter and optimizer go back to the state
before the step, and it is retried after a growing back-off; other tenants go on. So is a tenant whose lock
file cannot be made (a full disk, a locks folder this user cannot write). A backlog that cannot be read
(one tenant's unreadable file, or the trajectories folder that cannot be listed) leaves those tenants'
logs out, with the reason as their error, until it can be read.

Tenants: the config's tenants plus any tenant that has trajectories in storage (ingest may create tenants
on the fly; those get the config's defaults). Both are looked at on every pass, and the config file is
re-read every few seconds when the caller passes `reload`, so new tenants need no restart; a tenant removed
from it is what a restart would make it: one storage holds data of gets the defaults, another is let go. A
tenant's adapter is only created when it first has work. Several learner processes may share one data directory:
each trains its shard's tenants (`Shard`, `clora learn --shard K/N`), and a process trains a tenant only
while it holds that tenant's lock (`Learner._claim`), so no two processes ever step one tenant.

Rounds (`learner.round_tenants`): the scheduler's pick steps together with up to round_tenants - 1 other
ready tenants that have a gate probe and nothing to wait for (`round_partners`). A step is a generator that
yields twice: `Collected` once it has taken its work, then a `ProbeRequest` for its candidate's probe.
`step_round` first has every step of the round take its work (so the next batches that sample-ahead asks
for reach the serving engine together and are decoded as one multi-LoRA batch; asked for as each step's
training ended, they reached it one tenant at a time and the engine decoded them one after another), then
runs each step in turn up to its probe, decodes every request in one grouped batch
(`gate.probe_rewards_grouped`: the base weights multiplied once for every tenant's rows), and hands each
step its `ProbeAnswer` to gate, commit and publish in turn. Nothing else changes: each tenant's adapter,
optimizer and commit are its own, so a round trains and decides what the same steps one at a time would
(tested); a tenant's publish waits for the others' training. The wait is left out of the step's time (its `seconds`, timings and scheduler charge).

Overlap (rollouts tenants, serving sampler): every ready tenant's next batch is being sampled in the
serving engine while the learner trains another tenant (`prefetch`), and with `learner.sample_ahead` a
prompts-file tenant's step k+1 is sampled while its own step k trains (see `_start_prefetch`). A batch
whose every sample is too stale by the time its step takes it is sampled again at once; a step with no
usable sample at all fails (rollouts.NoUsableSamples) and commits nothing. A stop (`run`'s `stop` event)
ends a step still waiting for its rollouts at once, committing nothing (rollouts.Stopped); a step past
that wait is finished first. Each step's `StepRecord` says where its time went (`timings`, phases in
`PHASES`) and how many versions its oldest sample was behind (`staleness`); `run(on_step=...)` hands every
record to the caller.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from clora.config import Config, ConfigRereads
from learner import gate, logs_mode, rollouts
from learner.policy import (
    ADAPTER_WEIGHTS,
    DamagedFile,
    Policy,
    PolicyError,
    missing_checkpoint_files,
    read_adapter_shape,
)
from learner.metrics import LearnerMetrics
from learner.rollouts import LocalSampler, Prefetcher, RolloutPlan, SampleRequest, Sampler, ServingSampler
from learner.rollouts import SampledBatch
from learner.scheduler import Ledger, after_round, charge, choose
from learner.types import Shard, TenantSpec, learner_process_name
from learner.update import UpdateResult
from storage.cursors import KEEP_DAMAGED, CursorError, Cursors
from storage.files import FileLock, HeldLock, atomic_write_bytes, clear_ready, mark_ready
from storage.layout import DataDir, StorageError
from storage.parquet import column_max, partition_tenants, write_dataset
from storage.registry import RETIRED_BY_HAND, Registry, RegistryError, UnreadableRecord, VersionNotFound
from storage.schema import TRAIN_STEPS, TRAJECTORIES

logger = logging.getLogger(__name__)

CHECKPOINT_META = "learner.json"
CHECKPOINT_FORMAT = 1
CONFIG_RELOAD_SECONDS = 5.0
BACKOFF_SECONDS = (5.0, 15.0, 60.0, 300.0)
# Tries of the same rollout prompts whose every sample fails scoring before the step is committed as skipped:
# one per back-off (5 + 15 + 60 + 300 s), so a scorer's dependency down for minutes costs no batch, while a
# prompt the scorer cannot handle does not hold the tenant up for good.
UNSCORABLE_TRIES = len(BACKOFF_SECONDS) + 1
COMPACT_EVERY_STEPS = 100
MAX_REMEMBERED_ROLLOUTS = 100_000  # rollout interaction ids awaiting ingest; older ones are forgotten
SERVED_KEPT = 1024  # served version numbers a tenant remembers for staleness (at least max_staleness + 2)
ABANDONED = "abandoned: the learner stopped before committing the step that made it"
BACKLOG_UNREADABLE = "backlog unreadable: "  # the error of a tenant whose backlog cannot be read (cleared once it can)
LOCK_FAILED = "cannot take the tenant's lock: "  # the error of a tenant whose lock cannot be made (cleared once it can)


class LearnerError(RuntimeError):
    """A tenant cannot be trained as configured (the message names the tenant and the setting)."""


# ---------------------------------------------------------------------------------------------------------
# Per-tenant state and step results


# Learner settings read once, when the learner starts (its sampler, its device, how many shards `clora up`
# starts): a config re-read that changes them only says so.
RESTART_SETTINGS = ("rollout_sampler", "serving_url", "device", "processes", "metrics_port", "metrics_host")


@dataclass
class TenantRuntime:
    spec: TenantSpec  # as applied: the adapter's shape is the saved adapter's (Policy.update_spec)
    given: TenantSpec | None = None  # as the config (or the defaults) last gave it
    loaded: bool = False  # adapter created and restored from its checkpoint
    step: int = 0  # last committed step
    version: int = 0  # the registry version the adapter equals (0: none yet)
    served: list[int] = field(default_factory=list)  # numbers of its published (or since retired) versions: staleness
    withdrawn: frozenset[int] = frozenset()  # of those, the ones an operator retired: their samples are never trained
    served_read: bool = False  # `served` read from the registry since the tenant was taken; no step trains before
    state_id: int = 0  # bumped whenever the adapter weights change (keys the probe-reward cache)
    baseline: float | None = None  # running mean reward (logs mode)
    probes: tuple[str, ...] = ()
    probe_cache: dict = field(default_factory=dict)  # Learner._probe_key -> reward per probe prompt
    round_wait: float = 0.0  # seconds the step in progress waited for the other tenants of its round
    unfinished: dict | None = None  # learner.json of a committed step whose publish/row is not done yet
    rollout_ids: dict = field(default_factory=dict)  # ids of logged rollout interactions not seen in storage yet (ordered)
    status: str = "idle"
    error: str | None = None
    failures: int = 0
    retry_at: float = 0.0
    partial_since: float | None = None  # logs mode: when a backlog below batch_size was first seen
    unscorable: tuple[tuple[str, ...], int] = ((), 0)  # rollouts: (prompts, tries) whose every sample failed scoring
    probe_failures: int = 0  # steps in a row that failed because the scorer failed on a gate probe
    probe_unscored: bool = False  # this step left a probe prompt unscored (gate.LeaveUnscored)
    last: dict = field(default_factory=dict)  # the last train_steps row
    used_at: float = 0.0  # monotonic time its adapter was last loaded or stepped (learner.max_resident_tenants)
    committed_state: int = -1  # the state_id its last committed checkpoint holds (-1: none this process wrote)
    unloaded: tuple[int, bool] | None = None  # (step, weights were the checkpoint's) when `_unload` freed it
    set_aside: list[str] = field(default_factory=list)  # damaged checkpoints this process set aside (status.json)


@dataclass(frozen=True)
class StepRecord:
    tenant: str
    step: int
    decision: str  # "published" | "rejected" | "skipped" (nothing to learn from; ids still committed)
    version: str | None  # the version the step created
    reason: str | None
    row: dict
    timings: dict = field(default_factory=dict)  # seconds per phase of the step (see `PHASES`)
    rewards: tuple[float, ...] = ()  # the rewards the step trained on
    staleness: int | None = None  # rollouts: most versions any trained sample was behind the adapter


# Where a step's time goes (`StepRecord.timings`): the learner's own phases, which add up to "total", plus
# "sampling", the sampler's time for the step's rollouts (it ran in the background, overlapping other work,
# and only "wait" of it held up this step).
PHASES = ("wait", "score", "train", "probe", "publish", "other")


@dataclass(frozen=True)
class _Work:
    """What a step trains on, before training."""

    ids: tuple[str, ...]  # every trajectory id the step commits
    prompts: tuple[str, ...]  # prompts seen (for the gate's probe set)
    trajectory_range: dict
    logs: list | None = None  # logs mode: Examples
    dropped: int = 0
    plan: RolloutPlan | None = None  # rollouts mode
    samples: list | None = None
    sampling_seconds: float | None = None  # rollouts mode: the sampler's time for `samples`


@dataclass(frozen=True)
class Collected:
    """A step's word that it has taken its work (with sample-ahead, also asked for its next batch) and is
    about to train. A round takes every tenant's work before it trains any, so the batches sampled ahead
    reach the serving engine together and are decoded in one multi-LoRA batch, not one tenant after another
    as each step's training ends."""

    tenant: str


@dataclass(frozen=True)
class ProbeRequest:
    """A step's request for its candidate's gate probe. Steps are generators that yield one (at most, after
    their `Collected`) and carry on with its `ProbeAnswer`, so a round can decode the probes of all its
    tenants together."""

    tenant: str
    prompts: tuple[str, ...]
    scorer: Callable[[str, str], float]


@dataclass(frozen=True)
class ProbeAnswer:
    rewards: tuple[float, ...]  # gate.probe_rewards of the request
    seconds: float  # the request's share of the decode's time


@dataclass(frozen=True)
class _Trained:
    """What the update did (update None: nothing to learn from, e.g. equal rewards in every group)."""

    update: UpdateResult | None
    rewards: tuple[float, ...]
    reward_mean: float
    n_trained: int
    n_dropped: int
    baseline: float | None  # the running mean reward after this batch
    score_seconds: float = 0.0
    n_score_failed: int = 0  # rollouts: samples the scorer failed on (not in n_dropped)


# ---------------------------------------------------------------------------------------------------------
# The learner


class Learner:
    """Owns the policy, the registry and cursor handles, and every tenant's runtime state."""

    def __init__(self, cfg: Config, *, model_path: Path, policy: Policy | None = None, sampler: Sampler | None = None,
                 progress: bool = True, shard: Shard | None = None, bars: bool = True,
                 metrics: LearnerMetrics | None = None):
        self.dd = DataDir(cfg.data_dir)
        self.shard = shard
        self.process_name = learner_process_name(shard)  # readiness marker
        self._locks: dict[str, HeldLock] = {}  # the tenants this process trains now (see `_claim`)
        self._dealt: dict[str, int] = {}  # the shard of each of the config's tenants (Shard.deal)
        self.registry = Registry(self.dd, keep_last=cfg.learner.keep_versions)
        self.cursors = Cursors(self.dd)
        self.policy = policy or Policy(model_path, device=cfg.learner.device, seed=cfg.model.seed)
        if sampler is None:
            if cfg.learner.rollout_sampler == "local":
                sampler = LocalSampler(self.policy)
            else:
                sampler = ServingSampler(cfg.learner.serving_url or cfg.serving.local_url,
                                         priority=cfg.learner.rollout_priority)
        self.sampler = sampler
        self.prefetcher = Prefetcher(sampler) if sampler.background else None
        self.stop = threading.Event()  # set: a wait for samples gives up, its step committing nothing (`run` sets it)
        self.progress = progress  # a report per step: a progress bar per tenant (`bars`, on a terminal) or a log line
        self.bars = bars
        self.tenants: dict[str, TenantRuntime] = {}
        self._bars: dict[str, object] = {}
        self._status_failing = False  # the status file could not be written (logged once until it can)
        self._listing_error: str | None = None  # why the trajectories could not be listed (logged once until they can)
        self._prompts_cache: dict[str, tuple[tuple | None, list[str]]] = {}  # tenant -> (file identity, rendered)
        self._few_probes: set[str] = set()  # tenants told their gate probes are fewer for long prompts
        self._base_shapes: dict | None = None  # the base model's linear layers, for _check_servable
        self._servable: set[tuple] = set()  # (tenant, adapter shape) that passed _check_servable
        self._stepping: set[str] = set()  # tenants with a step in progress: never unloaded (`_make_room`)
        self._round: set[str] = set()  # the tenants of the round in progress: nor these
        self.ledger = Ledger()
        self.metrics = metrics if metrics is not None else LearnerMetrics()  # no endpoint unless given one
        self.apply_config(cfg)
        self.recover()

    # --- configuration and discovery ------------------------------------------------------------------
    def apply_config(self, cfg: Config) -> None:
        """Takes the learner settings and tenants of `cfg`; existing tenants keep their adapters. A tenant
        that left the config gets what a restart would give it (`_left_config`). Settings read only at start
        (RESTART_SETTINGS) are logged when they change; the rest apply from the next step."""
        before = getattr(self, "settings", None)
        self.settings = cfg.learner
        self.registry.keep_last = cfg.learner.keep_versions
        if isinstance(self.sampler, ServingSampler):
            self.sampler.priority = cfg.learner.rollout_priority  # from the next request
        if before is not None:
            if self.prefetcher is not None and (before.temperature, before.max_new_tokens) != (
                    cfg.learner.temperature, cfg.learner.max_new_tokens):
                for name in self.tenants:  # sampled under the old settings, it would train as if under the new
                    self.prefetcher.discard(name)
            changed = [k for k in RESTART_SETTINGS if getattr(before, k) != getattr(cfg.learner, k)]
            if changed:
                logger.warning("learner.%s changed in the config: takes effect when the learner starts again",
                               ", learner.".join(changed))
        if before is None:  # serving reads them only when it starts: a rollout prompt past its context is refused
            self.max_len = cfg.serving.max_model_len
            self.max_lora_rank = cfg.serving.max_lora_rank
        self.scheduler = cfg.learner.scheduler
        self.limits = gate.GateLimits(
            max_kl=cfg.learner.gate_max_kl,
            reward_tolerance=cfg.learner.gate_reward_tolerance,
            reward_z=cfg.learner.gate_reward_z,
            max_abs_reward=cfg.learner.gate_max_abs_reward,
        )
        self._dealt = self.shard.deal(t.name for t in cfg.tenants) if self.shard is not None else {}
        for t in cfg.tenants:
            if self._owns(t.name):
                self._set_spec(TenantSpec.from_config(t))
        for name in [n for n in self.tenants if not self._owns(n)]:  # a reload dealt it to another shard
            logger.info("tenant %s: now another learner shard's", name)
            self._let_go(name)
        configured = {t.name for t in cfg.tenants}
        for name in [n for n, rt in self.tenants.items() if rt.spec.configured and n not in configured]:
            self._left_config(name)

    def _owns(self, name: str) -> bool:
        return self.shard is None or self.shard.owns(name, self._dealt)

    def _claim(self, rt: TenantRuntime) -> bool:
        """Whether this process trains `rt` now: it holds the tenant's lock (<data_dir>/locks/learner/), taking
        it if free. Taking it completes the tenant's interrupted step (`_recover`) and, if this process held it
        before, reloads the adapter from the last checkpoint (another process may have trained it since). A
        lock held elsewhere leaves the tenant to that process; this one tries again on every pass, so a
        second unsharded learner is a standby that takes over the tenants of one that stops."""
        name = rt.spec.name
        if name in self._locks:
            return True
        if rt.retry_at > time.monotonic():  # its lock could not be taken: backing off
            return False
        path = self.dd.locks / "learner" / f"{name}.lock"
        try:
            lock = HeldLock.try_acquire(path)
        except OSError as e:  # a full disk, a locks folder this user cannot write: this tenant waits, the others go on
            logger.error("tenant %s: cannot take its lock %s: %s", name, path, e)
            self._back_off(rt, f"{LOCK_FAILED}{type(e).__name__}: {e}")
            self.metrics.cannot_train(name, rt.failures)
            self._save_status()
            return False
        if lock is None:
            if rt.status != "elsewhere":
                logger.info("tenant %s: trained by another learner process; waiting for it to let go", name)
                rt.status = "elsewhere"
            return False
        self._locks[name] = lock
        if rt.status == "elsewhere":
            rt.status = "idle"
        if rt.error is not None and rt.error.startswith(LOCK_FAILED):
            rt.status, rt.error, rt.failures = "idle", None, 0
        rt.loaded, rt.served_read = False, False
        self._recover(rt)
        return True

    def _load_served(self, rt: TenantRuntime) -> None:
        """The newest served versions, read newest first until there are as many as staleness can count:
        a start or takeover reads that many records (and the rejected ones between), not the whole history
        (one version per step, for ever)."""
        tenant, keep, served, withdrawn = rt.spec.name, self._served_kept(), [], set()
        for number in reversed(self.registry.numbers(tenant)):
            try:
                v = self.registry.get(tenant, number)
                was_served = v.published_at is not None
                if v.status == "retired" and v.reason == RETIRED_BY_HAND:
                    withdrawn.add(number)
            except VersionNotFound:  # deleted since the listing (retention)
                continue
            except UnreadableRecord as e:  # counted as served: samples look staler, never fresher, than they are
                logger.warning("tenant %s: %s; staleness counts %s@%d as served", tenant, e, tenant, number)
                was_served = True
            if was_served:
                served.append(number)
                if len(served) >= keep:
                    break
        rt.served, rt.withdrawn, rt.served_read = served[::-1], frozenset(withdrawn), True

    def _served_kept(self) -> int:
        return max(SERVED_KEPT, self.settings.max_staleness + 2)

    def _trim_served(self, rt: TenantRuntime) -> None:
        """Keeps the newest served versions staleness can count (one per published step would grow for
        ever); a sample older than all of them is behind by more than max_staleness either way."""
        del rt.served[:-self._served_kept()]

    def _left_config(self, name: str) -> None:
        """A tenant a config reload removed gets what a restart would give it: while storage holds anything
        of it (trajectories, a cursor, versions: what `recover` and `pending` find), the config's defaults,
        as a tenant ingest created has (logs mode, no prompts file, no api key); otherwise it is let go. A
        prompts-file tenant kept its spec and went on sampling with an api key serving no longer knew."""
        try:
            in_storage = (name in self.registry.tenants() or name in self.cursors.tenants()
                          or name in partition_tenants(self.dd, "trajectories"))
        except OSError as e:  # cannot tell: kept, as a tenant with data (with no backlog it costs nothing)
            logger.warning("tenant %s: cannot tell whether storage holds anything of it: %s", name, e)
            in_storage = True
        if in_storage:
            logger.info("tenant %s: no longer in the config; it goes on with the config's defaults (storage "
                        "holds its data)", name)
            self._prompts_cache.pop(name, None)
            self._set_spec(TenantSpec.default(name))
        else:
            logger.info("tenant %s: no longer in the config, and storage holds nothing of it: let go", name)
            self._let_go(name)

    def _let_go(self, name: str) -> None:
        """Lets go of a tenant (another shard's now, or gone from the config) and frees its adapter and
        optimizer (everything about it is in its last checkpoint, which its next owner loads)."""
        if self.prefetcher is not None:
            self.prefetcher.discard(name)
        if self.policy.has(name):
            self.policy.remove_tenant(name)
        self.metrics.forget(name)
        lock = self._locks.pop(name, None)
        if lock is not None:
            lock.release()
        self.tenants.pop(name, None)
        self._prompts_cache.pop(name, None)
        bar = self._bars.pop(name, None)
        if bar is not None:
            bar.close()

    def _set_spec(self, spec: TenantSpec) -> None:
        rt = self.tenants.get(spec.name)
        if rt is None:
            self.tenants[spec.name] = TenantRuntime(spec=spec, given=spec)
            logger.info("tenant %s: %s mode, scorer %s%s", spec.name, spec.mode, spec.scorer, "" if spec.configured else " (not in the config: defaults)")
            return
        # Compared with what was given last, not with what applies: a shape the saved adapter overrides (or
        # lists in another order) would differ on every re-read, dropping the batch sampled ahead each time.
        if spec == rt.given:
            return
        rt.given = spec
        if self.prefetcher is not None:  # a job planned under the old spec (mode, prompts, group size)
            self.prefetcher.discard(spec.name)
        if rt.loaded:
            self.policy.update_spec(spec)
            spec = self.policy.spec(spec.name)
        rt.spec = spec

    def pending(self, *, hold_partial: bool = True) -> dict[str, int]:
        """tenant -> pending work (untrained trajectories; a rollouts tenant with a prompts file always has a
        batch), for every tenant not backing off after a failure. New tenants in storage are picked up here.

        With `hold_partial`, a logs-mode backlog below the tenant's batch_size counts as 0 until it has
        been seen for `learner.batch_wait_seconds`: a step on one or two trajectories with sparse rewards
        is mostly noise, which Adam turns into a full-size step all the same."""
        try:
            backlog, unreadable_by_tenant = self.cursors.backlog(include=self._owns), self.cursors.backlog_errors
            if self._listing_error is not None:
                logger.info("the trajectories can be listed again")
            self._listing_error = None
        except (OSError, StorageError) as e:  # the folder listing itself: every tenant's backlog is unknown
            error = f"{type(e).__name__}: {e}"
            if error != self._listing_error:
                logger.error("cannot list the trajectories; no tenant's backlog is known until it can: %s", error)
            self._listing_error = error
            backlog, unreadable_by_tenant = {}, dict.fromkeys(self.tenants, error)
        for name in [*backlog, *unreadable_by_tenant]:
            if name not in self.tenants and self._owns(name):
                self._set_spec(TenantSpec.default(name))
        now = time.monotonic()
        wait = self.settings.batch_wait_seconds
        out, untrained = {}, {}
        changed = False  # a tenant's backlog became unreadable, or readable again: said in status.json at once
        for name, rt in self.tenants.items():
            if not self._claim(rt):
                out[name] = 0
                continue
            unreadable = unreadable_by_tenant.get(name)
            untrained[name] = None if unreadable is not None else backlog.get(name, 0)
            if unreadable is not None:  # left out until it can be read; the other tenants go on
                changed |= rt.error != BACKLOG_UNREADABLE + unreadable
                rt.status, rt.error = "error", BACKLOG_UNREADABLE + unreadable
            elif rt.error is not None and rt.error.startswith(BACKLOG_UNREADABLE):
                rt.status, rt.error = "idle", None
                changed = True
            n = backlog.get(name, 0)
            if rt.spec.mode == "rollouts" and rt.spec.prompts_file is not None:
                n = max(n, rt.spec.batch_size)
            if rt.spec.mode == "logs":
                if n == 0 or n >= rt.spec.batch_size:
                    rt.partial_since = None
                else:
                    rt.partial_since = rt.partial_since if rt.partial_since is not None else now
                    if hold_partial and now - rt.partial_since < wait:
                        n = 0
            out[name] = n if rt.retry_at <= now else 0
        if changed:
            self._save_status()
        self.metrics.backlog(untrained, len(self.policy.tenants),
                             {name: rt.status == "error" for name, rt in self.tenants.items() if self._owns(name)})
        return out

    def still_sampling(self, backlog: dict[str, int]) -> set[str]:
        """The ready tenants whose prefetched rollouts are still being sampled."""
        if self.prefetcher is None:
            return set()
        return {name for name, n in backlog.items() if n > 0 and self.prefetcher.busy(name)}

    def choose(self, backlog: dict[str, int], exclude=()) -> str | None:
        name, self.ledger = choose(self.scheduler, backlog, self.ledger, exclude=exclude)
        return name

    # --- one step, with per-tenant error handling -----------------------------------------------------
    def round_partners(self, first: str, backlog: dict[str, int], exclude=()) -> list[str]:
        """The tenants that take their steps in one round with the scheduler's pick `first` (module note,
        "Rounds"): up to learner.round_tenants - 1 more, picked by the scheduler among the ready tenants that
        have a gate probe to batch and nothing to wait for (a rollouts tenant's batch already sampled)."""
        if self.settings.round_tenants < 2 or self.settings.gate_prompts < 1:
            return []
        from ingest.scorers import is_function

        skip = set(exclude) | {first}
        eligible = {}
        for name, n in backlog.items():
            rt = self.tenants[name]
            if n <= 0 or name in skip or not is_function(rt.spec.scorer):
                continue
            if rt.spec.mode == "rollouts" and self.prefetcher is not None and (
                not self.prefetcher.pending(name) or self.prefetcher.busy(name)
            ):
                continue
            eligible[name] = n
        partners = []
        floor = self.ledger.floor  # fair_share's, from the ready tenants of the main pick (not the partners' fewer)
        while len(partners) < self.settings.round_tenants - 1:
            name = self.choose(eligible, exclude=partners)
            self.ledger = replace(self.ledger, floor=floor)
            if name is None:
                break
            partners.append(name)
        self.ledger = after_round(self.ledger, backlog, [first, *partners])
        return partners

    def step_safely(self, name: str) -> StepRecord | None:
        """One step of tenant `name`; an error is the tenant's (logged, recorded, backed off), not raised."""
        return self.step_round([name])[0]

    def step_round(self, names) -> list[StepRecord | None]:
        """One step of each of `names` as one round: each step runs in turn up to its gate probe, the probes
        are greedy-decoded in one batch, then each step finishes in turn. Errors are per tenant, as in
        `step_safely`; the records come in the order of `names`."""
        steps = {name: self._step_safely(name) for name in names}
        records: dict[str, StepRecord | None] = {}
        self._round = set(names)  # loaded one after another: none unloads a partner not started yet
        try:
            asked = self._advance(steps, dict.fromkeys(names), records)
            while asked:
                collected = [name for name, request in asked.items() if isinstance(request, Collected)]
                if collected:  # every step of the round has taken its work: now each trains in turn
                    asked = {name: r for name, r in asked.items() if name not in collected}
                    for name in collected:
                        if self.stop.is_set():
                            # Stopping: the steps trained so far finish (probe, gate, commit); the others
                            # leave their work, uncommitted, for the next start. Training the whole round
                            # first could outlast the stop's time limit and lose every step of it.
                            steps[name].close()  # restores its parent
                            records[name] = None
                            continue
                        asked.update(self._advance(steps, {name: None}, records))
                    continue
                requests = list(asked.values())
                answers = dict(zip(asked, self._probe(requests)))
                asked = self._advance(steps, answers, records)
        finally:
            self._round = set()
            for gen in steps.values():
                gen.close()  # only if something above raised: a step left mid-way restores its parent
        return [records.get(name) for name in names]

    @staticmethod
    def _advance(steps: dict, answers: dict, records: dict) -> dict[str, Collected | ProbeRequest]:
        """Runs each step in `answers` with its answer (None to start or go on; an exception is raised in it)
        until it has collected its work or asks for a probe (returned, by tenant) or ends (its record into
        `records`)."""
        asked = {}
        for name, answer in answers.items():
            try:
                if isinstance(answer, BaseException):
                    asked[name] = steps[name].throw(answer)
                else:
                    asked[name] = steps[name].send(answer)
            except StopIteration as done:
                records[name] = done.value
        return asked

    def _probe(self, requests: list[ProbeRequest]) -> list[ProbeAnswer | Exception]:
        """The answer to each request: all of them decoded in one grouped batch (one request alike, so a
        probe scores the same alone and in a round); if that fails, one at a time by `generate`, each
        failure then going to its own step. A tenant whose scorer failed on its probe gets that error
        (gate.ProbeScoringFailed), which fails its step: a reward of 0 would read as a fall (gate.py)."""
        started = time.monotonic()
        try:
            rewards = gate.probe_rewards_grouped(self.policy, [(r.tenant, r.prompts, r.scorer) for r in requests],
                                                 max_new_tokens=self.settings.max_new_tokens)
        except Exception:
            logger.warning("the gate probes of %s failed as one grouped batch; probing them one at a time",
                           ", ".join(r.tenant for r in requests), exc_info=True)
            return [self._probe_alone(r) for r in requests]
        share = (time.monotonic() - started) / len(requests)
        return [r if isinstance(r, Exception) else ProbeAnswer(rewards=tuple(r), seconds=share) for r in rewards]

    def _probe_alone(self, r: ProbeRequest) -> ProbeAnswer | Exception:
        started = time.monotonic()
        try:
            rewards = gate.probe_rewards(self.policy, r.tenant, r.prompts, r.scorer, max_new_tokens=self.settings.max_new_tokens)
        except Exception as e:
            return e
        return ProbeAnswer(rewards=rewards, seconds=time.monotonic() - started)

    def _step_safely(self, name: str):
        """`step_safely` as a step generator (see `ProbeRequest`)."""
        rt = self.tenants[name]
        rt.partial_since = None  # what arrives during this step waits for a batch of its own
        rt.probe_unscored = False
        started = time.monotonic()
        try:
            record = yield from self._step(name)
        except rollouts.Stopped:  # the learner is stopping: the step gave up waiting for its samples
            logger.info("tenant %s: step %d stopped while its rollouts were sampled; nothing committed", name,
                        rt.step + 1)
            rt.status = "idle"
            record = None
        except Exception as e:  # one tenant's failure must not stop the others; the traceback is logged
            logger.exception("tenant %s: step %d failed", name, rt.step + 1)
            self._back_off(rt, f"{type(e).__name__}: {e}")
            rt.probe_failures = rt.probe_failures + 1 if isinstance(e, gate.ProbeScoringFailed) else 0
            if self.prefetcher is not None:
                self.prefetcher.discard(name)
            record = None
            self.metrics.failed(name, rt.failures)
        else:
            rt.failures, rt.error, rt.retry_at = 0, None, 0.0
            if record is not None:
                self.metrics.stepped(name, record.decision, version=rt.version,
                                     reward_mean=_num(record.row.get("reward_mean")), timings=record.timings,
                                     trained=int(record.row.get("n_trajectories") or 0),
                                     dropped=int(record.row.get("n_dropped") or 0))
            else:  # nothing to do: not a failure either
                self.metrics.no_failures(name)
            if not rt.probe_unscored:  # every probe scored: back to failing a step on one that does not
                rt.probe_failures = 0
        self.ledger = charge(self.ledger, name, max(0.0, time.monotonic() - started - rt.round_wait))
        self._report(rt)
        return record

    @staticmethod
    def _back_off(rt: TenantRuntime, error: str) -> None:
        """Records a failure of the tenant; it is left out of the backlog for a growing while."""
        rt.failures += 1
        rt.status, rt.error = "error", error
        rt.retry_at = time.monotonic() + BACKOFF_SECONDS[min(rt.failures, len(BACKOFF_SECONDS)) - 1]

    def step(self, name: str) -> StepRecord | None:
        """One training step of tenant `name` alone (see the module note); None when it had nothing to do.
        Raises what the step raised."""
        steps = self._step(name)
        try:
            request = next(steps)
            while True:
                if isinstance(request, Collected):
                    request = steps.send(None)
                    continue
                (answer,) = self._probe([request])
                request = steps.throw(answer) if isinstance(answer, BaseException) else steps.send(answer)
        except StopIteration as done:
            return done.value
        finally:
            steps.close()

    def _step(self, name: str):
        """`step` as a step generator (see `ProbeRequest`)."""
        rt = self.tenants[name]
        rt.round_wait = 0.0
        self._stepping.add(name)
        try:
            return (yield from self._step_loaded(rt))
        finally:
            self._stepping.discard(name)
            rt.used_at = time.monotonic()

    def _step_loaded(self, rt: TenantRuntime):
        name = rt.spec.name
        self._ensure_loaded(rt)
        if rt.unfinished is not None:
            self._finish(rt, rt.unfinished)
        if not rt.served_read:  # the recovery failed after its finish (or before): done again, or the step fails
            self._reject_abandoned(name)
            self._load_served(rt)
        clock = _Phases()
        self._follow_registry(rt)
        self._check_parent_kl(rt)
        started = time.monotonic()
        parent = self.policy.snapshot(name)
        try:
            meta, work, trained = yield from self._train_and_commit(rt, parent, started, clock)
        except BaseException:
            # Nothing was committed: put the in-memory adapter and optimizer back to the committed state.
            self.policy.restore(name, parent)
            raise
        if meta is None:
            rt.status = "idle"
            return None
        with clock("publish"):
            decision = self._finish(rt, meta)
            if decision != meta["decision"]:  # an operator's rollback superseded it: follow what is served now
                self._follow_registry_now(rt)
            if meta["step"] % COMPACT_EVERY_STEPS == 0:
                self._compact(name, meta["step"])
        self._start_prefetch(rt)
        rt.status = decision
        timings = clock.timings(total=time.monotonic() - started - rt.round_wait)
        if work.sampling_seconds is not None:
            timings["sampling"] = work.sampling_seconds
        return StepRecord(
            tenant=name,
            step=meta["step"],
            decision=decision,
            version=None if meta["created"] is None else f"{name}@{meta['created']}",
            reason=meta["reason"],
            row=meta["row"],
            timings=timings,
            rewards=trained.rewards,
            staleness=_staleness(work.samples, name, meta["row"]["version"], rt.served, self.settings.max_staleness),
        )

    def _compact(self, name: str, step: int) -> None:
        """Folds the tenant's step directories into a snapshot (storage.cursors). Housekeeping: the step is
        committed and published whether or not it works, and a failure is tried again COMPACT_EVERY_STEPS on."""
        try:
            self.cursors.compact(name)
        except Exception:
            logger.warning("tenant %s: compacting its cursor after step %d failed (the step stands; tried again at "
                           "step %d)", name, step, step + COMPACT_EVERY_STEPS, exc_info=True)

    def _train_and_commit(self, rt: TenantRuntime, parent, started: float, clock: _Phases):
        """Collect, train, gate, create the version, commit. Returns the step's learner.json, its work and
        what training did (None, None, None: no work)."""
        name = rt.spec.name
        rt.status = "training"
        with clock("wait"):
            work = self._collect(rt)
        if work is None:
            return None, None, None
        collected = time.monotonic()
        yield Collected(name)  # a round takes the others' work now (`Collected`); the wait is not this step's
        rt.round_wait += time.monotonic() - collected
        probe_room = self.max_len - self.settings.max_new_tokens  # a probe decodes its prompt, then this many
        too_long = []

        def probe_fits(prompt: str) -> bool:
            if logs_mode.fits(self.policy.tokenizer, prompt, probe_room):
                return True
            too_long.append(prompt)
            return False

        rt.probes = gate.update_probes(rt.probes, work.prompts, self.settings.gate_prompts, probe_fits)
        if too_long and len(rt.probes) < self.settings.gate_prompts and name not in self._few_probes:
            self._few_probes.add(name)  # said once per run
            logger.warning("tenant %r: %d gate probes of learner.gate_prompts %d: %d prompts seen are too long for "
                           "the context (%d tokens) to hold them and learner.max_new_tokens (%d)", name,
                           len(rt.probes), self.settings.gate_prompts, len(too_long), self.max_len,
                           self.settings.max_new_tokens)
        scorer = tenant_scorer(rt.spec)
        with clock("probe"):
            parent_probe = self._parent_probe(rt, scorer)
        with clock("train"):
            trained = self._update(rt, work, scorer)
        clock.move("train", "score", trained.score_seconds)
        update = trained.update

        step = rt.step + 1
        parent_name = f"{name}@{rt.version}" if rt.version else None
        row = {
            "tenant": name,
            "step": step,
            "version": parent_name,
            "mode": rt.spec.mode,
            "reward_mean": _num(trained.reward_mean),
            "loss": None if update is None else _num(update.loss),
            "kl": None if update is None else _num(update.kl),
            "clip_frac": None if update is None else _num(update.clip_frac),
            "tokens": 0 if update is None else update.tokens,
            "seconds": None,
            "n_trajectories": trained.n_trained,
            "ts": None,
            # Here as well as in the version's metrics: a step that makes no version (every sample stale, a
            # flat batch) has no metrics to hold them.
            "n_dropped": trained.n_dropped,
            "n_score_failed": trained.n_score_failed,
        }
        meta = {
            "format": CHECKPOINT_FORMAT,
            "tenant": name,
            "step": step,
            "version": rt.version,
            "baseline": trained.baseline,
            "probes": list(rt.probes),
            "created": None,
            "decision": "skipped",
            "reason": None,
            "gate": None,
            "row": row,
            "rollout_ids": _remember_rollouts(rt.rollout_ids, work),
        }
        probe = None
        if update is not None:
            if parent_probe is not None:
                probe = yield from self._candidate_probe(rt, scorer, clock)
            result = gate.decide(
                gate.GateInput(
                    loss=update.loss,
                    grad_norm=update.grad_norm,
                    weights_finite=self.policy.weights_finite(name),
                    kl=update.kl,
                    rewards=trained.rewards,
                    probe_rewards=probe,
                    parent_probe_rewards=parent_probe,
                ),
                self.limits if rt.spec.gate_max_kl is None else replace(self.limits, max_kl=rt.spec.gate_max_kl),
            )
            metrics = _metrics(trained, step, rt.spec.mode, probe, parent_probe)
            with clock("publish"):
                try:
                    created = self.registry.create(
                        name,
                        parent=parent_name,
                        write=lambda d: self.policy.save_adapter(name, d),
                        metrics=metrics,
                        trajectory_range=work.trajectory_range,
                    )
                except Exception as e:
                    # create may raise after the version's record is written (HEAD.json's rewrite failed): a
                    # candidate no commit will reference. This process holds the tenant's lock, so every
                    # candidate of the tenant is its own and none belongs to a step in progress.
                    try:
                        self._reject_abandoned(name, reason=f"its creation failed: {type(e).__name__}: {e}")
                    except Exception:  # never served all the same; rejected when a learner next takes the tenant
                        logger.exception("tenant %s: cannot reject what the failed create of step %d left", name, step)
                    raise
            meta.update(created=created.number, gate=result.checks, reason=result.reason or None)
            if result.passed:
                meta.update(decision="published", version=created.number)
            else:
                logger.warning("tenant %s: step %d rejected by the gate: %s", name, step, result.reason)
                meta.update(decision="rejected", baseline=rt.baseline)  # a poisoned batch must not move the baseline
                self.policy.restore(name, parent)
        row["seconds"] = time.monotonic() - started - rt.round_wait
        row["ts"] = datetime.now(timezone.utc).isoformat()

        try:
            with clock("publish"):
                self.cursors.commit(name, step=step, ids=list(work.ids), checkpoint=lambda d: self._write_checkpoint(name, d, meta))
        except Exception as e:
            # A CursorError is raised before the commit point: this process was behind its cursor (an earlier
            # failure left it so), and the step on disk with this number is another one, whose candidate (an
            # older version) that step publishes: only this attempt's candidate is rejected.
            behind = isinstance(e, CursorError)
            try:
                committed = not behind and self.cursors.latest_step(name) == step
            except Exception:  # cannot tell whether the commit point was passed: the disk decides, next step
                logger.exception("tenant %s: step %d's commit failed, and whether it was committed cannot be read",
                                 name, step)
                rt.loaded = False  # the next step reloads the last committed step and finishes it
                raise e from None
            if not committed:
                if meta["created"] is not None:  # nothing references the candidate: it must never be published
                    self._reject_own(name, meta["created"], f"its step's commit failed: {type(e).__name__}: {e}")
                if behind:
                    rt.loaded = False  # the next step starts from the cursor's last checkpoint
                raise
            # The commit point (the step directory's rename) was passed and what failed came after it: the
            # step is committed, and its candidate is the committed step's to publish or reject.
            logger.warning("tenant %s: step %d committed, but the commit raised after its commit point", name, step,
                           exc_info=True)
        # Committed: from here on the in-memory state is the checkpoint's.
        rt.step, rt.baseline, rt.unfinished = step, meta["baseline"], meta
        rt.rollout_ids = dict.fromkeys(meta["rollout_ids"])
        if meta["decision"] == "published":
            rt.version, rt.state_id = meta["version"], rt.state_id + 1
            rt.served.append(meta["version"])
            self._trim_served(rt)
            rt.probe_cache = {self._probe_key(rt): probe} if probe is not None and None not in probe else {}
        rt.committed_state = rt.state_id  # a rejected step's weights were put back to its parent's before the write
        return meta, work, trained

    # --- collecting work ------------------------------------------------------------------------------
    def _collect(self, rt: TenantRuntime) -> _Work | None:
        if rt.spec.mode == "logs":
            return self._collect_logs(rt)
        if rt.spec.mode == "rollouts":
            return self._collect_rollouts(rt)
        raise LearnerError(f"tenant {rt.spec.name!r}: unknown mode {rt.spec.mode!r}")

    def _collect_logs(self, rt: TenantRuntime) -> _Work | None:
        # Up to catch_up batches at once, so a learner behind its traffic catches up (logs_mode's note).
        rows = self.cursors.untrained(rt.spec.name, limit=rt.spec.batch_size * self.settings.catch_up)
        if rows.num_rows == 0:
            return None
        # The learner's own rollout samples (a tenant moved from rollouts to logs mode, or out of the config)
        # were trained when they were drawn: trained again here, they counted twice.
        own = {tid: "the learner's own rollout sample, trained when it was drawn"
               for tid, meta in zip(rows.column("id").to_pylist(), rows.column("metadata_json").to_pylist())
               if tid in rt.rollout_ids or rollouts.is_rollout_row(meta)}
        production = rows
        if own:
            production = rows.filter(pc.invert(pc.is_in(rows.column("id"), pa.array(list(own), pa.string()))))
        selection = logs_mode.select_fresh(production, rt.spec.name, rt.version, self.settings.max_staleness,
                                           rt.served, rt.withdrawn)
        examples, unusable = logs_mode.to_examples(selection.kept, self.policy.tokenizer, self.policy.vocab_size,
                                                   self.max_len)
        dropped = {**own, **selection.dropped, **unusable}
        if dropped:
            logger.info("tenant %s: %d of %d trajectories not trained (%s)", rt.spec.name, len(dropped), rows.num_rows, next(iter(dropped.values())))
        # Before training, not at the gate: there one such reward rejected the whole batch (logs_mode's note).
        examples, out_of_range = logs_mode.within_reward_range(examples, self.limits.max_abs_reward)
        if out_of_range:
            logger.warning("tenant %s: %d of %d trajectories not trained: their reward is out of range (%s)",
                           rt.spec.name, len(out_of_range), rows.num_rows, next(iter(out_of_range.values())))
            dropped.update(out_of_range)
        return _Work(
            ids=tuple(rows.column("id").to_pylist()),
            prompts=tuple(e.group for e in examples),
            trajectory_range=_trajectory_range(rows),
            logs=examples,
            dropped=len(dropped),
        )

    def _collect_rollouts(self, rt: TenantRuntime) -> _Work | None:
        tenant_scorer(rt.spec)  # fail early (and loudly) on a tenant that cannot do rollouts
        job: SampledBatch | None = None
        if self.prefetcher is not None:
            job = self.prefetcher.take(rt.spec.name, stop=self.stop)
        if job is not None and job.step != rt.step + 1:  # planned for another step (the tenant reloaded since)
            logger.info("tenant %s: sampled batch for step %d dropped at step %d", rt.spec.name, job.step, rt.step + 1)
            job = None
        if job is not None:
            # Sampled ahead by the version before the newest, and versions moved on meanwhile (serving still
            # had an older one, an operator's publish): a batch too stale to train is sampled again now rather
            # than failing the step (train_step raises when nothing is left).
            stale = rollouts.all_stale(job.samples, rt.spec.name, rt.version, self.settings.max_staleness, rt.served,
                                       temperature=self.settings.temperature,
                                       version_files=lambda number: self._version_files(rt.spec.name, number),
                                       withdrawn=rt.withdrawn)
            if stale is not None:
                logger.info("tenant %s: sampled batch for step %d too stale (%s); sampling it again", rt.spec.name,
                            job.step, stale)
                job = None
        seconds = None
        if job is not None:
            plan, samples, seconds = job.plan, job.samples, job.seconds
            if rt.spec.prompts_file is not None:
                # Jobs of prompts-file tenants are planned without reading storage (and, with sample-ahead,
                # before the previous step committed): the trajectory ids the step consumes are read now, so
                # no id is committed by two steps.
                plan = RolloutPlan(prompts=plan.prompts, consumed_ids=self._consumed_ids(rt))
            self._start_prefetch(rt, ahead=True)
        else:
            plan = self._plan(rt)
            if plan is None:
                return None
            requests = self._requests(rt, plan) if plan.prompts else []
            if not requests:
                samples, seconds = [], 0.0
            elif self.prefetcher is not None:  # a background sampler: waited for as a prefetched batch is
                samples, seconds = self.prefetcher.sample(requests, stop=self.stop)
            else:
                started = time.perf_counter()
                samples = self.sampler.sample(requests)
                seconds = time.perf_counter() - started
        prompts = plan.prompts
        if rt.spec.prompts_file is not None:
            prompts = tuple(self._file_prompts(rt))
        return _Work(
            ids=plan.consumed_ids,
            prompts=prompts,
            trajectory_range={"n": len(plan.consumed_ids), "prompts": len(plan.prompts)},
            plan=plan,
            samples=samples,
            sampling_seconds=seconds,
        )

    def _plan(self, rt: TenantRuntime) -> RolloutPlan | None:
        n_prompts = max(1, rt.spec.batch_size // rt.spec.group_size)
        rows = self.cursors.untrained(rt.spec.name, limit=n_prompts * (rt.spec.group_size + 1) * 2)
        file_prompts = self._file_prompts(rt) if rt.spec.prompts_file is not None else ()
        plan = rollouts.plan_from_rows(rows, n_prompts, file_prompts=file_prompts, step=rt.step + 1,
                                       own_rollouts=rt.rollout_ids, tokenizer=self.policy.tokenizer,
                                       max_prompt_tokens=self.max_len - 1)  # serving leaves the rest to the answer
        return plan if plan.prompts or plan.consumed_ids else None

    def _file_plan(self, rt: TenantRuntime, step: int) -> RolloutPlan:
        """The prompts of step `step` of a tenant with a prompts file, without reading storage (the ids the
        step consumes are read when it collects: `_consumed_ids`)."""
        n_prompts = max(1, rt.spec.batch_size // rt.spec.group_size)
        return rollouts.plan_from_rows(TRAJECTORIES.empty_table(), n_prompts, file_prompts=self._file_prompts(rt), step=step)

    def _consumed_ids(self, rt: TenantRuntime) -> tuple[str, ...]:
        """A prompts-file tenant's untrained trajectory ids (its own rollouts come back as trajectories), which
        its next step commits."""
        n_prompts = max(1, rt.spec.batch_size // rt.spec.group_size)
        rows = self.cursors.untrained(rt.spec.name, limit=n_prompts * (rt.spec.group_size + 1) * 2)
        return tuple(rows.column("id").to_pylist())

    def _file_prompts(self, rt: TenantRuntime) -> list[str]:
        """The tenant's prompts file, rendered with the chat template; read and rendered again only when the
        file changes (every step asks, and rendering every prompt each time cost ~10% of a step)."""
        path = rt.spec.prompts_file
        try:
            stat = os.stat(path)
            key = (str(path), stat.st_mtime_ns, stat.st_size)
        except OSError:
            key = None  # read_prompts_file says what is wrong
        cached = self._prompts_cache.get(rt.spec.name)
        if key is None or cached is None or cached[0] != key:
            rendered = [rollouts.render_user_prompt(self.policy.tokenizer, p) for p in rollouts.read_prompts_file(path)]
            fitting = [p for p in rendered if logs_mode.fits(self.policy.tokenizer, p, self.max_len - 1)]
            if len(fitting) < len(rendered):  # each would fail its step at serving, at every turn of the file
                logger.warning("tenant %r: %d of the %d prompts in %s are longer than the context (%d tokens) "
                               "leaves room for; they are skipped", rt.spec.name, len(rendered) - len(fitting),
                               len(rendered), path, self.max_len)
            if not fitting:
                raise rollouts.SamplingError(f"no prompt in prompts_file {path} fits the context of {self.max_len} tokens")
            rendered = fitting
            cached = self._prompts_cache[rt.spec.name] = (key, rendered)
        return cached[1]

    def _requests(self, rt: TenantRuntime, plan: RolloutPlan) -> list[SampleRequest]:
        if isinstance(self.sampler, ServingSampler) and not rt.spec.api_key:
            raise LearnerError(f"tenant {rt.spec.name!r}: rollouts through the serving tier need the tenant's api_key in the config")
        return [
            SampleRequest(
                tenant=rt.spec.name,
                api_key=rt.spec.api_key,
                prompt=p,
                n=rt.spec.group_size,
                max_tokens=self.settings.max_new_tokens,
                temperature=self.settings.temperature,
                version=f"{rt.spec.name}@{rt.version}" if rt.version else None,
                prompt_ids=tuple(self.policy.tokenizer(p, add_special_tokens=False).input_ids),
            )
            for p in plan.prompts
        ]

    def _start_prefetch(self, rt: TenantRuntime, *, ahead: bool = False) -> None:
        """Serving sampler only: starts sampling the tenant's next batch while other tenants train.

        Normally after the commit, so the plan cannot reuse this step's ids. With `ahead` (called as a step
        takes its samples, `learner.sample_ahead`, tenants with a prompts file only): the batch of the step
        after the one now training, so the engine samples it while this step trains; its samples then come
        from the version before the one this step publishes (staleness 1, tracked by the version header
        and bounded by `learner.max_staleness`)."""
        if self.prefetcher is None or rt.spec.mode != "rollouts" or self.prefetcher.pending(rt.spec.name):
            return
        if ahead and not (self.settings.sample_ahead and self.settings.max_staleness >= 1
                          and rt.spec.prompts_file is not None):
            return  # with max_staleness 0, samples of the version before the newest would all be dropped
        try:
            tenant_scorer(rt.spec)  # no sampling for a tenant whose step would fail anyway
            step = rt.step + (2 if ahead else 1)
            plan = self._file_plan(rt, step) if rt.spec.prompts_file is not None else self._plan(rt)
            if plan is not None and plan.prompts:
                self.prefetcher.start(rt.spec.name, plan, self._requests(rt, plan), step=step)
        except Exception:  # planning reads storage; the next step plans again and reports the error
            logger.exception("tenant %s: could not start sampling", rt.spec.name)

    def prefetch(self, backlog: dict[str, int]) -> None:
        """Starts sampling for every ready rollouts tenant that has no request in flight, so all of them are
        sampled concurrently (and batch together in the serving engine)."""
        if self.prefetcher is None:
            return
        for name, n in backlog.items():
            rt = self.tenants[name]
            if n > 0:
                self._start_prefetch(rt)

    # --- the update -----------------------------------------------------------------------------------
    def _update(self, rt: TenantRuntime, work: _Work, scorer) -> _Trained:
        name = rt.spec.name
        common = dict(
            clip_eps=self.settings.clip_eps,
            behaviour_weight_cap=self.settings.behaviour_weight_cap,
            epochs=self.settings.update_epochs,
            kl_coef=self.settings.kl_coef,
            entropy_coef=self.settings.entropy_coef,
            max_grad_norm=self.settings.max_grad_norm,
            max_len=self.max_len,
        )
        if work.logs is not None:
            if not work.logs:
                return _Trained(None, (), math.nan, 0, work.dropped, rt.baseline)
            rewards = tuple(e.reward for e in work.logs)
            if self.settings.skip_flat_batches and (logs_mode.is_flat(rewards) or logs_mode.flat_within_prompts(work.logs)):
                # nothing to tell better from worse: only the baseline learns (see logs_mode's note)
                baseline = logs_mode.baseline_after(rt.baseline, rewards)
                return _Trained(None, rewards, sum(rewards) / len(rewards), 0, work.dropped, baseline)
            step = logs_mode.train_step(
                self.policy, name, work.logs, baseline=rt.baseline, scale_advantages=self.settings.scale_advantages,
                micro_batch_size=rt.spec.batch_size, current_version=rt.version,
                version_files=lambda number: self._version_files(name, number), **common
            )
            return _Trained(step.update, rewards, step.reward_mean, len(work.logs), work.dropped, step.baseline)
        if not work.plan.prompts:
            return _Trained(None, (), math.nan, 0, 0, rt.baseline)
        prompts = tuple(work.plan.prompts)
        tries = rt.unscorable[1] if rt.unscorable[0] == prompts else 0
        try:
            step = rollouts.train_step(
                self.policy,
                name,
                work.plan.prompts,
                work.samples,
                scorer,
                current_version=rt.version,
                max_staleness=self.settings.max_staleness,
                served=rt.served,
                withdrawn=rt.withdrawn,
                skip_unscorable=tries + 1 >= UNSCORABLE_TRIES,
                temperature=self.settings.temperature,
                version_files=lambda number: self._version_files(name, number),
                scale_advantages=self.settings.scale_advantages,
                **common,
            )
        except rollouts.NoUsableSamples as e:
            rt.unscorable = (prompts, tries + 1) if e.unscorable else ((), 0)
            raise
        if step.update is None and step.n_samples == 0:
            logger.warning("tenant %s: every sample of the same %d prompt(s) failed scoring %d times (last: %s); the "
                           "step is committed as skipped", name, len(prompts), tries + 1, rt.error)
        rt.unscorable = ((), 0)
        return _Trained(step.update, step.rewards, step.reward_mean, step.n_samples, step.n_dropped, rt.baseline,
                        step.score_seconds, step.n_score_failed)

    def _version_files(self, name: str, number: int) -> Path | None:
        """The directory of the tenant's version `number` while its adapter files are on disk, else None."""
        try:
            path = self.registry.get(name, number).path
        except (VersionNotFound, RegistryError):
            return None
        return path if (path / ADAPTER_WEIGHTS).is_file() else None

    def _candidate_probe(self, rt: TenantRuntime, scorer, clock: _Phases):
        """The freshly trained adapter's reward per probe prompt, asked of the step's driver (a round decodes
        every tenant's together); the wait for the other tenants of the round is not the step's time."""
        asked = time.monotonic()
        answer = yield ProbeRequest(tenant=rt.spec.name, prompts=rt.probes, scorer=self._probe_scorer(rt, scorer))
        clock.add("probe", answer.seconds)
        rt.round_wait += max(0.0, time.monotonic() - asked - answer.seconds)
        rt.probe_unscored |= None in answer.rewards
        return answer.rewards

    @staticmethod
    def _probe_scorer(rt: TenantRuntime, scorer):
        """The scorer a gate probe uses. After UNSCORABLE_TRIES - 1 steps in a row failed on a probe the scorer
        could not score (across the back-offs, some 6 minutes: a scorer that fails on some greedy answer every
        time, or a long outage), a prompt it cannot score is left out of the comparison on both sides
        (gate.LeaveUnscored), so the tenant is not stopped for good; never counted 0. The first step whose
        probes all scored goes back to failing the step on one."""
        return scorer if rt.probe_failures + 1 < UNSCORABLE_TRIES else gate.LeaveUnscored(scorer)

    def _parent_probe(self, rt: TenantRuntime, scorer) -> tuple[float, ...] | None:
        """The current adapter's reward per probe prompt (cached per adapter state); None without a scorer.
        A probe whose scorer failed raises (gate.ProbeScoringFailed) and is not cached: the step fails before
        it trains, and the next one probes again."""
        if scorer is None or not rt.probes:
            return None
        key = self._probe_key(rt)
        if key not in rt.probe_cache:  # decoded as the candidate's is (`_probe`), so the two compare like for like
            (answer,) = self._probe([ProbeRequest(tenant=rt.spec.name, prompts=rt.probes,
                                                  scorer=self._probe_scorer(rt, scorer))])
            if isinstance(answer, Exception):
                raise answer
            if None in answer.rewards:  # a prompt left unscored: not cached, asked again next step
                rt.probe_unscored = True
                return answer.rewards
            rt.probe_cache = {key: answer.rewards}
        return rt.probe_cache[key]

    def _probe_key(self, rt: TenantRuntime) -> tuple:
        """What a probe's rewards depend on: the adapter state, the prompts, the scorer and the decode length.
        A config re-read that changes the scorer or `max_new_tokens` then probes the parent again, so the gate
        compares both sides under the same ones (a cached probe of the old scorer would fail every step)."""
        return rt.state_id, rt.probes, rt.spec.scorer, self.settings.max_new_tokens

    # --- loading, recovery, following the registry ----------------------------------------------------
    def recover(self) -> None:
        """At start: takes every tenant this process owns that no other learner process holds (`_claim`),
        which completes its last committed step. Needs no model: it moves registry records and writes rows."""
        names = set(self.registry.tenants()) | set(self.cursors.tenants())  # both leave out folders left by hand
        for name in sorted(n for n in names if self._owns(n)):
            if name not in self.tenants:
                self._set_spec(TenantSpec.default(name))
        for rt in list(self.tenants.values()):
            self._claim(rt)

    def _recover(self, rt: TenantRuntime) -> None:
        """Completes the tenant's last committed step (publish or reject its version, write its row) and
        rejects candidates that no commit references (a crash came between create and commit). Runs when
        this process takes the tenant's lock, so no other process is in the middle of a step for it."""
        name = rt.spec.name
        try:
            latest = self.cursors.latest_checkpoint(name)
            if latest is not None:
                meta = _read_meta(latest[1])
                rt.step, rt.version = self._last_step(name, latest[0]), int(meta["version"] or 0)
                self._finish(rt, meta)
            self._reject_abandoned(name)
            self._load_served(rt)
        except Exception as e:  # this tenant's recovery is retried on its next step; the others go on
            logger.exception("tenant %s: recovery failed", name)
            rt.status, rt.error = "error", f"{type(e).__name__}: {e}"

    def _reject_own(self, name: str, number: int, reason: str) -> None:
        """Rejects this attempt's candidate (if it still is one) after its commit failed before the commit point."""
        if self.registry.get(name, number).status == "candidate":
            logger.warning("tenant %s: rejecting %s@%d (%s)", name, name, number, reason)
            self.registry.reject(name, number, reason=reason[:500])

    def _reject_abandoned(self, name: str, reason: str = ABANDONED) -> None:
        for v in self.registry.candidates(name):
            logger.warning("tenant %s: rejecting %s (%s)", name, v.name, reason)
            self.registry.reject(name, v.number, reason=reason[:500])
        if self.registry.repair(name):  # a crash inside a registry change: HEAD behind, or files left
            logger.warning("tenant %s: repaired what a crash left of its last registry change", name)

    def _ensure_loaded(self, rt: TenantRuntime) -> None:
        if rt.loaded:
            return
        name = rt.spec.name
        self._make_room(name)
        rt.used_at = time.monotonic()
        if rt.unloaded is not None and self._reload_unloaded(rt):
            return
        latest = self.cursors.latest_checkpoint(name)
        while latest is not None:
            step, directory = latest
            try:
                meta = self._load_checkpoint(rt, directory)
                break
            except DamagedFile as e:
                damaged = e
            # Its content is damaged: set aside, and on from the checkpoint before it, or from the served version.
            # The step stays committed: where its record reads, its publish and row are completed first (a
            # reload after a commit whose outcome could not be read has not finished it), else its candidate
            # goes as abandoned.
            try:
                unfinished = _read_meta(directory)
            except (DamagedFile, LearnerError):
                unfinished = None
                logger.error("tenant %s: step %d's record is unreadable: its version, if any, is rejected as "
                             "abandoned", name, step)
            if unfinished is not None:
                self._finish(rt, unfinished)
            try:
                moved = self.cursors.set_aside_checkpoint(name, step)
            except OSError as e:
                raise LearnerError(f"{damaged} -- the checkpoint of step {step} is damaged, and setting it aside "
                                   f"failed ({e}): move {directory} out of the cursor") from damaged
            logger.error("tenant %s: the checkpoint of step %d is damaged (%s); set aside in %s: going on from "
                         "the checkpoint before it, or from the served version", name, step, damaged, moved)
            rt.set_aside = [*rt.set_aside, str(moved)][-KEEP_DAMAGED:]  # the ones still on disk (cursors.py)
            latest = self.cursors.latest_checkpoint(name)
        if latest is not None:
            # Numbered on from the cursor: a step whose checkpoint was set aside stays committed.
            rt.step, rt.version, rt.baseline = self._last_step(name, step), int(meta["version"] or 0), meta.get("baseline")
            rt.probes = tuple(meta.get("probes") or ())
            rt.rollout_ids = dict.fromkeys(meta.get("rollout_ids") or ())
            rt.unfinished = meta
            logger.info("tenant %s: resumed at step %d from the checkpoint of step %d (adapter %s@%d)", name, rt.step,
                        step, name, rt.version)
        else:
            published = self.registry.latest_published(name)  # the records, as _follow_registry reads
            self._add_adapter(rt, published.path if published is not None else None)
            if published is not None:
                self._load_published(rt, published)
                rt.version = published.number
            # Numbered on from the tenant's train_steps too: its cursor may be gone (deleted by hand to train
            # the tenant again from its served adapter), and a step number that a row holds already would
            # name a train_steps file that exists, so the new step's row would not be written.
            rt.step = max(self.cursors.latest_step(name) or 0, column_max(self.dd, "train_steps", "step", name) or 0)
        rt.state_id += 1
        rt.probe_cache = {}
        if latest is not None:  # the weights are that checkpoint's
            rt.committed_state = rt.state_id
        rt.loaded = True
        if rt.unfinished is not None or rt.state_id > 1:  # a step to finish, or a reload (not the first load)
            # As at a take-over (_recover, which a first load follows): a reload after a commit whose outcome
            # could not be read leaves that attempt's candidate if the commit had in fact failed (at the first
            # step too, with no checkpoint to resume), and the versions served since moved.
            rt.served_read = False  # until done: a failure here leaves it to the next step (_step)
            if rt.unfinished is not None:
                self._finish(rt, rt.unfinished)
            self._reject_abandoned(name)
            self._load_served(rt)

    def _make_room(self, name: str) -> None:
        """Unloads the tenants that stepped longest ago until `name`'s adapter fits within
        learner.max_resident_tenants. An unloaded tenant's state is its last checkpoint (every committed step
        writes one; between steps nothing else changes its adapter that its next step does not redo: a
        followed registry change is followed again), so its next step loads it as a reload. A tenant of the
        step in progress (a round) is never unloaded: the limit may be exceeded by a round's size."""
        limit = self.settings.max_resident_tenants
        if limit <= 0:
            return
        resident = [rt for n, rt in self.tenants.items() if n != name and self.policy.has(n)]
        busy = self._stepping | self._round
        idle = sorted((rt for rt in resident if rt.spec.name not in busy), key=lambda rt: rt.used_at)
        for rt in idle[: max(0, len(resident) + 1 - limit)]:
            self._unload(rt)

    def _unload(self, rt: TenantRuntime) -> None:
        name = rt.spec.name
        self.policy.remove_tenant(name)
        # A tenant not loaded (a takeover's reload pending) gets the full load when it steps again.
        rt.unloaded = (rt.step, rt.state_id == rt.committed_state) if rt.loaded else None
        rt.loaded = False
        logger.debug("tenant %s: adapter and optimizer unloaded (learner.max_resident_tenants = %d); its next step "
                     "loads its last checkpoint", name, self.settings.max_resident_tenants)

    def _load_checkpoint(self, rt: TenantRuntime, directory: Path) -> dict:
        """The tenant's adapter and optimizer from the checkpoint in `directory`; returns its record.
        DamagedFile when its content is damaged; whatever fails, nothing half-loaded stays."""
        name = rt.spec.name
        try:
            meta = _read_meta(directory)
            if missing := missing_checkpoint_files(directory):
                raise DamagedFile(f"tenant {name!r}: the checkpoint {directory} lacks {', '.join(missing)}")
            self._add_adapter(rt, directory / "adapter")
            self.policy.load_checkpoint(name, directory)
            if not self.policy.weights_finite(name):
                raise DamagedFile(f"tenant {name!r}: the adapter in {directory} holds non-finite weights")
        except BaseException:
            if self.policy.has(name):  # nothing half-loaded stays: the next try starts afresh
                self.policy.remove_tenant(name)
            raise  # not DamagedFile: the config, the disk now, a newer clora: not mended by moving
        return meta

    def _reload_unloaded(self, rt: TenantRuntime) -> bool:
        """Loads the weights of a tenant `_unload` freed back from its last checkpoint, its runtime state kept
        (this process held its lock throughout: nothing but an operator's registry change, which its step
        follows, can have moved). When they were the checkpoint's as it was unloaded, the gate's cached
        probe of them still holds. False, nothing loaded: the checkpoint is not the one of its last step (or
        it has none, or it is damaged), and the full load (`_ensure_loaded`) decides."""
        name, (step, same) = rt.spec.name, rt.unloaded
        rt.unloaded = None
        latest = self.cursors.latest_checkpoint(name)
        if latest is None or latest[0] != step:
            return False
        try:
            meta = self._load_checkpoint(rt, latest[1])
        except DamagedFile:
            return False  # the full load sets it aside and goes on from the one before
        if not same:  # it had followed the registry since its step: that is followed again, and probed again
            rt.version = int(meta["version"] or 0)
            rt.state_id += 1
            rt.probe_cache = {}
        rt.committed_state = rt.state_id
        rt.loaded = True
        return True

    def _load_published(self, rt: TenantRuntime, published) -> None:
        """Loads the served version `published` into the tenant's adapter. Refused, the adapter left as it was,
        when its weights are not finite: serving refuses it too, and every step from it would be rejected by
        the gate with its batch spent."""
        name = rt.spec.name
        before = self.policy.snapshot(name)
        self.policy.load_adapter(name, published.path)
        if not self.policy.weights_finite(name):
            self.policy.restore(name, before)
            raise LearnerError(f"tenant {name!r}: the served {published.name} holds non-finite weights "
                               f"({published.path}): roll back to an earlier version")

    def _last_step(self, name: str, checkpoint_step: int) -> int:
        """The tenant's last committed step: its newest checkpoint's, or a later one whose checkpoint is gone."""
        return max(checkpoint_step, self.cursors.latest_step(name) or 0)

    def _check_parent_kl(self, rt: TenantRuntime) -> None:
        """Fails the step, before it takes a batch, when the served version's own gate KL is above the tenant's
        gate_max_kl (lowered since it was published, or a version published by hand): every candidate near it
        would be rejected, and each rejected step's batch counted as trained, without a word."""
        if not rt.version:
            return
        try:
            gate_checks = self.registry.get(rt.spec.name, rt.version).gate or {}
        except (VersionNotFound, UnreadableRecord):  # _follow_registry read it; gone or damaged since: no KL known
            return
        kl = gate_checks.get("kl")
        limit = self.limits.max_kl if rt.spec.gate_max_kl is None else rt.spec.gate_max_kl
        if isinstance(kl, (int, float)) and math.isfinite(kl) and kl > limit:
            raise LearnerError(
                f"tenant {rt.spec.name!r}: the served {rt.spec.name}@{rt.version} is {kl:.4g} nats from the base "
                f"model, above gate_max_kl {limit:g}: every candidate would be rejected and its batch spent; raise "
                f"gate_max_kl, or roll back to a version within it (nothing is trained until then)")

    def _add_adapter(self, rt: TenantRuntime, saved: Path | None) -> None:
        """Creates the tenant's adapter, in the shape it was saved in when there is a saved one."""
        spec = rt.spec
        if saved is not None:
            shape = read_adapter_shape(saved)
            if not spec.same_adapter_shape(replace(spec, **shape)):
                logger.warning("tenant %s: keeping the saved adapter shape %s (the config asks for another)", spec.name, shape)
            spec = replace(spec, **shape)
        if not self.policy.has(spec.name):
            self.policy.add_tenant(spec)
            shape = (spec.name, spec.rank, spec.alpha, tuple(sorted(spec.target_modules)), self.max_lora_rank)
            if shape not in self._servable:  # once, not at every reload of an unloaded tenant
                try:
                    self._check_servable(spec.name)
                except BaseException:
                    self.policy.remove_tenant(spec.name)
                    raise
                self._servable.add(shape)
        rt.spec = spec

    def _check_servable(self, name: str) -> None:
        """Raises LearnerError when serving would refuse every version of the tenant's adapter (its shape: a
        target name PEFT matches by suffix but serving does not, the tied lm_head, a rank over
        serving.max_lora_rank): it would train and publish versions that are never served. Checked once, on
        the fresh adapter, with serving's own check."""
        import tempfile

        from serving.adapter_check import AdapterRejected, base_linear_shapes, validate_adapter

        if self._base_shapes is None:
            self._base_shapes = base_linear_shapes(self.policy.model_path)
        with tempfile.TemporaryDirectory(prefix="clora-check-") as d:
            self.policy.save_adapter(name, d)
            try:
                validate_adapter(Path(d), max_rank=self.max_lora_rank, base_shapes=self._base_shapes)
            except AdapterRejected as e:
                raise LearnerError(f"tenant {name!r}: serving would refuse every version of this adapter: {e}") from e

    def _follow_registry(self, rt: TenantRuntime) -> None:
        """If the served version is not the learner's (an operator rolled back, or published or retired a
        version by hand), continue from the served one with a fresh optimizer; if every version was retired
        (the base model is served), from a fresh adapter."""
        # From the version records, not HEAD.json: a crash between a publish's record and its HEAD rewrite
        # leaves HEAD behind (until the next registry change), and the publish check reads the records too.
        published = self.registry.latest_published(rt.spec.name)
        if published is None:
            if rt.version:
                logger.warning("tenant %s: no version of it is served any more (retired); starting again from a "
                               "fresh adapter", rt.spec.name)
                self.policy.remove_tenant(rt.spec.name)
                self.policy.add_tenant(rt.spec)
                rt.version = 0
                rt.state_id += 1
                self._load_served(rt)
            return
        if published.number == rt.version:
            return
        logger.warning(
            "tenant %s: the registry serves %s but the learner is at %s@%d; continuing from %s",
            rt.spec.name, published.name, rt.spec.name, rt.version, published.name,
        )
        self._load_published(rt, published)
        self.policy.reset_optimizer(rt.spec.name)
        rt.version = published.number
        rt.state_id += 1
        self._load_served(rt)

    def _follow_registry_now(self, rt: TenantRuntime) -> None:
        """`_follow_registry` right after a step the registry refused to publish, so that the learner's version
        (and status.json) name what is served, not the refused candidate. A failure here is the next step's
        to meet (it follows the registry first)."""
        try:
            self._follow_registry(rt)
        except Exception:
            logger.warning("tenant %s: cannot follow the registry's served version yet; the next step does",
                           rt.spec.name, exc_info=True)

    def _finish(self, rt: TenantRuntime, meta: dict) -> str:
        """Completes a committed step: publish or reject its version, write its train_steps row. Idempotent.
        Returns what became of the step: its decision, or "rejected" where the registry refused to publish
        (an operator's rollback since: the version's parent is no longer served)."""
        name, created = rt.spec.name, meta.get("created")
        decision = meta["decision"]
        # The step is committed on disk, but maybe not durably: its commit may have raised after the rename
        # (its directory's fsync failed). Published on that, a power loss would leave the version served and
        # the step gone, and the batch trained again on top of the version.
        self.cursors.make_durable(name)
        try:
            v = self.registry.get(name, created) if created is not None else None
        except VersionNotFound:  # settled long ago and pruned by retention (prune_registry keeps no settled record)
            logger.info("tenant %s: %s@%d of step %s is no longer in the registry; nothing to publish", name, name,
                        created, meta.get("step"))
            v = None
        if v is not None:
            if v.status != "candidate":
                # Settled already, by this process's earlier try: a publish that raised after the version's
                # record (HEAD.json not rewritten: serving reads HEAD) is completed here.
                if self.registry.repair(name):
                    logger.warning("tenant %s: completed the registry change of %s", name, v.name)
            else:
                if meta["decision"] == "published":
                    v = self.registry.publish(name, created, gate=meta.get("gate"), if_parent_served=True)
                    if v.status == "rejected":  # the operator changed what is served: follow it next step
                        logger.warning("tenant %s: %s not published: %s", name, v.name, v.reason)
                else:
                    v = self.registry.reject(name, created, reason=meta.get("reason") or "rejected by the gate",
                                             gate=meta.get("gate"))
            if decision == "published" and v.status == "rejected":
                decision = "rejected"
        write_dataset(self.dd, "train_steps", _row_table(meta["row"]), file_id=f"step-{int(meta['step']):020d}")
        rt.last = meta["row"]
        rt.unfinished = None
        return decision

    def _write_checkpoint(self, name: str, directory: Path, meta: dict) -> None:
        self.policy.save_checkpoint(name, directory)
        (directory / CHECKPOINT_META).write_text(json.dumps(meta, indent=1))

    # --- reporting ------------------------------------------------------------------------------------
    def _report(self, rt: TenantRuntime) -> None:
        """After each step: a progress bar per tenant on a terminal; one log line per step elsewhere (under
        `clora up`, in a log file), where a bar's cursor moves would only garble the output."""
        last = rt.last or {}
        summary = (
            f"v{rt.version} {rt.status} r={_fmt(last.get('reward_mean'))} loss={_fmt(last.get('loss'))} kl={_fmt(last.get('kl'))}"
            + (f" error={rt.error[:60]}" if rt.error else "")
        )
        if self.progress and not (self.bars and sys.stderr.isatty()):
            logger.info("tenant %s: step %d, %s (%d trajectories)", rt.spec.name, rt.step, summary, last.get("n_trajectories") or 0)
        elif self.progress:
            bar = self._bars.get(rt.spec.name)
            if bar is None:
                from tqdm import tqdm

                bar = self._bars[rt.spec.name] = tqdm(
                desc=rt.spec.name, unit="step", initial=rt.step, position=len(self._bars), leave=True, dynamic_ncols=True
                )
            bar.update(rt.step - bar.n)
            bar.set_postfix_str(summary)
        self._save_status()

    def _save_status(self) -> None:
        try:
            self._write_status()
        except OSError as e:  # a full disk must not end the learner (the steps themselves fail per tenant)
            if not self._status_failing:
                logger.warning("cannot write the learner's status file: %s", e)
            self._status_failing = True
        else:
            self._status_failing = False

    def _write_status(self) -> None:
        status = {
            name: {
                "status": t.status,
                "step": t.step,
                "version": f"{name}@{t.version}" if t.version else None,
                "mode": t.spec.mode,
                "error": t.error,
                "failures": t.failures,
                "last": t.last,
                **({"damaged_checkpoints_set_aside": t.set_aside} if t.set_aside else {}),
            }
            for name, t in sorted(self.tenants.items())
        }
        if self.shard is not None:
            path = self.dd.state / "learner" / f"status-{self.shard.label}.json"
            atomic_write_bytes(path, json.dumps(status, indent=1, default=str).encode())
            return
        # Unsharded learners share status.json (a standby, or two started side by side): each writes the
        # tenants it trains and keeps the file's entries of the others (another process's, whatever this one
        # thinks of them: not tried yet, or "elsewhere"), under a lock; its own failure to take a tenant's lock
        # is its entry too.
        path = self.dd.state / "learner" / "status.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(self.dd.locks / "learner-status.lock"):
            try:
                written = json.loads(path.read_bytes())
            except (FileNotFoundError, ValueError):
                written = {}
            merged = {
                name: entry if name in self._locks or entry["status"] == "error" or name not in written
                else written[name]
                for name, entry in status.items()
            }
            atomic_write_bytes(path, json.dumps(merged, indent=1, default=str).encode())

    def close(self) -> None:
        self.metrics.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()
        for bar in self._bars.values():
            bar.close()
        for lock in self._locks.values():  # the tenants are free for another process (or this one's next run)
            lock.release()
        self._locks.clear()


# ---------------------------------------------------------------------------------------------------------
# The loop


def run(
    cfg: Config,
    *,
    model_path: Path,
    reload: Callable[[], Config] | None = None,
    reload_seconds: float = CONFIG_RELOAD_SECONDS,
    once: bool = False,
    until_idle: bool = False,
    max_steps: int | None = None,
    progress: bool = True,
    stop: threading.Event | None = None,
    learner: Learner | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    shard: Shard | None = None,
    bars: bool = True,
    metrics: LearnerMetrics | None = None,
) -> Learner:
    """Runs the learner until `stop` is set (or: one pass over all tenants with `once`; until no tenant has
    work with `until_idle`; `max_steps` steps in all). Returns the learner (its tenants hold the statuses).
    `on_step` is called with every committed step's record (benchmarks and tests observe the loop with it).
    `shard`: this process trains only that shard's tenants (several learner processes on one data dir)."""
    stop = stop or threading.Event()
    learner = learner or Learner(cfg, model_path=model_path, progress=progress, shard=shard, bars=bars, metrics=metrics)
    learner.stop = stop  # a step waiting for rollouts gives up when it is set
    mark_ready(learner.dd.state, learner.process_name)  # the model is loaded: `clora up` may send traffic now
    served: set[str] = set()
    steps = 0
    reloaded_at = time.monotonic()
    rereads = ConfigRereads(reload, cfg, service="the learner", at_restart=(
        _at_restart, "data_dir, [model], [kafka] or serving.max_model_len / max_lora_rank")) if reload is not None else None
    try:
        while not stop.is_set():
            if rereads is not None and time.monotonic() - reloaded_at >= reload_seconds:
                reloaded_at = time.monotonic()
                if (new := rereads.follow()) is not None:  # two reads in a row agree: not a file half-written
                    learner.apply_config(new)
            backlog = learner.pending(hold_partial=not (once or until_idle))
            learner.prefetch(backlog)
            exclude = set(served) if once else set()
            # A tenant whose rollouts are still being sampled would make the learner wait for them: while
            # another tenant is ready with nothing to wait for, that one goes first.
            sampling = learner.still_sampling(backlog)
            if sampling and any(n > 0 and t not in sampling and t not in exclude for t, n in backlog.items()):
                exclude |= sampling
            elif sampling - exclude:
                # Every ready tenant's rollouts are still being sampled: wait for the first to come back, then
                # look again. Taking one now waited for it in the step, deaf to the others' new data (and to
                # config reloads) until its rollouts returned.
                learner.prefetcher.wait_any(sampling - exclude, timeout=learner.settings.poll_seconds, stop=stop)
                continue
            name = learner.choose(backlog, exclude=exclude)
            if name is None:
                if once or until_idle:
                    break
                stop.wait(learner.settings.poll_seconds)  # as the config says now: it is re-read
                continue
            names = [name, *learner.round_partners(name, backlog, exclude=exclude | sampling)]
            if max_steps is not None:
                names = names[: max_steps - steps]
            for name, record in zip(names, learner.step_round(names)):
                if record is not None and on_step is not None:
                    on_step(record)
                served.add(name)
            steps += len(names)
            if max_steps is not None and steps >= max_steps:
                break
    finally:
        learner.close()
    clear_ready(learner.dd.state, learner.process_name)  # a clean stop: a mark left behind says otherwise
    return learner


# ---------------------------------------------------------------------------------------------------------
# Helpers


def _at_restart(cfg: Config) -> tuple:
    """The settings outside [learner] and [[tenants]] the learner reads only when it starts."""
    return cfg.data_dir, cfg.model, cfg.kafka, cfg.serving.max_model_len, cfg.serving.max_lora_rank


class _Phases:
    """Seconds per named phase of one step: `with clock("train"): ...` adds the block's time to "train"."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.monotonic() - started

    def add(self, phase: str, seconds: float) -> None:
        """Books `seconds` measured elsewhere to `phase`."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def move(self, source: str, target: str, seconds: float) -> None:
        """Books `seconds` of `source` to `target` (a part measured inside another phase)."""
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds

    def timings(self, *, total: float) -> dict[str, float]:
        out = {phase: self.seconds.get(phase, 0.0) for phase in PHASES if phase != "other"}
        out["other"] = max(0.0, total - sum(out.values()))
        out["total"] = total
        return out


def tenant_scorer(spec: TenantSpec):
    """The tenant's scorer function with its time limit; None for one scored by events (logs mode only: a
    rollouts tenant needs a function, LearnerError otherwise, as for a spec that cannot be built)."""
    from ingest.scorers import ScorerSpecError, build_scorer, is_function

    if not is_function(spec.scorer):
        if spec.mode == "rollouts":
            raise LearnerError(
                f"tenant {spec.name!r}: rollouts mode needs a programmatic scorer, but scorer is {spec.scorer!r}"
            )
        return None
    try:
        return build_scorer(spec.scorer, time_limit_s=spec.scorer_time_limit_s)
    except ScorerSpecError as e:
        raise LearnerError(f"tenant {spec.name!r}: {e}") from e


def _staleness(samples, tenant: str, parent: str | None, served: list[int], max_staleness: int) -> int | None:
    """How many served versions the oldest sample trained on is behind `parent` (the adapter the step
    trained, "<tenant>@<n>" or None before the first publish; logs_mode.versions_behind); None without such
    samples. A sample of the base model is version 0; samples dropped as stale or foreign do not count."""
    current = int(parent.rsplit("@", 1)[1]) if parent else 0
    behind = []
    for group in samples or ():
        for s in group:
            number = logs_mode.version_number(s.version, tenant)
            if number is not None:
                behind.append(logs_mode.versions_behind(number, current, served))
    kept = [b for b in behind if b <= max_staleness]
    return max(kept) if kept else None


def _num(x: float | None) -> float | None:
    return None if x is None else float(x)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _metrics(trained: _Trained, step: int, mode: str, probe: tuple | None, parent_probe: tuple | None) -> dict:
    """The version's metrics in the registry (JSON: non-finite numbers become strings)."""
    update = trained.update
    values = {
        "step": step,
        "mode": mode,
        "reward_mean": trained.reward_mean,
        "loss": update.loss,
        "pg_loss": update.pg_loss,
        "kl": update.kl,
        "kl_before": update.kl_before,
        "clip_frac": update.clip_frac,
        "entropy": update.entropy,
        "grad_norm": update.grad_norm,
        "tokens": update.tokens,
        "n_trajectories": trained.n_trained,
        "n_dropped": trained.n_dropped,
        "n_score_failed": trained.n_score_failed,
        "probe_reward": None if probe is None else gate.scored_mean(probe),
        "parent_probe_reward": None if parent_probe is None else gate.scored_mean(parent_probe),
    }
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}


def _remember_rollouts(known: dict, work: _Work) -> list[str]:
    """The rollout interaction ids still to recognise after this step: those known before plus this step's
    samples, minus the ones this step consumed; the newest MAX_REMEMBERED_ROLLOUTS."""
    ids = dict(known)
    for group in work.samples or ():
        for sample in group:
            if sample.interaction_id:
                ids[sample.interaction_id] = None
    for tid in work.ids:
        ids.pop(tid, None)
    return list(ids)[-MAX_REMEMBERED_ROLLOUTS:]


def _trajectory_range(rows: pa.Table) -> dict:
    ingested = rows.column("ingested_at").to_pylist()
    ids = rows.column("id").to_pylist()
    return {
        "n": rows.num_rows,
        "first_id": ids[0],
        "last_id": ids[-1],
        "first_ingested_at": min(ingested).isoformat(),
        "last_ingested_at": max(ingested).isoformat(),
    }


def _row_table(row: dict) -> pa.Table:
    values = dict(row)
    values["ts"] = datetime.fromisoformat(values["ts"])
    for k in ("reward_mean", "loss", "kl", "clip_frac"):  # NaN is stored as null: "not measured / poisoned"
        if isinstance(values[k], float) and not math.isfinite(values[k]):
            values[k] = None
    return pa.Table.from_pylist([values], schema=TRAIN_STEPS)


def _read_meta(directory: Path) -> dict:
    path = directory / CHECKPOINT_META
    try:
        meta = json.loads(path.read_text())
    except (FileNotFoundError, ValueError) as e:  # written atomically with its checkpoint: never missing
        raise DamagedFile(f"cannot read the learner checkpoint record {path}: {e}") from e
    except OSError as e:
        raise LearnerError(f"cannot read the learner checkpoint record {path}: {e}") from e
    if not isinstance(meta, dict):
        raise DamagedFile(f"the learner checkpoint record {path} is not a JSON object")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise LearnerError(f"{path} has format {meta.get('format')!r}; this clora reads {CHECKPOINT_FORMAT}")
    return meta
