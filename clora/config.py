"""clora's one typed configuration, loaded once from TOML with environment overrides.

Every process (`clora serve`, `clora ingest`, `clora learn`, ...) calls `load_config` at start and passes
plain values from the result to library code; nothing else in clora reads the environment. An override is
declared beside its field (`env="CLORA_..."` in `json_schema_extra`), so the list of variables is the model
itself. A bad file fails at start with every problem listed at once, each naming its field: a problem
between fields (two tenants with one name, a LoRA rank above serving's) is found along with the fields'
own, and one whose field came from the environment says which variable set it.

Deliberately not here: what a scorer *does* (ingest/scorers.py), how LoRA is applied (learner/), or any
I/O beyond reading the one file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tomllib
from collections.abc import Callable
from pathlib import Path
from functools import lru_cache
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError, field_validator,
                      model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

logger = logging.getLogger(__name__)

CONFIG_ENV = "CLORA_CONFIG"
DEFAULT_CONFIG_FILE = "clora.toml"

# A tenant name becomes a directory name: a letter or digit first, no trailing "." (Windows drops it), at
# most 64 characters, and \Z, not $, at the end ($ also matches before a final newline). Not "HEAD.json" in
# any case: registry/<tenant>/ would be the registry's own registry/HEAD.json.
TENANT_NAME = re.compile(r"^(?!(?i:head\.json)\Z)[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,62}[A-Za-z0-9_-])?\Z")
TENANT_NAME_RULE = ("1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit, not ending with '.', "
                    "and not 'HEAD.json'")

# Scorer specs are "kind" or "kind:argument"; the implementations live in ingest/scorers.py.
SCORER_KINDS = ("feedback", "inline", "contains", "regex", "length", "json_valid", "digits", "uppercase", "python")
SCORERS_WITH_ARGUMENT = ("contains", "regex", "length", "python")
EVENT_SCORERS = ("feedback", "inline")  # rewards that come with the events: no function to score a sample


class ConfigError(ValueError):
    """The configuration is unusable; the message lists every problem, one per line."""


def env(name: str) -> dict[str, str]:
    """Declares the environment variable that overrides a field (read only by `load_config`)."""
    return {"env": name}


class _Strict(BaseModel):
    # No Infinity or NaN in any number: TOML writes them (inf, nan), and every setting is a finite amount.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


def _bootstrap_entry_ok(entry: str) -> bool:
    """One bootstrap server, by kafka-python's rules (cluster.collect_hosts), its port (default 9092) 1-65535."""
    text = re.sub(r"^.*://", "", entry.strip())
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            return False
        port = rest[1:] if rest else "9092"
    elif ":" not in text:
        host, port = text, "9092"
    else:
        try:
            socket.inet_pton(socket.AF_INET6, text)  # an IPv6 literal, on the default port
            return True
        except OSError:
            host, _, port = text.rpartition(":")
            if ":" in host:
                return False
    return (bool(host) and not any(c.isspace() or c in "/?#@" for c in host)
            and port.isdigit() and 1 <= int(port) <= 65535)


# ---------------------------------------------------------------------------------------------------------
# Sections


TOPIC_NAME = r"^[A-Za-z0-9._-]{1,249}$"  # what Kafka accepts as a topic name (and not "." or "..": _topic)
LORA_RANK_SIZES = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values (its kernels' sizes)
MIN_POLL_SECONDS = 0.01  # the shortest poll or flush interval: shorter is a busy loop that takes a core


def lora_rank_size(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    for size in LORA_RANK_SIZES:
        if size >= rank:
            return size
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank, {LORA_RANK_SIZES[-1]}")


def _home_expanded(v, field: str):
    """A path field's "~/x" as the home's x, for every process (others pass through to the field's type)."""
    try:
        return Path(v).expanduser() if isinstance(v, (str, Path)) else v
    except RuntimeError as e:  # "~nosuchuser/x", or no home directory to be found
        raise ValueError(f"{field} {str(v)!r}: {e}") from None


class KafkaConfig(_Strict):
    bootstrap: str = Field(
        "127.0.0.1:9092",
        description="Kafka bootstrap servers, comma separated host:port.",
        json_schema_extra=env("CLORA_KAFKA_BOOTSTRAP"),
    )
    interactions_topic: str = Field("clora.interactions", pattern=TOPIC_NAME, description="Topic carrying interaction events.")
    feedback_topic: str = Field("clora.feedback", pattern=TOPIC_NAME, description="Topic carrying feedback events.")
    dead_letter_topic: str = Field(
        "clora.dead-letter", pattern=TOPIC_NAME,
        description="Topic receiving rejected messages; not one of the two ingest reads."
    )
    partitions: int = Field(4, ge=1, description="Partitions per topic when clora creates its topics.")
    replication_factor: int = Field(
        -1, ge=-1, le=32767, description="Replicas of each topic clora creates (the interactions, feedback and "
        "dead-letter topics, where missing); -1: the cluster's default.replication.factor (Kafka 2.4 or newer). "
        "Topics that exist are left as they are."
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How every clora Kafka client (ingest, serving's event log, topic creation) "
        "connects: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL (SASL authentication, over TLS for SASL_SSL)."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="SASL mechanism with a SASL_* security_protocol."
    )
    sasl_username: str | None = Field(None, description="SASL user name.", json_schema_extra=env("CLORA_KAFKA_SASL_USERNAME"))
    sasl_password: SecretStr | None = Field(
        None, description="SASL password (better from the environment than in the file).",
        json_schema_extra=env("CLORA_KAFKA_SASL_PASSWORD")
    )
    ssl_cafile: Path | None = Field(
        None, description="SSL/SASL_SSL: CA certificate (PEM) the brokers' certificates are checked against "
        "(unset: the system's)."
    )
    ssl_certfile: Path | None = Field(None, description="SSL/SASL_SSL: client certificate (PEM), for mutual TLS.")
    ssl_keyfile: Path | None = Field(None, description="SSL/SASL_SSL: the client certificate's private key (PEM).")
    ssl_check_hostname: bool = Field(True, description="SSL/SASL_SSL: whether a broker's certificate must name its host.")
    group_id: str = Field("clora-ingest", description="Consumer group of the ingest processes.")
    session_timeout_ms: int = Field(
        6000, ge=1000, description="Consumer-group session timeout; a group join takes about half of it."
    )
    heartbeat_interval_ms: int = Field(
        2000, ge=100, description="Consumer-group heartbeat interval; below session_timeout_ms."
    )

    @field_validator("replication_factor")
    @classmethod
    def _replicas(cls, v: int) -> int:
        if v == 0:
            raise ValueError("a topic needs at least 1 replica (-1: the cluster's default)")
        return v

    @field_validator("ssl_cafile", "ssl_certfile", "ssl_keyfile", mode="before")
    @classmethod
    def _ssl_file(cls, v, info):
        return _home_expanded(v, f"kafka.{info.field_name}")

    def client_options(self) -> dict[str, Any]:
        """The kafka-python keyword arguments of the connection settings above (with bootstrap_servers), for
        every client clora makes: consumer, producer and admin alike."""
        options: dict[str, Any] = {"bootstrap_servers": self.bootstrap, "security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL_"):
            options.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                           sasl_plain_password=_secret(self.sasl_password))
        if self.security_protocol.endswith("SSL"):
            options.update(ssl_check_hostname=self.ssl_check_hostname)
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if (path := getattr(self, name)) is not None:
                    options[name] = str(path)
        return options

    @field_validator("interactions_topic", "feedback_topic", "dead_letter_topic")
    @classmethod
    def _topic(cls, v: str) -> str:
        if v in (".", ".."):
            raise ValueError(f"{v!r} is not a topic name Kafka accepts")
        return v

    @field_validator("bootstrap")
    @classmethod
    def _host_port_list(cls, v: str) -> str:
        """Each entry as the Kafka client reads it (it raises from deep inside on anything else): host,
        host:port, [IPv6] or [IPv6]:port, an IPv6 literal, after an optional PROTOCOL:// prefix."""
        for entry in v.split(","):
            if not _bootstrap_entry_ok(entry):
                raise ValueError(f"{v!r}: {entry.strip()!r} is not host:port (comma separated, e.g. "
                                 "127.0.0.1:9092 or [::1]:9092)")
        return v


class BrokerConfig(_Strict):
    embedded: bool = Field(
        True, description="Whether `clora up` starts the embedded broker (false when an external Kafka is used)."
    )
    host: str = Field("127.0.0.1", description="Address the embedded broker binds to.")
    port: int = Field(9092, ge=1, le=65535, description="Port the embedded broker listens on.")


class ModelConfig(_Strict):
    path: Path | None = Field(
        None,
        description="Base model directory (Hugging Face layout). Empty: the tiny local model, built on first "
        "use under <data_dir>/models/tiny-<seed>.",
        json_schema_extra=env("CLORA_MODEL_PATH"),
    )
    name: str = Field("base", description="Name under which the serving tier exposes the base model.")
    seed: int = Field(0, description="Seed of the tiny local model (same seed, byte-identical weights).")

    @field_validator("name")
    @classmethod
    def _name_is_not_a_version(cls, v: str) -> str:
        if not v.strip() or "@" in v:  # "<tenant>@<n>" names a tenant's version, in requests and responses
            raise ValueError(f"model.name {v!r} must be non-empty and must not contain '@'")
        return v

    @field_validator("path", mode="before")
    @classmethod
    def _empty_is_the_tiny_model(cls, v):
        if isinstance(v, str) and not v.strip():
            return None  # Path("") would be the current directory
        return _home_expanded(v, "model.path")


class ServingConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address the HTTP API binds to.")
    admin_key: SecretStr | None = Field(
        None, description="Bearer key for /metrics and /health's details (every tenant's name and version). "
        "Unset: both answer anyone who reaches the port, which the default host (127.0.0.1) keeps local; set it "
        "when tenants can reach the port.", json_schema_extra=env("CLORA_ADMIN_KEY")
    )
    port: int = Field(8000, ge=1, le=65535, description="Port of the HTTP API.", json_schema_extra=env("CLORA_PORT"))

    @field_validator("admin_key")
    @classmethod
    def _admin_key_length(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 8:
            raise ValueError("admin_key must be at least 8 characters")
        return v

    @property
    def local_url(self) -> str:
        """Where a client on this machine reaches the API: a wildcard bind address is reached on loopback,
        and an IPv6 address goes in brackets."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    max_loras: int = Field(8, ge=1, description="Adapters that may take part in one engine batch.")
    max_cpu_loras: int = Field(
        16, ge=1, description="Adapters kept loaded (warm) in the engine; at least max_loras (a smaller value is "
        "raised to it, as vLLM requires)."
    )
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="Largest LoRA rank the engine accepts: one of vLLM's sizes, 1, 8, 16, 32, 64, 128, 256, "
        "320 or 512 (its kernels are built for those)."
    )
    max_model_len: int = Field(512, ge=16, description="Longest sequence (prompt + completion) in tokens.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences decoded together in one engine step.")
    default_max_tokens: int | None = Field(
        None, ge=1, description="Completion length of a request that sets none (max_tokens/max_completion_tokens). "
        "Unset: a chat request gets the room its context leaves (max_model_len - prompt), a /v1/completions "
        "request 16 tokens, as OpenAI and vLLM do."
    )
    max_request_bytes: int | None = Field(
        None, ge=1024, description="Largest request body; larger ones get 413. Unset: 1 MiB, or 96 bytes per "
        "max_model_len token when that is more (a prompt that fills the context, JSON-escaped, still fits)."
    )
    max_feedback_per_second: float = Field(
        100.0, gt=0, description="Feedback calls one tenant may make a second on average (bursts of twice that); "
        "beyond it, 429 with Retry-After. Every feedback event is stored, and one for an interaction not seen yet "
        "waits in ingest's memory."
    )
    max_inflight_per_tenant: int = Field(
        64, ge=1, description="Completions (prompts x n) one tenant may have in the engine at once; a request "
        "beyond it waits for room up to max_inflight_wait_seconds, then gets 429 with Retry-After. Below "
        "max_num_seqs, one tenant cannot take every sequence of an engine step (the defaults are equal: set it "
        "lower where tenants share the engine under load)."
    )
    max_inflight_wait_seconds: float = Field(
        30.0, ge=0, description="How long a request over its tenant's max_inflight_per_tenant waits for room (first "
        "come, first served) before its 429: a client sending more at once than the limit gets answers, not "
        "refusals its SDK gives up on after two quick retries. 0: refused at once."
    )
    idempotency_ttl_seconds: float = Field(
        3600.0, ge=0, description="How long the answer of a completion request sent with an Idempotency-Key header "
        "is kept: the same request sent again with that key within it gets that answer again, with nothing "
        "generated or logged twice. 0: the header is ignored."
    )
    idempotency_cache_mib: float = Field(
        64.0, gt=0, description="Memory the kept answers of Idempotency-Key requests take at most, MiB, shared by the "
        "tenants; past it the oldest answers of the tenant keeping the most leave first."
    )
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        "auto", description="Engine dtype: auto, float32 (float), bfloat16, float16 (half)."
    )
    kv_cache_gib: float = Field(
        1.0, ge=0, description="KV cache the engine reserves, GiB, on any device (1 GiB suits a CPU host; on a GPU set "
        "it, or 0: vLLM sizes it from the GPU's free memory)."
    )
    registry_poll_seconds: float = Field(
        0.5, ge=MIN_POLL_SECONDS, description="How often the registry is checked for new versions (at least 0.01 s: "
        "shorter is a busy loop)."
    )
    shutdown_grace_seconds: float = Field(
        30.0, ge=0, description="On stop, how long generations still running may take to finish; those running past "
        "it end with a 503 server_stopping (a stream: its last event) and can be sent again. `clora up` gives "
        "serving this plus 30 s to stop (the last answers, the event log's drain, the engine's stop)."
    )


BATCH_OVERHEAD_BYTES = 64 << 10  # a record batch's header, one record's framing, key and headers


class IngestConfig(_Strict):
    flush_rows: int = Field(5000, ge=1, description="Write Parquet once this many events are buffered.")
    flush_seconds: float = Field(
        1.0, ge=MIN_POLL_SECONDS, description="Write Parquet at least this often (freshness bound; at least 0.01 s)."
    )
    max_message_bytes: int = Field(1_000_000, ge=64, description="Larger messages are dead-lettered.")
    max_batch_bytes: int = Field(
        64 << 20, description="The most one Kafka record batch may decompress to: a larger one (a "
        "decompression bomb, or a producer's batches set far larger than usual) is one dead letter "
        "(batch_too_large) holding the batch as stored, its records not read. Bounds ingest's memory per batch; "
        "at least max_message_bytes + 64 KiB, so a batch of one largest message fits."
    )
    max_batch_scoring_seconds: float = Field(
        30.0, gt=0, description="A batch whose scorer functions have run this long ends before its next scorer call: "
        "what was processed is written and committed, the rest is read again for the next batch. Keeps a slow "
        "scorer (python:, a judge model behind it) from holding every row of the batch back, or the loop from polls."
    )
    unknown_tenant: Literal["reject", "create"] = Field(
        "create", description="Events of tenants absent from the config: dead-letter them, or create the tenant "
        "(with the feedback scorer, up to max_auto_tenants)."
    )
    removed_tenant_grace_seconds: float = Field(
        300.0, ge=0, description="With unknown_tenant = \"reject\": how long a tenant a config re-read removed is "
        "still stored. Serving reads the config again seconds later than ingest and answers the tenant meanwhile, "
        "and its requests running then end later still: their events would be dead-lettered as unknown_tenant."
    )
    max_auto_tenants: int = Field(
        64, ge=1, description="With unknown_tenant = \"create\": tenants absent from the config that may exist, those "
        "already on disk included; events of further new tenants are dead-lettered (unknown_tenant). Any Kafka "
        "producer can name a tenant, and each gets a partition in every dataset and a learner adapter."
    )
    pending_expiry_hours: float = Field(
        72.0, gt=0, description="Feedback or unscored interactions older than this without a partner are dropped."
    )
    max_pending_feedback_per_tenant: int = Field(
        100_000, ge=1, description="Feedback waiting in memory for an interaction not seen yet, per tenant (~0.5 KB "
        "each); beyond it the tenant's oldest waiting feedback leaves the join (it stays in feedback/, and a late "
        "interaction is then not scored by it). Bounds what a flood of feedback for made-up ids can hold."
    )
    max_pending_feedback: int = Field(
        1_000_000, ge=1, description="Feedback waiting in memory for an interaction not seen yet, every tenant "
        "together (~0.5 KB each); beyond it the oldest waiting feedback of the tenant holding the most leaves the "
        "join, so one tenant's flood does not take the others' room."
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port of the ingest process (0: none).")
    metrics_host: str = Field(
        "127.0.0.1", description="Address the ingest metrics listen on (0.0.0.0: every address, for a Prometheus "
        "in another container or host)."
    )
    processes: int = Field(
        1, ge=1, le=64, description="`clora up`: ingest processes in one consumer group (kafka.group_id), splitting "
        "the partitions between them (`clora ingest --member K`); beyond one per partition the rest wait idle. "
        "With metrics_port set, process K serves its metrics on metrics_port + K."
    )

    @model_validator(mode="after")
    def _batch_holds_a_message(self) -> IngestConfig:
        if self.max_batch_bytes < self.max_message_bytes + BATCH_OVERHEAD_BYTES:
            raise ValueError(f"max_batch_bytes ({self.max_batch_bytes}) must be at least max_message_bytes "
                             f"({self.max_message_bytes}) + {BATCH_OVERHEAD_BYTES}: a batch of one message that "
                             "large would be dead-lettered whole")
        return self


MAX_RETENTION_DAYS = 100_000.0  # some 270 years; beyond it the cutoff overflows a timestamp


class RetentionConfig(_Strict):
    days: float = Field(
        0.0, ge=0, le=MAX_RETENTION_DAYS, description="Delete stored interactions, feedback, trajectories and dead letters once every row "
        "of their file is older than this (`clora prune`; `clora up`'s compactor does it on each run). 0: keep "
        "everything. Keep it above the Kafka topics' retention (an event older than it that Kafka delivered again "
        "would be stored again) and at least ingest.pending_expiry_hours."
    )


class CompactionConfig(_Strict):
    every_seconds: float = Field(
        600.0, ge=0, description="`clora up` runs `clora compact --every` as a child at this interval: ingest writes "
        "a file per flush per tenant (~86,000 a day), which every listing would otherwise read. 0: not run."
    )
    grace_seconds: float = Field(
        60.0, ge=0, description="Merged inputs are deleted once the merged file is this old (running queries finish)."
    )


class LearnerConfig(_Strict):
    scheduler: Literal["round_robin", "most_backlog", "fair_share"] = Field(
        "round_robin", description="How the next tenant is chosen."
    )
    poll_seconds: float = Field(
        1.0, ge=MIN_POLL_SECONDS, description="Sleep when no tenant has new trajectories (at least 0.01 s)."
    )
    clip_eps: float = Field(
        0.2, gt=0, description="PPO clip range of the ratio to the adapter as a step starts (the proximal policy): "
        "the trust region of update_epochs > 1. With one optimizer step per batch that ratio stays 1 and the clip "
        "does not act; stale samples are corrected by behaviour_weight_cap either way."
    )
    update_epochs: int = Field(
        1, ge=1, le=16, description="Optimizer steps on each batch (PPO's epochs): more learning per sample, "
        "as many training passes per step, each epoch after the first clipped to 1 +- clip_eps around the "
        "adapter as the step started."
    )
    behaviour_weight_cap: float = Field(
        2.0, ge=1, description="Each sampled token's policy gradient is weighed by "
        "min(pi / pi_behaviour, this cap): the importance weight of the policy that sampled it (an older served "
        "version, an app's own model), truncated so one token it made unlikely cannot carry the update."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the base model (0: off).")
    entropy_coef: float = Field(
        0.0, ge=0, description="Weight of the entropy bonus (0: off): minus this times the policy's entropy (nats) "
        "at each completion position is added to the loss, so that a tenant does not collapse onto one answer "
        "whose batches all score alike and teach nothing."
    )
    scale_advantages: bool = Field(
        True, description="Divide advantages by the std of the rewards: in logs mode each batch's (small or sparse "
        "rewards still learn), in rollouts mode each prompt's group's (GRPO). false: rewards minus their baseline "
        "only (Dr. GRPO in rollouts mode), so a group whose rewards barely differ moves the adapter barely; "
        "then the learning rate sets the step for the rewards' units."
    )
    skip_flat_batches: bool = Field(
        True,
        description="logs mode: a batch of 2+ trajectories with all rewards equal, or whose every prompt came several "
        "times with its answers all scored alike (every advantage 0), trains nothing (only the baseline): its "
        "advantages are noise, or zero, that an Adam step would turn into a full-size step on its momentum.",
    )
    batch_wait_seconds: float = Field(
        5.0, ge=0, description="logs mode: a tenant with fewer than batch_size untrained trajectories trains once "
        "they have waited this long (a batch of one or two sparse rewards is mostly noise; this bounds freshness); "
        "0: train whatever is there. `clora learn --once/--until-idle` never wait."
    )
    catch_up: int = Field(
        4, ge=1, le=64, description="logs mode: a tenant with more than batch_size untrained trajectories trains up "
        "to this many batches' worth in one step (in micro-batches of batch_size: one batch's memory), so a learner "
        "that falls behind its traffic catches up with fewer, larger steps instead of training a backlog that has "
        "aged past max_staleness; 1: always batch_size."
    )
    max_staleness: int = Field(
        4, ge=0, description="Trajectories from an adapter version more than this many served versions behind the "
        "current one are dropped (rejected candidates do not count)."
    )
    sample_ahead: bool = Field(
        True, description="Rollouts mode with a prompts file: issue a tenant's next rollouts as soon as its current "
        "step has its samples, so the serving tier samples step k+1 while the learner trains step k (those samples "
        "come from the version before the newest, within max_staleness; off with max_staleness = 0); false: only "
        "after each step's commit."
    )
    keep_versions: int = Field(5, ge=1, description="Published versions kept on disk per tenant.")
    gate_max_kl: float = Field(
        10.0, gt=0, description="Publish gate: largest mean per-token KL to the base model (nats); catches an adapter "
        "that has drifted into degenerate text, not ordinary learning."
    )
    gate_reward_tolerance: float = Field(
        0.1, ge=0, description="Publish gate: the greedy probe reward may fall this much below the parent's, plus "
        "gate_reward_z standard errors of the per-prompt changes."
    )
    gate_reward_z: float = Field(
        1.0, ge=0, description="Publish gate: the probe reward may also fall by this many standard errors of the "
        "per-prompt changes (parent and candidate on the same prompts), so one probe prompt flipping is not a "
        "regression; 0: the tolerance alone."
    )
    gate_max_abs_reward: float = Field(
        100.0, gt=0, description="Publish gate: a batch with a non-finite reward or one beyond +-this is rejected."
    )
    gate_prompts: int = Field(
        4, ge=0, description="Publish gate: probe prompts greedy-decoded to compare rewards with the parent (0: off)."
    )
    round_tenants: int = Field(
        8, ge=1, le=256, description="Up to this many ready tenants step together as one round: each trains in "
        "turn, then the gate probes of all of them are greedy-decoded in one batch (one decode per round instead "
        "of one per tenant); a tenant joins the scheduler's pick only if it has a probe and nothing to wait for. "
        "1: one tenant per step."
    )
    rollout_sampler: Literal["serving", "local"] = Field(
        "serving",
        description="Rollouts mode: sample through the serving tier's HTTP API, or with the learner's own model.",
    )
    rollout_priority: int = Field(
        1, ge=0, le=2**31 - 1, description="Rollouts through the serving tier: their place in the engine's queue "
        "(the request's `priority`; production requests have 0, and smaller goes first), so an app's requests "
        "do not wait behind the experiments' rollouts. The queue has no aging: under sustained production load "
        "rollouts wait, and their step fails and is retried. 0: rollouts queue with production traffic, by "
        "arrival."
    )
    serving_url: str | None = Field(
        None,
        description="Where rollouts reach the serving tier, e.g. http://serving:8000 in another container. "
        "Unset: http://<serving.host>:<serving.port>, the serving process on this machine.",
        json_schema_extra=env("CLORA_SERVING_URL"),
    )
    max_new_tokens: int = Field(32, ge=1, description="Completion length of rollouts and of the gate's probes.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip of every update.")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|mps|(cuda|xpu)(:[0-9]+)?)$",
        description="Device of the learner's model: auto (cuda if present), cpu, cuda, cuda:N (or mps, xpu[:N])."
    )
    max_resident_tenants: int = Field(
        0, ge=0, description="Tenants whose adapter and optimizer state the learner holds in memory at once; "
        "another tenant's step first unloads the one that stepped longest ago (everything about it is in its "
        "last checkpoint, which its next step loads again). Bounds the learner's memory with many tenants "
        "(on a 4B model at r = 8 over every linear layer, ~250 MB a tenant: fp32 weights, gradient and Adam's moments); 0: no limit. A round "
        "(learner.round_tenants) keeps all of its tenants loaded."
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus port of the learner (0: none); learner shard K (`clora learn "
        "--shard K/N`, learner.processes under `clora up`) serves on metrics_port + K."
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address the learner metrics listen on (0.0.0.0: every address)."
    )
    processes: int = Field(
        1, ge=1, le=64, description="`clora up`: learner processes, each training its shard of the tenants "
        "(`clora learn --shard K/N`) with its own copy of the base model, so tenants train in parallel."
    )


class LoraConfig(_Strict):
    rank: int = Field(8, ge=1, le=256, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Module names the adapter wraps.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")


class TenantConfig(_Strict):
    name: str = Field(description="Tenant name: letters, digits, '.', '_', '-'; at most 64 characters.")
    api_key: SecretStr = Field(description="Bearer key that identifies the tenant to the serving tier.")
    scorer: str = Field(
        "feedback",
        description="How interactions are scored: feedback, inline, contains:TEXT, regex:PATTERN, length:N, "
        "json_valid, digits, uppercase, python:module:function.",
    )
    scorer_time_limit_s: float = Field(
        1.0, gt=0, le=3600, description="A regex or python scorer still running after this long on one completion is "
        "stopped: ingest dead-letters the event (scorer_error), the learner leaves the sample out."
    )
    mode: Literal["logs", "rollouts"] = Field(
        "logs", description="logs: learn off-policy from production; rollouts: on-policy GRPO via the serving tier."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="The tenant's adapter shape.")
    learning_rate: float = Field(1e-3, gt=0, description="Adam learning rate of the tenant's adapter.")
    batch_size: int = Field(16, ge=1, description="Trajectories per training step.")
    group_size: int = Field(4, ge=1, description="Completions per prompt in rollouts mode (GRPO group).")
    prompts_file: Path | None = Field(None, description="Rollouts mode: a text file of prompts, one per line.")
    gate_max_kl: float | None = Field(
        None, gt=0, description="Publish gate: this tenant's largest mean per-token KL to the base model (nats); "
        "default learner.gate_max_kl. A tenant whose objective moves far from the base model needs more room."
    )

    @field_validator("prompts_file", mode="before")
    @classmethod
    def _prompts_file_home(cls, v):
        return _home_expanded(v, "prompts_file")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TENANT_NAME.match(v):
            raise ValueError(f"tenant name {v!r} must be {TENANT_NAME_RULE}")
        return v

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: SecretStr) -> SecretStr:
        if len(v.get_secret_value()) < 8:
            raise ValueError("api_key must be at least 8 characters")
        return v

    @field_validator("scorer")
    @classmethod
    def _scorer(cls, v: str) -> str:
        kind, sep, arg = v.partition(":")
        if kind not in SCORER_KINDS:
            raise ValueError(f"unknown scorer kind {kind!r}; expected one of {', '.join(SCORER_KINDS)}")
        if kind in SCORERS_WITH_ARGUMENT and not arg:
            raise ValueError(f"scorer {kind!r} needs an argument, e.g. {kind}:...")
        if kind not in SCORERS_WITH_ARGUMENT and sep:
            raise ValueError(f"scorer {kind!r} takes no argument, got {v!r}")
        if kind == "length" and not (arg.isdigit() and int(arg) > 0):
            raise ValueError(f"scorer 'length' needs a positive integer target, got {arg!r}")
        if kind == "regex":
            try:
                re.compile(arg)
            except re.error as e:
                raise ValueError(f"scorer regex {arg!r} does not compile: {e}") from e
        if kind == "python" and (arg.count(":") != 1 or not all(arg.split(":"))):
            raise ValueError(f"scorer 'python' needs module:function, got {arg!r}")
        return v


class Config(_Strict):
    data_dir: Path = Field(
        Path(".clora"), description="Root of everything clora keeps on disk.", json_schema_extra=env("CLORA_DATA_DIR")
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="Logging level of every process.", json_schema_extra=env("CLORA_LOG_LEVEL")
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_any_case(cls, v):
        return v.upper() if isinstance(v, str) else v

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir_not_empty(cls, v):
        if isinstance(v, str) and not v.strip():
            raise ValueError("data_dir must not be empty (it would be the current directory)")
        if isinstance(v, (str, Path)) and "\x00" in str(v):
            raise ValueError("data_dir must not contain a NUL character")
        return _home_expanded(v, "data_dir")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig, description="Kafka connection and topics.")
    broker: BrokerConfig = Field(default_factory=BrokerConfig, description="The embedded broker.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The shared base model.")
    serving: ServingConfig = Field(default_factory=ServingConfig, description="The serving tier.")
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="The ingest process.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The learner process.")
    compaction: CompactionConfig = Field(default_factory=CompactionConfig, description="Background compaction.")
    retention: RetentionConfig = Field(default_factory=RetentionConfig, description="Deleting old data.")
    tenants: list[TenantConfig] = Field(default_factory=list, description="Tenants, each owning one adapter.")

    @model_validator(mode="wrap")
    @classmethod
    def _whole_config(cls, data: Any, handler) -> Config:
        """The problems between fields, one per problem at its field (e.g. tenants.1.name), found along with
        the fields' own: when some field is bad, from the fields that are good on their own."""
        try:
            cfg = handler(data)
        except ValidationError as e:
            between = _between_fields(_Partial(cls, data))
            if not between:
                raise
            # Rebuilt as custom errors of the same type and message: pydantic cannot rebuild some of its own
            # types from their names (a Path field's "path_type" raised KeyError here).
            errors = [InitErrorDetails(type=PydanticCustomError(err["type"], "{msg}", {"msg": err["msg"]}),
                                       loc=err["loc"], input=err["input"])
                      for err in e.errors(include_url=False)]
            raise ValidationError.from_exception_data(cls.__name__, errors + _as_errors(between)) from None
        between = _between_fields(cfg)
        if between:
            raise ValidationError.from_exception_data(cls.__name__, _as_errors(between))
        return cfg

    def retention_too_short(self, days: float) -> str | None:
        """Why a retention of `days` would delete interactions feedback may still come for, or None."""
        return _retention_too_short(days, self.ingest.pending_expiry_hours)

    def tenant(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    def tenant_by_key(self, key: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.api_key.get_secret_value() == key), None)

    @property
    def model_path(self) -> Path:
        """The base model directory: the configured one, or the cached tiny model."""
        return self.model.path or self.data_dir / "models" / f"tiny-{self.model.seed}"


# ---------------------------------------------------------------------------------------------------------
# Problems between fields


UNKNOWN: Any = type("Unknown", (), {"__repr__": lambda self: "UNKNOWN"})()  # a field that is itself bad


class _Partial:
    """A config that failed validation, as far as its fields are good on their own: attribute `x` is field
    x's value validated alone (constraints, no field validator), its default when absent, a _Partial for a
    section, a list of them for the tenants, or UNKNOWN when the field is bad itself (reported as such)."""

    def __init__(self, model: type[BaseModel], raw: Any) -> None:
        self._model = model
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        field = self._model.model_fields[name]  # KeyError for what is no field: a mistake here
        raw, annotation = self._raw, field.annotation
        if isinstance(raw, BaseModel):
            return getattr(raw, name)
        if not isinstance(raw, dict):  # the section itself is bad (`serving = 5`): so is every field in it
            return _Partial(annotation, None) if _is_model(annotation) else [] if name == "tenants" else UNKNOWN
        if name not in raw:
            value = field.get_default(call_default_factory=True)
            return _Partial(annotation, value) if _is_model(annotation) and value is not None else value
        value = raw[name]
        if _is_model(annotation):
            return _Partial(annotation, value)
        if name == "tenants" and self._model is Config:
            return [_Partial(TenantConfig, t) for t in value] if isinstance(value, list) else []
        try:
            return _field_adapter(self._model, name).validate_python(value)
        except ValidationError:
            return UNKNOWN


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


@lru_cache(maxsize=None)
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter:
    """Validates one field alone: its type and constraints (ge, le, ...), not its field validators."""
    field = model.model_fields[name]
    return TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)


def _secret(v: Any) -> Any:
    return v.get_secret_value() if isinstance(v, SecretStr) else v


def _known(*values: Any) -> bool:
    return all(v is not UNKNOWN for v in values)


def _between_fields(c: Any) -> list[tuple[tuple[str | int, ...], str]]:
    """(location, message) for each problem between fields of `c`, a Config or a _Partial one; a check
    whose fields are UNKNOWN (bad themselves) is skipped."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    kafka = c.kafka
    if _known(kafka.heartbeat_interval_ms, kafka.session_timeout_ms) and \
            kafka.heartbeat_interval_ms >= kafka.session_timeout_ms:
        problems.append((("kafka", "heartbeat_interval_ms"), f"heartbeat_interval_ms ({kafka.heartbeat_interval_ms}) "
                         f"must be below session_timeout_ms ({kafka.session_timeout_ms})"))
    if _known(kafka.security_protocol) and str(kafka.security_protocol).startswith("SASL_"):
        for field in ("sasl_mechanism", "sasl_username", "sasl_password"):
            if getattr(kafka, field) is None:
                problems.append((("kafka", field), f"security_protocol {kafka.security_protocol} needs "
                                 f"kafka.{field}" + (" (or $CLORA_KAFKA_SASL_PASSWORD)" if field == "sasl_password"
                                                     else "")))
    if _known(kafka.ssl_certfile, kafka.ssl_keyfile) and (kafka.ssl_certfile is None) != (kafka.ssl_keyfile is None):
        problems.append((("kafka", "ssl_keyfile" if kafka.ssl_keyfile is None else "ssl_certfile"),
                         "ssl_certfile and ssl_keyfile go together (the client certificate and its key)"))
    topics = {"interactions_topic": kafka.interactions_topic, "feedback_topic": kafka.feedback_topic}
    if _known(*topics.values()) and topics["interactions_topic"] == topics["feedback_topic"]:
        problems.append((("kafka", "feedback_topic"), f"feedback_topic {kafka.feedback_topic!r} is also the "
                         "interactions_topic: each needs a topic of its own"))
    if _known(kafka.dead_letter_topic):
        for field, topic in topics.items():
            if _known(topic) and topic == kafka.dead_letter_topic:
                problems.append((("kafka", "dead_letter_topic"), f"dead_letter_topic {topic!r} is also the "
                                 f"{field}: ingest would read its own rejected messages back, and reject them again "
                                 "for ever"))
    ingest = c.ingest
    if _known(ingest.metrics_port, ingest.processes) and ingest.metrics_port and \
            ingest.metrics_port + ingest.processes - 1 > 65535:
        problems.append((("ingest", "metrics_port"), f"metrics_port {ingest.metrics_port} leaves no port for all "
                         f"{ingest.processes} ingest processes (process K serves on metrics_port + K, at most 65535)"))
    learner = c.learner
    if _known(learner.metrics_port, learner.processes) and learner.metrics_port and \
            learner.metrics_port + learner.processes - 1 > 65535:
        problems.append((("learner", "metrics_port"), f"metrics_port {learner.metrics_port} leaves no port for all "
                         f"{learner.processes} learner processes (shard K serves on metrics_port + K, at most 65535)"))
    tenants = c.tenants if isinstance(c.tenants, list) else []
    first_name: dict[str, int] = {}
    first_folded: dict[str, tuple[int, str]] = {}
    first_key: dict[str, int] = {}
    for i, t in enumerate(tenants):
        name = t.name
        if isinstance(name, str):
            if name in first_name:
                problems.append((("tenants", i, "name"),
                                 f"tenant name {name!r} appears more than once (also tenants.{first_name[name]})"))
            elif name.casefold() in first_folded:  # one directory on a case-insensitive disk (macOS, Windows)
                j, other = first_folded[name.casefold()]
                problems.append((("tenants", i, "name"), f"tenant name {name!r} differs from another only in case "
                                 f"({other!r}, tenants.{j}): one directory on a case-insensitive disk"))
            first_name.setdefault(name, i)
            first_folded.setdefault(name.casefold(), (i, name))
            model_name = c.model.name
            if isinstance(model_name, str) and name == model_name:
                problems.append((("tenants", i, "name"), f"tenant name {name!r} collides with model.name"))
        key = _secret(t.api_key)
        if isinstance(key, str):
            if key in first_key:
                problems.append((("tenants", i, "api_key"),
                                 f"two tenants share an api_key (this one and tenants.{first_key[key]}'s)"))
            first_key.setdefault(key, i)
    admin = _secret(c.serving.admin_key)
    if isinstance(admin, str) and admin in first_key:
        problems.append((("serving", "admin_key"),
                         f"serving.admin_key is also a tenant's api_key (tenants.{first_key[admin]})"))
    max_rank = c.serving.max_lora_rank
    for i, t in enumerate(tenants):
        rank = t.lora.rank
        if _known(rank, max_rank) and rank > max_rank:
            problems.append((("tenants", i, "lora", "rank"),
                             f"tenant {_shown(t.name, i)}: lora.rank {rank} exceeds serving.max_lora_rank {max_rank}"))
    for i, t in enumerate(tenants):
        if t.mode == "rollouts" and _known(t.scorer) and t.scorer.partition(":")[0] in EVENT_SCORERS:
            problems.append((("tenants", i, "scorer"), f"tenant {_shown(t.name, i)}: rollouts mode needs a "
                             f"programmatic scorer to score its own samples, but scorer is {t.scorer!r} (rewards "
                             "from events): e.g. contains:..., regex:..., length:N or python:module:function"))
        if t.mode == "rollouts" and _known(t.group_size) and t.group_size < 2:
            problems.append((("tenants", i, "group_size"), f"tenant {_shown(t.name, i)}: group_size {t.group_size} "
                             "in rollouts mode never learns (each sample's advantage is its reward minus its group's "
                             "mean, 0 in a group of one); use 2 or more"))
    if c.learner.rollout_sampler == "serving":  # rollouts are /v1/completions requests with n = group_size
        from serving.protocol import MAX_N, MIN_TEMPERATURE

        inflight, temperature = c.serving.max_inflight_per_tenant, c.learner.temperature
        sampled = []  # group sizes that sample, for the temperature check
        for i, t in enumerate(tenants):
            if t.mode != "rollouts" or not _known(t.group_size):
                continue
            if t.group_size > MAX_N:
                problems.append((("tenants", i, "group_size"), f"tenant {_shown(t.name, i)}: group_size "
                                 f"{t.group_size} is more than the {MAX_N} completions a serving request may ask for (n)"))
            if _known(inflight) and t.group_size > inflight - inflight // 4:
                problems.append((("tenants", i, "group_size"), f"tenant {_shown(t.name, i)}: group_size "
                                 f"{t.group_size} is more than serving.max_inflight_per_tenant {inflight} less the "
                                 f"quarter kept for production requests ({inflight // 4}): a rollout request that "
                                 "large waits until the tenant holds nothing"))
            if t.group_size > 1:
                sampled.append(t.group_size)
        if sampled and _known(temperature) and not MIN_TEMPERATURE <= temperature <= 2:
            why = (f"the engine samples at {MIN_TEMPERATURE:g} at least, and the learner would train another policy"
                   if temperature < MIN_TEMPERATURE else "serving samples at temperatures up to 2")
            problems.append((("learner", "temperature"),
                             f"learner.temperature {temperature:g} is outside {MIN_TEMPERATURE:g} to 2 ({why})"))
    new_tokens, context = c.learner.max_new_tokens, c.serving.max_model_len
    if _known(new_tokens, context) and new_tokens >= context:
        problems.append((("learner", "max_new_tokens"), f"learner.max_new_tokens {new_tokens} leaves no room in "
                         f"serving.max_model_len {context} for a prompt (rollouts and the gate's probes)"))
    days, every = c.retention.days, c.compaction.every_seconds
    if _known(days, every) and days > 0 and every == 0:
        problems.append((("retention", "days"),
                         "retention.days is set but compaction.every_seconds is 0: the compactor that `clora up` runs "
                         "is what deletes old data (or leave retention.days at 0 and run `clora prune "
                         "--older-than-days` yourself)"))
    expiry = c.ingest.pending_expiry_hours
    if _known(days, expiry) and days > 0 and (short := _retention_too_short(days, expiry)):
        problems.append((("retention", "days"), f"retention.days {short}"))
    return problems


def _shown(name: Any, i: int) -> str:
    return repr(name) if isinstance(name, str) else f"tenants.{i}"


def _retention_too_short(days: float, pending_expiry_hours: float) -> str | None:
    if days * 24 < pending_expiry_hours:
        return (f"{days:g} is shorter than ingest.pending_expiry_hours {pending_expiry_hours:g}: "
                "feedback could come for interactions already deleted")
    return None


def _as_errors(problems: list[tuple[tuple[str | int, ...], str]]) -> list[InitErrorDetails]:
    return [InitErrorDetails(type=PydanticCustomError("config", "{problem}", {"problem": message}), loc=loc, input=None)
            for loc, message in problems]


# ---------------------------------------------------------------------------------------------------------
# Loading


def _env_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(field path, variable) for every field that declares an environment override."""
    found = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "env" in extra:
            found.append(((*prefix, name), extra["env"]))
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found.extend(_env_fields(field.annotation, (*prefix, name)))
    return found


def env_variables() -> dict[str, str]:
    """Every supported override: variable -> dotted field."""
    return {var: ".".join(path) for path, var in _env_fields(Config)}


# CLORA_* variables read elsewhere: the config's file, the CPU engine's switches, compose.yaml's own, and
# the seed of the ingest SIGKILL test's kill times.
OTHER_ENV = frozenset({CONFIG_ENV, "CLORA_CPU_LORA_OPS", "CLORA_CPU_LORA_COMPILE", "CLORA_ENGINE_WAIT",
                       "CLORA_INSTALL", "CLORA_MODELS_DIR", "CLORA_TEST_SEED"})


def unknown_env_variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Each CLORA_* variable set that nothing reads (a typo, or a name from another tool: exported
    CLORA_MODEL leaves the tiny model in place) -> a line saying so, with the nearest real name if any."""
    import difflib

    environ = os.environ if environ is None else environ
    known = [*env_variables(), *OTHER_ENV]
    lines = {}
    for name in sorted(n for n in environ if n.startswith("CLORA_") and n not in known):
        # a known name's own ending first (CLORA_SERVING_PORT: CLORA_PORT), then the nearest in spelling
        tails = {k.removeprefix("CLORA_"): k for k in known}
        tail = name.removeprefix("CLORA_")
        near = [k for t, k in tails.items() if tail.endswith("_" + t)][:1] or \
            [tails[t] for t in difflib.get_close_matches(tail, tails, n=1, cutoff=0.6)]
        hint = f" (did you mean {near[0]}?)" if near else ""
        lines[name] = f"{name} is not a clora setting and is ignored{hint}; `clora config env` lists them"
    return lines


def _format_errors(e: ValidationError, source: str, from_env: dict[tuple[str, ...], str] | None = None) -> str:
    """One line per problem at its field; `from_env`: field path -> the variable that set it, named on its
    lines (the file is not where to look for those)."""
    lines = [f"invalid configuration ({source}): {e.error_count()} problem(s)"]
    for err in e.errors():
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        msg = _in_clora_words(err["type"], loc, err["input"]) or err["msg"].removeprefix("Value error, ")
        var = next((v for keys, v in (from_env or {}).items() if loc[:len(keys)] == keys), None)
        lines.append(f"  - {where}: {msg}" + (f" (from ${var})" if var else ""))
    return "\n".join(lines)


def _in_clora_words(kind: str, loc: tuple[str | int, ...], value: Any) -> str | None:
    """The problem for the pydantic errors whose own words name its internals ("Extra inputs are not permitted",
    "instance of ServingConfig", "<class 'pathlib.Path'>") rather than what to write in the TOML; None for the
    others, whose messages say it already."""
    if kind == "extra_forbidden":
        return _unknown_setting(loc, value)
    if kind == "model_type":  # `serving = 5`: a section, or a [[tenants]] entry, that is no table
        return "must be a table"
    if kind == "path_type":
        return "must be a path (a string)"
    if kind == "list_type":
        return "must be an array of tables ([[tenants]])" if loc == ("tenants",) else "must be an array"
    return None


def _unknown_setting(loc: tuple[str | int, ...], value: Any) -> str:
    """`unknown setting; did you mean serving.port?`: the nearest name in its own table, else the same name in
    another table (`port` at the top level: serving.port)."""
    import difflib

    *table, name = loc
    what = "unknown table" if isinstance(value, dict) else "unknown setting"
    model = _model_at(table)
    prefix = "".join(f"{part}." for part in table)
    near = [prefix + n for n in difflib.get_close_matches(str(name), list(model.model_fields) if model else [], n=1)]
    if not near:
        near = [f"{section}.{name}" for section, field in Config.model_fields.items()
                if _is_model(field.annotation) and name in field.annotation.model_fields and section not in table]
    return f"{what}; did you mean {' or '.join(near)}?" if near else f"{what} (clora.example.toml names every setting)"


def _model_at(table: list[str | int]) -> type[BaseModel] | None:
    """The section model a location in the config names (tenants.0.lora: LoraConfig), or None."""
    model: type[BaseModel] = Config
    for part in table:
        if isinstance(part, int):  # an entry of an array of tables: the model is the array's
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        if get_origin(annotation) is list and get_args(annotation):
            annotation = get_args(annotation)[0]
        if not _is_model(annotation):
            return None
        model = annotation
    return model


def resolve_config_path(path: str | Path | None, environ: dict[str, str] | None = None) -> Path | None:
    """--config wins, then $CLORA_CONFIG, then ./clora.toml if it exists; None means built-in defaults."""
    environ = os.environ if environ is None else environ
    if path:
        return Path(path)
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    default = Path(DEFAULT_CONFIG_FILE)
    return default if default.exists() else None


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> Config:
    """Reads the TOML file (if any), applies environment overrides and validates the result."""
    environ = dict(os.environ if environ is None else environ)
    file = resolve_config_path(path, environ)
    raw: dict[str, Any] = {}
    source = "defaults"
    if file is not None:
        source = str(file)
        named = "" if path or not environ.get(CONFIG_ENV) else f" (from ${CONFIG_ENV})"
        try:
            raw = tomllib.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"config file {file}{named} does not exist") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {file}{named} is not valid TOML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {file}{named} is not UTF-8 text: {e}") from e
        except OSError as e:  # a directory, no permission, an I/O error
            raise ConfigError(f"config file {file}{named} cannot be read: {e}") from e
    from_env: dict[tuple[str, ...], str] = {}
    for keys, var in _env_fields(Config):
        if not environ.get(var):  # unset, or set to nothing (compose's `${X:-}`): the file's value stands
            continue
        from_env[keys] = var
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(keys[:-1])} must be a table to apply an environment override")
        node[keys[-1]] = environ[var]
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source, from_env)) from None


class ConfigRereads:
    """A config read again and again by a running service (`reread()`: the file read as at its start).
    `read()` returns the config once two reads in a row agree, else None: a file read while an editor
    rewrites it (truncated, then written) can parse as a valid config that says something else — no tenants —
    and acting on that one read would drop every tenant until the next. A read that fails raises; it does not
    count as a read. `follow()` is `read()` for a service that goes on as it is meanwhile: it logs a failed read
    (once for each error) and the settings it applies only at its next start when they change.
    `path`: the file `reread` reads; while its size and times are what they were at a read two reads agreed
    on, `read()` returns that config without reading the file (for a service that follows it often).
    `service`: the service's name in what `follow()` logs. `at_restart`: the settings the service reads only
    when it starts (a function of the config) and how the log names them."""

    def __init__(self, reread: Callable[[], Config], current: Config, *, path: Path | None = None,
                 service: str = "the service", at_restart: tuple[Callable[[Config], object], str] | None = None):
        self._reread = reread
        self._last = current  # what the previous read said (the config the service started with, at first)
        self._path = path
        self._settled: tuple[int, ...] | None = None  # the file's stat at the last read that agreed
        self._service = service
        self._at_restart = at_restart
        self._started_with = at_restart[0](current) if at_restart is not None else None  # or as last logged
        self._error: str | None = None  # the last failed read's, logged already

    def follow(self) -> Config | None:
        """`read()`, but a read that fails gives None (logged when its error differs from the last one's); a
        change of the settings `at_restart` names is logged once for each change."""
        try:
            new = self.read()
        except Exception as e:  # noqa: BLE001 - ConfigError, anything else: the service goes on as it is
            if str(e) != self._error:
                logger.error("config re-read failed; %s goes on as it is: %s", self._service, e,
                             exc_info=not isinstance(e, ConfigError))  # not the file's fault: where it failed
            self._error = str(e)
            return None
        self._error = None
        if new is not None and self._at_restart is not None:
            settings, what = self._at_restart[0](new), self._at_restart[1]
            if settings != self._started_with:
                logger.warning("%s changed in the config: %s applies them when it starts again", what, self._service)
                self._started_with = settings
        return new

    def read(self) -> Config | None:
        stat = self._stat()  # before the read: a write during it changes the stat, and the next call reads
        if stat is not None and stat == self._settled:
            return self._last
        new = self._reread()
        agreed, self._last = new == self._last, new
        self._settled = stat if agreed else None
        return new if agreed else None

    def _stat(self) -> tuple[int, ...] | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError:  # the read says what is wrong
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def show_config(cfg: Config) -> str:
    """The effective config as JSON, API keys masked."""
    data = cfg.model_dump(mode="json")
    for t in data["tenants"]:
        t["api_key"] = "********"
    if data["serving"].get("admin_key") is not None:
        data["serving"]["admin_key"] = "********"
    return json.dumps(data, indent=2)
