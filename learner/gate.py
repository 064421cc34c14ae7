"""The publish gate: whether a freshly trained adapter may replace the tenant's published one.

A candidate passes only if every check holds:
  - rewards:  every reward in the batch is finite and |reward| <= `learner.gate_max_abs_reward` (a batch
              with NaN or absurd rewards is poisoned: whatever it taught must not be served);
  - loss:     the training loss and the gradient norm are finite;
  - weights:  every adapter weight is finite;
  - kl:       the mean KL to the base model (exact, over the whole vocabulary, at the batch's completion
              positions, after the update) is at most `learner.gate_max_kl`: the adapter has not drifted
              into degenerate text;
  - reward:   (tenants with a programmatic scorer only) the mean reward of greedy completions of the
              tenant's probe prompts is not below the parent's by more than `learner.gate_reward_tolerance`.

Probe prompts: `learner.gate_prompts` prompts per tenant, picked as the ones with the smallest SHA-256
among the prompts the learner has seen for the tenant (its prompts file, or the prompts of its batches),
so the set is deterministic and changes rarely. They are greedy-decoded by the parent and the candidate
alike, so the comparison is like for like; they are not guaranteed unseen by training (production
traffic repeats prompts), which is fine for what the check is for: catching a step that made the tenant
worse at its own objective.

`decide` is pure and lists every failed check (the reason recorded with `Registry.reject`).
`probe_reward` runs the model. What happens after a failure (restore the parent, go on) is loop.py's.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from learner.policy import Policy


@dataclass(frozen=True)
class GateInput:
    loss: float
    grad_norm: float
    weights_finite: bool
    kl: float
    rewards: tuple[float, ...]  # the batch's rewards
    probe_reward: float | None = None  # the candidate's; None when the tenant has no programmatic scorer
    parent_probe_reward: float | None = None


@dataclass(frozen=True)
class GateLimits:
    max_kl: float
    reward_tolerance: float
    max_abs_reward: float


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
    if inp.probe_reward is not None and inp.parent_probe_reward is not None:
        drop = inp.parent_probe_reward - inp.probe_reward
        if not math.isfinite(inp.probe_reward) or drop > limits.reward_tolerance:
            failures.append(
                f"probe reward fell from {inp.parent_probe_reward:.4g} to {inp.probe_reward:.4g} "
                f"(tolerance {limits.reward_tolerance:g})"
            )
    checks = {k: _json_number(v) for k, v in asdict(inp).items() if k != "rewards"}
    checks["reward_min"] = _json_number(min(inp.rewards, default=math.nan))
    checks["reward_max"] = _json_number(max(inp.rewards, default=math.nan))
    checks.update({f"limit_{k}": v for k, v in asdict(limits).items()})
    return GateResult(passed=not failures, failures=tuple(failures), checks=checks)


def _json_number(v):
    """JSON has no NaN/inf: they are stored as strings so the registry record stays valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


# ---------------------------------------------------------------------------------------------------------
# Probe prompts and their reward


def _digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()


def update_probes(current: Sequence[str], seen: Iterable[str], k: int) -> tuple[str, ...]:
    """The k prompts with the smallest SHA-256 among `current` and `seen` (deterministic, rarely changing)."""
    pool = {p for p in (*current, *seen) if p}
    return tuple(sorted(pool, key=_digest)[:k])


def probe_reward(
    policy: Policy,
    tenant: str | None,
    prompts: Sequence[str],
    scorer: Callable[[str, str], float],
    *,
    max_new_tokens: int,
) -> float:
    """Mean reward of greedy completions of `prompts` under `tenant`'s adapter (None: the base model).
    A prompt whose completion the scorer fails on counts as reward 0."""
    from ingest.scorers import ScorerError, apply

    if not prompts:
        return math.nan
    samples = policy.generate(tenant, list(prompts), n=1, max_new_tokens=max_new_tokens, greedy=True)
    total = 0.0
    for prompt, (sample,) in zip(prompts, samples):
        try:
            total += apply(scorer, sample.text, prompt)
        except ScorerError:
            total += 0.0
    return total / len(prompts)
