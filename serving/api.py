"""The HTTP API: OpenAI-compatible completions for every tenant, over one shared engine.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both stream as server-sent events with
`"stream": true`), `GET /v1/models`, `POST /v1/feedback`, `GET /health`, `GET /metrics`.

One generation request, top to bottom (`_generate`): authenticate the bearer key (auth.py) -> parse the
body (protocol.py) -> resolve `model` to the tenant's adapter or the base model -> render the prompt
(chat template) -> lease the adapter version (adapters.py; held until the last token, so a hot-swap never
changes weights mid-generation) -> run it on the engine -> answer -> log one interaction event per
choice (events_log.py; never blocks) -> count it (metrics.py).

Every response carries `x-request-id`; completion responses also carry `x-clora-adapter-version`
("acme@3" or "base"). The response `id` is the interaction id: `POST /v1/feedback {"id", "score"}` with
it scores that interaction (with n > 1, choice i is the interaction "<id>-<i>"). The `model` field of a
response names the version that produced it. Refusals use OpenAI's error shape
`{"error": {"message", "type", "code"}}` with the status of serving/errors.py.

The log-probabilities of the sampled tokens are always captured for the event (RL needs them); the
response shows them only when the request asks (`logprobs`), as OpenAI does.

What this module does not do: choose versions, talk to Kafka, or touch vLLM types.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ingest.events import FeedbackEvent, InteractionEvent, utc_now
from serving import protocol
from serving.adapters import AdapterSet, Lease
from serving.auth import Authenticator, resolve_model
from serving.engine import Choice, Engine, Sampling
from serving.errors import ServingError, internal_error_body
from serving.events_log import EventLog
from serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)

REQUEST_ID = "x-request-id"
ADAPTER_VERSION = "x-clora-adapter-version"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/feedback": "feedback",
             "/v1/models": "models"}


@dataclass
class _Call:
    """One generation request after the edge: who, what, on which adapter, with which prompt."""

    endpoint: str  # "chat" or "completions"
    tenant: str
    response_id: str
    body: Any  # ChatRequest | CompletionRequest
    messages: list[dict[str, str]] | None
    prompt_text: str
    prompt_ids: list[int]
    sampling: Sampling
    lease: Lease
    arrived: float  # monotonic seconds, for latency
    arrived_at: datetime  # wall clock, the event's ts


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
        default_max_tokens: int,
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        self.auth = authenticator
        self.tenants = tuple(tenants)
        self.base_name = base_name
        self.events = events
        self.metrics = metrics
        self.registry = registry
        self.default_max_tokens = default_max_tokens
        self.started = int(time.time())

    # --- generation ---------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat", protocol.ChatRequest)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", protocol.CompletionRequest)

    async def _generate(self, request: Request, endpoint: str, model: type) -> Response:
        arrived, arrived_at = time.monotonic(), utc_now()
        tenant = self.auth.tenant(request.headers.get("authorization"))
        request.state.tenant = tenant
        body = protocol.parse(model, await request.body())
        choice = resolve_model(body.model, tenant=tenant, tenants=self.tenants, base_name=self.base_name)
        if endpoint == "chat":
            messages = body.plain_messages()
            prompt_text = self.engine.render_chat(messages)
            prompt_ids = self.engine.encode(prompt_text)
        else:
            messages = None
            prompt = body.single_prompt()
            if isinstance(prompt, str):
                prompt_text, prompt_ids = prompt, self.engine.encode(prompt)
            else:
                prompt_text, prompt_ids = self.engine.decode(prompt), list(prompt)
        sampling = self.engine.check_prompt(prompt_ids, body.sampling(self.default_max_tokens))
        lease = await self.adapters.acquire(tenant, choice.version) if choice.adapter else self.adapters.base_lease()
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        call = _Call(
            endpoint, tenant, f"{prefix}-{request.state.request_id}", body, messages, prompt_text, prompt_ids,
            sampling, lease, arrived, arrived_at,
        )
        headers = {REQUEST_ID: call.response_id, ADAPTER_VERSION: lease.label}
        if body.stream:
            chunks = self._stream(call)
            # Started here, the generator owns the lease: its `finally` releases it even if the client leaves
            # before the body is sent (asyncio closes a started, abandoned async generator; an unstarted
            # one would never run its `finally`).
            first = await anext(chunks)
            return StreamingResponse(_prepend(first, chunks), media_type="text/event-stream", headers=headers)
        try:
            choices = await self.engine.generate(prompt_ids, sampling, lease.adapter, call.response_id)
        finally:
            lease.release()
        self._finished(call, choices)
        build = protocol.chat_response if endpoint == "chat" else protocol.completion_response
        with_logprobs = bool(body.logprobs) if endpoint == "chat" else body.logprobs is not None
        return JSONResponse(build(call.response_id, lease.label, choices, len(prompt_ids), with_logprobs), headers=headers)

    async def _stream(self, call: _Call) -> AsyncIterator[bytes]:
        body, chat = call.body, call.endpoint == "chat"
        created = int(time.time())
        label = call.lease.label
        choices = {i: Choice(i) for i in range(call.sampling.n)}
        finished = False
        try:
            if chat:
                for i in choices:
                    yield protocol.sse(protocol.chat_chunk(call.response_id, label, created, None, index=i, role=True))
            async for delta in self.engine.stream(call.prompt_ids, call.sampling, call.lease.adapter, call.response_id):
                text_start = len(choices[delta.index].text)
                choices[delta.index].add(delta)
                if chat:
                    chunk = protocol.chat_chunk(
                        call.response_id, label, created, delta, with_logprobs=bool(body.logprobs)
                    )
                else:
                    chunk = protocol.completion_chunk(
                        call.response_id, label, created, delta, with_logprobs=body.logprobs is not None,
                        text_start=text_start,
                    )
                yield protocol.sse(chunk)
            finished = True  # the completion is whole: it is logged even if the client leaves now
            if body.include_usage:
                done = protocol.chat_chunk if chat else protocol.completion_chunk
                last = done(call.response_id, label, created, None)
                last["usage"] = protocol.usage(len(call.prompt_ids), sum(len(c.token_ids) for c in choices.values()))
                yield protocol.sse(last)
            yield protocol.sse("[DONE]")
        except ServingError as e:
            self.metrics.request_refused(call.tenant, call.endpoint, e.status)
            yield protocol.sse(e.body())
            yield protocol.sse("[DONE]")
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                logger.info("request %s: the client went away; generation aborted", call.response_id)
            raise
        except Exception as e:  # the status line is sent: the stream still ends with an error and [DONE]
            logger.exception("request %s: the stream failed", call.response_id)
            self.metrics.request_refused(call.tenant, call.endpoint, 500)
            yield protocol.sse(internal_error_body(e))
            yield protocol.sse("[DONE]")
        finally:
            call.lease.release()
            if finished:
                self._finished(call, [choices[i] for i in range(call.sampling.n)])

    def _finished(self, call: _Call, choices: list[Choice]) -> None:
        """Logs one interaction event per choice and counts the request."""
        seconds = time.monotonic() - call.arrived
        completion_tokens = sum(len(c.token_ids) for c in choices)
        for c in choices:
            event_id = call.response_id if len(choices) == 1 else f"{call.response_id}-{c.index}"
            self.events.log(
                InteractionEvent(
                    id=event_id,
                    tenant=call.tenant,
                    completion=c.text,
                    prompt=call.prompt_text,
                    messages=call.messages,
                    ts=call.arrived_at,
                    adapter_version=call.lease.adapter.name if call.lease.adapter else None,
                    completion_token_ids=list(c.token_ids),
                    completion_logprobs=[lp.logprob for lp in c.logprobs],
                    metadata={
                        **(call.body.metadata or {}),  # the caller's tags; clora's own keys below win
                        "endpoint": call.endpoint,
                        "model": call.body.model,
                        "served_by": call.lease.label,
                        "finish_reason": c.finish_reason,
                        "latency_ms": round(seconds * 1000, 1),
                        "usage": protocol.usage(len(call.prompt_ids), len(c.token_ids)),
                        "sampling": {
                            "temperature": call.sampling.temperature,
                            "top_p": call.sampling.top_p,
                            "max_tokens": call.sampling.max_tokens,
                            "n": call.sampling.n,
                        },
                        "logprobs": "raw",
                        "stream": bool(call.body.stream),
                    },
                )
            )
        self.metrics.request_done(call.tenant, call.endpoint, 200, seconds, len(call.prompt_ids), completion_tokens)

    # --- everything else ----------------------------------------------------------------------------------
    async def feedback(self, request: Request) -> Response:
        tenant = self.auth.tenant(request.headers.get("authorization"))
        request.state.tenant = tenant
        body = protocol.parse(protocol.FeedbackRequest, await request.body())
        self.events.log(FeedbackEvent(id=body.id, tenant=tenant, score=body.score, source=body.source or "http"))
        self.metrics.requests.labels(tenant, "feedback", "202").inc()
        return JSONResponse({"id": body.id, "object": "feedback", "status": "accepted"}, status_code=202)

    async def models(self, request: Request) -> Response:
        tenant = self.auth.tenant(request.headers.get("authorization"))
        versions = await asyncio.to_thread(self.registry.unsettled, tenant)  # every published one, not the history
        data = [_model_card(self.base_name, self.started), _model_card(tenant, self.started)]
        data += [
            _model_card(v.name, int((v.published_at or v.created_at).timestamp()), parent=tenant)
            for v in versions
            if v.status == "published"
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        ok = not self.engine.errored
        body = {
            "status": "ok" if ok else "engine_dead",
            "pid": os.getpid(),  # lets a supervisor tell its own serving from another process on the port
            "model": self.base_name,
            "adapters": {t: self.adapters.current(t) for t in self.tenants},
            "refused_adapters": self.adapters.refused(),
            "events": {"kafka_connected": self.events.connected, "spooled": self.events.spooled},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


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
    app = FastAPI(title="clora serving", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/feedback", api.feedback, methods=["POST"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.prometheus, methods=["GET"])

    @app.exception_handler(ServingError)
    async def _refused(request: Request, e: ServingError) -> Response:
        endpoint = ENDPOINTS.get(request.url.path, request.url.path)
        api.metrics.request_refused(getattr(request.state, "tenant", "-"), endpoint, e.status)
        headers = {"www-authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(Exception)
    async def _failed(request: Request, e: Exception) -> Response:
        logger.exception("request %s to %s failed", getattr(request.state, "request_id", "?"), request.url.path)
        return JSONResponse(internal_error_body(e), status_code=500)

    app.add_middleware(RequestIdMiddleware)
    return app
