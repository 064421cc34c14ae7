"""Pieces of the engine wrapper that need no running engine: the zero adapter, the logprob conversion,
each token's bytes, and text offsets through vLLM's own incremental detokenizer (no engine started)."""

import asyncio
import codecs
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from serving.adapter_check import base_linear_shapes, validate_adapter
from serving.engine import Choice, Engine, Sampling, TokenBytes, _text_offsets, _token_logprobs, write_zero_adapter

pytestmark = pytest.mark.unit


def test_zero_adapter_is_a_valid_all_zero_lora_over_every_projection(tmp_path, tiny_model):
    shapes = base_linear_shapes(tiny_model)
    out = write_zero_adapter(tmp_path / "zero", shapes)
    info = validate_adapter(out, max_rank=1, base_shapes=shapes)
    assert info.rank == 1 and info.modules == 4 * 7
    tensors = load_file(out / "adapter_model.safetensors")
    assert all(float(t.abs().sum()) == 0.0 for t in tensors.values())


@dataclass
class FakeLogprob:  # the attributes of vllm.logprobs.Logprob that the conversion reads
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def test_sampled_token_logprob_and_top_alternatives():
    positions = [
        {7: FakeLogprob(-0.1, 1, "a"), 8: FakeLogprob(-2.0, 2, "b"), 9: FakeLogprob(-3.0, 3, "c")},
        # the sampled token outside the top 2
        {5: FakeLogprob(-4.0, 9, "x"), 1: FakeLogprob(-0.5, 1, "y"), 2: FakeLogprob(-1.0, 2, "z")},
    ]
    out = _token_logprobs([7, 5], positions, 2, token_bytes=lambda t: b"<%d>" % t, offsets=[0, 3])
    assert [(t.token_id, t.raw, t.logprob, t.text_offset) for t in out] == [(7, b"<7>", -0.1, 0), (5, b"<5>", -4.0, 3)]
    assert out[0].top == ((7, b"<7>", -0.1), (8, b"<8>", -2.0))
    assert out[1].top == ((1, b"<1>", -0.5), (2, b"<2>", -1.0))
    only_sampled = _token_logprobs([3], [{3: FakeLogprob(-1.5)}], 0, token_bytes=lambda t: b"<%d>" % t, offsets=[0])
    assert only_sampled[0].raw == b"<3>" and only_sampled[0].top == ()


def test_a_log_prob_json_cannot_carry_is_answered_as_vllms_lowest():
    """-inf (a token the logits ruled out) made the answer fail to encode, a 500 after its interaction was
    logged, and a stream carry -Infinity, which strict JSON parsers refuse."""
    import json

    positions = [{7: FakeLogprob(float("-inf")), 8: FakeLogprob(-1.0), 9: FakeLogprob(float("nan"))}]
    (out,) = _token_logprobs([7], positions, 3, token_bytes=lambda t: b"<%d>" % t, offsets=[0])
    assert out.logprob == -9999.0
    assert out.top == ((8, b"<8>", -1.0), (7, b"<7>", -9999.0), (9, b"<9>", -9999.0))
    json.dumps([out.logprob, out.top[1][2]], allow_nan=False)


def test_a_byte_level_vocabularys_tokens_are_their_bytes_not_their_text(tiny_model):
    """The tiny model's tokenizer (byte-level BPE, as Qwen's) splits "你" and "😊" into tokens of one byte
    each, which decode to U+FFFD: their bytes come from the vocabulary, and joined they are the text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    token_bytes = TokenBytes(tokenizer)
    text = "héllo 你好 😊<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(t) for t in ids) == text.encode()
    assert tokenizer.decode([ids[1]]) == "\ufffd" and token_bytes(ids[1]) == b"\xc3"  # the first byte of "é"
    assert token_bytes(tokenizer.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"  # a special token: its text
    tokenizer.add_tokens(["<think>", "ĠxĠ"])  # not special: read as the decoder reads them, through the alphabet
    think, spaced = tokenizer.convert_tokens_to_ids(["<think>", "ĠxĠ"])
    assert TokenBytes(tokenizer)(think) == b"<think>" and tokenizer.decode([spaced]) == " x "
    assert TokenBytes(tokenizer)(spaced) == b" x "


class FakeSentencePieceTokenizer:
    """SentencePiece's pieces: "<0xE4>" for a byte it has no piece for, others their text."""

    pieces = {3: "hi", 4: "<0xE4>", 5: "<0xBD>", 6: "<0xA0>", 7: "é"}

    def encode(self, text, add_special_tokens=False):
        return [7]  # "é" is a piece of its own

    def convert_ids_to_tokens(self, ids):
        return [self.pieces.get(i) for i in ids]

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_sentencepiece_byte_pieces_are_their_byte_and_other_pieces_their_text():
    token_bytes = TokenBytes(FakeSentencePieceTokenizer())
    assert b"".join(token_bytes(t) for t in (4, 5, 6)) == "你".encode() and token_bytes(4) == b"\xe4"
    assert token_bytes(7) == "é".encode()  # not read as the byte-level alphabet's 0xE9
    assert token_bytes(3) == b"hi"  # its text, as vLLM decodes one token


def sentencepiece_style_tokenizer(metaspace: bool):
    """A fast SentencePiece-style tokenizer built offline: "▁" for a space, "<0xNN>" byte pieces, and the
    non-special added token "▁▁▁▁", as Gemma lists whitespace runs. `metaspace`: Llama 2's layout (a Metaspace
    pre-tokenizer, a decoder that strips the text's first space); otherwise Gemma's (a normalizer writes "▁",
    the decoder only turns it back)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    for piece in ["▁", "d", "e", "f", "x", "\n", "▁d", "▁de", "▁def", "de", "def"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "d"), ("▁d", "e"), ("▁de", "f"), ("d", "e"), ("de", "f")]
    model = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if metaspace:
        model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        model.normalizer = normalizers.Replace(" ", "▁")
    model.decoder = decoders.Sequence(steps)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<bos>", eos_token="<eos>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.add_tokens([AddedToken("▁▁▁▁", normalized=False, special=False)])
    return tokenizer


@pytest.mark.parametrize("metaspace", [False, True], ids=["gemma", "llama2"])
def test_sentencepiece_spaces_and_whitespace_added_tokens_are_spaces(metaspace):
    """"▁" is a space in every piece, the added token "▁▁▁▁" too (not the UTF-8 of "▁▁▁▁"): the tokens'
    bytes, joined, are the text vLLM's decode stream gives after a prompt. Special tokens stay their text."""
    from tokenizers.decoders import DecodeStream

    tokenizer = sentencepiece_style_tokenizer(metaspace)
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["▁def", "\n", "▁▁▁▁", "x", "▁def", "▁", "<0xE4>", "<0xBD>", "<0xA0>"])
    stream = DecodeStream(ids=tokenizer.encode("x", add_special_tokens=False), skip_special_tokens=True)
    text = "".join(stream.step(tokenizer._tokenizer, t) or "" for t in ids)
    assert text == " def\n    x def 你"
    assert b"".join(token_bytes(t) for t in ids) == text.encode()
    assert token_bytes(ids[2]) == b"    " and token_bytes(ids[0]) == b" def"
    assert token_bytes(tokenizer.eos_token_id) == b"<eos>"
    whole = TokenBytes(tokenizer)
    whole.warm()  # the vocabulary read at once reads as token by token
    assert [whole(t) for t in range(len(tokenizer))] == [TokenBytes(tokenizer)(t) for t in range(len(tokenizer))]
    # A model's vocabulary is often padded past its tokenizer's (Qwen: 151,936 rows, 151,665 tokens): such an
    # id, sampled or among the top alternatives, spells nothing (decoding it raised: a 500).
    assert token_bytes(len(tokenizer)) == b"" and token_bytes(len(tokenizer) + 100) == b""


def test_text_offsets_count_the_tokens_bytes_and_a_split_character_once():
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    # "a" and the first byte of "你" in one delta, the rest and "b" in the next: where each starts, and the end
    assert _text_offsets([b"a", b"\xe4"], 0, decoder) == ([0, 1], 1)
    assert _text_offsets([b"\xbd\xa0", b"b"], 1, decoder) == ([1, 2], 3)
    assert _text_offsets([b"", b"c"], 3, decoder) == ([3, 3], 4)  # a special token (b""): no characters


class FakeDetokenizingLLM:
    """What serving/engine.py reads of vLLM's AsyncLLM, answering `reply` one token a step through vLLM's own
    incremental detokenizer as its output processor drives it: a stop string's possible start held back from
    each delta's text and the stop string cut from the last one, an EOS left out of the text."""

    def __init__(self, tokenizer, reply: list[int]):
        self.tokenizer, self.reply = tokenizer, reply
        self.model_config = SimpleNamespace(get_vocab_size=lambda: len(tokenizer))
        self.errored = False

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self):
        pass

    async def generate(self, prompt, params, request_id, lora_request=None, priority=0):
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        request = SimpleNamespace(request_id=request_id, sampling_params=params, prompt_embeds=None,
                                  prompt_token_ids=prompt["prompt_token_ids"])
        detokenizer = IncrementalDetokenizer.from_new_request(self.tokenizer, request)
        for step, token in enumerate(self.reply):
            eos = token == self.tokenizer.eos_token_id
            stopped = detokenizer.update([token], eos) is not None
            finish = "stop" if eos or stopped else "length" if step == len(self.reply) - 1 else None
            text = detokenizer.get_next_output_text(finish is not None, delta=True)
            yield SimpleNamespace(outputs=[SimpleNamespace(index=0, text=text, token_ids=[token], finish_reason=finish,
                                                           logprobs=[{token: FakeLogprob(-0.5)}])])
            if finish is not None:
                return


def starts(text: str, raws: list[bytes]) -> list[int]:
    """Where each token starts in `text`, worked out apart: the characters whole before its first byte."""
    utf8, out, at = text.encode(), [], 0
    for raw in raws:
        out.append(len(utf8[:at].decode("utf-8", errors="ignore")))
        at += len(raw)
    return out


@pytest.mark.parametrize("stop", [(), ("\nUser:",)], ids=["no-stop", "stop"])
def test_text_offsets_are_where_tokens_start_when_vllm_holds_text_back_for_a_stop_string(tiny_model, stop):
    """vLLM holds back the last len(stop) - 1 characters of each delta's text while they may begin a stop
    string, so the text returned so far lags the tokens: offsets come from the tokens, streamed or not. "你"
    is three tokens, which start where it does; a token inside the stop string cut from the text starts at
    the text's end once the choice is whole, and streamed, past it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    said = "Hello 你好, how are you?\nUser: more"
    reply = [*tokenizer.encode(said, add_special_tokens=False), tokenizer.eos_token_id]
    engine = Engine(FakeDetokenizingLLM(tokenizer, reply), max_model_len=64)
    sampling = Sampling(max_tokens=40, stop=stop)

    deltas = asyncio.run(_collect(engine.stream([1, 2], sampling, None, "r")))
    engine.shutdown()
    choice = Choice(0)
    for delta in deltas:
        choice.add(delta)
    text = "Hello 你好, how are you?" if stop else said
    sent = [lp for delta in deltas for lp in delta.logprobs]
    raws = [lp.raw for lp in sent]
    assert choice.text == text and raws[:6] == [b"Hello", b" ", b"\xe4", b"\xbd", b"\xa0", b"\xe5"]
    if stop:  # 5 characters held back: "Hello" comes as "", then "Hello " as "H"
        assert [d.text for d in deltas[:2]] == ["", "H"] and choice.finish_reason == "stop"
        assert raws[-4:] == [b"U", b"s", b"er", b":"]  # the last one completes the stop string
    else:
        assert raws[-1] == b"<|im_end|>"  # the EOS, which the text leaves out
    whole = starts(said, raws)
    assert [lp.text_offset for lp in sent] == whole
    assert [lp.text_offset for lp in choice.logprobs] == [min(o, len(text)) for o in whole]
    assert [lp.text_offset for lp in choice.logprobs][:7] == [0, 5, 6, 6, 6, 7, 7]


def test_start_reads_the_whole_vocabulary_in_the_prompt_thread(tiny_model, monkeypatch):
    """No response reads the vocabulary on the event loop: start() has read every token, off the loop."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = Engine(FakeDetokenizingLLM(tokenizer, []), max_model_len=64)
    threads = []
    convert = tokenizer.convert_ids_to_tokens
    monkeypatch.setattr(tokenizer, "convert_ids_to_tokens",
                        lambda ids: threads.append(threading.current_thread().name) or convert(ids))
    asyncio.run(engine.start())
    assert threads and all(name.startswith("clora-prompts") for name in threads)
    threads.clear()
    one_by_one = TokenBytes(AutoTokenizer.from_pretrained(tiny_model))
    assert [engine.token_bytes(t) for t in range(len(tokenizer))] == [one_by_one(t) for t in range(len(tokenizer))]
    assert threads == []  # all of it read already
    engine.shutdown()


async def _collect(deltas):
    return [delta async for delta in deltas]


def test_requests_reach_the_engine_only_while_their_adapter_has_one_of_its_max_loras_slots(tiny_model):
    """vLLM leaves a waiting request whose adapter is not among the running ones' once max_loras adapters run
    (for good, under steady traffic of theirs): the engine takes a request of another adapter only once one
    has a slot (serving/lora_slots.py)."""
    from transformers import AutoTokenizer

    from serving.engine import AdapterHandle

    class OneSlotLLM(FakeDetokenizingLLM):
        vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_loras=1))

        def __init__(self, tokenizer):
            super().__init__(tokenizer, [5, 6])
            self.started, self.release = [], asyncio.Event()

        async def generate(self, prompt, params, request_id, lora_request=None, priority=0):
            self.started.append(request_id)
            await self.release.wait()
            async for output in super().generate(prompt, params, request_id, lora_request, priority):
                yield output

    llm = OneSlotLLM(AutoTokenizer.from_pretrained(tiny_model))
    engine = Engine(llm, max_model_len=64)
    acme, globex = AdapterHandle("acme@1", 101, tiny_model), AdapterHandle("globex@1", 102, tiny_model)

    async def scenario():
        first = asyncio.create_task(_collect(engine.stream([1, 2], Sampling(max_tokens=2), acme, "a1")))
        other = asyncio.create_task(_collect(engine.stream([1, 2], Sampling(max_tokens=2), globex, "g1")))
        again = asyncio.create_task(_collect(engine.stream([1, 2], Sampling(max_tokens=2), acme, "a2")))
        for _ in range(20):
            await asyncio.sleep(0)
        assert llm.started == ["a1"]  # globex waits for the slot, and acme's next request behind it
        llm.release.set()
        await asyncio.gather(first, other, again)
        assert llm.started == ["a1", "g1", "a2"] and engine.lora_slots.active == {}

    asyncio.run(scenario())
    engine.shutdown()


def test_a_request_gives_its_adapter_slot_up_once_the_engine_has_finished_it(tiny_model):
    """Not when its reader is done with it: a stream whose client stopped reading held its slot, and with the
    slots full every other adapter's requests waited for that client."""
    from transformers import AutoTokenizer

    from serving.engine import AdapterHandle

    class OneSlotLLM(FakeDetokenizingLLM):
        vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_loras=1))

        async def generate(self, prompt, params, request_id, lora_request=None, priority=0):
            outputs = [o async for o in super().generate(prompt, params, request_id, lora_request, priority)]
            for i, output in enumerate(outputs):
                output.finished = i == len(outputs) - 1  # as vLLM's RequestOutput says
                yield output

    engine = Engine(OneSlotLLM(AutoTokenizer.from_pretrained(tiny_model), [5, 6, 7]), max_model_len=64)
    acme = AdapterHandle("acme@1", 101, tiny_model)

    async def scenario():
        deltas = engine.stream([1, 2], Sampling(max_tokens=3), acme, "a1")
        await anext(deltas)
        assert engine.lora_slots.active == {101: 1}
        await anext(deltas), await anext(deltas)  # the last: the engine is done, its reader not yet
        assert engine.lora_slots.active == {}
        await deltas.aclose()
        assert engine.lora_slots.active == {}

    asyncio.run(scenario())
    engine.shutdown()
