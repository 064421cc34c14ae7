"""Tool calling: a chat request's tools, how the model's text becomes OpenAI's `tool_calls`, and the stream.

A request's `tools` go to the model's chat template (which shows them to the model; serving refuses tools
for a template that would not), and its `tool_choice` decides how the answer is read:

- "none": the text is the content, whatever it holds.
- "auto" (the default with tools): the model writes its calls in the Hermes format that Qwen's templates
  teach, each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the last one may stop before its
  closing tag, as vLLM reads it); the text before the first one is the content, and text after a call is
  left out of the answer, as vLLM leaves it. A block that is not such a call (not JSON, arguments that are
  not an object, a function the request did not define) means no calls: the whole text is the content, as
  vLLM's parser answers.
- "required" or a named function: the engine's structured outputs force the call (a JSON array of
  `{"name", "parameters"}`, or the named function's arguments), as vLLM forces them; the text is the call.

The event keeps the model's text as it came (the learner trains on the tokens the model produced); only
the answer shows calls. Pure functions and one small state machine, checked without an engine.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from ingest.events import json_object
from serving.engine import Delta
from serving.errors import BadRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")
# Each closed call, or one left open at the end (a model that stops without the closing tag, as vLLM reads it).
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE) + "|" + re.escape(OPEN) + r"(.*)\Z", re.DOTALL)


# A choice's text as its answer reads it: (content, tool_calls, finish_reason). Read once per choice (each call
# gets a fresh id), then shown to the client and recorded in the event.
Answer = tuple[str | None, list[dict[str, Any]], str | None]


@dataclass(frozen=True)
class ToolUse:
    """A request's tools (OpenAI's definitions, as the template takes them) and how its answer is read:
    `choice` is "none", "auto", "required" or "function" (the one `name` names)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether the answer may hold calls."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the engine forces the call (its text is the call, as JSON)."""
        return self.choice in ("required", "function")

    def schema(self) -> str | None:
        """The JSON schema (as JSON text) the engine forces for "required" or a named function; else None.
        "required"'s list nests each tool's parameters, so their `$defs` (every nested pydantic model's) move
        to the list's root, where their `$ref`s ("#/$defs/...") point, as vLLM moves them; two tools defining
        one name differently are a 400."""
        if self.choice == "function":
            return json.dumps(_parameters(self._tool(self.name)), separators=(",", ":"))
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        options = []
        for t in self.tools:
            parameters = dict(_parameters(t))
            for name, definition in (parameters.pop("$defs", None) or {}).items():
                if defs.setdefault(name, definition) != definition:
                    raise BadRequest(f"two tools define $defs.{name} differently; tool_choice \"required\" puts "
                                     "every tool's $defs in one schema", param="tools")
            options.append({"type": "object",
                            "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                           "parameters": parameters},
                            "required": ["name", "parameters"], "additionalProperties": False})
        array = {"type": "array", "minItems": 1, "items": {"anyOf": options},
                 **({} if self.parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})}
        return json.dumps(array, separators=(",", ":"))

    def answer(self, text: str, finish_reason: str | None) -> Answer:
        """(content, tool_calls, finish_reason) of a whole choice's text."""
        if not self.calls:
            return text, [], finish_reason
        if self.choice == "function":  # the text is the arguments (cut short only at the length limit)
            return None, [_call(self.name, text)], finish_reason
        if self.choice == "required":
            found = _listed(text, self._names())
        else:
            found = _hermes(text, self._names())
        if found is None:
            return text, [], finish_reason
        content, calls = found
        if not self.parallel:
            calls = calls[:1]
        return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason

    def _names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def read_tools(tools: list[Any] | None, choice: Any, parallel: bool | None) -> ToolUse | None:
    """The request's ToolUse (None without tools); BadRequest naming the field for what OpenAI refuses."""
    if choice is not None and not tools and choice not in ("none", "auto"):
        raise BadRequest(f"tool_choice {_shown(choice)} needs tools to call; send tools, or leave tool_choice out",
                         param="tool_choice")
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    defined = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{"name": ...}}}} (only function '
                             "tools are served)", param="tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got "
                             f"{_shown(name)}", param="tools")
        if any(t["function"]["name"] == name for t in defined):
            raise BadRequest(f"{where}: a second function named {name!r}", param="tools")
        description, parameters = fn.get("description"), fn.get("parameters")
        if not isinstance(description, (str, type(None))):
            raise BadRequest(f"{where}.function.description must be a string", param="tools")
        if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
            raise BadRequest(f"{where}.function.parameters must be a JSON Schema of an object (the call's arguments)",
                             param="tools")
        # what the template shows the model: OpenAI's fields only (a client's own keys stay out of the prompt)
        defined.append({"type": "function", "function": {"name": name, **({"description": description}
                        if description is not None else {}), **({"parameters": parameters} if parameters else {})}})
    use = ToolUse(tuple(defined), "auto", None, parallel is not False)
    if choice is None or choice in CHOICES:
        return replace(use, choice=choice or "auto")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or not any(t["function"]["name"] == name for t in defined):
            raise BadRequest(f"tool_choice names {_shown(name)}, which is not among the tools", param="tool_choice")
        return replace(use, choice="function", name=name)
    raise BadRequest(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                     f'{{"name": ...}}}}, got {_shown(choice)}', param="tool_choice")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:64] + "..."


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# Strict JSON: no NaN or Infinity (no client's parser takes them), and no escaped lone surrogate ("\\ud800"),
# which unescaped could not be sent (or rendered, when a client sends the call back); msgspec refuses both.
# Nested past the interpreter's depth it raises RecursionError: not a call either.
_strict = msgspec.json.Decoder().decode
NOT_JSON = (ValueError, RecursionError)  # msgspec.DecodeError is a ValueError


def _arguments(value: Any) -> str | None:
    """A call's arguments as OpenAI's JSON text of an object: an object is written out, a string kept when it
    is the strict JSON of one; None for anything else."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return value if json_object(value) is not None else None


def _named(call: Any, names: set[str]) -> str | None:
    """The called function's name, when `call` names one of `names`."""
    name = call.get("name") if isinstance(call, dict) else None
    return name if isinstance(name, str) and name in names else None


def _hermes(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content, calls) of text holding Hermes calls; None when it holds none, or one that is not a call."""
    start = text.find(OPEN)
    if start < 0:
        return None
    calls = []
    for match in _CALL.finditer(text, start):
        try:
            call = _strict(match.group(1) if match.group(1) is not None else match.group(2))
        except NOT_JSON:
            return None
        name = _named(call, names)
        arguments = _arguments(call.get("arguments", {})) if name else None
        if arguments is None:
            return None
        calls.append(_call(name, arguments))
    return text[:start] or None, calls


def _listed(text: str, names: set[str]) -> tuple[None, list[dict[str, Any]]] | None:
    """The calls of "required"'s JSON array; None when it is not whole (cut at the length limit)."""
    try:
        listed = _strict(text)
    except NOT_JSON:
        return None
    if not isinstance(listed, list) or not listed:
        return None
    calls = []
    for item in listed:
        name = _named(item, names)
        arguments = _arguments(item.get("parameters")) if name else None
        if arguments is None:
            return None
        calls.append(_call(name, arguments))
    return None, calls


def stream_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as a stream chunk's `tool_calls` (each with its index)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


class ToolStream:
    """One choice's deltas as its stream shows them with tools. Content goes out as it comes until a call may
    be starting: text that is, or may grow into, "<tool_call>" is held (a forced call's is held whole), and
    at the end the held text is read with everything before it: its calls go out in one chunk, with the
    content not yet sent and the held tokens' log-probs and ids; text that held no call goes out as content."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.held: list[Delta] = []
        self.calling = use.forced
        self.answer: Answer | None = None  # the whole text's, once its last delta is in

    def feed(self, delta: Delta) -> list[tuple[Delta, list[dict[str, Any]] | None]]:
        """What to send for `delta`: (delta, its tool_calls or None) pairs, none while text is held."""
        self.text += delta.text
        self.held.append(delta)
        if delta.finish_reason is not None:
            return self._end(delta.finish_reason)
        if self.calling or OPEN in self.text[self.sent:]:
            self.calling = True
            return []
        # Send the held deltas whose text ends before a tail that could begin "<tool_call>".
        tail = next((k for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1)
                     if OPEN.startswith(self.text[-k:])), 0)
        free, end, upto = len(self.text) - tail, self.sent, 0
        for i, held in enumerate(self.held):
            if end + len(held.text) > free:
                break
            end += len(held.text)
            upto = i + 1
        if not upto:
            return []
        out, self.held = _joined(self.held[:upto], None, self.text[self.sent:end]), self.held[upto:]
        self.sent = end
        return [(out, None)]

    def _end(self, finish_reason: str) -> list[tuple[Delta, list[dict[str, Any]] | None]]:
        """The held text, as content or as calls; calls are followed by a chunk of their own with the finish
        reason, as OpenAI sends it (the SDK's stream events close the last call on that chunk)."""
        self.answer = content, calls, finish = self.use.answer(self.text, finish_reason)
        held, self.held = self.held, []
        if not calls:
            return [(_joined(held, finish_reason, self.text[self.sent:]), None)]
        rest = (content or "")[self.sent:]
        self.sent = len(self.text)
        return [(_joined(held, None, rest), stream_calls(calls)), (Delta(held[0].index, "", [], [], finish), None)]


def _joined(deltas: list[Delta], finish_reason: str | None, text: str) -> Delta:
    """One delta of `deltas`' tokens and log-probs, with `text` (what of theirs is sent as content)."""
    return Delta(deltas[0].index, text, [t for d in deltas for t in d.token_ids],
                 [lp for d in deltas for lp in d.logprobs], finish_reason)
