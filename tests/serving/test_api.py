"""The HTTP API against what OpenAI clients send, without a real engine: the real `Engine` wrapper over a
fake vLLM `AsyncLLM` (one character = one token, the completion echoes the prompt's first characters), the
real `AdapterSet`, auth, protocol and app, over httpx's ASGI transport.

Each test states an OpenAI behaviour a client relies on (defaults, nulls, batches, refusals with their
status, `param` and `code`, limits) and checks the engine saw what it should.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import threading
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import httpx
import pytest

from serving.adapters import AdapterSet
from serving.api import Api, create_app
from serving.auth import Authenticator
from serving.engine import BYTE_LEVEL, Engine
from serving.metrics import ServingMetrics

pytestmark = pytest.mark.unit

MAX_MODEL_LEN = 64
BASE = "tiny-base"
KEYS = {"acme": "acme-key", "globex": "globex-key"}
MESSAGES = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------------------------
# Fakes


class FakeTokenizer:
    """One character per token (ids are code points below 256)."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def __init__(self):
        self.threads: list[str] = []

    def __len__(self):
        return 256

    def encode(self, text, add_special_tokens=False):
        self.threads.append(threading.current_thread().name)
        return [ord(c) % 256 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.threads.append(threading.current_thread().name)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeLLM:
    """What serving/engine.py reads of vLLM's AsyncLLM. Each choice is the prompt's first (up to 3) tokens."""

    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(get_vocab_size=lambda: 256)
        self.errored = False
        self.calls: list[SimpleNamespace] = []
        self.finish_reason: str | None = None  # forces every choice's finish reason
        self.fail: Exception | None = None  # raised when a request is added
        self.gate: asyncio.Event | None = None  # holds every request before its first token
        self.hold: asyncio.Event | None = None  # holds every request after its first token
        self.holding = asyncio.Event()  # set once a request is held there
        self.reply: list[int] | None = None  # the tokens every choice answers (None: the prompt's first three)

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self):
        pass

    async def generate(self, prompt, params, request_id, lora_request=None, priority=0):
        self.calls.append(SimpleNamespace(prompt=prompt, params=params, request_id=request_id, priority=priority))
        if self.fail is not None:
            raise self.fail
        try:
            async for output in self._outputs(prompt, params):
                yield output
        finally:  # vLLM aborts the request here when the generator is closed early
            if self.on_close is not None:
                self.on_close(request_id)

    on_close = None  # called with the request id when a generation's generator is closed or ends

    async def _outputs(self, prompt, params):
        if self.gate is not None:
            await self.gate.wait()
        tokens = self.reply[: params.max_tokens] if self.reply else prompt["prompt_token_ids"][: min(3, params.max_tokens)]
        shown = ""
        for step, token in enumerate(tokens):
            last = step == len(tokens) - 1
            finish = (self.finish_reason or ("length" if len(tokens) == params.max_tokens else "stop")) if last else None
            # the text the tokens so far complete, as vLLM's detokenizer gives it: a character not yet whole waits
            whole = self.tokenizer.decode(tokens[: step + 1])
            whole = whole if last else whole.rstrip("\ufffd")
            text, shown = whole[len(shown):], whole
            yield SimpleNamespace(outputs=[
                SimpleNamespace(index=i, text=text, token_ids=[token], finish_reason=finish,
                                logprobs=[{token: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=text)}])
                for i in range(params.n)
            ])
            if self.hold is not None and not last:
                self.holding.set()
                await self.hold.wait()


class FakeAdapterEngine:
    def new_handle(self, name, path):
        raise AssertionError("no adapter is loaded in these tests")


class FakeRegistry:
    """Published versions of "acme": 1 (published) and 2 (a candidate)."""

    def __init__(self):
        when = datetime(2025, 1, 1, tzinfo=timezone.utc)
        self.versions = {("acme", n): SimpleNamespace(name=f"acme@{n}", number=n, status=status, created_at=when,
                                                      published_at=when if status == "published" else None,
                                                      path=f"/adapters/acme/{n}")
                         for n, status in ((1, "published"), (2, "candidate"))}
        self.logged = []

    def generation(self):
        return 0

    def published(self):
        return {}

    def get(self, tenant, number):
        from storage.registry import VersionNotFound

        try:
            return self.versions[(tenant, number)]
        except KeyError:
            raise VersionNotFound(tenant, number) from None

    def unsettled(self, tenant):
        return [v for (t, _), v in self.versions.items() if t == tenant]

    def log_unreadable(self, e, consequence):  # the real one logs each file once per process
        self.logged.append((str(e), consequence))


class FakeEvents:
    connected, spooled, full = True, 0, False

    def __init__(self):
        self.logged = []

    def log(self, event):
        if self.full:
            return False
        self.logged.append(event)
        return True


class World:
    def __init__(self, **api_settings):
        self.llm = FakeLLM()
        self.engine = Engine(self.llm, max_model_len=MAX_MODEL_LEN)
        self.llm.tokenizer.threads.clear()  # the engine's start-up look at the tokenizer: not a request's work
        self.events = FakeEvents()
        metrics = ServingMetrics()
        adapters = AdapterSet(FakeAdapterEngine(), FakeRegistry(), list(KEYS), lambda path: None, metrics,
                              base_name=BASE)
        self.api = Api(engine=self.engine, adapters=adapters, authenticator=Authenticator(KEYS.items()),
                       tenants=list(KEYS), base_name=BASE, events=self.events, metrics=metrics,
                       registry=FakeRegistry(), **api_settings)
        self.app = create_app(self.api)

    def client(self, tenant="acme") -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://clora",
                                 headers={"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {})

    def run(self, scenario):
        """Runs `scenario(client)` (a coroutine function) and returns what it returns."""

        async def main():
            async with self.client() as c:
                return await scenario(c)

        return asyncio.run(main())

    def post(self, path, body, tenant="acme", **kwargs):
        async def one(_):
            async with self.client(tenant) as c:
                return await c.post(path, json=body, **kwargs)
        return self.run(one)

    def get(self, path, tenant="acme"):
        async def one(_):
            async with self.client(tenant) as c:
                return await c.get(path)
        return self.run(one)


async def eventually(condition, timeout: float = 30.0) -> None:
    """Waits until `condition()` holds, polled every 10 ms; fails the test after `timeout` seconds (what it
    waits for is a background task's doing, not a time)."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting for a condition")


def chat(**extra):
    return {"model": "acme", "messages": MESSAGES, **extra}


def sse_events(response) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in response.text.split("\n\n") if line]


def chat_scope(body: bytes, tenant: str = "acme", path: str = "/v1/chat/completions") -> dict:
    """The ASGI scope of a POST to `path` carrying `body`, for tests that drive the app's receive."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "server": ("clora", 80), "client": ("127.0.0.1", 5000),
            "headers": [(b"authorization", f"Bearer {KEYS[tenant]}".encode()),
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


async def leave_once_generating(w, body: bytes, *, headers=(), at_engine=lambda: None,
                                path: str = "/v1/chat/completions", requests: int = 1) -> None:
    """POSTs `body` to `path` straight to the app, as a client that leaves (disconnects) once the engine has
    `requests` requests (after `at_engine()`), and returns when the handler has ended."""
    left = asyncio.Event()
    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = chat_scope(body, path=path)
    scope["headers"] = [*scope["headers"], *headers]
    handler = asyncio.create_task(w.app(scope, receive, send))
    while len(w.llm.calls) < requests:
        await asyncio.sleep(0.01)
    at_engine()
    left.set()  # the client goes away
    await asyncio.wait_for(handler, 5)


def error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ---------------------------------------------------------------------------------------------------------
# A. What broke common clients


def test_no_max_tokens_means_the_room_the_context_leaves():
    w = World()
    r = w.post("/v1/chat/completions", chat())
    prompt_tokens = len("<user>hi<assistant>")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == prompt_tokens
    assert w.llm.calls[0].params.max_tokens == MAX_MODEL_LEN - prompt_tokens
    assert w.events.logged[0].metadata["sampling"]["max_tokens"] == MAX_MODEL_LEN - prompt_tokens

    capped = World(default_max_tokens=5)
    capped.post("/v1/completions", {"model": "acme", "prompt": "hello"})
    capped.post("/v1/completions", {"model": "acme", "prompt": "hello", "max_tokens": 9})
    capped.post("/v1/completions", {"model": "acme", "prompt": "hello", "max_tokens": 999})  # shortened to fit
    assert [c.params.max_tokens for c in capped.llm.calls] == [5, 9, MAX_MODEL_LEN - 5]


def test_time_to_first_token_is_measured_per_endpoint_streamed_or_not():
    w = World()
    assert w.post("/v1/chat/completions", chat()).status_code == 200
    assert w.post("/v1/chat/completions", chat(stream=True)).status_code == 200
    assert w.post("/v1/completions", {"model": "acme", "prompt": "hello"}).status_code == 200
    metrics = w.api.metrics.render().decode()
    assert 'clora_serving_time_to_first_token_seconds_count{endpoint="chat"} 2.0' in metrics
    assert 'clora_serving_time_to_first_token_seconds_count{endpoint="completions"} 1.0' in metrics


def test_completions_without_max_tokens_get_16_as_openai_and_vllm_give():
    w = World()
    w.post("/v1/completions", {"model": "acme", "prompt": "hello"})
    w.post("/v1/completions", {"model": "acme", "prompt": "hello", "max_tokens": 40})
    assert [c.params.max_tokens for c in w.llm.calls] == [16, 40]


TOOL_TURNS = [{"role": "user", "content": "x"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "42"}]


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    # with a choice of "none" OpenAI's model still sees the definitions; this template would not show them
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, "tools"),
    ({"messages": TOOL_TURNS}, "messages"),
])
def test_tools_and_tool_turns_are_refused_for_a_template_that_would_not_show_them(extra, param):
    """A chat template that leaves tools out (this fake's, and many base models') would have the model answer
    as if they had not been sent; dropped tool turns, an empty assistant turn and an orphaned result."""
    w = World()
    r = w.post("/v1/chat/completions", chat(**extra))
    assert r.status_code == 400 and error(r)["param"] == param and error(r)["code"] == "unsupported_parameter"
    assert "chat template does not show" in error(r)["message"]
    assert w.llm.calls == []


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "x"}, {"role": "function", "name": "f", "content": "42"}],
    [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
])
def test_deprecated_function_turns_are_refused_not_dropped(messages):
    w = World()
    r = w.post("/v1/chat/completions", {"model": "acme", "messages": messages})
    assert r.status_code == 400 and error(r)["param"] == "messages" and error(r)["code"] == "unsupported_parameter"
    assert w.llm.calls == []


def test_an_unknown_role_is_a_400_before_any_work_and_a_tool_turn_needs_its_call_id():
    w = World()
    r = w.post("/v1/chat/completions", chat(messages=[{"role": "bot", "content": "x"}]))
    assert r.status_code == 400 and error(r)["param"] == "messages.[0].role" and "'bot'" in error(r)["message"]
    r = w.post("/v1/chat/completions", chat(messages=[{"role": "tool", "content": "x"}]))
    assert r.status_code == 400 and "tool_call_id" in error(r)["message"] and error(r)["param"] == "messages"
    r = w.post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]))
    assert r.status_code == 400 and "only an assistant message has tool_calls" in error(r)["message"]
    assert w.llm.calls == [] and w.llm.tokenizer.threads == []


F = {"type": "function", "function": {"name": "f"}}


def nested(depth: int) -> dict:
    """A JSON Schema object nesting `depth` levels of properties."""
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("extra, param, code", [
    ({"tool_choice": "required"}, "tool_choice", "invalid_request"),  # a call demanded, with nothing to call
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "invalid_request"),
    ({"tools": [F], "tool_choice": {"type": "function"}}, "tool_choice", "invalid_request"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "invalid_request"),
    ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "invalid_request"),
    ({"tools": [F, F]}, "tools", "invalid_request"),
    ({"tools": [{"type": "web_search"}]}, "tools", "invalid_request"),
    ({"tools": [F] * 129}, "tools", "invalid_request"),
    ({"tools": [F], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_request"),
    ({"tools": [F], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "invalid_request"),
    ({"tools": [F], "tool_choice": "required", "min_tokens": 2}, "min_tokens", "invalid_request"),
    ({"function_call": {"name": "f"}}, "function_call", "unsupported_parameter"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"functions": [{"name": "f"}], "function_call": "none"}, "functions", "unsupported_parameter"),
    ({"response_format": {"type": "regex", "regex": "a+"}}, "response_format", "unsupported_parameter"),  # vLLM's
    # nested near the parser's own depth, writing the forced call's schema back as JSON raised (a 500)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(400)}}], "tool_choice": "required"},
     "tools", "invalid_request"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": nested(400)}}},
     "response_format.json_schema.schema", "invalid_request"),
])
def test_tool_requests_openai_refuses_and_deprecated_functions_are_a_400_naming_the_field(extra, param, code):
    w = World()
    r = w.post("/v1/chat/completions", chat(**extra))
    assert r.status_code == 400
    e = error(r)
    assert (e["param"], e["code"]) == (param, code), e
    assert w.llm.calls == []


class FakeToolTokenizer(FakeTokenizer):
    """FakeTokenizer whose template shows tools and tool turns, as Qwen's does (in a short format of its own)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
        shown = "".join(f"<tool {t['function']['name']}>" for t in tools or ())
        for m in messages:
            calls = "".join(f"<tool_call>{c['function']['name']} {json.dumps(c['function']['arguments'])}</tool_call>"
                            for c in m.get("tool_calls") or ())
            shown += f"<{m['role']}>{m['content'] or ''}{calls}"
        return shown + "<assistant>"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALLED = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tool_world(reply: str) -> World:
    """A World whose template shows tools, every choice answering `reply` (one token per character)."""
    llm = FakeLLM()
    llm.tokenizer = FakeToolTokenizer()
    llm.reply = [ord(c) for c in reply]
    w = World()
    w.llm, w.engine = llm, Engine(llm, max_model_len=1024)
    w.api.engine = w.engine
    return w


def test_a_call_in_the_models_text_is_answered_as_tool_calls_and_the_event_keeps_the_text():
    """tool_choice "auto" (the default with tools): the model's Hermes call becomes OpenAI's tool_calls, the
    text before it the content; the template was shown the tools and the tool turns; the event keeps the
    model's own text, which the learner trains on."""
    w = tool_world(CALLED)
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER], messages=TOOL_TURNS, logprobs=True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert len(choice["logprobs"]["content"]) == len(CALLED)  # every token's, the call's too
    prompt = w.llm.calls[0].prompt["prompt_token_ids"]
    # the call's arguments reach the template as an object, as vLLM hands them over
    assert "".join(map(chr, prompt)) == "<tool get_weather><user>x<assistant><tool_call>f {}</tool_call><tool>42<assistant>"
    [event] = w.events.logged
    assert event.completion == CALLED and event.metadata["finish_reason"] == "stop"
    assert event.metadata["tools"] == {"defined": 1, "choice": "auto", "called": ["get_weather"],
                                       "finish_reason": "tool_calls"}  # for queries: which answers called what
    assert event.messages == TOOL_TURNS


def test_a_streamed_call_is_held_from_its_first_character_and_sent_whole_with_the_content_before_it():
    """The stream sends content as it comes, but not text that may be a call's start ("<", "<tool"...): the
    call goes in one chunk with its id, name and arguments, and the finish reason in one of its own after
    it, as OpenAI sends them (the SDK's stream events close the last call on it); every token's log-prob
    and id is sent once."""
    w = tool_world(CALLED)
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER], stream=True, logprobs=True, return_token_ids=True))
    events = sse_events(r)
    deltas = [e["choices"][0] for e in events[1:-1]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Let me look."
    assert all("<" not in (d["delta"].get("content") or "") for d in deltas)
    [calls] = [d for d in deltas if "tool_calls" in d["delta"]]
    assert calls is deltas[-2] and calls["finish_reason"] is None
    assert deltas[-1]["delta"] == {"content": ""} and deltas[-1]["finish_reason"] == "tool_calls"
    [call] = calls["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [t for d in deltas for t in d["token_ids"]] == [ord(c) for c in CALLED]
    assert [lp["token"] for d in deltas for lp in (d["logprobs"] or {"content": []})["content"]] == list(CALLED)
    assert [d["finish_reason"] for d in deltas[:-1]] == [None] * (len(deltas) - 1)


@pytest.mark.parametrize("reply", [
    "a < b, and <tool is a word",  # looked like a call's start, twice, and was not
    '<tool_call>{"name": "get_weather", "arguments": ',  # cut short: no whole call
    '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # a function the request did not define
])
@pytest.mark.parametrize("stream", [False, True])
def test_text_that_holds_no_call_is_the_content_whole(reply, stream):
    """Nothing is dropped: what does not parse as a call of one of the request's tools is content."""
    w = tool_world(reply)
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER], stream=stream))
    if stream:
        deltas = [e["choices"][0] for e in sse_events(r)[1:-1]]
        assert "".join(d["delta"]["content"] for d in deltas) == reply
        assert not any("tool_calls" in d["delta"] for d in deltas) and deltas[-1]["finish_reason"] == "stop"
    else:
        choice = r.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": reply} and choice["finish_reason"] == "stop"


def test_tool_choice_none_reads_no_calls_and_parallel_false_keeps_the_first():
    two = CALLED + '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    w = tool_world(two)
    none = w.post("/v1/chat/completions", chat(tools=[WEATHER], tool_choice="none")).json()["choices"][0]
    assert none["message"] == {"role": "assistant", "content": two} and none["finish_reason"] == "stop"
    both = w.post("/v1/chat/completions", chat(tools=[WEATHER])).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in both] == ["Paris", "Rome"]
    assert len({c["id"] for c in both}) == 2
    one = w.post("/v1/chat/completions", chat(tools=[WEATHER], parallel_tool_calls=False)).json()
    assert [c["function"]["arguments"] for c in one["choices"][0]["message"]["tool_calls"]] == ['{"city": "Paris"}']


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_forces_its_arguments_through_the_engines_structured_outputs(stream):
    w = tool_world('{"city": "Oslo"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER], tool_choice=named, stream=stream))
    assert w.llm.calls[0].params.structured_outputs.json == WEATHER["function"]["parameters"]
    if stream:
        deltas = [e["choices"][0] for e in sse_events(r)[1:-1]]
        calls, last = deltas  # held whole (the text is the call), then the finish reason
        message, finish = calls["delta"], last["finish_reason"]
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in message["tool_calls"]]
    else:
        choice = r.json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        assert message["content"] is None
    assert finish == "stop"  # as OpenAI answers a named choice
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    sampling = w.events.logged[0].metadata["sampling"]
    assert sampling["structured"]["type"] == "tool_calls"  # drawn under a grammar: the learner reads it so


def test_the_openai_sdks_stream_helper_and_agent_loop_read_streamed_calls_as_they_read_openais():
    """The SDK's `chat.completions.stream`: each call's arguments-done event fires (the last one on the finish
    chunk), the final completion holds both calls, and that message, sent back with the tools' results as
    an agent loop sends it, is answered."""
    import openai

    two = CALLED + '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    w = tool_world(two)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=w.app)) as http:
            client = openai.AsyncOpenAI(api_key=KEYS["acme"], base_url="http://clora/v1", http_client=http)
            done = []
            async with client.chat.completions.stream(model="acme", messages=MESSAGES, tools=[WEATHER]) as stream:
                async for event in stream:
                    if event.type == "tool_calls.function.arguments.done":
                        done.append((event.index, event.arguments))
                final = await stream.get_final_completion()
            message = final.choices[0].message
            results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls]
            again = await client.chat.completions.create(
                model="acme", tools=[WEATHER], messages=[*MESSAGES, message.model_dump(exclude_none=True), *results])
            return done, final, again

    done, final, again = asyncio.run(scenario())
    assert done == [(0, '{"city": "Paris"}'), (1, '{"city": "Rome"}')]
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_weather"]
    assert again.choices[0].message.tool_calls is not None  # the fake answers every request with the calls
    sent_back = w.events.logged[-1].messages
    assert [m["role"] for m in sent_back] == ["user", "assistant", "tool", "tool"]
    assert sent_back[1]["tool_calls"][1]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


class FakeJsonCallsTokenizer(FakeToolTokenizer):
    """A template that shows tools but teaches calls as bare JSON (Llama 3.1's way), not Hermes."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
        text = super().apply_chat_template(messages, add_generation_prompt, tokenize, tools)
        return text.replace("<tool_call>", "").replace("</tool_call>", "")


def test_auto_is_refused_for_a_template_that_teaches_calls_in_another_format_and_forced_calls_are_served():
    """Its calls would come back as text with finish_reason "stop", which an agent takes for a final answer."""
    w = tool_world('{"city": "Oslo"}')
    w.llm.tokenizer = FakeJsonCallsTokenizer()
    w.engine = w.api.engine = Engine(w.llm, max_model_len=1024)
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER]))
    assert r.status_code == 400 and error(r)["param"] == "tool_choice" and "Hermes" in error(r)["message"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER], tool_choice=named))
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert w.post("/v1/chat/completions", chat(tools=[WEATHER], tool_choice="none")).status_code == 200


def test_an_assistant_message_the_sdk_sends_back_is_taken_with_what_it_adds():
    """The SDK's stream helper and .parse() put `parsed_arguments` (null, or an object) in each call."""
    w = tool_world("fine")
    turns = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}', "parsed_arguments": {"city": "Oslo"}}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER], messages=turns))
    assert r.status_code == 200, r.text
    assert w.events.logged[0].messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                          "arguments": '{"city": "Oslo"}'}


def test_tool_choice_required_forces_a_list_of_calls_of_the_requests_tools():
    other = {"type": "function", "function": {"name": "get_time"}}
    w = tool_world('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]')
    r = w.post("/v1/chat/completions", chat(tools=[WEATHER, other], tool_choice="required"))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_time", "arguments": "{}"}, {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    schema = w.llm.calls[0].params.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    w.post("/v1/chat/completions", chat(tools=[WEATHER, other], tool_choice="required", parallel_tool_calls=False))
    assert w.llm.calls[1].params.structured_outputs.json["maxItems"] == 1


@pytest.mark.parametrize("extra", [
    {"tools": [], "tool_choice": "none"},
    {"tools": [], "tool_choice": None},
    {"functions": [], "function_call": "none"},
    {"response_format": {"type": "text"}},
    {"parallel_tool_calls": False},
])
def test_tools_that_cannot_be_called_and_text_format_are_fine(extra):
    assert World().post("/v1/chat/completions", chat(**extra)).status_code == 200


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_response_formats_reach_the_engine_as_structured_outputs_and_the_event_says_so(endpoint):
    """LangChain's with_structured_output, the SDK's .parse(), instructor: all send response_format. The
    engine masks what would leave the JSON (or the schema); the event records it, for the learner, which
    cannot rebuild a distribution drawn under a grammar."""
    w = World()
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["reasoning", "n"]}  # reasoning first: sorted, the model would answer before it reasoned
    path, base = (("/v1/chat/completions", chat()) if endpoint == "chat"
                  else ("/v1/completions", {"model": "acme", "prompt": "hi"}))
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}):
        assert w.post(path, {**base, "response_format": fmt}).status_code == 200
    first, second = (call.params.structured_outputs for call in w.llm.calls)
    assert first.json_object is True and first.json is None
    assert second.json == schema and not second.json_object
    assert list(second.json["properties"]) == list(schema["properties"]), "the fields' order is the output's"
    recorded = [e.metadata["sampling"]["structured"] for e in w.events.logged]
    digest = hashlib.sha256(json.dumps(schema, separators=(",", ":")).encode()).hexdigest()
    assert recorded == [{"type": "json_object"}, {"type": "json_schema", "schema_sha256": digest}]
    assert w.post(path, {**base, "response_format": {"type": "text"}}).status_code == 200
    assert w.llm.calls[-1].params.structured_outputs is None and "structured" not in w.events.logged[-1].metadata["sampling"]


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "response_format.json_schema.schema"),
])
def test_a_json_schema_response_format_without_its_parts_is_a_400_naming_them(fmt, param):
    r = World().post("/v1/chat/completions", chat(response_format=fmt))
    assert r.status_code == 400 and error(r)["param"] == param, r.text


@pytest.mark.parametrize("extra, param", [
    ({"min_tokens": 4}, "min_tokens"),  # once the JSON is whole no token may come: the engine fails the request
    ({"ignore_eos": True}, "ignore_eos"),  # past the JSON's end the grammar no longer holds
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "description": "x" * 70_000}}}}, "response_format.json_schema.schema"),
])
def test_a_json_response_format_refuses_what_cannot_work_beside_it(extra, param):
    body = chat(**{"response_format": {"type": "json_object"}, **extra})
    r = World().post("/v1/chat/completions", body)
    assert r.status_code == 400 and error(r)["param"] == param, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_engine_refuses_is_a_400_on_response_format_and_gives_its_slots_back(stream):
    from vllm.exceptions import VLLMValidationError

    w = World()
    w.llm.fail = VLLMValidationError("The provided JSON schema contains features not supported by xgrammar.")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    r = w.post("/v1/chat/completions", chat(response_format=fmt, stream=stream, n=2, temperature=1))
    assert r.status_code == 400 and error(r)["param"] == "response_format", r.text
    assert w.api.inflight.held("acme") == 0
    w.llm.fail = VLLMValidationError("something else entirely")  # not the schema's: not blamed on it
    r = w.post("/v1/chat/completions", chat(response_format=fmt))
    assert r.status_code == 400 and error(r)["param"] is None


def test_explicit_null_is_the_default():
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "stream_options", "logprobs", "top_logprobs", "stop",
                           "seed", "max_tokens", "max_completion_tokens", "presence_penalty", "frequency_penalty",
                           "logit_bias", "user", "metadata", "tools", "tool_choice", "response_format"])
    w = World()
    r = w.post("/v1/chat/completions", chat(**nulls))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    params = w.llm.calls[0].params
    assert (params.temperature, params.top_p, params.n, params.presence_penalty) == (1.0, 1.0, 1, 0.0)
    completion = {**dict.fromkeys(["echo", "suffix", "logprobs", "best_of", "n", "stream", "temperature"]),
                  "model": "acme", "prompt": "hello"}
    assert World().post("/v1/completions", completion).status_code == 200
    for required in ({"model": None, "messages": MESSAGES}, {"model": "acme", "messages": None}):
        assert World().post("/v1/chat/completions", required).status_code == 400


def test_token_id_batches_and_one_string_list():
    w = World()
    for prompt in ([[104, 105]], ["hi"], [104, 105], "hi"):
        r = w.post("/v1/completions", {"model": "acme", "prompt": prompt})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi", (prompt, r.text)
    for empty in ([], [[]], [[104], []], [""]):
        r = World().post("/v1/completions", {"model": "acme", "prompt": empty})
        assert r.status_code == 400 and error(r)["param"] == "prompt", empty


def test_a_prompt_sent_as_token_ids_is_logged_with_those_ids_and_a_text_prompt_without():
    """The learner trains on the prompt the model saw: for token ids, the ids themselves (their decoded text
    may re-tokenize to other ids); text and chat prompts re-tokenize to what was served and carry none."""
    w = World()
    r = w.post("/v1/completions", {"model": "acme", "prompt": [[104, 105], [120, 121, 122]], "stream": False})
    assert r.status_code == 200, r.text
    assert [(e.prompt, e.prompt_token_ids) for e in w.events.logged] == [("hi", [104, 105]), ("xyz", [120, 121, 122])]
    streamed = World()
    events = sse_events(streamed.post("/v1/completions", {"model": "acme", "prompt": [104, 105], "stream": True}))
    assert events[-1] == "[DONE]" and [e.prompt_token_ids for e in streamed.events.logged] == [[104, 105]]
    mixed = World()
    assert mixed.post("/v1/completions", {"model": "acme", "prompt": "hi"}).status_code == 200
    assert mixed.post("/v1/chat/completions", {"model": "acme", "messages": MESSAGES}).status_code == 200
    assert [e.prompt_token_ids for e in mixed.events.logged] == [None, None]


def test_return_token_ids_gives_each_choice_its_sampled_tokens_streamed_or_not():
    """vLLM's extension: a trainer gets the tokens the model produced, not a re-tokenisation of the text."""
    w = World()
    r = w.post("/v1/completions", {"model": "acme", "prompt": "hey", "n": 2, "return_token_ids": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["token_ids"] == [104, 101, 121] and c["logprobs"]["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert "token_ids" not in w.post("/v1/completions", {"model": "acme", "prompt": "hey"}).json()["choices"][0]
    chat_r = w.post("/v1/chat/completions", chat(return_token_ids=True))
    assert chat_r.json()["choices"][0]["token_ids"] == [ord(c) for c in "<us"]
    events = sse_events(w.post("/v1/completions", {"model": "acme", "prompt": "hey", "stream": True,
                                                   "return_token_ids": True}))
    streamed = [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]]
    assert streamed == [104, 101, 121]
    chat_events = sse_events(w.post("/v1/chat/completions", chat(stream=True, return_token_ids=True)))
    assert "token_ids" not in chat_events[0]["choices"][0]  # the opening role chunk has none
    assert [t for e in chat_events[1:-1] for c in e["choices"] for t in c["token_ids"]] == [ord(c) for c in "<us"]


def test_return_token_ids_gives_the_prompts_ids_as_vllm_does_streamed_or_not():
    """Chat: at the top level (the first chunk of a stream); completions: on each choice (its first chunk).
    Only the server knows a chat prompt's ids (its template's), which a trainer needs."""
    w = World()
    rendered = [ord(c) for c in "<user>hi<assistant>"]
    batch = {"model": "acme", "prompt": ["hey", "yo"], "n": 2, "return_token_ids": True}
    r = w.post("/v1/completions", batch).json()
    assert [c["prompt_token_ids"] for c in r["choices"]] == [[104, 101, 121]] * 2 + [[121, 111]] * 2
    events = sse_events(w.post("/v1/completions", {**batch, "stream": True}))
    firsts = {}
    for e in events[:-1]:
        for c in e["choices"]:
            firsts.setdefault(c["index"], c.get("prompt_token_ids"))
            assert c["index"] in firsts
    assert firsts == {0: [104, 101, 121], 1: [104, 101, 121], 2: [121, 111], 3: [121, 111]}
    assert sum("prompt_token_ids" in c for e in events[:-1] for c in e["choices"]) == 4  # each choice's first only
    assert w.post("/v1/chat/completions", chat(return_token_ids=True)).json()["prompt_token_ids"] == rendered
    chat_events = sse_events(w.post("/v1/chat/completions", chat(stream=True, return_token_ids=True)))
    assert chat_events[0]["prompt_token_ids"] == rendered and all("prompt_token_ids" not in e for e in chat_events[1:-1])
    plain = w.post("/v1/completions", {"model": "acme", "prompt": "hey"}).json()
    assert "prompt_token_ids" not in plain and "prompt_token_ids" not in plain["choices"][0]
    assert "prompt_token_ids" not in w.post("/v1/chat/completions", chat()).json()


class FakeByteTokenizer(FakeTokenizer):
    """A byte-level vocabulary, as Qwen's: one token per UTF-8 byte, each spelt as GPT-2's alphabet spells it."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids):
        return [SPELT[i] for i in ids]


SPELT = {b: c for c, b in BYTE_LEVEL.items()}


def test_logprobs_carry_the_bytes_of_tokens_that_split_a_character_streamed_or_not():
    """"a你é" is six byte tokens. Each logprob entry has its own bytes (joined, the content's UTF-8), a token
    that is no whole character reads OpenAI's "bytes:\\xe4", and text_offset is where the token's character
    starts in the text returned: not "" or U+FFFD with the bytes of that text, nor offsets summed over it."""
    llm = FakeLLM()
    llm.tokenizer = FakeByteTokenizer()
    llm.reply = list("a你é".encode())
    w = World()
    w.llm, w.engine = llm, Engine(llm, max_model_len=MAX_MODEL_LEN)
    w.api.engine = w.engine
    tokens = ["a", "bytes:\\xe4", "bytes:\\xbd", "bytes:\\xa0", "bytes:\\xc3", "bytes:\\xa9"]

    r = w.post("/v1/chat/completions", chat(logprobs=True, top_logprobs=1))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "a你é"
    assert bytes(b for entry in content for b in entry["bytes"]) == "a你é".encode()
    assert [entry["token"] for entry in content] == tokens
    assert [entry["top_logprobs"][0]["bytes"] for entry in content] == [[b] for b in "a你é".encode()]

    body = {"model": "acme", "prompt": "x", "logprobs": 1}
    logprobs = w.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == tokens and logprobs["text_offset"] == [0, 1, 1, 1, 2, 2]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[t] for t in tokens]
    chunks = [c["logprobs"] for e in sse_events(w.post("/v1/completions", {**body, "stream": True}))[:-1]
              for c in e["choices"]]
    assert [t for lp in chunks for t in lp["tokens"]] == tokens
    assert [o for lp in chunks for o in lp["text_offset"]] == [0, 1, 1, 1, 2, 2]


class FakeBosTokenizer(FakeTokenizer):
    """FakeTokenizer that adds a BOS (id 2) when asked for special tokens, as Llama-family tokenizers do."""

    def encode(self, text, add_special_tokens=False):
        return ([2] if add_special_tokens else []) + super().encode(text)


def test_a_text_prompt_gets_the_tokenizers_bos_as_vllm_gives_it_and_the_event_carries_those_ids():
    """vLLM's completions endpoint adds special tokens to a text prompt; without them a Llama-family base
    model ran without its BOS. The text alone re-tokenizes without it, so the event carries the ids; chat
    prompts get theirs from the template and are tokenized as they are."""
    llm = FakeLLM()
    llm.tokenizer = FakeBosTokenizer()
    w = World()
    w.llm, w.engine = llm, Engine(llm, max_model_len=MAX_MODEL_LEN)
    w.api.engine = w.engine
    assert w.post("/v1/completions", {"model": "acme", "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert w.post("/v1/chat/completions", {"model": "acme", "messages": MESSAGES}).status_code == 200
    assert llm.calls[0].prompt["prompt_token_ids"] == [2, 104, 105]
    assert llm.calls[1].prompt["prompt_token_ids"] == [ord(c) for c in "<user>hi<assistant>"]
    assert [e.prompt_token_ids for e in w.events.logged] == [[2, 104, 105], None]
    assert w.events.logged[0].prompt == "hi"


def test_several_prompts_fan_out_with_openai_choice_numbering():
    w = World()
    r = w.post("/v1/completions", {"model": "acme", "prompt": ["ab", "xyz", "q"], "n": 2, "temperature": 1})
    assert r.status_code == 200
    body = r.json()
    # choice j of prompt i is i * n + j
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "ab"), (1, "ab"), (2, "xyz"), (3, "xyz"),
                                                                  (4, "q"), (5, "q")]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}
    assert len({c.request_id for c in w.llm.calls}) == 3  # one engine request per prompt
    # one interaction event per prompt x choice, each with its own prompt, ids as with n > 1
    assert [(e.id, e.prompt, e.completion) for e in w.events.logged] == [
        (f"{body['id']}-{k}", p, p) for k, p in enumerate(["ab", "ab", "xyz", "xyz", "q", "q"])]

    streamed = World().post("/v1/completions", {"model": "acme", "prompt": ["ab", "xyz"], "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = sse_events(streamed)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["prompt_tokens"] == 5
    assert all("usage" in e and e["usage"] is None for e in events[:-2])  # OpenAI's: null but in the last
    texts: dict[int, str] = {}
    for chunk in events[:-2]:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "ab", 1: "xyz"}

    too_many = World().post("/v1/completions", {"model": "acme", "prompt": ["a"] * 17, "n": 8})
    assert too_many.status_code == 400 and error(too_many)["param"] == "prompt"


def test_one_failing_prompt_of_a_batch_fails_the_request_before_any_work():
    w = World()
    r = w.post("/v1/completions", {"model": "acme", "prompt": ["ok", "x" * MAX_MODEL_LEN]})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
    assert w.llm.calls == [] and w.api.inflight.held("acme") == 0


# ---------------------------------------------------------------------------------------------------------
# B. What surprised clients


def test_penalties_and_vllm_sampling_extensions_reach_the_engine():
    w = World()
    r = w.post("/v1/chat/completions", chat(presence_penalty=0.5, frequency_penalty=-1.5, logit_bias={"104": 5, "7": -100},
                                            top_k=5, min_p=0.1, repetition_penalty=1.2))
    assert r.status_code == 200, r.text
    p = w.llm.calls[0].params
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_p, p.repetition_penalty) == (0.5, -1.5, 5, 0.1, 1.2)
    assert p.logit_bias == {104: 5.0, 7: -100.0}
    sampling = w.events.logged[0].metadata["sampling"]
    assert sampling["presence_penalty"] == 0.5 and sampling["logit_bias"] == {"104": 5.0, "7": -100.0}


def test_a_requests_priority_reaches_the_engine_for_each_of_its_prompts():
    w = World()
    assert w.post("/v1/chat/completions", chat()).status_code == 200
    assert w.post("/v1/completions", {"model": "acme", "prompt": "hi", "priority": 4}).status_code == 200
    assert w.post("/v1/completions", {"model": "acme", "prompt": ["a", "b"], "priority": 2}).status_code == 200
    assert [c.priority for c in w.llm.calls] == [0, 4, 2, 2]
    assert w.post("/v1/completions", {"model": "acme", "prompt": "hi", "priority": -1}).status_code == 400


def test_greedy_with_n_choices_runs_once_and_answers_n_times_streamed_or_not():
    """OpenAI answers temperature 0 with n > 1 (n equal choices); vLLM refuses it, so the engine runs it once."""
    w = World()
    r = w.post("/v1/chat/completions", chat(temperature=0, n=3, logprobs=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(i, "<us") for i in range(3)]
    assert body["usage"]["completion_tokens"] == 9  # each choice's tokens, as OpenAI bills them
    assert [c.params.n for c in w.llm.calls] == [1] and len(w.events.logged) == 3
    events = sse_events(w.post("/v1/completions", {"model": "acme", "prompt": "hey", "temperature": 0, "n": 2,
                                                   "stream": True, "stream_options": {"include_usage": True}}))
    texts: dict[int, str] = {}
    for chunk in events[:-2]:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "hey", 1: "hey"} and events[-2]["usage"]["completion_tokens"] == 6
    assert [c.params.n for c in w.llm.calls] == [1, 1]


def test_top_p_0_reaches_the_engine_as_top_k_1():
    w = World()
    assert w.post("/v1/chat/completions", chat(top_p=0)).status_code == 200
    assert (w.llm.calls[0].params.top_p, w.llm.calls[0].params.top_k) == (1.0, 1)


def test_vllms_stopping_fields_reach_the_engine_and_the_event():
    w = World()
    r = w.post("/v1/chat/completions", chat(min_tokens=2, stop_token_ids=[7], include_stop_str_in_output=True,
                                            ignore_eos=True, max_tokens=5))
    assert r.status_code == 200, r.text
    p = w.llm.calls[0].params
    assert (p.min_tokens, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == (2, [7], True, True)
    sampling = w.events.logged[0].metadata["sampling"]
    assert (sampling["min_tokens"], sampling["stop_token_ids"], sampling["ignore_eos"]) == (2, [7], True)
    r = w.post("/v1/chat/completions", chat(min_tokens=6, max_tokens=5))
    assert r.status_code == 400 and error(r)["param"] == "min_tokens", r.text


def test_a_field_clora_does_not_implement_is_refused_before_any_work():
    """Qwen3's chat_template_kwargs {"enable_thinking": false}, dropped, answered with the thinking it asked off."""
    w = World()
    for stream in (False, True):
        r = w.post("/v1/chat/completions", chat(stream=stream, chat_template_kwargs={"enable_thinking": False}))
        e = error(r)
        assert r.status_code == 400 and e["code"] == "unsupported_parameter" and e["param"] == "chat_template_kwargs"
        r = w.post("/v1/completions", {"model": "acme", "prompt": "a", "stream": stream, "guided_json": {}})
        assert r.status_code == 400 and error(r)["param"] == "guided_json"
    assert w.llm.calls == [] and w.llm.tokenizer.threads == []


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"300": 1}}, "logit_bias"),  # outside the vocabulary (256): vLLM's own check, made up front
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # int() of it raised: a 500 and a traceback in the log
    # Bounds on what each choice's event copies from the request
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop": ["ok", "x" * 1025]}, "stop"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_sampling_out_of_range_is_a_400_naming_the_field(extra, param):
    w = World()
    for stream in (False, True):
        r = w.post("/v1/chat/completions", chat(stream=stream, **extra))
        assert r.status_code == 400 and error(r)["param"] == param, r.text
    assert w.llm.calls == []


def test_best_of_other_than_n_is_refused():
    w = World()
    assert w.post("/v1/completions", {"model": "acme", "prompt": "a", "best_of": 1}).status_code == 200
    r = w.post("/v1/completions", {"model": "acme", "prompt": "a", "best_of": 3})
    assert r.status_code == 400 and error(r)["param"] == "best_of"


def test_stream_refusals_are_real_statuses_not_errors_inside_a_200():
    w = World()
    w.llm.errored = True
    for path, body in (("/v1/chat/completions", chat(stream=True)),
                       ("/v1/completions", {"model": "acme", "prompt": "a", "stream": True})):
        r = w.post(path, body)
        assert r.status_code == 503 and error(r)["code"] == "engine_unavailable"
        assert r.headers["x-should-retry"] == "false"  # only a restart helps: OpenAI's SDK must not retry
    assert w.llm.calls == []

    from vllm.exceptions import VLLMValidationError

    w = World()
    w.llm.fail = VLLMValidationError("nope", parameter="temperature")  # refused by the engine when added
    for path, body in (("/v1/completions", {"model": "acme", "prompt": "a", "stream": True}),
                       ("/v1/chat/completions", chat(stream=True))):  # chat too: its role chunks wait for the engine
        r = w.post(path, body)
        assert r.status_code == 400 and error(r)["param"] == "temperature"
    assert w.api.inflight.held("acme") == 0


def test_prompt_too_long_says_so_as_openai_does():
    w = World()
    r = w.post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * MAX_MODEL_LEN}]))
    e = error(r)
    assert r.status_code == 400 and e["code"] == "context_length_exceeded" and e["param"] == "messages"
    assert e["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
                                   f"messages resulted in {MAX_MODEL_LEN + len('<user><assistant>')} tokens")
    r = w.post("/v1/completions", {"model": "acme", "prompt": [1] * MAX_MODEL_LEN})
    assert error(r)["param"] == "prompt" and "your prompt resulted in 64 tokens" in error(r)["message"]


def test_text_far_beyond_the_context_is_refused_before_tokenizing():
    w = World()
    r = w.post("/v1/completions", {"model": "acme", "prompt": "x" * (MAX_MODEL_LEN * 16 + 1)})
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
    assert w.llm.tokenizer.threads == []  # never tokenized


@pytest.mark.parametrize("messages, code", [
    ([{"role": "user", "content": ""}] * MAX_MODEL_LEN, "context_length_exceeded"),  # each renders to framing
    ([{"role": "r" * (MAX_MODEL_LEN * 16), "content": "hi"}], "invalid_request"),  # a huge role: no role at all
], ids=["many-empty-messages", "long-role"])
def test_chat_text_counts_roles_and_framing_before_tokenizing(messages, code):
    w = World()
    r = w.post("/v1/chat/completions", chat(messages=messages))
    assert r.status_code == 400 and error(r)["code"] == code and len(error(r)["message"]) < 200
    assert w.llm.tokenizer.threads == []  # refused before the prompt thread


def test_one_tenants_queue_of_prompts_does_not_go_before_another_tenants():
    """The prompt thread takes one job of each tenant at a time: a flood from one tenant queues behind itself."""
    w = World(max_inflight_per_tenant=64)
    order, arrived, hold = [], [], threading.Event()
    real_template, real_turn = w.llm.tokenizer.apply_chat_template, w.engine._in_prompt_thread

    def held(messages, **kw):  # the prompt thread's jobs, in the order it runs them; the first waits for `hold`
        order.append(messages[0]["content"])
        hold.wait(10)
        return real_template(messages, **kw)

    async def counted(tenant, fn, *args):
        arrived.append(tenant)
        return await real_turn(tenant, fn, *args)

    w.llm.tokenizer.apply_chat_template, w.engine._in_prompt_thread = held, counted

    async def until(condition):
        for _ in range(1000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out: arrived {arrived}, ran {order}")

    async def scenario(c):
        flood = [asyncio.create_task(c.post("/v1/chat/completions", json=chat(
            messages=[{"role": "user", "content": f"acme{i}"}]))) for i in range(10)]
        await until(lambda: arrived.count("acme") == 10 and order == ["acme0"])  # the whole flood is queued
        async with w.client("globex") as g:
            other = asyncio.create_task(g.post("/v1/chat/completions", json=chat(
                model="globex", messages=[{"role": "user", "content": "globex"}])))
            await until(lambda: "globex" in arrived)
            hold.set()
            await asyncio.gather(*flood)
            return await other

    assert w.run(scenario).status_code == 200
    assert order[:2] == ["acme0", "globex"] and len(order) == 11, order  # next after the one running, not last
    assert w.engine._prompt_turns == {}, "a tenant's turn goes with its last job (tenants come and go)"


def test_templating_and_tokenizing_run_off_the_event_loop():
    w = World()
    w.post("/v1/chat/completions", chat())
    w.post("/v1/completions", {"model": "acme", "prompt": "abc"})
    assert len(w.llm.tokenizer.threads) == 3 and all(t.startswith("clora-prompts") for t in w.llm.tokenizer.threads)


def test_engine_error_finish_is_a_500_and_logs_nothing():
    w = World()
    w.llm.finish_reason = "error"
    r = w.post("/v1/chat/completions", chat())
    assert r.status_code == 500 and error(r)["code"] == "generation_failed"
    streamed = w.post("/v1/chat/completions", chat(stream=True))
    events = sse_events(streamed)
    assert streamed.status_code == 200  # its first tokens were out before the engine failed it
    assert events[-2]["error"]["code"] == "generation_failed" and events[-1] == "[DONE]"
    assert w.events.logged == [] and w.api.inflight.held("acme") == 0


def test_a_generation_that_ends_early_is_closed_in_the_engine_before_its_adapter_lease_is_released():
    """Closing it aborts the request in vLLM. Left to the garbage collector, the abort came after the
    lease's release, which may unload the adapter (and delete its files) under the still-running request."""
    w = World()
    w.llm.finish_reason = "error"  # a choice fails: the stream ends by an exception inside the engine's loop
    held_at_close = []
    w.llm.on_close = lambda request_id: held_at_close.append(w.api.inflight.held("acme"))
    for body in (chat(), chat(stream=True)):
        w.post("/v1/chat/completions", body)
    assert held_at_close == [1, 1] and w.api.inflight.held("acme") == 0


def test_unknown_routes_and_methods_use_the_openai_error_shape():
    w = World()
    r = w.get("/v1/nope")
    assert r.status_code == 404 and "Invalid URL (GET /v1/nope)" in error(r)["message"]
    r = w.get("/v1/chat/completions")
    assert r.status_code == 405 and error(r)["code"] == "method_not_allowed" and "POST" in error(r)["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/completions/", "/v1/feedback/"])
def test_a_trailing_slash_is_an_unknown_url_not_a_redirect(path):
    """OpenAI answers 404 in its error shape; a 307 with an empty body left clients with nothing to show."""
    w = World()
    r = w.post(path, chat())
    assert r.status_code == 404 and f"Invalid URL (POST {path})" in error(r)["message"]
    assert w.llm.calls == []


def test_one_model_card_of_your_own_models():
    w = World()
    assert w.get(f"/v1/models/{BASE}").json()["id"] == BASE
    assert w.get("/v1/models/acme").json()["id"] == "acme"
    card = w.get("/v1/models/acme@1").json()
    assert card == {"id": "acme@1", "object": "model", "created": 1735689600, "owned_by": "clora", "parent": "acme"}
    for other in ("acme@2", "acme@9", "globex", "globex@1", "nobody", "acme@x"):  # unpublished, missing, not yours
        r = w.get(f"/v1/models/{other}")
        assert r.status_code == 404 and error(r)["code"] == "model_not_found", other
    assert w.get("/v1/models/acme", tenant=None).status_code == 401


def test_models_answers_are_counted_in_requests_total():
    w = World()
    assert w.get("/v1/models").status_code == 200
    assert w.get("/v1/models/acme@1").status_code == 200
    assert w.get("/v1/models/acme@9").status_code == 404
    metrics = w.get("/metrics").text
    assert 'clora_serving_requests_total{endpoint="models",status="200",tenant="acme"} 2.0' in metrics, metrics
    assert 'clora_serving_requests_total{endpoint="models",status="404",tenant="acme"} 1.0' in metrics, metrics


def test_a_version_serving_refused_is_neither_listed_nor_carded(caplog):
    """A generation naming a refused version is 404, so the models routes do not offer it either. The reason
    the tenant reads names the adapter's problems, never the path of serving's copy (host, pid, data
    directory): that goes to the log."""
    from pathlib import Path

    from serving.adapter_check import AdapterRejected

    w = World()
    assert "acme@1" in [m["id"] for m in w.get("/v1/models").json()["data"]]

    def refuse(path):
        raise AdapterRejected(Path(path), ["rank 64 is above serving.max_lora_rank 16"])

    w.api.adapters.check = refuse
    r = w.post("/v1/chat/completions", chat(model="acme@1"))
    assert r.status_code == 404 and error(r)["message"] == ("model 'acme@1' cannot be served: (1) rank 64 is above "
                                                            "serving.max_lora_rank 16")
    assert w.api.adapters.refused() == {"acme@1": "(1) rank 64 is above serving.max_lora_rank 16"}
    assert "adapter /adapters/acme/1 refused: (1) rank 64" in caplog.text
    assert [m["id"] for m in w.get("/v1/models").json()["data"]] == [BASE, "acme"]
    r = w.get("/v1/models/acme@1")
    assert r.status_code == 404 and error(r)["code"] == "model_not_found" and error(r)["param"] == "model"
    assert "rank 64" in error(r)["message"] and "/adapters" not in error(r)["message"]  # what the generation got
    assert w.get("/v1/models/acme").status_code == 200  # the tenant's name still serves (the base model here)


def test_a_tenant_whose_registry_record_cannot_be_read_still_lists_and_cards_what_it_can():
    """A record edited by hand: /v1/models lists the base model and the tenant (no versions), its card is 404
    without the file's path (that goes to the log)."""
    from pathlib import Path

    from storage.registry import UnreadableRecord

    w = World()

    def damaged(*_):
        raise UnreadableRecord(Path("/data/registry/acme/1.json"), "not JSON")

    w.api.registry.unsettled = damaged
    w.api.registry.get = damaged
    r = w.get("/v1/models")
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [BASE, "acme"]
    r = w.get("/v1/models/acme@1")
    assert r.status_code == 404 and error(r)["code"] == "model_not_found" and "cannot be read" in error(r)["message"]
    assert "/data/registry" not in error(r)["message"]
    assert w.get("/v1/models/acme").status_code == 200
    assert all("/data/registry/acme/1.json" in e for e, _ in w.api.registry.logged), "the path goes to the log"
    assert [why for _, why in w.api.registry.logged] == [
        "tenant acme's versions are left out of /v1/models until it is mended",
        "model 'acme@1' is not found until it is mended"]


def test_base_model_answers_carry_the_configured_base_name():
    w = World()
    for model in ("acme", BASE):  # acme has nothing published: the base model serves it
        r = w.post("/v1/chat/completions", chat(model=model))
        assert r.json()["model"] == BASE and r.headers["x-clora-adapter-version"] == BASE
    assert w.events.logged[0].adapter_version is None and w.events.logged[0].metadata["served_by"] == BASE
    assert w.get("/health").json()["adapters"] == {"acme": BASE, "globex": BASE}


def test_developer_role_and_text_parts():
    w = World()
    messages = [{"role": "developer", "content": "be brief", "name": "dev"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert w.post("/v1/chat/completions", chat(messages=messages)).status_code == 200
    assert w.events.logged[0].prompt == "<system>be brief<user>a\nb<assistant>"
    r = w.post("/v1/chat/completions", chat(stream_options={"include_usage": True}))
    assert r.status_code == 400 and error(r)["param"] == "stream_options"
    r = w.post("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]))
    assert r.status_code == 400 and error(r)["param"] == "messages"


def test_every_error_names_its_param_or_null():
    w = World()
    r = w.post("/v1/chat/completions", chat(), tenant=None)
    assert r.status_code == 401 and error(r)["param"] is None
    r = w.post("/v1/chat/completions", chat(temperature=9))
    assert error(r)["param"] == "temperature"
    r = w.post("/v1/chat/completions", chat(model="globex"))
    assert r.status_code == 404 and error(r)["param"] is None


# ---------------------------------------------------------------------------------------------------------
# C. Limits a tenant cannot push past


def test_bodies_over_the_limit_are_413():
    w = World(max_request_bytes=2048)
    big = chat(messages=[{"role": "user", "content": "x" * 4096}])
    r = w.post("/v1/chat/completions", big)
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"

    async def chunked(c):  # no Content-Length: counted while read
        async def parts():
            for _ in range(8):
                yield b" " * 512
        return await c.post("/v1/feedback", content=parts(), headers={"content-type": "application/json"})

    r = World(max_request_bytes=2048).run(chunked)
    assert r.status_code == 413
    assert w.post("/v1/chat/completions", chat()).status_code == 200


def test_a_generation_body_past_a_limit_that_fits_the_context_is_context_length_exceeded():
    """The default limit is room for any prompt the context fits (16 characters a token, 6 bytes each escaped):
    a generation body past it is answered as OpenAI answers a prompt too long, 400 context_length_exceeded,
    which clients (the openai SDK's BadRequestError, LangChain, LiteLLM) read as context overflow; not 413."""
    w = World(max_request_bytes=96 * MAX_MODEL_LEN)
    r = w.post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 96 * MAX_MODEL_LEN}]))
    e = error(r)
    assert r.status_code == 400 and e["code"] == "context_length_exceeded" and e["param"] == "messages"
    assert e["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
                                   "request body is ")

    async def chunked(c):  # no Content-Length: counted while read
        async def parts():
            for _ in range(16):
                yield b" " * 512
        return await c.post("/v1/completions", content=parts(), headers={"content-type": "application/json"})

    r = w.run(chunked)
    assert r.status_code == 400 and error(r)["param"] == "prompt" and "over 6144 bytes" in error(r)["message"]
    r = w.post("/v1/feedback", {"id": "x" * 96 * MAX_MODEL_LEN, "score": 1})  # no prompt: the server's limit
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"
    assert w.llm.calls == []


def test_a_completions_batch_past_the_limit_is_413_batch_too_large_even_when_each_prompt_fits():
    """Many prompts that each fit the context, together past the body limit, are not told to "reduce the
    length of the prompt": 413 request_too_large says the batch is too large, with or without Content-Length.
    A prompt past the limit on its own, alone or first in a list, stays 400 context_length_exceeded."""
    w = World(max_request_bytes=96 * MAX_MODEL_LEN)
    batch = {"model": "acme", "prompt": ["x" * 100] * 100}
    r = w.post("/v1/completions", batch)
    e = error(r)
    assert r.status_code == 413 and e["code"] == "request_too_large" and e["param"] == "prompt"
    assert "batch of prompts is too large" in e["message"] and f"{len(r.request.content)} bytes" in e["message"]
    r = w.post("/v1/completions", {"model": "acme", "prompt": [[7] * 30] * 300})
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"

    async def chunked(c):  # no Content-Length: counted while read
        async def parts():
            body = json.dumps(batch).encode()
            for at in range(0, len(body), 512):
                yield body[at:at + 512]
        return await c.post("/v1/completions", content=parts(), headers={"content-type": "application/json"})

    r = w.run(chunked)
    assert r.status_code == 413 and "over 6144 bytes" in error(r)["message"] and "batch" in error(r)["message"]
    for one in ("x" * 96 * MAX_MODEL_LEN, ["x" * 96 * MAX_MODEL_LEN], ["x" * 96 * MAX_MODEL_LEN, "y"]):
        r = w.post("/v1/completions", {"model": "acme", "prompt": one})
        assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded", one
    assert w.llm.calls == []


def test_a_tenant_over_its_in_flight_limit_gets_429_with_retry_after():
    w = World(max_inflight_per_tenant=3)
    w.llm.gate = asyncio.Event()

    async def scenario(c):
        held = asyncio.create_task(c.post("/v1/chat/completions", json=chat(n=2, temperature=1)))
        while not w.llm.calls:
            await asyncio.sleep(0.01)
        over = await c.post("/v1/chat/completions", json=chat(n=2, temperature=1))
        fits = asyncio.create_task(c.post("/v1/chat/completions", json=chat()))
        async with w.client("globex") as g:  # another tenant is not held back
            other = asyncio.create_task(g.post("/v1/chat/completions", json=chat(model="globex", n=3, temperature=1)))
            while len(w.llm.calls) < 3:
                await asyncio.sleep(0.01)
            w.llm.gate.set()
            results = await asyncio.gather(held, fits, other)
        after = await c.post("/v1/chat/completions", json=chat(n=3, temperature=1))
        too_many = await c.post("/v1/chat/completions", json=chat(n=4, temperature=1))
        return over, results, after, too_many

    over, results, after, too_many = w.run(scenario)
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert error(over)["type"] == "requests" and error(over)["code"] == "rate_limit_exceeded"
    assert [r.status_code for r in results] == [200, 200, 200] and after.status_code == 200
    assert too_many.status_code == 400 and error(too_many)["param"] == "n"  # could never fit
    assert w.api.inflight.held("acme") == 0


def test_a_request_over_the_in_flight_limit_waits_for_room_in_turn_then_runs():
    """A client sending more at once than its tenant's limit (an SDK's gather) had the extra ones refused 429
    within the ~2 s OpenAI's SDK spends retrying, while the running ones had far longer to go."""
    w = World(max_inflight_per_tenant=3, max_inflight_wait_s=30.0)
    w.llm.gate = asyncio.Event()

    async def scenario(c):
        held = asyncio.create_task(c.post("/v1/chat/completions", json=chat(n=3, temperature=1)))
        while not w.llm.calls:
            await asyncio.sleep(0.01)
        waits = [asyncio.create_task(c.post("/v1/chat/completions", json=chat(n=2, temperature=1))),
                 asyncio.create_task(c.post("/v1/chat/completions", json=chat()))]
        while w.api.inflight.waiting("acme") < 2:
            await asyncio.sleep(0.01)
        assert len(w.llm.calls) == 1, "they wait: nothing of theirs reached the engine"
        w.llm.gate.set()
        return await held, await asyncio.gather(*waits)

    held, waited = w.run(scenario)
    assert held.status_code == 200 and [r.status_code for r in waited] == [200, 200]
    assert w.api.inflight.held("acme") == 0 and w.api.inflight.waiting("acme") == 0


def test_a_client_that_leaves_while_its_request_waits_for_room_gives_its_place_up():
    """uvicorn does not cancel a handler whose client left: the waiting request kept its place, and once
    granted went on to tokenize and reach the engine for nobody."""
    w = World(max_inflight_per_tenant=1, max_inflight_wait_s=30.0)
    w.llm.gate = asyncio.Event()

    async def scenario(c):
        held = asyncio.create_task(c.post("/v1/chat/completions", json=chat()))
        while not w.llm.calls:
            await asyncio.sleep(0.01)
        left, sent = asyncio.Event(), []

        async def receive():
            if not sent:
                sent.append({"type": "http.request", "body": json.dumps(chat()).encode(), "more_body": False})
                return sent[0]
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        handler = asyncio.create_task(w.app(chat_scope(json.dumps(chat()).encode()), receive, send))
        while w.api.inflight.waiting("acme") < 1:
            await asyncio.sleep(0.01)
        left.set()  # the client goes away while its request waits
        await asyncio.wait_for(handler, 5)
        waiting_after = w.api.inflight.waiting("acme")
        w.llm.gate.set()
        return await held, waiting_after, sent

    held, waiting_after, sent = w.run(scenario)
    assert held.status_code == 200 and waiting_after == 0
    assert len(w.llm.calls) == 1, "the request that left never reached the engine"
    assert w.api.inflight.held("acme") == 0
    assert 'clora_serving_requests_total{endpoint="chat",status="499",tenant="acme"} 1.0' in w.api.metrics.render().decode()


def test_the_in_flight_wait_is_first_come_first_served_bounded_and_left_by_a_client_that_goes():
    from serving.api import InflightLimit
    from serving.errors import RateLimited

    async def scenario():
        limit = InflightLimit(3, wait_s=30.0)
        two = limit.take("acme", 2)
        big = asyncio.create_task(limit.acquire("acme", 2))
        small = asyncio.create_task(limit.acquire("acme", 1))  # would fit now, but waits behind the first
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done() and limit.waiting("acme") == 2
        (await limit.acquire("globex", 3))()  # another tenant's room is its own
        two()
        release_big, release_small = await big, await small
        assert limit.held("acme") == 3 and limit.waiting("acme") == 0
        release_big(), release_small()
        assert limit.held("acme") == 0

        # the engine's order: a production request (priority 0) before the learner's rollouts waiting first
        order = []
        one = limit.take("acme", 3)

        async def wanting(name, priority):
            release = await limit.acquire("acme", 1, priority)
            order.append(name)
            return release

        rollouts = [asyncio.create_task(wanting(f"rollout-{i}", 1)) for i in range(2)]
        await asyncio.sleep(0.01)
        production = asyncio.create_task(wanting("production", 0))
        await asyncio.sleep(0.01)
        one()
        for release in await asyncio.gather(production, *rollouts):
            release()
        assert order == ["production", "rollout-0", "rollout-1"]

        short = InflightLimit(1, wait_s=0.05)
        hold = short.take("acme", 1)
        with pytest.raises(RateLimited, match="after waiting 0.05 s for room"):
            await short.acquire("acme", 1)
        gone = asyncio.create_task(short.acquire("acme", 1))  # its client leaves while it waits
        await asyncio.sleep(0.01)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert short.waiting("acme") == 0
        hold()
        assert short.held("acme") == 0, "no room was given to the request that left"
        full = InflightLimit(1, wait_s=30.0)  # at most `limit` requests of a tenant wait: then 429 at once
        hold = full.take("acme", 1)
        first = asyncio.create_task(full.acquire("acme", 1))
        await asyncio.sleep(0.01)
        assert full.must_wait("acme", 1) is False and full.waiting("acme") == 1
        with pytest.raises(RateLimited, match="1 requests wait for room already"):
            await full.acquire("acme", 1)
        hold()
        (await first)()
        at_once = InflightLimit(1)  # wait 0: refused at once, as before
        at_once.take("acme", 1)
        with pytest.raises(RateLimited):
            await at_once.acquire("acme", 1)

    asyncio.run(scenario())


def test_the_learners_rollouts_leave_a_quarter_of_a_tenants_room_to_its_production_requests():
    """A step's rollouts (priority 1) filled the tenant's room: an app's request then waited for a rollout to
    finish before the engine saw it."""
    from serving.api import InflightLimit

    async def scenario():
        limit = InflightLimit(8, wait_s=30.0)
        rollouts = [limit.take("acme", 1) for _ in range(6)]  # held already: the reserve is 2
        waiting = asyncio.create_task(limit.acquire("acme", 1, priority=1))
        await asyncio.sleep(0.01)
        assert not waiting.done() and limit.must_wait("acme", 1, priority=1)
        assert not limit.must_wait("acme", 2)  # production takes the reserve at once
        production = await limit.acquire("acme", 2)
        production()
        rollouts.pop()()  # a rollout ends: the one waiting takes its place, the reserve stays free
        granted = await waiting
        assert limit.held("acme") == 6 and not limit.must_wait("acme", 2)
        granted()
        for release in rollouts:
            release()
        alone = await limit.acquire("acme", 8, priority=1)  # one as large as the room runs when nothing is held
        assert limit.held("acme") == 8
        alone()
        assert InflightLimit(3).reserve == 0  # below 4: no reserve

    asyncio.run(scenario())


def test_each_tenant_salts_the_prefix_cache():
    w = World()
    w.post("/v1/chat/completions", chat())
    w.post("/v1/chat/completions", chat(model=BASE), tenant="globex")
    assert w.post("/v1/completions", {"model": "acme", "prompt": ["ab", "cd"]}).status_code == 200  # each of a batch
    assert [c.prompt["cache_salt"] for c in w.llm.calls] == ["acme", "globex", "acme", "acme"]


def test_a_batch_of_prompts_takes_an_in_flight_slot_per_completion():
    """The limit counts completions (prompts x n), a batch's every prompt included."""
    w = World(max_inflight_per_tenant=3)
    never = w.post("/v1/completions", {"model": "acme", "prompt": ["a", "b", "c", "d"]})
    assert never.status_code == 400 and "3" in error(never)["message"]  # could never fit
    w.llm.gate = asyncio.Event()

    async def scenario(c):
        held = asyncio.create_task(c.post("/v1/completions", json={"model": "acme", "prompt": ["ab", "cd"]}))
        while len(w.llm.calls) < 2:
            await asyncio.sleep(0.01)
        over = await c.post("/v1/completions", json={"model": "acme", "prompt": ["ef", "gh"]})
        w.llm.gate.set()
        return over, await held

    over, held = w.run(scenario)
    assert over.status_code == 429 and held.status_code == 200
    assert w.api.inflight.held("acme") == 0


def test_a_batch_whose_client_leaves_aborts_every_prompts_generation_before_its_slots_go_back():
    w = World(max_inflight_per_tenant=4)
    w.llm.gate = asyncio.Event()  # no generation gets its first token
    held_at_close = []
    w.llm.on_close = lambda request_id: held_at_close.append(w.api.inflight.held("acme"))
    body = json.dumps({"model": "acme", "prompt": ["ab", "cd"], "n": 2, "temperature": 1}).encode()

    async def scenario():
        await leave_once_generating(w, body, path="/v1/completions", requests=2)
        return w.api.inflight.held("acme")

    assert asyncio.run(scenario()) == 0
    assert held_at_close == [4, 4]  # both prompts' engine requests, each while the slots were still held


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_answer_gives_its_slots_back_at_once(stream):
    """The server does not notice a client leaving while a handler runs (a non-streamed one, or a stream
    before its first chunk); the API watches for it and aborts the generation, instead of holding the
    tenant's in-flight slots until it would have ended."""
    w = World(max_inflight_per_tenant=4)
    w.llm.gate = asyncio.Event()  # the generation never gets its first token unless the test lets it
    held_at_close = []  # the engine's request is closed (aborted) before the slots go back
    w.llm.on_close = lambda request_id: held_at_close.append(w.api.inflight.held("acme"))
    body = json.dumps(chat(n=4, temperature=1, stream=stream)).encode()

    held_at_engine = []

    async def scenario():
        await leave_once_generating(w, body, at_engine=lambda: held_at_engine.append(w.api.inflight.held("acme")))
        return w.api.inflight.held("acme")

    assert asyncio.run(scenario()) == 0
    assert held_at_engine == held_at_close == [4]
    assert w.events.logged == [], "nothing was answered, so no interaction is logged"
    assert w.api.metrics.requests.labels("acme", "chat", "499")._value.get() == 1, "the aborted request is counted"


def test_a_client_that_leaves_mid_stream_has_its_engine_request_closed_before_its_slots_go_back():
    """The connection breaks after the first chunks (sending fails): the server drops the response's
    iterator, and closing it must close the engine's generation (abort its request) before the lease goes
    back, not whenever the garbage collector gets to the inner generators."""
    import gc

    w = World(max_inflight_per_tenant=4)
    w.llm.reply = [1, 2, 3, 4, 5, 6]
    held_at_close = []
    w.llm.on_close = lambda request_id: held_at_close.append(w.api.inflight.held("acme"))
    body = json.dumps(chat(stream=True, max_tokens=6)).encode()

    async def scenario():
        chunks, gone = [], asyncio.Event()
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():  # the request's body; the disconnect only once sending has failed
            with contextlib.suppress(StopIteration):
                return next(messages)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if len(chunks) == 2:
                    gone.set()
                    raise OSError("connection reset by peer")

        with contextlib.suppress(Exception):
            await asyncio.wait_for(w.app(chat_scope(body), receive, send), 5)
        for _ in range(20):  # whatever the collector and the event loop close meanwhile
            gc.collect()
            await asyncio.sleep(0)
        return len(chunks)

    assert asyncio.run(scenario()) == 2
    assert held_at_close == [1] and w.api.inflight.held("acme") == 0


def test_a_stream_whose_client_stops_reading_is_aborted_as_if_it_left(monkeypatch):
    """A client that stops reading (its TCP window full) while staying connected is never seen to leave:
    uvicorn's send waited for ever, holding the tenant's in-flight slots, the adapter's lease and the
    Idempotency-Key. A send that waits past SEND_TIMEOUT_S ends the stream as a client that left does."""
    import serving.api

    monkeypatch.setattr(serving.api, "SEND_TIMEOUT_S", 0.2)
    w = World(max_inflight_per_tenant=4)
    w.llm.reply = [1, 2, 3, 4, 5, 6]
    w.llm.hold = asyncio.Event()  # never set: the generation is still running when the client stalls
    held_at_close = []
    w.llm.on_close = lambda request_id: held_at_close.append(w.api.inflight.held("acme"))
    body = json.dumps(chat(stream=True, max_tokens=6)).encode()

    async def scenario():
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])
        chunks = []

        async def receive():  # the body, then nothing: the client never disconnects
            with contextlib.suppress(StopIteration):
                return next(messages)
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if len(chunks) == 2:
                    await asyncio.Event().wait()  # the client reads no more: this send never completes

        scope = chat_scope(body)
        scope["headers"] = [*scope["headers"], (b"idempotency-key", b"k-1")]
        await asyncio.wait_for(w.app(scope, receive, send), 5)
        return len(chunks), dict(w.api.keys._running), w.api.inflight.held("acme")

    assert asyncio.run(scenario()) == (2, {}, 0)
    assert held_at_close == [1], "the engine's request is aborted before the slots go back"
    assert w.events.logged == [], "an unfinished completion is not logged"
    assert w.api.metrics.requests.labels("acme", "chat", "499")._value.get() == 1


def test_a_stopping_server_ends_the_generations_left_after_its_grace_period_with_503():
    """`stop_generations` (the grace period is over): a stream already answering gets an error event and
    [DONE], a non-streamed request a 503, both counted as 503 (not as clients that left, 499) and aborted in
    the engine before their slots go back; a request arriving later is a 503 before it reaches the engine."""
    w = World()
    w.llm.reply = [65, 66, 67]
    w.llm.hold = asyncio.Event()  # never set: the generations run until the server stops them
    closed = {}  # endpoint -> its tenant's slots held when its engine request was closed
    w.llm.on_close = lambda request_id: closed.update(
        {"chat": w.api.inflight.held("acme")} if request_id.startswith("chatcmpl") else
        {"completions": w.api.inflight.held("globex")})

    async def scenario(client):
        streamed = asyncio.create_task(client.post("/v1/chat/completions", json=chat(stream=True)))
        plain = asyncio.create_task(client.post("/v1/completions", json={"model": "globex", "prompt": "hi"},
                                                headers={"Authorization": f"Bearer {KEYS['globex']}"}))
        while len(w.llm.calls) < 2 or not w.llm.holding.is_set():
            await asyncio.sleep(0.01)
        w.api.stop_generations()
        done = await asyncio.wait_for(asyncio.gather(streamed, plain), 5)
        late = await client.post("/v1/chat/completions", json=chat())
        return (*done, late)

    streamed, plain, late = w.run(scenario)
    events = sse_events(streamed)
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "server_stopping" and events[-2]["error"]["type"] == "server_error"
    assert any(e["choices"][0]["delta"].get("content") == "A" for e in events[:-2]), "it had begun answering"
    for r in (plain, late):
        assert r.status_code == 503 and error(r)["code"] == "server_stopping"
        assert r.headers["retry-after"] == "5"  # not at once: this server is still stopping
    assert len(w.llm.calls) == 2, "the late request never reached the engine"
    assert closed == {"chat": 1, "completions": 1}
    assert w.api.inflight.held("acme") == w.api.inflight.held("globex") == 0
    requests = w.api.metrics.requests
    assert requests.labels("acme", "chat", "503")._value.get() == 2
    assert requests.labels("globex", "completions", "503")._value.get() == 1
    assert requests.labels("acme", "chat", "499")._value.get() == 0
    assert w.events.logged == [], "nothing was answered whole"


def test_a_stop_ends_a_stream_at_once_whatever_its_slow_client_has_not_read_yet():
    """The engine's outputs are queued at its pace, whatever the client's: a stop behind 40 of them queued for a
    slow client sent all 40 before its error, the engine's request running on meanwhile."""
    from types import SimpleNamespace

    w = World()

    async def outputs(prompt, params):
        for _ in range(40):
            yield SimpleNamespace(outputs=[SimpleNamespace(
                index=0, text="A", token_ids=[65], finish_reason=None,
                logprobs=[{65: SimpleNamespace(logprob=-0.5, rank=1, decoded_token="A")}])])
        w.llm.holding.set()
        await asyncio.Event().wait()  # still generating

    w.llm._outputs = outputs
    body = json.dumps(chat(stream=True, max_tokens=1000)).encode()

    async def scenario():
        after_stop, stopped = [], []
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            with contextlib.suppress(StopIteration):
                return next(messages)
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                if stopped:
                    after_stop.append(message["body"])
                await asyncio.sleep(0.02)  # a slow client

        app = asyncio.create_task(w.app(chat_scope(body), receive, send))
        await asyncio.wait_for(w.llm.holding.wait(), 10)
        stopped.append(True)
        w.api.stop_generations()
        await asyncio.wait_for(app, 10)
        return after_stop

    after_stop = asyncio.run(scenario())
    content = sum(b'"content":"A"' in chunk for chunk in after_stop)
    assert content <= 1 and any(b"server_stopping" in chunk for chunk in after_stop[:3])


def test_a_stop_answers_the_running_stream_over_http_before_the_server_exits(monkeypatch):
    """The same through uvicorn, as `python -m serving` runs it (`watch`, a grace period of 0): the stream
    gets its error event and [DONE] long before uvicorn's own deadline would cut it off with neither (and
    count it as a client that left), and the server then exits."""
    import uvicorn

    from serving import __main__ as process

    monkeypatch.setattr(process, "WATCH_SECONDS", 0.01)
    w = World()
    w.llm.reply = [65, 66, 67]
    w.llm.hold = asyncio.Event()  # never set: the generation runs until the server stops it

    async def main():
        listener = process.listen("127.0.0.1", 0)
        port = listener.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(w.app, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=60))
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        monitor = asyncio.create_task(process.watch(server, w.engine, w.api, stop, grace=0))
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False,
                                     headers={"Authorization": f"Bearer {KEYS['acme']}"}) as client:
            async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                await w.llm.holding.wait()
                server.should_exit = True  # what uvicorn's SIGTERM handler does
                body = await asyncio.wait_for(r.aread(), 30)
        await asyncio.wait_for(serving, 30)
        stop.set()
        assert await monitor is False
        return r.status_code, body.decode()

    status, body = asyncio.run(main())
    events = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in body.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_stopping"
    assert w.api.metrics.requests.labels("acme", "chat", "503")._value.get() == 1
    assert w.api.metrics.requests.labels("acme", "chat", "499")._value.get() == 0
    assert w.api.inflight.held("acme") == 0


def test_clora_up_gives_serving_its_grace_period_and_the_time_its_stop_takes(tmp_path):
    """uvicorn's own deadline and the event log's drain fit in the stop timeout `clora up` allows serving, so
    a stop never kills serving while it still answers or drains its events."""
    import inspect

    from clora.config import Config
    from clora.up import SERVING_STOP_AFTER_GRACE_S, stack_specs
    from serving.__main__ import LAST_ANSWERS_SECONDS, WATCH_SECONDS
    from serving.events_log import EventLog

    for grace in (None, 120.0):
        settings = {} if grace is None else {"shutdown_grace_seconds": grace}
        cfg = Config.model_validate({"data_dir": str(tmp_path), "serving": settings})
        grace = cfg.serving.shutdown_grace_seconds
        (serving,) = [spec for spec in stack_specs(cfg, "clora.toml")[0] if spec.name == "serving"]
        assert serving.stop_timeout == grace + SERVING_STOP_AFTER_GRACE_S
        drain = inspect.signature(EventLog.close).parameters["timeout"].default
        assert grace + WATCH_SECONDS + LAST_ANSWERS_SECONDS + drain < serving.stop_timeout


def test_a_body_not_whole_in_time_is_a_408_that_closes_the_connection(monkeypatch):
    """A body was read with no time limit: a client opening many connections and trickling their bodies held
    each one's memory for as long as it liked."""
    import serving.api

    monkeypatch.setattr(serving.api, "BODY_TIMEOUT_S", 0.2)
    w = World()
    body = json.dumps(chat()).encode()

    async def scenario():
        parts = [{"type": "http.request", "body": body[:10], "more_body": True}]
        sent = []

        async def receive():
            if parts:
                return parts.pop(0)
            await asyncio.Event().wait()  # the rest never comes, and the client stays

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(w.app(chat_scope(body), receive, send), 5)
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"], "uvicorn closes the connection once it is answered"
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"
    assert w.llm.calls == [] and w.api.inflight.held("acme") == 0
    assert w.api.metrics.requests.labels("acme", "chat", "408")._value.get() == 1


def test_a_client_that_leaves_while_sending_its_body_is_a_quiet_499(caplog):
    """It was a 500 with an ERROR traceback in the log for every aborted upload."""
    w = World()
    body = json.dumps(chat()).encode()

    async def scenario():
        parts = [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
        sent = []

        async def receive():
            return parts.pop(0)

        async def send(message):
            sent.append(message)

        scope = chat_scope(body)
        await w.app(scope, receive, send)
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert w.llm.calls == [] and w.api.inflight.held("acme") == 0
    assert w.api.metrics.requests.labels("acme", "chat", "499")._value.get() == 1


def test_the_event_records_stop_and_seed():
    w = World()
    w.post("/v1/chat/completions", chat(stop=["\n", "END"], seed=7))
    w.post("/v1/chat/completions", chat())
    first, second = (e.metadata["sampling"] for e in w.events.logged)
    assert first["stop"] == ["\n", "END"] and first["seed"] == 7
    assert "stop" not in second and "seed" not in second


def test_each_choices_event_records_the_seed_vllm_drew_it_with():
    """vLLM seeds the n samples of a request seed, seed + 1, ...; and -1 is its "unseeded". The events said
    seed for every choice, and -1."""
    w = World()
    w.post("/v1/chat/completions", chat(n=3, seed=7))
    w.post("/v1/chat/completions", chat(n=2, seed=7, temperature=0))  # greedy: one run, its answer n times
    w.post("/v1/chat/completions", chat(seed=-1))
    seeds = [e.metadata["sampling"].get("seed") for e in w.events.logged]
    assert seeds == [7, 8, 9, 7, 7, None]


@pytest.mark.parametrize("score", [False, True, "0.5", "1"])
def test_feedback_whose_score_is_not_a_number_is_refused_not_coerced(score):
    """`false` was taken as 0.0: a thumbs-down recorded as neutral."""
    w = World()
    r = w.post("/v1/feedback", {"id": "chatcmpl-1", "score": score})
    assert r.status_code == 400 and error(r)["param"] == "score" and w.events.logged == []
    assert World().post("/v1/feedback", {"id": "chatcmpl-1", "score": -1}).status_code == 202  # an int is a number


@pytest.mark.parametrize("extra, param", [
    ({"temperature": True}, "temperature"), ({"top_p": "0.5"}, "top_p"), ({"n": True}, "n"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"), ({"logit_bias": {"5": True}}, "logit_bias"),
])
def test_sampling_values_of_the_wrong_type_are_refused_and_name_their_field(extra, param):
    r = World().post("/v1/chat/completions", chat(**extra))
    assert r.status_code == 400 and error(r)["param"] == param, r.text


def test_feedback_is_limited_per_tenant_by_rate():
    from serving.api import RateLimit
    from serving.errors import RateLimited

    now = [0.0]
    limit = RateLimit(rate=2.0, burst=4, clock=lambda: now[0])
    for _ in range(4):
        limit.take("acme", "feedback")  # a burst
    with pytest.raises(RateLimited) as e:
        limit.take("acme", "feedback")
    assert e.value.headers["retry-after"] == "1"
    limit.take("globex", "feedback")  # another tenant has its own bucket
    now[0] = 0.5  # one more a half second later (2 a second)
    limit.take("acme", "feedback")

    w = World(max_feedback_per_second=1.0)  # bursts of 2
    codes = [w.post("/v1/feedback", {"id": f"chatcmpl-{i}", "score": 1}).status_code for i in range(3)]
    assert codes == [202, 202, 429] and len(w.events.logged) == 2


def test_feedback_the_full_event_log_cannot_take_is_503_so_the_client_sends_it_again():
    w = World()
    w.events.full = True  # Kafka slow and the spool failing: twice queue_bytes in memory already
    r = w.post("/v1/feedback", {"id": "chatcmpl-1", "score": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "event_log_full"
    assert r.headers["retry-after"] == "5" and w.events.logged == []
    w.events.full = False
    assert w.post("/v1/feedback", {"id": "chatcmpl-1", "score": 1}).status_code == 202 and len(w.events.logged) == 1


def test_health_is_503_engine_dead_once_the_engine_died():
    w = World()
    r = w.get("/health", tenant=None)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    w.llm.errored = True
    r = w.get("/health", tenant=None)
    assert r.status_code == 503 and r.json()["status"] == "engine_dead" and r.json()["pid"] == os.getpid()


def test_with_an_admin_key_health_details_and_metrics_need_it():
    w = World(admin_key="admin-key-123")
    anonymous = w.get("/health", tenant=None)
    assert anonymous.status_code == 200 and set(anonymous.json()) == {"status", "pid"}  # enough for a supervisor
    tenant = w.get("/health")  # a tenant's key is not the admin key: no other tenant's name or version
    assert set(tenant.json()) == {"status", "pid"}
    assert w.get("/metrics").status_code == 401

    async def as_admin(_):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=w.app), base_url="http://clora",
                                     headers={"Authorization": "Bearer admin-key-123"}) as admin:
            return await admin.get("/health"), await admin.get("/metrics")

    health, metrics = w.run(as_admin)
    assert set(health.json()["adapters"]) == set(KEYS) and metrics.status_code == 200
    assert "clora_serving" in metrics.text

    open_ = World()  # no admin key: a local deployment, as before
    assert "adapters" in open_.get("/health", tenant=None).json()
    assert open_.get("/metrics", tenant=None).status_code == 200


# ---------------------------------------------------------------------------------------------------------
# D. Bodies that are JSON but not text


def post_raw(w: World, path: str, body: bytes):
    """Posts `body` as is (httpx's `json=` cannot encode a lone surrogate)."""
    return w.post(path, None, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", chat(stop=["ok", "\udc00"]), "stop"),
    ("/v1/chat/completions", chat(stream=True, stop="\ud800"), "stop"),
    ("/v1/chat/completions", chat(metadata={"tag": "a\udc00b"}), "metadata"),
    ("/v1/chat/completions", chat(stream=True, metadata={"tag": "\udfff"}), "metadata"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi \ud83d"}]), "messages"),
    ("/v1/completions", {"model": "acme", "prompt": "x\udc00"}, "prompt"),
    ("/v1/completions", {"model": "acme", "prompt": ["fine", "\udc00"]}, "prompt"),
    ("/v1/feedback", {"id": "chatcmpl-\udc00", "score": 1}, "id"),
    ("/v1/feedback", {"id": "chatcmpl-1", "score": 1, "source": "\udc00"}, "source"),
], ids=["stop", "stop-stream", "metadata", "metadata-stream", "message", "prompt", "prompt-batch", "feedback-id",
        "feedback-source"])
def test_an_unpaired_surrogate_is_refused_before_any_work(path, body, param):
    """JSON can escape half of a UTF-16 pair ("\\udc00"); Python's parser takes it, but the string is not text:
    vLLM, the tokenizer and the event's encoding fail on it deep inside, after the engine holds the request."""
    w = World()
    raw = json.dumps(body).encode()  # ASCII, with "\\udc00" escapes
    assert b"\\ud" in raw
    r = post_raw(w, path, raw)
    assert r.status_code == 400, r.text
    e = error(r)
    assert e["param"] == param and "surrogate" in e["message"], e
    assert w.llm.calls == [] and w.llm.tokenizer.threads == [] and w.events.logged == []
    assert w.api.inflight.held("acme") == 0


def test_surrogates_anywhere_are_refused_and_a_whole_pair_is_text():
    w = World()
    for path, raw, param in (
        ("/v1/chat/completions", b'{"\\udc00": 1, "model": "acme", "messages": [{"role": "user", "content": "hi"}]}',
         None),  # a key: no field to name
        ("/v1/chat/completions", b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "x": {"\\ud800": 1}}',
         "x"),  # in a field clora ignores: the body is still not text
        ("/v1/completions", '{"model": "acme", "prompt": "\udc00"}'.encode("utf-8", "surrogatepass"),
         "prompt"),  # as bytes (not valid UTF-8, which Python's parser takes too)
    ):
        r = post_raw(w, path, raw)
        assert r.status_code == 400 and error(r)["param"] == param, (raw, r.text)
    r = post_raw(w, "/v1/chat/completions", json.dumps(chat(stop="\ud83d\ude00", metadata={"e": "\ud83d\ude00"})).encode())
    assert r.status_code == 200, r.text  # an escaped pair is one character (U+1F600)
    assert w.llm.calls[0].params.stop == ["\U0001F600"] and w.events.logged[0].metadata["e"] == "\U0001F600"


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"model": "acme", "prompt": ' + b"[" * 100_000,
                                 b'{"model": "acme", "prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_a_body_nested_too_deeply_is_a_400(raw):
    w = World()
    for path in ("/v1/completions", "/v1/feedback"):
        r = post_raw(w, path, raw)
        assert r.status_code == 400 and "nested too deeply" in error(r)["message"], r.text
    assert w.llm.calls == []


# ---------------------------------------------------------------------------------------------------------
# E. The server's own failures


def test_a_500_carries_its_request_id_and_the_error_shape(caplog):
    """Starlette runs the catch-all handler outside every middleware, so the id is set there too."""
    w = World()

    def broken(tenant):
        raise RuntimeError("the registry is gone")

    w.api.registry.unsettled = broken

    async def scenario(_):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=w.app, raise_app_exceptions=False),
                                     base_url="http://clora", headers={"Authorization": f"Bearer {KEYS['acme']}"}) as c:
            return await c.get("/v1/models"), await c.get("/v1/models")

    first, second = w.run(scenario)
    for r in (first, second):
        assert r.status_code == 500 and error(r) == {"message": "internal error: RuntimeError", "type": "server_error",
                                                     "param": None, "code": None}
        assert len(r.headers.get("x-request-id", "")) == 32, r.headers
    assert first.headers["x-request-id"] != second.headers["x-request-id"]
    logged = [r.getMessage() for r in caplog.records if r.name == "serving.api"]
    assert logged == [f"request {r.headers['x-request-id']} to /v1/models failed" for r in (first, second)]
    metrics = w.api.metrics.render().decode()
    assert 'clora_serving_requests_total{endpoint="models",status="500",tenant="acme"} 2.0' in metrics, metrics


def test_an_answer_with_logprobs_is_built_while_the_server_goes_on_answering(monkeypatch):
    """A non-streamed answer with log-probs runs to tens of MiB and took seconds to build on the event loop,
    which every other request waited out. Here the builder holds until another request has been answered:
    built on the loop, it would wait in vain (that request could not run) and see it unanswered."""
    import threading

    w = World()
    answered = threading.Event()
    seen = []
    from serving import protocol

    real = protocol.chat_response

    building = threading.Event()

    def slow_build(*args, **kwargs):
        building.set()
        seen.append(answered.wait(timeout=10))
        return real(*args, **kwargs)

    monkeypatch.setattr(protocol, "chat_response", slow_build)

    async def scenario(c):
        async with w.client("globex") as another:
            answer = asyncio.create_task(c.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=5)))
            while not building.is_set() and not answer.done():
                await asyncio.sleep(0.01)
            other = await another.get("/v1/models")
            answered.set()
            return await answer, other

    answer, other = w.run(scenario)
    assert other.status_code == 200 and answer.status_code == 200, answer.text
    assert seen == [True]
    assert answer.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_a_request_the_engine_fails_to_take_is_aborted_there():
    """vLLM registers a request before sending it to its engine core and never aborts one whose sending
    failed: its state stayed in the engine, one per such request."""
    w = World()
    w.llm.fail = RuntimeError("could not send the request")
    w.llm.aborted = []

    async def abort(request_id):
        w.llm.aborted.append(request_id)

    w.llm.abort = abort

    async def scenario(_):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=w.app, raise_app_exceptions=False),
                                     base_url="http://clora", headers={"Authorization": f"Bearer {KEYS['acme']}"}) as c:
            return await c.post("/v1/chat/completions", json=chat())

    r = w.run(scenario)
    assert r.status_code == 500
    assert w.llm.aborted == [call.request_id for call in w.llm.calls] and len(w.llm.aborted) == 1
    assert w.api.inflight.held("acme") == 0


# ---------------------------------------------------------------------------------------------------------
# F. Requests sent again with an Idempotency-Key


def keyed(key="k-1", **headers):
    return {"Idempotency-Key": key, **headers}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_sent_again_with_its_idempotency_key_gets_the_first_answer_and_runs_once(stream):
    w = World()
    path, body = "/v1/completions", {"model": "acme", "prompt": "hello", "n": 2, "temperature": 1, "stream": stream}
    w.llm.reply = [ord("o"), ord("k")]
    first = w.post(path, body, headers=keyed())
    w.llm.reply = [ord("n"), ord("o")]  # a second generation would answer otherwise
    again = w.post(path, body, headers=keyed())
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and ('"text":"k"' if stream else '"text":"ok"') in first.text
    assert again.headers["x-request-id"] == first.headers["x-request-id"]
    assert again.headers["x-clora-adapter-version"] == first.headers["x-clora-adapter-version"]
    assert again.headers["content-type"] == first.headers["content-type"]
    for answer in (first, again):  # a stream is neither cached nor buffered by a proxy (nginx's default)
        assert (answer.headers.get("cache-control"), answer.headers.get("x-accel-buffering")) == (
            ("no-cache", "no") if stream else (None, None))
    assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    assert len(w.llm.calls) == 1, "generated once"
    assert [e.id for e in w.events.logged] == [f"{first.headers['x-request-id']}-{i}" for i in (0, 1)], "logged once"
    metrics = w.get("/metrics").text
    assert 'clora_serving_idempotent_replays_total{endpoint="completions",tenant="acme"} 1.0' in metrics
    assert 'clora_serving_requests_total{endpoint="completions",status="200",tenant="acme"} 2.0' in metrics
    assert 'clora_serving_idempotency_keys{state="kept"} 1.0' in metrics
    assert 'clora_serving_idempotency_keys{state="running"} 0.0' in metrics
    assert f"clora_serving_idempotency_kept_bytes {float(w.api.keys.kept_bytes)}" in metrics
    assert w.api.keys.kept_bytes > len(first.content)
    # another key, no key, or another tenant's same key: each runs
    w.post(path, body, headers=keyed("k-2"))
    w.post(path, body)
    w.post(path, {**body, "model": BASE}, tenant="globex", headers=keyed())
    assert len(w.llm.calls) == 4


def test_an_idempotency_key_sent_with_another_request_is_a_422_and_a_bad_key_a_400():
    w = World()
    assert w.post("/v1/chat/completions", chat(), headers=keyed()).status_code == 200
    for path, body in (("/v1/chat/completions", chat(temperature=0.5)), ("/v1/completions", {"model": "acme", "prompt": "hi"})):
        r = w.post(path, body, headers=keyed())
        assert r.status_code == 422, r.text
        assert error(r)["code"] == "idempotency_key_reused" and error(r)["param"] == "Idempotency-Key"
    for bad in ("", "x" * 256, "a key", "ключ"):
        r = w.post("/v1/chat/completions", chat(), headers={"Idempotency-Key": bad} if bad.isascii() else
                   [("Idempotency-Key", bad.encode())])
        assert r.status_code == 400 and error(r)["param"] == "Idempotency-Key", bad
    assert len(w.llm.calls) == 1
    # a malformed body is its own 400 first, key or not
    r = w.post("/v1/chat/completions", {"model": "acme"}, headers=keyed("k-new"))
    assert r.status_code == 400 and error(r)["param"] == "messages"


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "too-large-to-keep"])
def test_a_request_sent_again_while_its_first_runs_waits_for_that_answer(kept):
    """Even an answer too large to keep for later tries goes to the tries that waited for it."""
    w = World() if kept else World(idempotency_max_bytes=10)
    w.llm.gate = asyncio.Event()

    async def scenario(c):
        first = asyncio.create_task(c.post("/v1/chat/completions", json=chat(), headers=keyed()))
        while not w.llm.calls:
            await asyncio.sleep(0.01)
        again = asyncio.create_task(c.post("/v1/chat/completions", json=chat(), headers=keyed()))
        other = await c.post("/v1/chat/completions", json=chat(stream=True), headers=keyed())  # another body
        await asyncio.sleep(0.05)
        assert not again.done()
        w.llm.gate.set()
        first, again = await first, await again
        return first, again, other, await c.post("/v1/chat/completions", json=chat(), headers=keyed())

    first, again, other, later = w.run(scenario)
    assert first.status_code == again.status_code == 200 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert len(w.events.logged) == 1 + (not kept) and len(w.llm.calls) == 1 + (not kept)
    assert ("idempotent-replayed" in later.headers) == kept  # not kept: the later try ran


def test_a_key_in_use_lets_a_few_tries_wait_and_answers_more_a_409():
    """A waiting try holds its body and takes no in-flight slot: one tenant's tries of one key kept any number
    of bodies in memory (300 stayed open while requests without a key got 429)."""
    from serving.idempotency import MAX_WAITING

    w = World()
    w.llm.gate = asyncio.Event()

    async def scenario(c):
        def post():
            return c.post("/v1/chat/completions", json=chat(), headers=keyed())

        first = asyncio.create_task(post())
        while not w.llm.calls:
            await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(post()) for _ in range(MAX_WAITING)]
        while w.api.keys._running[("acme", "k-1")].waiting < MAX_WAITING:
            await asyncio.sleep(0.01)
        over = await asyncio.wait_for(post(), 2)  # answered at once, not after the first
        w.llm.gate.set()
        return await first, await asyncio.gather(*waiting), over

    first, waited, over = w.run(scenario)
    assert over.status_code == 409 and over.headers["retry-after"] == "1"
    assert error(over)["code"] == "idempotency_key_in_use" and error(over)["param"] == "Idempotency-Key"
    assert [r.status_code for r in waited] == [200] * MAX_WAITING and all(r.content == first.content for r in waited)
    assert len(w.llm.calls) == 1 and w.api.keys._running == {}
    assert w.api.metrics.requests.labels("acme", "chat", "409")._value.get() == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_request_that_failed_or_was_refused_leaves_its_key_free(stream):
    w = World(max_inflight_per_tenant=1)
    body = chat(stream=stream)
    w.llm.finish_reason = "error"  # the engine fails the generation: nothing logged
    failed = w.post("/v1/chat/completions", body, headers=keyed())
    assert failed.status_code == 500 if not stream else "generation_failed" in failed.text
    w.llm.finish_reason = None
    over = w.post("/v1/chat/completions", chat(n=2, temperature=1, stream=stream), headers=keyed("k-n2"))
    assert over.status_code == 400  # n=2 never fits a limit of 1
    ran = w.post("/v1/chat/completions", body, headers=keyed())
    assert ran.status_code == 200 and "idempotent-replayed" not in ran.headers
    assert w.post("/v1/chat/completions", chat(stream=stream), headers=keyed("k-n2")).status_code == 200
    assert len(w.llm.calls) == 3 and len(w.events.logged) == 2


def test_a_first_request_whose_client_left_leaves_its_key_free():
    w = World()
    w.llm.gate = asyncio.Event()
    body = json.dumps(chat()).encode()

    async def scenario():
        await leave_once_generating(w, body, headers=[(b"idempotency-key", b"k-1")])
        w.llm.gate.set()
        async with w.client() as c:
            return await c.post("/v1/chat/completions", content=body, headers=keyed())

    again = asyncio.run(scenario())
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers
    assert len(w.llm.calls) == 2 and len(w.events.logged) == 1


def test_kept_answers_expire_and_stay_within_their_bytes():
    from serving.idempotency import Answer, Keys

    now = [0.0]
    keys = Keys(ttl_s=10.0, max_bytes=3000, clock=lambda: now[0])

    async def claim(key, body=b"{}"):
        async def never(_):
            raise AssertionError("nothing is running")
        return await keys.claim("acme", key, body, never)

    async def scenario():
        first = await claim("a")
        first.keep({}, [b"x" * 1000], stream=False)
        assert isinstance(await claim("a"), Answer)
        now[0] = 5.0
        (await claim("b")).keep({}, [b"y" * 1000], stream=False)
        (await claim("c")).keep({}, [b"z" * 1000], stream=False)  # over 3000: "a" leaves
        assert not isinstance(await claim("a"), Answer) and isinstance(await claim("b"), Answer)
        big = await claim("d")
        big.keep({}, [b"w" * 5000], stream=False)  # larger than all: not kept
        assert not isinstance(await claim("d"), Answer)
        now[0] = 15.5  # "b" and "c" were kept at 5.0: gone
        assert not isinstance(await claim("b"), Answer) and not isinstance(await claim("c"), Answer)
        return keys.kept_bytes

    assert asyncio.run(scenario()) == 0


def test_one_tenants_flood_of_answers_pushes_out_its_own_not_another_tenants():
    """The bytes for kept answers are shared, and the oldest answer used to leave whoever kept it: a tenant
    sending large answers under fresh keys pushed out every other tenant's, whose retries then ran again."""
    from serving.idempotency import Answer, Keys

    keys = Keys(ttl_s=3600.0, max_bytes=10_000)

    async def claim(tenant, key):
        async def never(_):
            raise AssertionError("nothing is running")
        return await keys.claim(tenant, key, b"{}", never)

    async def scenario():
        (await claim("acme", "a")).keep({}, [b"x" * 1000], stream=False)
        for i in range(9):
            (await claim("globex", f"g{i}")).keep({}, [b"y" * 2500], stream=False)
            assert keys.kept_bytes <= 10_000
        kept = [isinstance(await claim("globex", f"g{i}"), Answer) for i in range(9)]
        return isinstance(await claim("acme", "a"), Answer), kept

    acme_kept, globex_kept = asyncio.run(scenario())
    assert acme_kept
    assert globex_kept == [False] * 6 + [True] * 3  # its newest three (7,500 bytes) beside acme's 1,000

    async def one_large_answer():
        """globex keeps more bytes than acme once its answer is in: acme's leave, not the answer just kept."""
        for i in range(6):
            (await claim("acme", f"small{i}")).keep({}, [b"x" * 1000], stream=False)
        (await claim("globex", "large")).keep({}, [b"y" * 6500], stream=False)
        return isinstance(await claim("globex", "large"), Answer), keys.kept_bytes

    keys = Keys(ttl_s=3600.0, max_bytes=10_000)
    assert asyncio.run(one_large_answer())[0]


@pytest.mark.parametrize("fails_at", ["http.response.start", "http.response.body"])
def test_a_stream_whose_sending_fails_gives_back_its_key_and_slots_at_once(fails_at):
    """Starlette leaves a response's generator suspended when sending fails; the stream's `finally`, which
    gives back the tenant's slots and the Idempotency-Key, must run when the response ends, not when the
    garbage collector gets to it (never, while a traceback holds the generator): a retry with the key would
    wait for it."""
    import gc

    w = World()
    w.llm.reply = [1, 2, 3, 4, 5, 6]
    body = json.dumps(chat(stream=True, max_tokens=6)).encode()

    async def scenario():
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])
        gone = asyncio.Event()

        async def receive():
            with contextlib.suppress(StopIteration):
                return next(messages)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == fails_at and (fails_at == "http.response.start" or message.get("body")):
                gone.set()
                raise OSError("connection reset by peer")

        scope = chat_scope(body)
        scope["headers"] = [*scope["headers"], (b"idempotency-key", b"k-1")]
        with contextlib.suppress(OSError):
            await asyncio.wait_for(w.app(scope, receive, send), 5)
        return dict(w.api.keys._running), w.api.inflight.held("acme")

    gc.disable()
    try:
        running, held = asyncio.run(scenario())
    finally:
        gc.enable()
    assert running == {} and held == 0


def test_a_stream_whose_client_leaves_right_after_done_while_its_events_are_logged_keeps_its_key(monkeypatch):
    """The openai SDK closes a stream's connection as soon as it reads [DONE]; Starlette then cancels the body,
    and a large answer's events are logged on a thread the stream awaits after [DONE]. The key was settled
    after that await, so the cancellation skipped it: the key stayed "running" for the process's life and
    every retry with it waited for an answer that never came."""
    import serving.api as api

    monkeypatch.setattr(api, "LOG_IN_THREAD_TOKENS", 0)  # this small answer is logged on a thread, as large ones are
    w = World()
    log = w.events.log

    def slow_log(event):  # encoding a large event takes a while
        time.sleep(0.2)
        return log(event)

    w.events.log = slow_log
    body = json.dumps(chat(stream=True)).encode()

    async def scenario():
        read, left = [], asyncio.Event()

        async def receive():
            if not read:
                read.append(body)
                return {"type": "http.request", "body": body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and b"[DONE]" in message.get("body", b""):
                left.set()

        scope = chat_scope(body)
        scope["headers"] = [*scope["headers"], (b"idempotency-key", b"k-1")]
        await asyncio.wait_for(w.app(scope, receive, send), 30)
        await asyncio.sleep(0.4)  # the thread logs on
        async with w.client() as c:  # a retry waited for good: bounded here
            return await asyncio.wait_for(c.post("/v1/chat/completions", content=body, headers=keyed()), 30)

    again = asyncio.run(scenario())
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert len(w.llm.calls) == 1 and len(w.events.logged) == 1 and w.api.inflight.held("acme") == 0


def test_the_openai_sdks_own_retries_carry_one_key_and_a_lost_answer_is_given_again():
    """The README's recipe: with `_idempotency_header` set, the openai SDK sends one key on every try of a
    call; an answer lost on the way back (the connection reset after serving finished) is sent again."""
    import openai

    w = World()

    class LosesTheFirstAnswer(httpx.AsyncBaseTransport):
        def __init__(self):
            self.inner, self.keys = httpx.ASGITransport(app=w.app), []

        async def handle_async_request(self, request):
            self.keys.append(request.headers.get("idempotency-key"))
            response = await self.inner.handle_async_request(request)
            if len(self.keys) == 1:
                await response.aread()
                raise httpx.ReadError("connection reset by peer", request=request)
            return response

    async def scenario():
        transport = LosesTheFirstAnswer()
        async with httpx.AsyncClient(transport=transport) as http:
            client = openai.AsyncOpenAI(api_key=KEYS["acme"], base_url="http://clora/v1", http_client=http,
                                        max_retries=2)
            client._idempotency_header = "Idempotency-Key"
            raw = await client.chat.completions.with_raw_response.create(model="acme", messages=MESSAGES)
            return transport.keys, raw

    keys, raw = asyncio.run(scenario())
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0]
    assert raw.headers["idempotent-replayed"] == "true" and raw.parse().id == w.events.logged[0].id
    assert len(w.llm.calls) == 1 and len(w.events.logged) == 1


def test_metrics_are_rendered_off_the_event_loop():
    """A scrape renders every tenant's series (megabytes at 1,000 tenants): on the event loop, every request
    and stream waited for it."""
    import threading

    w = World()
    real, threads = w.api.metrics.render, []
    w.api.metrics.render = lambda: threads.append(threading.current_thread()) or real()
    r = w.get("/metrics")
    assert r.status_code == 200 and "clora_serving_requests_total" in r.text
    assert threads and threads[0] is not threading.main_thread()


def test_a_config_re_read_serves_an_added_tenant_and_refuses_a_removed_or_replaced_key(tmp_path, caplog):
    """Serving read its tenants once: a tenant added to the config got 401 until serving started again."""
    from clora.config import load_config
    from serving.__main__ import follow_config

    caplog.set_level("INFO", logger="serving")
    w = World()
    path = tmp_path / "clora.toml"

    def write(tenants):
        path.write_text("".join(f'[[tenants]]\nname = "{n}"\napi_key = "{k}"\n' for n, k in tenants))

    write(KEYS.items())
    cfg = load_config(path, environ={})
    counts = []  # the tenants after each change: serving's connection limit follows them
    reads = []

    def reload():
        reads.append(1)
        return load_config(path, environ={})

    async def scenario():
        stop = asyncio.Event()
        follower = asyncio.create_task(follow_config(reload, cfg, w.api, w.api.adapters, stop, every=0.02,
                                                     on_tenants=counts.append))
        write([("acme", "acme-key-2"), ("initech", "initech-key"), ("hooli", "hooli-key")])
        await eventually(lambda: w.api.adapters.tenants == ("acme", "initech", "hooli"))
        codes = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=w.app), base_url="http://clora") as c:
            for key in ("acme-key", "acme-key-2", "globex-key", "initech-key"):
                r = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "initech" if key.startswith("initech") else "acme", "messages": MESSAGES})
                codes[key] = r.status_code
        path.write_text("bogus = 1\n")
        await eventually(lambda: "config re-read failed" in caplog.text)
        failed_at = len(reads)
        await eventually(lambda: len(reads) >= failed_at + 3)  # the same error read again, not said again
        stop.set()
        await follower
        return codes

    assert w.run(lambda _: scenario()) == {"acme-key": 401, "acme-key-2": 200, "globex-key": 401, "initech-key": 200}
    assert w.api.tenants == ("acme", "initech", "hooli") and w.api.adapters.tenants == ("acme", "initech", "hooli")
    assert "config re-read: 3 tenant(s); added hooli, initech; removed globex" in caplog.text
    assert counts == [3]
    assert caplog.text.count("config re-read failed") == 1, "a bad config is logged once, not at every read"


def test_a_config_re_read_says_a_changed_admin_key_waits_for_a_restart(tmp_path, caplog):
    """The config's dump masks secrets: a rotated admin key compared equal and was never mentioned."""
    from clora.config import load_config
    from serving.__main__ import follow_config

    w = World()
    path = tmp_path / "clora.toml"
    tenants = "".join(f'[[tenants]]\nname = "{n}"\napi_key = "{k}"\n' for n, k in KEYS.items())
    path.write_text('[serving]\nadmin_key = "sk-admin-1234"\n' + tenants)
    cfg = load_config(path, environ={})

    reads = []

    def reload():
        reads.append(1)
        return load_config(path, environ={})

    async def scenario():
        stop = asyncio.Event()
        follower = asyncio.create_task(follow_config(reload, cfg, w.api, w.api.adapters, stop, every=0.02))
        await eventually(lambda: len(reads) >= 3)  # read again, unchanged: nothing said
        assert "starts again" not in caplog.text
        path.write_text('[serving]\nadmin_key = "sk-admin-5678"\n' + tenants)
        await eventually(lambda: "serving applies them when it starts again" in caplog.text)
        said_at = len(reads)
        await eventually(lambda: len(reads) >= said_at + 3)
        stop.set()
        await follower

    w.run(lambda _: scenario())
    assert caplog.text.count("serving applies them when it starts again") == 1


def test_a_rotated_key_takes_effect_while_an_adapter_refresh_is_still_running(tmp_path):
    """The new keys waited for the adapters' lock, which a refresh holds through its loads (up to minutes):
    a leaked key being rotated stayed good as long."""
    from clora.config import load_config
    from serving.__main__ import follow_config

    w = World()
    path = tmp_path / "clora.toml"

    def write(keys):
        path.write_text("".join(f'[[tenants]]\nname = "{n}"\napi_key = "{k}"\n' for n, k in keys.items()))

    write(KEYS)
    cfg = load_config(path, environ={})

    async def scenario():
        stop = asyncio.Event()
        follower = asyncio.create_task(follow_config(lambda: load_config(path, environ={}), cfg, w.api,
                                                     w.api.adapters, stop, every=0.02))
        async with w.api.adapters._refresh_lock:  # a long refresh under way
            write({**KEYS, "acme": "acme-key-rotated"})
            rotated = hashlib.sha256(b"acme-key-rotated").digest()
            await eventually(lambda: rotated in w.api.auth._by_digest)  # the follower applied the new keys
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=w.app), base_url="http://clora") as c:
                codes = [(await c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code
                         for key in ("acme-key", "acme-key-rotated")]
        stop.set()
        await follower
        return codes

    assert w.run(lambda _: scenario()) == [401, 200]


def test_a_config_read_half_written_once_changes_nothing(tmp_path):
    """An editor's rewrite read between its truncation and its write parses as a config without tenants:
    acted on, it refused every key until the next read. A change counts once two reads agree."""
    from clora.config import load_config
    from serving.__main__ import follow_config

    w = World()
    full = tmp_path / "full.toml"
    full.write_text("".join(f'[[tenants]]\nname = "{n}"\napi_key = "{k}"\n' for n, k in KEYS.items()))
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    files = [empty, full, full, full, full]
    reads = []
    applied = []
    real = w.api.set_tenants
    w.api.set_tenants = lambda names, keys: (applied.append(list(names)), real(names, keys))

    def reload():
        reads.append(1)
        return load_config(files[min(len(reads), len(files)) - 1], environ={})

    async def scenario():
        stop = asyncio.Event()
        follower = asyncio.create_task(follow_config(reload, load_config(full, environ={}), w.api, w.api.adapters,
                                                     stop, every=0.01))
        await eventually(lambda: len(reads) >= len(files) + 2)  # the empty read, then the full one again
        stop.set()
        await follower

    w.run(lambda _: scenario())
    assert applied == [], "the half-written read was acted on"
    assert w.api.tenants == tuple(KEYS) and w.api.auth.tenant(f"Bearer {KEYS['acme']}") == "acme"


def test_a_tenant_removed_by_a_config_re_read_leaves_metrics_and_the_feedback_limiter():
    """Every tenant that ever came and went kept its ~80 series on /metrics and its rate-limit bucket for the
    process's life: experiments come and go as tenants."""
    w = World()
    assert w.post("/v1/chat/completions", {**chat(), "model": "globex"}, tenant="globex").status_code == 200
    assert w.post("/v1/feedback", {"id": "x", "score": 1}, tenant="globex").status_code in (200, 202)
    assert 'tenant="globex"' in w.api.metrics.render().decode() and "globex" in w.api.feedback_rate._buckets
    w.api.set_tenants(["acme"], [("acme", KEYS["acme"])])  # as follow_config does: keys, then adapters
    w.run(lambda _: w.api.adapters.set_tenants(["acme"]))
    metrics = w.api.metrics.render().decode()
    assert 'tenant="globex"' not in metrics and 'tenant="acme"' in metrics
    assert "globex" not in w.api.feedback_rate._buckets
    # A request of globex still running at the removal ends afterwards: counted, it made the series again.
    w.api.metrics.request_done("globex", "chat", 200, 0.5, 10, 5)
    w.api.metrics.request_answered("globex", "chat", 499)
    assert 'tenant="globex"' not in w.api.metrics.render().decode()
    w.api.set_tenants(["acme", "globex"], [("acme", KEYS["acme"]), ("globex", KEYS["globex"])])  # back again
    assert w.post("/v1/chat/completions", {**chat(), "model": "globex"}, tenant="globex").status_code == 200
    assert 'clora_serving_requests_total{endpoint="chat",status="200",tenant="globex"} 1.0' in (
        w.api.metrics.render().decode())


@pytest.mark.parametrize("stream", [False, True])
def test_large_interaction_events_are_encoded_off_the_event_loop(monkeypatch, stream):
    """A finished request's events carry every token id and log-prob of every choice: their JSON took up to
    a second on the event loop at the largest requests allowed, every other stream waiting."""
    import threading

    import serving.api as api_module

    w = World()
    real, threads = w.events.log, []
    w.events.log = lambda event: threads.append(threading.current_thread()) or real(event)
    assert w.post("/v1/chat/completions", chat(stream=stream)).status_code == 200
    monkeypatch.setattr(api_module, "LOG_IN_THREAD_TOKENS", 0)  # every request's events count as large
    assert w.post("/v1/chat/completions", chat(stream=stream, n=2)).status_code == 200
    assert len(w.events.logged) == 3 and len(threads) == 3
    assert threads[0] is threading.main_thread(), "a small request's event: on the loop (no thread hop)"
    assert threads[1] is not threading.main_thread() and threads[2] is not threading.main_thread()
