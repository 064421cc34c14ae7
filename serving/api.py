"""The HTTP API: OpenAI-compatible completions for every tenant, over one shared engine.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both stream as server-sent events with
`"stream": true`), `GET /v1/models`, `GET /v1/models/{model}`, `POST /v1/feedback`, `GET /health`,
`GET /metrics`.

One generation request, top to bottom (`_generate`): authenticate the bearer key (auth.py) -> read the
body (at most `max_request_bytes`, else 413; 400 `context_length_exceeded` when that limit is room for
any prompt the context fits and the body is no batch of several prompts, see `_too_large`; whole within
`BODY_TIMEOUT_S`, else 408) and parse it (protocol.py) -> with an `Idempotency-Key` header, claim the key
(idempotency.py: a key already answered gets that answer again, and nothing below runs; a try while the
first runs waits for it, at most `idempotency.MAX_WAITING` of them) -> resolve `model` to the tenant's
adapter or the base model -> take the tenant's in-flight slots (`InflightLimit`: beyond
`max_inflight_per_tenant` completions, wait for room, then 429) -> render and tokenize the prompt (the engine's prompt thread, off the event loop), check it
fits and check the sampling with the engine ->
lease the adapter version (adapters.py; held until the last token, so a hot-swap never changes weights
mid-generation) -> run it on the engine, salted with the tenant (no prefix-cache sharing between tenants)
-> answer -> log one interaction event per choice (events_log.py; never blocks) -> count it (metrics.py).
Everything the engine would refuse is refused before the first byte, so a stream's refusals are real
4xx/5xx statuses; only failures after that arrive as an error event in the stream.

A /v1/completions request may carry several prompts; each becomes its own engine request and gets `n`
choices, numbered `i * n + j` for choice j of prompt i (OpenAI's numbering), each logged as its own
interaction event with its own prompt.

Every response carries `x-request-id`; completion responses also carry `x-clora-adapter-version`
("acme@3", or the base model's name). The response `id` is the interaction id: `POST /v1/feedback {"id",
"score"}` with it scores that interaction (with several choices, choice i is the interaction "<id>-<i>").
The `model` field of a response names the version that produced it. Refusals, unknown routes (404) and
wrong methods (405) use OpenAI's error shape `{"error": {"message", "type", "param", "code"}}` with the
status of serving/errors.py; a choice the engine fails (finish reason "error") is a 500 and logs no event.
A stopping server ends the generations still running at the end of its grace period (`stop_generations`,
called by serving/__main__.py) with a 503 `server_stopping`, a stream with its last event, before the HTTP
server's own deadline would cut them off unanswered.

The log-probabilities of the sampled tokens are always captured for the event (RL needs them); the
response shows them only when the request asks (`logprobs`), as OpenAI does.

What this module does not do: choose versions, talk to Kafka, or touch vLLM types.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import hashlib
import itertools
import math
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ingest.events import FeedbackEvent, InteractionEvent, utc_now
from serving import idempotency, protocol, responses
from serving.adapters import AdapterSet, Lease
from serving.auth import Authenticator, is_admin, resolve_model
from serving.engine import MAX_CHARS_PER_TOKEN, Choice, Delta, Engine, Sampling, greedy
from serving.errors import (
    BadRequest,
    ClientClosedRequest,
    ContextLengthExceeded,
    EventLogFull,
    MethodNotAllowed,
    ModelNotFound,
    RateLimited,
    RequestTimeout,
    RequestTooLarge,
    ServerStopping,
    ServingError,
    Unauthenticated,
    UnknownRoute,
    internal_error_body,
)
from serving.events_log import EventLog
from serving.metrics import ServingMetrics
from serving.tools import Answer, ToolStream, ToolUse

logger = logging.getLogger(__name__)

REQUEST_ID = "x-request-id"
ADAPTER_VERSION = "x-clora-adapter-version"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
             "/v1/feedback": "feedback", "/v1/models": "models"}
# The generation endpoints, by the name their metrics and events carry: how a body is parsed, and what its
# prompt field is called (a body too large names it). /v1/responses is a chat request (serving/responses.py).
GENERATIONS = {"chat": (functools.partial(protocol.parse, protocol.ChatRequest), "messages"),
               "completions": (functools.partial(protocol.parse, protocol.CompletionRequest), "prompt"),
               "responses": (responses.parse, "input")}
RESPONSE_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}
CHAT_ENDPOINTS = frozenset({"chat", "responses"})  # a chat request (messages, the chat template, tools)
RETRY_AFTER_SECONDS = 1  # what a tenant over its in-flight limit is told to wait
FEEDBACK_RETRY_AFTER_S = 5  # what a client whose feedback the full event log refused is told to wait
LOG_IN_THREAD_TOKENS = 4096  # a finished request's events with more token ids than this are encoded off the loop
# A stream's own headers: no cache keeps it, and no proxy buffers it (nginx's X-Accel-Buffering; otherwise
# its default buffering hands the client the whole stream at its end).
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
BODY_TIMEOUT_S = 30.0  # a request's whole body must arrive within this (a slow upload of the largest body fits)
SEND_TIMEOUT_S = 60.0  # a stream whose client reads nothing for this long is taken as left
SEND_WATCH_S = 1.0  # how often a stream's watchdog looks at the send under way
MIN_REQUEST_BYTES = 1 << 20
REQUEST_BYTES_PER_TOKEN = 6 * MAX_CHARS_PER_TOKEN  # the most characters a token may stand for, JSON-escaped ("\u00e9")


def default_request_bytes(max_model_len: int) -> int:
    """The body limit when the config sets none: 1 MiB, or room for a prompt that fills the context."""
    return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_model_len)


def endpoint_label(path: str) -> str:
    """The metrics label of a path: one of a few names, never the raw path (its values would be unbounded)."""
    if path.startswith("/v1/models/"):
        return "models"
    return ENDPOINTS.get(path, "other")


@dataclass
class _Prompt:
    """One prompt of a request: its text (rendered, for chat), token ids, and sampling fitted to its room.
    `log_ids`: its text may not re-tokenize to its ids (the request gave ids, or the tokenizer added a BOS to a
    text prompt), so its event carries the ids (`prompt_token_ids`) for the learner to train on what the
    model saw."""

    text: str
    ids: list[int]
    sampling: Sampling
    log_ids: bool = False


@dataclass
class _Call:
    """One generation request after the edge: who, what, on which adapter, with which prompts."""

    endpoint: str  # "chat", "completions" or "responses" (a chat request answered in Responses' form)
    tenant: str
    response_id: str
    body: Any  # ChatRequest | CompletionRequest
    messages: list[dict[str, str]] | None
    prompts: list[_Prompt]
    lease: Lease
    release: Callable[[], None]  # gives back the lease and the in-flight slots; idempotent
    arrived: float  # monotonic seconds, for latency
    arrived_at: datetime  # wall clock, the event's ts
    ticket: idempotency.Ticket | None = None  # the request's Idempotency-Key, when it is the key's first

    @property
    def chat(self) -> bool:
        """Whether the request is a chat one (chat completions, or a Responses request read as one)."""
        return self.endpoint in CHAT_ENDPOINTS

    @property
    def headers(self) -> dict[str, str]:
        return {REQUEST_ID: self.response_id, ADAPTER_VERSION: self.lease.label}

    def prompt_ids(self, choice: int) -> Sequence[int]:
        """The token ids the engine was given for the prompt of choice number `choice`."""
        return self.prompts[choice // self.body.n].ids

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.body.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)


class RateLimit:
    """At most `rate` calls a second per tenant on average, `burst` at once (a token bucket); past it, 429 with
    the seconds until the next call fits as Retry-After. Runs on the event loop only: no lock."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when counted)

    def take(self, tenant: str, what: str) -> None:
        now = self.clock()
        tokens, then = self._buckets.get(tenant, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if tokens < 1.0:
            wait = (1.0 - tokens) / self.rate
            self._buckets[tenant] = (tokens, now)
            raise RateLimited(f"tenant {tenant!r} sends {what} faster than {self.rate:g} a second (bursts of "
                              f"{self.burst}); retry in {wait:.1f}s", headers={"retry-after": str(max(1, math.ceil(wait)))})
        self._buckets[tenant] = (tokens - 1.0, now)

    def forget(self, tenant: str) -> None:
        self._buckets.pop(tenant, None)


class InflightLimit:
    """Sequences (prompts x n) each tenant has in the engine at once, at most `limit`. A request that does not
    fit waits up to `wait_s` for room, first come first served among the tenant's (past that, or with
    `wait_s` 0: 429 with Retry-After). Without the wait, a client sending more requests at once than the
    limit (an SDK's `asyncio.gather`, a batch of evaluations) saw the extra ones refused within the ~2 s
    OpenAI's SDK spends on its two retries, while the running ones had far longer to go. At most `limit`
    requests of a tenant wait (more: 429 at once): each holds a connection, and one tenant's flood must not
    fill the server's connection limit for every other tenant.

    A quarter of each tenant's room (`reserve`, none below a limit of 4) is production's: a request of a
    `priority` above 0 (the learner's rollouts) takes room only while it leaves that much free, or when the
    tenant holds nothing (so a large one still runs). Without it, a step's rollouts filled the tenant's room
    and an app's request waited for a rollout to finish before the engine saw it.

    Runs on the event loop only, like the rest of the API: no lock.
    """

    def __init__(self, limit: int, wait_s: float = 0.0) -> None:
        self.limit = limit
        self.reserve = limit // 4
        self.wait_s = wait_s
        self._held: dict[str, int] = {}
        # tenant -> its waiting requests (priority, arrival, sequences, granted), in the order they get room
        self._waiting: dict[str, list[tuple[int, int, int, asyncio.Future]]] = {}
        self._arrivals = itertools.count()

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    def must_wait(self, tenant: str, sequences: int, priority: int = 0) -> bool:
        """Whether `acquire` would wait (rather than take at once, or refuse)."""
        try:
            return not self._fits_now(tenant, sequences, priority)
        except (BadRequest, RateLimited):
            return False

    def _room(self, tenant: str, sequences: int, priority: int) -> bool:
        """Whether the tenant has room for the request now (a rollout's leaves production's reserve)."""
        held = self.held(tenant)
        if priority > 0 and held:
            return held + sequences <= self.limit - self.reserve
        return held + sequences <= self.limit

    def _fits_now(self, tenant: str, sequences: int, priority: int = 0) -> bool:
        """Whether the request takes its room at once (False: it waits for room); raises when it is refused."""
        self._check(sequences)
        ahead = any(waiting_priority <= priority for waiting_priority, *_ in self._waiting.get(tenant, ()))
        if not ahead and self._room(tenant, sequences, priority):  # production passes waiting rollouts
            return True
        if self.wait_s <= 0:
            raise self._over(tenant, sequences)
        if self.waiting(tenant) >= self.limit:
            raise self._over(tenant, sequences, queue_full=True)
        return False

    async def acquire(self, tenant: str, sequences: int, priority: int = 0) -> Callable[[], None]:
        """`take`, waiting for room up to `wait_s` behind the tenant's requests of a smaller `priority` (the
        engine's order: production traffic, 0, before the learner's rollouts) or of the same that waited first."""
        if self._fits_now(tenant, sequences, priority):
            return self.take(tenant, sequences)
        granted = asyncio.get_running_loop().create_future()
        waiter = (priority, next(self._arrivals), sequences, granted)
        bisect.insort(self._waiting.setdefault(tenant, []), waiter)  # arrivals are unique: futures never compared
        try:
            return await asyncio.wait_for(asyncio.shield(granted), self.wait_s)
        except asyncio.TimeoutError:
            if granted.done():  # room came as the wait ran out: taken
                return granted.result()
            raise self._over(tenant, sequences, waited=True, priority=priority) from None
        except BaseException:  # the client left (cancelled): a place given meanwhile goes back
            if granted.done() and not granted.cancelled():
                granted.result()()
            raise
        finally:
            self._leave(tenant, waiter)

    def take(self, tenant: str, sequences: int) -> Callable[[], None]:
        """Takes `sequences` slots of `tenant` now; returns the (idempotent) function that gives them back."""
        self._check(sequences)
        held = self.held(tenant)
        if held + sequences > self.limit:
            raise self._over(tenant, sequences)
        self._held[tenant] = held + sequences
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            left = self._held[tenant] - sequences
            if left:
                self._held[tenant] = left
            else:
                del self._held[tenant]
            self._grant(tenant)

        return release

    def _grant(self, tenant: str) -> None:
        """Gives room to the tenant's first waiting requests that fit now, in their order."""
        queue = self._waiting.get(tenant)
        while queue and self._room(tenant, queue[0][2], queue[0][0]):
            _, _, sequences, granted = queue.pop(0)
            if not granted.done():
                granted.set_result(self.take(tenant, sequences))
        if not queue:
            self._waiting.pop(tenant, None)

    def _leave(self, tenant: str, waiter: tuple[int, int, int, asyncio.Future]) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:  # granted: already out of the queue
            pass
        if not queue:
            self._waiting.pop(tenant, None)
        else:
            self._grant(tenant)  # a large request that left may have held up smaller ones behind it

    def _check(self, sequences: int) -> None:
        if sequences > self.limit:
            raise BadRequest(
                f"this request asks for {sequences} completions at once (prompts x n); this server runs at most "
                f"{self.limit} per tenant", param="n")

    def _over(self, tenant: str, sequences: int, *, waited: bool = False, queue_full: bool = False,
              priority: int = 0) -> RateLimited:
        waited_for = f" after waiting {self.wait_s:g} s for room" if waited else ""
        if queue_full:
            waited_for = f", and {self.waiting(tenant)} requests wait for room already"
        most = f"at most {self.limit} at once"
        if priority > 0 and self.reserve:
            most += f", {self.reserve} of them kept for production requests (priority 0)"
        return RateLimited(
            f"tenant {tenant!r} has {self.held(tenant)} completions in flight; {most} "
            f"(this request asks for {sequences}){waited_for}. Retry after the running requests finish.",
            headers={"retry-after": str(RETRY_AFTER_SECONDS)})


async def _chain_first(first, rest: AsyncIterator):
    if first is not None:
        yield first
    async for item in rest:
        yield item


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left (never sent: nobody reads it)
STOPPING = "the server is stopping; send the request again"  # what stop_generations answers
_STOPPING = object()  # put in a running generation's queue of outputs by stop_generations


async def _unless_disconnected(request: Request, work) -> bool:
    """Runs `work` (a coroutine) to the end and returns True, or cancels it and returns False as soon as the
    client disconnects. The body has been read, so `receive()` can only answer the disconnect."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
    if task.cancelled():
        return False
    task.result()  # its exception, if it failed
    return True


class Api:
    def __init__(
        self,
        *,
        engine: Engine,
        adapters: AdapterSet,
        authenticator: Authenticator,
        tenants: Iterable[str],
        base_name: str,
        events: EventLog,
        metrics: ServingMetrics,
        registry: Any,
        default_max_tokens: int | None = None,
        max_request_bytes: int = 1 << 20,
        max_inflight_per_tenant: int = 64,
        max_inflight_wait_s: float = 0.0,
        max_feedback_per_second: float = 100.0,
        admin_key: str | None = None,
        idempotency_ttl_s: float = 3600.0,
        idempotency_max_bytes: int = 64 << 20,
    ) -> None:
        """`default_max_tokens`: the completion length of a request that sets none (None: for chat the room
        its context leaves, for /v1/completions 16, as OpenAI and vLLM do). `idempotency_*`: how long, and in
        how many bytes in all, the answers of requests sent with an Idempotency-Key are kept (idempotency.py;
        a ttl of 0 ignores the header)."""
        self.engine = engine
        self.adapters = adapters
        self.auth = authenticator
        self.tenants = tuple(tenants)
        self.base_name = base_name
        self.events = events
        self.metrics = metrics
        self.registry = registry
        self.default_max_tokens = default_max_tokens
        self.max_request_bytes = max_request_bytes
        self.inflight = InflightLimit(max_inflight_per_tenant, max_inflight_wait_s)
        self.admin_key = admin_key  # None: /metrics and /health's details are open (a local deployment)
        self.keys = idempotency.Keys(idempotency_ttl_s, idempotency_max_bytes)
        # Feedback costs no engine time, but every event is stored, and feedback for an interaction not seen
        # yet waits in ingest's memory: a tenant's feedback is limited by rate instead.
        self.feedback_rate = RateLimit(max_feedback_per_second, burst=max(1, math.ceil(2 * max_feedback_per_second)))
        self.started = int(time.time())
        self._stopped = False  # stop_generations was called
        self._outputs: set[asyncio.Queue] = set()  # each running generation's queue of its engine's outputs

    def set_tenants(self, tenants: Iterable[str], keys: Iterable[tuple[str, str]]) -> None:
        """The tenants and their keys from now on (a config re-read; `AdapterSet.set_tenants` does the adapters):
        a key no longer listed is refused from the next request; requests running finish."""
        tenants = tuple(tenants)
        for tenant in set(self.tenants) - set(tenants):
            self.metrics.forget(tenant)
            self.feedback_rate.forget(tenant)
        for tenant in set(tenants) - set(self.tenants):
            self.metrics.welcome(tenant)
        self.auth.replace(keys)
        self.tenants = tenants

    def stop_generations(self) -> None:
        """Ends every running generation with a 503 `server_stopping` (a stream already answering: its last
        event, then [DONE]), and every one started from now on: the server is stopping and its grace period
        is over. Left to the HTTP server's own deadline, streams were cut off with no error event (counted as
        if the client had left) and non-streamed requests got no answer at all."""
        if self._stopped:
            return
        self._stopped = True
        if self._outputs:
            logger.warning("stopping: %d generation(s) still running end with 503 server_stopping", len(self._outputs))
        for outputs in self._outputs:
            outputs.put_nowait(_STOPPING)  # its reader raises ServerStopping: the engine's request is aborted

    # --- generation ---------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, "responses")

    async def _generate(self, request: Request, endpoint: str) -> Response:
        arrived, arrived_at = time.monotonic(), utc_now()
        tenant = self.auth.tenant(request.headers.get("authorization"))
        request.state.tenant = tenant
        parse, prompt_field = GENERATIONS[endpoint]
        raw = await self._body(request, prompt_field)
        body = parse(raw)
        key = request.headers.get(idempotency.HEADER)
        if key is None or not self.keys.enabled:
            return await self._run(request, endpoint, tenant, body, arrived, arrived_at, None)

        async def wait(first_done: asyncio.Event) -> None:
            nonlocal body
            body = None  # a try that waits holds its raw body only (parsed again if it runs)
            if not await _unless_disconnected(request, first_done.wait()):
                raise ClientClosedRequest("the client left while its request waited for the first one with its "
                                          "Idempotency-Key")

        claimed = await self.keys.claim(tenant, idempotency.check_key(key), idempotency.fingerprint(endpoint, raw), wait)
        if isinstance(claimed, idempotency.Answer):
            return self._replay(tenant, endpoint, claimed)
        if body is None:
            body = parse(raw)
        try:
            response = await self._run(request, endpoint, tenant, body, arrived, arrived_at, claimed)
        except BaseException:
            claimed.abandon()
            raise
        if not isinstance(response, StreamingResponse):  # a stream settles the key as it ends (`_stream`)
            claimed.abandon()  # does nothing if the answer was kept; a 499's was not
        return response

    def _replay(self, tenant: str, endpoint: str, answer: idempotency.Answer) -> Response:
        """The kept answer of a request's Idempotency-Key, sent again: nothing generated, nothing logged."""
        self.metrics.replayed(tenant, endpoint)
        headers = {**answer.headers, idempotency.REPLAYED: "true"}
        if not answer.stream:
            return Response(answer.chunks[0], media_type=answer.media_type, headers=headers)

        async def again() -> AsyncIterator[bytes]:
            for chunk in answer.chunks:
                yield chunk

        return StreamingResponse(again(), media_type=answer.media_type, headers={**headers, **STREAM_HEADERS})

    async def _run(self, request: Request, endpoint: str, tenant: str, body: Any, arrived: float,
                   arrived_at: datetime, ticket: idempotency.Ticket | None) -> Response:
        """A parsed generation request, from its model to its answer (the module note's steps after parsing)."""
        choice = resolve_model(body.model, tenant=tenant, base_name=self.base_name)
        sampling = body.sampling(self.default_max_tokens)
        chat = endpoint in CHAT_ENDPOINTS
        given = [None] if chat else body.prompts()
        sequences = len(given) * body.n
        if self.inflight.must_wait(tenant, sequences, body.priority):  # for room: its client may leave meanwhile
            got = []

            async def wait() -> None:
                got.append(await self.inflight.acquire(tenant, sequences, body.priority))

            if not await _unless_disconnected(request, wait()):  # a place given meanwhile went back
                self.metrics.request_answered(tenant, endpoint, CLIENT_CLOSED_REQUEST)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            give_back = got[0]
        else:
            give_back = await self.inflight.acquire(tenant, sequences, body.priority)  # before the prompt work
        try:
            if chat:
                messages = body.plain_messages()
                use = body.tool_use
                rendered = await self.engine.chat_prompt(messages, tenant, use.tools if use else None,
                                                         reads_calls=use is not None and use.choice == "auto")
                prompts = [self._prompt(rendered, sampling, GENERATIONS[endpoint][1])]
            else:
                messages = None
                prompts = []
                for p in given:
                    as_ids = not isinstance(p, str)
                    rendered = await (self.engine.ids_prompt(p, tenant) if as_ids else self.engine.text_prompt(p, tenant))
                    # ids whose text does not re-tokenize to them: sent as ids, or with a BOS the tokenizer added
                    prompts.append(self._prompt(rendered, sampling, "prompt",
                                                log_ids=as_ids or self.engine.adds_special_tokens))
            if choice.adapter:
                lease = await self.adapters.acquire(tenant, choice.version)
            else:
                lease = self.adapters.base_lease()
        except BaseException:
            give_back()
            raise

        def release() -> None:
            lease.release()
            give_back()

        response_id = f"{RESPONSE_ID_PREFIX[endpoint]}{request.state.request_id}"
        call = _Call(endpoint, tenant, response_id, body, messages, prompts, lease, release, arrived, arrived_at, ticket)
        headers = call.headers
        if body.stream:
            chunks = self._stream(call)
            # Started here, the generator owns the lease: its `finally` releases it even if the client leaves
            # before the body is sent (asyncio closes a started, abandoned async generator; an unstarted
            # one would never run its `finally`). A refusal before its first chunk raises here: a real status.
            got = []

            async def first_chunk() -> None:
                got.append(await anext(chunks))

            # Until the first chunk (the engine's first token, for chat too) nothing else watches the client.
            if not await _unless_disconnected(request, first_chunk()):
                await chunks.aclose()  # aborts the engine's request, gives the slots back (and counts the 499)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return _ClosingStream(_prepend(got[0], chunks), chunks, media_type="text/event-stream",
                                  headers={**headers, **STREAM_HEADERS})
        choices = {k: Choice(k) for k in range(call.choices)}

        async def collect() -> None:
            async for delta in self._deltas(call):
                choices[delta.index].add(delta)

        try:
            # A client that leaves is not noticed by the server while this handler runs: watch for it, and
            # abort the generation (closing `_deltas` aborts the engine's request), so the tenant's in-flight
            # slots come back at once, not when a long completion nobody reads would have ended.
            if not await _unless_disconnected(request, collect()):
                self.metrics.request_answered(tenant, endpoint, CLIENT_CLOSED_REQUEST)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            release()
        done = [choices[k] for k in range(call.choices)]
        answers = _answers(call, done)
        await self._log_finished(call, done, answers)
        with_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        if endpoint == "responses":
            build = functools.partial(responses.response, answers=answers, body=body)
        elif chat:
            build = functools.partial(protocol.chat_response, answers=answers)
        else:
            build = protocol.completion_response

        def answer() -> bytes:
            return msgspec.json.encode(build(call.response_id, lease.label, done, call.prompt_tokens, with_logprobs,
                                             token_ids=body.return_token_ids, prompt_token_ids=call.prompt_ids))

        # With log-probs an answer runs to tens of MiB (128 choices, every token's 20 alternatives): ~3 s of
        # building on the event loop, which every other tenant's requests would wait out. On a thread the
        # loop goes on between the interpreter's switches.
        content = await asyncio.to_thread(answer) if with_logprobs else answer()
        response = Response(content, media_type="application/json", headers=headers)
        if ticket is not None:
            ticket.keep(headers, [response.body], stream=False)
        return response

    def _prompt(self, rendered: tuple[str, list[int]], sampling: Sampling, param: str, *,
                log_ids: bool = False) -> _Prompt:
        """A rendered prompt checked against the context and the engine, before anything is answered."""
        text, ids = rendered
        fitted = self.engine.check_prompt(ids, sampling, param=param)
        self.engine.check_sampling(fitted)
        return _Prompt(text, ids, fitted, log_ids)

    async def _body(self, request: Request, prompt: str | None = None) -> bytes:
        """The request body, refused past `max_request_bytes` (by Content-Length, and while read). `prompt` names
        a generation's prompt field ("messages" or "prompt"), for `_too_large`. A /v1/completions body declared
        too large is still read up to the limit, as one that fits would be: whether it lists several prompts
        decides the answer. A body not whole within BODY_TIMEOUT_S is a 408."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        size = f"{int(declared)} bytes" if declared.isdigit() and int(declared) > limit else None
        if size is not None and prompt != "prompt":
            raise self._too_large(size, prompt)
        chunks, got = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for chunk in request.stream():
                    got += len(chunk)
                    chunks.append(chunk)
                    if got > limit:
                        raise self._too_large(size or f"over {limit} bytes", prompt, b"".join(chunks))
        except ClientDisconnect:
            raise ClientClosedRequest("the client left before its request body was read") from None
        except TimeoutError:
            raise RequestTimeout(f"the request body was not received within {BODY_TIMEOUT_S:g}s "
                                 f"({got} bytes came)") from None
        return b"".join(chunks)

    def _too_large(self, size: str, prompt: str | None, head: bytes = b"") -> ServingError:
        """413, unless a generation's limit is at least what a prompt filling the context takes (the default
        limit is): then a body past it holds a prompt past the context, or bulk no prompt needs, and the answer
        is OpenAI's 400 context_length_exceeded, by which clients (the openai SDK's BadRequestError, LangChain,
        LiteLLM) tell a prompt too long. A smaller limit is the server's own: 413. So is a /v1/completions
        batch, whose prompts may each fit (`head`, the body read so far, lists several within the limit; a
        first prompt that runs past the limit is too long on its own): it is told the batch is too large, not
        to shorten a prompt."""
        context = self.engine.max_model_len
        if prompt == "prompt" and protocol.lists_several_prompts(head[: self.max_request_bytes]):
            return RequestTooLarge(
                f"the request body is {size}; this server takes at most {self.max_request_bytes} bytes. The batch of "
                "prompts is too large: send fewer prompts per request", param="prompt")
        if prompt is not None and self.max_request_bytes >= REQUEST_BYTES_PER_TOKEN * context:
            return ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens. However, your request body is {size}, more "
                f"than a prompt of {context} tokens can take (this server takes {self.max_request_bytes} bytes). Please "
                f"reduce the length of the {prompt}.", param=prompt)
        return RequestTooLarge(f"the request body is {size}; this server takes at most {self.max_request_bytes}")

    async def _deltas(self, call: _Call) -> AsyncIterator[Delta]:
        """Every choice's deltas, numbered across prompts (choice j of prompt i is i * n + j)."""
        adapter, n = call.lease.adapter, call.body.n
        # Each prompt's engine request is read by a task of its own, whatever the client's pace: a request
        # gives its adapter's engine slot up once the engine has finished it (lora_slots.py), which a stream
        # read only as fast as its client reads would delay for as long as the client stalls.
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        single = len(call.prompts) == 1

        async def pump(i: int, p: _Prompt) -> None:
            try:
                request_id = call.response_id if single else f"{call.response_id}-p{i}"
                async for delta in self.engine.stream(p.ids, p.sampling, adapter, request_id,
                                                      cache_salt=call.tenant, priority=call.body.priority):
                    queue.put_nowait(replace(delta, index=i * n + delta.index) if i else delta)
                queue.put_nowait(end)
            except Exception as e:  # handed to the reader, which raises it
                queue.put_nowait(e)

        if self._stopped:
            raise ServerStopping(STOPPING)
        # `stop_generations` puts _STOPPING in the queue (a timeout per wait, to cancel, cost ~3 us an output)
        self._outputs.add(queue)
        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(call.prompts)]
        first = True
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if self._stopped:  # not only at _STOPPING: outputs queued ahead of it would all be sent first
                    raise ServerStopping(STOPPING)
                if item is end:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    if first:
                        first = False
                        self.metrics.first_output(call.endpoint, time.monotonic() - call.arrived)
                    yield item
        finally:  # a failure, or the client gone: every prompt's engine request is aborted (before the lease goes)
            self._outputs.discard(queue)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(self, call: _Call) -> AsyncIterator[bytes]:
        """The answer's server-sent events. With an Idempotency-Key, a copy of every event is kept, and once
        the stream is whole (even if its client leaves during the last events) the key's answer is that copy."""
        body, chat = call.body, call.chat
        created = int(time.time())
        label = call.lease.label
        choices = {i: Choice(i) for i in range(call.choices)}
        finished = sent = False
        deltas = self._deltas(call)
        kept: list[bytes] | None = None if call.ticket is None else []
        # /v1/responses: the chat chunks below become Responses' typed events
        typed = responses.ResponseEvents(call.response_id, label, body) if call.endpoint == "responses" else None

        def failure(error: dict[str, Any]) -> list[bytes]:
            """A failure once the stream has begun: its last events."""
            if typed is not None:
                return [typed.failed(error)]
            return [protocol.sse(error), protocol.sse("[DONE]")]

        def event(chunk: Any) -> bytes:
            if body.include_usage and isinstance(chunk, dict):
                chunk.setdefault("usage", None)  # OpenAI's: every chunk has the key, null but in the last
            if typed is None:
                data = protocol.sse(chunk)
            elif chunk == "[DONE]":
                data = typed.done(call.prompt_tokens, sum(len(c.token_ids) for c in choices.values()))
            else:
                data = typed.chunk(chunk)
            if kept is not None:
                kept.append(data)
            return data

        try:
            # The first delta before any byte: an engine that fails the request (a dead engine, a refusal)
            # then gets its own status, for chat too, whose role chunks come first.
            first = await anext(deltas, None)
            if chat:
                for i in choices:
                    sent = True
                    yield event(protocol.chat_chunk(call.response_id, label, created, None, index=i, role=True,
                                                    token_ids=body.return_token_ids, prompt_token_ids=None if i else
                                                    call.prompt_ids(0)))
            # completions with return_token_ids: the choices whose first chunk (the one with the prompt's ids) went
            started: set[int] = set() if body.return_token_ids and not chat else set(choices)
            # chat with tools that may be called: each choice's text is read for calls as it comes (tools.py)
            use = body.tool_use if chat else None
            readers = {i: ToolStream(use) for i in choices} if use is not None and use.calls else None
            async for delta in _chain_first(first, deltas):
                choices[delta.index].add(delta)
                if readers is not None:
                    for shown, tool_calls in readers[delta.index].feed(delta):
                        sent = True
                        yield event(protocol.chat_chunk(
                            call.response_id, label, created, shown, with_logprobs=bool(body.logprobs),
                            token_ids=body.return_token_ids, tool_calls=tool_calls))
                    continue
                if chat:
                    chunk = protocol.chat_chunk(
                        call.response_id, label, created, delta, with_logprobs=bool(body.logprobs),
                        token_ids=body.return_token_ids,
                    )
                else:
                    chunk = protocol.completion_chunk(
                        call.response_id, label, created, delta, with_logprobs=body.logprobs is not None,
                        token_ids=body.return_token_ids,
                        prompt_token_ids=None if delta.index in started else call.prompt_ids(delta.index),
                    )
                    started.add(delta.index)
                sent = True
                yield event(chunk)
            finished = True  # the completion is whole: it is logged even if the client leaves now
            tail = []
            if body.include_usage:
                done = protocol.chat_chunk if chat else protocol.completion_chunk
                last = done(call.response_id, label, created, None)
                last["usage"] = protocol.usage(call.prompt_tokens, sum(len(c.token_ids) for c in choices.values()))
                tail.append(event(last))
            tail.append(event("[DONE]"))
            for data in tail:
                yield data
        except ServingError as e:
            if not sent:
                raise  # nothing answered yet: the app's handler gives it its own status
            self.metrics.request_answered(call.tenant, call.endpoint, e.status)
            for data in failure(e.body()):
                yield data
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                # Clients leave all the time (a user closing a tab): counted as 499, not logged at INFO per request.
                logger.debug("request %s of %s: the client went away; generation aborted", call.response_id,
                             call.tenant)
                self.metrics.request_answered(call.tenant, call.endpoint, CLIENT_CLOSED_REQUEST)
            raise
        except Exception as e:  # the status line is sent: the stream still ends with an error and [DONE]
            if not sent:
                raise
            logger.exception("request %s: the stream failed", call.response_id)
            self.metrics.request_answered(call.tenant, call.endpoint, 500)
            for data in failure(internal_error_body(e)):
                yield data
        finally:
            # Each await here can be cancelled (a client that left after [DONE]: Starlette cancels the body's
            # task), so what must happen whatever comes is done before the awaits that may not finish: the
            # slots and the key, settled before the events are logged (a thread that runs to its end).
            try:
                await deltas.aclose()  # aborts the engine's request if the stream ended early
            finally:
                call.release()
                if call.ticket is not None:
                    if finished:
                        call.ticket.keep(call.headers, kept, stream=True)
                    else:  # refused, failed or left: nothing was logged, so the request sent again runs
                        call.ticket.abandon()
            if finished:
                done = [choices[i] for i in range(call.choices)]
                # the calls the stream sent, read once (their ids the client has), else read here
                answers = [readers[i].answer for i in range(call.choices)] if readers else _answers(call, done)
                await self._log_finished(call, done, answers)

    async def _log_finished(self, call: _Call, choices: list[Choice], answers: list[Answer] | None) -> None:
        """`_finished`, in a worker thread when its events are large: their JSON (every token id and log-prob
        of every choice) takes ~0.5 µs a token (18 ms for 64 choices of 512 tokens, over a second at the most
        one request may ask for), which every other request and stream would wait for on the event loop."""
        tokens = sum(len(c.token_ids) for c in choices) + sum(len(p.ids) for p in call.prompts if p.log_ids)
        if tokens > LOG_IN_THREAD_TOKENS:
            await asyncio.to_thread(self._finished, call, choices, answers)  # runs to its end even if cancelled
        else:
            self._finished(call, choices, answers)

    def _finished(self, call: _Call, choices: list[Choice], answers: list[Answer] | None) -> None:
        """Logs one interaction event per choice and counts the request. `answers`: with tools, each choice's
        as the client got it."""
        seconds = time.monotonic() - call.arrived
        completion_tokens = sum(len(c.token_ids) for c in choices)
        use = call.body.tool_use if call.chat else None
        for c in choices:
            prompt = call.prompts[c.index // call.body.n]
            sampling = prompt.sampling
            event_id = call.response_id if len(choices) == 1 else f"{call.response_id}-{c.index}"
            self.events.log(
                InteractionEvent(
                    id=event_id,
                    tenant=call.tenant,
                    completion=c.text,
                    prompt=prompt.text,
                    messages=call.messages,
                    ts=call.arrived_at,
                    adapter_version=call.lease.adapter.name if call.lease.adapter else None,
                    prompt_token_ids=list(prompt.ids) if prompt.log_ids else None,
                    completion_token_ids=list(c.token_ids),
                    completion_logprobs=[lp.logprob for lp in c.logprobs],
                    metadata={
                        **(call.body.metadata or {}),  # the caller's tags; clora's own keys below win
                        "endpoint": call.endpoint,
                        "model": call.body.model,
                        "served_by": call.lease.label,
                        "finish_reason": c.finish_reason,
                        "latency_ms": round(seconds * 1000, 1),
                        "usage": protocol.usage(len(prompt.ids), len(c.token_ids)),
                        "sampling": _sampling_metadata(sampling, c.index % sampling.n),
                        "logprobs": "raw",
                        "stream": bool(call.body.stream),
                        # how the answer read the text (the event keeps the text): the calls it found
                        **({"tools": _tools_metadata(use, answers[c.index])} if use is not None else {}),
                    },
                )
            )
        self.metrics.request_done(call.tenant, call.endpoint, 200, seconds, call.prompt_tokens, completion_tokens)

    # --- everything else ----------------------------------------------------------------------------------
    async def feedback(self, request: Request) -> Response:
        tenant = self.auth.tenant(request.headers.get("authorization"))
        request.state.tenant = tenant
        body = protocol.parse(protocol.FeedbackRequest, await self._body(request))
        self.feedback_rate.take(tenant, "feedback")
        if not self.events.log(FeedbackEvent(id=body.id, tenant=tenant, score=body.score, source=body.source or "http")):
            # Nothing else keeps it: the client must send it again (a completion's event, by contrast, is lost
            # after its answer was sent; that is counted and logged only).
            raise EventLogFull("feedback not accepted: the event log is full (Kafka is slow and the spool failing); "
                               "send it again", headers={"retry-after": str(FEEDBACK_RETRY_AFTER_S)})
        self.metrics.request_answered(tenant, "feedback", 202)
        return JSONResponse({"id": body.id, "object": "feedback", "status": "accepted"}, status_code=202)

    async def models(self, request: Request) -> Response:
        """The base model, the caller's tenant, and its published versions that serving has not refused (a
        generation naming one of those is 404)."""
        from storage.registry import UnreadableRecord

        tenant = self.auth.tenant(request.headers.get("authorization"))
        request.state.tenant = tenant
        try:
            versions = await asyncio.to_thread(self.registry.unsettled, tenant)  # every published one, not the history
        except UnreadableRecord as e:  # a record edited by hand: the tenant's versions stay out until it is mended
            self.registry.log_unreadable(e, f"tenant {tenant}'s versions are left out of /v1/models until it is mended")
            versions = []
        data = [_model_card(self.base_name, self.started), _model_card(tenant, self.started)]
        data += [
            _model_card(v.name, int((v.published_at or v.created_at).timestamp()), parent=tenant)
            for v in versions
            if v.status == "published" and self.adapters.refusal(tenant, v.number) is None
        ]
        self.metrics.request_answered(tenant, "models", 200)
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One model card: the base model, the caller's tenant, or one of its published versions; anything
        else (another tenant's, or a version serving refused, included) is 404, as a generation naming it is."""
        tenant = self.auth.tenant(request.headers.get("authorization"))
        request.state.tenant = tenant
        model_id = request.path_params["model_id"]
        choice = resolve_model(model_id, tenant=tenant, base_name=self.base_name)
        if not choice.adapter:
            card = _model_card(self.base_name, self.started)
        elif choice.version is None:
            card = _model_card(tenant, self.started)
        else:
            card = await self._version_card(tenant, model_id, choice.version)
        self.metrics.request_answered(tenant, "models", 200)
        return JSONResponse(card)

    async def _version_card(self, tenant: str, model_id: str, number: int) -> dict[str, Any]:
        """The card of one of the tenant's versions, or 404 when it is not published or serving refused it."""
        from storage.registry import UnreadableRecord, VersionNotFound

        try:
            version = await asyncio.to_thread(self.registry.get, tenant, number)
        except VersionNotFound:
            version = None
        except UnreadableRecord as e:  # the path goes to the log (once), not to the caller
            self.registry.log_unreadable(e, f"model {model_id!r} is not found until it is mended")
            raise ModelNotFound(f"model {model_id!r}: its registry record cannot be read", param="model") from None
        if version is None or version.status != "published":
            raise ModelNotFound(f"model {model_id!r} does not exist or is not published", param="model")
        refused = self.adapters.refusal(tenant, number)
        if refused is not None:
            raise ModelNotFound(f"model {model_id!r} cannot be served: {refused}", param="model")
        return _model_card(version.name, int((version.published_at or version.created_at).timestamp()), parent=tenant)

    async def health(self, request: Request) -> Response:
        """Status and pid for anyone (a load balancer, `clora up`); every tenant's adapter, refused versions and
        the event log's state too when no admin key is configured, or the caller sends it."""
        ok = not self.engine.errored
        body: dict[str, Any] = {
            "status": "ok" if ok else "engine_dead",
            "pid": os.getpid(),  # lets a supervisor tell its own serving from another process on the port
        }
        if self.admin_key is None or is_admin(request.headers.get("authorization"), self.admin_key):
            body.update({
                "model": self.base_name,
                "adapters": {t: self.adapters.current(t) for t in self.tenants},
                "refused_adapters": self.adapters.refused(),
                "events": {"kafka_connected": self.events.connected, "spooled": self.events.spooled},
            })
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self, request: Request) -> Response:
        if self.admin_key is not None and not is_admin(request.headers.get("authorization"), self.admin_key):
            raise Unauthenticated("/metrics needs the admin key: 'Authorization: Bearer <serving.admin_key>'")
        for state, count in self.keys.counts().items():
            self.metrics.idempotency_keys.labels(state).set(count)
        self.metrics.idempotency_bytes.set(self.keys.kept_bytes)
        for tenant in self.tenants:
            self.metrics.inflight.labels(tenant).set(self.inflight.held(tenant))
        # On a worker thread: with per-tenant series, a scrape renders megabytes (~1 s at 1,000 tenants),
        # which on the event loop held every request and stream for as long.
        return Response(await asyncio.to_thread(self.metrics.render), media_type=self.metrics.content_type)


def _answers(call: _Call, choices: list[Choice]) -> list[Answer] | None:
    """Each choice's text as the chat request's tools read it; None without tools."""
    use = call.body.tool_use if call.chat else None
    return None if use is None else [use.answer(c.text, c.finish_reason) for c in choices]


def _tools_metadata(use: ToolUse, answer: Answer) -> dict[str, Any]:
    """The event's record of a request's tools: how many, the tool_choice, and the calls its answer gave (the
    finish reason it answered: "tool_calls" where the event's own says "stop")."""
    _, calls, finish_reason = answer
    return {"defined": len(use.tools), "choice": use.name if use.choice == "function" else use.choice,
            "called": [c["function"]["name"] for c in calls], "finish_reason": finish_reason}


def _sampling_metadata(sampling: Sampling, sample: int = 0) -> dict[str, Any]:
    """The interaction event's record of how its choice, the request's `sample`-th of each prompt's n, was
    sampled (penalties only when set). Its seed is the one vLLM drew it with: seed + sample with n > 1 (vLLM
    seeds each of the n samples apart; a greedy request runs once), none for -1 (vLLM's "unseeded")."""
    out: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "n": sampling.n,
    }
    defaults = Sampling()
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_p", "min_tokens",
                 "ignore_eos", "include_stop_str_in_output"):
        if getattr(sampling, name) != getattr(defaults, name):
            out[name] = getattr(sampling, name)
    if sampling.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in sampling.logit_bias}
    if sampling.stop:  # a completion that ended on one is cut there: the event says why
        out["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        out["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None and sampling.seed != -1:
        out["seed"] = sampling.seed + (0 if greedy(sampling) else sample)
    if sampling.structured is not None:  # drawn under a grammar: the logged log-probs are not its distribution's
        # The schema by its digest: whole, a large one (up to the request's size) on every choice's event
        # could pass ingest's message limit, and the interaction would be dead-lettered.
        kind, schema = sampling.structured
        out["structured"] = {"type": kind, **({"schema_sha256": hashlib.sha256(schema.encode()).hexdigest()}
                                              if schema else {})}
    return out


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


class _ClientStalled(Exception):
    """A stream's send that did not complete within SEND_TIMEOUT_S."""


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that closes `generator` (the stream's, started: it holds the engine's request,
    the lease, the tenant's in-flight slots and an Idempotency-Key until its `finally`) however the
    response ends. Starlette leaves it suspended when sending fails (the client gone while the server waited
    to write, or before the first byte); left so, its `finally` would run only when the garbage collector
    got to it, or never while a traceback held it. A send that waits past SEND_TIMEOUT_S (a client that
    stopped reading) ends the response so too."""

    def __init__(self, content: AsyncIterator[bytes], generator: AsyncGenerator[bytes, None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.generator = generator

    async def __call__(self, scope, receive, send) -> None:
        # A client that stops reading (its TCP window full) is never seen to leave: the send waits for ever,
        # holding the generator and all it holds. Past SEND_TIMEOUT_S, it has left. One watchdog per stream
        # looks at the send under way every SEND_WATCH_S (a timer per send cost ~5 us a chunk).
        loop = asyncio.get_running_loop()
        sending: tuple[asyncio.Task, float] | None = None  # the send under way: its task, since when
        stalled = False

        def watch() -> None:
            nonlocal watchdog, stalled
            if sending is not None and loop.time() - sending[1] >= SEND_TIMEOUT_S:
                stalled = True
                sending[0].cancel()
            else:
                watchdog = loop.call_later(min(SEND_WATCH_S, SEND_TIMEOUT_S), watch)

        async def send_in_time(message) -> None:
            nonlocal sending
            task = asyncio.current_task()
            sending = (task, loop.time())
            try:
                await send(message)
            except asyncio.CancelledError:
                if not stalled:
                    raise
                task.uncancel()  # the watchdog's cancel, not the task's own: it goes on, as _ClientStalled
                raise _ClientStalled() from None
            finally:
                sending = None

        watchdog = loop.call_later(min(SEND_WATCH_S, SEND_TIMEOUT_S), watch)
        try:
            await super().__call__(scope, receive, send_in_time)
        except _ClientStalled:  # the generator's `finally` below aborts it as for a client that left
            logger.info("request %s: its client read nothing for %gs; taken as gone", self.headers.get(REQUEST_ID),
                        SEND_TIMEOUT_S)
        finally:
            watchdog.cancel()
            await self.generator.aclose()


def _model_card(model_id: str, created: int, parent: str | None = None) -> dict[str, Any]:
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "clora"}
    if parent:
        card["parent"] = parent
    return card


# ---------------------------------------------------------------------------------------------------------
# The app


class RequestIdMiddleware:
    """Gives every request an id (`request.state.request_id`) and every response an `x-request-id` header."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == REQUEST_ID.encode() for k, _ in headers):
                    headers.append((REQUEST_ID.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(api: Api) -> FastAPI:
    # No redirect of "/v1/chat/completions/" to the route without its slash: a 307 with an empty body, where
    # OpenAI answers 404 in its error shape (and a client would have to send its body again).
    app = FastAPI(title="clora serving", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    # Plain Starlette routes: every handler takes the Request and returns a Response, and FastAPI's dependency
    # solving for one cost ~30 us a request.
    app.add_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_route("/v1/completions", api.completions, methods=["POST"])
    app.add_route("/v1/responses", api.responses, methods=["POST"])
    app.add_route("/v1/models", api.models, methods=["GET"])
    app.add_route("/v1/models/{model_id:path}", api.model, methods=["GET"])  # base names may hold "/"
    app.add_route("/v1/feedback", api.feedback, methods=["POST"])
    app.add_route("/health", api.health, methods=["GET"])
    app.add_route("/metrics", api.prometheus, methods=["GET"])

    @app.exception_handler(ServingError)
    async def _refused(request: Request, e: ServingError) -> Response:
        api.metrics.request_answered(getattr(request.state, "tenant", "-"), endpoint_label(request.url.path), e.status)
        headers = {"www-authenticate": "Bearer", **e.headers} if e.status == 401 else e.headers
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _routing(request: Request, e: StarletteHTTPException) -> Response:
        """Unknown routes and wrong methods, in OpenAI's error shape instead of FastAPI's {"detail": ...}."""
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            error: ServingError = UnknownRoute(f"Invalid URL ({where})")
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow")
            error = MethodNotAllowed(f"Method not allowed ({where})" + (f"; it takes {allowed}" if allowed else ""))
        else:
            error = ServingError(str(e.detail))
            error.status = e.status_code
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _failed(request: Request, e: Exception) -> Response:
        # Starlette runs this handler in its outermost middleware, outside RequestIdMiddleware, whose `send`
        # never sees this response: the id goes on here. The scope's state is shared, so it is the same id.
        request_id = getattr(request.state, "request_id", None) or uuid.uuid4().hex
        logger.exception("request %s to %s failed", request_id, request.url.path)
        api.metrics.request_answered(getattr(request.state, "tenant", "-"), endpoint_label(request.url.path), 500)
        return JSONResponse(internal_error_body(e), status_code=500, headers={REQUEST_ID: request_id})

    app.add_middleware(RequestIdMiddleware)
    return app
