"""Rollouts sampled at a temperature other than 1 train the policy that sampled them (tiny model, CPU).

The engine's log-probs are temperature 1's whatever the sampling temperature (vLLM's raw ones), so at
T != 1 they are not the behaviour policy's: the update uses softmax(logits / T) on both sides of the behaviour
weight, takes the current version's samples as on-policy, and recomputes an earlier version's log-probs from
that version's adapter files, leaving its samples out once those are gone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from learner.batch import pack
from learner.policy import Policy
from learner.rollouts import LocalSampler, NoUsableSamples, SampleRequest, all_stale, render_user_prompt, train_step
from learner.types import Sample, TenantSpec
from learner_support import LEARNABLE_TARGETS

pytestmark = pytest.mark.unit

T = 2.0


@pytest.fixture()
def policy(tiny_model):
    torch.manual_seed(0)
    policy = Policy(tiny_model, device="cpu")
    policy.add_tenant(replace(TenantSpec.default("acme"), target_modules=tuple(LEARNABLE_TARGETS)))
    return policy


def _batch(policy, prompt, samples):
    p_ids = policy.tokenizer(prompt, add_special_tokens=False).input_ids
    return pack([p_ids] * len(samples), [list(s.token_ids) for s in samples], pad_id=policy.pad_token_id, max_len=256)


def _step(policy, prompt, samples, *, current, version_files=None, temperature=T, scorer=lambda c, p: float(len(c) % 3)):
    snapshot = policy.snapshot("acme")
    try:
        return train_step(policy, "acme", [prompt], [samples], scorer,
                          current_version=current, max_staleness=4, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0,
                          max_len=256, temperature=temperature, version_files=version_files)
    finally:
        policy.restore("acme", snapshot)


def test_token_logprobs_at_a_temperature_are_those_of_the_tempered_softmax(policy):
    prompt = render_user_prompt(policy.tokenizer, "hello")
    (group,) = LocalSampler(policy).sample([SampleRequest("acme", "", prompt, 3, 8, T)])
    batch = _batch(policy, prompt, group)
    with policy.adapter("acme"), torch.no_grad():
        logits = policy._completion_logits(batch)
    expected = torch.log_softmax(logits / T, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    got = policy.token_logprobs(batch, "acme", temperature=T)
    mask = batch.completion_mask.bool()
    assert torch.allclose(got[mask], expected[mask], atol=1e-5)
    assert not torch.allclose(got[mask], policy.token_logprobs(batch, "acme")[mask], atol=1e-3)
    ref, _ = policy.base_reference(batch, temperature=T)
    assert torch.allclose(ref[mask], policy.token_logprobs(batch, None, temperature=T)[mask], atol=1e-5)


def test_current_versions_samples_are_on_policy_whatever_log_probs_the_sampler_gave(policy):
    prompt = render_user_prompt(policy.tokenizer, "hello")
    (group,) = LocalSampler(policy).sample([SampleRequest("acme", "", prompt, 4, 8, T)])
    # log-probs from the sampler far from the policy's: at T = 1 the behaviour weight's cap would cut most tokens
    given = [replace(s, version="acme@3", logprobs=tuple(-30.0 for _ in s.token_ids)) for s in group]
    at_one = _step(policy, prompt, given, current=3, temperature=1.0)
    assert at_one.update.clip_frac > 0.3
    tempered = _step(policy, prompt, given, current=3)
    assert tempered.update is not None and tempered.update.clip_frac == 0.0


def test_an_earlier_versions_samples_get_that_versions_log_probs_recomputed(policy, tmp_path):
    prompt = render_user_prompt(policy.tokenizer, "hello")
    (group,) = LocalSampler(policy).sample([SampleRequest("acme", "", prompt, 4, 8, T)])
    samples = [replace(s, version="acme@1", logprobs=tuple(-30.0 for _ in s.token_ids)) for s in group]
    same = tmp_path / "same"
    same.mkdir()
    policy.save_adapter("acme", same)
    weights = {n: p.detach().clone() for n, p in policy._params["acme"]}

    # version 1's files hold the current weights: the recomputed weight is 1, as for an on-policy batch
    result = _step(policy, prompt, samples, current=2, version_files={1: same}.get)
    assert result.update is not None and result.update.clip_frac == 0.0
    batch = _batch(policy, prompt, group)
    assert torch.allclose(policy.logprobs_of_version(batch, "acme", same, temperature=T),
                          policy.token_logprobs(batch, "acme", temperature=T))

    # version 1 far from the current weights: its log-probs differ, so the cap cuts some weights
    far = tmp_path / "far"
    far.mkdir()
    with torch.no_grad():
        for _, p in policy._params["acme"]:
            p.add_(torch.randn_like(p) * 0.5)
    policy.save_adapter("acme", far)
    with torch.no_grad():
        for n, p in policy._params["acme"]:
            p.copy_(weights[n])
    result = _step(policy, prompt, samples, current=2, version_files={1: far}.get)
    assert result.update.clip_frac > 0.0
    # the current weights are back after each recomputation
    assert all(torch.equal(p, weights[n]) for n, p in policy._params["acme"])

    # version 1's files gone: its samples are left out as stale, never trained with a weight of 1
    with pytest.raises(NoUsableSamples, match="adapter files are gone"):
        _step(policy, prompt, samples, current=2, version_files=lambda number: None)
    # at temperature 1 the sampler's log-probs are the behaviour policy's and no files are needed
    assert _step(policy, prompt, samples, current=2, version_files=lambda number: None, temperature=1.0).update


def test_the_base_models_samples_are_recomputed_without_files(policy, monkeypatch):
    """From the update's own base-model reference pass: no pass of their own, and the same update as
    one given the base model's tempered log-probs for them (the current version's rows on-policy)."""
    from learner import maths
    from learner.update import pg_update

    with torch.no_grad():  # the current version away from the base model
        for _, p in policy._params["acme"]:
            p.add_(torch.randn_like(p) * 0.5)
    prompt = render_user_prompt(policy.tokenizer, "hello")
    (group,) = LocalSampler(policy).sample([SampleRequest("acme", "", prompt, 4, 8, T)])
    # two made before the tenant's first version, two by the current one
    samples = [replace(s, version=None if i < 2 else "acme@1") for i, s in enumerate(group)]
    batch = _batch(policy, prompt, samples)
    base = policy.token_logprobs(batch, None, temperature=T)
    old = torch.full(base.shape, float("nan"))
    old[:2] = base[:2]
    def scorer(completion, _prompt):
        return (len(completion) % 3) - 1.0

    rewards = torch.tensor([scorer(s.text, prompt) for s in samples], dtype=torch.float64)
    assert len(set(rewards.tolist())) > 1, "the group needs different rewards to train"
    snapshot = policy.snapshot("acme")
    try:
        expected = pg_update(policy, "acme", batch, maths.grpo_advantages(rewards, torch.zeros(4, dtype=torch.long)).float(),
                             old_logprobs=old, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0, temperature=T)
    finally:
        policy.restore("acme", snapshot)

    def no_pass(*args, **kwargs):
        raise AssertionError("the base model's rows need no pass of their own")

    monkeypatch.setattr(policy, "logprobs_of_version", no_pass)
    result = _step(policy, prompt, samples, current=1, version_files=lambda number: None, scorer=scorer)
    assert result.update.grad_norm == pytest.approx(expected.grad_norm, rel=1e-4)
    assert result.update.pg_loss == pytest.approx(expected.pg_loss, rel=1e-4, abs=1e-7)
    on_policy = _step(policy, prompt, [replace(s, version="acme@1") for s in samples], current=1, scorer=scorer)
    assert result.update.grad_norm != pytest.approx(on_policy.update.grad_norm, rel=1e-4)


def test_a_batch_whose_every_sample_train_step_would_leave_out_counts_as_all_stale():
    """The loop samples such a batch again (a batch sampled ahead); at T != 1 a sample whose version's files
    are gone is left out by train_step, and all_stale missed it: the step failed instead."""
    samples = [[Sample(text="x", token_ids=None, finished=True, version="acme@1")] * 2]
    assert all_stale(samples, "acme", 2, 4, temperature=1.0) is None
    assert all_stale(samples, "acme", 2, 4, temperature=T, version_files={1: "/v1"}.get) is None
    assert "adapter files are gone" in all_stale(samples, "acme", 2, 4, temperature=T, version_files=lambda n: None)
    current = [[Sample(text="x", token_ids=None, finished=True, version="acme@2")]]
    assert all_stale(current, "acme", 2, 4, temperature=T, version_files=lambda n: None) is None
