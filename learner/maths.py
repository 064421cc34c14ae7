"""The learner's maths: advantages, importance ratios and weights, the clipped policy-gradient loss, KL
estimators, and the serving engine's sampling distribution as a function of the logits.

Every function here is tensor-in, tensor-out: no model, no tokenizer, no I/O, no config. Shapes follow one
convention: per-sequence values are `[B]`, per-token values are `[B, T]` with a 0/1 `mask` of the same shape
marking real completion tokens (padding is 0). Log-probabilities are natural logs of the probability of
the token that was actually sampled.

What is deliberately not here: how logits and log-probs are computed (policy.py), where rewards come from
(logs_mode.py, rollouts.py) and what a step does with the loss (update.py).

References: the clipped surrogate is PPO's (Schulman et al. 2017); splitting it into a proximal policy (the
clip's centre) and a behaviour policy (the one that sampled, corrected by an importance weight) is the
decoupled objective of Hilton et al. 2021, "Batch size-invariance for policy optimization"; truncating
that weight at a constant is IMPALA's (Espeholt et al. 2018, V-trace); group-normalised advantages are
GRPO's (Shao et al. 2024, DeepSeekMath); the k1/k2/k3 KL estimators are from Schulman's note
"Approximating KL divergence" (2020).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean"]

# ---------------------------------------------------------------------------------------------------------
# Advantages


def group_ids(keys: list[str]) -> Tensor:
    """Integer group id per element: equal keys (say, equal prompts) share an id, numbered by first sight."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(k, len(seen)) for k in keys], dtype=torch.long)


def _group_stats(rewards: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per element: its group's size, mean and sample standard deviation (0 for groups of one)."""
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    size = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, groups, torch.ones_like(rewards))
    total = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, groups, rewards)
    mean = total / size
    sq_dev = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, groups, (rewards - mean[groups]) ** 2)
    var = sq_dev / (size - 1).clamp(min=1)
    return size[groups], mean[groups], var.sqrt()[groups]


def baseline_advantages(rewards: Tensor, groups: Tensor, baseline: float) -> Tensor:
    """reward - baseline, where the baseline is the mean of the group's other rewards for groups of two or
    more, the mean of the batch's other rewards for an element alone in its group (leave-one-out both, as
    RLOO), and `baseline` (a running mean the caller keeps) only in a batch of one.

    The group's baseline is the better one when it exists (same prompt, several completions: the prompt's
    own difficulty cancels). Leaving the element out of its own baseline keeps it unbiased and weighs a pair
    as much as a lone completion (the group mean with the element in would scale a group of n by (n-1)/n).
    A single completion has no such peer, so it is compared with the rest of its batch:
    that baseline is as fresh as the rewards themselves, so the batch's advantages are centred. A running
    mean lags whenever the reward moves; with the advantages then scaled by the batch's std (often small),
    that lag made every advantage of a batch the same sign, 2 std or more off. The update then pushed every
    sampled completion up or down alike, which carries no contrast, and Adam turned that noise into full-size
    steps: a demo tenant drifted to KL 4 while its reward fell from 0.15 to 0.08.
    """
    size, mean, _ = _group_stats(rewards, groups)
    group_others = (mean * size - rewards) / (size - 1).clamp(min=1)
    n = rewards.numel()
    if n >= 2:
        others = (rewards.sum() - rewards) / (n - 1)
    else:
        others = torch.full_like(rewards, baseline)
    return torch.where(size >= 2, rewards - group_others, rewards - others)


def grpo_advantages(rewards: Tensor, groups: Tensor, eps: float = 1e-6, *, scale: bool = True) -> Tensor:
    """GRPO: (reward - group mean) / (group sample std + eps); with `scale` off, reward - group mean (Dr. GRPO:
    dividing by the std weighs a group whose rewards barely differ, 0.5 and 0.50001, as much as one of 0 and
    1, and a prompt nearly always solved or failed more than one in between). A group of one, or a group whose rewards are
    all equal, gets advantage exactly 0: it says nothing about which completion was better. "Equal" allows
    for rounding: eight rewards of 0.7 have a mean of 0.7 - 1e-16 and would otherwise get advantages of
    -1e-10, all of one sign, which made a batch without any contrast train, gate and publish a version."""
    size, mean, std = _group_stats(rewards, groups)
    flat = std <= eps * (1 + mean.abs())
    centred = rewards - mean
    return torch.where((size >= 2) & ~flat, centred / (std + eps) if scale else centred, torch.zeros_like(rewards))


def scale_by_std(advantages: Tensor, rewards: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """advantages / (the sample std of `rewards` + eps), not re-centred (`rewards` defaults to the advantages
    themselves). Production rewards are often small and sparse (a digit fraction of 0.002, one thumbs-up in
    twenty): scaling keeps the step size independent of the reward's units. Scaling by the spread of the
    rewards, not of the advantages, matters when every reward in a batch is equal: the advantages are then
    only baseline noise (0 - 0.002 here, 0 there), and dividing them by their own tiny std would turn that
    noise into full-size steps. A batch with fewer than two values, or all rewards equal, is returned
    unchanged."""
    spread = advantages if rewards is None else rewards
    if spread.numel() < 2:
        return advantages
    std = spread.std()
    if not torch.isfinite(std) or std <= eps:
        return advantages
    return advantages / (std + eps)


def running_mean(previous: float | None, rewards: Tensor, momentum: float = 0.9) -> float:
    """Exponential moving average of batch-mean rewards: momentum * previous + (1 - momentum) * batch mean.
    With no previous value it starts at the batch mean. Non-finite rewards are ignored."""
    finite = rewards[torch.isfinite(rewards)]
    if finite.numel() == 0:
        return previous if previous is not None else 0.0
    batch = float(finite.mean())
    return batch if previous is None else momentum * previous + (1.0 - momentum) * batch


# ---------------------------------------------------------------------------------------------------------
# Ratios and the clipped policy-gradient loss


MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: past it float32 products overflow (TRL and verl cap it likewise)
DUAL_CLIP = 3.0  # the dual clip's bound c on -r * A for A < 0 (Ye et al. 2020)
BEHAVIOUR_WEIGHT_CAP = 2.0  # the truncation C of pi_prox / mu (verl's truncated importance sampling uses 2)


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """pi(token) / pi_old(token) = exp(logp - logp_old), per token, the log-ratio capped at MAX_LOG_RATIO."""
    return torch.exp((logprobs - old_logprobs).clamp(max=MAX_LOG_RATIO))


def behaviour_weights(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """The truncated importance weight min(pi_prox / mu, cap) per token, and where the cap cut it.

    mu is the policy that sampled the token (an older adapter version still being served, or an app's own
    model), pi_prox the adapter the update starts from; neither carries a gradient, so the weight only
    scales each token's policy gradient. Truncating it bounds the variance a token mu made unlikely would
    otherwise bring (its weight grows without limit); tokens mu made likelier than pi_prox now does get a
    weight below 1 and are not cut. `cap` >= 1. Returns (weight [B, T], truncated [B, T] bool)."""
    if not cap >= 1.0:
        raise ValueError(f"the behaviour weight cap must be at least 1, got {cap}")
    log_weight = (proximal_logprobs - behaviour_logprobs).detach()
    log_cap = math.log(cap)
    return torch.exp(log_weight.clamp(max=log_cap)), log_weight > log_cap


def clipped_pg_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_eps: float, dual_clip: float = DUAL_CLIP
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate with the dual clip, per token: -min(r * A, clip(r, 1 - eps, 1 + eps) * A), and
    for A < 0 at most -dual_clip * A, with r = pi / pi_old.

    Plain PPO leaves r unbounded where A < 0 and r > 1 + eps (the unclipped term is the smaller one there):
    one token whose old probability was tiny then carries the whole update (its gradient is r * |A|). The
    dual clip makes such a token's loss constant, so its gradient is 0 past r = dual_clip.

    The learner's `old_logprobs` are the proximal policy's, not the behaviour policy's (update.py says why):
    centred on the sampler, a clip this tight switches off every token a stale batch has already moved the
    right way.

    `advantages` is per sequence [B] (broadcast over tokens) or per token [B, T]. Returns (loss [B, T],
    clipped [B, T] bool), where `clipped` marks tokens whose gradient a clip has switched off (r > 1 + eps
    with A > 0, r < 1 - eps with A < 0, or r > dual_clip with A < 0).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == logprobs.dim() - 1 else advantages
    ratio = importance_ratio(logprobs, old_logprobs)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    loss = -torch.minimum(unclipped, clipped)
    negative = adv < 0
    loss = torch.where(negative, torch.minimum(loss, -dual_clip * adv), loss)
    active = ((ratio > 1.0 + clip_eps) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & negative) | ((ratio > dual_clip) & negative)
    return loss, active


# ---------------------------------------------------------------------------------------------------------
# KL to the reference (base) model, per token, on tokens sampled from the policy


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi(x) - log ref(x): unbiased for KL(pi || ref), high variance, can be negative."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log pi(x) - log ref(x))^2 / 2: biased, low variance, never negative."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """k3 = (r - 1) - log r with r = ref(x) / pi(x): unbiased for KL(pi || ref), low variance, never negative.
    As a loss term (the penalty, as DeepSeekMath and TRL use it) its expected gradient is that of
    KL(ref || pi), not of KL(pi || ref): its value estimates the one, its gradient follows the other.
    Where `mask` is 0 (padding) the reference is the policy itself: 0 with a zero gradient. A masked sum
    alone keeps such a position out of the value, not out of the backward pass, where a gap over ~88 nats
    (float32's exp overflows) would make 0 x inf = NaN of the whole batch's gradient."""
    if mask is not None:
        ref_logprobs = torch.where(mask.bool(), ref_logprobs, logprobs.detach())
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


def kl_exact(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """KL(pi || ref) = sum_v pi(v) (log pi(v) - log ref(v)) over the last (vocabulary) axis, from full
    log-distributions [..., V] -> [...]. What the publish gate reads: unlike k3 on tokens another policy
    sampled, it does not blow up when the update made one of those tokens unlikely."""
    return (logprobs.exp() * (logprobs - ref_logprobs)).sum(-1).clamp(min=0.0)


def entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last (vocabulary) axis, [..., V] -> [...], in nats: the entropy
    bonus's term (`learner.entropy_coef`), which keeps a policy from collapsing onto one answer whose
    batches then all score alike and teach nothing."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------------------------------------------------
# The serving engine's sampling distribution

MIN_TEMPERATURE = 0.01  # vLLM's SamplingParams raises any temperature in (0, 0.01) to this; only 0 is greedy
PROCESSED_CHUNK = 2**25  # logits processed at once by processed_logprobs (128 MiB of float32)


@dataclass(frozen=True)
class History:
    """What vLLM applies from the tokens so far, one row each: `min_tokens` [B] (the `stops` [B, S] cannot
    be drawn before that many completion tokens; -1 pads a row's stops), and the penalties, from the
    prompt's tokens `prompt_ids` [B, P] (-1 pads) and the completion's up to the position: `repetition`
    [B] divides a positive logit of a token seen in either (multiplies a negative one), `frequency` [B]
    is subtracted once per occurrence in the completion so far, `presence` [B] once if it occurred. On the
    logits' device; token ids below the vocabulary size."""

    prompt_ids: Tensor
    stops: Tensor
    min_tokens: Tensor
    presence: Tensor
    frequency: Tensor
    repetition: Tensor


def processed_logprobs(logits: Tensor, tokens: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                       min_p: Tensor, bias: Tensor | None = None, mask: Tensor | None = None,
                       history: History | None = None) -> Tensor:
    """log mu(token) under the distribution vLLM's sampler draws from (vllm/v1/sample/sampler.py), the
    behaviour policy of a completion sampled with these settings: logits + bias, the stop tokens cut before
    min_tokens and the penalties applied (`history`, None: none of them), then / temperature (raised to
    MIN_TEMPERATURE as vLLM raises it), then min-p (tokens less likely than min_p x the likeliest one are
    cut), then top-k, then top-p over what top-k kept (the likeliest tokens whose probabilities first reach
    top_p), renormalised.

    logits [B, C, V] (the model's, at temperature 1); tokens [B, C]; one setting per row [B]: top_k <= 0 or
    >= V is off, top_p 1 is off, min_p 0 is off; bias [B, V] or None (a request's logit_bias); mask [B, C]
    or None: the positions to compute (the others are 0), so padding costs nothing. A greedy row
    (temperature 0) is 0 everywhere: its token was the argmax, drawn with probability 1. The sampled token
    is never cut: the engine drew it, so it had passed the engine's masks, and a rounding difference between
    two machines' logits at a mask's edge must not give it probability 0 (an unbounded importance weight).
    Works through PROCESSED_CHUNK logits at a time: the masks need several vocabulary-wide copies of what
    they work on. Returns [B, C], float32."""
    b, c, v = logits.shape
    out = torch.zeros(b, c, dtype=torch.float32, device=logits.device)
    wanted = (temperature[:, None] > 0).expand(b, c)
    if mask is not None:
        wanted = wanted & mask.bool()
    rows, cols = wanted.nonzero(as_tuple=True)
    step = max(1, PROCESSED_CHUNK // (v + (c if history is not None else 0)))
    prompt_seen = None
    if history is not None and bool((history.repetition != 1).any()):
        prompt_seen = _present(history.prompt_ids.to(logits.device), v)  # [B, V], once: not per position
    for start in range(0, rows.numel(), step):
        r, col = rows[start : start + step], cols[start : start + step]
        x = logits[r, col].float()  # [n, V]: one position each
        if bias is not None:
            x = x + bias[r].float()
        if history is not None:
            x = _with_history(x, tokens, r, col, history, None if prompt_seen is None else prompt_seen[r])
        x = x / temperature[r].float().clamp(min=MIN_TEMPERATURE)[:, None]
        out[r, col] = _processed(x, tokens[r, col].unsqueeze(1), top_k[r].long(), top_p[r].float(), min_p[r].float())
    return out


def _with_history(x: Tensor, tokens: Tensor, r: Tensor, col: Tensor, h: History,
                  prompt_seen: Tensor | None) -> Tensor:
    """x [n, V], the logits of row r[i] at completion position col[i], after min_tokens and the penalties
    (vLLM's MinTokensLogitsProcessor, then apply_penalties); prompt_seen [n, V]: the tokens of each row's
    prompt (None when no row has a repetition penalty). The sampled token is not cut by min_tokens, for the
    reason processed_logprobs gives."""
    n, v = x.shape
    early = col < h.min_tokens[r]
    if bool(early.any()):
        cut = _present(h.stops[r], v) & early[:, None]
        cut.scatter_(1, tokens[r, col].unsqueeze(1), False)
        x = x.masked_fill(cut, -math.inf)
    presence, frequency, repetition = (t[r].float()[:, None] for t in (h.presence, h.frequency, h.repetition))
    if not bool(((presence != 0) | (frequency != 0) | (repetition != 1)).any()):
        return x
    so_far = tokens[r].masked_fill(torch.arange(tokens.shape[1], device=col.device)[None, :] >= col[:, None], -1)
    counts = torch.zeros(n, v + 1, device=x.device).scatter_add_(
        1, so_far.masked_fill(so_far < 0, v), torch.ones(so_far.shape, device=x.device))[:, :v]
    occurred = counts > 0
    seen = occurred if prompt_seen is None else occurred | prompt_seen
    factor = torch.where(seen, repetition, torch.ones_like(x))
    x = x * torch.where(x > 0, 1.0 / factor, factor)
    return x - frequency * counts - presence * occurred.float()


def _present(ids: Tensor, v: int) -> Tensor:
    """[n, V] bool: which of the V tokens each row of ids [n, K] holds (-1 pads)."""
    at = ids.long().masked_fill(ids < 0, v)
    return torch.zeros(ids.shape[0], v + 1, dtype=torch.bool, device=ids.device).scatter_(1, at, True)[:, :v]


def _processed(x: Tensor, picked: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """processed_logprobs for tempered logits x [n, V], one position per row: the picked tokens' [n]."""
    v = x.shape[-1]
    sampled = x.gather(1, picked)
    if bool((min_p > 0).any()):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], -math.inf)
        del probs
    cut_k, cut_p = (top_k > 0) & (top_k < v), top_p < 1.0
    if bool(cut_k.any()) or bool(cut_p.any()):
        ascending, order = x.sort(dim=-1)
        if bool(cut_k.any()):
            kth = ascending.gather(1, (v - torch.where(cut_k, top_k, v)).unsqueeze(1))
            ascending.masked_fill_(ascending < kth, -math.inf)
        if bool(cut_p.any()):
            below = ascending.softmax(-1).cumsum_(-1) <= (1.0 - top_p)[:, None]
            below[:, -1] = False  # the likeliest token always stays
            ascending.masked_fill_(below, -math.inf)
            del below
        x = x.scatter_(1, order, ascending)
        del ascending, order
    x = x.scatter_(1, picked, sampled)
    return torch.log_softmax(x, dim=-1).gather(1, picked).squeeze(1)


# ---------------------------------------------------------------------------------------------------------
# Aggregation over tokens


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of `values` where mask is 1 (a non-finite value where it is 0 counts nothing: not inf * 0 = NaN)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where mask is 1; 0 when the mask is empty."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


def aggregate(per_token: Tensor, mask: Tensor, how: Aggregation = "token-mean") -> Tensor:
    """Reduces a per-token loss to a scalar.

    token-mean: every real token weighs the same (long completions weigh more in total).
    seq-mean:   each sequence's mean over its tokens, then the mean over sequences (every sequence weighs
                the same); sequences with no tokens count as 0 but still in the denominator.
    """
    if how == "token-mean":
        return masked_mean(per_token, mask)
    if how == "seq-mean":
        per_seq = torch.where(mask.bool(), per_token, torch.zeros_like(per_token)).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.mean()
    raise ValueError(f"unknown aggregation {how!r}; expected 'token-mean' or 'seq-mean'")


def clip_fraction(clipped: Tensor, mask: Tensor) -> Tensor:
    """Share of real tokens whose gradient the clip switched off."""
    return masked_mean(clipped.to(mask.dtype), mask)
