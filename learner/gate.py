"""The publish gate: whether a freshly trained adapter may replace the tenant's published one.

A candidate passes only if every check holds:
  - rewards:  every reward in the batch is finite and |reward| <= `learner.gate_max_abs_reward` (a batch
              with NaN or absurd rewards is poisoned: whatever it taught must not be served; logs mode
              leaves a finite reward beyond the limit out before training, logs_mode.within_reward_range,
              so the rest of its batch is not lost with it);
  - loss:     the training loss and the gradient norm are finite;
  - weights:  every adapter weight is finite;
  - kl:       the mean KL to the base model (exact, over the whole vocabulary, at the batch's completion
              positions, after the update) is at most `learner.gate_max_kl`: the adapter has not drifted
              into degenerate text;
  - reward:   (tenants with a programmatic scorer only) the mean reward of greedy completions of the
              tenant's probe prompts is not below the parent's by more than `learner.gate_reward_tolerance`
              plus `learner.gate_reward_z` standard errors of the per-prompt changes (see below).

Why the standard error: the probe is a handful of prompts, and a greedy completion flips between "scores"
and "does not" at the smallest weight change. With 4 prompts and a 0/1 scorer, one prompt flipping is a drop
of 0.25, beyond any useful tolerance; a fixed tolerance rejected ~30% of steps in the experiments
benchmark, each a wasted step. The parent and the candidate are probed on the same prompts, so the changes
are paired: one prompt falling while the others hold is within noise (the standard error of (-1, 0, 0, 0)
is 0.25), a fall on most prompts is not (every prompt falling alike has standard error 0). With
`gate_reward_z = 0` the rule is the plain tolerance.

Probe prompts: `learner.gate_prompts` prompts per tenant, picked as the ones with the smallest SHA-256
among the prompts the learner has seen for the tenant (its prompts file, or the prompts of its batches),
so the set is deterministic and changes rarely. They are greedy-decoded by the parent and the candidate
alike, so the comparison is like for like; they are not guaranteed unseen by training (production
traffic repeats prompts), which is fine for what the check is for: catching a step that made the tenant
worse at its own objective.

A probe whose scorer fails (ScorerError: its dependency down, a timeout) has no reward to compare: it raises
ProbeScoringFailed rather than counting 0. Counted 0, an outage during the candidate's probe read as a fall
in reward (the candidate rejected, its batch committed as trained and lost), and one during the parent's
was cached as the parent's rewards. The loop fails the step instead: nothing is committed or cached, and
the tenant tries again after its back-off. A scorer that keeps failing on a probe (on some greedy answer,
every time) would stop its tenant for good that way: after a while the loop probes with `LeaveUnscored`,
and a prompt it cannot score is left out of the comparison on both sides (`probe_prompts_compared` in the
checks), never counted 0.

`decide` is pure and lists every failed check (the reason recorded with `Registry.reject`).
`probe_rewards` runs the model. What happens after a failure (restore the parent, go on) is loop.py's.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from learner.policy import Policy


class ProbeScoringFailed(RuntimeError):
    """The tenant's scorer failed on a probe completion: the probe has no reward to gate on."""


@dataclass(frozen=True)
class LeaveUnscored:
    """A probe scorer whose failures leave that prompt's reward None instead of raising ProbeScoringFailed:
    such a prompt is left out of the comparison on both sides (`decide`). The loop probes with it once its
    tenant's steps have failed on probes for a while (loop.py, `_probe_scorer`)."""

    scorer: Callable[[str, str], float]


@dataclass(frozen=True)
class GateInput:
    loss: float
    grad_norm: float
    weights_finite: bool
    kl: float
    rewards: tuple[float, ...]  # the batch's rewards
    # Greedy reward per probe prompt, the candidate's and the parent's on the same prompts in the same order;
    # None when the tenant has no programmatic scorer.
    probe_rewards: tuple[float, ...] | None = None
    parent_probe_rewards: tuple[float, ...] | None = None


@dataclass(frozen=True)
class GateLimits:
    max_kl: float
    reward_tolerance: float
    max_abs_reward: float
    reward_z: float = 0.0


@dataclass(frozen=True)
class GateResult:
    passed: bool
    failures: tuple[str, ...]  # one line per failed check
    checks: dict  # what was measured (JSON-serialisable), stored with the version in the registry

    @property
    def reason(self) -> str:
        return "; ".join(self.failures)


def decide(inp: GateInput, limits: GateLimits) -> GateResult:
    failures = []
    bad_rewards = [r for r in inp.rewards if not math.isfinite(r) or abs(r) > limits.max_abs_reward]
    if bad_rewards:
        failures.append(
            f"poisoned batch: {len(bad_rewards)} of {len(inp.rewards)} rewards non-finite or beyond "
            f"+-{limits.max_abs_reward:g} (e.g. {bad_rewards[0]!r})"
        )
    if not math.isfinite(inp.loss):
        failures.append(f"loss is not finite ({inp.loss})")
    if not math.isfinite(inp.grad_norm):
        failures.append(f"gradient norm is not finite ({inp.grad_norm})")
    if not inp.weights_finite:
        failures.append("adapter weights are not finite")
    if not math.isfinite(inp.kl) or inp.kl > limits.max_kl:
        failures.append(f"KL to the base model {inp.kl:.4g} exceeds gate_max_kl {limits.max_kl:g}")
    probe = parent = allowed = None
    # A prompt the scorer could not score on either side (None: LeaveUnscored) is left out of both.
    pairs = [] if inp.probe_rewards is None or inp.parent_probe_rewards is None else [
        (c, p) for c, p in zip(inp.probe_rewards, inp.parent_probe_rewards) if c is not None and p is not None]
    if pairs:
        scored, scored_parent = [c for c, _ in pairs], [p for _, p in pairs]
        probe, parent = mean(scored), mean(scored_parent)
        se = paired_standard_error(scored, scored_parent)
        se = se if math.isfinite(se) else 0.0  # a NaN allowance would pass anything
        allowed = limits.reward_tolerance + limits.reward_z * se
        if not math.isfinite(probe) or parent - probe > allowed:
            noise = f" + {limits.reward_z:g} x standard error {se:.3g}" if limits.reward_z and se else ""
            failures.append(
                f"probe reward fell from {parent:.4g} to {probe:.4g} "
                f"(more than tolerance {limits.reward_tolerance:g}{noise} over {len(pairs)} prompts)"
            )
    checks = {k: _json_number(v) for k, v in asdict(inp).items() if k not in ("rewards", "probe_rewards", "parent_probe_rewards")}
    checks["probe_reward"] = _json_number(probe)
    checks["parent_probe_reward"] = _json_number(parent)
    checks["probe_rewards"] = None if inp.probe_rewards is None else [_json_number(r) for r in inp.probe_rewards]
    checks["parent_probe_rewards"] = (
        None if inp.parent_probe_rewards is None else [_json_number(r) for r in inp.parent_probe_rewards]
    )
    checks["probe_drop_allowed"] = _json_number(allowed)
    checks["probe_prompts_compared"] = len(pairs)
    checks["reward_min"] = _json_number(min(inp.rewards, default=math.nan))
    checks["reward_max"] = _json_number(max(inp.rewards, default=math.nan))
    checks.update({f"limit_{k}": v for k, v in asdict(limits).items()})
    return GateResult(passed=not failures, failures=tuple(failures), checks=checks)


def mean(values: Sequence[float]) -> float:
    """The mean of `values`; NaN for none."""
    return math.fsum(values) / len(values) if values else math.nan


def scored_mean(values: Sequence[float | None]) -> float | None:
    """The mean of the probe rewards that were scored (None: left unscored, LeaveUnscored); None if none were."""
    scored = [v for v in values if v is not None]
    return mean(scored) if scored else None


def paired_standard_error(candidate: Sequence[float], parent: Sequence[float]) -> float:
    """Standard error of the mean per-prompt change candidate - parent (sample standard deviation / sqrt(k)).
    0 for fewer than two prompts or prompts that do not pair up (the plain tolerance then applies alone);
    NaN when a change is not finite."""
    if len(candidate) != len(parent) or len(candidate) < 2:
        return 0.0
    diffs = [c - p for c, p in zip(candidate, parent)]
    m = mean(diffs)
    var = math.fsum((d - m) ** 2 for d in diffs) / (len(diffs) - 1)
    return math.sqrt(var / len(diffs))


def _json_number(v):
    """JSON has no NaN/inf: they are stored as strings so the registry record stays valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


# ---------------------------------------------------------------------------------------------------------
# Probe prompts and their reward


def _digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()


def update_probes(current: Sequence[str], seen: Iterable[str], k: int,
                  fits: Callable[[str], bool] = lambda prompt: True) -> tuple[str, ...]:
    """The k prompts with the smallest SHA-256 among `current` and `seen` (deterministic, rarely changing)
    that `fits`: a probe decodes its whole prompt, where training cuts a row to the context."""
    pool = {p for p in (*current, *seen) if p}
    return tuple(itertools.islice((p for p in sorted(pool, key=_digest) if fits(p)), k))


def probe_rewards(
    policy: Policy,
    tenant: str | None,
    prompts: Sequence[str],
    scorer: Callable[[str, str], float],
    *,
    max_new_tokens: int,
) -> tuple[float, ...]:
    """The reward of the greedy completion of each of `prompts` under `tenant`'s adapter (None: the base
    model), in order. Raises ProbeScoringFailed when the scorer fails on one (module note)."""
    if not prompts:
        return ()
    samples = policy.generate(tenant, list(prompts), n=1, max_new_tokens=max_new_tokens, greedy=True)
    return _scored(tenant, prompts, samples, scorer)


def probe_rewards_grouped(
    policy: Policy,
    probes: Sequence[tuple[str, Sequence[str], Callable[[str, str], float]]],
    *,
    max_new_tokens: int,
) -> list[tuple[float, ...] | ProbeScoringFailed]:
    """`probe_rewards` of several tenants' (tenant, prompts, scorer) probes, decoded together in one batch
    (`Policy.generate_grouped`): what a round of the learner's steps probes. A tenant whose scorer fails has
    its ProbeScoringFailed in its place; the others' rewards stand (the decode was good)."""
    samples = policy.generate_grouped([(tenant, prompts) for tenant, prompts, _ in probes], max_new_tokens=max_new_tokens)
    out: list[tuple[float, ...] | ProbeScoringFailed] = []
    for (tenant, prompts, scorer), got in zip(probes, samples):
        try:
            out.append(_scored(tenant, prompts, got, scorer))
        except ProbeScoringFailed as e:
            out.append(e)
    return out


def _scored(tenant: str | None, prompts: Sequence[str], samples,
            scorer: Callable[[str, str], float]) -> tuple[float, ...]:
    from ingest.scorers import ScorerError, apply

    leave_unscored = isinstance(scorer, LeaveUnscored)
    scorer = scorer.scorer if leave_unscored else scorer
    rewards = []
    for i, (prompt, (sample,)) in enumerate(zip(prompts, samples)):
        try:
            rewards.append(apply(scorer, sample.text, prompt))
        except ScorerError as e:
            if leave_unscored:
                rewards.append(None)
                continue
            raise ProbeScoringFailed(
                f"tenant {tenant!r}: the scorer failed on gate probe {i + 1} of {len(prompts)} ({prompt[-60:]!r}): "
                f"{str(e).splitlines()[0]}"
            ) from e
    return tuple(rewards)
