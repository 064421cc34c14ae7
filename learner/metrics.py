"""What the learner reports to Prometheus, served on `learner.metrics_host`:`learner.metrics_port` (+ K for
shard K of `clora learn --shard K/N`) when the port is non-zero.

Per tenant (the tenants this process trains; one it lets go of leaves the gauges): steps by what became of
them (`published`, `rejected`, `skipped`: nothing to learn from; `error`: the step failed, the tenant backs
off), when its last step ended and its failures in a row (an alert's two questions: has it stopped learning,
is it failing), its backlog of untrained trajectories, the adapter version it trains from and its last
step's mean reward. For the process: where the steps' time goes by phase (loop.PHASES, seconds summed over
steps) and how many tenants' adapters it holds in memory (learner.max_resident_tenants).

Metrics live in a registry of their own, as ingest's do (several learners in one test process do not
collide). Not here: the numbers themselves (loop.py calls `stepped`, `failed` and `backlog`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from clora.metrics_endpoint import serve_metrics, stop_metrics


class LearnerMetrics:
    def __init__(self, *, port: int = 0, host: str = "127.0.0.1", setting: str | None = None) -> None:
        """`setting`: how the config names `port`, for the error when it cannot be used."""
        self.registry = r = CollectorRegistry()
        self.steps = Counter("clora_learner_steps", "Steps, by tenant and outcome: published, rejected, skipped, error",
                             ["tenant", "outcome"], registry=r)
        self.last_step = Gauge("clora_learner_last_step_timestamp_seconds",
                               "When the tenant's last step (whatever its outcome) ended, Unix time", ["tenant"], registry=r)
        self.failures = Gauge("clora_learner_consecutive_failures", "The tenant's failed steps in a row (0 after one "
                              "that did not fail)", ["tenant"], registry=r)
        self.backlog_gauge = Gauge("clora_learner_backlog", "The tenant's untrained trajectories in storage",
                                   ["tenant"], registry=r)
        self.in_error = Gauge("clora_learner_tenant_error", "1 while the tenant is in error (its last step failed, "
                              "its backlog cannot be read, its lock cannot be taken: status.json says why), else 0",
                              ["tenant"], registry=r)
        self.version = Gauge("clora_learner_adapter_version", "The adapter version the tenant trains from (0: none yet)",
                             ["tenant"], registry=r)
        self.reward = Gauge("clora_learner_reward_mean", "Mean reward of the tenant's last step's batch", ["tenant"],
                            registry=r)
        self.trajectories = Counter("clora_learner_trajectories", "Trajectories (or samples) the tenant's committed "
                                    "steps took, by outcome: trained, or dropped (stale, withdrawn, foreign, unusable, "
                                    "reward out of range; their ids are committed, never trained)", ["tenant", "outcome"],
                                    registry=r)
        self.phase = Counter("clora_learner_phase_seconds", "Seconds the steps spent, by phase (wait, score, train, "
                             "probe, publish, other)", ["phase"], registry=r)
        self.resident = Gauge("clora_learner_resident_tenants", "Tenants whose adapter and optimizer are in memory",
                              registry=r)
        self.server = None
        if port:
            self.server = serve_metrics(r, port=port, host=host, setting=setting or f"learner.metrics_port {port}",
                                        what="learner")

    def stepped(self, tenant: str, outcome: str, *, version: int, reward_mean: float | None,
                timings: Mapping[str, float], trained: int = 0, dropped: int = 0) -> None:
        """A step that ended without an error (`outcome`: its decision, or "skipped"), having taken `trained`
        trajectories to train and `dropped` it left out."""
        self.steps.labels(tenant, outcome).inc()
        self.trajectories.labels(tenant, "trained").inc(trained)
        self.trajectories.labels(tenant, "dropped").inc(dropped)
        self.last_step.labels(tenant).set(time.time())
        self.failures.labels(tenant).set(0)
        self.version.labels(tenant).set(version)
        if reward_mean is not None:
            self.reward.labels(tenant).set(reward_mean)
        for phase, seconds in timings.items():
            if phase not in ("total", "sampling"):  # the sum of the others; the sampler's time, overlapping them
                self.phase.labels(phase).inc(max(0.0, seconds))

    def no_failures(self, tenant: str) -> None:
        """A step that ended with nothing to do: not a failure (the tenant's failures in a row end)."""
        self.failures.labels(tenant).set(0)

    def failed(self, tenant: str, failures: int) -> None:
        self.steps.labels(tenant, "error").inc()
        self.last_step.labels(tenant).set(time.time())
        self.failures.labels(tenant).set(failures)

    def backlog(self, backlog: Mapping[str, int | None], resident: int, in_error: Mapping[str, bool]) -> None:
        """Each tenant's backlog (None: unknown, its series removed rather than a 0 that looks idle) and
        whether it is in error."""
        for tenant, n in backlog.items():
            if n is None:
                try:
                    self.backlog_gauge.remove(tenant)
                except KeyError:
                    pass
            else:
                self.backlog_gauge.labels(tenant).set(n)
        for tenant, errored in in_error.items():
            self.in_error.labels(tenant).set(int(errored))
        self.resident.set(resident)

    def cannot_train(self, tenant: str, failures: int) -> None:
        """The tenant cannot be trained now (its lock cannot be taken): its failures in a row, no step counted."""
        self.failures.labels(tenant).set(failures)

    def forget(self, tenant: str) -> None:
        """A tenant this process no longer trains (another shard's now, or gone)."""
        for gauge in (self.last_step, self.failures, self.backlog_gauge, self.in_error, self.version, self.reward):
            try:
                gauge.remove(tenant)
            except KeyError:
                pass
        for counter, outcomes in ((self.steps, ("published", "rejected", "skipped", "error")),
                                  (self.trajectories, ("trained", "dropped"))):
            for outcome in outcomes:
                try:
                    counter.remove(tenant, outcome)
                except KeyError:
                    pass

    def close(self) -> None:
        stop_metrics(self.server)
        self.server = None
