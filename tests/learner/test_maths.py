"""learner/maths.py against numbers worked out by hand (the arithmetic is written beside each check)."""

from __future__ import annotations

import math

import pytest
import torch

from learner import maths

pytestmark = pytest.mark.unit


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=tol), (actual, expected)


def test_group_ids_number_keys_by_first_sight():
    assert maths.group_ids(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


def test_baseline_advantages_use_group_mean_for_groups_and_the_rest_of_the_batch_for_singletons():
    # prompts: p, p, q, p, r ; rewards 1, 0, 0.5, 0.5, 0.2 (sum 2.2) ; running baseline 0.3
    # group p = {1, 0, 0.5}, each against the mean of the other two: 1 - 0.25 = 0.75, 0 - 0.75 = -0.75,
    #   0.5 - 0.5 = 0.0
    # q and r are alone, each against the mean of the other four rewards:
    #   q: 0.5 - (2.2 - 0.5) / 4 = 0.5 - 0.425 = 0.075 ; r: 0.2 - (2.2 - 0.2) / 4 = 0.2 - 0.5 = -0.3
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2])
    groups = maths.group_ids(["p", "p", "q", "p", "r"])
    close(maths.baseline_advantages(rewards, groups, baseline=0.3), [0.75, -0.75, 0.075, 0.0, -0.3])
    # singletons only: leave-one-out means centre the batch whatever the running baseline says
    # rewards 0.1, 0.2, 0.3: 0.1 - 0.25 = -0.15, 0.2 - 0.2 = 0, 0.3 - 0.15 = 0.15
    close(maths.baseline_advantages(torch.tensor([0.1, 0.2, 0.3]), maths.group_ids(["a", "b", "c"]), baseline=0.9),
          [-0.15, 0.0, 0.15])
    # a batch of one has no peers: the running baseline, 0.5 - 0.3 = 0.2
    close(maths.baseline_advantages(torch.tensor([0.5]), maths.group_ids(["q"]), baseline=0.3), [0.2])


def test_grpo_advantages_normalise_by_group_sample_std():
    # group a = {1, 0, 0, 1}: mean 0.5, deviations +-0.5, sample var = 4 * 0.25 / 3 = 1/3, std = 0.57735
    #   -> +-0.5 / 0.57735 = +-0.866025
    # group b = {2, 2}: std 0 -> (2 - 2) / eps = 0
    # group c = {7} alone -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    close(maths.grpo_advantages(rewards, groups), [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0], tol=1e-4)


def test_grpo_advantages_without_scaling_are_the_rewards_minus_their_group_mean():
    # Dr. GRPO: group a = {0.5, 0.51} -> +-0.005 (scaled: +-0.005 / 0.0070711 = +-0.7071); b = {1, 0, 0, 1} ->
    # +-0.5; c alone -> 0
    rewards = torch.tensor([0.5, 0.51, 1.0, 0.0, 0.0, 1.0, 7.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 1, 1, 2])
    close(maths.grpo_advantages(rewards, groups, scale=False), [-0.005, 0.005, 0.5, -0.5, -0.5, 0.5, 0], tol=1e-9)
    close(maths.grpo_advantages(rewards, groups)[:2], [-0.7070, 0.7070], tol=1e-3)
    equal = torch.full((8,), 0.7, dtype=torch.float64)
    assert maths.grpo_advantages(equal, torch.zeros(8, dtype=torch.long), scale=False).abs().max().item() == 0.0


@pytest.mark.parametrize("value, n", [(0.1, 3), (0.7, 8), (1 / 3, 5), (123.456, 4)])
def test_grpo_advantages_of_equal_rewards_are_exactly_zero_whatever_the_rounding(value, n):
    # the mean of n equal floats is not always exactly that float (0.7 * 8 / 8 = 0.7 - 1e-16); a group without
    # contrast must still give exactly 0, or rollouts.train_step would train on rounding noise
    rewards = torch.full((n,), value, dtype=torch.float64)
    assert maths.grpo_advantages(rewards, torch.zeros(n, dtype=torch.long)).abs().max().item() == 0.0


def test_scale_by_std_divides_by_the_sample_std_without_recentring():
    # advantages 0.3, -0.1, 0.1, 0.1: mean 0.1, deviations 0.2, -0.2, 0, 0 -> sample var 0.08 / 3, std 0.163299
    #   -> 0.3 / 0.163299 = 1.837117, -0.1 / 0.163299 = -0.612372, 0.1 / 0.163299 = 0.612372
    close(maths.scale_by_std(torch.tensor([0.3, -0.1, 0.1, 0.1])), [1.837117, -0.612372, 0.612372, 0.612372], tol=1e-4)
    # all equal or a single value: unchanged (no signal to scale)
    close(maths.scale_by_std(torch.tensor([0.5, 0.5])), [0.5, 0.5])
    close(maths.scale_by_std(torch.tensor([2.0])), [2.0])


def test_scale_by_std_of_the_rewards_leaves_an_all_equal_batch_unscaled():
    # rewards 0, 0, 0, 0 against a running mean of 0.002 (singletons) or a group mean of 0 (the pair):
    # advantages -0.002, -0.002, 0, 0 are baseline noise; their own std (0.0011547) would blow them up to
    # -1.73, but the rewards' std is 0, so they stay as they are
    advantages = torch.tensor([-0.002, -0.002, 0.0, 0.0])
    close(maths.scale_by_std(advantages, torch.zeros(4)), [-0.002, -0.002, 0.0, 0.0])
    # rewards 0.05, 0, 0, 0: sample std 0.025 -> advantages 0.048, -0.002, 0, 0 become 1.92, -0.08, 0, 0
    close(maths.scale_by_std(torch.tensor([0.048, -0.002, 0.0, 0.0]), torch.tensor([0.05, 0.0, 0.0, 0.0])),
          [1.92, -0.08, 0.0, 0.0], tol=1e-4)


def test_running_mean_starts_at_batch_mean_then_moves_by_momentum():
    # first batch mean (0 + 1) / 2 = 0.5 ; next 0.9 * 0.5 + 0.1 * 1.0 = 0.55
    first = maths.running_mean(None, torch.tensor([0.0, 1.0]))
    assert first == pytest.approx(0.5)
    assert maths.running_mean(first, torch.tensor([1.0, 1.0])) == pytest.approx(0.55)
    # non-finite rewards are ignored: mean of {1.0} = 1.0 -> 0.9 * 0.5 + 0.1 = 0.55
    assert maths.running_mean(0.5, torch.tensor([float("nan"), 1.0])) == pytest.approx(0.55)
    assert maths.running_mean(0.5, torch.tensor([float("nan")])) == 0.5


def test_importance_ratio():
    # exp(log 0.5 - log 0.25) = 2 ; exp(0) = 1
    close(maths.importance_ratio(torch.tensor([math.log(0.5), -1.0]), torch.tensor([math.log(0.25), -1.0])), [2.0, 1.0])


def test_behaviour_weights_are_the_ratio_to_the_sampler_truncated_at_the_cap():
    # pi_prox / mu per token: 4 (cut to the cap 2), 2 (exactly the cap: not cut), 0.5 (kept: the sampler
    # made the token likelier than pi_prox does), 1 (on-policy)
    proximal = torch.tensor([[math.log(0.8), math.log(0.4), math.log(0.1), -1.0]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.2), -1.0]])
    weight, truncated = maths.behaviour_weights(proximal, behaviour, cap=2.0)
    close(weight, [[2.0, 2.0, 0.5, 1.0]])
    assert truncated.tolist() == [[True, False, False, False]]
    assert not weight.requires_grad  # it scales each token's gradient, it has none of its own
    # a sampler that made a token impossibly unlikely: the weight stays at the cap, finite
    weight, _ = maths.behaviour_weights(torch.zeros(1, 1), torch.tensor([[-1e4]]), cap=2.0)
    close(weight, [[2.0]])
    with pytest.raises(ValueError, match="at least 1"):
        maths.behaviour_weights(proximal, behaviour, cap=0.5)


def test_learner_config_default_cap_is_the_maths_default():
    from clora.config import LearnerConfig

    assert LearnerConfig().behaviour_weight_cap == maths.BEHAVIOUR_WEIGHT_CAP


def test_clipped_pg_loss_by_hand():
    # eps = 0.2. Tokens (ratio, advantage):
    #  r=1.5, A=+1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped (r > 1.2 and A > 0)
    #  r=0.5, A=+1: min(0.5, 0.8) = 0.5 -> loss -0.5, not clipped (the unclipped term is active)
    #  r=1.5, A=-2: min(-3.0, -2.4) = -3.0 -> loss 3.0, not clipped
    #  r=0.5, A=-2: min(-1.0, -1.6) = -1.6 -> loss 1.6, clipped (r < 0.8 and A < 0)
    ratio = torch.tensor([[1.5, 0.5], [1.5, 0.5]])
    old = torch.zeros(2, 2)
    logp = ratio.log()
    adv = torch.tensor([1.0, -2.0])  # per sequence, broadcast over tokens
    loss, clipped = maths.clipped_pg_loss(logp, old, adv, clip_eps=0.2)
    close(loss, [[-1.2, -0.5], [3.0, 1.6]])
    assert clipped.tolist() == [[True, False], [False, True]]
    # a ratio of 1 is the plain policy gradient: loss = -A
    loss, clipped = maths.clipped_pg_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([0.7]), 0.2)
    close(loss, [[-0.7, -0.7, -0.7]])
    assert not clipped.any()


def test_clipped_pg_loss_gradient_is_advantage_weighted_ratio():
    # d/dlogp of -(r * A) at r = 1 is -A ; a clipped token gets no gradient
    logp = torch.tensor([[0.0, math.log(1.5)]], requires_grad=True)
    loss, _ = maths.clipped_pg_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), 0.2)
    loss.sum().backward()
    close(logp.grad, [[-2.0, 0.0]])


def test_the_dual_clip_bounds_a_negative_advantage_tokens_loss_and_gradient():
    # eps 0.2, dual clip c = 3, A = -2. Tokens by ratio:
    #  r=2: PPO's min(-4.0, -2.4) = -4.0 -> loss 4.0; under the bound -c*A = 6: kept, gradient r*|A| flows
    #  r=5: PPO's loss 10.0 -> capped at 6.0, no gradient (and counted as clipped)
    #  r=e^30: the log-ratio is capped at 20 before exp: finite, capped at 6.0
    logp = torch.tensor([[math.log(2.0), math.log(5.0), 30.0]], requires_grad=True)
    loss, clipped = maths.clipped_pg_loss(logp, torch.zeros(1, 3), torch.tensor([-2.0]), 0.2)
    close(loss, [[4.0, 6.0, 6.0]])
    assert clipped.tolist() == [[False, True, True]]
    loss.sum().backward()
    close(logp.grad, [[4.0, 0.0, 0.0]])  # d/dlogp of -(r * A) = -A * r = 2 * 2
    # a positive advantage is untouched by the dual clip: r=5, A=+1 -> PPO's clip, -1.2
    loss, _ = maths.clipped_pg_loss(torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1), torch.tensor([1.0]), 0.2)
    close(loss, [[-1.2]])


def test_a_non_finite_value_at_a_masked_position_counts_nothing():
    values, mask = torch.tensor([[1.0, math.inf]]), torch.tensor([[1.0, 0.0]])
    assert float(maths.masked_mean(values, mask)) == 1.0 and float(maths.masked_sum(values, mask)) == 1.0
    assert float(maths.aggregate(values, mask, "seq-mean")) == 1.0


def test_kl_estimators_by_hand():
    # pi(x) = 0.5, ref(x) = 0.25: log r = log(0.25/0.5) = -log 2 = -0.693147
    #  k1 = -log r = 0.693147 ; k2 = 0.5 * 0.693147^2 = 0.240227 ; k3 = (0.5 - 1) + 0.693147 = 0.193147
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    close(maths.kl_k1(logp, ref), [0.693147])
    close(maths.kl_k2(logp, ref), [0.240227])
    close(maths.kl_k3(logp, ref), [0.193147])
    # identical distributions: every estimator is 0
    for fn in (maths.kl_k1, maths.kl_k2, maths.kl_k3):
        close(fn(ref, ref), [0.0])


def test_k3_is_unbiased_for_kl_on_a_small_distribution():
    # pi = (0.5, 0.5), ref = (0.25, 0.75): KL(pi||ref) = 0.5 ln 2 + 0.5 ln(2/3) = 0.346574 - 0.202733 = 0.143841
    # E_pi[k3] = 0.5 * ((0.5 - 1) - ln 0.5) + 0.5 * ((1.5 - 1) - ln 1.5) = 0.5 * 0.193147 + 0.5 * 0.094535 = 0.143841
    pi, ref = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.25, 0.75]).log()
    expectation = (pi.exp() * maths.kl_k3(pi, ref)).sum()
    close(expectation, 0.143841)
    close((pi.exp() * maths.kl_k1(pi, ref)).sum(), 0.143841)


def test_exact_kl_over_the_vocabulary_by_hand():
    # the same pi = (0.5, 0.5), ref = (0.25, 0.75): 0.143841 (above); a second position where they agree: 0
    pi = torch.tensor([[0.5, 0.5], [0.3, 0.7]]).log()
    ref = torch.tensor([[0.25, 0.75], [0.3, 0.7]]).log()
    close(maths.kl_exact(pi, ref), [0.143841, 0.0])
    # it does not blow up where a token became unlikely: pi = (0.999, 0.001), ref = (0.5, 0.5)
    # KL = 0.999 ln 1.998 + 0.001 ln 0.002 = 0.691455 - 0.006215 = 0.685240, while k3 on the second token
    # (sampled by another policy) is 500 - 1 - ln 500 = 492.785
    pi, ref = torch.tensor([0.999, 0.001]).log(), torch.tensor([0.5, 0.5]).log()
    close(maths.kl_exact(pi, ref), 0.685240, tol=1e-5)
    close(maths.kl_k3(pi[1:], ref[1:]), [492.785], tol=1e-2)


def test_k3_at_a_padded_position_puts_no_nan_in_the_gradient():
    # a padded position (mask 0) where the reference is 200 nats above the policy: exp overflows there
    logp = torch.tensor([[-1.0, -200.0]], requires_grad=True)
    ref, mask = torch.tensor([[-0.5, 0.0]]), torch.tensor([[1, 0]])
    loss = maths.masked_mean(maths.kl_k3(logp, ref), mask)
    loss.backward()
    assert logp.grad[0, 1].isnan(), "the masked sum alone keeps the overflow out of the value, not the gradient"
    logp.grad = None
    k3 = maths.kl_k3(logp, ref, mask)
    assert k3[0, 1] == 0.0
    close(k3[0, :1], [math.expm1(0.5) - 0.5])
    maths.masked_mean(k3, mask).backward()
    assert logp.grad.isfinite().all() and logp.grad[0, 1] == 0.0
    close(logp.grad[0, :1], [1 - math.exp(0.5)])  # d/dlogp (e^(ref - logp) - 1 - (ref - logp))


def test_token_mean_and_seq_mean_differ_as_expected():
    # seq 0 has tokens 1, 2, 3 ; seq 1 has token 10 (then padding, which must not count)
    # token-mean = (1 + 2 + 3 + 10) / 4 = 4.0
    # seq-mean   = ((1 + 2 + 3) / 3 + 10 / 1) / 2 = (2 + 10) / 2 = 6.0
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    close(maths.aggregate(values, mask, "token-mean"), 4.0)
    close(maths.aggregate(values, mask, "seq-mean"), 6.0)
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        maths.aggregate(values, mask, "sum")


def test_empty_mask_gives_zero_not_nan():
    values = torch.tensor([[5.0, 5.0]])
    mask = torch.zeros(1, 2)
    close(maths.masked_mean(values, mask), 0.0)
    close(maths.aggregate(values, mask, "seq-mean"), 0.0)


def test_clip_fraction_counts_only_real_tokens():
    # clipped on 1 of the 3 real tokens; the clipped padding token does not count -> 1/3
    clipped = torch.tensor([[True, False, False, True]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    close(maths.clip_fraction(clipped, mask), 1 / 3)


def test_entropy_is_log_v_for_uniform_logits_and_zero_for_one_sure_token():
    close(maths.entropy(torch.zeros(2, 8)), [math.log(8)] * 2)  # uniform over 8: log 8 = 2.079 nats
    close(maths.entropy(torch.tensor([[0.0, -1e4, -1e4]])), [0.0])  # all the mass on one token
    # p = (1/2, 1/4, 1/4): -(1/2 log 1/2 + 2 x 1/4 log 1/4) = 1.5 log 2 = 1.0397
    close(maths.entropy(torch.log(torch.tensor([0.5, 0.25, 0.25]))), 1.5 * math.log(2))


# --- the serving engine's sampling distribution ----------------------------------------------------------


def _one(logits, token, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, bias=None):
    """processed_logprobs of one token at one position, under one row's settings."""
    return maths.processed_logprobs(
        torch.tensor([[logits]]), torch.tensor([[token]]), torch.tensor([temperature]), torch.tensor([top_k]),
        torch.tensor([top_p]), torch.tensor([min_p]), None if bias is None else torch.tensor([bias]),
    ).item()


def test_processed_logprobs_by_hand():
    logits = [2.0, 1.0, 0.0, -1.0]
    z = sum(math.exp(x) for x in logits)  # probabilities 0.644, 0.237, 0.087, 0.032
    assert _one(logits, 1) == pytest.approx(1.0 - math.log(z), abs=1e-6)  # temperature 1, nothing cut: raw
    z_half = sum(math.exp(2 * x) for x in logits)
    assert _one(logits, 1, temperature=0.5) == pytest.approx(2.0 - math.log(z_half), abs=1e-6)
    # top-k 2 keeps tokens 0 and 1, renormalised
    assert _one(logits, 1, top_k=2) == pytest.approx(1.0 - math.log(math.exp(2) + math.exp(1)), abs=1e-6)
    # top-p 0.7: 0.644 alone falls short, 0.644 + 0.237 reaches it; the same two tokens
    assert _one(logits, 0, top_p=0.7) == pytest.approx(2.0 - math.log(math.exp(2) + math.exp(1)), abs=1e-6)
    # min-p 0.1: a token below 0.1 x 0.644 is cut (token 3 at 0.032), token 2 (0.087) stays
    assert _one(logits, 2, min_p=0.1) == pytest.approx(0.0 - math.log(math.exp(2) + math.exp(1) + 1), abs=1e-6)
    # logit_bias is added before the temperature
    assert _one(logits, 3, temperature=0.5, bias=[0.0, 0.0, 0.0, 3.0]) == pytest.approx(
        4.0 - math.log(math.exp(4) + math.exp(2) + 1 + math.exp(4)), abs=1e-6)
    # greedy: the argmax, drawn with probability 1; a temperature in (0, 0.01) is drawn at 0.01, as vLLM does
    assert _one(logits, 0, temperature=0.0) == 0.0
    assert _one(logits, 1, temperature=1e-6) == pytest.approx(_one(logits, 1, temperature=0.01)) == pytest.approx(
        -100.0, abs=1e-3)
    # a token the masks cut (the engine's logits differed a little) keeps its own mass, never probability 0
    cut = _one(logits, 3, top_k=2)
    assert math.isfinite(cut) and cut == pytest.approx(-1.0 - math.log(math.exp(2) + math.exp(1) + math.exp(-1)), abs=1e-6)


def test_processed_logprobs_are_vllms_sampling_distribution(monkeypatch):
    """The same settings through vLLM's own pieces (SamplingParams' temperature, its min-p processor's rule,
    its top-k/top-p masking), per row of a mixed batch: the recomputed behaviour is the engine's; and the
    same in chunks of a few positions, padding left out."""
    from vllm import SamplingParams
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    b, c, v = 6, 4, 64
    logits = torch.randn(b, c, v) * 3
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 1.0, 0.004])
    top_k = torch.tensor([0, 5, -1, 10, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.95, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.2, 0.0])
    engine_temperature = torch.tensor([SamplingParams(temperature=float(t)).temperature for t in temperature])
    x = (logits / engine_temperature[:, None, None]).reshape(b * c, v)
    rows_min_p = min_p.repeat_interleave(c)[:, None]
    probs = x.softmax(-1)
    x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * rows_min_p, -math.inf)
    k = torch.where(top_k > 0, top_k, v).repeat_interleave(c)
    engine = torch.log_softmax(apply_top_k_top_p_pytorch(x, k, top_p.repeat_interleave(c)), -1)
    tokens = torch.multinomial(engine.exp(), 1).reshape(b, c)  # what the engine would draw
    expected = engine.gather(1, tokens.reshape(-1, 1)).reshape(b, c)
    got = maths.processed_logprobs(logits, tokens, temperature, top_k, top_p, min_p)
    assert torch.allclose(got, expected, atol=1e-5)
    monkeypatch.setattr(maths, "PROCESSED_CHUNK", 3 * v)  # three positions at a time
    mask = torch.ones(b, c)
    mask[:, -1] = 0  # padding
    chunked = maths.processed_logprobs(logits, tokens, temperature, top_k, top_p, min_p, mask=mask)
    assert torch.allclose(chunked[:, :-1], expected[:, :-1], atol=1e-5) and (chunked[:, -1] == 0).all()
    assert not torch.allclose(got, torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1), atol=1e-2)


def test_processed_logprobs_apply_min_tokens_and_the_penalties_as_vllm_does(monkeypatch):
    """Penalties and min_tokens depend on the tokens so far: each position's distribution through vLLM's own
    apply_penalties (prompt and completion-so-far counts) and its min-tokens rule (the stop tokens cut before
    min_tokens), with a logit bias, then the temperature and top-k/top-p, against processed_logprobs over the
    whole completion at once; tokens drawn position by position from that distribution, as the engine would."""
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(1)
    b, c, v = 5, 7, 40
    logits = torch.randn(b, c, v) * 2
    prompts = [[1, 2, 3], [4, 4, 9, 30, 31], [7], [0, 5, 6, 7, 8, 9], [12, 13]]
    prompt_ids = torch.full((b, 6), -1)
    for i, p in enumerate(prompts):
        prompt_ids[i, : len(p)] = torch.tensor(p)
    stops = torch.tensor([[2, -1], [2, 17], [2, -1], [2, 3], [2, -1]])
    history = maths.History(prompt_ids=prompt_ids, stops=stops, min_tokens=torch.tensor([0, 3, 7, 2, 0]),
                            presence=torch.tensor([0.5, 0.0, -0.4, 1.5, 0.0]),
                            frequency=torch.tensor([0.0, 0.8, 0.3, -1.0, 0.0]),
                            repetition=torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0]))
    temperature = torch.tensor([0.8, 1.0, 1.2, 0.6, 1.0])
    top_k = torch.tensor([0, 10, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0])
    bias = torch.zeros(b, v)
    bias[:, 5] = 2.0
    tokens = torch.zeros(b, c, dtype=torch.long)
    expected = torch.zeros(b, c)
    for j in range(c):  # the engine's step j: every row's logits through vLLM's pieces, then a draw
        x = logits[:, j] + bias
        for i in range(b):
            if j < history.min_tokens[i]:
                x[i, [s for s in stops[i].tolist() if s >= 0]] = -math.inf
        x = apply_penalties(x, prompt_ids.masked_fill(prompt_ids < 0, v), tokens[:, :j], history.presence,
                            history.frequency, history.repetition)
        engine = torch.log_softmax(apply_top_k_top_p_pytorch(x / temperature[:, None], torch.where(top_k > 0, top_k, v),
                                                             top_p), -1)
        tokens[:, j] = torch.multinomial(engine.exp(), 1).squeeze(1)
        expected[:, j] = engine.gather(1, tokens[:, j : j + 1]).squeeze(1)
    zeros = torch.zeros(b)
    got = maths.processed_logprobs(logits, tokens, temperature, top_k, top_p, zeros, bias, history=history)
    assert torch.allclose(got, expected, atol=1e-5)
    # the stop tokens were cut before min_tokens: none drawn there, and a stop had mass where it was not cut
    assert not any(tokens[i, j] in stops[i] for i in range(b) for j in range(int(history.min_tokens[i])))
    plain = maths.processed_logprobs(logits, tokens, temperature, top_k, top_p, zeros, bias)
    for i in range(4):  # the rows with penalties or min_tokens are not the plain distribution; the last is
        assert not torch.allclose(got[i], plain[i], atol=1e-3), i
    assert torch.allclose(got[4], plain[4], atol=1e-6)
    monkeypatch.setattr(maths, "PROCESSED_CHUNK", 3 * v)  # a few positions at a time, from different rows
    chunked = maths.processed_logprobs(logits, tokens, temperature, top_k, top_p, zeros, bias, history=history)
    assert torch.allclose(chunked, expected, atol=1e-5)
    # a stop token sampled before min_tokens (the engine's logits differ by a rounding) is not given
    # probability 0: the engine drew it, so it had passed the cut
    early_stop = tokens.clone()
    early_stop[1, 0] = 17
    got = maths.processed_logprobs(logits, early_stop, temperature, top_k, top_p, zeros, bias, history=history)
    assert torch.isfinite(got).all() and got[1, 0] < 0
