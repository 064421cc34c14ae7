"""The serving process end to end: real engine on the tiny model, real broker, the official openai client.

One server for the whole session (`server` in conftest.py); each test works with its own tenants so
the order of tests does not matter.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from datetime import datetime

import httpx
import openai
import pytest
import safetensors.torch

from make_adapter import publish_adapter, write_peft_adapter
from serving_process import count_events, read_events
from storage.registry import Registry

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Give me 5 digits."}]


def client(server, tenant, async_=False):
    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=server.base_url + "/v1", api_key=server.keys[tenant], max_retries=0, timeout=120)


def chat(server, tenant, model=None, **kwargs):
    kwargs = {"max_tokens": 8, "temperature": 0, **kwargs}
    raw = client(server, tenant).chat.completions.with_raw_response.create(
        model=model or tenant, messages=MESSAGES, **kwargs
    )
    return raw.headers, raw.parse()


# ---------------------------------------------------------------------------------------------------------


def test_three_tenants_share_the_engine_each_with_its_own_adapter(server, tiny_model):
    for tenant, seed in (("acme", 11), ("globex", 12)):
        n = publish_adapter(server.data_dir, tenant, tiny_model, seed=seed)
        server.wait_for_version(tenant, f"{tenant}@{n}")
    expected_label = {"acme": server.health()["adapters"]["acme"], "globex": server.health()["adapters"]["globex"],
                      "initech": "base"}
    alone = {t: chat(server, t)[1].choices[0].message.content for t in expected_label}
    assert len(set(alone.values())) == 3  # each adapter changes the output

    async def one(tenant):
        raw = await client(server, tenant, async_=True).chat.completions.with_raw_response.create(
            model=tenant, messages=MESSAGES, max_tokens=8, temperature=0
        )
        return tenant, raw.headers, raw.parse()

    async def together():
        return await asyncio.gather(*[one(t) for t in expected_label for _ in range(3)])

    results = asyncio.run(together())
    for tenant, headers, completion in results:
        assert headers["x-clora-adapter-version"] == expected_label[tenant]
        assert completion.model == expected_label[tenant]
        assert headers["x-request-id"] == completion.id
        # Mixed into one batch (max_loras=2 < three adapters: some waited their turn), every row still
        # ran on its own adapter -- base-model rows included.
        assert completion.choices[0].message.content == alone[tenant], tenant

    ids = {c.id: (t, h["x-clora-adapter-version"]) for t, h, c in results}
    events = read_events(server.bootstrap, "clora.interactions", set(ids))
    assert set(events) == set(ids)
    for event_id, event in events.items():
        tenant, label = ids[event_id]
        assert event["tenant"] == tenant
        assert event.get("adapter_version") == (None if label == "base" else label)
        assert event["messages"] == MESSAGES and event["prompt"].startswith("<|im_start|>user")
        assert len(event["completion_token_ids"]) == len(event["completion_logprobs"]) > 0
        assert all(lp <= 0 for lp in event["completion_logprobs"])
        assert event["metadata"]["usage"]["completion_tokens"] == len(event["completion_token_ids"])


def test_models_logprobs_completions_and_feedback(server):
    models = [m.id for m in client(server, "initech").models.list()]
    assert models[:2] == ["base", "initech"]

    headers, completion = chat(server, "initech", logprobs=True, top_logprobs=2)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)

    text = client(server, "initech").completions.create(model="base", prompt="1 2 3", max_tokens=5, logprobs=1,
                                                         extra_body={"metadata": {"source": "rollout", "endpoint": "x"}})
    assert text.choices[0].finish_reason in ("stop", "length") and len(text.choices[0].logprobs.tokens) <= 5
    # the caller's metadata travels with the interaction event; clora's own keys win over the caller's
    [logged] = read_events(server.bootstrap, "clora.interactions", {text.id}).values()
    assert logged["metadata"]["source"] == "rollout" and logged["metadata"]["endpoint"] == "completions"

    response = httpx.post(server.base_url + "/v1/feedback", json={"id": completion.id, "score": 0.75},
                          headers={"Authorization": f"Bearer {server.keys['initech']}"})
    assert response.status_code == 202 and response.headers["x-request-id"]
    [event] = read_events(server.bootstrap, "clora.feedback", {completion.id}).values()
    assert (event["tenant"], event["score"], event["source"]) == ("initech", 0.75, "http")

    metrics = urllib.request.urlopen(server.base_url + "/metrics").read().decode()
    assert 'clora_serving_requests_total{endpoint="chat",status="200",tenant="initech"}' in metrics


def test_the_cpu_engines_zero_adapter_lives_in_the_process_own_stage_folder(server):
    """It was a temporary folder of its own, deleted only at a normal stop: each SIGKILL left one in /tmp. In
    the stage folder, the next start on this host removes a gone process's."""
    import socket

    (stage,) = (server.data_dir / "state" / "serving-adapters").glob(f"{socket.gethostname()}-{server.process.pid}.*")
    assert (stage / "_zero" / "adapter_model.safetensors").is_file()


def test_a_request_sent_again_with_its_idempotency_key_is_answered_from_the_first(server):
    """What a client retrying after a lost answer gets: the first answer again, one generation, one event."""
    key = {"Idempotency-Key": f"retry-{time.time_ns()}"}
    first = client(server, "initech").completions.with_raw_response.create(
        model="base", prompt="1 2 3", max_tokens=8, temperature=1.0, n=2, extra_headers=key)
    again = client(server, "initech").completions.with_raw_response.create(
        model="base", prompt="1 2 3", max_tokens=8, temperature=1.0, n=2, extra_headers=key)
    assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    assert again.parse().model_dump() == first.parse().model_dump()
    refused = httpx.post(server.base_url + "/v1/completions", headers={**key, "Authorization": f"Bearer {server.keys['initech']}"},
                         json={"model": "base", "prompt": "4 5 6", "max_tokens": 8})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "idempotency_key_reused"
    after = client(server, "initech").completions.create(model="base", prompt="after", max_tokens=2)
    ids = {f"{first.parse().id}-{i}" for i in (0, 1)}
    assert count_events(server.bootstrap, "clora.interactions", ids, until=after.id) == dict.fromkeys(ids, 1)


def test_refusals_use_the_openai_error_shape(server):
    anonymous = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anonymous.chat.completions.create(model="acme", messages=MESSAGES)
    assert e.value.body["type"] == "invalid_request_error"
    no_key = httpx.post(server.base_url + "/v1/chat/completions", json={"model": "base", "messages": MESSAGES})
    assert no_key.status_code == 401 and set(no_key.json()["error"]) == {"message", "type", "param", "code"}
    assert no_key.headers["x-request-id"]

    for model in ("initech@999", "nobody", "acme"):  # another tenant's too, as one no tenant has
        with pytest.raises(openai.NotFoundError) as e:
            chat(server, "initech", model=model)
        assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client(server, "initech").chat.completions.create(model="base", messages=[])
    assert "messages" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client(server, "initech").chat.completions.create(
            model="base", messages=MESSAGES, extra_body={"metadata": {f"k{i}": "v" for i in range(17)}})
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client(server, "initech").chat.completions.create(
            model="base", messages=MESSAGES, extra_body={"metadata": {"source": 3}})
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens") as e:
        client(server, "initech").completions.create(model="base", prompt="word " * 400)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "prompt")
    for extra in ({"stop": [""]}, {"seed": 2**64}):  # vLLM itself refuses these
        for stream in (False, True):
            r = httpx.post(server.base_url + "/v1/chat/completions", headers={"Authorization": "Bearer " + server.keys["initech"]},
                           json={"model": "base", "messages": MESSAGES, "max_tokens": 2, "stream": stream, **extra})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (extra, r.text)


def test_openai_fields_reach_the_real_engine(server):
    """What the fake engine of test_api.py cannot show: vLLM takes every field clora maps onto it."""
    c = client(server, "initech")
    token = 100
    biased = c.completions.create(model="base", prompt="1 2 3", max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100})
    [event] = read_events(server.bootstrap, "clora.interactions", {biased.id}).values()
    assert event["completion_token_ids"] == [token] * 4 and event["metadata"]["sampling"]["logit_bias"] == {"100": 100.0}
    penalised = c.chat.completions.create(
        model="base", messages=MESSAGES, max_tokens=4, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "temperature": None})
    assert penalised.choices[0].finish_reason in ("stop", "length")

    batch = c.completions.create(model="base", prompt=["1 2", "3 4 5"], max_tokens=3, n=2, temperature=1.0)
    assert sorted(ch.index for ch in batch.choices) == [0, 1, 2, 3]
    ids = {f"{batch.id}-{k}" for k in range(4)}
    events = read_events(server.bootstrap, "clora.interactions", ids)
    assert [events[f"{batch.id}-{k}"]["prompt"] for k in range(4)] == ["1 2", "1 2", "3 4 5", "3 4 5"]

    # Greedy with n > 1: one engine request, every choice its answer, streamed or not; the new sampling fields
    # reach vLLM; logprob bytes joined are the text's bytes (the tiny tokenizer splits every non-ASCII character).
    greedy = c.chat.completions.create(model="base", messages=MESSAGES, max_tokens=6, temperature=0, n=3,
                                       logprobs=True, extra_body={"min_tokens": 2, "stop_token_ids": [5]})
    assert [ch.index for ch in greedy.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in greedy.choices}) == 1 and greedy.usage.completion_tokens % 3 == 0
    for ch in greedy.choices:
        assert b"".join(bytes(t.bytes) for t in ch.logprobs.content) == ch.message.content.encode()
    streamed = {}
    for chunk in c.chat.completions.create(model="base", messages=MESSAGES, max_tokens=6, temperature=0, n=2, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert streamed == {0: greedy.choices[0].message.content, 1: greedy.choices[0].message.content}
    text = c.completions.create(model="base", prompt="caf\u00e9 \u65e5\u672c", max_tokens=4, temperature=0, logprobs=3)
    lp = text.choices[0].logprobs
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and all(0 <= o <= len(text.choices[0].text) for o in lp.text_offset)

    assert c.models.retrieve("base").id == "base" and c.models.retrieve("initech").id == "initech"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("acme")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="base", messages=MESSAGES, max_tokens=2,
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                  tool_choice={"type": "function", "function": {"name": "g"}})
    assert e.value.body["param"] == "tool_choice"
    lost = httpx.get(server.base_url + "/v1/nope")
    assert lost.status_code == 404 and set(lost.json()["error"]) == {"message", "type", "param", "code"}


def test_a_json_schema_response_format_gives_json_of_that_schema_from_the_real_engine(server):
    """The engine's structured outputs (xgrammar on CPU too): the tiny model's text is noise, yet what comes
    back parses, and holds what the schema requires, through the OpenAI SDK as LangChain or .parse() send it."""
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema, "strict": True}}
    _, answer = chat(server, "initech", model="base", max_tokens=64, response_format=fmt)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    assert json.loads(choice.message.content)["color"] in ("red", "blue")
    _, answer = chat(server, "initech", model="base", max_tokens=64, response_format={"type": "json_object"},
                     logprobs=True)
    assert answer.choices[0].message.content.lstrip().startswith("{")  # the noise, inside a JSON object
    # JSON Schema that pydantic models give and xgrammar cannot take (a string's format with a length: HttpUrl)
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                                             "site": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 20}},
            "required": ["tags"], "additionalProperties": False}
    _, tagged = chat(server, "initech", model="base", max_tokens=64,
                     response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": tags}})
    assert tagged.choices[0].message.content.startswith("{"), tagged
    # The log-probs are taken after the grammar's mask (what logs mode trusts them for): the first token is
    # one of the few that open an object, where the random model alone gives any token ~log(1/2048) = -7.6.
    assert answer.choices[0].logprobs.content[0].logprob > -3.0, answer.choices[0].logprobs.content[0]


def test_tool_calls_forced_on_the_real_engine_come_back_through_the_sdk_and_the_template_shows_the_tools(server):
    """The tiny model's text is noise, so only a forced call can be checked whole on the real engine: a named
    tool_choice and "required" give calls whose arguments hold what the schema requires. The tools reach the
    prompt (the template lists them), and a conversation with a call and its result is answered."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {  # the test context is small
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
    _, plain = chat(server, "initech", model="base", max_tokens=2)
    _, answer = chat(server, "initech", model="base", max_tokens=64, tools=[weather],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 30  # the template listed the tool
    turns = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    c = client(server, "initech")
    required = c.chat.completions.create(model="base", messages=turns, tools=[weather], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=64, temperature=0)
    assert required.choices[0].finish_reason == "tool_calls", required.choices[0]
    [again] = required.choices[0].message.tool_calls
    assert json.loads(again.function.arguments)["city"] in ("Oslo", "Rome")
    streamed = c.chat.completions.create(model="base", messages=MESSAGES, tools=[weather], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True)
    calls = [tc for chunk in streamed for ch in chunk.choices for tc in (ch.delta.tool_calls or [])]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments)["city"] in ("Oslo", "Rome")
    # a schema the engine cannot compile is a 400 naming where it came from
    broken = {"type": "object", "properties": {"city": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="base", messages=MESSAGES, max_tokens=4, tool_choice="required",
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": broken}}])
    assert e.value.body["param"] == "tools", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="base", messages=MESSAGES, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "f", "schema": broken}})
    assert e.value.body["param"] == "response_format", e.value.body


def test_the_responses_api_is_the_chat_path_answered_in_its_form_through_the_sdk(server):
    """/v1/responses on the real engine: the same prompt and tokens as the chat request it reads as (so the
    same answer at temperature 0), Responses' output items and typed stream events as the openai SDK reads
    them (its stream helper checks their order and identities), a forced function call and the turn that
    sends its result back, and the interaction event the learner gets."""
    c = client(server, "initech")
    asked = {"model": "base", "max_output_tokens": 6, "temperature": 0}
    chat_answer = c.chat.completions.create(model="base", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, *MESSAGES])
    r = c.responses.create(instructions="Answer briefly.", input=MESSAGES[0]["content"], **asked)
    assert r.id.startswith("resp_") and r.object == "response" and r.model.startswith("base")
    [message] = r.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    assert r.output_text == chat_answer.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat_answer.usage.prompt_tokens, 6)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # 6 tokens, cut
    assert (r.instructions, r.max_output_tokens, r.store) == ("Answer briefly.", 6, False)
    with_logprobs = c.responses.create(instructions="Answer briefly.", input=MESSAGES[0]["content"],
                                       include=["message.output_text.logprobs"], top_logprobs=2, **asked)
    [part] = with_logprobs.output[0].content
    assert part.text == r.output_text and len(part.logprobs) == 6  # each token's, as chat gives them
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert bytes(b for lp in part.logprobs for b in lp.bytes).decode() == r.output_text

    events = list(c.responses.create(instructions="Answer briefly.", input=MESSAGES, stream=True, **asked))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == 6

    weather = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}
    forced = c.responses.create(model="base", input=MESSAGES, tools=[weather], temperature=0, max_output_tokens=64,
                                tool_choice={"type": "function", "name": "get_weather"})
    [call] = forced.output
    assert (call.type, call.name, forced.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments)["city"] in ("Oslo", "Rome") and call.call_id
    turns = [*MESSAGES, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    with c.responses.stream(model="base", input=turns, tools=[weather], tool_choice="required", temperature=0,
                            max_output_tokens=64, parallel_tool_calls=False) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    [again] = final.output
    assert again.type == "function_call" and json.loads(again.arguments)["city"] in ("Oslo", "Rome")
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"

    logged = read_events(server.bootstrap, "clora.interactions", {r.id, forced.id})
    assert logged[r.id]["completion"] == r.output_text and logged[r.id]["metadata"]["endpoint"] == "responses"
    assert logged[r.id]["messages"] == [{"role": "system", "content": "Answer briefly."}, *MESSAGES]
    assert logged[forced.id]["metadata"]["tools"]["called"] == ["get_weather"]

    for refused, param in [({"previous_response_id": r.id}, "previous_response_id"),
                           ({"tools": [{"type": "web_search"}]}, "tools"),
                           ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                            "input")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**{"model": "base", "input": "hi", **refused})
        assert e.value.body["param"] == param, e.value.body


def test_a_production_request_is_started_before_waiting_requests_of_a_lower_priority(server):
    """The engine's queue is ordered by `priority`: a full engine (one request of 16 choices fills the test
    server's 16 sequences) with 16 more choices of priority 5 waiting takes a priority-0 request that came
    after them as soon as the running ones end. First come first served, it would wait for all 16."""
    long = {"model": "base", "prompt": "1 2 3", "n": 16, "max_tokens": 200, "ignore_eos": True, "temperature": 1.0,
            "priority": 5}

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            def post(tenant, body):
                return http.post("/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {server.keys[tenant]}"})

            finished = {}

            async def timed(name, tenant, body):
                response = await post(tenant, body)
                assert response.status_code == 200, response.text
                finished[name] = time.monotonic()

            async with http.stream("POST", "/v1/completions", json={**long, "stream": True},
                                   headers={"Authorization": f"Bearer {server.keys['initech']}"}) as running:
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: "):  # the first token: it is decoding
                    pass
                waiting = asyncio.create_task(timed("waiting", "initech", long))
                deadline = time.monotonic() + 60
                while True:  # in the engine's queue, behind the running request: initech holds 32 sequences
                    text = (await http.get("/metrics")).text
                    if 'clora_serving_inflight_sequences{tenant="initech"} 32.0' in text:
                        break
                    assert not waiting.done() and time.monotonic() < deadline, "the waiting request never queued"
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # from its slots taken to the engine's queue: its prompt's tokens only
                urgent = asyncio.create_task(timed("urgent", "globex", {"model": "base", "prompt": "4 5", "max_tokens": 8,
                                                                        "ignore_eos": True}))
                async for _ in lines:
                    pass
                running_done = time.monotonic()
            await asyncio.gather(waiting, urgent)
            return finished, running_done

    finished, running_done = asyncio.run(run())
    assert finished["urgent"] < finished["waiting"], (finished, running_done)


def test_hot_swap_under_streaming_load(server, tiny_model):
    tenant = "umbrella"
    first = publish_adapter(server.data_dir, tenant, tiny_model, seed=21)
    server.wait_for_version(tenant, f"{tenant}@{first}")
    seen: list[tuple[str, str, str, int, str]] = []  # (label, id, text, tokens, finish)
    failures: list[BaseException] = []

    async def stream_once(c):
        async with c.chat.completions.with_streaming_response.create(
            model=tenant, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ) as response:
            label = response.headers["x-clora-adapter-version"]
            text, finish, usage, rid = "", None, None, None
            async for chunk in await response.parse():
                rid = chunk.id
                if chunk.usage:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        seen.append((label, rid, text, usage.completion_tokens, finish))

    async def load(stop_after_new: int):
        c = client(server, tenant, async_=True)
        second = None

        async def worker():
            while second is None or sum(1 for s in seen if s[0] == second) < stop_after_new:
                try:
                    await stream_once(c)
                except Exception as e:  # every failure is reported below
                    failures.append(e)
                    return

        async def publisher():
            nonlocal second
            await asyncio.sleep(1.0)  # let streams be in flight
            n = await asyncio.to_thread(publish_adapter, server.data_dir, tenant, tiny_model, seed=22)
            second = f"{tenant}@{n}"

        await asyncio.gather(publisher(), *[worker() for _ in range(4)])
        return second

    second = asyncio.run(load(stop_after_new=4))
    assert failures == []
    old, new = f"{tenant}@{first}", second
    assert {s[0] for s in seen} == {old, new}
    for _, _, text, tokens, finish in seen:  # nothing truncated: every stream ran to its end
        assert finish in ("stop", "length")
        assert finish == "stop" or tokens == 24
    # Every output is exactly what its version produces (weights never changed mid-generation).
    expected = {label: chat(server, tenant, model=label, max_tokens=24)[1].choices[0].message.content
                for label in (old, new)}
    for label, _, text, _, _ in seen:
        assert text == expected[label]
    events = read_events(server.bootstrap, "clora.interactions", {s[1] for s in seen})
    assert {e["id"]: e["adapter_version"] for e in events.values()} == {s[1]: s[0] for s in seen}
    # The swap is one cut in the order the server took the requests in, which the client cannot see: the event's
    # ts is when the request arrived (to the millisecond), and its version is picked right after, the prompts
    # rendered one at a time in that order. No request that came after one given the new version got the old.
    arrived = {label: [datetime.fromisoformat(e["ts"]) for e in events.values() if e["adapter_version"] == label]
               for label in (old, new)}
    assert max(arrived[old]) <= min(arrived[new]), arrived


def test_seeded_requests_filling_an_engine_step(server):
    """More prompt tokens at once than one engine step takes (2048), each request with its own seed: with
    chunked prefill this crashed vLLM's CPU engine core ("CPU Generator does not use offset"); the serving
    engine runs without chunked prefill on CPU."""

    async def one(c, i):
        prompt = f"{i} " + "the apple is red " * 45  # ~190 tokens each, distinct (no prefix-cache sharing)
        r = await c.completions.create(model="base", prompt=prompt, max_tokens=6, temperature=1.0, seed=i)
        return r.choices[0]

    async def together():
        c = client(server, "initech", async_=True)
        return await asyncio.gather(*[one(c, i) for i in range(16)])

    choices = asyncio.run(together())
    assert all(c.finish_reason in ("stop", "length") for c in choices)
    assert server.health()["status"] == "ok"


def test_corrupt_adapter_is_refused_and_service_continues(server, tiny_model):
    tenant = "hooli"
    good = publish_adapter(server.data_dir, tenant, tiny_model, seed=31)
    server.wait_for_version(tenant, f"{tenant}@{good}")

    def write_with_nan(directory):
        write_peft_adapter(tiny_model, directory, seed=32)
        path = directory / "adapter_model.safetensors"
        tensors = safetensors.torch.load_file(path)
        name = sorted(tensors)[0]
        tensors[name][0, 0] = float("nan")
        safetensors.torch.save_file(tensors, path)

    registry = Registry(server.data_dir)
    bad = registry.create(tenant, parent=f"{tenant}@{good}", write=write_with_nan)
    registry.publish(tenant, bad.number)
    deadline = time.monotonic() + 30
    while bad.name not in server.health()["refused_adapters"]:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.05)
    assert "non-finite" in server.health()["refused_adapters"][bad.name]
    headers, completion = chat(server, tenant)
    assert headers["x-clora-adapter-version"] == f"{tenant}@{good}"
    with pytest.raises(openai.NotFoundError):
        chat(server, tenant, model=bad.name)
    metrics = urllib.request.urlopen(server.base_url + "/metrics").read().decode()
    assert f'clora_serving_adapters_refused_total{{tenant="{tenant}"}} 1.0' in metrics
