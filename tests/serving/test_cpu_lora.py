"""serving/cpu_lora.py: the CPU multi-LoRA ops give what vLLM's own torch ops give (where those are right),
zero for rows without an adapter, and are what vLLM's CPU punica wrapper calls once the plugin ran."""

from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch
from vllm.lora.ops import torch_ops as vllm_ops

from serving import cpu_lora

pytestmark = pytest.mark.unit

SLOTS, TOKENS, RANK, HIDDEN = 5, 13, 8, 48


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)


def indices(rng, with_none=False):
    low = -1 if with_none else 0
    return torch.randint(low, SLOTS, (TOKENS,), generator=rng)


@pytest.mark.parametrize("four_d", [False, True])
def test_shrink_and_expand_match_vllms_ops(rng, four_d):
    x = torch.randn(TOKENS, HIDDEN, generator=rng)
    a = torch.randn(SLOTS, RANK, HIDDEN, generator=rng)
    b = torch.randn(SLOTS, HIDDEN, RANK, generator=rng)
    if four_d:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    idx = indices(rng)

    ours, theirs = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
    cpu_lora.bgmv_shrink(x, a, ours, idx, 0.5)
    vllm_ops.bgmv_shrink(x, a, theirs, idx, 0.5)
    assert torch.allclose(ours, theirs, atol=1e-4)

    y0 = torch.randn(TOKENS, HIDDEN + 4, generator=rng)  # the model pads more than the adapter
    for add in (True, False):
        ours_y, theirs_y = y0.clone(), y0.clone()
        cpu_lora.bgmv_expand(theirs, b, ours_y, idx, add)
        vllm_ops.bgmv_expand(theirs, b, theirs_y, idx, add)
        assert torch.allclose(ours_y, theirs_y, atol=1e-4)
        ours_y, theirs_y = y0.clone(), y0.clone()
        cpu_lora.bgmv_expand_slice(theirs, b[..., :16, :], ours_y, idx, 8, 16, add)
        vllm_ops.bgmv_expand_slice(theirs, b[..., :16, :], theirs_y, idx, 8, 16, add)
        assert torch.allclose(ours_y, theirs_y, atol=1e-4)


def test_prefill_ops_expand_per_sequence_indices(rng):
    x = torch.randn(TOKENS, HIDDEN, generator=rng)
    a = torch.randn(SLOTS, RANK, HIDDEN, generator=rng)
    seq_lens = torch.tensor([4, 6, 3])
    seq_idx = torch.tensor([2, 0, 4])
    starts = torch.tensor([0, 4, 10])
    ours, theirs = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
    cpu_lora.sgmv_shrink(x, a, ours, starts, seq_lens, seq_idx, 3, 6, TOKENS, 1.0)
    vllm_ops.sgmv_shrink(x, a, theirs, starts, seq_lens, seq_idx, 3, 6, TOKENS, 1.0)
    assert torch.allclose(ours, theirs, atol=1e-4)
    # the second sequence (tokens 4..9) used slot 0
    assert torch.allclose(ours[4:10], x[4:10] @ a[0].T, atol=1e-4)


def test_rows_without_an_adapter_get_zero_not_the_last_slot(rng):
    x = torch.randn(TOKENS, HIDDEN, generator=rng)
    a = torch.randn(SLOTS, RANK, HIDDEN, generator=rng)
    idx = indices(rng, with_none=True)
    idx[0] = -1
    out = torch.full((TOKENS, RANK), 7.0)
    cpu_lora.bgmv_shrink(x, a, out, idx, 1.0)
    assert torch.equal(out[idx < 0], torch.zeros(int((idx < 0).sum()), RANK))
    keep = idx >= 0
    assert torch.allclose(out[keep], torch.einsum("ti,tri->tr", x[keep], a[idx[keep]]), atol=1e-4)


def test_the_plugin_is_declared_and_replaces_the_cpu_wrappers_ops(monkeypatch):
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("clora_cpu_lora") == "serving.cpu_lora:register"
    from vllm.lora.punica_wrapper import punica_cpu

    for name in cpu_lora.OPS:
        monkeypatch.setattr(punica_cpu, name, getattr(vllm_ops, name))
    monkeypatch.setenv(cpu_lora.ENV, "vllm")
    cpu_lora.register()
    assert punica_cpu.bgmv_shrink is vllm_ops.bgmv_shrink  # switched off: vLLM's own
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    assert hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading")  # the cache mend, either way
    assert punica_cpu.PunicaWrapperCPU.add_lora_linear is not cpu_lora.add_lora_linear
    monkeypatch.setenv(cpu_lora.ENV, "clora")
    cpu_lora.register()
    assert all(getattr(punica_cpu, name) is fn for name, fn in cpu_lora.OPS.items())
    assert punica_cpu.PunicaWrapperCPU.add_lora_linear is cpu_lora.add_lora_linear
    monkeypatch.setenv(cpu_lora.ENV, "vllm")
    cpu_lora.register()
    assert punica_cpu.PunicaWrapperCPU.add_lora_linear is cpu_lora._VLLM_ADD_LORA_LINEAR
    monkeypatch.setenv(cpu_lora.ENV, "clora")
    cpu_lora.register()
    monkeypatch.setenv(cpu_lora.ENV, "fast")
    with pytest.raises(ValueError, match=cpu_lora.ENV):
        cpu_lora.register()


def test_the_plugin_compiles_lora_engines_unless_switched_off(monkeypatch):
    """vLLM's CPU platform sets compilation mode NONE for any engine with a LoRA config; the plugin hides
    the LoRA config from that check (and only from it) unless CLORA_CPU_LORA_COMPILE=0 or vLLM's ops."""
    from vllm.platforms import cpu

    seen = []

    def fake_check(cls, vllm_config):  # stands in for vLLM's check, recording what it was shown
        seen.append(vllm_config.lora_config)

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(fake_check))
    monkeypatch.setattr(cpu_lora, "_VLLM_CHECK_CONFIG", None)
    config = types.SimpleNamespace(lora_config="lora")
    monkeypatch.setenv(cpu_lora.ENV, "clora")
    monkeypatch.setenv(cpu_lora.COMPILE_ENV, "1")
    cpu_lora.register()
    cpu.CpuPlatform.check_and_update_config(config)
    assert seen == [None] and config.lora_config == "lora"  # hidden during the check, restored after
    monkeypatch.setenv(cpu_lora.COMPILE_ENV, "0")
    cpu_lora.register()
    cpu.CpuPlatform.check_and_update_config(config)
    assert seen == [None, "lora"]  # eager: vLLM's check sees the LoRA config
    monkeypatch.setenv(cpu_lora.COMPILE_ENV, "1")
    cpu_lora.register()
    monkeypatch.setenv(cpu_lora.ENV, "vllm")
    cpu_lora.register()
    cpu.CpuPlatform.check_and_update_config(config)
    assert seen == [None, "lora", "lora"]  # vLLM's ops: vLLM's eager LoRA engines too
    monkeypatch.setenv(cpu_lora.ENV, "clora")
    monkeypatch.setenv(cpu_lora.COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match=cpu_lora.COMPILE_ENV):
        cpu_lora.register()


def test_a_batch_with_one_adapter_takes_the_short_path_with_the_same_result(rng):
    x = torch.randn(TOKENS, HIDDEN, generator=rng)
    a = torch.randn(SLOTS, RANK, HIDDEN, generator=rng)
    idx = torch.full((TOKENS,), 3)
    assert torch.allclose(cpu_lora.per_row(x, a, idx, torch.float32), x @ a[3].T, atol=1e-5)
    assert torch.equal(cpu_lora.per_row(x, a, torch.full((TOKENS,), -1), torch.float32), torch.zeros(TOKENS, RANK))


def test_wide_expands_with_several_adapters_go_per_adapter_and_agree(rng):
    h = torch.randn(TOKENS, RANK, generator=rng)
    b = torch.randn(SLOTS, 3 * HIDDEN, RANK, generator=rng)
    idx = indices(rng, with_none=True)
    idx[:3] = torch.tensor([-1, 0, 4])
    per_adapter = cpu_lora.per_row(h, b, idx, torch.float32)  # out > in, several adapters
    keep = idx >= 0
    assert torch.allclose(per_adapter[keep], torch.einsum("tr,tor->to", h[keep], b[idx[keep]]), atol=1e-4)
    assert torch.equal(per_adapter[~keep], torch.zeros(int((~keep).sum()), 3 * HIDDEN))


@pytest.mark.parametrize("prefill", [True, False])
@pytest.mark.parametrize("ids", [(1, 1, 1, 1), (1, 3, 0, 2), (2, 0, 0, 2), (0, 0, 0, 0)])
def test_the_per_step_wrapper_path_matches_vllms_wrapper(rng, monkeypatch, prefill, ids):
    """add_lora_linear with a plan made by update_metadata == vLLM's own add_lora_linear with vLLM's ops:
    one adapter, several, some rows without any (id 0), none at all; merged slices of different widths;
    prefill (per-sequence metadata) and decode."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper import punica_cpu

    cpu_lora.register()  # installs the wrapper path (idempotent)
    for name in cpu_lora.OPS:  # the reference runs on vLLM's own ops
        monkeypatch.setattr(punica_cpu, name, getattr(vllm_ops, name))
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    seq_lens = (3, 1, 4, 2)
    mapping = LoRAMapping(
        index_mapping=tuple(i for i, n in zip(ids, seq_lens) for _ in range(n)), prompt_mapping=ids, is_prefill=prefill
    )
    wrapper.update_metadata(mapping, [1, 2, 3, None], 5, 2048)
    assert wrapper._clora_plan.tokens == sum(seq_lens)
    tokens, widths = sum(seq_lens), (HIDDEN, 16, 16)
    x = torch.randn(tokens, HIDDEN, generator=rng)
    a = tuple(torch.randn(5, 1, RANK, HIDDEN, generator=rng) for _ in widths)
    b = tuple(torch.randn(5, 1, w, RANK, generator=rng) for w in widths)
    y0 = torch.randn(tokens, sum(widths), generator=rng)
    ours, theirs = y0.clone(), y0.clone()
    cpu_lora.add_lora_linear(wrapper, ours, x, a, b, 0.5, widths)
    cpu_lora._VLLM_ADD_LORA_LINEAR(wrapper, theirs, x, a, b, 0.5, widths)
    # rows without an adapter keep the base output (vLLM's CPU ops give them the last slot's adapter)
    none = wrapper.token_lora_indices < 0
    assert torch.equal(ours[none], y0[none])
    assert torch.allclose(ours[~none], theirs[~none], atol=1e-4)
    assert not torch.equal(ours[~none], y0[~none]) or bool(none.all())


def test_the_wrapper_path_falls_back_to_vllms_without_a_plan_for_the_batch(rng, monkeypatch):
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper import punica_cpu

    cpu_lora.register()
    calls = []
    monkeypatch.setattr(cpu_lora, "_VLLM_ADD_LORA_LINEAR", lambda *args, **kwargs: calls.append(kwargs))
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    x, a, b = torch.randn(4, HIDDEN, generator=rng), (torch.zeros(2, 1, RANK, HIDDEN),), (torch.zeros(2, 1, HIDDEN, RANK),)
    wrapper.add_lora_linear(torch.ones(4, HIDDEN), x, a, b, 1.0, (HIDDEN,))  # no metadata yet (vLLM's profile run)
    wrapper.update_metadata(LoRAMapping(index_mapping=(1, 1, 1), prompt_mapping=(1,), is_prefill=True), [1, None], 2, 2048)
    wrapper.add_lora_linear(torch.ones(4, HIDDEN), x, a, b, 1.0, (HIDDEN,))  # 4 rows, a plan for 3
    wrapper.add_lora_linear(torch.ones(3, HIDDEN), x[:3], a, b, 1.0, (HIDDEN,), add_inputs=False)  # not "y +="
    assert len(calls) == 3
    wrapper.add_lora_linear(torch.ones(3, HIDDEN), x[:3], a, b, 1.0, (HIDDEN,))  # the plan's batch: ours
    assert len(calls) == 3


def test_logits_lora_is_skipped_while_no_slot_has_an_lm_head_adapter(rng, monkeypatch):
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper import punica_cpu

    cpu_lora.register()
    assert punica_cpu.PunicaWrapperCPU.add_lora_logits is cpu_lora.add_lora_logits
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    wrapper.update_metadata(LoRAMapping(index_mapping=(1, 2, 1), prompt_mapping=(1, 2, 1), is_prefill=False),
                            [1, 2, None, None], 4, 2048)
    vocab = 40
    x = torch.randn(3, HIDDEN, generator=rng)
    a = torch.randn(4, 1, RANK, HIDDEN, generator=rng)
    b = torch.zeros(4, 1, vocab, RANK)
    y0 = torch.randn(3, vocab, generator=rng)
    calls = []
    vllms = cpu_lora._VLLM_ADD_LORA_LOGITS
    monkeypatch.setattr(cpu_lora, "_VLLM_ADD_LORA_LOGITS", lambda *args, **kwargs: calls.append(1) or vllms(*args, **kwargs))
    y = y0.clone()
    cpu_lora.add_lora_logits(wrapper, y, x, a, b, 1.0)
    assert torch.equal(y, y0) and calls == []  # all-zero B: nothing to add, vLLM's op not run
    b[1] = torch.randn(1, vocab, RANK, generator=rng)  # slot 1 now has an lm_head LoRA
    y = y0.clone()
    cpu_lora.add_lora_logits(wrapper, y, x, a, b, 1.0)
    assert calls == [1] and not torch.equal(y, y0)
    reference = y0.clone()
    vllms(wrapper, reference, x, a, b, 1.0)
    assert torch.equal(y, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_adapters_follow_slot_writes_batch_changes_and_padded_ranks(rng, monkeypatch, dtype):
    """The stacked A^T/B^T kept between steps (`_stacked`) are rebuilt when vLLM writes a slot in place (a
    new adapter version) and when the batch's adapters change; adapters of rank 3 in slots padded to rank 8
    give what vLLM's own wrapper gives, before and after each change, in a float32 and a bfloat16 engine."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper import punica_cpu

    cpu_lora.register()
    for name in cpu_lora.OPS:
        monkeypatch.setattr(punica_cpu, name, getattr(vllm_ops, name))
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    widths = (HIDDEN, 16)
    a = tuple(torch.zeros(5, 1, RANK, HIDDEN, dtype=dtype) for _ in widths)
    b = tuple(torch.zeros(5, 1, w, RANK, dtype=dtype) for w in widths)

    def write_slot(slot: int, rank: int, *, only_b: bool = False) -> None:  # as vLLM's set_lora: in place
        for a_i, b_i in zip(a, b):
            if not only_b:
                a_i[slot, 0, :rank].copy_(torch.randn(rank, HIDDEN, generator=rng))
            b_i[slot, 0, :, :rank].copy_(torch.randn(b_i.shape[2], rank, generator=rng))

    def kept() -> list:
        return [cpu_lora._KEPT[(a_i.data_ptr(), b_i.data_ptr())][2] for a_i, b_i in zip(a, b)]

    def check(ids: tuple[int, ...]) -> None:
        wrapper.update_metadata(LoRAMapping(index_mapping=ids, prompt_mapping=ids, is_prefill=False),
                                [1, 2, 3, None], 5, 2048)
        x = torch.randn(len(ids), HIDDEN, generator=rng).to(dtype)
        y0 = torch.randn(len(ids), sum(widths), generator=rng).to(dtype)
        ours, theirs = y0.clone(), y0.clone()
        cpu_lora.add_lora_linear(wrapper, ours, x, a, b, 0.5, widths)
        cpu_lora._VLLM_ADD_LORA_LINEAR(wrapper, theirs, x, a, b, 0.5, widths)
        if dtype == torch.float32:
            assert torch.allclose(ours, theirs, atol=1e-4)
        else:  # both multiply in float32 and round once into the bfloat16 output
            assert torch.allclose(ours.float(), theirs.float(), rtol=3e-2, atol=0.25), (ours.float() - theirs.float()).abs().max()
            assert not torch.equal(ours, y0)

    for slot in (0, 1, 2):
        write_slot(slot, 3)
    check((1, 2, 1, 3))
    stacks = kept()
    check((1, 2, 1, 3))  # the same batch again: from the kept stacks
    assert all(x is y for x, y in zip(kept(), stacks))
    write_slot(1, 3)  # a new version into a slot the batch uses
    check((1, 2, 1, 3))
    write_slot(2, 3, only_b=True)  # a write to one table of the pair is seen too
    check((1, 2, 1, 3))
    check((2, 2, 2))  # one adapter only
    write_slot(1, RANK)  # a higher-rank adapter: the rank cut grows
    check((1, 2, 2, 1))
    write_slot(1, 3)
    for a_i, b_i in zip(a, b):  # vLLM's reset_lora
        a_i[2] = 0
        b_i[2] = 0
    check((1, 2, 3, 1))
