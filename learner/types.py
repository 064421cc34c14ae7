"""The learner's internal types: what it knows about a tenant, which tenants a learner process owns, one
training example, one sampled completion.

These are neither wire events (ingest/, serving/) nor storage rows (storage/schema.py): the learner builds
them from Parquet rows or from sampled completions at the edge (logs_mode.py, rollouts.py) and trains on
them. Token batches, the tensors a step consumes, live in batch.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from clora.config import TenantConfig


@dataclass(frozen=True)
class TenantSpec:
    """A tenant as the learner sees it: from the config, or the config's defaults for a tenant that ingest
    created on the fly (`configured=False`, no api key, reward from events)."""

    name: str
    mode: str  # "logs" | "rollouts"
    scorer: str  # the scorer spec (ingest/scorers.py)
    api_key: str = field(repr=False)  # "" when the tenant is not in the config (it cannot be sampled through serving)
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float
    learning_rate: float
    batch_size: int
    group_size: int
    prompts_file: Path | None
    configured: bool
    gate_max_kl: float | None = None  # None: learner.gate_max_kl
    scorer_time_limit_s: float = 1.0  # a regex or python scorer's time limit per call

    @classmethod
    def from_config(cls, t: TenantConfig, *, configured: bool = True) -> TenantSpec:
        return cls(
            name=t.name,
            mode=t.mode,
            scorer=t.scorer,
            api_key=t.api_key.get_secret_value() if configured else "",
            rank=t.lora.rank,
            alpha=t.lora.alpha,
            target_modules=tuple(t.lora.target_modules),
            dropout=t.lora.dropout,
            learning_rate=t.learning_rate,
            batch_size=t.batch_size,
            group_size=t.group_size,
            prompts_file=t.prompts_file,
            configured=configured,
            gate_max_kl=t.gate_max_kl,
            scorer_time_limit_s=t.scorer_time_limit_s,
        )

    @classmethod
    def default(cls, name: str) -> TenantSpec:
        """The config's defaults, for a tenant that exists in storage but not in the config."""
        return cls.from_config(TenantConfig.model_construct(name=name), configured=False)

    def same_adapter_shape(self, other: TenantSpec) -> bool:
        return (self.rank, self.alpha, sorted(self.target_modules), self.dropout) == (
            other.rank,
            other.alpha,
            sorted(other.target_modules),
            other.dropout,
        )


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` learner processes on one data directory (`clora learn --shard K/N`).

    Tenants are dealt by rendezvous hashing with bounded load: every tenant ranks the shards by a hash of
    (tenant, shard) and goes to the first in its ranking that has room, the config's tenants taken in the
    order of their own hash, each shard holding floor(T/N) of them or one more. So N processes get the same
    number of configured tenants, give or take one, and a config that adds or removes a tenant moves few
    others (each move costs a checkpoint reload and up to one config re-read): in trials, ~0.4 of 8 tenants on
    2 shards and 1.2 of 100 on 4 on average, where dealing by name order moved half of them. A tenant only in
    storage (ingest created it) goes to the first shard of its ranking. Every process reads the same config,
    so all agree without talking to each other; a per-tenant lock (loop.py) makes sure no two train one
    tenant even when they do not (a config reload seen at different moments, or two processes started with
    the same shard)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """"K/N" with 0 <= K < N."""
        k, sep, n = text.partition("/")
        try:
            shard = cls(int(k), int(n)) if sep else None
        except ValueError:
            shard = None
        if shard is None or not 0 <= shard.index < shard.count:
            raise ValueError(f"a shard is K/N with 0 <= K < N (e.g. 0/2), got {text!r}")
        return shard

    @property
    def label(self) -> str:
        return f"{self.index}-of-{self.count}"

    def ranking(self, tenant: str) -> list[int]:
        """The shards in `tenant`'s order of preference (the same in every process)."""
        return sorted(range(self.count), key=lambda k: (_hash(f"{tenant}\0{k}"), k), reverse=True)

    def deal(self, configured: Iterable[str]) -> dict[str, int]:
        """The shard of each configured tenant (worked out once per config, not per question)."""
        names = sorted(set(configured), key=lambda name: (_hash(name), name))
        base, extra = divmod(len(names), self.count)  # every shard takes base; `extra` of them one more
        load = [0] * self.count
        dealt = {}
        for name in names:
            k = next(k for k in self.ranking(name) if load[k] < base or (load[k] == base and extra > 0))
            extra -= load[k] == base
            dealt[name] = k
            load[k] += 1
        return dealt

    def owns(self, tenant: str, dealt: Mapping[str, int]) -> bool:
        """Whether this shard trains `tenant`; `dealt` is `deal` of the config's tenants."""
        k = dealt.get(tenant)
        if k is None:
            k = self.ranking(tenant)[0]
        return k == self.index


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def learner_process_name(shard: Shard | None) -> str:
    """What a learner process calls itself in its readiness marker and status file ("learner", or
    "learner-K-of-N" for a shard); `clora up` waits for that marker."""
    return "learner" if shard is None else f"learner-{shard.label}"


@dataclass(frozen=True)
class SampledWith:
    """How the serving engine drew a logged completion when that was not the temperature-1 distribution its
    logged log-probs (vLLM's raw ones) describe: the tenant's version that drew it (0: the base model) and
    the settings that shaped the draw (temperature 0: greedy; top_k 0: off; top_p 1: off; min_p 0: off;
    logit_bias as (token id, bias) pairs; the penalties, 0, 0 and 1 when off; min_tokens, with the request's
    own stop_token_ids, which it cuts besides the model's). Logs mode recomputes the behaviour log-probs
    from them (logs_mode.behaviour_logprobs)."""

    version: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def has_history(self) -> bool:
        """Whether the draw depended on the tokens so far (penalties, min_tokens)."""
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_tokens) != (0, 0, 1, 0)


@dataclass(frozen=True)
class Example:
    """One completion to learn from: tokens, reward, and (logs mode) what the behaviour policy assigned.

    `behaviour_logprobs` has one entry per completion token, or is None when the trajectory carried none
    that fit (the update then uses the current policy's detached log-probs: ratio 1, plain policy gradient);
    an entry is NaN where that one token's is unknown (the same there: the stop token logs mode appends).
    `sampled_with` is set, and `behaviour_logprobs` None, when the behaviour log-probs are to be recomputed
    from the version and settings that drew the completion. `group` is what makes examples comparable (the
    prompt text): equal groups share a baseline.
    """

    id: str
    group: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    reward: float
    behaviour_logprobs: tuple[float, ...] | None = None
    sampled_with: SampledWith | None = None


@dataclass(frozen=True)
class Sample:
    """One sampled completion: its text, its tokens when the sampler knows them, whether it ended on its
    own (end-of-sequence) rather than at the length limit, the adapter version that produced it, the id
    of the interaction the serving tier logged for it (None when nothing was logged), and the sampled
    tokens' log-probabilities under the policy that sampled them, at temperature 1 whatever the sampling
    temperature (vLLM's raw log-probs; one per token id; None when the sampler does not give them)."""

    text: str
    token_ids: tuple[int, ...] | None
    finished: bool
    version: str | None = None
    interaction_id: str | None = None
    logprobs: tuple[float, ...] | None = None
