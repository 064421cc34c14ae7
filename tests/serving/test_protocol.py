"""OpenAI request parsing at the edge and response/chunk shapes, without an engine."""

import json

import pytest

from serving import protocol
from serving.engine import Choice, Delta, TokenLogprob
from serving.errors import BadRequest, UnsupportedParameter

pytestmark = pytest.mark.unit


def test_chat_request_defaults_and_sampling():
    req = protocol.parse(protocol.ChatRequest, json.dumps(
        {"model": "acme", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
         "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "stop": "\n", "future_field": 1}).encode())
    assert req.plain_messages() == [{"role": "user", "content": "hi \nthere"}]  # joined with "\n", as vLLM does
    s = req.sampling(default_max_tokens=32)
    assert (s.max_tokens, s.top_logprobs, s.stop, s.n, s.temperature) == (7, 3, ("\n",), 1, 1.0)
    no_logprobs = protocol.parse(protocol.ChatRequest, b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    assert no_logprobs.sampling(32).top_logprobs == 0 and no_logprobs.sampling(32).max_tokens == 32
    assert no_logprobs.sampling().max_tokens is None  # the engine gives it the room the context leaves


def test_bad_bodies_list_every_problem():
    with pytest.raises(BadRequest) as e:
        protocol.parse(protocol.ChatRequest, b'{"model": "", "messages": [], "temperature": 9}')
    for field in ("model", "messages", "temperature"):
        assert field in e.value.message
    assert e.value.param == "model"  # the first one
    with pytest.raises(BadRequest, match="not JSON"):
        protocol.parse(protocol.ChatRequest, b"{nope")
    with pytest.raises(BadRequest, match="JSON object"):
        protocol.parse(protocol.ChatRequest, b"[1]")
    with pytest.raises(BadRequest, match="score"):
        protocol.parse(protocol.FeedbackRequest, b'{"id": "x", "score": 1.5}')


@pytest.mark.parametrize("extra, expected", [
    ({"stop": ""}, "stop sequences must not be empty"),
    ({"stop": ["\n", ""]}, "stop sequences must not be empty"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
])
def test_sampling_the_engine_would_refuse_is_a_bad_request(extra, expected):
    """vLLM refuses these inside the engine (a seed beyond int64 even leaks its request state there)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(BadRequest, match=expected):
        protocol.parse(protocol.ChatRequest, json.dumps(body).encode())
    ok = {**body, "temperature": 0.5, "n": 2, "seed": 2**63 - 1, "stop": ["\n"]}
    assert protocol.parse(protocol.ChatRequest, json.dumps(ok).encode()).seed == 2**63 - 1


@pytest.mark.parametrize("model, extra, field", [
    (protocol.ChatRequest, {"stream": "true"}, "stream"),
    (protocol.ChatRequest, {"stream": 1}, "stream"),
    (protocol.ChatRequest, {"logprobs": 1}, "logprobs"),
    (protocol.CompletionRequest, {"prompt": [True, False]}, "prompt"),
    (protocol.CompletionRequest, {"prompt": [[1, True]]}, "prompt"),
    (protocol.CompletionRequest, {"prompt": "x", "echo": "false"}, "echo"),
    (protocol.FeedbackRequest, {"source": ""}, "source"),
    (protocol.ChatRequest, {"ignore_eos": "yes"}, "ignore_eos"),
    (protocol.ChatRequest, {"return_token_ids": 1}, "return_token_ids"),
    (protocol.CompletionRequest, {"prompt": "x", "include_stop_str_in_output": "on"}, "include_stop_str_in_output"),
    (protocol.ChatRequest, {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    (protocol.ChatRequest, {"top_k": 2**64}, "top_k"),
    (protocol.ChatRequest, {"messages": [{"role": "user", "content": "x", "name": 7}]}, "messages"),
])
def test_values_of_the_wrong_type_are_refused_not_read_as_another(model, extra, field):
    """`true` is no token id 1 and "true" no flag, as OpenAI answers them (400)."""
    base = {protocol.ChatRequest: {"model": "m", "messages": [{"role": "user", "content": "x"}]},
            protocol.CompletionRequest: {"model": "m"}, protocol.FeedbackRequest: {"id": "r", "score": 1}}[model]
    with pytest.raises(BadRequest) as e:
        protocol.parse(model, json.dumps({**base, **extra}).encode())
    assert e.value.param == field


@pytest.mark.parametrize("role", ["bot", "User", "ASSISTANT", "model", "human"])
def test_a_role_openai_does_not_define_is_refused_naming_the_message(role):
    """Qwen3's chat template drops a message whose role it does not know: answered 200 as if it was not sent."""
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": role, "content": "x"}]}
    with pytest.raises(BadRequest) as e:
        protocol.parse(protocol.ChatRequest, json.dumps(body).encode())
    assert e.value.param == "messages.[1].role" and e.value.code == "invalid_request"
    assert e.value.message == (f"Invalid value: '{role}'. Supported values are: 'system', 'developer', 'user', "
                               "'assistant', and 'tool'.")
    for known in ("system", "developer", "user", "assistant"):
        body["messages"][1]["role"] = known
        assert protocol.parse(protocol.ChatRequest, json.dumps(body).encode()).messages[1].role == known


def test_a_messages_name_reaches_the_chat_template_not_dropped():
    """OpenAI's `name` (who speaks, in a chat of several) was dropped without a word; vLLM hands it to the
    template, which renders it where it knows it."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "yo"}]}
    assert protocol.parse(protocol.ChatRequest, json.dumps(body).encode()).plain_messages() == [
        {"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "yo"}]


def test_top_p_0_is_the_most_likely_token_as_top_k_1():
    """OpenAI takes top_p 0; vLLM refuses it, and top_k 1 keeps the same one token."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0, "top_k": 5}
    s = protocol.parse(protocol.ChatRequest, json.dumps(body).encode()).sampling()
    assert (s.top_p, s.top_k) == (1.0, 1)
    s = protocol.parse(protocol.ChatRequest, json.dumps({**body, "top_p": 0.5}).encode()).sampling()
    assert (s.top_p, s.top_k) == (0.5, 5)


def test_greedy_with_several_choices_is_taken():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0, "n": 3}
    assert protocol.parse(protocol.ChatRequest, json.dumps(body).encode()).sampling().n == 3


@pytest.mark.parametrize("prompt, expected", [
    ("text", ["text"]),
    (["only"], ["only"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6, 7]], [[5, 6, 7]]),
    (["a", "b"], ["a", "b"]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert protocol.parse(protocol.CompletionRequest, body).prompts() == expected


@pytest.mark.parametrize("head, several", [
    (b'{"model": "m", "prompt": ["a", "b"', True),  # cut inside the second prompt
    (b'{"model": "m", "prompt": [ "a \\"quoted\\", [1]" ,', True),  # quotes and brackets inside a string
    (b'{"prompt": [[1, 2], [3', True),
    (b'{"prompt": ["only"]}', False),
    (b'{"prompt": [5, 6, 7]}', False),  # one prompt as token ids
    (b'{"prompt": [[5, 6, 7]]}', False),
    (b'{"model": "m", "prompt": "text ', False),
    (b'{"model": "m", "prompt": ["a prompt past the limit on its own', False),
    (b'{"prompt": ["ends in a backslash \\\\"', False),  # the list may still end here
    (b'{"user": "\\"prompt\\": [\\"a\\", \\"b\\"]", "prompt": "x"}', False),  # "prompt" inside a string
    (b'{"model": "m", "max_tokens": 5', False),  # no prompt yet: bulk before it
])
def test_a_body_cut_short_tells_a_batch_of_prompts_from_one_prompt(head, several):
    assert protocol.lists_several_prompts(head) is several


@pytest.mark.timeout(60)
def test_telling_a_batch_from_one_prompt_reads_megabytes_at_once():
    """The start of a body past the size limit is looked at on the event loop: no character-by-character walk,
    no backtracking over a string that does not end (which would not finish within the test's timeout)."""
    assert not protocol.lists_several_prompts(b'{"prompt": ["' + b'a\\"' * 1_000_000)
    assert not protocol.lists_several_prompts(b'{"prompt": [[' + b"1, " * 1_000_000)
    assert protocol.lists_several_prompts(b'{"prompt": ["a", ' + b'"aaaaaaa", ' * 300_000)


@pytest.mark.parametrize("extra, param", [
    ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"response_format": {"type": "grammar", "grammar": "root ::= 'a'"}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_completion_fields_clora_does_not_implement(extra, param):
    with pytest.raises(BadRequest) as e:
        protocol.parse(protocol.CompletionRequest, json.dumps({"model": "m", "prompt": "a", **extra}).encode())
    assert e.value.param == param


@pytest.mark.parametrize("field, value", [
    ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]), ("guided_regex", "a+"),
    ("guided_grammar", "root ::= 'a'"), ("structured_outputs", {"json": {}}), ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]), ("prompt_logprobs", 1), ("truncate_prompt_tokens", 8), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy"}), ("web_search_options", {}), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"), ("use_beam_search", True), ("skip_special_tokens", False), ("cache_salt", "s"),
    ("request_id", "mine"), ("return_tokens_as_token_ids", True),
])
def test_fields_clora_does_not_implement_are_refused_not_dropped(field, value):
    for model, body in ((protocol.ChatRequest, {"messages": [{"role": "user", "content": "x"}]}),
                        (protocol.CompletionRequest, {"prompt": "x"})):
        with pytest.raises(UnsupportedParameter) as e:
            protocol.parse(model, json.dumps({"model": "m", **body, field: value}).encode())
        assert e.value.param == field and e.value.code == "unsupported_parameter" and "not supported" in e.value.message


@pytest.mark.parametrize("field, value", [
    ("chat_template_kwargs", {"enable_thinking": False}), ("chat_template", "{{ messages }}"),
    ("continue_final_message", True), ("add_generation_prompt", False), ("add_special_tokens", True),
    ("documents", [{"text": "x"}]), ("echo", True),
])
def test_chat_template_options_are_refused(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(UnsupportedParameter) as e:
        protocol.parse(protocol.ChatRequest, json.dumps(body).encode())
    assert e.value.param == field


def test_what_clora_does_anyway_metadata_and_unknown_fields_are_taken():
    """A refused field holding the value that asks for what clora does is no request for more; OpenAI's
    metadata fields change no answer; a field nobody defines is a newer client's, ignored as OpenAI does."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
            "continue_final_message": False, "chat_template_kwargs": {}, "add_special_tokens": False, "echo": False,
            "modalities": ["text"], "skip_special_tokens": True, "use_beam_search": False, "length_penalty": 1,
            "bad_words": [], "guided_json": None, "user": "u", "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "safety_identifier": "s", "prompt_cache_key": "k", "some_future_field": 1}
    assert protocol.parse(protocol.ChatRequest, json.dumps(chat).encode()).model == "m"
    completion = {"model": "m", "prompt": "x", "add_special_tokens": True}
    assert protocol.parse(protocol.CompletionRequest, json.dumps(completion).encode()).model == "m"
    with pytest.raises(UnsupportedParameter):  # `true` asks for more than 1, and 1 more than `true`
        protocol.parse(protocol.ChatRequest, json.dumps({**chat, "add_generation_prompt": 1}).encode())


def test_vllms_stopping_fields_reach_the_sampling():
    body = {"model": "m", "prompt": "x", "min_tokens": 3, "stop_token_ids": [7, 9], "include_stop_str_in_output": True,
            "ignore_eos": True}
    s = protocol.parse(protocol.CompletionRequest, json.dumps(body).encode()).sampling()
    assert (s.min_tokens, s.stop_token_ids, s.include_stop_str_in_output, s.ignore_eos) == (3, (7, 9), True, True)
    for bad in ({"min_tokens": -1}, {"stop_token_ids": [-1]}, {"stop_token_ids": ["7"]}):
        with pytest.raises(BadRequest) as e:
            protocol.parse(protocol.CompletionRequest, json.dumps({**body, **bad}).encode())
        assert e.value.param == next(iter(bad))


def test_a_request_may_queue_behind_others_but_never_ahead_of_production_traffic():
    body = {"model": "m", "prompt": "x"}
    assert protocol.parse(protocol.CompletionRequest, json.dumps(body).encode()).priority == 0
    for priority in (0, 1, 7, 2**31 - 1):
        assert protocol.parse(protocol.CompletionRequest, json.dumps({**body, "priority": priority}).encode()).priority == priority
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": 3}
    assert protocol.parse(protocol.ChatRequest, json.dumps(chat).encode()).priority == 3
    for bad in (-1, 2**31, 1.5, "1", True):
        with pytest.raises(BadRequest) as e:
            protocol.parse(protocol.CompletionRequest, json.dumps({**body, "priority": bad}).encode())
        assert e.value.param == "priority"


def test_null_is_the_default_but_required_fields_stay_required():
    req = protocol.parse(protocol.ChatRequest, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": None, "n": None,
         "stream": None, "logprobs": None, "top_p": None}).encode())
    assert (req.temperature, req.n, req.stream, req.logprobs, req.top_p) == (1.0, 1, False, False, 1.0)
    with pytest.raises(BadRequest) as e:
        protocol.parse(protocol.ChatRequest, b'{"model": null, "messages": [{"role": "user", "content": "x"}]}')
    assert e.value.param == "model"


def _choice():
    lps = [TokenLogprob(5, b"He", -0.5, ((5, b"He", -0.5), (9, b"Hi", -1.0)), text_offset=0),
           TokenLogprob(6, b"llo", -0.25, ((6, b"llo", -0.25),), text_offset=2)]
    c = Choice(0)
    c.add(Delta(0, "Hello", [5, 6], lps, "stop"))
    return c


def test_chat_response_shape():
    body = protocol.chat_response("chatcmpl-1", "acme@2", [_choice()], prompt_tokens=4, with_logprobs=True)
    assert body["object"] == "chat.completion" and body["model"] == "acme@2"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello"} and choice["finish_reason"] == "stop"
    first = choice["logprobs"]["content"][0]
    assert first["token"] == "He" and first["logprob"] == -0.5 and first["bytes"] == [72, 101]
    assert [t["token"] for t in first["top_logprobs"]] == ["He", "Hi"]
    assert protocol.chat_response("x", "m", [_choice()], 1, with_logprobs=False)["choices"][0]["logprobs"] is None


def test_completion_logprobs_layout():
    lp = protocol.completion_logprobs(_choice().logprobs)
    assert lp == {"tokens": ["He", "llo"], "token_logprobs": [-0.5, -0.25],
                  "top_logprobs": [{"He": -0.5, "Hi": -1.0}, {"llo": -0.25}], "text_offset": [0, 2]}


def _split_character():
    """"你" as three byte tokens, each with two alternatives that are also part of a character."""
    raws = [b"\xe4", b"\xbd", b"\xa0"]
    return [TokenLogprob(10 + i, raw, -0.1, ((10 + i, raw, -0.1), (20 + i, b"\xe5", -2.0)), text_offset=0)
            for i, raw in enumerate(raws)]


def test_tokens_that_split_a_character_keep_their_bytes():
    """OpenAI's `bytes` are the token's own (joined, the content's UTF-8), and a token that is not whole
    characters reads "bytes:\\xe4", not "" or U+FFFD (whose bytes would be [239, 191, 189])."""
    content = protocol.chat_logprobs(_split_character())["content"]
    assert [e["bytes"] for e in content] == [[0xE4], [0xBD], [0xA0]]
    assert bytes(b for e in content for b in e["bytes"]).decode() == "你"
    assert [e["token"] for e in content] == ["bytes:\\xe4", "bytes:\\xbd", "bytes:\\xa0"]
    assert content[0]["top_logprobs"][1] == {"token": "bytes:\\xe5", "logprob": -2.0, "bytes": [0xE5]}
    assert protocol.token_text("你".encode()) == "你" and protocol.token_text(b"") == ""


def test_completions_top_logprobs_keep_every_alternative():
    """Keyed by decoded text, two partial tokens were both U+FFFD and one of the k alternatives was lost."""
    top = protocol.completion_logprobs(_split_character())["top_logprobs"]
    assert top[0] == {"bytes:\\xe4": -0.1, "bytes:\\xe5": -2.0}
    same_bytes = TokenLogprob(1, b"a", -0.1, ((1, b"a", -0.1), (2, b"a", -0.2)))  # a byte spelt twice
    assert protocol.completion_logprobs([same_bytes])["top_logprobs"] == [{"a": -0.1, "token_id:2": -0.2}]


def test_completions_top_logprobs_hold_the_sampled_token_too():
    """As OpenAI's and vLLM's: `logprobs` + 1 entries when the sampled token is not among the best, so that
    `top_logprobs[i][tokens[i]]` always answers (with `logprobs: 0` it was `{}`)."""
    third = TokenLogprob(7, b"h", -3.0, ((1, b"A", -0.1), (2, b"B", -0.5)))
    logprobs = protocol.completion_logprobs([third, TokenLogprob(7, b"h", -3.0, ())])
    assert logprobs["top_logprobs"] == [{"A": -0.1, "B": -0.5, "h": -3.0}, {"h": -3.0}]
    assert all(top[token] == lp for top, token, lp in zip(logprobs["top_logprobs"], logprobs["tokens"],
                                                          logprobs["token_logprobs"]))


def test_stream_chunks_and_sse():
    d = Delta(1, "lo", [6], [], None)
    chunk = protocol.chat_chunk("c", "m", 10, d)
    assert chunk["choices"] == [{"index": 1, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None}]
    opening = protocol.chat_chunk("c", "m", 10, None, index=0, role=True)
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert protocol.chat_chunk("c", "m", 10, None)["choices"] == []
    assert protocol.sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(protocol.sse(chunk)[6:]) == chunk


def test_stream_options_clora_does_not_implement_are_refused_and_the_ones_it_takes_are_read():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with pytest.raises(UnsupportedParameter) as e:
        protocol.parse(protocol.ChatRequest, json.dumps({**base, "stream_options": {"continuous_usage_stats": True}}).encode())
    assert e.value.param == "stream_options" and "continuous_usage_stats" in str(e.value)
    for options, usage in [({"include_usage": True}, True), ({"include_usage": True, "include_obfuscation": True}, True),
                           ({"continuous_usage_stats": False}, False), ({"include_usage": None}, False)]:
        body = protocol.parse(protocol.ChatRequest, json.dumps({**base, "stream_options": options}).encode())
        assert body.include_usage is usage


def test_a_body_only_the_standard_parser_takes_is_walked_for_surrogates_only_when_it_can_hold_one(monkeypatch):
    """A NaN anywhere (msgspec refuses it, json.loads takes it) used to walk every value of the body, copying
    each one's path: a 1 MiB body nested 900 deep held the event loop for seconds. A surrogate can only come
    from an escape or from bytes that decode to one, so a body with neither is not walked at all."""
    deep = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 500 + b"NaN" + b"]" * 500 + b"}"
    walked = []
    real = protocol._lone_surrogate
    monkeypatch.setattr(protocol, "_lone_surrogate", lambda value: walked.append(1) or real(value))
    assert protocol.parse(protocol.ChatRequest, deep).model == "m"
    assert walked == []
    # One that does hold one is walked, and the path of the string is named, however deep it is.
    held = deep.replace(b"NaN", b'NaN, "\\udc00"')
    with pytest.raises(BadRequest, match=r"x(\.0){499}\.1: the string holds an unpaired UTF-16 surrogate") as e:
        protocol.parse(protocol.ChatRequest, held)
    assert e.value.param == "x" and walked == [1]


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16", "utf-32"])
def test_a_surrogate_as_encoded_text_is_refused_in_every_encoding_the_parser_takes(encoding):
    body = '{"model": "m", "messages": [{"role": "user", "content": "hi \udc00"}]}'.encode(encoding, "surrogatepass")
    with pytest.raises(BadRequest, match="messages.0.content: the string holds an unpaired UTF-16 surrogate"):
        protocol.parse(protocol.ChatRequest, body)
    fine = '{"model": "m", "messages": [{"role": "user", "content": "hi \U0001F600"}]}'.encode(encoding)
    assert protocol.parse(protocol.ChatRequest, fine).messages[0].content == "hi \U0001F600"
