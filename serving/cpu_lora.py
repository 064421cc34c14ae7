"""Faster multi-LoRA ops for vLLM's CPU engine, installed as a vLLM plugin.

On CPU, vLLM 0.32 applies each row's adapter with PyTorch ops (`vllm/lora/ops/torch_ops`, used by
`PunicaWrapperCPU`): for every token they gather a full copy of that token's adapter matrix
(`weights[indices]`, [T, out, in]) and run a batched matrix-vector einsum, per projection, per layer, per
engine step. With small models that copy is most of the LoRA cost (the all-zero adapter alone made
decoding 2.3x slower than the base model, BENCHMARKS.md). Rows without an adapter carry index -1, which
that indexing turns into the *last* slot's adapter.

The ops here compute the same thing without per-token copies. A shrink (hidden -> rank) is one matrix
product of the inputs with every adapter that occurs in the batch, stacked ([T, in] @ [in, U x r] for U
distinct adapters), after which each row keeps its own adapter's slice: U times the multiply-adds, which
are few at LoRA ranks. An expand (rank -> hidden) with several adapters is one product per adapter over
that adapter's rows, since there the stacked form would multiply U-fold a large output. Rows with index
-1 get zero (as vLLM's GPU kernels skip them). Per call, on the tiny model with 128 rows: shrink 0.34 ms
-> 0.13 ms, expand to 768 wide 1.16 ms -> 0.25 ms with 9 adapters in the batch.

Above the ops, vLLM's wrapper (`PunicaWrapperCPU.add_lora_linear`) runs a shrink and an expand per slice
of every LoRA layer, each working out again which adapter each token uses: with a small batch that Python
and indexing, not the multiply-adds, was most of a step (one adapter over 16 sequences: 12.5 ms per
decode step against the base model's 3.6 ms). `add_lora_linear` here works that out once per engine step
(`StepPlan`, made when vLLM updates the wrapper's token-to-slot metadata, which it does whenever the
batch's mapping changes) and then does two matrix products per slice: with one adapter in the batch the
adapter's own A and B; with several, every used adapter's A stacked and B stacked block-wise, the rows
masked to their own adapter's block in between. Rows of slot -1 get nothing. The stacked (transposed)
matrices are kept from step to step until the batch's adapters or a slot's weights change, and cut to the
highest rank an adapter in the batch uses (vLLM pads slots to max_lora_rank): eight rank-8 adapters in
rank-16 slots over 64 rows, 5.6 -> 1.6 ms of LoRA per decode step (+11% tokens/s mixed, BENCHMARKS.md).

vLLM's CPU platform runs LoRA engines eagerly while it compiles plain ones (torch.compile, traced once);
with the small batches of RL rollouts that eager overhead made a LoRA engine step ~1.5x a base one. Here
LoRA engines are compiled too: traced, a LoRA layer calls one custom op (`clora::add_lora_linear`), which
the compiler treats as opaque and which runs `add_lora_linear` on the current step's plan when the graph
runs. Eight tenants x 8 rollouts: +11% tokens/s mixed, +32% one tenant at a time (BENCHMARKS.md).
Compiled graphs of every CPU engine, plain or LoRA, load from vLLM's compile cache at the next start
(`_loadable_compile_cache`); without that vLLM recompiled them at every start.

`register` is the `vllm.general_plugins` entry point (pyproject.toml), so it runs in every vLLM process,
the engine core and its workers included. It does nothing off CPU. `CLORA_CPU_LORA_OPS=vllm` restores
vLLM's own ops and eager LoRA engines (for comparisons: `clora bench serving --cpu-lora-ops vllm`);
`CLORA_CPU_LORA_COMPILE=0` keeps clora's ops but runs LoRA engines eagerly (`--eager-lora`).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV = "CLORA_CPU_LORA_OPS"  # "clora" (default) or "vllm"
COMPILE_ENV = "CLORA_CPU_LORA_COMPILE"  # "1" (default): LoRA engines compiled; "0": eager, as vLLM runs them


def per_row(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, out]: row t is weights[indices[t]] @ inputs[t]; zero where indices[t] < 0.

    `weights` is vLLM's slot table, [L, out, in] or [L, 1, out, in]. Shrinks (in > out) multiply by every
    adapter in the batch at once; expands with several adapters multiply each adapter's rows only (there
    the stacked product would be U times the work, and out is large)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    _, out_dim, in_dim = weights.shape
    used, inverse = torch.unique(indices, return_inverse=True)
    if used.numel() > 1 and out_dim > in_dim:
        return _per_adapter(inputs, weights, indices, dtype)
    tokens = inputs.shape[0]
    stacked = weights[used.clamp(min=0)].to(dtype)  # [U, out, in]: each adapter in the batch once
    products = inputs.to(dtype) @ stacked.reshape(-1, in_dim).T  # [T, U x out]
    if used.numel() == 1:  # one adapter in the batch (a single tenant, or only the zero adapter)
        outputs = products
    else:
        outputs = products.view(tokens, used.numel(), out_dim).gather(
            1, inverse.view(tokens, 1, 1).expand(tokens, 1, out_dim)
        ).squeeze(1)
    if bool((used < 0).any()):
        outputs[indices < 0] = 0
    return outputs


def _per_adapter(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """per_row by one product per adapter over that adapter's rows (rows with index < 0 stay zero)."""
    outputs = inputs.new_zeros(inputs.shape[0], weights.shape[1], dtype=dtype)
    order = torch.argsort(indices, stable=True)
    slots, counts = torch.unique_consecutive(indices[order], return_counts=True)
    start = 0
    for slot, count in zip(slots.tolist(), counts.tolist()):
        rows = order[start : start + count]
        start += count
        if slot >= 0:
            outputs.index_copy_(0, rows, inputs.index_select(0, rows).to(dtype) @ weights[slot].to(dtype).T)
    return outputs


class StepPlan:
    """Which adapter each token of an engine step uses, worked out once for every LoRA layer of the step.

    `slots` are the adapter slots in the batch (ascending, -1 as 0), `single` the slot when the batch has
    exactly one adapter and no row without one, `empty` when no row has an adapter; `mask(rank, dtype)` is
    [T, U x rank], 1 where a row's own adapter's block lies, 0 elsewhere (all 0 for rows of slot -1)."""

    def __init__(self, token_slots: torch.Tensor):
        used, inverse = torch.unique(token_slots, return_inverse=True)
        self.tokens = int(token_slots.shape[0])
        self.slots = used.clamp(min=0)
        self.slot_key = tuple(self.slots.tolist())
        self.empty = bool((used < 0).all())
        self.single = int(used[0]) if used.numel() == 1 and not self.empty else None
        self._owner = (inverse.unsqueeze(1) == torch.arange(used.numel()).unsqueeze(0)) & (used >= 0).unsqueeze(0)
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        key = (rank, dtype)
        if key not in self._masks:
            self._masks[key] = self._owner.to(dtype).repeat_interleave(rank, dim=1)
        return self._masks[key]


def add_lora_linear(wrapper, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, lora_b_stacked, scale: float,
                    output_slices, *, buffer=None, **kwargs) -> None:
    """y[:, slice i] += scale x A_i^T B_i^T with each row's own adapter (vLLM's semantics, see the module
    note); `wrapper` is the PunicaWrapperCPU. Falls back to vLLM's own when the step has no plan for x, and
    for the `add_inputs=False` form (y = instead of y +=)."""
    if torch.compiler.is_compiling():
        # Traced: one opaque op, which reads the step's plan when the compiled graph runs.
        torch.ops.clora.add_lora_linear(y, x, list(lora_a_stacked), list(lora_b_stacked), scale, list(output_slices))
        return None
    plan = getattr(wrapper, "_clora_plan", None)
    rows = x.view(-1, x.shape[-1])
    stale = plan is None or plan.tokens != rows.shape[0]
    if stale or kwargs.get("add_inputs") is False:
        return _VLLM_ADD_LORA_LINEAR(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                     buffer=buffer, **kwargs)
    if plan.empty:
        return None
    out = y.view(-1, y.shape[-1])
    exact = out.dtype == torch.float32  # else products in float32, as vLLM's float32 buffers do
    inputs = rows if exact else rows.float()
    offset = 0
    for a, b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):  # a: [L, 1, r, in], b: [L, 1, out, r]
        down_t, up, rank = _stacked(a, b, plan, scale, size)
        shrunk = inputs @ down_t
        if plan.single is None:
            shrunk.mul_(plan.mask(rank, shrunk.dtype))
        target = out[:, offset : offset + size]
        if exact:
            target.addmm_(shrunk, up)
        else:
            target.add_(shrunk @ up)  # rounded to the output's dtype as it is added
        offset += size
    return None


def _stacked(a: torch.Tensor, b: torch.Tensor, plan: StepPlan, scale: float, size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The step's adapters of one slice in float32, ready to multiply: A^T of every adapter in the batch side
    by side ([in, U x r]), their B^T stacked and times `scale` ([U x r, size]), and r, the rank cut to the
    highest row any of them uses (vLLM pads every slot to max_lora_rank with zeros). Kept (`_kept`) until
    the batch's adapters or a slot's weights change, so the gathers and transposes run once per change, not
    per slice per step. The kept copies cover only the adapters of the latest batch, one set per slice: at
    most the size of the slot tables in float32."""

    def build() -> tuple[torch.Tensor, torch.Tensor, int]:
        down = a[plan.slots, 0]  # [U, r, in]
        used_rows = torch.nonzero((down != 0).any(dim=2).any(dim=0))
        rank = int(used_rows.max()) + 1 if used_rows.numel() else 1
        down_t = down[:, :rank].reshape(-1, a.shape[3]).T.float().contiguous()
        up = b[plan.slots, 0, :size, :rank].transpose(1, 2).reshape(-1, size).float().mul(scale).contiguous()
        return down_t, up, rank

    return _kept((a, b), (plan.slot_key, scale, size), build)


def _kept(tables: tuple[torch.Tensor, ...], built_for, build):
    """`build()`, or what it returned the last time for the same slot `tables` and `built_for`, if no table
    was written since: vLLM writes slots in place (`set_lora`, `reset_lora`), which bumps a tensor's version
    counter. Keyed by the tables' addresses; an entry holds the tables themselves, so no other tensor can
    take those addresses while it is kept."""
    key = tuple(t.data_ptr() for t in tables)
    try:
        version = tuple(t._version for t in tables)
    except RuntimeError:  # an inference tensor has no version counter: nothing tells when to build again
        if not _UNVERSIONED:
            _UNVERSIONED.append(key)
            logger.info("LoRA slot tables without version counters: adapters are stacked at every step")
        return build()
    entry = _KEPT.get(key)
    if entry is not None and entry[0] == (built_for, version):
        return entry[2]
    value = build()
    if len(_KEPT) >= _KEPT_MAX:  # slot tables of engines gone (tests): start afresh
        _KEPT.clear()
    _KEPT[key] = ((built_for, version), tables, value)
    return value


_KEPT: dict[tuple[int, ...], tuple] = {}  # by slot tables' addresses: ((built for, versions), tables, value)
_UNVERSIONED: list = []  # logged once
_KEPT_MAX = 4096  # entries: a model has layers x LoRA slices (the tiny model 28) and one logits table


def add_lora_logits(wrapper, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                    lora_b_stacked: torch.Tensor, scale: float, *, buffer=None, **kwargs) -> None:
    """vLLM's, skipped while no adapter in any slot has an lm_head LoRA (all their B weights zero: the
    delta is zero). clora's tenant adapters never do (serving/engine.LORA_TARGETS), so on CPU this saves a
    shrink and an expand to the vocabulary on every engine step (~3% of a decode step). Whether any B is
    non-zero is looked at again only after a slot was written (`_kept`)."""
    if not _kept((lora_b_stacked,), "any", lambda: bool(lora_b_stacked.any())):
        return None
    return _VLLM_ADD_LORA_LOGITS(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)


def _update_metadata(wrapper, *args, **kwargs) -> None:
    global _WRAPPER
    _VLLM_UPDATE_METADATA(wrapper, *args, **kwargs)
    wrapper._clora_plan = StepPlan(wrapper.token_lora_indices)
    _WRAPPER = wrapper


_WRAPPER = None  # the wrapper whose metadata was updated last: the engine process's one LoRA model


# Compiled LoRA engines (module note): the custom op the traced LoRA layers call, and the config switch.


def _add_lora_linear_op(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                        scale: float, output_slices: list[int]) -> None:
    if _WRAPPER is None:
        raise RuntimeError("clora.add_lora_linear ran before vLLM set any LoRA metadata")
    add_lora_linear(_WRAPPER, y, x, lora_a, lora_b, scale, tuple(output_slices))


def _add_lora_linear_fake(y, x, lora_a, lora_b, scale, output_slices) -> None:
    return None


def _register_op() -> None:
    global _LIBRARY
    if _LIBRARY is not None:
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    _LIBRARY = torch.library.Library("clora", "FRAGMENT")
    direct_register_custom_op("add_lora_linear", _add_lora_linear_op, mutates_args=["y"],
                              fake_impl=_add_lora_linear_fake, target_lib=_LIBRARY)


_LIBRARY = None


def _compile_lora_engines(on: bool) -> None:
    """LoRA engines compiled as vLLM compiles plain ones on CPU (`on`), or eager as vLLM runs them."""
    global _VLLM_CHECK_CONFIG
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    if _VLLM_CHECK_CONFIG is None:
        _VLLM_CHECK_CONFIG = platform.check_and_update_config
    if not on:
        platform.check_and_update_config = _VLLM_CHECK_CONFIG
        return
    original = _VLLM_CHECK_CONFIG.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        lora = vllm_config.lora_config  # its only use there: LoRA engines get compilation mode NONE
        vllm_config.lora_config = None
        try:
            original(cls, vllm_config)
        finally:
            vllm_config.lora_config = lora

    platform.check_and_update_config = classmethod(check_and_update_config)


_VLLM_CHECK_CONFIG = None


def _loadable_compile_cache() -> None:
    """vLLM saves each compiled engine's graph (AOT) and loads it at the next start, but on CPU (inductor
    named directly, not vLLM's backend) the saved function is torch's own serializable callable, which lacks
    the `finalize_loading` step vLLM calls on load, so every start compiled again (~12 s on the tiny model).
    That callable needs no finalizing: give it a no-op one (plain and LoRA engines alike)."""
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Callable_
    except ImportError:  # another torch: nothing to mend
        return
    if not hasattr(Callable_, "finalize_loading"):
        Callable_.finalize_loading = lambda self, vllm_config: None


_VLLM_ADD_LORA_LINEAR = None  # vLLM's own, set by register()
_VLLM_UPDATE_METADATA = None
_VLLM_ADD_LORA_LOGITS = None


# The six ops PunicaWrapperCPU calls, with vLLM's signatures and output semantics.


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = per_row(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = per_row(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True):
    outputs = per_row(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def _token_indices(lora_indices_tensor, seq_len_tensor):
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, scaling: float):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _token_indices(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches,
                max_seq_length, token_nums, add_inputs: bool = False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _token_indices(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset: int, slice_size: int, add_inputs: bool = False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _token_indices(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


OPS = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
    "sgmv_shrink": sgmv_shrink,
    "sgmv_expand": sgmv_expand,
    "sgmv_expand_slice": sgmv_expand_slice,
}


def register() -> None:
    """vLLM general plugin, on CPU only: PunicaWrapperCPU uses the ops above, LoRA engines are compiled,
    and compiled graphs load from vLLM's cache (see the module note)."""
    global _VLLM_ADD_LORA_LINEAR, _VLLM_UPDATE_METADATA, _VLLM_ADD_LORA_LOGITS
    choice = os.environ.get(ENV, "clora")
    if choice not in ("clora", "vllm"):
        raise ValueError(f"{ENV} must be 'clora' or 'vllm', got {choice!r}")
    compiled = os.environ.get(COMPILE_ENV, "1")
    if compiled not in ("0", "1"):
        raise ValueError(f"{COMPILE_ENV} must be '0' or '1', got {compiled!r}")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    _loadable_compile_cache()  # every CPU engine's, whichever LoRA ops it runs
    if choice == "vllm":
        if _VLLM_ADD_LORA_LINEAR is not None:  # this process installed ours earlier: put vLLM's back
            from vllm.lora.punica_wrapper import punica_cpu

            punica_cpu.PunicaWrapperCPU.add_lora_linear = _VLLM_ADD_LORA_LINEAR
            punica_cpu.PunicaWrapperCPU.update_metadata = _VLLM_UPDATE_METADATA
            punica_cpu.PunicaWrapperCPU.add_lora_logits = _VLLM_ADD_LORA_LOGITS
            _compile_lora_engines(False)
        return
    from vllm.lora.punica_wrapper import punica_cpu

    for name, fn in OPS.items():
        if not hasattr(punica_cpu, name):
            logger.warning("vLLM's PunicaWrapperCPU has no %s; keeping vLLM's own CPU LoRA ops", name)
            return
    for name, fn in OPS.items():
        setattr(punica_cpu, name, fn)
    wrapper = punica_cpu.PunicaWrapperCPU
    if _VLLM_ADD_LORA_LINEAR is None:
        _VLLM_ADD_LORA_LINEAR, _VLLM_UPDATE_METADATA = wrapper.add_lora_linear, wrapper.update_metadata
        _VLLM_ADD_LORA_LOGITS = wrapper.add_lora_logits
    wrapper.add_lora_linear, wrapper.update_metadata = add_lora_linear, _update_metadata
    wrapper.add_lora_logits = add_lora_logits
    _register_op()
    _compile_lora_engines(compiled == "1")
    logger.debug("clora's CPU LoRA ops are in place")
