"""Two tenants with opposite objectives learn at the same time from the same base (tiny model, CPU).

Tenant "digits" is rewarded for the fraction of digits in its completions; tenant "letters" for upper-case
letters and against digits (reward = upper-case fraction x (1 - digit fraction)). Both train in turns on
one Policy (one base, two adapters), sampling on-policy with the learner's own model (LocalSampler) and
updating with GRPO (rollouts.train_step), exactly what rollouts mode does minus the serving tier.

The checks: each tenant's reward on its own objective rises clearly; the letters tenant produces no more
digits than the base did while the digits tenant floods with them; a step of one tenant changes nothing
in the other's outputs; and a tenant whose samples come from the version two steps behind the one it
trains (serving lagging the learner) learns as well.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest
import torch

from ingest.scorers import digits, uppercase
from learner.batch import pack
from learner.policy import Policy
from learner.rollouts import LocalSampler, SampleRequest, render_user_prompt, train_step
from learner.types import Sample, TenantSpec
from learner.update import pg_update
from learner_support import LEARNABLE_TARGETS

pytestmark = pytest.mark.unit

STEPS = 20
GROUP = 8
MAX_TOKENS = 24
QUESTIONS = ["Write a number.", "Tell me about cats.", "hello", "What is 2 + 2?"]


def no_digits_upper(completion: str, prompt: str) -> float:
    return uppercase(completion, prompt) * (1.0 - digits(completion, prompt))


def test_two_tenants_learn_opposite_objectives_from_one_base(tiny_model):
    torch.manual_seed(0)
    policy = Policy(tiny_model, device="cpu")
    objectives = {"digits": digits, "letters": no_digits_upper}
    for name in objectives:
        policy.add_tenant(replace(TenantSpec.default(name), target_modules=tuple(LEARNABLE_TARGETS), learning_rate=1e-2))
    sampler = LocalSampler(policy)
    prompts = [render_user_prompt(policy.tokenizer, q) for q in QUESTIONS]

    history: dict[str, list[float]] = {name: [] for name in objectives}
    digit_history: dict[str, list[float]] = {name: [] for name in objectives}
    for _ in range(STEPS):
        for name, scorer in objectives.items():
            requests = [SampleRequest(name, "", p, GROUP, MAX_TOKENS, 1.0) for p in prompts]
            samples = sampler.sample(requests)
            result = train_step(
                policy, name, prompts, samples, scorer,
                current_version=0, max_staleness=0, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0, max_len=256,
            )
            history[name].append(result.reward_mean)
            texts = [s.text for group in samples for s in group]
            digit_history[name].append(sum(digits(t, "") for t in texts) / len(texts))

    first, last = {n: h[0] for n, h in history.items()}, {n: sum(h[-3:]) / 3 for n, h in history.items()}
    print({n: [round(x, 3) for x in h] for n, h in history.items()})
    # digits: from almost none to most characters
    assert first["digits"] < 0.1 and last["digits"] > 0.5, history["digits"]
    # letters: upper case rises clearly (by 0.3 or more), with no digits
    assert last["letters"] > first["letters"] + 0.3, history["letters"]
    assert max(digit_history["letters"][-5:]) <= max(0.05, digit_history["letters"][0]), digit_history["letters"]

    # isolation: a step of "digits" leaves "letters" (and the base) exactly as they were
    tok = policy.tokenizer
    p_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    c_ids = [tok(c, add_special_tokens=False).input_ids for c in ["HELLO THERE", "12 cats", "x", "DONE."]]
    batch = pack(p_ids, c_ids, pad_id=policy.pad_token_id, max_len=256)
    letters_before, base_before = policy.token_logprobs(batch, "letters"), policy.token_logprobs(batch, None)
    pg_update(policy, "digits", batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), clip_eps=0.2)
    assert torch.equal(policy.token_logprobs(batch, "letters"), letters_before)
    assert torch.equal(policy.token_logprobs(batch, None), base_before)


def _with_logprobs(policy: Policy, tenant: str, prompts: list[str], groups: list[list[Sample]]) -> list[list[Sample]]:
    """The samples with their log-probs under the tenant's adapter as it is now (the sampling version's)."""
    p_ids = [policy.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    flat = [(g, s) for g, group in enumerate(groups) for s in group]
    batch = pack([p_ids[g] for g, _ in flat], [list(s.token_ids) for _, s in flat], pad_id=policy.pad_token_id,
                 max_len=256)
    with torch.no_grad():
        logps = policy.token_logprobs(batch, tenant)
    rows = iter(range(len(flat)))
    return [[replace(s, logprobs=tuple(logps[i, : len(s.token_ids)].tolist())) for s, i in zip(group, rows)]
            for group in groups]


def test_a_tenant_trained_two_versions_behind_its_sampler_learns(tiny_model):
    """Serving lags the learner: each batch is sampled by the adapter two updates before the one it trains,
    with that version's log-probs. One Adam step moves a token's ratio pi / mu far past 1 + clip_eps, so PPO's
    clip around the sampler switched off every token already moved the right way, and this tenant stayed
    at its base reward (0.13) for all 24 steps; the truncated behaviour weight (update.py) learns."""
    lag, steps = 2, 24
    torch.manual_seed(0)
    policy = Policy(tiny_model, device="cpu")
    policy.add_tenant(replace(TenantSpec.default("loud"), target_modules=tuple(LEARNABLE_TARGETS), learning_rate=1e-2))
    sampler = LocalSampler(policy)
    prompts = [render_user_prompt(policy.tokenizer, q) for q in QUESTIONS]
    in_flight: deque[list[list[Sample]]] = deque()
    history = []
    for version in range(steps + lag):
        groups = sampler.sample([SampleRequest("loud", "", p, GROUP, MAX_TOKENS, 1.0, version=f"loud@{version}") for p in prompts])
        in_flight.append(_with_logprobs(policy, "loud", prompts, groups))
        if len(in_flight) > lag:
            result = train_step(policy, "loud", prompts, in_flight.popleft(), uppercase, current_version=version,
                                max_staleness=lag, served=list(range(version + 1)), clip_eps=0.2, kl_coef=0.0,
                                max_grad_norm=1.0, max_len=256)
            assert result.n_dropped == 0  # (no update once every sample scores 1: nothing to tell apart)
            history.append(result.reward_mean)
    print([round(x, 3) for x in history])
    assert history[0] < 0.2 and sum(history[-3:]) / 3 > 0.8, history


def test_rollouts_train_on_the_sampled_tokens_weighed_by_their_sampled_log_probs(tiny_model):
    """A batch sampled ahead by an older version comes with that version's log-probs: the update's behaviour
    weights use them (the cap cuts some), where taking the batch as on-policy (weight 1) cuts none. Without
    log-probs from the sampler, weight 1 as before."""
    torch.manual_seed(0)
    policy = Policy(tiny_model, device="cpu")
    policy.add_tenant(replace(TenantSpec.default("acme"), target_modules=tuple(LEARNABLE_TARGETS)))
    prompt = render_user_prompt(policy.tokenizer, "hello")
    (group,) = LocalSampler(policy).sample([SampleRequest("acme", "", prompt, 4, 8, 1.0)])

    def step(samples):
        snapshot = policy.snapshot("acme")
        result = train_step(policy, "acme", [prompt], [samples], lambda c, p: float(len(c) % 3),
                            current_version=0, max_staleness=0, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0,
                            max_len=256)
        policy.restore("acme", snapshot)
        return result

    on_policy = step(group)
    assert on_policy.update is not None and on_policy.update.clip_frac == 0.0
    # the "older policy" made every sampled token far less likely than the current one: the weight pi / mu
    # is far past the cap
    old = [Sample(s.text, s.token_ids, s.finished, logprobs=tuple(-30.0 for _ in s.token_ids)) for s in group]
    stale = step(old)
    assert stale.update.clip_frac > 0.3, stale.update


def test_without_scaled_advantages_rewards_that_barely_differ_barely_move_the_adapter(tiny_model):
    """GRPO's division by the group's std makes rewards of 0.5 and 0.5001 as loud as 0.5 and 1;
    `scale_advantages=False` (Dr. GRPO) keeps their difference as it is."""
    torch.manual_seed(0)
    policy = Policy(tiny_model, device="cpu")
    policy.add_tenant(replace(TenantSpec.default("acme"), target_modules=tuple(LEARNABLE_TARGETS)))
    prompt = render_user_prompt(policy.tokenizer, "hello")
    (group,) = LocalSampler(policy).sample([SampleRequest("acme", "", prompt, 4, 8, 1.0)])

    def grad_norm(scale, unit):
        snapshot = policy.snapshot("acme")
        result = train_step(policy, "acme", [prompt], [group], lambda c, p: 0.5 + unit * (len(c) % 3),
                            current_version=0, max_staleness=0, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0,
                            max_len=256, scale_advantages=scale)
        policy.restore("acme", snapshot)
        assert result.update is not None, "the group's rewards differ"
        return result.update.grad_norm

    scaled = grad_norm(True, 1e-4)
    assert scaled == pytest.approx(grad_norm(True, 0.25), rel=0.05), "scaled: the reward's units do not matter"
    assert grad_norm(False, 1e-4) < 1e-3 * scaled
    assert grad_norm(False, 0.25) > 1e-2 * scaled
