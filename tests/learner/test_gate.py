"""learner/gate.py: every check, alone and together, and the probe set."""

from __future__ import annotations

import json
import math

import pytest

from learner.gate import (
    GateInput,
    GateLimits,
    LeaveUnscored,
    ProbeScoringFailed,
    decide,
    paired_standard_error,
    probe_rewards,
    probe_rewards_grouped,
    update_probes,
)
from learner.types import Sample

pytestmark = pytest.mark.unit

LIMITS = GateLimits(max_kl=1.0, reward_tolerance=0.1, max_abs_reward=100.0)
GOOD = GateInput(loss=0.3, grad_norm=0.5, weights_finite=True, kl=0.2, rewards=(0.0, 1.0, 0.5))


def with_(**kw):
    return GateInput(**{**GOOD.__dict__, **kw})


def test_a_healthy_step_passes_and_records_what_was_measured():
    r = decide(GOOD, LIMITS)
    assert r.passed and r.failures == () and r.reason == ""
    assert r.checks["kl"] == 0.2 and r.checks["reward_max"] == 1.0 and r.checks["limit_max_kl"] == 1.0
    json.dumps(r.checks, allow_nan=False)  # stored in the registry as strict JSON


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"rewards": (0.0, math.nan)}, "poisoned batch: 1 of 2 rewards"),
        ({"rewards": (0.0, 1e9, -1e9)}, "poisoned batch: 2 of 3 rewards"),
        ({"loss": math.nan}, "loss is not finite"),
        ({"grad_norm": math.inf}, "gradient norm is not finite"),
        ({"weights_finite": False}, "adapter weights are not finite"),
        ({"kl": 1.5}, "KL to the base model 1.5 exceeds gate_max_kl 1"),
        ({"kl": math.nan}, "KL to the base model nan"),
        ({"probe_rewards": (0.5, 0.5), "parent_probe_rewards": (0.75, 0.75)}, "probe reward fell from 0.75 to 0.5"),
        ({"probe_rewards": (0.5, math.nan), "parent_probe_rewards": (0.5, 0.5)}, "probe reward fell from 0.5 to nan"),
    ],
)
def test_each_failed_check_rejects_with_its_reason(change, expected):
    r = decide(with_(**change), LIMITS)
    assert not r.passed
    assert expected in r.reason, r.reason
    json.dumps(r.checks, allow_nan=False)


def test_reward_tolerance_is_inclusive_and_only_applies_with_both_probes():
    # parent 0.75, candidate 0.65: a drop of 0.10 is within the tolerance; 0.11 is not
    assert decide(with_(probe_rewards=(0.65,), parent_probe_rewards=(0.75,)), LIMITS).passed
    assert not decide(with_(probe_rewards=(0.64,), parent_probe_rewards=(0.75,)), LIMITS).passed
    assert decide(with_(probe_rewards=(0.0,), parent_probe_rewards=None), LIMITS).passed  # no scorer: no check
    r = decide(with_(probe_rewards=(0.65, 0.25), parent_probe_rewards=(0.75, 0.25)), LIMITS)
    assert r.checks["probe_reward"] == pytest.approx(0.45) and r.checks["parent_probe_reward"] == pytest.approx(0.5)
    assert r.checks["probe_rewards"] == [0.65, 0.25] and r.checks["limit_reward_z"] == 0.0


NOISY = GateLimits(max_kl=1.0, reward_tolerance=0.1, max_abs_reward=100.0, reward_z=1.0)


def test_one_probe_prompt_flipping_is_noise_a_fall_on_most_is_not():
    parent = (1.0, 1.0, 0.0, 1.0)
    one_flip = (0.0, 1.0, 0.0, 1.0)  # mean -0.25, standard error 0.25: allowed 0.35
    two_flips = (0.0, 0.0, 0.0, 1.0)  # mean -0.5, standard error ~0.29: allowed ~0.39
    assert not decide(with_(probe_rewards=one_flip, parent_probe_rewards=parent), LIMITS).passed  # z = 0: tolerance
    r = decide(with_(probe_rewards=one_flip, parent_probe_rewards=parent), NOISY)
    assert r.passed and r.checks["probe_drop_allowed"] == pytest.approx(0.35)
    r = decide(with_(probe_rewards=two_flips, parent_probe_rewards=parent), NOISY)
    assert not r.passed and "standard error 0.289 over 4 prompts" in r.reason, r.reason
    # every prompt falling by the same amount has no noise: the tolerance alone decides
    r = decide(with_(probe_rewards=(0.3, 0.3, 0.3), parent_probe_rewards=(0.5, 0.5, 0.5)), NOISY)
    assert not r.passed and r.checks["probe_drop_allowed"] == pytest.approx(0.1)
    # one prompt up and one down: no fall at all
    assert decide(with_(probe_rewards=(1.0, 0.0), parent_probe_rewards=(0.0, 1.0)), NOISY).passed


def test_paired_standard_error():
    assert paired_standard_error((0.0, 1.0, 0.0, 1.0), (1.0, 1.0, 0.0, 1.0)) == pytest.approx(0.25)
    assert paired_standard_error((0.5, 0.5), (0.5, 0.5)) == 0.0
    assert paired_standard_error((0.5,), (1.0,)) == 0.0  # one prompt: no spread to measure
    assert paired_standard_error((0.5, 0.5), (1.0,)) == 0.0  # not paired
    r = decide(with_(probe_rewards=(0.0, 0.0), parent_probe_rewards=(1.0, math.inf)), NOISY)
    assert not r.passed  # a non-finite allowance must not wave anything through


def test_all_failures_are_listed_together():
    r = decide(with_(loss=math.nan, kl=5.0, rewards=(math.inf,)), LIMITS)
    assert len(r.failures) == 3 and "poisoned" in r.reason and "loss" in r.reason and "KL" in r.reason


def test_probe_set_is_the_k_smallest_hashes_and_stable():
    seen = [f"prompt {i}" for i in range(20)]
    probes = update_probes((), seen, 4)
    assert len(probes) == 4 and len(set(probes)) == 4
    # order of arrival does not matter; seeing the same prompts again changes nothing
    assert update_probes((), list(reversed(seen)), 4) == probes
    assert update_probes(probes, seen[:5], 4) == probes
    assert update_probes((), ["", "a"], 4) == ("a",)
    assert update_probes(probes, seen, 0) == ()
    # a probe decodes its whole prompt: one too long for the context (an app's logged 100,000 tokens) is no probe,
    # nor one picked before
    long = "x" * 1000
    kept = update_probes((*probes[:3], long), [*seen, long], 4, fits=lambda p: len(p) < 100)
    assert long not in kept and len(kept) == 4 and kept == update_probes((), seen, 4)


# ---------------------------------------------------------------------------------------------------------
# Probe rewards


class FakePolicy:
    """Greedy-decodes every prompt to its own text upper-cased (no model)."""

    def generate(self, tenant, prompts, **kw):
        return [[Sample(text=p.upper(), token_ids=None, finished=True)] for p in prompts]

    def generate_grouped(self, groups, **kw):
        return [self.generate(tenant, prompts) for tenant, prompts in groups]


def fake_scorer_down_on(bad: str):
    """A scorer whose service fails on completion `bad` (rewards 1 otherwise)."""

    def score(completion: str, prompt: str) -> float:
        if completion == bad:
            raise ConnectionError("scoring service unavailable")
        return 1.0

    return score


def test_a_probe_whose_scorer_fails_raises_rather_than_scoring_0():
    """Counted 0, a scorer outage during the candidate's probe read as a fall in reward (the candidate
    rejected, its batch lost), and one during the parent's was cached as its rewards."""
    policy, scorer = FakePolicy(), fake_scorer_down_on("B")
    assert probe_rewards(policy, "acme", ["a", "c"], scorer, max_new_tokens=4) == (1.0, 1.0)
    with pytest.raises(ProbeScoringFailed, match=r"'acme'.*probe 2 of 3.*scoring service unavailable"):
        probe_rewards(policy, "acme", ["a", "b", "c"], scorer, max_new_tokens=4)


def test_in_a_grouped_probe_only_the_tenant_whose_scorer_failed_gets_the_error():
    policy = FakePolicy()
    acme, beta = probe_rewards_grouped(
        policy, [("acme", ["a", "b"], fake_scorer_down_on("B")), ("beta", ["a", "b"], fake_scorer_down_on("Z"))],
        max_new_tokens=4,
    )
    assert isinstance(acme, ProbeScoringFailed) and "'acme'" in str(acme)
    assert beta == (1.0, 1.0)


def test_a_prompt_left_unscored_is_left_out_of_the_comparison_on_both_sides():
    """A scorer that keeps failing on one probe answer: its prompt is compared on neither side (never 0)."""
    policy, scorer = FakePolicy(), fake_scorer_down_on("B")
    assert probe_rewards(policy, "acme", ["a", "b", "c"], LeaveUnscored(scorer), max_new_tokens=4) == (1.0, None, 1.0)
    # prompt 2 unscored on the candidate's side: only prompts 1 and 3 count, where nothing fell
    r = decide(with_(probe_rewards=(1.0, None, 1.0), parent_probe_rewards=(1.0, 1.0, 1.0)), LIMITS)
    assert r.passed and r.checks["probe_prompts_compared"] == 2 and r.checks["probe_reward"] == 1.0
    r = decide(with_(probe_rewards=(0.0, None, 1.0), parent_probe_rewards=(1.0, 0.0, 1.0)), LIMITS)
    assert not r.passed and "over 2 prompts" in r.failures[0]
    r = decide(with_(probe_rewards=(None, None), parent_probe_rewards=(1.0, None)), LIMITS)
    assert r.passed and r.checks["probe_prompts_compared"] == 0 and r.checks["probe_reward"] is None
