"""Two tenants with opposite objectives learn at the same time from the same base (tiny model, CPU).

Tenant "digits" is rewarded for the fraction of digits in its completions; tenant "letters" for upper-case
letters and against digits (reward = upper-case fraction x (1 - digit fraction)). Both train in turns on
one Policy (one base, two adapters), sampling on-policy with the learner's own model (LocalSampler) and
updating with GRPO (rollouts.train_step), exactly what rollouts mode does minus the serving tier.

The checks: each tenant's reward on its own objective rises clearly; the letters tenant produces no more
digits than the base did while the digits tenant floods with them; and a step of one tenant changes
nothing in the other's outputs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ingest.scorers import digits, uppercase
from learner.batch import pack
from learner.policy import Policy
from learner.rollouts import LocalSampler, SampleRequest, render_user_prompt, train_step
from learner.types import TenantSpec
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


def test_rollouts_train_on_the_sampled_tokens_weighed_by_their_sampled_log_probs(tiny_model):
    """A batch sampled ahead by an older version comes with that version's log-probs: the update's ratios
    use them (the clip acts), where taking the batch as on-policy (ratio 1) never clips. Without log-probs
    from the sampler, ratio 1 as before."""
    from learner.types import Sample

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
    # the "older policy" made every sampled token far less likely than the current one: r = e^2 > 1 + eps
    old = [Sample(s.text, s.token_ids, s.finished, logprobs=tuple(-30.0 for _ in s.token_ids)) for s in group]
    stale = step(old)
    assert stale.update.clip_frac > 0.3, stale.update
