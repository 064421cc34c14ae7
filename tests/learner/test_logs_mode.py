"""learner/logs_mode.py: staleness, foreign adapters, rows -> examples."""

from __future__ import annotations

import json
import math

import pytest

from learner.logs_mode import (
    baseline_after,
    is_flat,
    select_fresh,
    stale_reason,
    to_examples,
    version_number,
    within_reward_range,
)
from learner.types import Example

from learner_support import chat_prompt, trajectories

pytestmark = pytest.mark.unit


def test_version_numbers():
    assert version_number(None, "acme") == 0  # the base model
    assert version_number("acme@7", "acme") == 7
    assert version_number("a.b@2", "a.b") == 2
    assert version_number("beta@7", "acme") is None  # another tenant's adapter
    assert version_number("acme", "acme") is None
    assert version_number("acme@" + "9" * 5000, "acme") is None  # int() of it raised, failing every step


def test_rows_any_producer_can_write_train_or_are_left_out_but_never_fail_the_step(tiny_model):
    """Values ingest takes that broke every step of their tenant: a sampling record's number
    past a float's or an int64's range, log-probs above 0 (an app logging probabilities or negative
    log-likelihoods: their weights came out ~0, the rows training nothing while counted), and a null inside a
    list column (a writer other than ingest)."""
    from transformers import AutoTokenizer

    from learner.logs_mode import sampled_with

    tok = AutoTokenizer.from_pretrained(tiny_model)
    served = {"served_by": "acme@1", "endpoint": "chat", "latency_ms": 1, "usage": {}}
    for sampling in ({"temperature": 10**400}, {"top_p": 10**400}, {"logit_bias": {"5": 10**400}},
                     {"top_k": 2**70}, {"min_tokens": 2**70}, {"stop_token_ids": [2**70]}):
        row = {"tenant": "acme", "adapter_version": "acme@1", "metadata_json": json.dumps({**served, "sampling": sampling})}
        assert sampled_with(row).startswith("unreadable sampling record"), sampling  # weight 1, not an exception
    text = tok("12 cats", add_special_tokens=False).input_ids
    rows = trajectories("acme", [
        {"id": "probabilities", "prompt": "q", "completion": "12 cats", "reward": 1.0,
         "completion_token_ids": text, "completion_logprobs": [0.5, 0.9, 0.1, 0.7]},
        {"id": "hole", "prompt": "q", "completion": "12 cats", "reward": 1.0,
         "completion_token_ids": [text[0], None, *text[2:]]},
    ])
    examples, unusable = to_examples(rows, tok, vocab_size=len(tok))
    assert [e.id for e in examples] == ["probabilities"] and examples[0].behaviour_logprobs is None
    assert unusable == {"hole": "completion_token_ids holds a null"}
    # what training keeps of a row (batch.truncate), and no more: a megabyte of text is cut before it is tokenized
    huge = trajectories("acme", [{"id": "huge", "prompt": "q " * 2000, "completion": "cats " * 200_000, "reward": 1.0},
                                 {"id": "ids", "prompt": "q", "completion": "x", "reward": 1.0,
                                  "completion_token_ids": text * 100, "completion_logprobs": [-1.0] * 400}])
    examples, _ = to_examples(huge, tok, vocab_size=len(tok), max_len=64)
    for e in examples:
        assert len(e.completion_ids) == 63 and len(e.prompt_ids) == 1, e.id
    assert examples[1].behaviour_logprobs == (-1.0,) * 63
    assert examples[0].completion_ids == tuple(tok("cats " * 200, add_special_tokens=False).input_ids[:63])
    # the cut text's first tokens are the whole text's: its logged log-probs still line up with them
    whole = tok("cats " * 400, add_special_tokens=False).input_ids
    logged = trajectories("acme", [{"id": "lp", "prompt": "q", "completion": "cats " * 400, "reward": 1.0,
                                    "completion_logprobs": [-0.5 - i / 1000 for i in range(len(whole))]}])
    (example,), _ = to_examples(logged, tok, vocab_size=len(tok), max_len=64)
    assert example.behaviour_logprobs == pytest.approx([-0.5 - i / 1000 for i in range(63)], abs=1e-6)


def test_staleness_is_counted_in_version_numbers():
    # learner at version 10, max_staleness 4: versions 6..10 are fresh, 5 and older are stale
    assert stale_reason("acme@10", "acme", 10, 4) is None
    assert stale_reason("acme@6", "acme", 10, 4) is None
    assert "stale: made by version 5, 5 behind 10" in stale_reason("acme@5", "acme", 10, 4)
    assert "stale" in stale_reason(None, "acme", 10, 4)  # base model output, 10 versions ago
    assert stale_reason(None, "acme", 0, 0) is None  # nothing published yet: the base is current
    # newer than the learner's (it followed a retire of 11 and 12 back to 10): withdrawn, whatever max_staleness
    assert "withdrawn: made by version 12, newer than 10, retired since" in stale_reason("acme@12", "acme", 10, 0)
    assert "withdrawn" in stale_reason("acme@12", "acme", 10, 4)
    assert "withdrawn" in stale_reason("acme@1", "acme", 0, 4)  # every version retired: a fresh adapter
    assert "foreign adapter 'beta@3'" in stale_reason("beta@3", "acme", 10, 4)


def test_with_the_served_versions_staleness_counts_them_not_the_numbers_rejects_took():
    served = [1, 2, 7, 10]  # 3..6, 8 and 9 were rejected candidates (never served)
    assert stale_reason("acme@2", "acme", 10, 2, served) is None  # 7 and 10 since: 2 behind
    assert "stale: made by version 1, 3 behind 10" in stale_reason("acme@1", "acme", 10, 2, served)
    assert "stale: made by version 0, 4 behind 10" in stale_reason(None, "acme", 10, 3, served)
    assert stale_reason("acme@7", "acme", 10, 1, served) is None
    assert "withdrawn" in stale_reason("acme@12", "acme", 10, 4, [*served, 12])  # retired since
    assert "8 behind 10" in stale_reason("acme@2", "acme", 10, 2, [1, 2])  # a list without 10: by numbers
    kept = select_fresh(trajectories("acme", [{"id": "a", "prompt": "p", "completion": "c", "reward": 1.0,
                                                "adapter_version": "acme@2"}]), "acme", 10, 2, served)
    assert kept.kept.num_rows == 1 and not kept.dropped


def test_a_flat_batch_is_two_or_more_equal_finite_rewards():
    assert is_flat([0.0, 0.0, 0.0]) and is_flat([1.0, 1.0])
    assert not is_flat([0.0]) and not is_flat([]) and not is_flat([0.0, 0.05])
    assert not is_flat([math.nan, math.nan])  # a poisoned batch goes to the gate, not around it
    assert baseline_after(None, [0.0, 0.0]) == 0.0
    assert baseline_after(0.5, [0.0, 0.0]) == pytest.approx(0.45)  # 0.9 * 0.5 + 0.1 * 0


def test_rewards_beyond_the_gates_limit_are_left_out_naming_the_value_and_a_nan_stays_for_the_gate():
    def example(i, reward):
        return Example(id=i, group="p", prompt_ids=(1,), completion_ids=(2,), reward=reward)

    batch = [example("in", 0.5), example("edge", -100.0), example("far", 100.5), example("huge", 1e12),
             example("nan", math.nan)]
    kept, dropped = within_reward_range(batch, 100.0)
    assert [e.id for e in kept] == ["in", "edge", "nan"]  # a NaN is no value ingest lets in: the gate rejects it
    assert set(dropped) == {"far", "huge"} and "reward 1e+12 beyond +-100" in dropped["huge"]


def test_select_fresh_keeps_order_and_names_every_drop():
    rows = trajectories(
        "acme",
        [
            {"id": "a", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": "acme@9"},
            {"id": "b", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": "acme@2"},
            {"id": "c", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": "zed@9"},
            {"id": "d", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": "acme@10"},
        ],
    )
    sel = select_fresh(rows, "acme", current=10, max_staleness=4)
    assert sel.kept.column("id").to_pylist() == ["a", "d"]
    assert set(sel.dropped) == {"b", "c"}
    # every row stale (the base model served them, the learner is far ahead): an empty table, not an error
    none = select_fresh(rows, "acme", current=30, max_staleness=4)
    assert none.kept.num_rows == 0 and none.kept.schema == rows.schema and len(none.dropped) == 4


def test_rows_without_a_version_age_only_when_clora_served_them():
    """A row without a version is the base model's (version 0) when clora's serving tier logged it (it sets
    metadata.served_by); one an app produced to Kafka itself was made by the app's model and never ages."""
    rows = trajectories("newco", [
        {"id": "a", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": None},
        {"id": "b", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": "newco@2"},
        {"id": "c", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": "zed@9"},
        {"id": "d", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": None,
         "metadata": {"served_by": "tiny", "endpoint": "chat", "latency_ms": 5.0, "usage": {}, "sampling": {}}},
        {"id": "e", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": None,
         "metadata": {"app": "shop"}},
        {"id": "f", "prompt": "p", "completion": "c", "reward": 1.0, "adapter_version": None,
         "metadata": {"served_by": "pod-7", "endpoint": "/chat"}},  # an app's own keys of the same names
    ])
    sel = select_fresh(rows, "newco", current=30, max_staleness=4)
    assert sel.kept.column("id").to_pylist() == ["a", "e", "f"] and set(sel.dropped) == {"b", "c", "d"}
    assert "stale" in sel.dropped["b"] and "foreign" in sel.dropped["c"]
    assert "made by version 0" in sel.dropped["d"]
    assert select_fresh(rows, "newco", current=4, max_staleness=4).kept.column("id").to_pylist() == ["a", "b", "d", "e", "f"]


def test_a_placeholder_log_prob_is_unknown_not_a_behaviour_log_prob(tiny_model):
    """Serving answers -inf (or NaN) as -9999, as vLLM's server does: taken as the behaviour's log-prob, that
    token's weight was the cap's; unknown, it gets weight 1 (NaN)."""
    from transformers import AutoTokenizer

    from learner.rollouts import _sampled_logprobs

    rows = trajectories("acme", [{"id": "a", "prompt": chat_prompt("q"), "completion": "xyz", "reward": 0.5,
                                  "completion_token_ids": [40, 41, 2], "completion_logprobs": [-1.0, -9999.0, -0.5]}])
    (a,), _ = to_examples(rows, AutoTokenizer.from_pretrained(tiny_model))
    assert a.behaviour_logprobs[0::2] == (-1.0, -0.5) and math.isnan(a.behaviour_logprobs[1])
    got = _sampled_logprobs({"token_ids": [5, 6, 7], "logprobs": {"token_logprobs": [-0.1, -9999.0, None]}})
    assert got[0] == -0.1 and math.isnan(got[1]) and math.isnan(got[2])


def test_rows_become_examples_with_token_ids_and_behaviour_logprobs_when_usable(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": "hi there"}]
    rows = trajectories(
        "acme",
        [
            # stored token ids and matching logprobs: used as they are
            {"id": "a", "prompt": chat_prompt("q"), "completion": "xyz", "reward": 0.5, "completion_token_ids": [40, 41, 2], "completion_logprobs": [-1.0, -2.0, -0.5]},
            # logprobs that do not match the tokens: dropped (the update falls back to ratio 1)
            {"id": "b", "prompt": chat_prompt("q"), "completion": "12 cats", "reward": -1.0, "completion_logprobs": [-1.0]},
            # no prompt text: rendered from the messages
            {"id": "c", "messages_json": json.dumps(messages), "completion": "ok", "reward": 1.0},
            # nothing to train on
            {"id": "d", "prompt": chat_prompt("q"), "completion": "", "reward": 1.0},
            {"id": "e", "completion": "orphan", "reward": 1.0},
        ],
    )
    examples, unusable = to_examples(rows, tok)
    assert [e.id for e in examples] == ["a", "b", "c"]
    assert set(unusable) == {"d", "e"}
    # token ids beyond the model's vocabulary would fail every step of the tenant: unusable, with the reason
    _, unusable_small = to_examples(rows, tok, vocab_size=41)  # a's stored ids include 41
    assert "outside the model's vocabulary of 41" in unusable_small["a"]
    assert [e.id for e in to_examples(rows, tok, vocab_size=len(tok))[0]] == ["a", "b", "c"]
    a, b, c = examples
    assert a.completion_ids == (40, 41, 2) and a.behaviour_logprobs == (-1.0, -2.0, -0.5)
    assert b.completion_ids == (*tok("12 cats", add_special_tokens=False).input_ids, tok.eos_token_id)
    assert b.behaviour_logprobs is None
    assert a.group == b.group == chat_prompt("q")
    assert c.prompt_ids == tuple(tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids)
    assert c.group.endswith("<|im_start|>assistant\n")


def test_a_completion_logged_as_text_is_trained_to_its_end_unless_cut_at_the_length_limit(tiny_model):
    """Rows without completion ids (an app producing to Kafka itself) are tokenized from their text. The answer
    ended there: the end-of-sequence token is appended, as serving's sampled ids and finished rollouts have it,
    or the policy is never taught to stop. Log-probs logged for the text's tokens stay aligned."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    eos = tok.eos_token_id
    text = tuple(tok("12 cats", add_special_tokens=False).input_ids)
    assert len(text) == 4 and eos not in text
    row = {"prompt": chat_prompt("q"), "completion": "12 cats", "reward": 1.0}
    rows = trajectories("acme", [
        {**row, "id": "ended"},
        {**row, "id": "stop", "metadata": {"finish_reason": "stop"}},
        {**row, "id": "cut", "metadata": {"finish_reason": "length"}},  # cut at max_tokens: it did not end
        {**row, "id": "has_eos", "completion": "12 cats<|im_end|>"},  # ends with the token already: not twice
        {**row, "id": "text_lp", "completion_logprobs": [-1.0, -2.0, -3.0, -4.0]},  # one per token of the text
        {**row, "id": "stop_lp", "completion_logprobs": [-1.0, -2.0, -3.0, -4.0, -0.5]},  # and the stop token's
        {**row, "id": "cut_lp", "completion_logprobs": [-1.0, -2.0, -3.0, -4.0], "metadata": {"finish_reason": "length"}},
        {**row, "id": "odd_lp", "completion_logprobs": [-1.0, -2.0]},  # fits neither: left out
        {**row, "id": "ids", "completion_token_ids": [19, 20], "completion_logprobs": [-1.0, -2.0]},  # as sampled
        {**row, "id": "empty", "completion": ""},
    ])
    examples, unusable = to_examples(rows, tok, vocab_size=len(tok))
    got = {e.id: e for e in examples}
    assert set(unusable) == {"empty"}  # still nothing to train: a lone stop token is no logged answer
    assert got["ended"].completion_ids == got["stop"].completion_ids == got["has_eos"].completion_ids == (*text, eos)
    assert got["cut"].completion_ids == got["cut_lp"].completion_ids == text
    assert got["ended"].behaviour_logprobs is None and got["odd_lp"].behaviour_logprobs is None
    *known, unknown = got["text_lp"].behaviour_logprobs
    assert got["text_lp"].completion_ids == (*text, eos) and known == [-1.0, -2.0, -3.0, -4.0]
    assert math.isnan(unknown)  # the appended token's: weight 1 there (update.py)
    assert got["stop_lp"].behaviour_logprobs == (-1.0, -2.0, -3.0, -4.0, -0.5)
    assert got["cut_lp"].behaviour_logprobs == (-1.0, -2.0, -3.0, -4.0)
    assert got["ids"].completion_ids == (19, 20) and got["ids"].behaviour_logprobs == (-1.0, -2.0)


def test_a_chat_answer_logged_as_text_ends_with_the_token_its_template_closes_a_turn_with(tiny_model):
    """Gemma's template closes a turn with <end_of_turn>, Phi-3's with <|end|>, while their tokenizers' end of
    sequence is another token: appending that one taught the policy to end its answers with a token the
    model never writes there. A plain prompt's answer still ends with the end-of-sequence token."""
    from transformers import AutoTokenizer

    from learner.logs_mode import turn_end_id

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert turn_end_id(tok) == tok.eos_token_id == 2  # the tiny model's ChatML: <|im_end|> both
    tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|endoftext|>' }}"
                         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    assert turn_end_id(tok) == 0 != tok.eos_token_id
    text = tuple(tok("12 cats", add_special_tokens=False).input_ids)
    rows = trajectories("acme", [
        {"id": "chat", "messages_json": json.dumps([{"role": "user", "content": "q"}]), "completion": "12 cats",
         "reward": 1.0},
        {"id": "plain", "prompt": "q:", "completion": "12 cats", "reward": 1.0},
    ])
    examples, unusable = to_examples(rows, tok, vocab_size=len(tok))
    got = {e.id: e.completion_ids for e in examples}
    assert unusable == {} and got == {"chat": (*text, 0), "plain": (*text, tok.eos_token_id)}


def test_a_prompt_sent_as_token_ids_is_trained_on_those_ids_not_on_its_text_re_tokenized(tiny_model):
    """ids [74, 71, 78, 78, 81] decode to "hello", which re-encodes as [261, 300, 81]: the model saw the first,
    and the behaviour log-probs were sampled under them, so the learner trains on the stored ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    sent = [74, 71, 78, 78, 81]
    assert tok.decode(sent) == "hello" and tok("hello", add_special_tokens=False).input_ids == [261, 300, 81]
    rows = trajectories("acme", [
        {"id": "ids1", "prompt": "hello", "prompt_token_ids": sent, "completion": "!", "reward": 1.0,
         "completion_token_ids": [5], "completion_logprobs": [-0.5]},
        {"id": "ids2", "prompt": "hello", "prompt_token_ids": sent, "completion": "?", "reward": 0.0},
        {"id": "text", "prompt": "hello", "completion": "!", "reward": 0.5},  # no ids: the text, tokenized
        {"id": "far", "prompt": "hello", "prompt_token_ids": [74, len(tok) + 5], "completion": "!", "reward": 0.5},
    ])
    examples, unusable = to_examples(rows, tok, vocab_size=len(tok))
    ids1, ids2, text = examples
    assert ids1.prompt_ids == ids2.prompt_ids == tuple(sent)
    assert ids1.completion_ids == (5,) and ids1.behaviour_logprobs == (-0.5,)
    assert text.prompt_ids == (261, 300, 81)
    assert ids1.group == ids2.group  # the same prompt ids: one group
    assert set(unusable) == {"far"} and "prompt token ids outside the model's vocabulary" in unusable["far"]


def test_an_event_with_messages_only_is_trained_and_sampled_on_the_chat_template_not_on_ingests_text(tiny_model):
    """An app producing to Kafka itself may send `messages` without `prompt`; ingest then stores the messages'
    "role: content" lines as `prompt` (for scorers and queries). The model never saw that text: the learner
    renders the messages with the chat template, as serving does."""
    from transformers import AutoTokenizer

    from ingest.events import InteractionEvent
    from ingest.rows import Coords, interaction_row
    from learner.rollouts import plan_from_rows

    tok = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 x 7?"}]
    stored = interaction_row(InteractionEvent(id="m1", tenant="acme", messages=messages, completion="42"),
                             Coords("clora.interactions", 0, 0), 0)
    assert stored.prompt == "system: Be brief.\nuser: What is 6 x 7?"  # what ingest keeps for scorers
    template = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rows = trajectories("acme", [
        {"id": "m1", "prompt": stored.prompt, "messages_json": stored.messages_json, "completion": "42", "reward": 1.0},
        # serving's events carry both: the template's text is the prompt, used as it is
        {"id": "s1", "prompt": chat_prompt("q"), "messages_json": json.dumps([{"role": "user", "content": "q"}]),
         "completion": "ok", "reward": 0.0},
    ])
    (m1, s1), unusable = to_examples(rows, tok)
    assert unusable == {} and m1.group == template and s1.group == chat_prompt("q")
    # a tool-calling conversation: rendered as serving renders it (the calls' arguments handed to the template
    # as objects); ingest's lines now carry the calls, and a row stored before they did is still known for
    # ingest's text
    from ingest.events import template_messages

    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city":"Oslo"}'}}]
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    with_calls = tok.apply_chat_template(template_messages(turns), tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Oslo"}' in with_calls
    for lines in ("user: q\nassistant: " + json.dumps(calls) + "\ntool: 1", "user: q\nassistant: \ntool: 1"):
        row = trajectories("acme", [{"id": "t1", "prompt": lines, "messages_json": json.dumps(turns),
                                     "completion": "ok", "reward": 1.0}])
        (t1,), _ = to_examples(row, tok)
        assert t1.group == with_calls, lines
    assert plan_from_rows(rows, 2, tokenizer=tok).prompts == (template, chat_prompt("q"))
    # a prompt serving would refuse as past the context is skipped, consumed: the step does not fail on it again
    long = trajectories("acme", [{"id": "long", "prompt": "word " * 600, "completion": "x", "reward": 1.0},
                                 {"id": "short", "prompt": "hi", "completion": "x", "reward": 1.0}])
    plan = plan_from_rows(long, 2, tokenizer=tok, max_prompt_tokens=511)
    assert plan.prompts == ("hi",) and plan.consumed_ids == ("long", "short")
    # a row served with ids its text does not re-tokenize to (sent as ids, or a BOS serving added): the
    # rollouts prompt is those ids, special tokens included, as the tokenizer reads them back
    eos = tok.convert_ids_to_tokens(tok.eos_token_id)
    served = [tok.eos_token_id] + tok("hello", add_special_tokens=False).input_ids  # a special token first, as a BOS
    with_ids = trajectories("acme", [{"id": "b1", "prompt": "hello", "completion": "x", "reward": 1.0,
                                      "prompt_token_ids": served}])
    (prompt,) = plan_from_rows(with_ids, 1, tokenizer=tok).prompts
    assert prompt.startswith(eos) and tok(prompt, add_special_tokens=False).input_ids == served

    class StrictTemplate:  # a template with rules of its own (say, roles that must alternate)
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    examples, unusable = to_examples(rows, StrictTemplate())
    assert [e.id for e in examples] == ["s1"] and set(unusable) == {"m1"}  # unusable, not a failing step
