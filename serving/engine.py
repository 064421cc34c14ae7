"""The one vLLM engine of a serving process: built from plain arguments, driven by token ids.

Every tenant's request goes into the same `AsyncLLM` (vLLM's V1 engine), each with its own LoRA adapter
or none; the engine's scheduler batches them together and its punica kernels (PunicaWrapperCPU here,
SGMV/BGMV on GPU) apply each row's adapter. At most `max_loras` distinct adapters share one engine
step; requests for more wait in the scheduler's queue (they are never refused for it), and up to
`max_cpu_loras` adapters stay loaded between uses (older ones are reloaded from their path on demand).

This module speaks the engine's language only: token ids in; text, token ids, the log-probability of
every sampled token (always; RL needs them) and a finish reason out, in one piece (`generate`) or as
deltas (`stream`). Chat templates are applied here too, because the tokenizer is the engine's; they and
tokenization run in one worker thread (`chat_prompt`, `text_prompt`, `ids_prompt`), never on the event
loop, where one tenant's long prompt would stall every stream, and with one job per tenant queued at a
time, so a tenant's flood of long prompts queues behind itself; text obviously longer than the context
(more than `MAX_CHARS_PER_TOKEN` characters a token, counting each chat message's role and framing) is
refused before it is tokenized.

Before a request's first byte is answered, `check_prompt` (the context left for the completion, which is
also a chat request's default `max_tokens`) and `check_sampling` (a dead engine, and everything vLLM's SamplingParams
refuses) turn the engine's refusals into proper statuses. Each request carries `cache_salt` (the tenant):
vLLM then never shares cached prefix blocks between tenants, so no tenant can time another's prompts
through the prefix cache. A choice the engine ends with finish reason "error" raises `GenerationFailed`.
A greedy request (temperature 0) with n > 1, which vLLM refuses, runs once with n = 1 and every choice
gets its deltas: greedy decoding has one answer.

Log-probabilities are vLLM's default `raw_logprobs`: log-softmax of the model's logits before
temperature, top-p or penalties, i.e. the log-probability under the policy at temperature 1, which is
what a learner recomputes with the same weights. Each sampled token comes with its raw bytes, read from
the vocabulary (`TokenBytes`, all of it at start, in the prompt thread) rather than decoded (a token
holding part of a UTF-8 character decodes to "" or U+FFFD, which says nothing of its bytes), and with
where it starts in its choice's text (`text_offset`), counted from the tokens' bytes: with stop strings
vLLM holds a delta's last characters back, so the text returned so far says nothing of where a token
starts.

On CPU, vLLM 0.32's torch punica ops (`vllm/lora/ops/torch_ops`) index the adapter slot table with the
row's adapter index, and rows without an adapter carry index -1: Python indexing turns that into the
*last* slot, so a base-model row batched with adapter rows gets the last slot's adapter (observed:
base requests answered with another tenant's completion). The GPU kernels skip -1. So on CPU the engine
serves the base model through an all-zero rank-1 adapter (`write_zero_adapter`, loaded at start): no
row ever has index -1, and the output is exactly the base model's. It takes one of the `max_loras`
slots while base requests are in the batch.

Also on CPU, chunked prefill is off: with it, a request that sets its own `seed` and has its prompt
split over engine steps crashes the engine core (see `build_engine`).

What this module does not do: decide which adapter a request gets (serving/adapters.py), authenticate,
log events, or speak HTTP. vLLM is imported only inside functions, so `clora --help` and unit tests stay
light.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import itertools
import json
import logging
import math
import re
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ingest.events import template_messages
from serving.errors import BadRequest, ContextLengthExceeded, EngineStopped, GenerationFailed, UnsupportedParameter
from serving.lora_slots import LoraSlots

logger = logging.getLogger(__name__)

# KV cache reserved on CPU hosts: small, because clora's models are small and the machine is shared.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

# Tokens one engine step may take when prompts are not chunked (vLLM's CPU default budget).
DEFAULT_BATCHED_TOKENS = 2048

# The layers a LoRA may wrap in the Qwen/Llama family (what the zero adapter covers).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ZERO_ADAPTER_NAME = "_zero"  # never a tenant version name ("<tenant>@<n>")

# Text longer than this many characters per token of context is refused before it is tokenized (vLLM's
# renderer makes the same bound from its tokenizer; no real tokenizer averages more than a few characters).
MAX_CHARS_PER_TOKEN = 16
MESSAGE_FRAMING_CHARS = 16  # what a chat template adds around each message, at least (counted with its role)
_PROBE_TOOL, _PROBE_RESULT = "clora_probe_tool", "clora_probe_result"  # what `_template_shows_tools` looks for
MIN_TEMPERATURE = 0.01  # vLLM samples a temperature in (0, 0.01) at 0.01: only 0 is greedy (and runs n = 1 only)


# ---------------------------------------------------------------------------------------------------------
# Types the rest of serving uses (no vLLM types leak out of this module)


@dataclass(frozen=True)
class AdapterHandle:
    """One adapter version loaded (or loadable) in the engine: a unique int id per (tenant, version)."""

    name: str  # "acme@3"
    lora_id: int  # >= 1, never reused within a process
    path: Path


@dataclass(frozen=True)
class Sampling:
    """How to sample: what an OpenAI request may set, plus `top_logprobs` alternatives to report per token."""

    max_tokens: int | None = None  # None: the room the context leaves (check_prompt resolves it)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # the sampled token's own log-probability is always returned
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the completion before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the completion, as EOS does
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # always generate max_tokens (the benchmarks, a request's `ignore_eos`)
    # response_format's structured output: ("json_object", "") or ("json_schema", its schema as JSON text), or
    # a forced tool call's ("tool_calls", its schema); the engine masks every token that would leave it
    structured: tuple[str, str] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token. `raw` is its bytes in the vocabulary: the `raw` of a choice's tokens, joined, is its
    text's UTF-8 (less special tokens, which the text leaves out), though a token may hold part of a character."""

    token_id: int
    raw: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()  # (token id, raw bytes, logprob) of the best alternatives
    text_offset: int = 0  # characters of the choice's text before this token


@dataclass(frozen=True)
class Delta:
    """New output of one choice (`index`) since the previous delta; `finish_reason` set on its last one."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None


@dataclass
class Choice:
    """One finished (or accumulating) choice. Once its last delta is in, no token starts past the end of its
    text: a token that starts inside a stop string cut from the text starts where it was cut."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            end = len(self.text)
            self.logprobs = [lp if lp.text_offset <= end else replace(lp, text_offset=end) for lp in self.logprobs]


# ---------------------------------------------------------------------------------------------------------
# Building


def build_engine(
    model_path: str | Path,
    *,
    max_loras: int,
    max_cpu_loras: int,
    max_lora_rank: int,
    max_model_len: int,
    max_num_seqs: int,
    dtype: str = "auto",
    kv_cache_bytes: int | None = DEFAULT_CPU_KV_CACHE_BYTES,
    seed: int = 0,
    enable_lora: bool = True,
    zero_adapter_dir: Path | None = None,
) -> Engine:
    """Starts the engine (its core runs in a child process; callers need the `__main__` guard).

    `kv_cache_bytes` sets the KV cache size explicitly (vLLM's `kv_cache_memory_bytes`, which on CPU
    replaces the VLLM_CPU_KVCACHE_SPACE variable and skips the warm-up pass); None lets vLLM size it
    from `gpu_memory_utilization` (what a GPU host wants). `enable_lora=False` gives a plain engine (the
    benchmarks' base-model baseline). On CPU, the zero adapter that stands in for "no adapter" is written
    to `zero_adapter_dir` (a temporary directory if None); call `await engine.start()` before serving.
    """
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    cpu = current_platform.is_cpu()
    # On CPU, a request with its own `seed` whose prompt is prefilled in chunks kills the engine core
    # (vLLM 0.32 rewinds the request's torch.Generator with set_offset, which CPU generators lack:
    # "CPU Generator does not use offset"). Without chunked prefill no sampled token is ever discarded,
    # so no generator is rewound; every prompt (<= max_model_len) then fits one engine step.
    chunking = {} if not cpu else dict(
        enable_chunked_prefill=False, max_num_batched_tokens=max(DEFAULT_BATCHED_TOKENS, max_model_len)
    )
    lora_args = dict(
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max(max_cpu_loras, max_loras),  # vLLM requires max_cpu_loras >= max_loras
        max_lora_rank=max_lora_rank,
    ) if enable_lora else {}
    args = AsyncEngineArgs(
        model=str(model_path),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        kv_cache_memory_bytes=kv_cache_bytes,
        seed=seed,
        disable_log_stats=True,
        enable_prefix_caching=True,
        scheduling_policy="priority",  # a request's `priority` orders the queue (protocol.py); all 0: first come
        # JSON outputs (response_format, forced tool calls) without whitespace between their tokens: allowed
        # it, a model can fill its whole length limit with whitespace inside a grammar (the tiny model does,
        # at any temperature), and the answer comes back cut and unparsable. vLLM takes that only with a
        # backend named; llguidance takes more of JSON Schema than xgrammar (a string's format with a length)
        structured_outputs_config=StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True),
        use_tqdm_on_load=sys.stderr.isatty(),  # its weight-loading bar garbles logs (`clora up`'s prefixed output)
        **chunking,
        **lora_args,
    )
    logger.info(
        "starting the engine on %s (lora=%s, max_loras=%d, max_cpu_loras=%d, max_lora_rank=%d, max_model_len=%d, "
        "max_num_seqs=%d, dtype=%s, kv_cache_bytes=%s)",
        model_path, enable_lora, max_loras, max(max_cpu_loras, max_loras), max_lora_rank, max_model_len, max_num_seqs,
        dtype, kv_cache_bytes,
    )
    zero_adapter, temporary = None, None
    if enable_lora and cpu:
        from serving.adapter_check import base_linear_shapes

        if zero_adapter_dir is None:
            zero_adapter_dir = temporary = Path(tempfile.mkdtemp(prefix="clora-zero-adapter-"))
        zero_adapter = write_zero_adapter(Path(zero_adapter_dir), base_linear_shapes(Path(model_path)))
    return Engine(AsyncLLM.from_engine_args(args), max_model_len=max_model_len, zero_adapter_dir=zero_adapter,
                  temporary_dir=temporary)


def write_zero_adapter(out_dir: Path, base_shapes: dict[str, tuple[int, int]]) -> Path:
    """A PEFT LoRA of rank 1 whose weights are all zero, over every `LORA_TARGETS` layer of the base model."""
    import torch
    from safetensors.torch import save_file

    modules = sorted(m for m in base_shapes if m.rsplit(".", 1)[-1] in LORA_TARGETS)
    if not modules:
        raise ValueError(f"the base model has none of the layers {LORA_TARGETS}; cannot build the zero adapter")
    tensors = {}
    for module in modules:
        out_features, in_features = base_shapes[module]
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(1, in_features)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(out_features, 1)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# The engine


class Engine:
    """Token ids in, choices out; adapters by `AdapterHandle`. Wraps one vLLM `AsyncLLM`."""

    def __init__(
        self, llm: Any, *, max_model_len: int, zero_adapter_dir: Path | None = None, temporary_dir: Path | None = None
    ) -> None:
        """`zero_adapter_dir`: the all-zero adapter that stands in for "no adapter" (CPU); `temporary_dir` is
        deleted at shutdown."""
        self.llm = llm
        self.max_model_len = max_model_len
        self.tokenizer = llm.get_tokenizer()
        self.vocab_size = llm.model_config.get_vocab_size()
        # One thread: templating and tokenizing leave the event loop, and take at most one core from the engine.
        self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="clora-prompts")
        # tenant -> its turn in the prompt thread, and how many of its jobs hold or wait for it (the entry goes
        # with the last: tenants that came and went, a config re-read's, leave nothing)
        self._prompt_turns: dict[str, list] = {}
        self._developer_role = "developer" in str(getattr(self.tokenizer, "chat_template", None) or "")
        self.shows_tools, self.shows_tool_turns, self.writes_hermes_calls = self._template_shows_tools()
        if not self.shows_tools:
            logger.info("the chat template does not show tools to the model: requests with tools are refused")
        elif not self.writes_hermes_calls:
            logger.info("the chat template does not write tool calls in the Hermes format: tool_choice \"auto\" is "
                        "refused (the model's calls would come back as text)")
        self.token_bytes = TokenBytes(self.tokenizer)
        # Whether the tokenizer adds tokens of its own to a text (a BOS: Llama, Mistral, Gemma; not Qwen).
        self.adds_special_tokens = (list(self.tokenizer.encode("a", add_special_tokens=True))
                                    != list(self.tokenizer.encode("a", add_special_tokens=False)))
        self._ids = itertools.count(1)
        self._temporary_dir = temporary_dir
        # Adapters with requests in the engine, at most its max_loras (lora_slots.py): beyond them, vLLM's
        # scheduler could leave a tenant's requests waiting for good.
        lora_config = getattr(getattr(llm, "vllm_config", None), "lora_config", None)
        self.lora_slots = LoraSlots(lora_config.max_loras) if lora_config is not None else None
        self.zero_adapter = self.new_handle(ZERO_ADAPTER_NAME, zero_adapter_dir) if zero_adapter_dir else None

    async def start(self) -> None:
        """Loads what must be in place before the first request (the zero adapter, on CPU), and meanwhile reads
        every token's bytes in the prompt thread (`TokenBytes.warm`), so no response reads the vocabulary on
        the event loop: a SentencePiece token is read by decoding it, and the first such read serializes the
        whole tokenizer (vLLM's leading-space rule), a stall the first request with logprobs would take."""
        warming = asyncio.get_running_loop().run_in_executor(self._prompt_thread, self.token_bytes.warm)
        if self.zero_adapter is not None:
            await self.load_adapter(self.zero_adapter)
        try:
            await warming
        except Exception:  # tokens are then read as responses need them, each failing or not on its own
            logger.exception("could not read the vocabulary's token bytes at start; reading them as needed")

    # --- prompts ------------------------------------------------------------------------------------------
    async def chat_prompt(self, messages: Sequence[dict[str, Any]], tenant: str = "",
                          tools: Sequence[dict[str, Any]] | None = None, *,
                          reads_calls: bool = False) -> tuple[str, list[int]]:
        """Messages (and the request's tools) -> (rendered prompt, its token ids), in the prompt thread; refuses
        text far too long first, and tools or tool turns a chat template would not show the model, or calls
        to be read from the text (`reads_calls`: tool_choice "auto") that it teaches in another format than
        Hermes (serving/tools.py reads that one only). Each message counts its role, name, calls and the
        template's framing too, so many empty messages (or a long role) cannot render into a huge prompt past
        the check; and a message takes at least one token."""
        if tools and not self.shows_tools:
            raise UnsupportedParameter("this model's chat template does not show tools to the model, so it could not "
                                       "call them: send no tools", param="tools")
        if tools and reads_calls and not self.writes_hermes_calls:
            raise UnsupportedParameter("this model's chat template teaches tool calls in another format than Hermes "
                                       "(<tool_call>...</tool_call>), which this server cannot read from its text: "
                                       'send tool_choice "required", a named function, or "none"', param="tool_choice")
        if not self.shows_tool_turns and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            raise UnsupportedParameter("this model's chat template does not show tool calls and results to the model: "
                                       "send no tool_calls or tool messages", param="messages")
        if len(messages) >= self.max_model_len:
            raise _too_long(self.max_model_len, len(messages), "messages")
        self._check_chars(sum(_message_chars(m) for m in messages)
                          + (len(json.dumps(list(tools), ensure_ascii=False)) if tools else 0), "messages")
        return await self._in_prompt_thread(tenant, self._render_and_encode, list(messages), tools)

    async def text_prompt(self, text: str, tenant: str = "") -> tuple[str, list[int]]:
        """A /v1/completions text prompt -> (the text, its ids with the tokenizer's special tokens added), as
        vLLM's completions endpoint tokenizes it (a chat prompt gets them from its template instead). Where the
        tokenizer adds some (`adds_special_tokens`), the api logs the ids with the event, since the text alone
        re-tokenizes without them."""
        self._check_chars(len(text), "prompt")
        return text, await self._in_prompt_thread(tenant, self.encode_text_prompt, text)

    async def ids_prompt(self, token_ids: Sequence[int], tenant: str = "") -> tuple[str, list[int]]:
        """A prompt given as token ids -> (its text, the ids); BadRequest for ids outside the vocabulary.
        The text need not re-tokenize to the ids (ids [74, 71, 78, 78, 81] decode to "hello", which encodes
        otherwise), so the api logs these ids with the event (`prompt_token_ids`)."""
        if len(token_ids) >= self.max_model_len:  # no decoding needed to refuse it
            raise _too_long(self.max_model_len, len(token_ids), "prompt")
        return await self._in_prompt_thread(tenant, self.decode, token_ids), list(token_ids)

    async def _in_prompt_thread(self, tenant: str, fn, *args):
        """Runs `fn` in the prompt thread, with at most one job of each tenant queued there at a time: a
        tenant sending many long prompts waits behind its own, not in front of everyone else's."""
        entry = self._prompt_turns.setdefault(tenant, [asyncio.Semaphore(1), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                return await asyncio.get_running_loop().run_in_executor(self._prompt_thread, fn, *args)
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._prompt_turns[tenant]

    def _check_chars(self, chars: int, param: str) -> None:
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if chars > limit:
            what = "messages" if param == "messages" else "prompt"
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {what} "
                f"{'are' if what == 'messages' else 'is'} {chars} characters long, more than {limit} characters, "
                f"the most that {self.max_model_len} tokens can hold. Please reduce the length of the {what}.",
                param=param,
            )

    def _render_and_encode(self, messages: list[dict[str, Any]],
                           tools: Sequence[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        text = self.render_chat(messages, tools)
        return text, self.encode(text)

    def encode_text_prompt(self, text: str) -> list[int]:
        if not self.adds_special_tokens:
            return self.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Text -> token ids, without adding special tokens (a chat template has already placed them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The tokenizer's chat template applied to `messages` (and `tools`, which it shows the model), with the
        assistant turn opened. A `developer` message (OpenAI's newer name for system) becomes `system` unless
        the template knows the role, as vLLM does."""
        if not self._developer_role:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        messages = template_messages(messages)
        extra = {"tools": list(tools)} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                      **extra)
        except Exception as e:  # jinja raises its own types (TemplateError, UndefinedError, TypeError, ...)
            raise BadRequest(f"the chat template cannot render these messages: {e}", param="messages") from e

    def _template_shows_tools(self) -> tuple[bool, bool, bool]:
        """(whether the chat template shows the model a request's tools, whether it shows tool calls and
        results, whether it writes calls in the Hermes format), tried once on a made-up tool: a template that
        leaves them out would have the model answer as if they had not been sent (tool calling is then
        refused, not served blind)."""
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "",
                                                 "parameters": {"type": "object", "properties": {}}}}
        turns = [{"role": "user", "content": "?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "call_0", "content": _PROBE_RESULT}]
        rendered = []
        for messages, tools in (([turns[0]], [tool]), (turns, None)):
            try:
                rendered.append(self.render_chat(messages, tools))
            except BadRequest:
                rendered.append("")
        with_tools, with_turns = rendered
        shows_turns = _PROBE_TOOL in with_turns and _PROBE_RESULT in with_turns
        return _PROBE_TOOL in with_tools, shows_turns, shows_turns and "<tool_call>" in with_turns

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids (a prompt given as ids) -> text; BadRequest for ids the tokenizer does not have."""
        size = len(self.tokenizer)
        bad = [t for t in token_ids if not 0 <= t < size]
        if bad:
            raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{size - 1})", param="prompt")
        return self.tokenizer.decode(list(token_ids))

    # --- adapters -----------------------------------------------------------------------------------------
    def new_handle(self, name: str, path: Path) -> AdapterHandle:
        """A handle with an engine-wide unique id (vLLM caches adapters by id, so ids are never reused)."""
        return AdapterHandle(name=name, lora_id=next(self._ids), path=Path(path))

    async def load_adapter(self, adapter: AdapterHandle) -> None:
        """Loads the adapter's weights into the engine now, so the first request that uses it does not."""
        if not await self.llm.add_lora(_lora_request(adapter)):
            raise RuntimeError(f"the engine did not load adapter {adapter.name} from {adapter.path}")

    async def unload_adapter(self, adapter: AdapterHandle) -> None:
        await self.llm.remove_lora(adapter.lora_id)

    async def loaded_adapters(self) -> set[int]:
        return set(await self.llm.list_loras())

    # --- generation ---------------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: Sequence[int], sampling: Sampling, *, param: str = "prompt") -> Sampling:
        """Refuses a prompt that leaves no room to generate; max_tokens becomes what fits (all of the room
        when the request set none). `param` names the request field in the error ("messages" or "prompt")."""
        room = self.max_model_len - len(prompt_ids)
        if not prompt_ids:
            raise BadRequest(f"the {param} is empty", param=param)
        if room < 1:
            raise _too_long(self.max_model_len, len(prompt_ids), param)
        if sampling.max_tokens is None or sampling.max_tokens > room:
            return replace(sampling, max_tokens=room)
        return sampling

    def check_sampling(self, sampling: Sampling) -> None:
        """What the engine would refuse once the request is in, refused now: a dead engine (503), sampling
        vLLM's SamplingParams rejects, logit_bias ids outside the vocabulary and min_tokens past max_tokens (400)."""
        if self.errored:
            raise EngineStopped("the engine has stopped; the server must be restarted")
        bad = [t for t, _ in sampling.logit_bias if t >= self.vocab_size]
        if bad:
            raise BadRequest(f"logit_bias token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})",
                             param="logit_bias")
        if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
            raise BadRequest(f"min_tokens ({sampling.min_tokens}) is more than the {sampling.max_tokens} tokens this "
                             "completion may have (max_tokens, or the room the context leaves)", param="min_tokens")
        _sampling_params(sampling)

    async def stream(
        self, prompt_ids: list[int], sampling: Sampling, adapter: AdapterHandle | None, request_id: str,
        *, cache_salt: str | None = None, priority: int = 0,
    ) -> AsyncIterator[Delta]:
        """Deltas of every choice as the engine produces them; the last delta of a choice has its finish reason.

        Leaving the iteration early (client gone, task cancelled) aborts the request in the engine.
        `cache_salt` (the tenant) keeps this request's prefix-cache blocks apart from other salts'. `priority`:
        its place in the engine's queue (smaller first, then by arrival; 0 for production traffic).

        A token's `text_offset` counts the characters its choice's earlier tokens decode to, text still held
        back for a stop string included. A stop string is cut from the text only once its last token comes,
        so a token that starts inside it starts past the end of the text the deltas add up to (by less than
        the stop string's length); a `Choice`, taking the last delta, moves such offsets to the end.
        """
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError

        sampling = self.check_prompt(prompt_ids, sampling)
        copies = sampling.n if greedy(sampling) else 1  # greedy runs once (n = 1); each choice gets its answer
        adapter = adapter or self.zero_adapter
        lora = _lora_request(adapter) if adapter is not None else None
        chars: dict[int, int] = {}  # choice -> characters its tokens decode to so far
        decoders: dict[int, Any] = {}  # choice -> the UTF-8 decoder its tokens' bytes go through
        slot = lora.lora_int_id if lora is not None and self.lora_slots is not None else None
        holding = False
        try:
            params = _sampling_params(sampling)  # vLLM refuses some combinations: a 400, like its own server
            prompt = tokens_input(list(prompt_ids), cache_salt=cache_salt)
            # Its adapter's slot in the engine (lora_slots.py), given up once the engine has finished it: a
            # client slow to read the last deltas must not hold it.
            if slot is not None:
                await self.lora_slots.enter(slot, priority)
                holding = True
            # Closed (which aborts the request in the engine) as soon as this loop ends, however it ends: left
            # to the garbage collector, the abort came a few event-loop passes after the caller released the
            # adapter, which could then be unloaded, its files deleted, under a request still running on it.
            async with contextlib.aclosing(self.llm.generate(prompt, params, request_id, lora_request=lora,
                                                              priority=priority)) as outputs:
                async for output in outputs:
                    if holding and getattr(output, "finished", False):
                        holding = False
                        self.lora_slots.leave(slot)
                    for out in output.outputs:
                        if out.finish_reason == "error":  # vLLM: a request-level internal error, always a 500
                            raise GenerationFailed(f"the engine failed request {request_id} (choice {out.index}); "
                                                   "it may succeed if retried")
                        decoder = decoders.setdefault(out.index, codecs.getincrementaldecoder("utf-8")("replace"))
                        text_bytes = [b"" if t in self.token_bytes.special else self.token_bytes(t)
                                      for t in out.token_ids]
                        offsets, chars[out.index] = _text_offsets(text_bytes, chars.get(out.index, 0), decoder)
                        delta = Delta(
                            index=out.index,
                            text=out.text,
                            token_ids=list(out.token_ids),
                            logprobs=_token_logprobs(out.token_ids, out.logprobs, sampling.top_logprobs,
                                                     self.token_bytes, offsets),
                            finish_reason=out.finish_reason,
                        )
                        for index in range(copies):
                            yield delta if copies == 1 else replace(delta, index=index)
        except VLLMClientError as e:  # a schema vLLM's structured outputs cannot take is found as the request goes in
            raise BadRequest(str(e), param=_param_of(e, sampling)) from e
        except EngineDeadError as e:
            raise EngineStopped("the engine has stopped; the server must be restarted") from e
        except Exception:
            # vLLM registers a request before sending it to the engine core, and one whose sending failed it
            # never aborts: its state would stay in the engine for good, one per such request.
            with contextlib.suppress(Exception):
                await self.llm.abort(request_id)
            raise
        finally:
            if holding:  # after the abort above (or the generator's close): the engine is done with it
                self.lora_slots.leave(slot)

    async def generate(
        self, prompt_ids: list[int], sampling: Sampling, adapter: AdapterHandle | None, request_id: str,
        *, cache_salt: str | None = None, priority: int = 0,
    ) -> list[Choice]:
        """Runs the request to the end; one `Choice` per `sampling.n`, ordered by index."""
        choices = {i: Choice(i) for i in range(sampling.n)}
        async with contextlib.aclosing(self.stream(prompt_ids, sampling, adapter, request_id, cache_salt=cache_salt,
                                                   priority=priority)) as deltas:  # closed (aborted) on any exit
            async for delta in deltas:
                choices[delta.index].add(delta)
        return [choices[i] for i in range(sampling.n)]

    @property
    def errored(self) -> bool:
        return self.llm is None or bool(self.llm.errored)

    def shutdown(self) -> None:
        """Stops the engine core; idempotent. Drops the AsyncLLM at once (its own __del__ would otherwise
        run during interpreter exit, when vLLM's module globals are already gone)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
        self._prompt_thread.shutdown(wait=False, cancel_futures=True)
        if self._temporary_dir is not None:
            shutil.rmtree(self._temporary_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Conversions to and from vLLM types


def _lora_request(adapter: AdapterHandle):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=str(adapter.path))


def _sampling_params(sampling: Sampling):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams  # not `from vllm`: its
    # lazy __getattr__ imports again at every call (twice per prompt)

    structured = None
    if sampling.structured is not None:
        kind, schema = sampling.structured
        structured = (StructuredOutputsParams(json_object=True) if kind == "json_object"
                      else StructuredOutputsParams(json=json.loads(schema)))
    try:
        return SamplingParams(
            n=1 if greedy(sampling) else sampling.n,  # vLLM refuses greedy with n > 1: stream() copies its answer
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            logprobs=sampling.top_logprobs,  # 0: the sampled token's logprob only
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            logit_bias=dict(sampling.logit_bias) or None,
            min_tokens=sampling.min_tokens,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
            ignore_eos=sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured,
        )
    except VLLMValidationError as e:  # its own server answers these with 400 too
        raise BadRequest(str(e), param=_param_of(e, sampling)) from e


def _param_of(e: Exception, sampling: Sampling) -> str | None:
    """The request field a vLLM validation error is about: the one it names, else, for an error about a
    structured output's schema or grammar (which vLLM names no field for), where that schema came from:
    `tools` for a forced call's, `response_format` otherwise."""
    named = getattr(e, "parameter", None)
    if named or sampling.structured is None:
        return named
    text = str(e).lower()
    if not any(word in text for word in ("schema", "json", "grammar", "structured")):
        return None
    return "tools" if sampling.structured[0] == "tool_calls" else "response_format"


def greedy(sampling: Sampling) -> bool:
    """Temperature 0: one answer, which vLLM runs once (n = 1) and `stream` copies to every choice."""
    return sampling.temperature == 0


def _message_chars(message: dict[str, Any]) -> int:
    """A message's characters as its template shows them, at least: role, name, content, calls, framing."""
    calls = message.get("tool_calls") or ()
    return (len(message["role"]) + len(message.get("content") or "") + len(message.get("name", ""))
            + sum(len(c["function"]["name"]) + len(c["function"]["arguments"]) for c in calls)
            + MESSAGE_FRAMING_CHARS)


def _too_long(max_model_len: int, tokens: int, param: str) -> ContextLengthExceeded:
    what = "messages" if param == "messages" else "prompt"
    return ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, your {what} resulted in "
        f"{tokens} tokens, which leaves no room for the completion. Please reduce the length of the {what}.",
        param=param,
    )


def _token_logprobs(
    token_ids: Sequence[int], logprobs: Any, top_k: int, token_bytes, offsets: Sequence[int]
) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob} -> one `TokenLogprob` per sampled token, its bytes and its
    alternatives' from `token_bytes` (vLLM's `decoded_token` is text, which a partial character has none of).

    vLLM returns the top-k entries plus the sampled token (k + 1 entries when it is not among them).
    """
    if logprobs is None:
        raise RuntimeError("the engine returned no logprobs although every request asks for them")
    out = []
    for position, token_id in enumerate(token_ids):
        entries = logprobs[position]
        best = sorted(entries.items(), key=lambda item: -_finite(item[1].logprob))[:top_k]
        top = tuple((tid, token_bytes(tid), _finite(lp.logprob)) for tid, lp in best)
        out.append(TokenLogprob(token_id=token_id, raw=token_bytes(token_id), logprob=_finite(entries[token_id].logprob),
                                top=top, text_offset=offsets[position]))
    return out


LOWEST_LOGPROB = -9999.0  # what a log-prob of -inf (or NaN) is answered as, as vLLM's own server does


def _finite(logprob: float) -> float:
    """A log-prob JSON can carry: -inf (a token the logits ruled out) and NaN are LOWEST_LOGPROB. Else the
    answer would fail to encode (a 500 after its interaction was logged) and a stream would carry -Infinity."""
    value = float(logprob)
    return value if math.isfinite(value) and value >= LOWEST_LOGPROB else LOWEST_LOGPROB


def _text_offsets(raws: Sequence[bytes], start: int, decoder: Any) -> tuple[list[int], int]:
    """Where each token of one delta starts in its choice's text, and where the last one ends: `start` (the
    characters the choice's earlier tokens decode to) plus the characters the delta's earlier tokens complete.

    Counted from the tokens' bytes (`raws`: b"" for a special token, which the text leaves out), never from
    the text the delta returns: with stop strings, vLLM holds back the text's last characters (the longest
    stop string's length less one) until it knows they do not begin one, so a delta's text lags its tokens.
    `decoder` is the choice's incremental UTF-8 decoder, so a character split over tokens (over deltas too)
    counts once, at its last byte: every token of it starts where the character does."""
    offsets = []
    for raw in raws:
        offsets.append(start)
        start += len(decoder.decode(raw))
    return offsets, start


# ---------------------------------------------------------------------------------------------------------
# Token bytes


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted (character -> byte): printable bytes spell themselves, the
    other 68 bytes are spelt by the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    spelt = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelt):
        spelt[b] = chr(256 + n)
    return {c: b for b, c in spelt.items()}


BYTE_LEVEL = _byte_level_alphabet()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
BYTE_LEVEL_PROBE = "é ü\n"  # bytes a byte-level vocabulary spells with characters of its own


def _spelt_bytes(piece: str) -> bytes | None:
    """A byte-level piece ("Ġh" -> b" h"); None when a character of it is not in the alphabet."""
    try:
        return bytes(BYTE_LEVEL[c] for c in piece)
    except KeyError:
        return None


class TokenBytes:
    """Each token id's raw bytes, read from the tokenizer's vocabulary and kept: all of it at once (`warm`, at
    the engine's start: for a byte-level vocabulary of 150k tokens about 0.2 s and 16 MB, for a SentencePiece
    one of 256k, which is decoded, about 2 s and 29 MB), or a token on first use (an id past the tokenizer).

    Special tokens ("<|im_end|>") are their content: vLLM leaves them out of the text, so they have no other.
    A byte-level BPE vocabulary (Qwen's, Llama 3's, the tiny model's) spells every byte with one character;
    whether the tokenizer is one is tried once, on a probe text whose pieces must spell its bytes.
    SentencePiece spells a byte it has no piece for "<0xE4>". Any other token falls back to its text as vLLM
    decodes one token, where SentencePiece's "▁" is a space (leading ones kept). Added tokens that are not
    special are text like any piece and take the same rules, not their content: Gemma's whitespace tokens
    "▁▁" to 31 × "▁" are spaces, and a byte-level tokenizer's added tokens go through its alphabet, as its
    decoder takes them.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special = {token_id: token.content for token_id, token in added.items()
                        if getattr(token, "special", False)}
        self._byte_level = self._spells_bytes()
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._known.get(token_id)
        if raw is None:
            raw = self._known[token_id] = self._read([token_id])[0]
        return raw

    def warm(self) -> None:
        """Reads the whole vocabulary now, in a few calls, so that no response reads a token on the event loop."""
        token_ids = list(range(len(self.tokenizer)))
        self._known.update(zip(token_ids, self._read(token_ids)))

    def _spells_bytes(self) -> bool:
        pieces = self._pieces(list(self.tokenizer.encode(BYTE_LEVEL_PROBE, add_special_tokens=False)))
        return _spelt_bytes("".join(p or "" for p in pieces)) == BYTE_LEVEL_PROBE.encode()

    def _pieces(self, token_ids: list[int]) -> list[str | None]:
        """The vocabulary's pieces of `token_ids` (None for an id it lacks, and for every id when the tokenizer
        has no vocabulary to look at)."""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        try:
            return list(convert(token_ids)) if convert is not None else [None] * len(token_ids)
        except IndexError:  # a slow tokenizer's answer to an id past its vocabulary
            return [None] * len(token_ids)

    def _read(self, token_ids: list[int]) -> list[bytes]:
        """The bytes of `token_ids`: from their pieces where these spell them, the others decoded in one call."""
        size = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else None
        # An id past the tokenizer's vocabulary (models pad theirs: Qwen's 151,936 rows against 151,665 tokens)
        # spells nothing; decoding it raised in vLLM's SentencePiece path (a 500).
        raws = [self.special[t].encode("utf-8") if t in self.special else b"" if size is not None and t >= size
                else _piece_bytes(piece, self._byte_level) for t, piece in zip(token_ids, self._pieces(token_ids))]
        decode = [token_id for token_id, raw in zip(token_ids, raws) if raw is None]
        if decode:
            from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

            decoded = iter(convert_ids_list_to_tokens(self.tokenizer, decode))
            raws = [raw if raw is not None else next(decoded).encode("utf-8") for raw in raws]
        return raws


def _piece_bytes(piece: str | None, byte_level: bool) -> bytes | None:
    """A piece's bytes where its spelling says them: a byte-level piece, or SentencePiece's "<0xE4>"; None
    when only decoding says (SentencePiece's "▁", a WordPiece "##")."""
    if piece is None:
        return None
    spelt = _spelt_bytes(piece) if byte_level else None
    if spelt is not None:
        return spelt
    byte = BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte.group(1), 16)]) if byte is not None else None
