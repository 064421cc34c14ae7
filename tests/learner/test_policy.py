"""learner/policy.py on the tiny model: padding, adapters side by side, PEFT files, checkpoints."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from learner.batch import pack
from learner.policy import Policy, PolicyError, adapter_name, read_adapter_shape
from learner.types import TenantSpec
from learner.update import pg_update

pytestmark = pytest.mark.unit


def spec(name, **kw):
    return replace(TenantSpec.default(name), **kw)


TENANTS = ("acme", "beta.prod")


@pytest.fixture(scope="module")
def fresh_policy(tiny_model):
    """One Policy for the module (a load takes seconds), with the snapshot of its fresh adapters."""
    p = Policy(tiny_model, device="cpu")
    p.add_tenant(spec("acme", rank=8, learning_rate=1e-2))
    p.add_tenant(spec("beta.prod", rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), learning_rate=1e-2))
    return p, {t: p.snapshot(t) for t in TENANTS}


@pytest.fixture
def policy(fresh_policy):
    """The module's Policy as it was built: fresh adapters, empty optimizers, no gradients, whatever the
    tests before this one trained."""
    p, fresh = fresh_policy
    for t in TENANTS:
        p.restore(t, fresh[t])
        p.zero_grad(t)
        assert all(torch.equal(param, fresh[t].weights[n]) for n, param in p._params[t]), f"{t} not restored"
        assert p._optimizers[t].state_dict()["state"] == {}, f"{t}'s optimizer not restored"
    return p


def small_batch(policy, completions=("12 cats", "x", "hello there friend")):
    tok = policy.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) for q in ("a", "bb bb", "what is 2 + 2?")]
    p_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    c_ids = [tok(c, add_special_tokens=False).input_ids for c in completions]
    return pack(p_ids, c_ids, pad_id=policy.pad_token_id, max_len=256), p_ids, c_ids


def test_adapter_names_are_module_safe_and_none_holds_another():
    """peft matches adapter names in state-dict keys by substring: a readable name let tenant
    `acme_prod_d2836b7d` (which a Kafka producer may create) hold `acme-prod`'s name."""
    names = [adapter_name(t) for t in ("acme", "beta.prod", "a-b", "a.b", "a_b", "acme-prod", "acme_prod_d2836b7d")]
    assert all(re.fullmatch(r"clora_[0-9a-f]{16}", n) for n in names) and len(set(names)) == len(names)
    assert not any(a in b for a in names for b in names if a != b)


def test_padded_batch_gives_the_same_logprobs_as_each_row_alone(policy):
    batch, p_ids, c_ids = small_batch(policy)
    together = policy.token_logprobs(batch, "acme")
    for i in range(batch.size):
        alone = policy.token_logprobs(pack([p_ids[i]], [c_ids[i]], pad_id=policy.pad_token_id, max_len=256), "acme")
        n = len(c_ids[i])
        # a padding or masking bug moves log-probs by tenths of a nat; CPU kernels for other shapes by ~1e-4
        assert torch.allclose(together[i, :n], alone[0, :n], atol=1e-4, rtol=1e-4)


def test_fresh_adapters_equal_the_base_and_disabling_gives_the_base(policy, tiny_model):
    from transformers import AutoModelForCausalLM

    batch, _, _ = small_batch(policy)
    base = policy.token_logprobs(batch, None)
    # LoRA B starts at zero: a fresh adapter changes nothing
    fresh = Policy(tiny_model, device="cpu")
    fresh.add_tenant(spec("new"))
    assert torch.allclose(fresh.token_logprobs(batch, "new"), base, atol=1e-5)
    # and the disabled adapter is the plain model loaded without peft
    plain = AutoModelForCausalLM.from_pretrained(tiny_model)
    logits = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    ref = logits[:, batch.prompt_width - 1 : -1].log_softmax(-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    mask = batch.completion_mask.bool()
    assert torch.allclose(base[mask], ref[mask], atol=1e-4)


def test_training_one_tenant_leaves_the_other_and_the_base_untouched(policy):
    batch, _, _ = small_batch(policy)
    before_beta = policy.token_logprobs(batch, "beta.prod")
    before_base = policy.token_logprobs(batch, None)
    before_acme = policy.token_logprobs(batch, "acme")
    for _ in range(3):
        pg_update(policy, "acme", batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    assert not torch.allclose(policy.token_logprobs(batch, "acme"), before_acme)
    assert torch.equal(policy.token_logprobs(batch, "beta.prod"), before_beta)
    assert torch.equal(policy.token_logprobs(batch, None), before_base)


def test_exact_kl_to_the_base_is_zero_for_a_fresh_adapter_and_matches_the_full_distributions(policy, tiny_model):
    batch, _, _ = small_batch(policy)
    mask = batch.completion_mask.bool()
    fresh = Policy(tiny_model, device="cpu")
    fresh.add_tenant(spec("new"))
    assert torch.allclose(fresh.kl_to_base(batch, "new")[mask], torch.zeros(int(mask.sum())), atol=1e-5)

    pg_update(policy, "acme", batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    kl = policy.kl_to_base(batch, "acme", rows_per_pass=2)  # rows in two passes: the same as in one
    assert torch.allclose(kl, policy.kl_to_base(batch, "acme"), atol=1e-6)
    assert (kl[mask] > 0).all()
    # by hand for one row: sum_v p (log p - log q) from the two models' full distributions
    row = batch.rows(slice(0, 1))
    dists = []
    for who in ("acme", None):
        with policy.adapter(who), torch.no_grad():
            logits = policy.model(input_ids=row.input_ids, attention_mask=row.attention_mask,
                                  position_ids=row.position_ids).logits
        dists.append(logits[0, row.prompt_width - 1 : -1].log_softmax(-1))
    p, q = dists
    by_hand = (p.exp() * (p - q)).sum(-1)
    n = int(batch.completion_mask[0].sum())
    assert torch.allclose(kl[0, :n], by_hand[:n], atol=1e-4)


def test_several_epochs_on_one_batch_learn_more_within_a_clip_around_where_the_step_began(policy):
    batch, _, _ = small_batch(policy)
    advantages = torch.tensor([1.0, -1.0, 0.5])
    mask = batch.completion_mask.bool()
    start = policy.snapshot("acme")
    before = policy.token_logprobs(batch, "acme")

    def moved(**kw):
        """How far the step raised the log-probs of row 0 (advantage +1), and the step's result."""
        policy.restore("acme", start)
        result = pg_update(policy, "acme", batch, advantages, **kw)
        return float((policy.token_logprobs(batch, "acme") - before)[0][mask[0]].mean()), result

    one, one_result = moved(clip_eps=0.05)
    clipped, clipped_result = moved(clip_eps=0.05, epochs=4)
    free, _ = moved(clip_eps=1e6, epochs=4)
    assert one_result.clip_frac == 0.0  # one step on fresh samples: ratio 1, weight 1, nothing cut
    assert clipped_result.clip_frac > 0.0 and clipped_result.finite
    assert 0 < one < clipped < free  # more steps learn more; the clip holds them back
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        pg_update(policy, "acme", batch, advantages, clip_eps=0.2, epochs=0)
    poisoned = pg_update(policy, "acme", batch, torch.tensor([float("nan"), 1.0, 0.5]), clip_eps=0.2, epochs=3)
    assert not poisoned.finite  # stops at the first non-finite gradient and reports it, for the gate


def test_the_entropy_bonus_keeps_the_policy_spread_where_the_same_steps_collapse_it_without(policy):
    """Steps that push one answer up: without the bonus the policy's entropy at its positions falls;
    with it, it falls less. A step with the bonus off reports no entropy."""
    batch, _, _ = small_batch(policy)
    mask = batch.completion_mask.bool()
    advantages = torch.tensor([1.0, -1.0, -1.0])
    start = policy.snapshot("acme")

    def entropy_after(coef: float, steps: int = 6) -> tuple[float, float]:
        policy.restore("acme", start)
        for _ in range(steps):
            result = pg_update(policy, "acme", batch, advantages, clip_eps=0.2, entropy_coef=coef)
        _, entropy = policy.token_logprobs_and_entropy(batch, "acme")
        return float(entropy[mask].mean()), result.entropy

    fresh = float(policy.token_logprobs_and_entropy(batch, "acme")[1][mask].mean())
    plain, plain_reported = entropy_after(0.0)
    bonus, bonus_reported = entropy_after(0.5)
    assert math.isnan(plain_reported) and 0 < bonus_reported <= fresh + 1e-3
    assert plain < fresh - 0.05  # the pushed answer took the mass
    assert plain < bonus  # the bonus held some of it back


def test_memory_is_per_tenant_adapter_and_optimizer(policy):
    # acme: 7 targets x 4 layers, r=8; beta: q,v x 4 layers, r=4 -> a smaller adapter
    assert policy.adapter_bytes("beta.prod") < policy.adapter_bytes("acme")
    batch, _, _ = small_batch(policy)
    pg_update(policy, "beta.prod", batch, torch.tensor([1.0, -1.0, 0.0]), clip_eps=0.2)
    # AdamW keeps two moments per parameter (plus a step counter per tensor)
    assert 2 * policy.adapter_bytes("beta.prod") <= policy.optimizer_bytes("beta.prod") < 3 * policy.adapter_bytes("beta.prod")


def test_saved_adapter_is_standard_peft_and_loads_in_peft(policy, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch, _, _ = small_batch(policy)
    pg_update(policy, "beta.prod", batch, torch.tensor([1.0, -1.0, 0.0]), clip_eps=0.2)
    policy.save_adapter("beta.prod", tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["peft_type"] == "LORA" and config["inference_mode"] is True
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.model.layers.") for k in keys)
    assert not any("clora_" in k for k in keys), keys[:3]  # no adapter name inside the keys
    # the file's keys and tensors are exactly what peft's own state-dict walk gives
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    assert policy._file_keys["beta.prod"] is not None  # the direct path, not the walk
    peft_state = get_peft_model_state_dict(policy.model, adapter_name=adapter_name("beta.prod"), save_embedding_layers=False)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert saved.keys() == peft_state.keys() and all(torch.equal(saved[k], peft_state[k]) for k in saved)
    assert read_adapter_shape(tmp_path) == {"rank": 4, "alpha": 8.0, "target_modules": ("q_proj", "v_proj"), "dropout": 0.0}
    # peft loads it onto a fresh base and computes what the learner computes
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path)
    logits = loaded(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits
    theirs = logits[:, batch.prompt_width - 1 : -1].log_softmax(-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    ours = policy.token_logprobs(batch, "beta.prod")
    mask = batch.completion_mask.bool()
    assert torch.allclose(ours[mask], theirs[mask], atol=1e-4)


def test_checkpoint_round_trip_restores_adapter_and_optimizer(policy, tiny_model, tmp_path):
    batch, _, _ = small_batch(policy)
    pg_update(policy, "acme", batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    policy.save_checkpoint("acme", tmp_path)
    other = Policy(tiny_model, device="cpu")
    other.add_tenant(policy.spec("acme"))
    other.load_checkpoint("acme", tmp_path)
    assert torch.equal(other.token_logprobs(batch, "acme"), policy.token_logprobs(batch, "acme"))
    # the same next step from both: identical optimizer state gives identical weights
    pg_update(policy, "acme", batch, torch.tensor([0.3, 0.2, -0.5]), clip_eps=0.2)
    pg_update(other, "acme", batch, torch.tensor([0.3, 0.2, -0.5]), clip_eps=0.2)
    assert torch.allclose(other.token_logprobs(batch, "acme"), policy.token_logprobs(batch, "acme"), atol=1e-6)


def test_a_checkpoint_resumes_with_the_configured_learning_rate(policy, tiny_model, tmp_path):
    policy.save_checkpoint("acme", tmp_path)  # its optimizer state says lr 1e-2
    other = Policy(tiny_model, device="cpu")
    other.add_tenant(replace(policy.spec("acme"), learning_rate=5e-4))  # the config changed since
    other.load_checkpoint("acme", tmp_path)
    assert [g["lr"] for g in other._optimizers["acme"].param_groups] == [5e-4]


def test_snapshot_and_restore_undo_a_step(policy):
    batch, _, _ = small_batch(policy)
    pg_update(policy, "acme", batch, torch.tensor([0.5, -1.0, 0.5]), clip_eps=0.2)  # the optimizer has state
    snap = policy.snapshot("acme")
    before = policy.token_logprobs(batch, "acme")
    moments = {k: v.clone() for k, v in policy._optimizers["acme"].state_dict()["state"][0].items()}
    pg_update(policy, "acme", batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    policy.restore("acme", snap)
    assert torch.equal(policy.token_logprobs(batch, "acme"), before)
    restored = policy._optimizers["acme"].state_dict()["state"][0]
    assert moments.keys() == restored.keys() and all(torch.equal(moments[k], restored[k]) for k in moments)


def test_loading_an_adapter_of_another_shape_is_refused_with_names(policy, tmp_path):
    policy.save_adapter("beta.prod", tmp_path)  # q,v only, r=4
    with pytest.raises(PolicyError, match="does not fit"):
        policy.load_adapter("acme", tmp_path)


def test_damaged_checkpoint_files_are_policy_errors_naming_the_file(policy, tmp_path):
    """A damaged file raises its reader's own error (safetensors', unpickling's), not an OSError: it must
    still come out as a PolicyError that says which file."""
    from learner.policy import ADAPTER_WEIGHTS, CHECKPOINT_ADAPTER_DIR, OPTIMIZER_FILE

    policy.save_checkpoint("acme", tmp_path)
    for damaged in (b"not a pickle", b"\x80\x02garbage"):  # the second: torch's advice to load it unsafely
        (tmp_path / OPTIMIZER_FILE).write_bytes(damaged)
        with pytest.raises(PolicyError) as e:
            policy.load_checkpoint("acme", tmp_path)
        assert str(e.value).startswith(f"tenant 'acme': the optimizer state {tmp_path / OPTIMIZER_FILE} is damaged")
        assert "weights_only" not in str(e.value)
    adapter = tmp_path / CHECKPOINT_ADAPTER_DIR
    (adapter / ADAPTER_WEIGHTS).write_bytes(b"xx")
    with pytest.raises(PolicyError, match=f"cannot read adapter weights in {adapter}: SafetensorError"):
        policy.load_adapter("acme", adapter)


def test_a_damaged_base_model_is_a_policy_error(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").write_bytes(b"xx")
    with pytest.raises(PolicyError, match=f"cannot load the base model from {model}: "):
        Policy(model, device="cpu")


def test_unknown_tenant_and_bad_targets_are_named(policy, tiny_model):
    with pytest.raises(PolicyError, match="'ghost' has no adapter"):
        policy.snapshot("ghost")
    p = Policy(tiny_model, device="cpu")
    with pytest.raises(PolicyError, match="nope_proj"):
        p.add_tenant(spec("x", target_modules=("nope_proj",)))


def test_generate_stops_at_an_end_token_and_greedy_is_deterministic(policy):
    prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    a = policy.generate("acme", [prompt, "hello"], max_new_tokens=8, greedy=True)
    b = policy.generate("acme", [prompt, "hello"], max_new_tokens=8, greedy=True)
    assert [g[0].text for g in a] == [g[0].text for g in b]
    sampled = policy.generate("acme", [prompt], n=6, max_new_tokens=12)
    assert len(sampled) == 1 and len(sampled[0]) == 6
    for s in [g[0] for g in a] + sampled[0]:
        assert 1 <= len(s.token_ids) <= 12
        ends = [t for t in s.token_ids if t in policy.stop_token_ids]
        # an end token, if any, is the last token, and only then is the sample finished
        assert ends == ([s.token_ids[-1]] if s.finished else [])
    with pytest.raises(ValueError, match="n=2"):
        policy.generate("acme", [prompt], n=2, greedy=True)


def test_one_base_pass_serves_the_reference_and_the_kl_and_the_base_switch_always_turns_back(policy):
    batch, _, _ = small_batch(policy)
    ref, logps = policy.base_reference(batch)
    assert torch.allclose(ref, policy.token_logprobs(batch, None), atol=1e-6)
    assert logps.shape == (*batch.completion_ids.shape, policy.model.config.vocab_size)
    assert policy.base_reference(batch, keep_bytes=0)[1] is None
    # a pass per micro-batch (2 rows, then 1) gives the whole batch's reference and distributions, up to float32
    # rounding: log-probs near -8 carry ~1e-6 of it, and a matmul over 2 rows may sum in another order than
    # over 3 (a CI machine's kernels differed by 1.9e-6 there), so the tolerance is relative to the value
    close = functools.partial(torch.testing.assert_close, rtol=1e-6, atol=1e-6)
    ref2, logps2 = policy.base_reference(batch, rows_per_pass=2)
    close(ref2, ref)
    close(logps2, logps)
    assert policy.base_reference(batch, keep_bytes=0, rows_per_pass=2)[1] is None
    close(policy.base_reference(batch, keep_bytes=0, rows_per_pass=2)[0], ref)
    pg_update(policy, "acme", batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    assert torch.allclose(policy.kl_to_base(batch, "acme", base_logps=logps), policy.kl_to_base(batch, "acme"), atol=1e-6)
    # the fast base switch: the adapters are back on after the block, even when it raised
    with pytest.raises(RuntimeError, match="inside the base block"), policy.adapter(None):
        assert policy.model.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters
        raise RuntimeError("inside the base block")
    assert not any(layer.disable_adapters for layer in policy._lora_layers)
    assert not torch.allclose(policy.token_logprobs(batch, "acme"), ref)


def test_the_fast_tenant_switch_matches_peft_set_adapter(policy):
    batch, _, _ = small_batch(policy)
    policy.use("beta.prod")
    fast = policy.token_logprobs(batch, "beta.prod")
    assert policy.model.active_adapters == [adapter_name("beta.prod")]
    policy.model.set_adapter(adapter_name("beta.prod"))  # peft's own switch
    assert torch.equal(policy.model(input_ids=batch.input_ids).logits, policy.model(input_ids=batch.input_ids).logits)
    slow = policy.token_logprobs(batch, "beta.prod")
    assert torch.equal(fast, slow)
    # gradients reach exactly the active tenant's adapter, after any number of switches and base passes
    for tenant in ("acme", "beta.prod", "acme"):
        policy.token_logprobs(batch, None)
        policy.zero_grad(tenant)
        policy.token_logprobs(batch, tenant, grad=True).sum().backward()
        assert all(p.grad is not None for p in policy.trainable(tenant))
        other = "beta.prod" if tenant == "acme" else "acme"
        assert all(p.grad is None for p in policy.trainable(other))
        policy.zero_grad(tenant)


def test_generation_with_the_adapter_folded_into_the_weights_matches_the_adapter_and_restores_the_base(policy):
    """generate() folds the tenant's LoRA into merged copies of the base weights (LoRA layers off); the
    greedy tokens are the adapter path's, the base weights come back as the very same tensors, and an
    exception inside the block restores them too."""
    batch, _, _ = small_batch(policy)
    for tenant in ("acme", "beta.prod"):  # a trained adapter: B is no longer zero, so the merge changes W
        pg_update(policy, tenant, batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    prompts = [policy.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True) for q in ("hi", "count to five")]
    weights = {name: (p, p.detach().clone()) for name, p in policy.model.named_parameters() if "base_layer" in name}
    for tenant in ("acme", "beta.prod"):
        layers = policy._mergeable(tenant)
        assert layers, "the tiny model's adapters are plain LoRA over nn.Linear: the merged path applies"
        merged = policy.generate(tenant, prompts, max_new_tokens=12, greedy=True)
        with policy.adapter(tenant):  # the same decoding through peft's LoRA layers
            enc = policy.tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
            out = policy.model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=policy.pad_token_id,
                                        eos_token_id=list(policy.stop_token_ids))
        width = enc["input_ids"].shape[1]
        unmerged = [policy._sample(row[width:].tolist(), tenant) for row in out]
        assert [m[0].token_ids for m in merged] == [u.token_ids for u in unmerged]
        base_tokens = policy.generate(None, prompts, max_new_tokens=12, greedy=True)
        assert [m[0].token_ids for m in merged] != [b[0].token_ids for b in base_tokens]
    with pytest.raises(RuntimeError), policy._merged("acme"):
        raise RuntimeError("inside the merged block")
    current = dict(policy.model.named_parameters())
    for name, (param, value) in weights.items():
        assert current[name] is param and torch.equal(param, value)  # the same tensors, unchanged
    assert not any(layer.disable_adapters for layer in policy._lora_layers)
    assert policy._mergeable(None) is None


def test_grouped_generation_decodes_several_tenants_at_once_as_each_alone(policy):
    """generate_grouped: every group's greedy tokens are its tenant's own `generate`, with ranks (8 and 4)
    and adapted layers (all, or q/v only) that differ, groups of unequal size and an empty one; peft's own
    forward is back afterwards, also after an exception inside the block."""
    batch, _, _ = small_batch(policy)
    for tenant in ("acme", "beta.prod"):  # trained adapters: B is no longer zero
        pg_update(policy, tenant, batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    render = lambda q: policy.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                            add_generation_prompt=True)
    groups = [("acme", [render("hi"), render("count to five"), render("x")]), ("beta.prod", [render("hi")]),
              ("acme", []), ("beta.prod", [render("what is 2 + 2?"), render("count to five")])]
    grouped = policy.generate_grouped(groups, max_new_tokens=12)
    alone = [policy.generate(t, prompts, max_new_tokens=12, greedy=True) if prompts else [] for t, prompts in groups]
    assert [[s[0].token_ids for s in g] for g in grouped] == [[s[0].token_ids for s in g] for g in alone]
    assert [len(g) for g in grouped] == [3, 1, 0, 2]
    # the adapters matter: the two tenants' completions of "hi" differ from each other or from the base's
    base = policy.generate(None, [render("hi")], max_new_tokens=12, greedy=True)[0][0].token_ids
    assert len({grouped[0][0][0].token_ids, grouped[1][0][0].token_ids, base}) > 1
    assert not any("forward" in vars(layer) for layer in policy._lora_layers)
    # a tenant outside the batch adapts layers the batch's do not: they stay off, whichever tenant was active
    policy.use("acme")
    only_beta = policy.generate_grouped([("beta.prod", [render("hi")]), ("beta.prod", [render("x")])], max_new_tokens=12)
    assert [g[0][0].token_ids for g in only_beta] == [
        s[0].token_ids for s in policy.generate("beta.prod", [render("hi"), render("x")], max_new_tokens=12, greedy=True)]
    with pytest.raises(RuntimeError, match="inside the grouped block"), policy._grouped(["acme", "beta.prod"], rows=2):
        assert all("forward" in vars(layer) for layer in policy._lora_layers)
        raise RuntimeError("inside the grouped block")
    assert not any("forward" in vars(layer) for layer in policy._lora_layers)


def test_gradient_passes_use_train_mode_only_when_some_dropout_would_act(tiny_model):
    """Train mode walks every module twice per pass; it is skipped when it changes nothing (no dropout),
    and used when a tenant's adapter has dropout (two gradient passes then differ, no-grad ones do not)."""
    plain = Policy(tiny_model, device="cpu")
    plain.add_tenant(spec("a", rank=4))
    assert plain._has_dropout is False
    batch, _, _ = small_batch(plain)
    assert torch.equal(plain.token_logprobs(batch, "a", grad=True), plain.token_logprobs(batch, "a", grad=True))
    plain.add_tenant(spec("b", rank=4, dropout=0.5))
    assert plain._has_dropout is True
    with torch.no_grad():
        for name, p in plain.model.named_parameters():
            if "lora_B" in name and adapter_name("b") in name:
                p.fill_(0.1)  # dropout on the adapter's input now shows in the output
    assert not torch.equal(plain.token_logprobs(batch, "b", grad=True), plain.token_logprobs(batch, "b", grad=True))
    assert torch.equal(plain.token_logprobs(batch, "b"), plain.token_logprobs(batch, "b"))
    assert not plain.model.training


def test_with_dropout_the_steps_starting_policy_is_the_adapter_without_it(tiny_model, monkeypatch):
    """π_prox (where the behaviour weight and the clip are centred) is the adapter as it samples, without
    dropout: taken from the train-mode gradient pass, on-policy samples got random weights around 1."""
    import learner.update as update_module

    policy = Policy(tiny_model, device="cpu")
    policy.add_tenant(spec("b", rank=4, dropout=0.5))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name and adapter_name("b") in name:
                p.fill_(0.1)  # dropout on the adapter's input now shows in the output
    batch, _, _ = small_batch(policy)
    assert not policy.model.training  # peft left it in train mode: no-grad passes had dropout too
    on_policy = policy.token_logprobs(batch, "b")  # what the version being trained gave when it sampled
    assert torch.equal(on_policy, policy.token_logprobs(batch, "b"))
    seen = []
    real = update_module.maths.behaviour_weights

    def spy(proximal, behaviour, cap):
        seen.append((proximal, behaviour))
        return real(proximal, behaviour, cap)

    monkeypatch.setattr(update_module.maths, "behaviour_weights", spy)
    result = pg_update(policy, "b", batch, torch.tensor([1.0, -1.0, 0.5]), old_logprobs=on_policy, clip_eps=0.2)
    ((proximal, behaviour),) = seen
    mask = batch.completion_mask.bool()
    assert torch.allclose(proximal[mask], on_policy[mask]) and torch.allclose(behaviour[mask], on_policy[mask])
    assert result.finite  # (the clip is centred there too: dropout's own noise can now reach it)
    # behaviour log-probs made from the first pass's logits (logs mode's current-version rows) are made from
    # those of the pass without dropout too
    handed = []

    def from_logits(logits, part, rows):
        handed.append(logits)
        return torch.full(part.completion_ids.shape, math.nan)

    with policy.adapter("b"), torch.no_grad():
        clean = policy._completion_logits(batch)
    pg_update(policy, "b", batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2, behaviour_from_logits=from_logits)
    (logits,) = handed
    assert torch.allclose(logits, clean) and not logits.requires_grad


def test_a_removed_tenant_frees_its_adapter_and_leaves_the_others_as_they_were(tiny_model):
    p = Policy(tiny_model, device="cpu")
    p.add_tenant(spec("keep", learning_rate=1e-2))
    p.add_tenant(spec("gone", learning_rate=1e-2))
    batch, _, _ = small_batch(p)
    pg_update(p, "keep", batch, torch.tensor([1.0, -1.0, 0.5]), clip_eps=0.2)
    kept = p.token_logprobs(batch, "keep")
    p.remove_tenant("gone")
    assert p.tenants == ["keep"] and "clora_gone" not in p.model.peft_config
    assert not any("clora_gone" in n for n, _ in p.model.named_parameters())
    assert torch.equal(p.token_logprobs(batch, "keep"), kept)
    with pytest.raises(PolicyError, match="gone"):
        p.token_logprobs(batch, "gone")
    p.remove_tenant("keep")  # the last one: the model has no adapter left, and a new tenant starts afresh
    p.add_tenant(spec("again"))
    assert torch.allclose(p.token_logprobs(batch, "again"), p.token_logprobs(batch, None), atol=1e-5)


def test_sampling_draws_what_transformers_generate_draws(policy):
    """generate()'s decoding loop makes the forward passes and random draws of transformers' `generate`
    (sampling at a temperature, top-k and top-p off): the same seed gives the same tokens, prompts of
    different lengths (left padding) and several completions per prompt included."""
    prompts = [policy.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                    add_generation_prompt=True) for q in ("hi", "count to five, slowly")]
    enc = policy.tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    assert (enc["attention_mask"] == 0).any(), "the prompts must differ in length for the padding to be tested"
    width = enc["input_ids"].shape[1]
    for temperature in (0.7, 1.3):
        torch.manual_seed(11)
        ours = policy.generate("acme", prompts, n=3, max_new_tokens=16, temperature=temperature)
        torch.manual_seed(11)
        with policy._merged("acme"):
            out = policy.model.generate(**enc, max_new_tokens=16, do_sample=True, temperature=temperature, top_k=0,
                                        top_p=1.0, num_return_sequences=3, pad_token_id=policy.pad_token_id,
                                        eos_token_id=list(policy.stop_token_ids))
        theirs = [policy._sample(row[width:].tolist(), "acme").token_ids for row in out]
        assert [s.token_ids for group in ours for s in group] == theirs
        assert len(set(theirs)) > 1  # draws, not one sequence six times


def test_generation_over_a_bf16_base_applies_the_adapter_unmerged(tiny_model):
    """On a GPU the base stays bf16 while peft keeps the adapters in float32. Folded into bf16 weights, a young
    adapter's change was mostly rounded away (relative error ~0.5 at a step's ~1e-4), so local rollouts came
    from another policy than the one trained, uncorrected; the adapter is applied as trained. (The merge also
    once raised "self and mat2 must have the same dtype", failing every gate probe.)"""
    p = Policy(tiny_model, device="cpu")
    p.model.to(torch.bfloat16)  # as on cuda
    p.add_tenant(spec("acme"))
    layer = p._lora_layers[0]
    assert layer.lora_A[adapter_name("acme")].weight.dtype == torch.float32
    with torch.no_grad():
        for param in p.trainable("acme"):
            param.normal_(std=0.02)
    weight = layer.base_layer.weight
    seen = []
    decode = p._decode

    def watched(*args):
        seen.append((layer.base_layer.weight is weight, layer.disable_adapters))  # the base as loaded, the LoRA on
        return decode(*args)

    p._decode = watched
    [[sample]] = p.generate("acme", ["hello there"], max_new_tokens=6, greedy=True)
    assert 1 <= len(sample.token_ids) <= 6
    assert seen == [(True, False)]
    assert layer.base_layer.weight is weight and weight.dtype == torch.bfloat16


def grouped_logprobs_and_gradient(policy, tenant, *, share):
    """Log-probs (with gradient) of two prompts x two completions each and the adapter's gradient of their
    sum, with the shared prompt pass on or off, and the (rows, tokens) of each forward pass's input. Call it
    with share=False first: the shared call leaves `share_prompts` as the model's cache allows."""
    tok = policy.tokenizer
    long, short = (tok(q, add_special_tokens=False).input_ids for q in ("hello there my friend, how are you", "hi"))
    completions = [tok(c, add_special_tokens=False).input_ids for c in ("a cat sat on it", "no", "twelve dogs ran", "ok")]
    batch = pack([long, short, long, short], completions, pad_id=policy.pad_token_id, max_len=256)
    shapes = []
    hook = policy.model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    policy.share_prompts = share  # left as the pass leaves it: on, or off where the model's cache turned it off
    try:
        logp = policy.token_logprobs(batch, tenant, grad=True)
        (logp * batch.completion_mask).sum().backward()
    finally:
        hook.remove()
    grad = torch.cat([p.grad.flatten() for p in policy.trainable(tenant)])
    policy.zero_grad(tenant)
    return batch, logp.detach(), grad, shapes


def test_rows_that_share_a_prompt_run_it_once_with_the_same_logprobs_and_gradient(policy):
    with torch.no_grad():  # a non-zero adapter, so the LoRA path and its gradient both take part
        for p in policy.trainable("acme"):
            p.add_(0.05 * torch.randn_like(p))
    batch, plain, plain_grad, plain_shapes = grouped_logprobs_and_gradient(policy, "acme", share=False)
    _, shared, shared_grad, shared_shapes = grouped_logprobs_and_gradient(policy, "acme", share=True)
    width_p, width_c = batch.prompt_width, batch.completion_width
    assert plain_shapes == [(4, width_p + width_c)]
    assert shared_shapes == [(2, width_p), (4, width_c - 1)]  # each prompt once, then the completions alone
    mask = batch.completion_mask.bool()
    assert torch.allclose(shared[mask], plain[mask], atol=1e-4)
    assert float((shared_grad - plain_grad).norm() / plain_grad.norm()) < 1e-4  # no gradient lost in the prompt pass: ~1e-6
    assert float(plain_grad.norm()) > 0


def model_with_other_cache(tiny_model, path, arch):
    """A small random model whose cache is not Qwen3's: LFM2's convolution layers, or a sliding window."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if arch == "lfm2":
        config = transformers.Lfm2Config(**common, layer_types=["conv", "full_attention", "conv", "full_attention"])
    else:
        config = transformers.MistralConfig(**common, sliding_window=4)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["lfm2", "mistral-sliding-window"])
def test_shared_prompt_passes_on_models_with_other_caches_match_or_turn_themselves_off(tiny_model, tmp_path, arch):
    """A sliding window's cache is indexed by row like any other; LFM2's convolution states cannot be,
    so its policy goes back to one pass per row, with the same log-probs."""
    p = Policy(model_with_other_cache(tiny_model, tmp_path, arch), device="cpu")
    p.add_tenant(spec("a", target_modules=("q_proj", "v_proj")))
    with torch.no_grad():
        for param in p.trainable("a"):
            param.add_(0.1 * torch.randn_like(param))
    batch, plain, plain_grad, _ = grouped_logprobs_and_gradient(p, "a", share=False)
    _, shared, shared_grad, shapes = grouped_logprobs_and_gradient(p, "a", share=True)
    mask = batch.completion_mask.bool()
    assert torch.allclose(shared[mask], plain[mask], atol=1e-4)
    assert float((shared_grad - plain_grad).norm() / plain_grad.norm()) < 1e-4  # no gradient lost in the prompt pass: ~1e-6
    if arch == "lfm2":
        assert shapes[-1] == (4, batch.prompt_width + batch.completion_width)
        assert p.share_prompts is False
    else:
        assert shapes == [(2, batch.prompt_width), (4, batch.completion_width - 1)]


@pytest.mark.parametrize("arch", ["lfm2", "mistral-sliding-window"])
def test_decoding_matches_transformers_generate_on_models_with_other_caches(tiny_model, tmp_path, arch):
    """A model with convolution layers (LFM2) or a sliding window needs the cache its own forward pass makes:
    a plain DynamicCache made beforehand failed on LFM2 (IndexError) where transformers' generate worked."""
    p = Policy(model_with_other_cache(tiny_model, tmp_path, arch), device="cpu")
    prompts = ["hello there, how are you today my friend, tell me a long story", "hi"]
    enc = p.tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    out = p.model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=p.pad_token_id,
                           eos_token_id=list(p.stop_token_ids))
    width = enc["input_ids"].shape[1]
    theirs = [p._sample(row[width:].tolist(), None).token_ids for row in out]
    assert [g[0].token_ids for g in p.generate(None, prompts, max_new_tokens=12, greedy=True)] == theirs


def test_a_base_model_whose_tokenizer_has_no_pad_token_generates(tiny_model, tmp_path):
    """Llama 3's and Mistral's tokenizers have none: the policy pads with EOS, but the tokenizer refused to pad
    a batch, so every gate probe and every local sample failed, for every tenant."""
    import json
    import shutil

    model = tmp_path / "no-pad"
    shutil.copytree(tiny_model, model)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((model / name).read_text())
        config.pop("pad_token", None)
        (model / name).write_text(json.dumps(config))
    p = Policy(model, device="cpu")
    assert p.pad_token_id == p.eos_token_id
    p.add_tenant(spec("acme", rank=8))
    prompts = ["hello", "a longer question than that"]
    plain = p.generate("acme", prompts, greedy=True, max_new_tokens=4)
    assert p.generate_grouped([("acme", prompts)], max_new_tokens=4) == [plain]
    assert [len(group) for group in p.generate("acme", prompts, n=2, max_new_tokens=4)] == [2, 2]
