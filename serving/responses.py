"""OpenAI's Responses API (`POST /v1/responses`), served by the chat path.

A Responses request is read into a chat request: `instructions` become the first (system) message; `input`
is a string (one user message) or a list of items: messages (`role` user, assistant, system or developer;
`content` a string or `input_text`/`output_text` parts), `function_call` items (an assistant turn's calls,
joined to the assistant message just before them) and `function_call_output` items (a `tool` turn). Function
`tools` (Responses' flat form), `tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`,
`top_p`, `text.format` (text, JSON object, JSON schema), `include: ["message.output_text.logprobs"]` with
`top_logprobs`, `metadata`, `user` and `stream` map onto their chat fields, so everything the chat path
does (the chat template, tool calling, structured outputs, adapters, the interaction event the learner
trains on) applies as it is; the answer is one `response`
object: a `message` item with the text, then one `function_call` item per call. A stream is Responses' typed
events (`response.created`, `response.output_text.delta`, ..., `response.completed`), each with its
`sequence_number`; a failure after the first event is an `error` event then `response.failed`.

Nothing is stored (the answer says `"store": false`): `previous_response_id`, `conversation` and retrieving
a response are refused or absent, so a conversation goes back whole in `input`, as with chat. Refused with a
400 naming the field: hosted tools (web search, file search, ...), input items other than the three above
(images, files, reasoning, item references), `background: true`, `prompt` templates, `reasoning` (but
effort "none"), `truncation` "auto", `max_tool_calls`. `include` values other than log-probabilities ask for output
this server has none of (hosted tools' results, encrypted reasoning) and add nothing. Unknown fields are
ignored, as in chat.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import PrivateAttr

from serving import protocol
from serving.engine import Choice
from serving.errors import BadRequest, UnsupportedParameter
from serving.tools import Answer

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
# Responses fields that ask for what this server does not do: refused unless null (or the value named).
REFUSED = {
    "previous_response_id": "responses are not stored: send the whole conversation in input",
    "conversation": "conversations are not stored: send the whole conversation in input",
    "background": "responses run in the foreground only",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "max_tool_calls": "the number of tool calls is not limited",
}
HARMLESS = {"background": False}
LOGPROBS = "message.output_text.logprobs"  # the one `include` value served: each output text token's log-prob
# The chat request's names of fields a Responses request names otherwise (in a 400's message and param).
CHAT_NAMES = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens", "messages": "input"}
# Fields taken as they are by the chat path (vLLM's sampling extensions among them).
PASSED = ("model", "temperature", "top_p", "stream", "metadata", "user", "parallel_tool_calls", "seed", "top_k",
          "min_p", "repetition_penalty", "priority")


class ResponsesRequest(protocol.ChatRequest):
    """The chat request a Responses request reads as; `echo` holds what the answer repeats of the request."""

    _echo: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def echo(self) -> dict[str, Any]:
        return self._echo


def parse(raw: bytes) -> ResponsesRequest:
    """A /v1/responses body -> its chat request; a 400 naming the Responses field otherwise."""
    data = protocol.loads_object(raw)
    for name, why in REFUSED.items():
        value = data.get(name)
        if value is not None and value != HARMLESS.get(name, None):
            raise UnsupportedParameter(f"{name} is not supported by this server: {why}", param=name)
    include = data.get("include")
    if include is not None and not isinstance(include, list):
        raise BadRequest("include must be a list", param="include")
    reasoning = data.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, "none")
                                  or reasoning.get("summary") is not None):
        raise UnsupportedParameter("reasoning is not supported by this server (its models do not reason "
                                   "apart): only effort \"none\" or null", param="reasoning")
    if data.get("truncation") not in (None, "disabled"):
        raise UnsupportedParameter("truncation is not supported by this server: a prompt past the context is a 400 "
                                   "(truncation \"disabled\")", param="truncation")
    chat: dict[str, Any] = {k: data[k] for k in PASSED if k in data}
    chat["messages"] = _messages(data.get("instructions"), data.get("input"))
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    top = data.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= protocol.MAX_TOP_LOGPROBS):
        raise BadRequest(f"top_logprobs must be an integer from 0 to {protocol.MAX_TOP_LOGPROBS}", param="top_logprobs")
    if LOGPROBS in (include or ()):  # top_logprobs alone returns nothing, as OpenAI answers it
        chat["logprobs"] = True
        chat["top_logprobs"] = top
    if data.get("tools") is not None:
        chat["tools"] = _tools(data["tools"])
    if data.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(data["tool_choice"])
    given_format = _given_format(data.get("text"))
    text_format = _text_format(given_format)
    if text_format is not None:
        chat["response_format"] = text_format
    try:
        request = protocol.validate(ResponsesRequest, chat)
    except BadRequest as e:  # the fields named as this request names them
        message, param = e.message, e.param
        for chat_name, name in CHAT_NAMES.items():
            message = message.replace(chat_name, name)
            if param is not None and param.startswith(chat_name):
                param = name + param.removeprefix(chat_name)
        raise type(e)(message, param=param) from None
    request._echo = {
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": data.get("metadata") or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tool_choice": data.get("tool_choice") or ("auto" if data.get("tools") else "none"),
        "tools": data.get("tools") or [],
        "top_logprobs": data.get("top_logprobs") or 0,
        "text": {"format": given_format or {"type": "text"}},
        "user": data.get("user"),
    }
    return request


def _messages(instructions: Any, given: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise UnsupportedParameter("instructions must be a string here", param="instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise BadRequest("input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:64]!r}", param="input")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of the turn whose text came just before
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _content(output, f"{where}.output")})
        else:
            raise UnsupportedParameter(f"{where}: items of type {str(kind)[:64]!r} are not supported by this server "
                                       "(it takes message, function_call and function_call_output)", param="input")
    return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise BadRequest(f"{where}.{key} must be a{' non-empty' if key != 'arguments' else ''} string", param="input")
    return value


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or text parts (chat's form of them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise UnsupportedParameter(f"{where}.content[{j}]: only input_text and output_text parts are supported by "
                                       f"this server, got {str(kind)[:64]!r}", param="input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise UnsupportedParameter(f"tools[{i}]: only function tools are supported by this server, got "
                                       f"{str(kind)[:64]!r}", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise UnsupportedParameter(f"tool_choice {str(kind)[:64]!r} is not supported by this server (it takes none, auto, "
                               "required, or a function)", param="tool_choice")


def _given_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as given (None: not given); a `text` or format that is no object is a 400."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("text must be an object", param="text")
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise BadRequest("text.format must be an object", param="text.format")
    return fmt


def _text_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat request's response_format for a `text.format`."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":  # flat in Responses, nested in chat
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return fmt  # json_object; anything else is refused by the chat request, naming response_format


# ---------------------------------------------------------------------------------------------------------
# The answer


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _within(logprobs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The first of `logprobs` whose tokens' bytes make up `text` (a call's tokens follow them)."""
    room, kept = len(text.encode()), []
    for entry in logprobs:
        room -= len(entry["bytes"])
        if room < 0:
            break
        kept.append(entry)
    return kept


def _message_id(response_id: str, k: int) -> str:
    """The id of the answer's k-th message item (k from 1)."""
    return f"msg_{response_id.removeprefix('resp_')}" + (f"_{k}" if k > 1 else "")


def _call_item(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments, "status": status}


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(response_id: str, model: str, created: float, body: ResponsesRequest, *,
                    output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
                    incomplete: dict[str, str] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "completed_at": time.time() if status != "in_progress" else None,
        "error": error, "incomplete_details": incomplete, "model": model, "output": output, "usage": usage,
        "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
        "background": False, **body.echo,
    }


def response(response_id: str, model: str, choices: list[Choice], prompt_tokens: int, with_logprobs: bool,
             token_ids: bool = False, prompt_token_ids: Any = None, *, answers: list[Answer] | None,
             body: ResponsesRequest) -> dict[str, Any]:
    """The `response` object of a finished request (one choice): chat_response's arguments, and the body."""
    (choice,) = choices
    content, calls, finish_reason = answers[0] if answers else (choice.text, [], choice.finish_reason)
    status, incomplete = _status(finish_reason)
    output = []
    if content or not calls:  # log-probs as chat's: each token's, with its bytes and its top alternatives
        logprobs = protocol.chat_logprobs(choice.logprobs)["content"] if with_logprobs else []
        if calls:  # the message's text is what came before the first call: its tokens only
            logprobs = _within(logprobs, content or "")
        output.append(_message_item(_message_id(response_id, 1), content or "", status, logprobs))
    output += [_call_item(call, "completed") for call in calls]
    return response_object(response_id, model, time.time(), body, output=output, status=status,
                           usage=_usage(prompt_tokens, len(choice.token_ids)), incomplete=incomplete)


class ResponseEvents:
    """A stream's chat chunks (api.py builds them as for chat) -> Responses' typed events, as SSE bytes."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest) -> None:
        self.response_id, self.model, self.body = response_id, model, body
        self.created = time.time()
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the finished items
        self.text: str | None = None  # the message item's text while it is open
        self.logprobs: list[dict[str, Any]] = []  # and its tokens' log-probs, when asked for
        self.message_id = ""  # the open message item's (each has its own: _open_text)
        self.messages = 0
        self.finish_reason: str | None = None

    def _event(self, kind: str, **data: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\n".encode() + protocol.sse(data)

    def _snapshot(self, status: str, **more: Any) -> dict[str, Any]:
        return response_object(self.response_id, self.model, self.created, self.body, output=list(self.output),
                               status=status, usage=more.pop("usage", None), **more)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events one chat chunk makes (the opening one, a text delta, calls, the finish)."""
        out: list[bytes] = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("role"):
                out += [self._event("response.created", response=self._snapshot("in_progress")),
                        self._event("response.in_progress", response=self._snapshot("in_progress"))]
                continue
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("tool_calls"):  # the held text's tokens come with the calls: the text's only
                logprobs = _within(logprobs, delta.get("content") or "")
            if delta.get("content") or logprobs:
                out += self._text(delta.get("content") or "", logprobs)
            for call in delta.get("tool_calls") or []:
                out += self._close_text()
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _open_text(self) -> list[bytes]:
        index, self.text, self.logprobs = len(self.output), "", []
        self.messages += 1
        self.message_id = _message_id(self.response_id, self.messages)
        return [self._event("response.output_item.added", output_index=index,
                            item={**_message_item(self.message_id, "", "in_progress"), "content": []}),
                self._event("response.content_part.added", item_id=self.message_id, output_index=index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []})]

    def _text(self, piece: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        out = self._open_text() if self.text is None else []
        self.text += piece
        self.logprobs += logprobs
        out.append(self._event("response.output_text.delta", item_id=self.message_id, output_index=len(self.output),
                               content_index=0, delta=piece, logprobs=logprobs))
        return out

    def _close_text(self, status: str = "completed") -> list[bytes]:
        if self.text is None:
            return []
        index, item = len(self.output), _message_item(self.message_id, self.text, status, self.logprobs)
        part = item["content"][0]
        out = [self._event("response.output_text.done", item_id=self.message_id, output_index=index,
                           content_index=0, text=self.text, logprobs=self.logprobs),
               self._event("response.content_part.done", item_id=self.message_id, output_index=index,
                           content_index=0, part=part),
               self._event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.text = None
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        index, item = len(self.output), _call_item(call, "completed")
        out = [self._event("response.output_item.added", output_index=index,
                           item=_call_item(call, "in_progress", arguments="")),
               self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                           delta=item["arguments"]),
               self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
               self._event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        return out

    def done(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last events: the message closed, and the response whole (completed, or incomplete at the length)."""
        status, incomplete = _status(self.finish_reason)
        # nothing at all was generated: an empty message, as the answer of a request not streamed has
        opened = b"".join(self._open_text()) if self.text is None and not self.output else b""
        closed = b"".join(self._close_text(status))
        final = self._snapshot(status, usage=_usage(prompt_tokens, completion_tokens), incomplete=incomplete)
        return opened + closed + self._event(f"response.{status}", response=final)

    def failed(self, error: dict[str, Any]) -> bytes:
        """A failure after the stream began (`error`: an OpenAI error body): `error`, then `response.failed`."""
        detail = error.get("error", error)
        code, message = detail.get("code") or detail.get("type") or "server_error", detail.get("message", "")
        # the response's error code is one of Responses' own few; the event before it keeps clora's
        kind = "rate_limit_exceeded" if code == "rate_limit_exceeded" else "server_error"
        return (self._event("error", code=code, message=message, param=detail.get("param"))
                + self._event("response.failed", response=self._snapshot("failed", error={"code": kind,
                                                                                          "message": message})))
