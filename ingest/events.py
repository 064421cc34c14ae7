"""Wire events: what Kafka carries, decoded and validated at the edge.

One JSON object per Kafka message, UTF-8, message key = tenant. Two event types (the contract in the
README, "Events"):

    interaction  {"type":"interaction","id","tenant","ts","messages"|"prompt","completion",
                  "adapter_version"?,"prompt_token_ids"?,"completion_token_ids"?,"completion_logprobs"?,
                  "reward"?,"metadata"?}
    feedback     {"type":"feedback","id","tenant","ts","score" in [-1, 1],"source"?}

`decode` turns bytes into an `InteractionEvent`, a `FeedbackEvent` or a `DeadLetter` naming a short, stable
reason (the keys of `REASONS`); it never raises, so one bad message can never stop the consumer. Past
`decode`, code trusts the types, and every number in a decoded event (metadata included) is finite.
`encode` is its inverse: the serving tier and apps build the dataclasses and send `encode(event)`;
`decode(encode(e)) == e` for every valid event. The dataclasses are treated as values; they are not
frozen only because frozen construction costs ~5x more on the hot path.

Parsing takes two paths with one outcome. The fast one is msgspec's strict parser (~3x the standard
library's speed on a 1 KB event), which accepts only strict JSON in valid UTF-8: no NaN or Infinity, no
fraction or exponent that overflows a float, no unpaired surrogate escape, integers kept exact; whatever
it accepts, the standard library parses to the same value, and none of it can hold a non-finite number.
Anything it refuses goes through the standard library path (UTF-8 check, `json.loads`, surrogate and
finiteness checks), which alone decides the dead-letter reason, so reasons are the same whichever path ran
(tests/ingest/test_events.py checks both on arbitrary input).

JSON integers are exact and unbounded (both parsers stop at 4300 digits), so a number field can hold an
integer no float can: a reward of 1 followed by 400 zeros made `math.isfinite` raise OverflowError out of
`decode`, and the replayed message stopped ingest for good. Numbers are therefore compared or converted
only in ways that cannot overflow or whose overflow is caught (`_as_float`; a comparison of an int with a
float is exact), an integer past a float's range counting as infinite, as `1e999` parses to infinity. And
should a check still raise something nobody foresaw, `decode` turns that into a dead letter too
(`bad_field` once the tenant and id are read, `not_json` before) and logs the traceback: a bug here costs
one message, never the consumer. MemoryError alone goes up: it is the process's trouble, and a dead letter
would lose a good event for good.

Unknown fields are ignored (newer producers may add some). Not here: scoring (scorers.py), what a row
looks like on disk (rows.py), or whether a tenant is known (batch.py, which has the config).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

import msgspec

from clora.config import TENANT_NAME, TENANT_NAME_RULE

logger = logging.getLogger(__name__)

# Reason codes of dead letters: short, stable strings (dashboards and alerts key on them).
REASONS: dict[str, str] = {
    "too_large": "the message is larger than ingest.max_message_bytes",
    "not_utf8": "the message bytes are not UTF-8",
    "not_json": "the message is not JSON (or is nested too deeply to parse)",
    "not_object": "the JSON is not an object",
    "missing_tenant": "no tenant, or a tenant that is not a non-empty string",
    "bad_tenant": "the tenant name is not a valid tenant name (letters, digits, '.', '_', '-')",
    "unknown_type": "type is neither \"interaction\" nor \"feedback\"",
    "missing_id": "no id, or an id that is not a non-empty string of at most 256 characters",
    "bad_field": "a field has the wrong type or an impossible value (the detail names it)",
    "missing_completion": "an interaction without a completion string",
    "reward_not_finite": "an interaction's inline reward is NaN, infinite or beyond a float's range",
    "score_out_of_range": "a feedback score outside [-1, 1] (or NaN)",
    "key_mismatch": "the Kafka message key is set and is not the event's tenant",
    "unknown_tenant": "the tenant is not configured and ingest.unknown_tenant is \"reject\"",
    "scorer_error": "the tenant's scorer raised or returned a bad value (the detail has the traceback summary)",
    "batch_too_large": "a Kafka record batch decompresses to more than ingest.max_batch_bytes (one dead letter, at "
                       "its last offset, holds the batch as stored)",
    "bad_batch": "a Kafka record batch cannot be read: its data does not decompress, a record does not parse, or its "
                 "checksum fails (one dead letter, at its last offset, holds the batch as stored)",
}


class SkippedBatch(bytes):
    """A Kafka record batch ingest did not read (ingest.record_batches), as a message value: its bytes are
    the batch as the broker stored it; `reason` and `detail` are its dead letter's. Only the consumer makes
    one: no message a producer sends can be one."""

    def __new__(cls, stored: bytes, reason: str, detail: str) -> SkippedBatch:
        value = super().__new__(cls, stored)
        value.reason, value.detail = reason, detail
        return value

MAX_ID_CHARS = 256
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234e38

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

# A JSON escape of a UTF-16 surrogate: only then can json.loads produce a string that is not valid UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


# Built once: json.dumps with keyword arguments builds a new encoder per call, which dominates small dumps.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)

# The strict fast parser (see the module docstring) and the encoder of values that passed `decode`.
_strict_loads = msgspec.json.Decoder().decode
_fast_dumps = msgspec.json.Encoder().encode


def to_json(value: Any) -> str:
    """Compact JSON text (UTF-8 kept as is); raises ValueError on NaN or infinities."""
    return _COMPACT.encode(value)


def decoded_to_json(value: Any) -> str:
    """Compact JSON text of a value taken from a decoded event, ~8x faster than `to_json`.

    Only for values that passed `decode`, whose numbers are all finite: this encoder would write a NaN
    as null where `to_json` raises.
    """
    return _fast_dumps(value).decode("utf-8")


def utc_now() -> datetime:
    """Now, in UTC, truncated to the millisecond (what storage keeps)."""
    now = datetime.now(timezone.utc)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


# ---------------------------------------------------------------------------------------------------------
# The types


@dataclass(slots=True)
class InteractionEvent:
    """One model call: what was asked, what came back, and (optionally) how good it was.

    Give `messages` (chat) or `prompt` (plain text), or both: the serving tier sends both, `prompt` then
    being the exact text the chat template produced. `ts` defaults to now. `prompt_token_ids`: the prompt
    as the model saw it, when it was sent as token ids (the serving tier sets it for those prompts only;
    text and chat prompts re-tokenize to exactly what was served, and their events stay small).
    """

    id: str
    tenant: str
    completion: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    ts: datetime = field(default_factory=utc_now)
    adapter_version: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    reward: float | None = None
    metadata: dict[str, Any] | None = None

    type: ClassVar[str] = "interaction"

    def __post_init__(self) -> None:
        if self.prompt is None and self.messages is None:
            raise ValueError(f"interaction {self.id!r} needs messages or a prompt")
        if self.ts.tzinfo is None:
            raise ValueError(f"interaction {self.id!r}: ts {self.ts} must be timezone-aware")

    @property
    def rendered_prompt(self) -> str:
        """The prompt as text: `prompt` when given, else the messages, one "role: content" line each."""
        if self.prompt is not None:
            return self.prompt
        return render_messages(self.messages or [])


@dataclass(slots=True)
class FeedbackEvent:
    """A score in [-1, 1] for the interaction with this `id` (sent before or after that interaction)."""

    id: str
    tenant: str
    score: float
    ts: datetime = field(default_factory=utc_now)
    source: str | None = None

    type: ClassVar[str] = "feedback"

    def __post_init__(self) -> None:
        if not -1.0 <= self.score <= 1.0:  # also rejects NaN
            raise ValueError(f"feedback for {self.id!r}: score {self.score} is outside [-1, 1]")
        if self.ts.tzinfo is None:
            raise ValueError(f"feedback for {self.id!r}: ts {self.ts} must be timezone-aware")


@dataclass(slots=True)
class DeadLetter:
    """Why a message was rejected. `tenant`/`id` are filled when they could be read (for the operator)."""

    reason: str
    detail: str
    tenant: str | None = None
    id: str | None = None


Event = InteractionEvent | FeedbackEvent


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as a chat template takes them, as vLLM hands them over: each call's arguments an object
    (templates that write `arguments | tojson` would show a string of JSON), {} where they are not the strict
    JSON of one (msgspec: no NaN, no escaped lone surrogate, which the tokenizer could not encode). The
    serving tier renders its prompts with these, and the learner a row that came with messages only."""
    return [m if not m.get("tool_calls") else {**m, "tool_calls": [
        {**call, "function": {**call["function"], "arguments": _arguments_object(call["function"].get("arguments"))}}
        for call in m["tool_calls"]]} for m in messages]


def _arguments_object(arguments: Any) -> dict[str, Any]:
    return arguments if isinstance(arguments, dict) else json_object(arguments) or {}


def json_object(text: Any) -> dict[str, Any] | None:
    """The object `text` is the strict JSON of (msgspec: no NaN, no escaped lone surrogate); None when it is
    not text, not JSON, not an object, or nested past the interpreter's depth."""
    if not isinstance(text, str):
        return None
    try:
        parsed = _strict_loads(text)
    except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
        return None
    return parsed if isinstance(parsed, dict) else None


def render_messages(messages: list[dict[str, Any]], calls: bool = True) -> str:
    """One "role: content" line per message; an assistant's calls follow its content as their JSON (not with
    `calls` False: how ingest rendered them before it took calls)."""
    return "\n".join([f"{m['role']}: {_shown_content(m, calls)}" for m in messages])


def _shown_content(message: dict[str, Any], with_calls: bool) -> str:
    content, calls = message["content"], message.get("tool_calls")
    if not calls or not with_calls:
        return content if content is not None else ""
    return " ".join(part for part in (content, json.dumps(calls, ensure_ascii=False)) if part)


# ---------------------------------------------------------------------------------------------------------
# Encoding


def format_ts(ts: datetime) -> str:
    """ISO-8601 in UTC with milliseconds and a Z, e.g. 2025-01-31T12:00:00.123Z."""
    return ts.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def encode(event: Event) -> bytes:
    """The event as the JSON bytes of one Kafka message (optional fields that are None are left out)."""
    out: dict[str, Any] = {"type": event.type, "id": event.id, "tenant": event.tenant, "ts": format_ts(event.ts)}
    if isinstance(event, InteractionEvent):
        optional = {
            "messages": event.messages,
            "prompt": event.prompt,
            "completion": event.completion,
            "adapter_version": event.adapter_version,
            "prompt_token_ids": event.prompt_token_ids,
            "completion_token_ids": event.completion_token_ids,
            "completion_logprobs": event.completion_logprobs,
            "reward": event.reward,
            "metadata": event.metadata,
        }
    else:
        optional = {"score": event.score, "source": event.source}
    out.update((k, v) for k, v in optional.items() if v is not None)
    return to_json(out).encode("utf-8")


# ---------------------------------------------------------------------------------------------------------
# Decoding


class _Reject(Exception):
    """Internal: carries a dead letter out of the field checks."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_float(v: int | float) -> float:
    """A JSON number as a float, without raising: an integer beyond a float's range (float() raises
    OverflowError on it) becomes an infinity of its sign, as a decimal like 1e999 does in json.loads."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def shown(value: Any) -> str:
    """A value for a message (a dead letter's detail, a scorer error): a long integer by its size, not its
    thousands of digits (repr() of one over 4300 digits raises), and a user object whose repr() fails by its
    type."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        return f"{value!r:.80}"
    except Exception:
        return f"a {type(value).__name__} (its repr() failed)"


def exception_text(e: BaseException) -> str:
    """str(e), which may fail too (an exception holding such an integer, a user's exception class)."""
    try:
        return str(e)
    except Exception:
        return "(its message cannot be shown)"


def _optional_str(data: dict, name: str) -> str | None:
    v = data.get(name)
    if v is not None and not isinstance(v, str):
        raise _Reject("bad_field", f"{name} must be a string or null, got {type(v).__name__}")
    return v


def parse_ts(v: Any) -> datetime:
    """ISO-8601 text (naive means UTC) or epoch milliseconds -> aware UTC datetime, to the millisecond."""
    try:
        if isinstance(v, str):
            try:
                ts = datetime.fromisoformat(v)
            except ValueError:  # RFC 3339 allows a lower-case t and z, which Python does not read
                ts = datetime.fromisoformat(v.upper())
            if ts.tzinfo is None:
                ts = ts.replace(tzinfo=timezone.utc)
            elif ts.tzinfo is not timezone.utc:
                ts = ts.astimezone(timezone.utc)
        elif _is_number(v):  # int() raises on NaN and infinities, timedelta past year 9999 (huge integers too)
            ts = EPOCH + timedelta(milliseconds=int(v))
        else:
            raise _Reject("bad_field", f"ts must be ISO-8601 text or epoch milliseconds, got {shown(v)}")
    except (ValueError, OverflowError, OSError) as e:
        raise _Reject("bad_field", f"ts {shown(v)} is not a usable time: {e}") from e
    sub_ms = ts.microsecond % 1000
    return ts.replace(microsecond=ts.microsecond - sub_ms) if sub_ms else ts


def _messages(v: Any) -> list[dict[str, Any]]:
    """A list of {role, content} objects; an assistant's turn that only calls tools (`tool_calls`, a
    non-empty list) may have a null content, as OpenAI's chat format writes it."""
    if not isinstance(v, list) or not v:
        raise _Reject("bad_field", "messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _Reject("bad_field", f"messages[{i}] must be an object with string role and content")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and isinstance(m.get("tool_calls"), list)
                                                 and m["tool_calls"]):
            raise _Reject("bad_field", f"messages[{i}] must be an object with string role and content (null only "
                                       "beside tool_calls)")
    return v


# Token lists are checked with builtins that loop in C (a completion carries hundreds of tokens).
_INT = {int}
_NUMBER = {int, float}  # not bool: type() is exact


def _token_ids(v: Any, name: str = "completion_token_ids") -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or (v and not (set(map(type, v)) <= _INT and min(v) >= 0 and max(v) <= INT32_MAX)):
        raise _Reject("bad_field", f"{name} must be a list of non-negative 32-bit integers")
    return v


def _logprobs(v: Any) -> list[float] | None:
    if v is None:
        return None
    # FLOAT32_MAX >= abs(x) is False for NaN as well as for infinities.
    if not isinstance(v, list) or not (set(map(type, v)) <= _NUMBER and all(map(FLOAT32_MAX.__ge__, map(abs, v)))):
        raise _Reject("bad_field", "completion_logprobs must be a list of finite numbers")
    return list(map(float, v))


def _interaction(data: dict, id_: str, tenant: str, ts: datetime, strict: bool) -> InteractionEvent:
    completion = data.get("completion")
    if not isinstance(completion, str):
        raise _Reject("missing_completion", "completion must be a string")
    prompt = _optional_str(data, "prompt")
    messages = data.get("messages")
    if messages is not None:
        messages = _messages(messages)
        if not strict:  # the strict parser admits no NaN or Infinity; the standard library does
            try:
                to_json(messages)
            except ValueError as e:
                raise _Reject("bad_field", f"messages hold a non-finite number: {e}") from e
    elif prompt is None:
        raise _Reject("bad_field", "an interaction needs messages or a prompt")
    prompt_token_ids = _token_ids(data.get("prompt_token_ids"), "prompt_token_ids")
    token_ids = _token_ids(data.get("completion_token_ids"))
    logprobs = _logprobs(data.get("completion_logprobs"))
    if token_ids is not None and logprobs is not None and len(token_ids) != len(logprobs):
        raise _Reject(
            "bad_field",
            f"completion_token_ids ({len(token_ids)}) and completion_logprobs ({len(logprobs)}) differ in length",
        )
    reward = data.get("reward")
    if reward is not None:
        if not _is_number(reward):
            raise _Reject("bad_field", f"reward must be a number or null, got {type(reward).__name__}")
        as_float = _as_float(reward)
        if not math.isfinite(as_float):
            raise _Reject("reward_not_finite", f"reward is {shown(reward)}, not a finite float")
        reward = as_float
    metadata = data.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _Reject("bad_field", f"metadata must be an object or null, got {type(metadata).__name__}")
        if not strict:  # the strict parser admits no NaN or Infinity; the standard library does
            try:
                to_json(metadata)
            except ValueError as e:
                raise _Reject("bad_field", f"metadata holds a non-finite number: {e}") from e
    # Positional, in the order of the fields: a dataclass called with twelve keywords costs 3x as much, once
    # per message (tests/ingest/test_events.py checks the decoded event field by field).
    return InteractionEvent(id_, tenant, completion, prompt, messages, ts, _optional_str(data, "adapter_version"),
                            prompt_token_ids, token_ids, logprobs, reward, metadata)


def _feedback(data: dict, id_: str, tenant: str, ts: datetime) -> FeedbackEvent:
    score = data.get("score")
    if not _is_number(score):
        raise _Reject("bad_field", f"score must be a number, got {type(score).__name__}")
    if not -1.0 <= score <= 1.0:  # exact for an integer of any size, and False for NaN
        raise _Reject("score_out_of_range", f"score {shown(score)} is outside [-1, 1]")
    return FeedbackEvent(id_, tenant, float(score), ts, _optional_str(data, "source"))  # positional: as above


def _lenient_loads(raw: bytes) -> Any:
    """The standard library path, for what the strict parser refused: the value, or the DeadLetter."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return DeadLetter("not_utf8", str(e))
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        return DeadLetter("not_json", f"{type(e).__name__}: {e}"[:300])
    if not isinstance(data, dict):
        return DeadLetter("not_object", f"the JSON is a {type(data).__name__}, not an object")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, ValueError) as e:
            return DeadLetter("bad_field", f"a string holds an unpaired UTF-16 surrogate: {e}")
    return data


def decode(raw: bytes, *, max_bytes: int) -> Event | DeadLetter:
    """One Kafka message value -> a valid event, or a DeadLetter with its reason. Never raises (but
    MemoryError; see the module docstring)."""
    try:
        return _decode(raw, max_bytes)
    except MemoryError:
        raise
    except Exception as e:  # a check that failed in a way nobody foresaw: see the module docstring
        logger.exception("ingest.events: decoding a message of %d bytes raised; it is dead-lettered", len(raw))
        return DeadLetter("not_json", f"the message could not be decoded: {_describe(e)}")


def _decode(raw: bytes, max_bytes: int) -> Event | DeadLetter:
    if type(raw) is SkippedBatch:
        return DeadLetter(raw.reason, raw.detail)
    if len(raw) > max_bytes:
        return DeadLetter("too_large", f"{len(raw)} bytes is more than the limit of {max_bytes}")
    try:
        data = _strict_loads(raw)
        strict = True
    except (msgspec.DecodeError, RecursionError):
        data = _lenient_loads(raw)
        if isinstance(data, DeadLetter):
            return data
        strict = False
    if not isinstance(data, dict):
        return DeadLetter("not_object", f"the JSON is a {type(data).__name__}, not an object")
    tenant = data.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        return DeadLetter("missing_tenant", f"tenant must be a non-empty string, got {tenant!r:.80}")
    if not TENANT_NAME.match(tenant):
        return DeadLetter("bad_tenant", f"tenant {tenant!r:.80} is not {TENANT_NAME_RULE}")
    kind = data.get("type")
    if kind not in ("interaction", "feedback"):
        return DeadLetter("unknown_type", f"type must be \"interaction\" or \"feedback\", got {kind!r:.80}", tenant)
    id_ = data.get("id")
    if not isinstance(id_, str) or not id_ or len(id_) > MAX_ID_CHARS:
        return DeadLetter("missing_id", f"id must be a non-empty string of at most {MAX_ID_CHARS} characters, got {id_!r:.80}", tenant)
    try:
        ts = parse_ts(data.get("ts"))
        if kind == "interaction":
            return _interaction(data, id_, tenant, ts, strict)
        return _feedback(data, id_, tenant, ts)
    except _Reject as r:
        return DeadLetter(r.reason, r.detail, tenant, id_)
    except MemoryError:
        raise
    except Exception as e:  # as in `decode`, but here the dead letter can name its tenant and id
        logger.exception("ingest.events: checking the fields of %s %r (tenant %r) raised; it is dead-lettered",
                         kind, id_, tenant)
        return DeadLetter("bad_field", f"a field could not be checked: {_describe(e)}", tenant, id_)


def _describe(e: BaseException) -> str:
    """An unexpected exception for a dead letter's detail."""
    return f"{type(e).__name__}: {exception_text(e)}"[:300]


def key_mismatch(key: bytes, event: Event) -> DeadLetter:
    """The dead letter of a valid event whose Kafka message key is not its tenant. The key decides the
    partition, and an interaction and its feedback meet only on one partition number of the two topics (one
    ingest process owns both): keyed by anything else, they would be split between processes, and the
    feedback would wait for its interaction until it expired. A message without a key is accepted."""
    shown = key.decode("utf-8", "backslashreplace")
    return DeadLetter("key_mismatch", f"message key {shown!r:.80} is not the tenant {event.tenant!r}", event.tenant, event.id)
