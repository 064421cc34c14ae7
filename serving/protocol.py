"""The OpenAI wire format: request bodies parsed at the edge, response bodies and stream chunks built here.

Requests are validated into pydantic models (unknown fields are ignored, as OpenAI's own server ignores
fields newer clients send; an explicit `null` means the field's default, as OpenAI and vLLM read it); a
malformed body becomes one 400 listing every bad field, `param` naming the first. A body must be text: a
string or key holding an unpaired UTF-16 surrogate (JSON can escape one, "\\udc00") is refused wherever it
is, since vLLM, the tokenizer and the event log would each fail on it later. Fields OpenAI or vLLM's OpenAI
server define that clora does not implement are refused (400 `unsupported_parameter`, `param` the field)
rather than silently dropped, so a client never gets an answer that ignored its request: the deprecated
`functions`/`function_call` (tools are served: serving/tools.py), `response_format` other than text, JSON
object or JSON schema, `echo`, `suffix`, `best_of` other than `n`, and the
fields of `NOT_IMPLEMENTED` (guided decoding, chat template options, prompt logprobs, audio, ...) unless
they hold the value that asks for what clora does anyway (`"add_generation_prompt": true`). OpenAI's
metadata fields that change no answer (`user`, `metadata`, `store`, `service_tier`, ...) are taken, as are
vLLM's `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`
and `ignore_eos`, which the engine applies. Two samplings vLLM refuses are taken, as OpenAI takes them:
`temperature: 0` with `n` > 1 gets n copies of the one greedy answer (the engine runs it once), and
`top_p: 0` keeps the most likely token only, sampled as `top_k: 1`. A completions body too large to parse is still
looked at for one thing, `lists_several_prompts`: a batch is told so, not to shorten a prompt that may fit.
README.md ("Serving: the HTTP contract") has the table of what is accepted and refused.

Responses are plain dicts built from the engine's `Choice`/`Delta` (serving/engine.py) by pure
functions, so the shapes can be checked without an engine: `chat.completion`, `chat.completion.chunk`,
`text_completion`, and the two logprobs layouts (chat: `content[{token, logprob, bytes, top_logprobs}]`;
completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). A token's `bytes` are its raw bytes
in the vocabulary, so joining a choice's reproduces its content's UTF-8 even where tokens split a character;
its `token` is its text, or, when its bytes are not whole UTF-8 characters, OpenAI's "bytes:\\xe4\\xbd"
(vLLM would show "" or U+FFFD). Completions' `top_logprobs` is keyed by that `token`, so it keeps every
alternative; `text_offset` is where the token starts in the choice's text (the engine's count).

Not here: authentication, adapters, the engine call, or events (api.py wires those).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationError, field_validator,
                      model_validator)

from serving.engine import MIN_TEMPERATURE as MIN_TEMPERATURE  # the engine's; clora's config check reads it here
from serving.engine import Choice, Delta, Sampling, TokenLogprob
from serving.errors import BadRequest, UnsupportedParameter
from serving.tools import Answer, ToolUse, read_tools

MAX_N = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM default it
MAX_CHOICES = 128  # prompts x n of one /v1/completions request
MAX_TOP_LOGPROBS = 20
MAX_METADATA_KEYS = 16  # OpenAI's limits on a request's `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range of a logit_bias value
# Bounds on what every choice's interaction event copies from the request (its sampling record): without
# them one request of 128 one-token choices made events of ~60 MiB from a body of 1 MiB.
MAX_STOP_CHARS = 1024  # of each stop sequence
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: past any vocabulary (int() of a key of 4,300 digits raises)
# A response_format's JSON schema, as JSON: vLLM compiles it as the request goes in, on the event loop every
# stream shares (~0.2 s for 0.9 MB); tools' and apps' schemas are a few KiB.
MAX_SCHEMA_CHARS = 64 * 1024
# How deep a schema (response_format's, a tool's parameters) may nest: writing one back as JSON near the
# parser's own limit raised RecursionError (a 500); real schemas nest a few levels.
MAX_JSON_DEPTH = 64


NOTHING = object()  # no value of the field asks for what clora does


def _refused(why: str, *names: str, **harmless: Any) -> dict[str, tuple[str, Any]]:
    """Fields refused for `why`: `names` whatever they hold, `harmless` unless they hold the value given."""
    return {**{name: (why, NOTHING) for name in names}, **{name: (why, v) for name, v in harmless.items()}}


# Fields of OpenAI's API or vLLM's OpenAI server that clora does not implement -> (why, the value that asks
# only for what clora does anyway: the default there). Checked on the raw body, where they are still visible.
NOT_IMPLEMENTED: dict[str, tuple[str, Any]] = {
    **_refused("structured outputs and constrained decoding are not implemented",
               "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "guided_whitespace_pattern", "allowed_token_ids", "logits_processors",
               bad_words=[]),
    **_refused("the prompt is given whole; it is never truncated", "truncate_prompt_tokens", "truncation_side",
               "prompt_embeds"),
    **_refused("only text is served", "audio", "mm_processor_kwargs", "media_io_kwargs", "return_mm_kwargs",
               modalities=["text"], mm_payload="tensors"),
    **_refused("OpenAI's hosted tools and reasoning options are not implemented", "web_search_options",
               "prediction", "reasoning_effort", "verbosity", "thinking_token_budget", include_reasoning=True),
    **_refused("not implemented", "prompt_logprobs", "logprob_token_ids", "repetition_detection", "vllm_xargs",
               use_beam_search=False, length_penalty=1.0, skip_special_tokens=True,
               spaces_between_special_tokens=True, return_tokens_as_token_ids=False, return_token_offsets=False,
               return_prompt_text=False, watermarking=False, stream_interval=1),
    **_refused("the server sets it (request ids, prefix-cache salts, transfers)", "request_id", "cache_salt",
               "kv_transfer_params", "ec_transfer_params", "session_id", routed_experts_prompt_start=0),
}
# Chat only: the prompt is the model's own chat template over the messages, the assistant turn opened.
CHAT_NOT_IMPLEMENTED = {
    **NOT_IMPLEMENTED,
    **_refused("the prompt is the model's chat template over the messages, with the assistant turn opened",
               "chat_template", "documents", chat_template_kwargs={}, add_generation_prompt=True,
               continue_final_message=False, add_special_tokens=False),
    **_refused("not implemented", echo=False),
}
COMPLETIONS_NOT_IMPLEMENTED = {
    **NOT_IMPLEMENTED,
    **_refused("a text prompt gets the tokenizer's special tokens, as vLLM gives them", add_special_tokens=True),
}


# stream_options this server takes: include_usage (a last chunk with the usage), include_obfuscation
# (OpenAI's random padding of stream events against length side channels: none is sent, which clients accept).
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def _asks_for_more(value: Any, harmless: Any) -> bool:
    """Whether a refused field's value asks for something clora does not do (`true` is not 1, nor 1 true)."""
    if harmless is NOTHING:
        return True
    if isinstance(value, bool) or isinstance(harmless, bool):
        return value is not harmless
    return value != harmless


def _finite(default: float, **bounds) -> Any:
    # strict: `true` or "0.5" is a 400, as OpenAI answers, not 1.0 or 0.5 (ints are still numbers)
    return Field(default, allow_inf_nan=False, strict=True, **bounds)


def _count(default: int | None, **bounds) -> Any:
    return Field(default, strict=True, **bounds)  # `true` is not 1


_TokenId = Annotated[int, Strict()]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    not_implemented: ClassVar[dict[str, tuple[str, Any]]] = NOT_IMPLEMENTED

    model: str = Field(min_length=1)
    max_tokens: int | None = _count(None, ge=1)
    temperature: float = _finite(1.0, ge=0, le=2)
    top_p: float = _finite(1.0, ge=0, le=1)  # 0: the most likely token only (top_k 1; vLLM refuses top_p 0)
    n: int = _count(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = _count(None, ge=-(2**63), le=2**63 - 1)  # vLLM's range (a larger one fails inside it)
    stream: bool = Field(False, strict=True)  # "true" or 1 is a 400, not a stream
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # the caller's tags, kept on the interaction event (see README)
    presence_penalty: float = _finite(0.0, ge=-2, le=2)
    frequency_penalty: float = _finite(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Strict()]] | None = None  # token id (as a JSON key) -> [-100, 100]
    # vLLM's extensions, which its OpenAI server also takes
    top_k: int = _count(0, ge=-1, le=2**31 - 1)  # 0 or -1: off; past int32 vLLM fails (and keeps the request)
    min_p: float = _finite(0.0, ge=0, le=1)
    repetition_penalty: float = _finite(1.0, gt=0)
    response_format: dict[str, Any] | None = None
    _structured: tuple[str, str] | None = PrivateAttr(None)  # structured(), as the validator found it
    # vLLM's extension: each choice (and each stream chunk's choice) carries the sampled token ids, so a
    # trainer gets exactly the tokens the model produced, not a re-tokenization of the text
    return_token_ids: bool = Field(False, strict=True)
    min_tokens: int = _count(0, ge=0)  # EOS and stop_token_ids are masked before this many tokens
    stop_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = Field(False, strict=True)
    ignore_eos: bool = Field(False, strict=True)
    # vLLM's extension: the request's place in the engine's queue. Waiting requests go in ascending order
    # (then by arrival), and when memory runs short the largest number is preempted first. 0 (every request's
    # default) goes first, so a caller may only put its own request behind others (the learner's rollouts,
    # batch jobs), never ahead of production traffic.
    priority: int = _count(0, ge=0, le=2**31 - 1)

    @model_validator(mode="before")
    @classmethod
    def _nothing_dropped(cls, data: Any) -> Any:
        """A field clora does not implement is refused, not dropped (a null one is its default, so taken)."""
        if isinstance(data, dict):
            for name, (why, harmless) in cls.not_implemented.items():
                value = data.get(name)
                if value is not None and _asks_for_more(value, harmless):
                    raise UnsupportedParameter(f"{name} is not supported by this server: {why}", param=name)
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """`"temperature": null` means the default, as OpenAI and vLLM take it (required fields stay required)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}
        return data

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} metadata keys, got {len(v)}")
        for key, value in v.items():
            if not key or len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys must be 1 to {MAX_METADATA_KEY_CHARS} characters, got {key!r}")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata[{key!r}] is longer than {MAX_METADATA_VALUE_CHARS} characters")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(v)}")
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("stop sequences must not be empty")
        if any(len(stop) > MAX_STOP_CHARS for stop in ([v] if isinstance(v, str) else v or [])):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids (OpenAI's JSON carries them as strings), values in [-100, 100]."""
        if v is not None and len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries, got {len(v)}")
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > MAX_TOKEN_ID_DIGITS:
                shown = key if len(key) <= 24 else key[:24] + "..."
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers of at most "
                                 f"{MAX_TOKEN_ID_DIGITS} digits), got {shown!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:  # NaN fails this too
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _what_clora_does_not_do(self):
        # Raised as a BadRequest (not a ValueError), so it carries its `param`; it runs once the fields are valid.
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        for key, value in (self.stream_options or {}).items():
            if value is not None and not isinstance(value, bool):
                raise BadRequest(f"stream_options.{key} must be true or false, got {value!r}", param="stream_options")
            if value and key not in STREAM_OPTIONS:
                raise UnsupportedParameter(f"stream_options.{key} is not supported by this server (it takes "
                                           f"{', '.join(STREAM_OPTIONS)})", param="stream_options")
        self._structured = self.structured()  # a response_format it cannot take is refused here, with the others
        return self

    def structured(self) -> tuple[str, str] | None:
        """The structured output `response_format` asks for, as Sampling.structured: ("json_object", "") or
        ("json_schema", the schema as JSON text, its keys in their order: the fields' order in the output);
        None for text. Anything else is a 400 naming the field."""
        fmt = self.response_format
        if fmt is None:
            return None
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind not in ("json_object", "json_schema"):
            raise UnsupportedParameter(
                f"response_format {kind!r} is not supported by this server: it takes 'text', 'json_object' and "
                "'json_schema'", param="response_format")
        # Once the JSON is whole, only its end may come: min_tokens would rule out every token (the engine fails
        # the request), and past the end the grammar no longer holds (unconstrained text would follow).
        for name in ("min_tokens", "ignore_eos"):
            if getattr(self, name):
                raise BadRequest(f"{name} cannot be set with a JSON response_format", param=name)
        if kind == "json_object":
            return ("json_object", "")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise BadRequest("response_format.json_schema must be an object with a name (and a schema)",
                             param="response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:
            return ("json_object", "")  # a name and no schema: any JSON object, as OpenAI takes it
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON Schema object",
                             param="response_format.json_schema.schema")
        if _deeper_than(schema, MAX_JSON_DEPTH):
            raise BadRequest(f"response_format.json_schema.schema is nested deeper than {MAX_JSON_DEPTH} levels",
                             param="response_format.json_schema.schema")
        text = json.dumps(schema, separators=(",", ":"))
        if len(text) > MAX_SCHEMA_CHARS:  # the engine checks it as the request goes in, on the event loop
            raise BadRequest(f"response_format.json_schema.schema is {len(text)} characters as JSON; this server "
                             f"takes at most {MAX_SCHEMA_CHARS}", param="response_format.json_schema.schema")
        return ("json_schema", text)

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def _sampling(self, max_tokens: int | None, top_logprobs: int) -> Sampling:
        return Sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p or 1.0,
            n=self.n,
            stop=self.stop_tuple(),
            seed=self.seed,
            top_logprobs=top_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            top_k=self.top_k if self.top_p else 1,
            min_p=self.min_p,
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            structured=self._structured,
        )


ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's, less the deprecated "function"


class CalledFunction(BaseModel):
    # ignored: what the SDK adds when it sends back an answer's message (`parsed_arguments`, after .parse())
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the answer gave it


class ToolCall(BaseModel):
    """An assistant turn's call, as the answer gave it."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a field OpenAI does not define is dropped

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # the speaker's, handed to the chat template as vLLM does (Qwen's ignores it)
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _no_function_turns(cls, data: Any) -> Any:
        """The deprecated function-calling turns are refused, not sent with those parts dropped (the model
        would see an empty assistant turn and an orphaned result)."""
        if isinstance(data, dict) and (data.get("role") == "function" or data.get("function_call") is not None):
            raise UnsupportedParameter("function-calling turns (role 'function', function_call) are not supported "
                                       "by this server: send tools, and their turns as tool_calls and role 'tool'",
                                       param="messages")
        return data

    @model_validator(mode="after")
    def _tool_turns(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message has tool_calls, not a {self.role!r} one")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def plain(self) -> dict[str, Any]:
        """The message as the chat template and the interaction event take it."""
        plain: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            plain["name"] = self.name
        if self.tool_calls:
            plain["content"] = self.text() if self.content is not None else None
            plain["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                    "arguments": c.function.arguments}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            plain["tool_call_id"] = self.tool_call_id
        return plain

    def text(self) -> str:
        """The content as text: a string, or the text parts of a content list joined with newlines (as vLLM
        joins them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedParameter(f"only text content parts are supported, got {part.get('type')!r}",
                                           param="messages")
            parts.append(part["text"])
        return "\n".join(parts)


class ChatRequest(_Request):
    not_implemented: ClassVar[dict[str, tuple[str, Any]]] = CHAT_NOT_IMPLEMENTED
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _count(None, ge=1)
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = _count(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    _tools: tuple[ToolUse | None] | None = PrivateAttr(None)  # (read_tools(),) once read

    @model_validator(mode="after")
    def _no_function_calling(self):
        """The deprecated `functions` are refused, not dropped (even with a choice of "none", OpenAI's model
        sees them); a `function_call` demanding a call without them too."""
        if self.functions or self.function_call not in (None, "none", "auto"):
            field = "functions" if self.functions else "function_call"
            raise UnsupportedParameter(f"{field} is not supported by this server (the deprecated form of tool "
                                       "calling): send tools and tool_choice", param=field)
        return self

    def structured(self) -> tuple[str, str] | None:
        """`response_format`'s structured output, or the call a `tool_choice` of "required" or a named function
        forces (serving/tools.py); both at once is a 400, as are min_tokens and ignore_eos with a forced call."""
        use, fmt = self.tool_use, super().structured()
        if use is None or not use.forced:
            return fmt
        if fmt is not None:
            raise BadRequest("response_format cannot be a JSON format with a tool_choice that forces a call",
                             param="response_format")
        for name in ("min_tokens", "ignore_eos"):
            if getattr(self, name):
                raise BadRequest(f"{name} cannot be set with a tool_choice that forces a call", param=name)
        schema = use.schema()
        if len(schema) > MAX_SCHEMA_CHARS:
            raise BadRequest(f"the forced call's schema is {len(schema)} characters as JSON; this server takes at most "
                             f"{MAX_SCHEMA_CHARS}", param="tools")
        return ("tool_calls", schema)

    @property
    def tool_use(self) -> ToolUse | None:
        """The request's tools and how its answer is read; None without tools. Read (and checked: BadRequest)
        on first use, which the model's validation makes (`structured`)."""
        if self._tools is None:
            if _deeper_than(self.tools, MAX_JSON_DEPTH):
                raise BadRequest(f"tools are nested deeper than {MAX_JSON_DEPTH} levels", param="tools")
            self._tools = (read_tools(self.tools, self.tool_choice, self.parallel_tool_calls),)
        return self._tools[0]

    @model_validator(mode="after")
    def _known_roles(self):
        """OpenAI's roles only, as OpenAI checks them: a chat template skips a role it does not know (Qwen's
        does), so "bot" or "User" would be answered as if the message had not been sent. `param` is OpenAI's
        path to it ("messages.[1].role")."""
        for i, message in enumerate(self.messages):
            if message.role not in ROLES:
                shown = message.role if len(message.role) <= 64 else message.role[:64] + "..."  # not echoed whole
                supported = ", ".join(f"'{r}'" for r in ROLES[:-1]) + f", and '{ROLES[-1]}'"
                raise BadRequest(f"Invalid value: {shown!r}. Supported values are: {supported}.",
                                 param=f"messages.[{i}].role")
        return self

    def plain_messages(self) -> list[dict[str, Any]]:
        return [m.plain() for m in self.messages]

    def sampling(self, default_max_tokens: int | None = None) -> Sampling:
        """`default_max_tokens` applies when the request sets no length; None: the room the context leaves."""
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else 0)


class CompletionRequest(_Request):
    not_implemented: ClassVar[dict[str, tuple[str, Any]]] = COMPLETIONS_NOT_IMPLEMENTED
    prompt: str | list[str] | list[_TokenId] | list[list[_TokenId]]  # [true, false] is no prompt of ids 1, 0
    logprobs: int | None = _count(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(False, strict=True)
    suffix: str | None = None
    best_of: int | None = _count(None, ge=1)

    @model_validator(mode="after")
    def _completions_only(self):
        if self.echo:
            raise UnsupportedParameter("echo is not supported", param="echo")
        if self.suffix:
            raise UnsupportedParameter("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter(
                f"best_of ({self.best_of}) must equal n ({self.n}): this server returns every sampled completion "
                "and ranks none", param="best_of")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (a batch is several; each gets n choices)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts or any(len(x) == 0 for x in prompts if isinstance(x, list)):
            raise BadRequest("the prompt is empty", param="prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise BadRequest(
                f"{len(prompts)} prompts x n={self.n} is {len(prompts) * self.n} completions; at most {MAX_CHOICES} "
                "per request", param="prompt")
        return prompts

    def sampling(self, default_max_tokens: int | None = None) -> Sampling:
        """`default_max_tokens` applies when the request sets no length; None: COMPLETIONS_DEFAULT_MAX_TOKENS."""
        return self._sampling(self.max_tokens or default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, self.logprobs or 0)


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=256)
    score: float = Field(ge=-1, le=1, allow_inf_nan=False, strict=True)  # `false` is not a score of 0
    source: str | None = Field(None, min_length=1, max_length=128)  # leave it out for the default, "http"


# msgspec's parser takes strict JSON in valid UTF-8 only, so what it accepts holds no lone surrogate (the
# idea of ingest/events.py); it is also faster than the standard library's.
_strict_loads = msgspec.json.Decoder().decode
# After json.loads a surrogate left in a string is unpaired: it combines an escaped pair into one character.
_SURROGATE = re.compile("[\ud800-\udfff]")
# What in a body's text can become one: a surrogate's escape, or a surrogate itself (decoded with surrogatepass).
_SURROGATE_IN_TEXT = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|[\ud800-\udfff]")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests lists and objects more than `limit` deep (iterative: any depth)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        if depth > limit:
            return True
        stack.extend((item, depth + 1) for item in items)
    return False


def _loads(raw: bytes) -> Any:
    """The body's JSON value. BadRequest when it is not JSON, nests too deeply, or holds a string that is not
    text: JSON may escape half of a UTF-16 pair ("\\udc00"), which Python's parser takes, but a lone
    surrogate fails deep inside later (vLLM's stop strings, the tokenizer, the interaction event's
    encoding), after the engine holds the request; it is refused here instead, for every body route."""
    try:
        return _strict_loads(raw)
    except (msgspec.DecodeError, RecursionError):
        pass  # the standard library's parser decides what is wrong (and takes NaN, a BOM, UTF-16, as before)
    try:
        # As json.loads(bytes) reads them: UTF-8, -16 or -32 by the first bytes, surrogates passed through.
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        data = json.loads(text)
    except RecursionError:  # "[" * 100000: Python's parser recurses per level
        raise BadRequest("the request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not JSON: {e}") from e
    # Walked only when the text can hold one (an escaped or an encoded surrogate): any body msgspec refuses
    # (a NaN in a field serving ignores will do) would otherwise cost a walk of its every value.
    found = _lone_surrogate(data) if _SURROGATE_IN_TEXT.search(text) else None
    if found is not None:
        path, text = found
        where = ".".join(str(p) if isinstance(p, int) else _shown(p) for p in path) or "body"
        at = _SURROGATE.search(text)
        param = path[0] if path and isinstance(path[0], str) and not _SURROGATE.search(path[0]) else None
        raise BadRequest(f"invalid request: {where}: the string holds an unpaired UTF-16 surrogate "
                         f"{at.group()!r} at character {at.start()}; strings must be valid Unicode", param=param)
    return data


def _shown(key: str) -> str:
    """A key as a path step; repr'd when it holds a surrogate (repr escapes it, so the message stays text)."""
    return repr(key) if _SURROGATE.search(key) else key


def _lone_surrogate(value: Any) -> tuple[tuple[str | int, ...], str] | None:
    """(its path, the string) of a string or key holding a surrogate (a dict's keys are looked at before its
    values); None when there is none. Iterative: a value as deep as json.loads allows would overflow a
    recursive walk. Each value is kept with the index of its step (its parent's index and its key) in
    `steps`, and a path is put together only for the one found: copying every value's path would cost the
    body's size times its depth."""
    steps: list[tuple[int, str | int]] = []

    def path(at: int) -> tuple[str | int, ...]:
        keys = []
        while at >= 0:
            at, key = steps[at]
            keys.append(key)
        return tuple(reversed(keys))

    stack: list[tuple[int, Any]] = [(-1, value)]
    while stack:
        at, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path(at), v
        elif isinstance(v, dict):
            for key in v:
                if _SURROGATE.search(key):
                    steps.append((at, key))
                    return path(len(steps) - 1), key
            for key, item in reversed(v.items()):
                steps.append((at, key))
                stack.append((len(steps) - 1, item))
        elif isinstance(v, list):
            for i in range(len(v) - 1, -1, -1):
                steps.append((at, i))
                stack.append((len(steps) - 1, v[i]))
    return None


# What a completions body cut short shows of its prompt (`lists_several_prompts`): the "prompt" key and an
# opening "[" (a string can only read `"prompt"` as a whole token: quotes inside a string are escaped), and
# the first element of that list, a string or a list of token ids, ending; possessive, so a string cut short
# fails without backtracking.
_PROMPT_LIST = re.compile(rb'"prompt"\s*+:\s*+\[\s*+')
_FIRST_PROMPT = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|\[[^\]]*+\]', re.DOTALL)
_NEXT_ELEMENT = re.compile(rb"\s*+,")


def lists_several_prompts(head: bytes) -> bool:
    """Whether the start of a /v1/completions body (`head`, cut anywhere) shows a batch: a "prompt" that is a
    list whose first prompt, text or token ids, ends inside `head` and has another after it. A single prompt,
    a list of token ids, a first prompt that runs past `head`, or no "prompt" in it at all: False. For telling
    a batch too large from a prompt too long when the body is past the size limit, so never parsed."""
    key = _PROMPT_LIST.search(head)
    first = _FIRST_PROMPT.match(head, key.end()) if key else None
    return first is not None and _NEXT_ELEMENT.match(head, first.end()) is not None


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """Bytes of a JSON body -> the request model; one BadRequest listing every problem otherwise."""
    return validate(model, loads_object(raw))


def loads_object(raw: bytes) -> dict[str, Any]:
    """Bytes of a JSON body -> its object (checked as `_loads` checks it); a BadRequest otherwise."""
    data = _loads(raw or b"null")
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """A request's JSON object -> the request model; one BadRequest listing every problem otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg'].removeprefix('Value error, ')}"
            for err in errors
        )
        param = next((str(err["loc"][0]) for err in errors if err["loc"]), None)
        raise BadRequest(f"invalid request: {problems}", param=param) from None


# ---------------------------------------------------------------------------------------------------------
# Responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(raw: bytes) -> str:
    """A token as OpenAI writes it: its text, or "bytes:\\xe4\\xbd" when its bytes are not whole UTF-8
    characters (part of one split over tokens)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": token_text(lp.raw),
                "logprob": lp.logprob,
                "bytes": list(lp.raw),
                "top_logprobs": [{"token": token_text(raw), "logprob": v, "bytes": list(raw)} for _, raw, v in lp.top],
            }
            for lp in logprobs
        ]
    }


def _top_by_token(top: tuple[tuple[int, bytes, float], ...]) -> dict[str, float]:
    """Completions' {token: logprob} of the alternatives. Two with the same bytes (a vocabulary may spell a
    byte twice) stay apart: the later one is keyed "token_id:<id>", as vLLM names a token by its id."""
    out: dict[str, float] = {}
    for token_id, raw, logprob in top:
        key = token_text(raw)
        out[f"token_id:{token_id}" if key in out else key] = logprob
    return out


def completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """Completions' log-probs. Each position's `top_logprobs` holds the sampled token too, as OpenAI's and
    vLLM's do (`logprobs` + 1 entries when it is not among the best): clients read
    `top_logprobs[i][tokens[i]]`."""
    return {
        "tokens": [token_text(lp.raw) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [_top_by_token(_with_sampled(lp)) for lp in logprobs],
        "text_offset": [lp.text_offset for lp in logprobs],
    }


def _with_sampled(lp: TokenLogprob) -> tuple[tuple[int, bytes, float], ...]:
    if any(token_id == lp.token_id for token_id, _, _ in lp.top):
        return lp.top
    return (*lp.top, (lp.token_id, lp.raw, lp.logprob))


def _with_token_ids(choice: dict[str, Any], token_ids: list[int], wanted: bool,
                    prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    if wanted:
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = list(prompt_token_ids)
        choice["token_ids"] = list(token_ids)
    return choice


def chat_response(
    response_id: str, model: str, choices: list[Choice], prompt_tokens: int, with_logprobs: bool,
    token_ids: bool = False, prompt_token_ids: Callable[[int], list[int]] | None = None,
    answers: list[Answer] | None = None,
) -> dict[str, Any]:
    """`prompt_token_ids(choice index)`: with `token_ids`, the prompt's ids, as vLLM answers them (top level).
    `answers`: each choice's text as the request's tools read it (serving/tools.py); None: the text is the content."""
    return {
        **({"prompt_token_ids": list(prompt_token_ids(0))} if token_ids and prompt_token_ids else {}),
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_chat_choice(c, with_logprobs, token_ids, answers[i] if answers else None)
                    for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def _chat_choice(c: Choice, with_logprobs: bool, token_ids: bool, answer: Answer | None) -> dict[str, Any]:
    content, calls, finish_reason = answer or (c.text, [], c.finish_reason)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return _with_token_ids({
        "index": c.index,
        "message": message,
        "logprobs": chat_logprobs(c.logprobs) if with_logprobs else None,
        "finish_reason": finish_reason,
    }, c.token_ids, token_ids)


def completion_response(
    response_id: str, model: str, choices: list[Choice], prompt_tokens: int, with_logprobs: bool,
    token_ids: bool = False, prompt_token_ids: Callable[[int], list[int]] | None = None,
) -> dict[str, Any]:
    """`prompt_token_ids(choice index)`: with `token_ids`, each choice's prompt's ids, as vLLM answers them."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            _with_token_ids({
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs) if with_logprobs else None,
                "finish_reason": c.finish_reason,
            }, c.token_ids, token_ids, prompt_token_ids and prompt_token_ids(c.index))
            for c in choices
        ],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def chat_chunk(
    response_id: str, model: str, created: int, delta: Delta | None, *, index: int = 0, role: bool = False,
    with_logprobs: bool = False, token_ids: bool = False, prompt_token_ids: list[int] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`: the opening one (`role`), a content delta, or (delta None) usage only.
    `prompt_token_ids` (the stream's first chunk, with `token_ids`): the prompt's ids, as vLLM sends them.
    `tool_calls`: the delta's calls, whole (tools.stream_calls); its content then only if it has some."""
    if delta is None and not role:
        choices = []
    else:
        content: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": delta.text}
        if tool_calls:
            content = {"content": delta.text} if delta.text else {}
            content["tool_calls"] = tool_calls
        choices = [
            _with_token_ids({
                "index": index if delta is None else delta.index,
                "delta": content,
                "logprobs": chat_logprobs(delta.logprobs) if with_logprobs and delta is not None else None,
                "finish_reason": None if delta is None else delta.finish_reason,
            }, [] if delta is None else delta.token_ids, token_ids and not role)
        ]
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if token_ids and prompt_token_ids is not None:
        chunk["prompt_token_ids"] = list(prompt_token_ids)
    return chunk


def completion_chunk(
    response_id: str, model: str, created: int, delta: Delta | None, *, with_logprobs: bool = False,
    token_ids: bool = False, prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """`prompt_token_ids` (each choice's first chunk, with `token_ids`): its prompt's ids, as vLLM sends them."""
    choices = []
    if delta is not None:
        choices = [
            _with_token_ids({
                "index": delta.index,
                "text": delta.text,
                "logprobs": completion_logprobs(delta.logprobs) if with_logprobs else None,
                "finish_reason": delta.finish_reason,
            }, delta.token_ids, token_ids, prompt_token_ids)
        ]
    return {"id": response_id, "object": "text_completion", "created": created, "model": model, "choices": choices}


_encode = msgspec.json.Encoder().encode  # compact UTF-8 JSON, ~10x the standard library's speed per chunk


def sse(data: dict[str, Any] | Literal["[DONE]"]) -> bytes:
    """One server-sent event, as OpenAI streams them (encoded once per streamed chunk, on the event loop)."""
    if isinstance(data, str):
        return b"data: " + data.encode() + b"\n\n"
    return b"data: " + _encode(data) + b"\n\n"
