"""The Prefetcher keeps at most one sampling job per tenant in the serving tier, a discarded one included:
a job already running when the learner discards it (a config change, a step out of step) cannot be
cancelled, and a second job beside it would double the tenant's requests at once. The sampler here is a
fake that holds its requests until released; the Prefetcher is the real one."""

from __future__ import annotations

import threading
import time

import pytest

from learner.rollouts import Prefetcher, RolloutPlan, SampleRequest, Stopped

pytestmark = pytest.mark.unit


class HeldSampler:
    """A fake sampler: each call blocks until `release` is set; counts the calls in flight at once."""

    def __init__(self):
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = self.calls = 0

    def sample(self, requests):
        with self.lock:
            self.calls += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.release.wait(30)
        with self.lock:
            self.in_flight -= 1
        return [[] for _ in requests]


PLAN = RolloutPlan(prompts=("p",), consumed_ids=())
REQUESTS = [SampleRequest(tenant="acme", api_key="k", prompt="p", n=2, max_tokens=4, temperature=1.0)]


def wait_until(condition):
    for _ in range(600):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("timed out")


@pytest.fixture
def held():
    """A Prefetcher over a HeldSampler (both released and closed after the test)."""
    sampler = HeldSampler()
    prefetcher = Prefetcher(sampler, workers=4)
    yield sampler, prefetcher
    sampler.release.set()
    prefetcher.close()


def discard_while_running(sampler, prefetcher):
    """acme's job, discarded once its sampler holds it."""
    prefetcher.start("acme", PLAN, REQUESTS, step=1)
    wait_until(lambda: sampler.calls == 1)
    prefetcher.discard("acme")


def test_a_discarded_running_job_keeps_the_tenant_busy_and_its_next_job_starts_after_it(held):
    sampler, prefetcher = held
    discard_while_running(sampler, prefetcher)
    assert not prefetcher.pending("acme") and prefetcher.busy("acme")  # the scheduler takes others meanwhile

    prefetcher.start("acme", PLAN, REQUESTS, step=2)  # returns at once: the loop must not wait here
    assert not prefetcher.pending("acme") and sampler.calls == 1  # nothing sent beside the discarded job
    sampler.release.set()
    wait_until(lambda: not prefetcher.busy("acme"))
    prefetcher.start("acme", PLAN, REQUESTS, step=2)  # the loop's next pass
    assert prefetcher.take("acme").step == 2
    assert sampler.calls == 2 and sampler.most_in_flight == 1


def test_a_departed_tenants_finished_discarded_job_is_not_kept(held):
    """A tenant that left the config never asks again: its discarded job, once done, holds its samples no more."""
    sampler, prefetcher = held
    discard_while_running(sampler, prefetcher)  # acme leaves the config
    sampler.release.set()
    wait_until(lambda: not prefetcher.busy("acme"))
    prefetcher.start("other", PLAN, REQUESTS)  # the loop goes on with the others
    assert "acme" not in prefetcher._discarded
    assert prefetcher.take("other") is not None


def test_taking_nothing_after_a_discard_waits_for_the_discarded_job_too(held):
    """With no job to take, the learner samples itself next: not while the discarded job still runs."""
    sampler, prefetcher = held
    discard_while_running(sampler, prefetcher)
    threading.Timer(0.3, sampler.release.set).start()
    assert prefetcher.take("acme") is None
    assert sampler.in_flight == 0 and not prefetcher.busy("acme")


def test_a_discarded_job_not_yet_running_is_cancelled_and_holds_nothing():
    sampler = HeldSampler()
    prefetcher = Prefetcher(sampler, workers=1)
    try:
        prefetcher.start("other", PLAN, REQUESTS)  # takes the only worker
        wait_until(lambda: sampler.calls == 1)
        prefetcher.start("acme", PLAN, REQUESTS)  # queued behind it
        prefetcher.discard("acme")
        assert not prefetcher.busy("acme")
        sampler.release.set()
        assert prefetcher.take("other") is not None and sampler.calls == 1  # acme's never ran
    finally:
        sampler.release.set()
        prefetcher.close()


def stopped_within_seconds(wait) -> float:
    """How long `wait(stop)` took to raise Stopped once `stop` was set 0.2 s in."""
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        wait(stop)
    return time.monotonic() - started


def test_every_wait_for_samples_gives_up_when_the_learner_stops_and_no_thread_holds_up_the_exit(held):
    """SIGTERM while serving was slow to answer: the step waited for its samples up to the HTTP timeout, and
    the process's exit then waited for the thread pool's threads."""
    sampler, prefetcher = held  # its sampler holds every call for 30 s
    prefetcher.start("acme", PLAN, REQUESTS, step=1)
    wait_until(lambda: sampler.calls == 1)
    # Each well under the sampler's 30 s hold, with room for a slow machine.
    assert stopped_within_seconds(lambda stop: prefetcher.take("acme", stop=stop)) < 20  # a prefetched job
    assert stopped_within_seconds(lambda stop: prefetcher.sample(REQUESTS, stop=stop)) < 20  # sampling now
    prefetcher.start("bee", PLAN, REQUESTS, step=1)
    wait_until(lambda: sampler.calls == 3)
    prefetcher.discard("bee")
    assert stopped_within_seconds(lambda stop: prefetcher.take("bee", stop=stop)) < 20  # a discarded job still running
    assert sampler.in_flight == 3
    sampling = [t for t in threading.enumerate() if t.name.startswith("rollout-")]
    assert len(sampling) == 3 and all(t.daemon for t in sampling)


def test_sampling_now_starts_nothing_once_stopped_and_a_sample_it_gave_up_on_keeps_the_tenant_busy(held):
    sampler, prefetcher = held
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        prefetcher.sample(REQUESTS, stop=stop)
    assert sampler.calls == 0  # no request sent for a step that cannot use it
    stopped_within_seconds(lambda s: prefetcher.sample(REQUESTS, stop=s))
    assert sampler.calls == 1 and prefetcher.busy("acme")  # still sampling in the serving tier
    prefetcher.start("acme", PLAN, REQUESTS, step=2)
    assert not prefetcher.pending("acme")  # no second job beside it
    sampler.release.set()
    wait_until(lambda: not prefetcher.busy("acme"))
    prefetcher.start("acme", PLAN, REQUESTS, step=2)
    assert prefetcher.pending("acme")


def test_every_tenants_job_runs_at_once_however_many_wait_on_the_serving_tier():
    """Eight tenants waiting out 429s held the Prefetcher's eight threads, and a ninth tenant's rollouts did
    not start until one of them ended (up to two minutes)."""
    sampler = HeldSampler()
    prefetcher = Prefetcher(sampler)
    try:
        for k in range(12):
            prefetcher.start(f"t{k}", PLAN, REQUESTS)
        wait_until(lambda: sampler.in_flight == 12)
    finally:
        sampler.release.set()
        prefetcher.close()
