"""Logs mode's behaviour log-probs for completions the serving engine drew otherwise than at temperature 1
(tiny model, CPU).

Serving logs vLLM's raw log-probs (temperature 1, before any cut) and the request's sampling settings. For
a completion drawn at another temperature, or with top-k, top-p, min-p, a logit bias, penalties or
min_tokens, the raw ones are
not the behaviour policy's: the step recomputes them from the drawing version's logits under those
settings (maths.processed_logprobs), instead of weighing its tokens against the wrong distribution.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from learner import maths
from learner.batch import pack
from learner.logs_mode import SERVING_KEYS, behaviour_logprobs, sampled_with, to_examples, train_step
from learner.policy import Policy
from learner.rollouts import LocalSampler, SampleRequest, render_user_prompt
from learner.types import Example, SampledWith, TenantSpec
from learner_support import LEARNABLE_TARGETS, trajectories
from serving.api import _sampling_metadata
from serving.engine import Sampling

pytestmark = pytest.mark.unit


def _served(sampling: dict, version: str | None = "acme@3", **extra) -> dict:
    """A trajectory row as clora's serving tier logs it (every SERVING_KEYS key in its metadata)."""
    meta = {key: None for key in SERVING_KEYS} | {"sampling": sampling}
    return {"tenant": "acme", "adapter_version": version, "metadata_json": json.dumps(meta), **extra}


def test_serving_records_the_settings_that_shaped_the_draw_and_logs_mode_reads_them_back():
    record = _sampling_metadata(Sampling(temperature=0.5, top_p=0.8, top_k=5, min_p=0.1, logit_bias=((3, 1.5),)))
    assert sampled_with(_served(record)) == SampledWith(version=3, temperature=0.5, top_k=5, top_p=0.8, min_p=0.1,
                                                        logit_bias=((3, 1.5),))
    assert sampled_with(_served(_sampling_metadata(Sampling(temperature=0.0)), version=None)) == SampledWith(
        version=0, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    # temperature 1 with nothing cut: the logged raw log-probs are the behaviour's
    assert sampled_with(_served(_sampling_metadata(Sampling(seed=7, stop=("x",))))) is None
    assert sampled_with(_served(_sampling_metadata(Sampling(top_k=-1)))) is None  # -1 is off, as 0
    # an app's own row: its log-probs are its own model's, taken as they are
    assert sampled_with({"tenant": "acme", "adapter_version": None,
                         "metadata_json": json.dumps({"sampling": {"temperature": 0.2}})}) is None
    # the settings that read the tokens so far: recomputed too, at temperature 1 as well
    record = _sampling_metadata(Sampling(temperature=0.5, repetition_penalty=1.2, presence_penalty=-0.5,
                                         frequency_penalty=0.3, min_tokens=3, stop_token_ids=(7, 9)))
    assert sampled_with(_served(record)) == SampledWith(
        version=3, temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=-0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, min_tokens=3, stop_token_ids=(7, 9))
    assert sampled_with(_served(_sampling_metadata(Sampling(min_tokens=3)))) == SampledWith(
        version=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, min_tokens=3)
    assert sampled_with(_served(_sampling_metadata(Sampling(stop_token_ids=(7,))))) is None  # changes no draw alone
    # what cannot be recomputed here: said why (the row then trains with weight 1)
    assert "unreadable" in sampled_with(_served("warm"))
    assert "unreadable" in sampled_with(_served({"temperature": "0.5"}))
    assert "unreadable" in sampled_with(_served({"temperature": True}))
    for bad in ({"temperature": -0.5}, {"top_k": 2.5}, {"top_p": 1.5}, {"logit_bias": {"-1": 5.0}},
                {"logit_bias": {"x": 5.0}}, {"min_p": float("nan")}, {"repetition_penalty": 0},
                {"presence_penalty": 2.5}, {"frequency_penalty": "1"}, {"min_tokens": -1}, {"min_tokens": 1.5},
                {"stop_token_ids": [1.5]}, {"stop_token_ids": "ab"}):
        assert "unreadable" in sampled_with(_served({"temperature": 0.5, **bad})), bad
    assert "another tenant" in sampled_with(_served({"temperature": 0.5}, version="beta@2"))
    # drawn under a response_format grammar: at temperature 1 the logged log-probs are the masked ones the
    # engine drew from; otherwise the mask cannot be rebuilt to recompute them
    for structured in (("json_object", ""), ("json_schema", '{"type":"object"}')):
        assert sampled_with(_served(_sampling_metadata(Sampling(structured=structured)))) is None
        record = _sampling_metadata(Sampling(structured=structured, temperature=0.7))
        assert "structured-output grammar" in sampled_with(_served(record))
        greedy = sampled_with(_served(_sampling_metadata(Sampling(structured=structured, temperature=0.0))))
        assert greedy.temperature == 0.0  # each token had probability 1, mask or not


def test_rows_drawn_otherwise_carry_how_and_not_their_logged_log_probs(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("hello there", add_special_tokens=False).input_ids
    common = {"prompt": "p", "completion": "hello there", "reward": 1.0, "completion_token_ids": ids,
              "completion_logprobs": [-0.5] * len(ids)}
    rows = trajectories("acme", [
        {"id": "hot", **common, "adapter_version": "acme@3",
         "metadata": {key: None for key in SERVING_KEYS} | {"sampling": {"temperature": 0.7, "top_p": 0.9}}},
        {"id": "plain", **common, "adapter_version": "acme@3",
         "metadata": {key: None for key in SERVING_KEYS} | {"sampling": {"temperature": 1.0, "top_p": 1.0}}},
        {"id": "penalised", **common, "adapter_version": "acme@3",
         "metadata": {key: None for key in SERVING_KEYS} | {"sampling": {"temperature": 0.7, "presence_penalty": 1.0}}},
        {"id": "apps", **common, "metadata": {"sampling": {"temperature": 0.7}}},
    ])
    examples, unusable = to_examples(rows, tok)
    assert not unusable
    by_id = {e.id: e for e in examples}
    assert by_id["hot"].sampled_with == SampledWith(3, 0.7, 0, 0.9, 0.0) and by_id["hot"].behaviour_logprobs is None
    assert by_id["plain"].sampled_with is None and by_id["plain"].behaviour_logprobs == (-0.5,) * len(ids)
    assert by_id["penalised"].sampled_with == SampledWith(3, 0.7, 0, 1.0, 0.0, presence_penalty=1.0)
    assert by_id["penalised"].behaviour_logprobs is None
    assert by_id["apps"].sampled_with is None and by_id["apps"].behaviour_logprobs == (-0.5,) * len(ids)


@pytest.fixture()
def policy(tiny_model):
    torch.manual_seed(0)
    policy = Policy(tiny_model, device="cpu")
    policy.add_tenant(replace(TenantSpec.default("acme"), target_modules=tuple(LEARNABLE_TARGETS)))
    with torch.no_grad():  # an adapter away from the base model, so the two give different log-probs
        for _, p in policy._params["acme"]:
            p.add_(torch.randn_like(p) * 0.3)
    return policy


def _examples(policy, n: int, settings: list[SampledWith | None]) -> list[Example]:
    prompt = render_user_prompt(policy.tokenizer, "hello")
    (group,) = LocalSampler(policy).sample([SampleRequest("acme", "", prompt, n, 8, 1.0)])
    prompt_ids = tuple(policy.tokenizer(prompt, add_special_tokens=False).input_ids)
    return [Example(id=f"e{i}", group=prompt, prompt_ids=prompt_ids, completion_ids=tuple(s.token_ids),
                    reward=float(i % 2), behaviour_logprobs=tuple(-1.0 for _ in s.token_ids), sampled_with=drawn)
            for i, (s, drawn) in enumerate(zip(group, settings))]


def _behaviour(policy, examples, batch, **kw) -> torch.Tensor:
    """behaviour_logprobs with the current adapter's and the base model's rows filled in by passes of their
    own, where a step takes them from passes it runs anyway (pg_update's behaviour_from_logits and
    behaviour_from_base_logits)."""
    behaviour = behaviour_logprobs(policy, "acme", examples, batch, **kw)
    old = behaviour.old
    for adapter, made_by in (("acme", behaviour.from_adapter), (None, behaviour.from_base)):
        if made_by is not None:
            assert torch.isnan(old[list(made_by.position)]).all()
            made = policy.processed_logprobs(batch, adapter, made_by, rows_per_pass=kw.get("rows_per_pass"))
            old = torch.where(torch.isnan(made), old, made)
    return old


def _expected(policy, batch, adapter, drawn: SampledWith, history: maths.History | None = None) -> torch.Tensor:
    with policy.adapter(adapter), torch.no_grad():
        logits = policy._completion_logits(batch)
    n = batch.size
    bias = None
    if drawn.logit_bias:
        bias = torch.zeros(n, policy.vocab_size)
        for token, value in drawn.logit_bias:
            bias[:, token] = value
    return maths.processed_logprobs(logits, batch.completion_ids, torch.full((n,), drawn.temperature),
                                    torch.full((n,), drawn.top_k), torch.full((n,), drawn.top_p),
                                    torch.full((n,), drawn.min_p), bias, history=history)


def test_behaviour_log_probs_are_recomputed_from_the_version_that_drew_each_row(policy, tmp_path):
    current = SampledWith(version=3, temperature=0.5, top_k=0, top_p=0.9, min_p=0.0)
    base = SampledWith(version=0, temperature=0.7, top_k=5, top_p=1.0, min_p=0.0)
    earlier = SampledWith(version=1, temperature=1.5, top_k=0, top_p=1.0, min_p=0.1, logit_bias=((5, 2.0),))
    pruned = SampledWith(version=2, temperature=0.5, top_k=0, top_p=1.0, min_p=0.0)
    greedy = SampledWith(version=3, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    examples = _examples(policy, 6, [current, base, earlier, pruned, greedy, None])
    batch = pack([e.prompt_ids for e in examples], [e.completion_ids for e in examples],
                 pad_id=policy.pad_token_id, max_len=256)
    weights = {n: p.detach().clone() for n, p in policy._params["acme"]}
    one = tmp_path / "v1"
    one.mkdir()
    with torch.no_grad():
        for _, p in policy._params["acme"]:
            p.add_(torch.randn_like(p) * 0.3)
    policy.save_adapter("acme", one)
    with policy.weights_of_version("acme", one):
        want_earlier = _expected(policy, batch, "acme", earlier)
    with torch.no_grad():
        for n, p in policy._params["acme"]:
            p.copy_(weights[n])

    old = _behaviour(policy, examples, batch, current_version=3, version_files={1: one}.get, rows_per_pass=2)
    mask = batch.completion_mask.bool()

    def same(row, expected):
        return torch.allclose(old[row][mask[row]], expected[row][mask[row]], atol=1e-5)

    assert same(0, _expected(policy, batch, "acme", current))
    assert same(1, _expected(policy, batch, None, base))
    assert same(2, want_earlier)
    assert not same(2, _expected(policy, batch, "acme", earlier))  # version 1's weights, not the current ones
    assert torch.isnan(old[3]).all()  # version 2's files are gone: unknown, weight 1
    assert (old[4][mask[4]] == 0).all()  # greedy: probability 1
    assert (old[5][mask[5]] == -1.0).all()  # logged at temperature 1: taken as logged
    assert not same(0, torch.log_softmax(policy._completion_logits(batch).detach(), -1).gather(
        -1, batch.completion_ids.unsqueeze(-1)).squeeze(-1))  # not the raw (temperature 1) log-probs
    assert all(torch.equal(p, weights[n]) for n, p in policy._params["acme"])  # the current weights are back


@pytest.mark.parametrize("micro_batch_size", [None, 3])
@pytest.mark.parametrize("current_version", [3, 0])
def test_a_step_weighs_each_token_against_the_distribution_it_was_drawn_from(policy, micro_batch_size, current_version):
    """The current adapter's rows get their behaviour log-probs from the step's own first pass, the base
    model's from its reference pass (micro-batch by micro-batch, some holding rows of several sorts): the
    same as passes of their own give. Before the tenant's first version, the base model is its current one."""
    drawn = SampledWith(version=current_version, temperature=0.5, top_k=0, top_p=0.9, min_p=0.0)
    base = SampledWith(version=0, temperature=0.7, top_k=5, top_p=1.0, min_p=0.0)
    examples = _examples(policy, 6, [drawn, drawn, base, base, None, drawn])
    batch = pack([e.prompt_ids for e in examples], [e.completion_ids for e in examples],
                 pad_id=policy.pad_token_id, max_len=256)
    recomputed = _behaviour(policy, examples, batch, current_version=current_version, version_files=None)
    raw = policy.token_logprobs(batch, "acme")  # what serving logged for them

    def step(examples):
        snapshot = policy.snapshot("acme")
        try:
            return train_step(policy, "acme", examples, baseline=None, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0,
                              max_len=256, current_version=current_version,
                              micro_batch_size=micro_batch_size).update
        finally:
            policy.restore("acme", snapshot)

    def logged(values):
        return [replace(e, sampled_with=None, behaviour_logprobs=tuple(values[i, : len(e.completion_ids)].tolist()))
                if e.sampled_with else e for i, e in enumerate(examples)]

    got = step(examples)
    assert got.grad_norm == pytest.approx(step(logged(recomputed)).grad_norm, rel=1e-4)
    assert got.pg_loss == pytest.approx(step(logged(recomputed)).pg_loss, rel=1e-4, abs=1e-7)
    # weighed against the raw log-probs the step would be the on-policy one (every weight 1), which it is not
    assert not math.isclose(got.pg_loss, step(logged(raw)).pg_loss, rel_tol=1e-3, abs_tol=1e-6)


def test_a_version_whose_files_cannot_be_read_trains_its_rows_with_weight_1_not_failing_every_step(policy, tmp_path):
    drawn = SampledWith(version=1, temperature=0.5, top_k=0, top_p=1.0, min_p=0.0)
    examples = _examples(policy, 2, [drawn, drawn])
    batch = pack([e.prompt_ids for e in examples], [e.completion_ids for e in examples],
                 pad_id=policy.pad_token_id, max_len=256)
    damaged = tmp_path / "v1"
    damaged.mkdir()
    policy.save_adapter("acme", damaged)
    weights = damaged / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short
    before = {n: p.detach().clone() for n, p in policy._params["acme"]}
    old = _behaviour(policy, examples, batch, current_version=3, version_files={1: damaged}.get)
    assert torch.isnan(old).all()
    assert all(torch.equal(p, before[n]) for n, p in policy._params["acme"])


def test_penalties_and_min_tokens_are_recomputed_from_the_whole_prompt_and_the_models_and_requests_stops(policy):
    """A row drawn with penalties and min_tokens: each position's distribution counts the completion's
    tokens before it and the whole prompt's (also when the batch cut the prompt to max_len, as the engine
    did not), and cuts the model's stop tokens and the request's own before min_tokens."""
    drawn = SampledWith(version=3, temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.7,
                        frequency_penalty=0.4, repetition_penalty=1.5, min_tokens=4, stop_token_ids=(11,))
    examples = _examples(policy, 3, [drawn, drawn, None])
    batch = pack([e.prompt_ids for e in examples], [e.completion_ids for e in examples],
                 pad_id=policy.pad_token_id, max_len=256)
    old = _behaviour(policy, examples, batch, current_version=3, version_files=None)
    prompt = torch.tensor([list(e.prompt_ids) for e in examples])
    stops = torch.tensor([[*policy.stop_token_ids, 11]] * 3)
    history = maths.History(prompt_ids=prompt, stops=stops, min_tokens=torch.full((3,), 4),
                            presence=torch.full((3,), 0.7), frequency=torch.full((3,), 0.4),
                            repetition=torch.full((3,), 1.5))
    want = _expected(policy, batch, "acme", drawn, history)
    plain = _expected(policy, batch, "acme", drawn)
    mask = batch.completion_mask.bool()
    for row in (0, 1):
        assert torch.allclose(old[row][mask[row]], want[row][mask[row]], atol=1e-5)
        assert not torch.allclose(old[row][mask[row]], plain[row][mask[row]], atol=1e-3)  # not the plain draw
    assert (old[2][mask[2]] == -1.0).all()
    # the batch cut to the completion and a little of the prompt: the prompt's penalties still count all of it
    width = max(len(e.completion_ids) for e in examples)
    short = pack([e.prompt_ids for e in examples], [e.completion_ids for e in examples],
                 pad_id=policy.pad_token_id, max_len=width + 2)
    assert short.prompt_width < prompt.shape[1]
    cut = _behaviour(policy, examples, short, current_version=3, version_files=None)
    cut_history = replace(history, prompt_ids=short.input_ids[:, : short.prompt_width].masked_fill(
        short.attention_mask[:, : short.prompt_width] == 0, -1))
    assert torch.allclose(cut[:2], _expected(policy, short, "acme", drawn, history)[:2], atol=1e-5)
    assert not torch.allclose(cut[:2], _expected(policy, short, "acme", drawn, cut_history)[:2], atol=1e-4)
    # a stop id beyond the vocabulary (another model's) has no logit to cut: left out, as logit_bias's are
    beyond = replace(drawn, stop_token_ids=(11, policy.vocab_size + 5))
    examples = _examples(policy, 3, [beyond, beyond, None])
    far = _behaviour(policy, examples, batch, current_version=3, version_files=None)
    assert torch.allclose(far[:2], old[:2], atol=1e-6)


def test_the_kl_penalty_is_weighed_like_the_policy_gradient(policy):
    """The KL term is an expectation over the adapter's tokens too: drawn by a behaviour policy four times as
    likely to draw them, it counts a quarter (unweighted, it pulled as if the adapter had drawn them)."""
    from learner.update import pg_update

    examples = _examples(policy, 4, [None] * 4)
    batch = pack([e.prompt_ids for e in examples], [e.completion_ids for e in examples],
                 pad_id=policy.pad_token_id, max_len=256)
    proximal = policy.token_logprobs(batch, "acme")
    no_advantage = torch.zeros(batch.size)

    def step(old_logprobs):
        snapshot = policy.snapshot("acme")
        try:
            return pg_update(policy, "acme", batch, no_advantage, old_logprobs=old_logprobs, clip_eps=0.2,
                             kl_coef=1.0, max_grad_norm=1e9)
        finally:
            policy.restore("acme", snapshot)

    on_policy, quarter = step(None), step(proximal + math.log(4))
    assert on_policy.loss > 0 and on_policy.pg_loss == 0
    assert quarter.loss == pytest.approx(on_policy.loss / 4, rel=1e-3)
    assert quarter.grad_norm == pytest.approx(on_policy.grad_norm / 4, rel=1e-3)
