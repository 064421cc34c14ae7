"""One policy-gradient update of one tenant's adapter: the step both training modes share.

Given a token batch, per-sequence advantages and (optionally) the behaviour policy's per-token log-probs,
`pg_update` does, in order:
  1. reference log-probs of the base model (the same model with the adapter disabled), no gradient, keeping
     its log-distributions (when they fit, `Policy.base_reference`) for step 4;
  2. for each micro-batch: the tenant's log-probs with gradient, the decoupled surrogate below plus
     `kl_coef` x k3 KL to the base minus `entropy_coef` x the policy's entropy at each completion position
     (the entropy bonus, below), aggregated with the batch-wide denominator, backward;
  3. gradient clipping and one AdamW step (policy.py); steps 2-3 `epochs` times (PPO's epochs);
  4. the exact KL to the base over the whole vocabulary at every completion position, no gradient, that
     the publish gate reads (the KL of the adapter that would be published, not of its parent). Not k3 on
     the batch's tokens: those were sampled by an older policy, and where the update made one of them
     unlikely k3 explodes (a KL of 300 for an adapter whose true KL is 5). Only the updated adapter's pass
     runs here: the base model's side is step 1's.

The surrogate, per token: w x PPO's clipped loss of the ratio pi / pi_prox, where pi_prox is the adapter as
the step starts (its detached log-probs) and w = min(pi_prox / mu, `behaviour_weight_cap`) the truncated
importance weight of the behaviour policy mu that sampled the token (maths.py; Hilton et al. 2021's
decoupled objective). With one optimizer step per batch (`epochs = 1`, the default) pi = pi_prox when the
gradient is taken: the ratio is 1, the clip does not act, and the gradient is -w x A x grad log pi. With
several, every epoch after the first starts where the last one's step left the adapter, so its ratio to
pi_prox has moved, and the clip (`clip_eps`) is the trust region that keeps the reuse of one batch from
walking the adapter arbitrarily far from where the step began: a token whose ratio has passed 1 + eps the
way its advantage pushes gets no more gradient. pi_prox and w stay those of the step's start throughout.
The correction for stale samples is w either way. The KL penalty and the entropy bonus are weighted by w
too (as TRL weights its whole per-token loss): they are expectations over the adapter's own tokens as well.

Why not PPO's clip around mu itself: serving lags the learner (a batch is sampled by the version one to
a few steps back), and one Adam step at an adapter's learning rate moves a token's ratio pi / mu well
past 1 +- clip_eps. Centred on mu, the clip then switched off every token that had already moved the right way
and kept those that had moved the wrong way: only the gradients undoing the last steps were left. Trained
two versions behind its sampler, the tiny model's upper-case tenant stayed at its base reward of 0.13
for 24 steps in every seed (and `make demo`'s drifted to a KL of 2.4 without learning), where on-policy
it reaches 1.0 in 12; with w it reaches 1.0 within 24 steps two versions behind, in 4 seeds of 4 (the
set-up of tests/learner/test_learning.py, which runs seed 0).

The entropy bonus (`entropy_coef`, 0: off) rewards spread in the policy's next-token distributions, exactly
over the vocabulary from the logits the surrogate already computes. Without it a tenant trained on its own
traffic can collapse onto one answer: a demo tenant's KL to the base went 2.5 -> 4.9 -> 8.8 in three steps
onto one 71-character answer whose reward was 0.41; from then on every answer was that one, every batch
scored alike (flat, so skipped) and the tenant was stuck for good.

Unknown behaviour log-probs (NaN) are taken as pi_prox's: w = 1 there (on-policy, plain REINFORCE with a
baseline).

Temperature: samples drawn at temperature T came from softmax(logits / T), so that is the policy whose
log-probs the surrogate and the KL penalty use (pi, pi_prox, mu and the base model's reference, all at T);
the gate's exact KL to the base compares the adapters themselves, at temperature 1.

The logs and rollouts modes differ only in where the batch, the advantages and the behaviour log-probs
come from (logs_mode.py, rollouts.py). Nothing here decides whether the result is kept (gate.py, loop.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from learner import maths
from learner.batch import TokenBatch
from learner.policy import Policy


@dataclass(frozen=True)
class UpdateResult:
    loss: float  # the aggregated loss that was back-propagated (policy gradient + KL penalty - entropy bonus)
    pg_loss: float  # its policy-gradient part
    kl: float  # mean exact KL to the base over completion positions, after the update
    kl_before: float  # mean k3 estimate on the batch's tokens before the update (the parent's)
    clip_frac: float  # share of tokens whose behaviour weight the cap cut or whose gradient the clip switched off, over the epochs
    grad_norm: float  # before clipping
    tokens: int  # completion tokens trained on
    entropy: float = math.nan  # mean entropy (nats) of the policy at the completion positions before the update; NaN when the bonus is off

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in (self.loss, self.kl, self.grad_norm))


def pg_update(
    policy: Policy,
    tenant: str,
    batch: TokenBatch,
    advantages: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    clip_eps: float,
    behaviour_weight_cap: float = maths.BEHAVIOUR_WEIGHT_CAP,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    max_grad_norm: float = 1.0,
    aggregation: maths.Aggregation = "token-mean",
    micro_batch_size: int | None = None,
    temperature: float = 1.0,
    epochs: int = 1,
    behaviour_from_logits: Callable[[Tensor, TokenBatch, slice], Tensor] | None = None,
    behaviour_from_base_logits: Callable[[Tensor, TokenBatch, slice], Tensor] | None = None,
) -> UpdateResult:
    """See the module note. `advantages` is [B]; `old_logprobs` is [B, C] with NaN where unknown, or None,
    under the policy at `temperature`, the one trained (rollouts sampled at that temperature). `epochs`
    optimizer steps on the batch (fewer if a gradient is not finite: the last epoch run reports it); loss,
    pg_loss and clip_frac are the epochs' means, grad_norm the largest, kl_before the first epoch's (the
    parent's).

    `behaviour_from_logits(logits, part, rows)`, when given, makes behaviour log-probs [b, C] (NaN where it
    has none; they take the place of `old_logprobs` elsewhere) for the micro-batch `part`, the batch's
    `rows`, from the logits [b, C, V] (temperature 1) of the adapter as the step starts: those of the
    first epoch's pass, so a row the current adapter drew costs no pass of its own (logs mode's rows drawn
    at another temperature, logs_mode.behaviour_logprobs). `behaviour_from_base_logits` likewise, from the
    base model's logits of the reference pass (step 1), for rows the base model drew."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    device = policy.device
    mask = batch.completion_mask.to(device)
    advantages = advantages.to(device, torch.float32)
    if advantages.shape != (batch.size,):
        raise ValueError(f"advantages have shape {tuple(advantages.shape)}, expected ({batch.size},)")
    if old_logprobs is not None and old_logprobs.shape != mask.shape:
        raise ValueError(f"old_logprobs have shape {tuple(old_logprobs.shape)}, expected {tuple(mask.shape)}")

    from_base: list[Tensor] = []
    take_base = None
    if behaviour_from_base_logits is not None:
        def take_base(logits: Tensor, part: TokenBatch, rows: slice) -> None:
            from_base.append(behaviour_from_base_logits(logits, part, rows).to(device, torch.float32))
    ref, base_logps = policy.base_reference(batch, temperature=temperature, rows_per_pass=micro_batch_size,
                                            on_logits=take_base)
    if from_base:
        old_logprobs = _over(torch.cat(from_base), None if old_logprobs is None else old_logprobs.to(device))
    total_tokens = mask.sum().clamp(min=1)
    start: list[tuple[Tensor, Tensor, Tensor]] = []  # per micro-batch, from the first epoch: pi_prox, w, the cap's cuts
    loss_sum = pg_sum = clipped_sum = kl_before_sum = entropy_sum = 0.0
    norms = []
    for epoch in range(epochs):
        policy.zero_grad(tenant)
        for i, (rows, part) in enumerate(batch.chunks(micro_batch_size)):
            mb_mask = mask[rows]
            made: list[Tensor] = []  # behaviour_from_logits' log-probs for this micro-batch, in the first epoch
            take = None
            if epoch == 0 and behaviour_from_logits is not None:
                def take(logits: Tensor, part: TokenBatch = part, rows: slice = rows) -> None:
                    made.append(behaviour_from_logits(logits, part, rows).to(device, torch.float32))
            logp, entropy = policy.token_logprobs_and_entropy(part, tenant, grad=True, temperature=temperature,
                                                              with_entropy=bool(entropy_coef),
                                                              on_logits=None if policy.has_dropout else take)
            if epoch == 0:  # the adapter as the step starts
                proximal = logp.detach()
                if policy.has_dropout:
                    # The gradient pass runs in train mode, its dropout in `logp`; the adapter as it samples
                    # (and as the behaviour log-probs were taken) has none, so π_prox comes from a pass without.
                    proximal = policy.token_logprobs(part, tenant, temperature=temperature, on_logits=take)
                known = None if old_logprobs is None else old_logprobs[rows].to(device)
                behaviour = _over(_over(made[0] if made else None, known), proximal)
                start.append((proximal, *maths.behaviour_weights(proximal, behaviour, behaviour_weight_cap)))
            proximal, weight, truncated = start[i]
            pg, clipped = maths.clipped_pg_loss(logp, proximal, advantages[rows], clip_eps)
            clipped = clipped | truncated
            kl_tok = maths.kl_k3(logp, ref[rows], mb_mask)
            per_token = pg + kl_coef * kl_tok if kl_coef else pg
            if entropy_coef:
                per_token = per_token - entropy_coef * entropy
            # Every term is an expectation over the adapter's own tokens, estimated from tokens the behaviour
            # policy drew: each is importance-weighted, the penalties as the policy gradient (an unweighted KL
            # term pulled towards the reference as the behaviour policy, not the adapter, would).
            per_token = weight * per_token
            pg = weight * pg
            # Each micro-batch's share of the batch-wide aggregate, so the summed gradient equals the one of
            # the whole batch at once.
            if aggregation == "token-mean":
                share = mb_mask.sum() / total_tokens
            else:
                share = torch.tensor(mb_mask.shape[0] / batch.size, device=device)
            loss = maths.aggregate(per_token, mb_mask, aggregation) * share
            loss.backward()
            loss_sum += float(loss.detach())
            pg_sum += float(maths.aggregate(pg.detach(), mb_mask, aggregation) * share)
            clipped_sum += float(maths.masked_sum(clipped.float(), mb_mask))
            if epoch == 0:
                kl_before_sum += float(maths.masked_sum(kl_tok.detach(), mb_mask))
                if entropy_coef:
                    entropy_sum += float(maths.masked_sum(entropy.detach(), mb_mask))
        norms.append(policy.optimizer_step(tenant, max_grad_norm=max_grad_norm))
        if not math.isfinite(norms[-1]):
            break  # the gate rejects this candidate whatever more epochs would do

    kl_after = policy.kl_to_base(batch, tenant, base_logps=base_logps)
    n = float(total_tokens)
    return UpdateResult(
        loss=loss_sum / len(norms),
        pg_loss=pg_sum / len(norms),
        kl=float(maths.masked_mean(kl_after, mask)),
        kl_before=kl_before_sum / n,
        clip_frac=clipped_sum / (n * len(norms)),
        grad_norm=norms[-1] if not math.isfinite(norms[-1]) else max(norms),
        tokens=batch.n_tokens,
        entropy=entropy_sum / n if entropy_coef else math.nan,
    )


def _over(values: Tensor | None, under: Tensor | None) -> Tensor | None:
    """`values` where they are known, `under` where they are NaN (either may be None: the other)."""
    if values is None or under is None:
        return under if values is None else values
    return torch.where(torch.isnan(values), under, values)
