"""Tool calling's pure parts (serving/tools.py): reading a model's text for calls, and a stream's hold-back."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.engine import Delta
from serving.errors import BadRequest
from serving.tools import ToolStream, read_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
AUTO = read_tools([WEATHER], None, None)


def calls_of(text, finish="stop", use=AUTO):
    content, calls, finish_reason = use.answer(text, finish)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], finish_reason


def test_hermes_calls_are_read_with_the_content_before_them():
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>\n'
    # arguments given as the JSON text of an object are kept as that text
    assert calls_of(text) == (None, [("get_weather", '{"city": "Oslo"}')], "tool_calls")
    # the text before the call is the content, whitespace too (as the stream sends it)
    assert calls_of("\n\n" + text)[0] == "\n\n"
    unclosed = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Köln"}}'
    assert calls_of(unclosed) == ("Sure.", [("get_weather", '{"city": "Köln"}')], "tool_calls")
    no_arguments = '<tool_call>{"name": "get_weather"}</tool_call>'
    assert calls_of(no_arguments) == (None, [("get_weather", "{}")], "tool_calls")
    # a call read whole before the length limit cut what followed keeps the limit's reason
    assert calls_of(text + "and more", finish="length")[2] == "length"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"t": NaN}}</tool_call>',  # no client's parser takes NaN
    '<tool_call>{"name": {"a": 1}, "arguments": {}}</tool_call>',  # a name that is no string: no call, no crash
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
])
def test_text_with_one_block_that_is_no_call_is_content_whole(text):
    assert calls_of(text) == (text, [], "stop")


def test_required_reads_the_forced_list_and_a_list_cut_short_is_content():
    required = read_tools([WEATHER], "required", None)
    assert calls_of('[{"name": "get_weather", "parameters": {"a": 1}}]', use=required) == (
        None, [("get_weather", '{"a": 1}')], "tool_calls")
    assert calls_of('[{"name": "get_weather", "param', "length", use=required) == (
        '[{"name": "get_weather", "param', [], "length")


def test_tool_use_is_none_without_tools_and_checks_what_it_is_given():
    assert read_tools(None, None, None) is None and read_tools([], "none", True) is None
    assert read_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False).name == "get_weather"
    with pytest.raises(BadRequest) as e:
        read_tools([{"type": "function", "function": {"name": "f", "parameters": "object"}}], None, None)
    assert e.value.param == "tools" and "parameters" in e.value.message


def deltas_of(pieces, finish="stop"):
    return [Delta(0, piece, [i], [], finish if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]


def streamed(pieces, use=AUTO, finish="stop"):
    stream = ToolStream(use)
    return [out for d in deltas_of(pieces, finish) for out in stream.feed(d)]


def test_a_call_split_over_deltas_is_held_from_its_possible_start():
    out = streamed(["Hi", " <", "tool", '_call>{"name": "get_weather", "arguments": {}}', "</tool_call>"])
    # deltas are held whole: " <" goes with the call, as the content before it; the finish in a chunk of its own
    assert [(d.text, calls is not None) for d, calls in out] == [("Hi", False), (" ", True), ("", False)]
    # the held deltas' tokens go with the call: every token once, in order
    assert [t for d, _ in out for t in d.token_ids] == [0, 1, 2, 3, 4]
    assert out[1][1][0]["function"]["name"] == "get_weather" and out[1][0].finish_reason is None
    assert out[2][0].finish_reason == "tool_calls"


CALL = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
FRAGMENTS = ["a", " b", "<", "<tool", "_call>", "<tool_call>", CALL, CALL, "</tool_call>", "</", "\n"]


@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=10), st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_sends_every_token_once_and_the_content_the_whole_answer_gives(fragments, cuts):
    """Whatever the text and however it is split into deltas, the stream's content is the whole answer's
    content and each token goes out exactly once, the finish reason on the last delta only."""
    text = "".join(fragments)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    out = streamed(pieces)
    content, calls, finish = AUTO.answer(text, "stop")
    assert "".join(d.text for d, _ in out) == (content or "")
    assert [t for d, _ in out for t in d.token_ids] == list(range(len(pieces)))
    assert [d.finish_reason for d, _ in out] == [None] * (len(out) - 1) + [finish]
    assert [c["function"]["name"] for _, sent in out for c in sent or ()] == [c["function"]["name"] for c in calls]


def test_a_forced_call_is_held_whole():
    named = read_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    out = streamed(['{"ci', 'ty": 1}'], use=named)
    assert [(d.text, d.finish_reason) for d, _ in out] == [("", None), ("", "stop")]
    assert json.loads(out[0][1][0]["function"]["arguments"]) == {"city": 1}


@pytest.mark.parametrize("arguments", ['{"q": "\\ud800"}', '"{\\"q\\": \\"\\\\ud800\\"}"', "[" * 5000])
def test_arguments_holding_an_escaped_lone_surrogate_or_nested_past_the_parser_are_no_call(arguments):
    """'\\ud800' in the model's JSON is plain ASCII; unescaped, the answer could not be encoded (a 500), nor
    the call rendered when a client sent it back. JSON nested past the interpreter's depth raised."""
    text = '<tool_call>{"name": "get_weather", "arguments": ' + arguments + '}</tool_call>'
    content, calls, finish = AUTO.answer(text, "stop")
    assert (content, calls, finish) == (text, [], "stop")
    content.encode("utf-8")
    assert read_tools([WEATHER], "required", None).answer("[" * 5000, "length")[1] == []


def test_required_moves_every_tools_defs_to_the_root_where_their_refs_point():
    """Nested pydantic models (the SDK's pydantic_function_tool, LangChain's bind_tools) come with $defs."""
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    nested = {"type": "object", "properties": {"inner": {"$ref": "#/$defs/Inner"}}, "$defs": {"Inner": inner}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": nested}},
             {"type": "function", "function": {"name": "b", "parameters": nested}}]
    schema = json.loads(read_tools(tools, "required", None).schema())
    assert schema["$defs"] == {"Inner": inner}
    assert all("$defs" not in option["properties"]["parameters"] for option in schema["items"]["anyOf"])
    clash = [tools[0], {"type": "function", "function": {"name": "b", "parameters": {
        **nested, "$defs": {"Inner": {"type": "string"}}}}}]
    with pytest.raises(BadRequest) as e:
        read_tools(clash, "required", None).schema()
    assert e.value.param == "tools" and "Inner" in e.value.message


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": ["get_weather"]}}, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": {"a": 1}}}, "tool_choice"),
])
def test_what_openai_refuses_in_tools_is_a_400_naming_the_field(tools, choice, param):
    with pytest.raises(BadRequest) as e:
        read_tools(tools, choice, None)
    assert e.value.param == param


def test_the_template_is_shown_openais_fields_of_a_tool_only():
    tool = {"type": "function", "extra": 1, "function": {"name": "f", "strict": True, "x-internal": "secret"}}
    assert read_tools([tool], None, None).tools == ({"type": "function", "function": {"name": "f"}},)
