"""Decoding at the edge: every valid event decodes to its type, every bad message to a DeadLetter with a
reason from REASONS, and nothing (arbitrary bytes, arbitrary JSON) ever makes decode raise."""

import json
import math
from datetime import datetime, timezone

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ingest import events
from ingest.events import REASONS, DeadLetter, FeedbackEvent, InteractionEvent, decode, decoded_to_json, encode

pytestmark = pytest.mark.unit

MAX = 10_000
TS = datetime(2025, 3, 1, 12, 30, 15, 123000, tzinfo=timezone.utc)


def interaction(**over):
    d = {"type": "interaction", "id": "r1", "tenant": "acme", "ts": "2025-03-01T12:30:15.123Z",
         "messages": [{"role": "user", "content": "2+2?"}], "completion": "4"}
    d.update(over)
    return {k: v for k, v in d.items() if v is not ...}


def raw(d) -> bytes:
    return json.dumps(d).encode()


def reason(d_or_bytes) -> str:
    b = d_or_bytes if isinstance(d_or_bytes, bytes) else raw(d_or_bytes)
    out = decode(b, max_bytes=MAX)
    assert isinstance(out, DeadLetter), out
    return out.reason


def test_interaction_with_messages():
    ev = decode(raw(interaction(adapter_version="acme@2", metadata={"app": "x"})), max_bytes=MAX)
    assert ev == InteractionEvent(id="r1", tenant="acme", completion="4", messages=[{"role": "user", "content": "2+2?"}],
                                  ts=TS, adapter_version="acme@2", metadata={"app": "x"})
    assert ev.rendered_prompt == "user: 2+2?"


def test_a_conversation_with_tool_calls_and_results_is_taken_and_rendered_with_its_calls():
    """Serving answers tool calls: an assistant turn that only calls has a null content, as OpenAI writes it."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ev = decode(raw(interaction(messages=messages)), max_bytes=MAX)
    assert isinstance(ev, InteractionEvent) and ev.messages == messages
    assert decode(encode(ev), max_bytes=MAX) == ev
    assert ev.rendered_prompt == f"user: weather?\nassistant: {json.dumps(calls)}\ntool: sunny"
    dl = decode(raw(interaction(messages=[{"role": "assistant", "content": None}])), max_bytes=MAX)
    assert isinstance(dl, DeadLetter) and dl.reason == "bad_field" and "null only beside tool_calls" in dl.detail


def test_interaction_with_prompt_and_all_optional_fields():
    ev = decode(raw(interaction(messages=..., prompt="2+2=", ts=1740832215123, completion_token_ids=[19, 7],
                                completion_logprobs=[-0.5, 0], reward=1)), max_bytes=MAX)
    assert isinstance(ev, InteractionEvent)
    assert ev.ts == TS  # epoch milliseconds
    assert ev.rendered_prompt == "2+2="
    assert ev.completion_token_ids == [19, 7] and ev.completion_logprobs == [-0.5, 0.0]
    assert ev.reward == 1.0 and isinstance(ev.reward, float)


def test_prompt_token_ids_are_decoded_checked_and_encoded():
    """A prompt sent to serving as token ids comes with them: the learner trains on those ids."""
    ev = decode(raw(interaction(messages=..., prompt="hello", prompt_token_ids=[74, 71, 78, 78, 81, 0, 2**31 - 1])),
                max_bytes=MAX)
    assert isinstance(ev, InteractionEvent) and ev.prompt_token_ids == [74, 71, 78, 78, 81, 0, 2**31 - 1]
    assert decode(encode(ev), max_bytes=MAX) == ev
    assert json.loads(encode(ev))["prompt_token_ids"] == [74, 71, 78, 78, 81, 0, 2**31 - 1]
    without = decode(raw(interaction()), max_bytes=MAX)
    assert without.prompt_token_ids is None and "prompt_token_ids" not in json.loads(encode(without))
    for bad in ([1, -2], [1, 2**31], [1, 2.0], [1, "2"], [True], [None], [[1]], "74 71", 74, {"0": 1}):
        dl = decode(raw(interaction(prompt_token_ids=bad)), max_bytes=MAX)
        assert isinstance(dl, DeadLetter) and dl.reason == "bad_field" and "prompt_token_ids" in dl.detail, bad
        assert (dl.tenant, dl.id) == ("acme", "r1")
    assert decode(raw(interaction(prompt_token_ids=None)), max_bytes=MAX).prompt_token_ids is None


def test_prompt_wins_over_messages_for_the_rendered_text():
    ev = decode(raw(interaction(prompt="<|user|>2+2?<|assistant|>")), max_bytes=MAX)
    assert ev.rendered_prompt == "<|user|>2+2?<|assistant|>"


def test_naive_and_offset_timestamps_are_utc():
    assert decode(raw(interaction(ts="2025-03-01T12:30:15.123")), max_bytes=MAX).ts == TS
    assert decode(raw(interaction(ts="2025-03-01T14:30:15.123456+02:00")), max_bytes=MAX).ts == TS
    # RFC 3339's lower-case t and z (some clients' formatters write them) were dead-lettered as bad_field
    assert decode(raw(interaction(ts="2025-03-01t12:30:15.123z")), max_bytes=MAX).ts == TS


def test_feedback():
    ev = decode(raw({"type": "feedback", "id": "r1", "tenant": "acme", "ts": "2025-03-01T12:30:15.123Z",
                     "score": -1, "source": "thumbs"}), max_bytes=MAX)
    assert ev == FeedbackEvent(id="r1", tenant="acme", score=-1.0, ts=TS, source="thumbs")


def test_unknown_fields_are_ignored():
    assert isinstance(decode(raw(interaction(future_field=[1, 2])), max_bytes=MAX), InteractionEvent)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (b"\xff\xfe", "not_utf8"),
        (b"{not json", "not_json"),
        (b"", "not_json"),
        (b"[" * 100_000 + b"]" * 100_000, "too_large"),
        (b"[" * 5000 + b"]" * 5000, "not_json"),  # deeper than the parser's recursion limit
        (b"[1, 2]", "not_object"),
        (interaction(tenant=...), "missing_tenant"),
        (interaction(tenant=""), "missing_tenant"),
        (interaction(tenant=7), "missing_tenant"),
        (interaction(tenant="../etc"), "bad_tenant"),
        (interaction(tenant="acme\n"), "bad_tenant"),  # $ in a pattern matches before a final newline
        (interaction(tenant="acme."), "bad_tenant"),  # Windows drops a trailing dot: "acme" again
        (interaction(type="click"), "unknown_type"),
        (interaction(type=...), "unknown_type"),
        (interaction(id=...), "missing_id"),
        (interaction(id="x" * 257), "missing_id"),
        (interaction(completion=...), "missing_completion"),
        (interaction(completion=["4"]), "missing_completion"),
        (interaction(messages=..., prompt=...), "bad_field"),
        (interaction(messages=[]), "bad_field"),
        (interaction(messages=[{"role": "user"}]), "bad_field"),
        (interaction(ts=...), "bad_field"),
        (interaction(ts="yesterday"), "bad_field"),
        (interaction(ts=10**20), "bad_field"),
        (interaction(ts=True), "bad_field"),
        (interaction(reward="high"), "bad_field"),
        (interaction(reward=True), "bad_field"),
        (interaction(metadata=[1]), "bad_field"),
        (interaction(completion_token_ids=[1, -2]), "bad_field"),
        (interaction(completion_token_ids=[1, 2**31]), "bad_field"),
        (interaction(completion_token_ids=[1], completion_logprobs=[-1.0, -2.0]), "bad_field"),
        (interaction(adapter_version=3), "bad_field"),
        ({"type": "feedback", "id": "r1", "tenant": "acme", "ts": 0, "score": 1.5}, "score_out_of_range"),
        ({"type": "feedback", "id": "r1", "tenant": "acme", "ts": 0}, "bad_field"),
        ({"type": "feedback", "id": "r1", "tenant": "acme", "ts": 0, "score": 1, "source": 5}, "bad_field"),
    ],
)
def test_bad_messages_have_their_reason(message, expected):
    assert reason(message) == expected


@pytest.mark.parametrize(("text", "expected"), [
    (b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"p","completion":"c","reward":NaN}', "reward_not_finite"),
    (b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"p","completion":"c","reward":1e999}', "reward_not_finite"),
    (b'{"type":"feedback","id":"r","tenant":"a","ts":0,"score":NaN}', "score_out_of_range"),
    (b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"p","completion":"c","metadata":{"x":Infinity}}', "bad_field"),
    (b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"\\ud800","completion":"c"}', "bad_field"),
    (b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"p","completion":"c","completion_logprobs":[NaN]}', "bad_field"),
    # stored in messages_json as null, had it passed
    (b'{"type":"interaction","id":"r","tenant":"a","ts":0,"completion":"c","messages":[{"role":"user","content":"x","n":NaN}]}',
     "bad_field"),
])
def test_non_finite_numbers_and_lone_surrogates(text, expected):
    assert reason(text) == expected


HUGE = 10**400  # exact in JSON and in both parsers; float() of it raises OverflowError


@pytest.mark.parametrize(("message", "expected"), [
    (interaction(reward=HUGE), "reward_not_finite"),  # raised OverflowError out of decode: ingest stopped for good
    (interaction(reward=-HUGE), "reward_not_finite"),
    (interaction(ts=HUGE), "bad_field"),
    (interaction(ts=-HUGE), "bad_field"),
    ({"type": "feedback", "id": "r1", "tenant": "acme", "ts": HUGE, "score": 1}, "bad_field"),
    ({"type": "feedback", "id": "r1", "tenant": "acme", "ts": 0, "score": HUGE}, "score_out_of_range"),
    ({"type": "feedback", "id": "r1", "tenant": "acme", "ts": 0, "score": -HUGE}, "score_out_of_range"),
    (interaction(completion_token_ids=[HUGE]), "bad_field"),
    (interaction(completion_token_ids=[1], completion_logprobs=[-HUGE]), "bad_field"),
    (b'{"type":"interaction","id":"r1","tenant":"acme","ts":0,"prompt":"p","completion":"c","reward":1' + b"0" * 4299 + b"}",
     "reward_not_finite"),  # 4300 digits: the most either parser reads
])
def test_integers_beyond_a_float_are_dead_letters_not_exceptions(message, expected):
    dl = decode(message if isinstance(message, bytes) else raw(message), max_bytes=MAX)
    assert isinstance(dl, DeadLetter) and dl.reason == expected and (dl.tenant, dl.id) == ("acme", "r1")
    assert len(dl.detail) < 200  # a long integer is described by its size, not written out
    _same(message if isinstance(message, bytes) else raw(message))


def test_a_huge_integer_in_metadata_is_kept_exactly():
    ev = decode(raw(interaction(metadata={"n": HUGE})), max_bytes=MAX)
    assert ev.metadata == {"n": HUGE} and json.loads(decoded_to_json(ev.metadata)) == {"n": HUGE}


def test_an_unexpected_exception_in_a_field_check_is_a_dead_letter_naming_tenant_and_id(monkeypatch, caplog):
    """decode promises never to raise: a check failing in a way nobody foresaw costs one message."""
    def broken(*args):
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr(events, "_feedback", broken)
    dl = decode(raw({"type": "feedback", "id": "r1", "tenant": "acme", "ts": 0, "score": 1}), max_bytes=MAX)
    assert (dl.reason, dl.tenant, dl.id) == ("bad_field", "acme", "r1")
    assert "RuntimeError: a bug in a check" in dl.detail
    assert "raised; it is dead-lettered" in caplog.text  # with the traceback, for whoever fixes the bug


def test_an_unexpected_exception_while_parsing_is_a_dead_letter(monkeypatch, caplog):
    class Unprintable(Exception):
        def __str__(self):
            raise ValueError("no")

    def broken(raw):
        raise Unprintable()

    monkeypatch.setattr(events, "_strict_loads", broken)
    dl = decode(raw(interaction()), max_bytes=MAX)
    assert (dl.reason, dl.tenant) == ("not_json", None) and "Unprintable" in dl.detail
    assert "raised; it is dead-lettered" in caplog.text
    monkeypatch.setattr(events, "_strict_loads", lambda raw: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):  # the process's trouble: dead-lettering would lose a good message
        decode(raw(interaction()), max_bytes=MAX)


def test_paired_surrogate_escape_is_fine():
    ev = decode(b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"\\ud83d\\ude00","completion":"c"}', max_bytes=MAX)
    assert isinstance(ev, InteractionEvent) and ev.prompt == "\U0001F600"


def test_dead_letter_keeps_tenant_and_id_when_readable():
    dl = decode(raw(interaction(completion=...)), max_bytes=MAX)
    assert (dl.tenant, dl.id) == ("acme", "r1")


def test_constructors_check_what_they_can():
    with pytest.raises(ValueError, match="messages or a prompt"):
        InteractionEvent(id="r", tenant="a", completion="c")
    with pytest.raises(ValueError, match="outside"):
        FeedbackEvent(id="r", tenant="a", score=2.0)
    with pytest.raises(ValueError, match="timezone"):
        FeedbackEvent(id="r", tenant="a", score=0.0, ts=datetime(2025, 1, 1))


def test_encode_is_compact_json_and_defaults_ts_to_now():
    before = datetime.now(timezone.utc)
    ev = InteractionEvent(id="r1", tenant="acme", prompt="hi", completion="yo")
    data = json.loads(encode(ev))
    assert data["type"] == "interaction" and "messages" not in data and "reward" not in data
    assert abs((datetime.fromisoformat(data["ts"]) - before).total_seconds()) < 5
    assert decode(encode(ev), max_bytes=MAX) == ev


# ---------------------------------------------------------------------------------------------------------
# Properties

texts = st.text(max_size=30)
tenants = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,19}[A-Za-z0-9_-])?", fullmatch=True)
times = st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9000, 1, 1), timezones=st.just(timezone.utc)).map(
    lambda t: t.replace(microsecond=t.microsecond // 1000 * 1000)
)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
# Integers no float can hold, up to the 4300 digits either parser reads (float() of them overflows).
huge_ints = st.builds(lambda sign, digits, low: sign * (10**digits + low),
                      st.sampled_from([1, -1]), st.integers(308, 4299), st.integers(0, 10**6))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | huge_ints | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)


def _interactions():
    return st.builds(
        InteractionEvent,
        id=st.text(min_size=1, max_size=40),
        tenant=tenants,
        completion=texts,
        prompt=texts,
        messages=st.none() | st.lists(st.fixed_dictionaries({"role": texts, "content": texts}), min_size=1, max_size=3),
        ts=times,
        adapter_version=st.none() | texts,
        prompt_token_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=5),
        completion_token_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=5),
        reward=st.none() | finite,
        metadata=st.none() | st.dictionaries(texts, st.integers() | texts, max_size=3),
    )


def _feedbacks():
    return st.builds(FeedbackEvent, id=st.text(min_size=1, max_size=40), tenant=tenants,
                     score=st.floats(-1, 1), ts=times, source=st.none() | texts)


def _well_formed(ev):
    return isinstance(ev, (InteractionEvent, FeedbackEvent)) or (isinstance(ev, DeadLetter) and ev.reason in REASONS)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_to_an_event_or_a_dead_letter(b):
    assert _well_formed(decode(b, max_bytes=200))


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_json_decodes_to_an_event_or_a_dead_letter(value):
    assert _well_formed(decode(json.dumps(value).encode(), max_bytes=MAX))


_FEEDBACK = {"type": "feedback", "id": "r1", "tenant": "acme", "ts": 0, "score": 0.5}


# Random dicts rarely make a valid event: the examples do, so that the checks on what passed the edge run.
@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "id", "tenant", "ts", "messages", "prompt", "completion", "score",
                                         "reward", "metadata", "completion_token_ids", "completion_logprobs",
                                         "prompt_token_ids", "adapter_version", "source"]),
                       json_values | huge_ints | st.sampled_from(["interaction", "feedback", "acme", "2025-01-01T00:00:00Z"])))
@example(interaction())
@example(interaction(messages=..., prompt="2+2=", reward=1))
@example(_FEEDBACK)
def test_event_shaped_json_decodes_to_an_event_or_a_dead_letter(value):
    out = decode(json.dumps(value).encode(), max_bytes=MAX)
    assert _well_formed(out)
    if isinstance(out, InteractionEvent):  # what passed the edge is what storage needs
        assert isinstance(out.completion, str) and isinstance(out.rendered_prompt, str)
        assert out.reward is None or math.isfinite(out.reward)
    if isinstance(out, FeedbackEvent):
        assert -1.0 <= out.score <= 1.0


def test_the_event_shaped_examples_are_valid_events():
    """The examples above reach the checks on a decoded event only while they decode to one."""
    assert isinstance(decode(raw(interaction()), max_bytes=MAX), InteractionEvent)
    assert decode(raw(interaction(messages=..., prompt="2+2=", reward=1)), max_bytes=MAX).reward == 1.0
    assert isinstance(decode(raw(_FEEDBACK), max_bytes=MAX), FeedbackEvent)


_numbers = st.integers() | huge_ints | st.floats()


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([
    lambda n: interaction(ts=n), lambda n: interaction(reward=n), lambda n: interaction(metadata={"n": [n]}),
    lambda n: interaction(completion_token_ids=[n]), lambda n: interaction(completion_token_ids=[1], completion_logprobs=[n]),
    lambda n: interaction(prompt_token_ids=[n]),
    lambda n: {**_FEEDBACK, "ts": n}, lambda n: {**_FEEDBACK, "score": n},
]), _numbers)
def test_any_number_in_a_numeric_field_of_a_valid_event_decodes_to_an_event_or_a_dead_letter(put, n):
    """Arbitrary JSON rarely makes an event valid up to the one number being checked; this does."""
    out = decode(json.dumps(put(n)).encode(), max_bytes=MAX)
    assert _well_formed(out)
    if isinstance(out, InteractionEvent) and out.reward is not None:
        assert math.isfinite(out.reward) and out.reward == float(n)


@settings(max_examples=200, deadline=None)
@given(_interactions() | _feedbacks())
def test_encode_then_decode_is_the_identity(ev):
    assert decode(encode(ev), max_bytes=10**6) == ev


# ---------------------------------------------------------------------------------------------------------
# Two parsers, one outcome: whatever the strict fast parser accepts decodes exactly as the standard library
# path alone would decode it (same event, or same dead letter with the same detail).


def _standard_library_only(raw: bytes, max_bytes: int):
    def refuse(_raw):
        raise msgspec.DecodeError("the fast parser is switched off")

    fast, events._strict_loads = events._strict_loads, refuse
    try:
        return decode(raw, max_bytes=max_bytes)
    finally:
        events._strict_loads = fast


def _same(raw: bytes, max_bytes: int = MAX) -> None:
    fast, slow = decode(raw, max_bytes=max_bytes), _standard_library_only(raw, max_bytes)
    assert fast == slow, (raw, fast, slow)


_event_fields = st.dictionaries(
    st.sampled_from(["type", "id", "tenant", "ts", "messages", "prompt", "completion", "score", "reward", "metadata",
                     "completion_token_ids", "completion_logprobs", "adapter_version", "source"]),
    json_values | huge_ints | st.sampled_from(["interaction", "feedback", "acme", "2025-01-01T00:00:00Z", 1740832215123]),
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()) | _event_fields.map(lambda v: json.dumps(v).encode()))
def test_the_fast_parser_changes_no_outcome(raw):
    _same(raw)


@settings(max_examples=200, deadline=None)
@given(_interactions() | _feedbacks())
def test_the_fast_parser_changes_no_valid_event(ev):
    _same(encode(ev), 10**6)


@pytest.mark.parametrize("raw", [
    b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"p","completion":"c","metadata":{"n":123456789012345678901234567890}}',
    b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"p","completion":"c","reward":1e999}',
    b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"p","completion":"c","reward":1' + b"0" * 400 + b'}',
    b'{"type":"interaction","id":"r","tenant":"a","ts":0,"prompt":"\\ud800","completion":"c"}',
    b'{"type":"feedback","id":"r","tenant":"a","ts":0,"score":0.5,"type":"interaction","completion":"c","prompt":"p"}',
    b'\xef\xbb\xbf{"type":"feedback","id":"r","tenant":"a","ts":0,"score":0.5}',
    b'[' * 990 + b']' * 990,
])
def test_the_fast_parser_changes_no_outcome_at_the_edges(raw):
    _same(raw)


def test_big_integers_in_metadata_are_kept_exactly():
    ev = decode(raw(interaction(metadata={"n": 2**80, "m": [-(2**70)]})), max_bytes=MAX)
    assert ev.metadata == {"n": 2**80, "m": [-(2**70)]}
    assert json.loads(decoded_to_json(ev.metadata)) == ev.metadata


_finite_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(texts, _finite_json, max_size=4))
def test_decoded_to_json_is_json_of_the_same_value(value):
    assert json.loads(decoded_to_json(value)) == value
