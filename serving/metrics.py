"""Prometheus metrics of the serving process, per tenant, served on `/metrics`.

One `ServingMetrics` per process, on its own `CollectorRegistry` (so tests and benchmarks can build
several without clashing in the global one). Names start with `clora_serving_`:

    requests_total{tenant,endpoint,status}      answered API requests, errors included (status: HTTP code)
    prompt_tokens_total{tenant}, completion_tokens_total{tenant}
    request_seconds{tenant,endpoint}            request latency, arrival to last token
    adapter_version{tenant}                     version number now served as "<tenant>" (0: base model)
    adapter_swaps_total{tenant}                 versions made current
    adapter_swap_seconds{tenant}                validate + load of a new version
    adapter_publish_to_live_seconds{tenant}     registry publish time -> version current here
    adapters_refused_total{tenant}              versions refused (corrupt or unfit adapters)
    adapter_load_failures_total{tenant}         loads that failed and are tried again (the tenant waits on an older one)
    connections_refused_total                   503 server_busy past the connection limit (before the app)
    events_total{kind,outcome}                  interaction/feedback events: sent, spooled, resent, dropped, dead
    spool_events                                events waiting in the on-disk spool
    inflight_sequences{tenant}                  completions a tenant has in the engine, running or queued
    time_to_first_token_seconds{endpoint}       arrival to the engine's first output of a request
    lora_slot_waiting                           requests waiting for an adapter slot in the engine (lora_slots.py)
    lora_slot_wait_seconds                      how long those that waited for one waited

What this module does not do: decide when to count (the callers do) or serve HTTP (api.py does).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# To 10 minutes: a request runs to its last token, and a chat answer may fill the context.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServingMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.gone: set[str] = set()  # tenants a config re-read removed (forget): their requests are not counted
        self.requests = Counter(
            "clora_serving_requests", "Finished HTTP requests.", ["tenant", "endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("clora_serving_prompt_tokens", "Prompt tokens processed.", ["tenant"], registry=r)
        self.completion_tokens = Counter(
            "clora_serving_completion_tokens", "Completion tokens generated.", ["tenant"], registry=r
        )
        self.latency = Histogram(
            "clora_serving_request_seconds",
            "Request latency, arrival to last token.",
            ["tenant", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_version = Gauge(
            "clora_serving_adapter_version", "Adapter version served for the tenant (0: base model).", ["tenant"],
            registry=r,
        )
        self.swaps = Counter("clora_serving_adapter_swaps", "Adapter versions made current.", ["tenant"], registry=r)
        self.swap_seconds = Histogram(
            "clora_serving_adapter_swap_seconds", "Validate and load time of a new adapter version.", ["tenant"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.publish_to_live = Histogram(
            "clora_serving_adapter_publish_to_live_seconds",
            "From the registry's publish time to the version being current here.",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "clora_serving_adapters_refused", "Adapter versions refused (corrupt or unfit).", ["tenant"], registry=r
        )
        self.load_failures = Counter(
            "clora_serving_adapter_load_failures", "Loads of an adapter version that failed and are tried again "
            "(an I/O error, the engine's load error): the tenant stays on an older version meanwhile.", ["tenant"],
            registry=r
        )
        self.connections_refused = Counter(
            "clora_serving_connections_refused", "Requests answered 503 server_busy by the HTTP server, past the "
            "connection limit (never reaching the app: not in requests_total).", registry=r
        )
        self.events = Counter(
            "clora_serving_events", "Events produced, by outcome.", ["kind", "outcome"], registry=r
        )
        self.replays = Counter(
            "clora_serving_idempotent_replays", "Completion requests answered with the kept answer of their "
            "Idempotency-Key (nothing generated or logged).", ["tenant", "endpoint"], registry=r
        )
        self.spool_events = Gauge("clora_serving_spool_events", "Events waiting in the on-disk spool.", registry=r)
        self.inflight = Gauge(
            "clora_serving_inflight_sequences", "Completions (prompts x n) each tenant has in the engine, running or "
            "queued (at most serving.max_inflight_per_tenant).", ["tenant"], registry=r
        )
        self.idempotency_bytes = Gauge(
            "clora_serving_idempotency_kept_bytes", "Memory the kept answers of Idempotency-Key requests take "
            "(at most serving.idempotency_cache_mib).", registry=r
        )
        self.idempotency_keys = Gauge(
            "clora_serving_idempotency_keys", "Idempotency keys held: their first request running, or its answer kept.",
            ["state"], registry=r
        )
        # Not per tenant: one more per-tenant histogram would double /metrics at many tenants.
        self.first_token = Histogram(
            "clora_serving_time_to_first_token_seconds", "Arrival to the engine's first output of a request.",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.slot_waiting = Gauge("clora_serving_lora_slot_waiting", "Requests waiting for an adapter slot in the "
                                  "engine (serving.max_loras adapters at once).", registry=r)
        self.slot_wait = Histogram("clora_serving_lora_slot_wait_seconds", "How long requests that waited for an "
                                   "adapter slot waited.", buckets=LATENCY_BUCKETS, registry=r)

    def watch_slots(self, slots) -> None:
        """Reports the engine's adapter slots (a LoraSlots; None: the engine has none)."""
        if slots is None:
            return
        self.slot_waiting.set_function(lambda: slots.waiting)
        slots.on_wait = self.slot_wait.observe

    def first_output(self, endpoint: str, seconds: float) -> None:
        self.first_token.labels(endpoint).observe(seconds)

    def request_done(
        self, tenant: str, endpoint: str, status: int, seconds: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        if tenant in self.gone:
            return
        self.requests.labels(tenant, endpoint, str(status)).inc()
        self.latency.labels(tenant, endpoint).observe(seconds)
        self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        self.completion_tokens.labels(tenant).inc(completion_tokens)

    def request_answered(self, tenant: str, endpoint: str, status: int) -> None:
        """A request that generated nothing: refused, failed, abandoned, or a models or feedback answer."""
        if tenant in self.gone:
            return
        self.requests.labels(tenant, endpoint, str(status)).inc()

    def replayed(self, tenant: str, endpoint: str) -> None:
        """A request answered again from its Idempotency-Key's kept answer (counted as a 200 too)."""
        if tenant in self.gone:
            return
        self.requests.labels(tenant, endpoint, "200").inc()
        self.replays.labels(tenant, endpoint).inc()

    def swapped(self, tenant: str, version: int, seconds: float, publish_to_live: float | None) -> None:
        self.adapter_version.labels(tenant).set(version)
        self.swaps.labels(tenant).inc()
        self.swap_seconds.labels(tenant).observe(seconds)
        if publish_to_live is not None:
            self.publish_to_live.labels(tenant).observe(max(0.0, publish_to_live))

    def forget(self, tenant: str) -> None:
        """A tenant a config re-read removed: its series leave /metrics (each tenant that ever came and went
        kept ~80 series, for the process's life). Back again, it starts from zero (a counter reset). Not
        `adapter_version`: the adapter set's, which has it for exactly the tenants it serves (set_tenants)."""
        for metric in (self.requests, self.prompt_tokens, self.completion_tokens, self.latency, self.swaps,
                       self.swap_seconds, self.publish_to_live, self.refused, self.load_failures, self.replays,
                       self.inflight):
            metric.remove_by_labels({"tenant": tenant})
        # A request of it still running when it was removed ends later: counted, it made the series again,
        # for good. Not counted until the tenant is back (`welcome`).
        self.gone.add(tenant)

    def welcome(self, tenant: str) -> None:
        """A tenant a config re-read added (perhaps one removed before): its requests are counted."""
        self.gone.discard(tenant)

    def render(self) -> bytes:
        return generate_latest(self.registry)
