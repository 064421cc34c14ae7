"""/v1/responses read into a chat request, and its answers and stream events built from the chat path's
pieces (serving/responses.py), without an engine. The same through the openai SDK on the real engine:
test_server.py."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response
from openai.types.responses import ResponseStreamEvent as StreamEvent
from pydantic import TypeAdapter

from serving import protocol
from serving.engine import Choice, Delta, TokenLogprob
from serving.errors import BadRequest, UnsupportedParameter
from serving.responses import ResponseEvents, parse, response

ResponseStreamEvent = TypeAdapter(StreamEvent)  # the openai SDK's union of Responses' stream events

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "name": "get_weather", "description": "now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields) -> bytes:
    return json.dumps({"model": "base", "input": "hi", **fields}).encode()


def test_instructions_and_input_items_become_the_chat_messages_of_one_conversation():
    body = parse(request(instructions="Be brief.", input=[
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
    ], tools=[WEATHER]))
    assert body.plain_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
        {"role": "assistant", "content": None, "tool_calls": [  # after a tool turn: a turn of its own
            {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]
    assert body.tool_use.tools == ({"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}},)
    assert parse(request(input="hello")).plain_messages() == [{"role": "user", "content": "hello"}]


def test_fields_map_onto_their_chat_fields():
    body = parse(request(max_output_tokens=7, temperature=0.5, top_p=0.9, tool_choice={"type": "function", "name": "get_weather"},
                         tools=[WEATHER], parallel_tool_calls=False, metadata={"app": "x"}, user="u", seed=3,
                         store=True, include=[], background=False, truncation="disabled", some_new_field=1))
    sampling = body.sampling()
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (7, 0.5, 0.9, 3)
    assert (body.tool_use.choice, body.tool_use.name, body.tool_use.parallel) == ("function", "get_weather", False)
    assert body.metadata == {"app": "x"} and body.n == 1
    with pytest.raises(BadRequest, match="text.format cannot be a JSON format with a tool_choice") as e:
        parse(request(tools=[WEATHER], tool_choice="required", text={"format": {"type": "json_object"}}))
    assert e.value.param == "text.format"  # the chat request's response_format, named as this request names it
    assert parse(request(text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
                 ).sampling().structured == ("json_schema", '{"type":"object"}')
    assert parse(request(text={"format": {"type": "json_object"}})).sampling().structured == ("json_object", "")
    assert parse(request(text={"format": {"type": "text"}})).sampling().structured is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"instructions": [{"role": "system", "content": "x"}]}, "instructions"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
])
def test_what_this_server_does_not_do_is_a_400_naming_the_field(fields, param):
    with pytest.raises(UnsupportedParameter) as e:
        parse(request(**fields))
    assert e.value.param == param


def test_options_that_ask_for_nothing_this_server_lacks_are_taken():
    """What stateless agent clients send every turn: encrypted reasoning to include (there is none), reasoning
    off, hosted tools' results (no hosted tools)."""
    parse(request(include=["reasoning.encrypted_content", "file_search_call.results"], reasoning={"effort": "none"},
                  top_logprobs=0, background=False))
    parse(request(reasoning={"effort": None, "summary": None}, include=None, text={"verbosity": "low"}))


def test_log_probabilities_are_asked_for_by_include_as_openai_asks_for_them():
    body = parse(request(include=["message.output_text.logprobs"], top_logprobs=3))
    assert (body.logprobs, body.top_logprobs, body.sampling().top_logprobs) == (True, 3, 3)
    body = parse(request(top_logprobs=3))  # without the include, none are returned
    assert (body.logprobs, body.sampling().top_logprobs) == (False, 0)
    for top in (21, -1, 2.5, True):
        with pytest.raises(BadRequest) as e:
            parse(request(top_logprobs=top))
        assert e.value.param == "top_logprobs"
    with pytest.raises(BadRequest) as e:
        parse(request(include="message.output_text.logprobs"))
    assert e.value.param == "include"

    # in the answer: chat's entries (token, logprob, bytes, top_logprobs) on the output text
    body = parse(request(include=["message.output_text.logprobs"], top_logprobs=1))
    tokens = [TokenLogprob(5, b"He", -0.5, ((5, b"He", -0.5),)), TokenLogprob(6, b"y", -1.5, ((7, b"l", -0.2),))]
    answer = response("resp_a", "base", [Choice(0, "Hey", [5, 6], tokens, "stop")], 2, True, answers=None, body=body)
    Response.model_validate(answer)
    (part,) = answer["output"][0]["content"]
    assert [(lp["token"], lp["logprob"], lp["bytes"]) for lp in part["logprobs"]] == [("He", -0.5, [72, 101]), ("y", -1.5, [121])]
    assert part["logprobs"][1]["top_logprobs"] == [{"token": "l", "logprob": -0.2, "bytes": [108]}]
    assert answer["top_logprobs"] == 1
    events = ResponseEvents("resp_a", "base", body)
    opening = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    streamed = events_of(events.chunk(opening) + b"".join(
        events.chunk(protocol.chat_chunk("resp_a", "base", 0, Delta(0, text, [i], [lp], None), with_logprobs=True))
        for i, (text, lp) in enumerate(zip(["He", "y"], tokens))) + events.done(2, 2))
    deltas = [e for e in streamed if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"][0]["token"] for d in deltas] == ["He", "y"]
    (done,) = [e for e in streamed if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == part["logprobs"]
    for event in streamed:
        ResponseStreamEvent.validate_python(event)

    # with a call read from the text, the message's log-probs are its text's tokens, not the call's
    tool_body = parse(request(include=["message.output_text.logprobs"], tools=[WEATHER]))
    text = 'Hi<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    spoken = [TokenLogprob(5, b"Hi", -0.1), TokenLogprob(6, b"<tool_call>", -0.2), TokenLogprob(7, text[13:].encode(), -0.3)]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    answer = response("resp_t", "base", [Choice(0, text, [5, 6, 7], spoken, "stop")], 2, True,
                      answers=[("Hi", [call], "tool_calls")], body=tool_body)
    assert [lp["token"] for lp in answer["output"][0]["content"][0]["logprobs"]] == ["Hi"]
    for shown in ("Hi", ""):  # streamed: the held tokens come with the calls; a call alone opens no message
        events = ResponseEvents("resp_t", "base", tool_body)
        chunk_with_calls = protocol.chat_chunk("resp_t", "base", 0, Delta(0, shown, [5, 6, 7], spoken, None),
                                               with_logprobs=True, tool_calls=[{"index": 0, **call}])
        got = events_of(events.chunk(opening) + events.chunk(chunk_with_calls) + events.done(2, 3))
        items = got[-1]["response"]["output"]
        if shown:
            assert [i["type"] for i in items] == ["message", "function_call"]
            assert [lp["token"] for lp in items[0]["content"][0]["logprobs"]] == ["Hi"]
        else:
            assert [i["type"] for i in items] == ["function_call"]


@pytest.mark.parametrize(("text", "param"), [("hello", "text"), ([1], "text"), ({"format": "json_object"}, "text.format"),
                                             ({"format": ["x"]}, "text.format")])
def test_a_text_or_format_that_is_no_object_is_a_400(text, param):
    with pytest.raises(BadRequest) as e:
        parse(request(text=text))
    assert e.value.param == param


@pytest.mark.parametrize("given", [[], 7, [{"role": "bot", "content": "x"}], ["text"],
                                   [{"type": "function_call", "name": "f", "arguments": "{}"}],
                                   [{"type": "function_call_output", "output": "x"}]])
def test_malformed_input_is_a_400_naming_input(given):
    with pytest.raises(BadRequest) as e:
        parse(request(input=given))
    assert e.value.param == "input"


def test_an_answer_is_a_message_item_then_a_function_call_item_per_call():
    body = parse(request(tools=[WEATHER]))
    choice = Choice(0, text="Sure.<tool_call>…", token_ids=[1, 2, 3], finish_reason="stop")
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    answer = response("resp_abc", "base", [choice], 11, False, answers=[("Sure.", [call], "tool_calls")], body=body)
    assert [item["type"] for item in answer["output"]] == ["message", "function_call"]
    assert answer["output"][0]["content"][0]["text"] == "Sure." and answer["output"][0]["id"] == "msg_abc"
    assert answer["output"][1] == {"type": "function_call", "id": "fc_call_9", "call_id": "call_9",
                                   "name": "get_weather", "arguments": '{"city":"Oslo"}', "status": "completed"}
    assert (answer["status"], answer["incomplete_details"], answer["store"]) == ("completed", None, False)
    assert answer["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                               "output_tokens": 3,
                               "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    assert (answer["tool_choice"], answer["tools"]) == ("auto", [WEATHER])  # as the request gave them
    only_calls = response("resp_abc", "base", [choice], 11, False, answers=[(None, [call], "tool_calls")], body=body)
    assert [item["type"] for item in only_calls["output"]] == ["function_call"]
    for built in (answer, only_calls):
        Response.model_validate(built)  # as the openai SDK types it, strictly
    cut = response("resp_abc", "base", [Choice(0, text="ab", finish_reason="length")], 1, False, answers=None, body=body)
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert cut["output"][0]["status"] == "incomplete"


def events_of(data: bytes) -> list[dict]:
    """SSE bytes -> each event's data, checking its `event:` line names its type."""
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == f"event: {event['type']}"
            out.append(event)
    return out


def chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def test_a_stream_of_chat_chunks_becomes_responses_typed_events_in_order():
    events = ResponseEvents("resp_x", "base", parse(request(tools=[WEATHER])))
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    data = b"".join([events.chunk(chunk({"role": "assistant", "content": ""})), events.chunk(chunk({"content": "He"})),
                     events.chunk(chunk({"content": "llo"})), events.chunk(chunk({"tool_calls": [call]})),
                     events.chunk(chunk({}, "tool_calls")), events.done(5, 4)])
    got = events_of(data)
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    assert got[6]["text"] == "Hello" and [got[9]["output_index"], got[12]["item"]["call_id"]] == [1, "call_1"]
    final = got[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["usage"]["output_tokens"] == 4 and final["status"] == "completed"
    for event in got:
        ResponseStreamEvent.validate_python(event)  # as the openai SDK types them, strictly
    again = ResponseEvents("resp_x", "base", parse(request(tools=[WEATHER])))  # text, a call, text: two messages
    data = b"".join([again.chunk(chunk({"role": "assistant", "content": ""})), again.chunk(chunk({"content": "a"})),
                     again.chunk(chunk({"tool_calls": [call]})), again.chunk(chunk({"content": "b"})), again.done(1, 3)])
    items = events_of(data)[-1]["response"]["output"]
    assert [i["type"] for i in items] == ["message", "function_call", "message"] and items[0]["id"] != items[2]["id"]


def test_a_stream_cut_at_the_length_ends_incomplete_and_an_empty_one_still_has_its_message():
    events = ResponseEvents("resp_x", "base", parse(request()))
    got = events_of(events.chunk(chunk({"role": "assistant", "content": ""})) + events.chunk(chunk({"content": "ab"}, "length"))
                    + events.done(3, 2))
    assert got[-1]["type"] == "response.incomplete" and got[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert got[-2]["item"]["status"] == "incomplete"
    empty = ResponseEvents("resp_y", "base", parse(request()))
    got = events_of(empty.chunk(chunk({"role": "assistant", "content": ""})) + empty.chunk(chunk({}, "stop")) + empty.done(3, 0))
    assert [e["type"] for e in got][2:] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.completed"]
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_failure_once_streaming_is_an_error_event_then_response_failed():
    events = ResponseEvents("resp_x", "base", parse(request()))
    opening = events.chunk(chunk({"role": "assistant", "content": ""}))
    got = events_of(opening + events.failed({"error": {"message": "stopping", "type": "server_error",
                                                       "code": "server_stopping", "param": None}}))
    assert [e["type"] for e in got[2:]] == ["error", "response.failed"]
    assert (got[2]["code"], got[2]["message"]) == ("server_stopping", "stopping")
    # the response's error code is one of Responses' own (the SDK's type has a fixed list); the event keeps clora's
    assert got[3]["response"]["status"] == "failed" and got[3]["response"]["error"]["code"] == "server_error"
    for event in got:
        ResponseStreamEvent.validate_python(event)


def test_the_body_is_checked_as_any_request_is():
    with pytest.raises(BadRequest, match="the request body must be a JSON object"):
        parse(b"[1]")
    with pytest.raises(BadRequest) as e:
        parse(request(temperature=3))
    assert e.value.param == "temperature"
    with pytest.raises(BadRequest) as e:
        parse(request(max_output_tokens=0))
    assert e.value.param == "max_output_tokens"
    assert protocol.parse(protocol.ChatRequest, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
