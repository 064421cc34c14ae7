"""One base model, one LoRA adapter and one optimizer per tenant: the learner's whole model state.

The base model is loaded once. Each tenant gets a named LoRA adapter on the same peft `PeftModel`
(`add_adapter` / `set_adapter`), with its own rank, alpha and target modules, and its own torch AdamW over
that adapter's parameters only. Memory is therefore base + N x (adapter + optimizer state), and switching
tenants is `set_adapter` (pointer moves, no copies; `clora bench learner` measures it). The base weights
are frozen and shared; KL to the base is computed by running the same model with its LoRA layers switched
off (`Policy.adapter(None)`), so no second copy of the base is ever held.

Adapter names: torch module names cannot contain ".", which tenant names may, and peft finds and strips
an adapter's name in state-dict keys by plain substring matching; so each tenant's adapter is called
`clora_<16 hex digits of the tenant's SHA-256>`: every name of one length, none can occur inside a module
path or inside another's (a readable prefix could: tenant `a_<that tenant's digest>` held tenant `a`'s
name, and one of the two could not be loaded).

Files (PEFT format, as `vllm serve --lora-modules` and `PeftModel.from_pretrained` read them):
    adapter_config.json          the tenant's LoraConfig (inference_mode true)
    adapter_model.safetensors    standard keys, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
A checkpoint is a directory with `adapter/` (those files) and `optimizer.pt` (the AdamW state dict,
loaded with `weights_only=True`).

Deliberately not here: losses (maths.py, update.py), what to train on (logs_mode.py, rollouts.py), when to
save (loop.py), where files go (storage/).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from learner import maths
from learner.batch import TokenBatch
from learner.types import Sample, TenantSpec

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
CHECKPOINT_ADAPTER_DIR = "adapter"
_LORA_PARTS = ("lora_A", "lora_B")
KEEP_BASE_BYTES = 256 * 2**20  # base log-distributions kept for the KL gate up to this size (else recomputed)


class PolicyError(RuntimeError):
    """A tenant's adapter or checkpoint cannot be used (unknown tenant, wrong shape, missing or bad files)."""


class DamagedFile(PolicyError):
    """An adapter or checkpoint file whose bytes do not parse, or hold non-finite weights: read on the CPU, so
    that a device's error (out of memory, a CUDA fault) is never taken for it, nor is an OSError (the disk
    now), nor a file that parses but does not fit (another model or peft: the environment, not the file)."""


def adapter_name(tenant: str) -> str:
    """The peft adapter name of `tenant` (see the module note)."""
    return f"clora_{hashlib.sha256(tenant.encode()).hexdigest()[:16]}"


def tenant_seed(tenant: str, seed: int) -> int:
    """Seed of a tenant's fresh adapter: the same tenant and seed always start from the same weights."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{tenant}".encode()).digest()[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class Snapshot:
    """A tenant's adapter weights and optimizer state, copied in memory (to undo a rejected step)."""

    weights: dict[str, Tensor]
    optimizer: dict


def pick_device(device: str) -> torch.device:
    """The torch device `learner.device` names; PolicyError when this host has no such device (torch's own
    error is an assertion deep in the first tensor moved there)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_problem(device)
    if problem is not None:
        raise PolicyError(problem)
    return torch.device(device)


def device_problem(device: str) -> str | None:
    """Why this host cannot run the learner on `device` (learner.device), or None."""
    if device in ("auto", "cpu"):
        return None
    kind, _, index = device.partition(":")
    backend = getattr(torch, kind, None)
    if backend is None or not backend.is_available():
        return f"learner.device is {device!r}, but this host has no {kind} device torch can use (set it to auto or cpu)"
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if index and int(index) >= count:
        return f"learner.device is {device!r}, but this host has {count} {kind} device(s), numbered from 0"
    return None


class Policy:
    """The shared base model and every tenant's adapter and optimizer (see the module note)."""

    def __init__(self, model_path: str | Path, *, device: str = "auto", seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model_path)
        self.device = pick_device(device)
        self.seed = seed
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            base = AutoModelForCausalLM.from_pretrained(self.model_path, dtype="auto")
        except Exception as e:  # noqa: BLE001 - damaged files raise whatever their reader does (safetensors, tokenizers)
            raise PolicyError(f"cannot load the base model from {self.model_path}: {type(e).__name__}: {e}") from e
        if self.device.type == "cpu" and base.dtype != torch.float32:
            base = base.float()  # half precision matmuls are slow or missing on CPU
        base.to(self.device)
        base.eval()
        base.requires_grad_(False)
        self.model = base  # becomes a PeftModel with the first tenant
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_id
        if self.tokenizer.pad_token_id is None:  # Llama 3's and Mistral's have none: padding a batch would refuse
            self.tokenizer.pad_token_id = self.pad_token_id
        # Generation stops at any of the model's end tokens (the tiny model: <|im_end|> and <|endoftext|>),
        # as vLLM does with the same generation_config.
        configured = base.generation_config.eos_token_id if base.generation_config is not None else None
        configured = configured if isinstance(configured, list) else [configured]
        self.stop_token_ids = tuple(dict.fromkeys(t for t in [self.eos_token_id, *configured] if t is not None))
        self._specs: dict[str, TenantSpec] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._params: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        self._file_keys: dict[str, list[tuple[str, torch.nn.Parameter]] | None] = {}
        self._active: str | None = None
        self._lora_layers: list | None = None  # the switch's fast path (see `use`)
        self._has_dropout = _has_dropout(base)  # whether train mode changes a forward pass at all
        self.share_prompts = True  # rows with one prompt share its forward pass (`_completion_logits`)

    # --- tenants --------------------------------------------------------------------------------------
    @property
    def has_dropout(self) -> bool:
        """Whether a gradient pass (train mode) differs from a no-grad one: some dropout would act."""
        return self._has_dropout

    @property
    def tenants(self) -> list[str]:
        return sorted(self._specs)

    def has(self, tenant: str) -> bool:
        return tenant in self._specs

    def spec(self, tenant: str) -> TenantSpec:
        self._require(tenant)
        return self._specs[tenant]

    def add_tenant(self, spec: TenantSpec) -> None:
        """Creates the tenant's adapter (freshly initialised, seeded by tenant name) and its optimizer."""
        from peft import LoraConfig, get_peft_model

        if spec.name in self._specs:
            raise PolicyError(f"tenant {spec.name!r} already has an adapter")
        name = adapter_name(spec.name)
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.target_modules),
            lora_dropout=spec.dropout,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=str(self.model_path),
        )
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(tenant_seed(spec.name, self.seed))
            try:
                if not hasattr(self.model, "peft_config"):  # the bare base model: the first tenant
                    self.model = get_peft_model(self.model, config, adapter_name=name)
                else:
                    self.model.add_adapter(name, config)
            except ValueError as e:  # peft: target modules not found in the base model, and the like
                raise PolicyError(f"cannot add an adapter for tenant {spec.name!r}: {e}") from e
        # peft leaves the model in train mode: every pass but a gradient pass (which switches train mode on for
        # itself) must run without dropout, a probe or a π_prox before this tenant's first update included.
        self.model.eval()
        params = sorted(
            (n, p) for n, p in self.model.named_parameters() if _adapter_of(n) == name
        )
        if not params:
            raise PolicyError(f"tenant {spec.name!r}: target modules {list(spec.target_modules)} matched no layer")
        self._params[spec.name] = params
        # The PEFT file keys of the adapter's tensors: its parameter names without the adapter name, as peft's
        # get_peft_model_state_dict writes them (checked against it here, once; that walk of the whole model
        # state cost more than the file write, twice per step). None: an adapter kind with other keys.
        keyed = {n.replace(f".{name}.", "."): param for n, param in params}
        self._file_keys[spec.name] = sorted(keyed.items()) if set(keyed) == set(_peft_keys(self.model, name)) else None
        for _, p in (p for ps in self._params.values() for p in ps):
            p.requires_grad_(True)  # peft's add_adapter froze the other adapters; each optimizer owns its own
        self._lora_layers = _lora_layers(self.model)
        self._has_dropout = _has_dropout(self.model)
        self._optimizers[spec.name] = torch.optim.AdamW([p for _, p in params], lr=spec.learning_rate, weight_decay=0.0)
        self._specs[spec.name] = spec
        self._active = None  # peft may have moved the active adapter
        logger.info(
            "tenant %s: adapter r=%d alpha=%g on %s (%d tensors, %.1f KiB)",
            spec.name, spec.rank, spec.alpha, ",".join(spec.target_modules), len(params), self.adapter_bytes(spec.name) / 1024,
        )

    def remove_tenant(self, tenant: str) -> None:
        """Deletes the tenant's adapter and optimizer (another learner process trains it now)."""
        self._require(tenant)
        if len(self._specs) == 1:  # the last one: back to the bare base model (peft keeps no empty wrapper)
            self.model = self.model.unload()
        else:
            with warnings.catch_warnings():  # "Adapter ... was active which is now deleted": `use` picks the next
                warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
                self.model.delete_adapter(adapter_name(tenant))
        for table in (self._specs, self._optimizers, self._params, self._file_keys):
            table.pop(tenant, None)
        self._lora_layers = _lora_layers(self.model)
        self._has_dropout = _has_dropout(self.model)
        self._active = None
        logger.info("tenant %s: adapter and optimizer removed", tenant)

    def update_spec(self, spec: TenantSpec) -> None:
        """Applies config changes that need no new adapter (learning rate, batch size, mode, scorer).
        A changed adapter shape cannot apply to an existing adapter: it is logged and ignored."""
        old = self.spec(spec.name)
        if not old.same_adapter_shape(spec):
            logger.warning(
                "tenant %s: the config changes the adapter shape (r=%d alpha=%g targets=%s); the existing adapter "
                "keeps r=%d alpha=%g targets=%s",
                spec.name, spec.rank, spec.alpha, list(spec.target_modules), old.rank, old.alpha, list(old.target_modules),
            )
            spec = replace(spec, rank=old.rank, alpha=old.alpha, target_modules=old.target_modules, dropout=old.dropout)
        for group in self._optimizers[spec.name].param_groups:
            group["lr"] = spec.learning_rate
        self._specs[spec.name] = spec

    def use(self, tenant: str) -> None:
        """Makes `tenant`'s adapter the active one (the tenant switch).

        peft's `set_adapter` walks every module of the model and flips requires_grad on every adapter of
        every LoRA layer: O(modules x tenants), milliseconds with a few tenants on a 4B model. The fast path
        points the LoRA layers (listed once, when adapters are added) at the tenant's adapter and makes only
        its parameters trainable, O(LoRA layers). Other adapters may stay trainable: they take no part in
        the forward pass, so they get no gradient, and each tenant's optimizer holds only its own.
        """
        self._require(tenant)
        if self._active == tenant:
            return
        name = adapter_name(tenant)
        if self._lora_layers is None:
            self.model.set_adapter(name)
        else:
            for layer in self._lora_layers:
                layer._active_adapter = [name]
            self.model.base_model.active_adapter = name
            for _, p in self._params[tenant]:
                p.requires_grad_(True)  # disable_adapter() re-enables layers through peft, which freezes the inactive
        self._active = tenant

    @contextlib.contextmanager
    def adapter(self, tenant: str | None) -> Iterator[None]:
        """Runs the block with `tenant`'s adapter, or with no adapter at all (the base model) for None.

        peft's `disable_adapter()` walks every module twice and flips requires_grad on every adapter
        (~11 ms with 8 tenants on the tiny model, a third of its forward pass); the fast path sets the flag
        its LoRA layers read, on those layers only. The base pass runs without gradient here, so the
        adapters' requires_grad need not change."""
        if tenant is not None:
            self.use(tenant)
            yield
        elif not self._specs:
            yield
        elif self._lora_layers is None:
            with self.model.disable_adapter():
                yield
        else:
            for layer in self._lora_layers:
                layer._disable_adapters = True
            try:
                yield
            finally:
                for layer in self._lora_layers:
                    layer._disable_adapters = False

    @contextlib.contextmanager
    def _merged(self, tenant: str | None) -> Iterator[None]:
        """For generation (no gradient): runs the block on the base model with `tenant`'s LoRA folded into
        the weights of the layers it adapts, W + scale B A, with the LoRA layers switched off, so each
        token's forward pass is the plain model's (peft's per-layer adapter ops were most of a probe's time:
        decoding is a few rows per step). The base weights are swapped for merged copies and put back, never
        changed in place. Falls back to `adapter` for the base model, for LoRA layers of another kind, and for a
        base in lower precision than float32 (bf16 on a GPU): W + scale B A rounded back to bf16 keeps little of
        a young adapter's change (relative error ~0.5 for a step's ~1e-4 change of weights ~N(0, 0.02²)), so
        the rollouts would come from another policy than the one trained, with nothing to correct for it."""
        layers = self._mergeable(tenant)
        if layers is None or any(layer.base_layer.weight.dtype != torch.float32 for layer in layers):
            with self.adapter(tenant):
                yield
            return
        name = adapter_name(tenant)
        originals = []
        try:
            with torch.no_grad():
                for layer in layers:
                    base = layer.base_layer
                    # Stored as the transpose of a contiguous [in, out] matrix: `linear` multiplies by
                    # weight.t(), and a contiguous right operand is faster at decoding's few rows on CPU (the
                    # tiny model's probe: ~7%).
                    merged = torch.addmm(base.weight.t(), layer.lora_A[name].weight.t().float(),
                                         layer.lora_B[name].weight.t().float(), alpha=layer.scaling[name]).t()
                    originals.append((base, base.weight))
                    base.weight = torch.nn.Parameter(merged, requires_grad=False)
            with self.adapter(None):
                yield
        finally:
            for base, weight in originals:
                base.weight = weight

    def _mergeable(self, tenant: str | None) -> list | None:
        """The LoRA layers holding `tenant`'s adapter if every one is a plain peft LoRA over an nn.Linear
        (no DoRA, no transposed weights); None otherwise (and for the base model)."""
        if tenant is None or self._lora_layers is None:
            return None
        self._require(tenant)
        name = adapter_name(tenant)
        layers = [layer for layer in self._lora_layers if name in getattr(layer, "lora_A", {})]
        for layer in layers:
            if not (
                isinstance(layer.base_layer, torch.nn.Linear)
                and not getattr(layer, "fan_in_fan_out", False)
                and not getattr(layer, "use_dora", {}).get(name, False)
                and not getattr(layer, "lora_bias", {}).get(name, False)
                and name in layer.lora_B
                and name in layer.scaling
            ):
                return None
        return layers or None

    # --- log-probs and the optimizer ------------------------------------------------------------------
    def token_logprobs(self, batch: TokenBatch, tenant: str | None, *, grad: bool = False,
                       temperature: float = 1.0, on_logits: Callable[[Tensor], None] | None = None) -> Tensor:
        """log pi(completion token | prefix) for every completion position, [B, C] (float32), of the policy
        that samples at `temperature` (softmax(logits / temperature)). Positions past a completion's end
        hold values of padding tokens: mask them with batch.completion_mask. `on_logits`: see
        token_logprobs_and_entropy."""
        return self.token_logprobs_and_entropy(batch, tenant, grad=grad, temperature=temperature,
                                               with_entropy=False, on_logits=on_logits)[0]

    def token_logprobs_and_entropy(self, batch: TokenBatch, tenant: str | None, *, grad: bool = False,
                                   temperature: float = 1.0, with_entropy: bool = True,
                                   on_logits: Callable[[Tensor], None] | None = None) -> tuple[Tensor, Tensor | None]:
        """`token_logprobs` and, when `with_entropy`, the entropy of the policy's next-token distribution at
        every completion position, [B, C] (float32), from the same logits (one forward pass). `on_logits`,
        when given, is called with the pass's logits [B, C, V] (temperature 1, detached, no gradient), so a
        caller that needs something else of them does not run the model again."""
        batch = batch.to(self.device)
        with self.adapter(tenant), torch.set_grad_enabled(grad):
            train = grad and self._has_dropout  # train mode would change nothing else (it walks every module)
            if train:
                self.model.train(True)
            try:
                logits = self._completion_logits(batch)
            finally:
                if train:
                    self.model.train(False)
            if on_logits is not None:
                with torch.no_grad():
                    on_logits(logits.detach())
            logits = _tempered(logits, temperature)
            return (_gather_logprobs(logits, batch.completion_ids),
                    maths.entropy(logits) if with_entropy else None)

    def logprobs_of_version(self, batch: TokenBatch, tenant: str, directory: str | Path | None, *,
                            temperature: float = 1.0) -> Tensor:
        """`token_logprobs` (no gradient) of an earlier version of the tenant's adapter, whose PEFT files are
        in `directory` (None: the base model, version 0): the behaviour policy of samples that version
        made, where the sampler's own log-probs are not those of the sampling distribution. The tenant's
        current weights are put back afterwards; its optimizer is not touched."""
        if directory is None:
            return self.token_logprobs(batch, None, temperature=temperature)
        with self.weights_of_version(tenant, directory):
            return self.token_logprobs(batch, tenant, temperature=temperature)

    @contextlib.contextmanager
    def weights_of_version(self, tenant: str, directory: str | Path) -> Iterator[None]:
        """Inside the block the tenant's adapter holds an earlier version's weights (its PEFT files in
        `directory`); its current weights are put back afterwards, its optimizer is not touched."""
        self._require(tenant)
        current = {n: p.detach().clone() for n, p in self._params[tenant]}
        try:
            self.load_adapter(tenant, directory)
            yield
        finally:
            with torch.no_grad():
                for n, p in self._params[tenant]:
                    p.copy_(current[n])

    def processed_logprobs(self, batch: TokenBatch, tenant: str | None,
                           process: Callable[[Tensor, TokenBatch, slice], Tensor], *,
                           rows_per_pass: int | None = None) -> Tensor:
        """No-grad log-probs of the completion tokens [B, C] (float32, on the CPU) under a distribution that
        `process(logits [b, C, V], part, rows)` makes from the logits of `tenant`'s adapter (None: the base
        model) for `part`, the batch's `rows`: `rows_per_pass` rows at a time, so a catch-up step never
        holds every row's logits at once. Logs mode's behaviour log-probs (maths.processed_logprobs)."""
        batch = batch.to(self.device)
        out = []
        with self.adapter(tenant), torch.no_grad():
            for rows, part in batch.chunks(rows_per_pass):
                out.append(process(self._completion_logits(part), part, rows).to("cpu", torch.float32))
        return torch.cat(out)

    def _completion_logits(self, batch: TokenBatch) -> Tensor:
        """[B, C, V] float32 logits at the positions that predict each completion token, with whatever
        adapter and grad mode the caller set.

        Rows that share a prompt (a GRPO group's completions) share its pass: each distinct prompt runs
        once, with the KV cache kept, and its keys and values are indexed out to every row of its group
        for a second pass over the completions (all but their last token, which predicts nothing). The
        logits are the single pass's up to float rounding, and so is the gradient, which flows back
        through the indexing into the shared prompt pass. A group of G completions of a P-token prompt
        then costs P + G x (C - 1) tokens where it cost G x (P + C); `share_prompts = False` turns it off."""
        groups = batch.prompt_groups() if self.share_prompts else None
        if groups is not None:
            shared = self._shared_prompt_logits(batch, *groups)
            if shared is not None:
                return shared
        out = self.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.completion_width + 1,
            use_cache=False,
        )
        return out.logits[:, :-1].float()

    def _shared_prompt_logits(self, batch: TokenBatch, first: Tensor, inverse: Tensor) -> Tensor | None:
        """`_completion_logits` with one pass per distinct prompt (see there); None, and `share_prompts`
        turned off for good, when the model's cache cannot be indexed by row (LFM2's convolution states)."""
        width_p, width_c = batch.prompt_width, batch.completion_width
        prompt = self.model(
            input_ids=batch.input_ids[first, :width_p],
            attention_mask=batch.attention_mask[first, :width_p],
            position_ids=batch.position_ids[first, :width_p],
            logits_to_keep=1,
            use_cache=True,
        )
        first_token = prompt.logits[inverse]  # [B, 1, V]: the last prompt position predicts the first token
        if width_c == 1:
            return first_token.float()
        cache = prompt.past_key_values
        if not all(hasattr(layer, "batch_select_indices") for layer in getattr(cache, "layers", [None])):
            logger.info("the model's cache (%s) cannot be indexed by row: rows that share a prompt run it each",
                        type(cache).__name__)
            self.share_prompts = False
            return None
        cache.batch_select_indices(inverse)
        rest = self.model(
            input_ids=batch.completion_ids[:, : width_c - 1],
            attention_mask=batch.attention_mask[:, : width_p + width_c - 1],
            position_ids=batch.position_ids[:, width_p : width_p + width_c - 1],
            past_key_values=cache,
            use_cache=True,
        )
        return torch.cat([first_token, rest.logits], dim=1).float()

    def base_reference(self, batch: TokenBatch, *, keep_bytes: int = KEEP_BASE_BYTES,
                       temperature: float = 1.0, rows_per_pass: int | None = None,
                       on_logits: Callable[[Tensor, TokenBatch, slice], None] | None = None) -> tuple[Tensor, Tensor | None]:
        """A no-grad pass of the base model: its log-probs of the completion tokens [B, C] at
        `temperature` (the KL penalty's reference, beside a policy trained at that temperature), and its
        whole log-distributions at those positions [B, C, V] at temperature 1 (the exact KL the gate reads)
        when they fit in `keep_bytes` (else None), for `kl_to_base` to reuse instead of running the base
        model again. `rows_per_pass` rows at a time (None: all), so a batch trained in micro-batches holds
        one micro-batch's logits at once here too. `on_logits(logits, part, rows)`, when given, is called with
        each pass's logits [b, C, V] (temperature 1) for `part`, the batch's `rows`."""
        batch = batch.to(self.device)
        picked, kept, keep = [], [], None
        with self.adapter(None), torch.no_grad():
            for rows, part in batch.chunks(rows_per_pass):
                logits = self._completion_logits(part)
                if on_logits is not None:
                    on_logits(logits, part, rows)
                if keep is None:  # every row's [C, V] is the same size (rows keep the batch's widths)
                    keep = logits[0].numel() * logits.element_size() * batch.size <= keep_bytes
                if keep:
                    kept.append(torch.log_softmax(logits, dim=-1))
                if keep and temperature == 1.0:
                    picked.append(kept[-1].gather(-1, part.completion_ids.unsqueeze(-1)).squeeze(-1))
                else:
                    picked.append(picked_logprobs(logits, part.completion_ids, temperature))
        return torch.cat(picked), torch.cat(kept) if keep else None

    def kl_to_base(
        self, batch: TokenBatch, tenant: str, *, rows_per_pass: int = 8, base_logps: Tensor | None = None
    ) -> Tensor:
        """Exact KL(tenant's policy || base model) over the whole vocabulary at every completion position,
        [B, C] (float32; mask with batch.completion_mask). `rows_per_pass` rows at a time, so at most that
        many rows' [C, V] log-distributions (twice) are alive at once. `base_logps` ([B, C, V], from
        `base_reference`) saves the base model's pass."""
        batch = batch.to(self.device)
        out = []
        with torch.no_grad():
            for rows, part in batch.chunks(rows_per_pass):
                with self.adapter(tenant):
                    ours = torch.log_softmax(self._completion_logits(part), dim=-1)
                if base_logps is not None:
                    base = base_logps[rows]
                else:
                    with self.adapter(None):
                        base = torch.log_softmax(self._completion_logits(part), dim=-1)
                out.append(maths.kl_exact(ours, base))
        return torch.cat(out)

    def zero_grad(self, tenant: str) -> None:
        self._require(tenant)
        self._optimizers[tenant].zero_grad(set_to_none=True)

    def optimizer_step(self, tenant: str, *, max_grad_norm: float) -> float:
        """Clips the tenant's gradient to `max_grad_norm`, steps its optimizer, clears the gradient; returns
        the gradient norm before clipping (inf or nan when the gradient was not finite)."""
        self._require(tenant)
        params = [p for _, p in self._params[tenant]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        self._optimizers[tenant].step()
        self._optimizers[tenant].zero_grad(set_to_none=True)
        return float(norm)

    def trainable(self, tenant: str) -> list[torch.nn.Parameter]:
        self._require(tenant)
        return [p for _, p in self._params[tenant]]

    # --- state: snapshots, files ----------------------------------------------------------------------
    def snapshot(self, tenant: str) -> Snapshot:
        self._require(tenant)
        return Snapshot(
            weights={n: p.detach().clone() for n, p in self._params[tenant]},
            optimizer=_copy_state(self._optimizers[tenant].state_dict()),
        )

    def restore(self, tenant: str, snapshot: Snapshot) -> None:
        self._require(tenant)
        with torch.no_grad():
            for n, p in self._params[tenant]:
                p.copy_(snapshot.weights[n])
        self._optimizers[tenant].load_state_dict(_copy_state(snapshot.optimizer))

    def weights_finite(self, tenant: str) -> bool:
        self._require(tenant)
        return all(bool(torch.isfinite(p).all()) for _, p in self._params[tenant])

    def adapter_bytes(self, tenant: str) -> int:
        self._require(tenant)
        return sum(p.numel() * p.element_size() for _, p in self._params[tenant])

    def optimizer_bytes(self, tenant: str) -> int:
        self._require(tenant)
        state = self._optimizers[tenant].state
        return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))

    def save_adapter(self, tenant: str, directory: str | Path) -> None:
        """Writes the tenant's adapter in PEFT format into `directory` (which must exist)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        self._require(tenant)
        name = adapter_name(tenant)
        directory = Path(directory)
        # Never the base embeddings (peft would add them when lm_head is a target): only lora_A/lora_B.
        keyed = self._file_keys.get(tenant)
        if keyed is not None:
            state = dict(keyed)
        else:
            state = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = copy.deepcopy(self.model.peft_config[name])
        config.inference_mode = True
        config.save_pretrained(str(directory))

    def load_adapter(self, tenant: str, directory: str | Path) -> None:
        """Loads adapter weights saved by `save_adapter` (or any PEFT adapter of the same shape)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        self._require(tenant)
        directory = Path(directory)
        try:
            state = load_file(str(directory / ADAPTER_WEIGHTS), device="cpu")  # copied to the model's device below
        except (OSError, MemoryError) as e:
            raise PolicyError(f"tenant {tenant!r}: cannot read adapter weights in {directory}: {e}") from e
        except Exception as e:  # noqa: BLE001 - a damaged file raises safetensors' own error, not an OSError
            raise DamagedFile(f"tenant {tenant!r}: cannot read adapter weights in {directory}: {type(e).__name__}: {e}") from e
        expected = {k for k in _peft_keys(self.model, adapter_name(tenant))}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise PolicyError(
                f"tenant {tenant!r}: adapter in {directory} does not fit its adapter "
                f"({len(missing)} missing keys e.g. {missing[:2]}, {len(extra)} unexpected e.g. {extra[:2]})"
            )
        try:
            set_peft_model_state_dict(self.model, state, adapter_name=adapter_name(tenant))
        except RuntimeError as e:  # size mismatch
            raise PolicyError(f"tenant {tenant!r}: adapter in {directory} has other shapes: {e}") from e

    def save_checkpoint(self, tenant: str, directory: str | Path) -> None:
        """adapter/ (PEFT format) + optimizer.pt into `directory`."""
        directory = Path(directory)
        (directory / CHECKPOINT_ADAPTER_DIR).mkdir(parents=True, exist_ok=True)
        self.save_adapter(tenant, directory / CHECKPOINT_ADAPTER_DIR)
        torch.save(self._optimizers[tenant].state_dict(), directory / OPTIMIZER_FILE)

    def load_checkpoint(self, tenant: str, directory: str | Path) -> None:
        directory = Path(directory)
        self.load_adapter(tenant, directory / CHECKPOINT_ADAPTER_DIR)
        path = directory / OPTIMIZER_FILE
        try:
            # Read on the CPU: a damaged file raises what unpickling meets (UnpicklingError, EOFError, the zip
            # reader's RuntimeError), and nothing else can fail there but the disk.
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, MemoryError) as e:  # the disk's say, e.g. EIO: worth showing whole
            raise PolicyError(f"tenant {tenant!r}: cannot read the optimizer state {path}: {e}") from e
        except Exception as e:  # noqa: BLE001
            raise DamagedFile(f"tenant {tenant!r}: the optimizer state {path} is damaged, or not one clora wrote: "
                              f"{_without_unsafe_advice(e)}") from e
        try:
            self._optimizers[tenant].load_state_dict(state)  # onto the parameters' device
        except (ValueError, KeyError, TypeError) as e:  # parsed, but for other parameters
            raise PolicyError(f"tenant {tenant!r}: the optimizer state {path} does not fit its adapter: {e}") from e
        for group in self._optimizers[tenant].param_groups:  # the saved state carries the lr of its time
            group["lr"] = self.spec(tenant).learning_rate

    @property
    def vocab_size(self) -> int:
        """Rows of the model's input embedding: every token id it can take."""
        return self.model.get_input_embeddings().weight.shape[0]

    def reset_optimizer(self, tenant: str) -> None:
        """A fresh optimizer state (after the adapter was replaced from outside, e.g. a rollback)."""
        spec = self.spec(tenant)
        self._optimizers[tenant] = torch.optim.AdamW(self.trainable(tenant), lr=spec.learning_rate, weight_decay=0.0)

    # --- sampling -------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        tenant: str | None,
        prompts: Sequence[str],
        *,
        n: int = 1,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        greedy: bool = False,
    ) -> list[list[Sample]]:
        """`n` completions of each rendered prompt with `tenant`'s adapter (None: the base model); greedy
        decoding gives one completion per prompt."""
        if greedy and n != 1:
            raise ValueError(f"greedy decoding gives one completion per prompt, asked for n={n}")
        if not prompts:
            return []
        enc = self.tokenizer(list(prompts), add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        input_ids = enc["input_ids"].to(self.device).repeat_interleave(n, dim=0)
        attention_mask = enc["attention_mask"].to(self.device).repeat_interleave(n, dim=0)
        with self._merged(tenant):
            tokens = self._decode(input_ids, attention_mask, max_new_tokens, None if greedy else temperature)
        samples = [self._sample(row.tolist(), tenant) for row in tokens]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def generate_grouped(self, groups: Sequence[tuple[str, Sequence[str]]], *, max_new_tokens: int = 32) -> list[list[Sample]]:
        """The greedy completion of each prompt of each (tenant, prompts) group under that tenant's adapter, all
        groups decoded together: one forward pass per token for every tenant (the learner's gate probes of a
        round, loop.py), where `generate` would run one decode per tenant. The same tokens as `generate(tenant,
        prompts, greedy=True)` per group (tested), up to float rounding of the adapters' sums.

        Every LoRA layer computes base(x) + B_t A_t x for the rows of tenant t as one batched matmul over the
        groups (`_grouped`), so the base weights are multiplied once for all rows and no adapter is merged or
        copied. Groups are padded to the largest with copies of their first prompt (dropped afterwards). One
        group decodes the same way (so a tenant's probes score alike alone and in a round, whatever the base's
        dtype: `generate` folds the adapter into the base's weights, which rounds it in bf16). Falls back to
        one `generate` per group for adapters `_grouped` cannot batch."""
        groups = [(tenant, list(prompts)) for tenant, prompts in groups]
        live = [(tenant, prompts) for tenant, prompts in groups if prompts]
        if not live or any(self._mergeable(tenant) is None for tenant, _ in live):
            return [self.generate(tenant, prompts, max_new_tokens=max_new_tokens, greedy=True) if prompts else []
                    for tenant, prompts in groups]
        width = max(len(prompts) for _, prompts in live)
        rows = [p for _, prompts in live for p in prompts + [prompts[0]] * (width - len(prompts))]
        enc = self.tokenizer(rows, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
        with self._grouped([tenant for tenant, _ in live], rows=len(rows)):
            tokens = self._decode(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device), max_new_tokens, None)
        out, at = [], 0
        for tenant, prompts in groups:
            if not prompts:
                out.append([])
                continue
            out.append([[self._sample(row.tolist(), tenant)] for row in tokens[at : at + len(prompts)]])
            at += width
        return out

    @contextlib.contextmanager
    def _grouped(self, tenants: Sequence[str], *, rows: int) -> Iterator[None]:
        """Runs the block with the batch's `rows` rows in len(tenants) equal groups, group g under tenants[g]'s
        adapter: each LoRA layer's forward becomes base(x) + bmm(bmm(x_g, A_g), B_g), with every tenant's
        A [in, r] and scale x B [r, out] stacked (ranks padded with zeros to the largest; zeros for a tenant
        that does not adapt the layer), and every other LoRA layer (another tenant's only) is off. No
        gradient, no dropout (as in generation); peft's own forward comes back afterwards. Every tenant must
        be `_mergeable` (plain LoRA over nn.Linear); a layer that sees other than the batch's rows raises."""
        names = [adapter_name(t) for t in tenants]
        for tenant in tenants:
            self._require(tenant)
        patched = []
        try:
            for layer in self._lora_layers or ():
                present = [n for n in names if n in getattr(layer, "lora_A", {})]
                if not present:
                    continue
                base = layer.base_layer
                rank = max(layer.lora_A[n].weight.shape[0] for n in present)
                dtype = layer.lora_A[present[0]].weight.dtype
                a = torch.zeros(len(names), base.in_features, rank, dtype=dtype, device=self.device)
                b = torch.zeros(len(names), rank, base.out_features, dtype=dtype, device=self.device)
                for g, n in enumerate(names):
                    if n in layer.lora_A:
                        r = layer.lora_A[n].weight.shape[0]
                        a[g, :, :r] = layer.lora_A[n].weight.t()
                        b[g, :r] = layer.lora_B[n].weight.t() * layer.scaling[n]
                layer.forward = _grouped_forward(base, a, b, rows)
                patched.append(layer)
            with self.adapter(None):  # layers of tenants outside the batch: the base alone
                yield
        finally:
            for layer in patched:
                del layer.forward

    def _decode(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, temperature: float | None) -> Tensor:
        """New tokens [rows, <= max_new_tokens] for left-padded prompts: greedy (`temperature` None) or drawn
        from softmax(logits / temperature), one token per row per forward pass over a KV cache, until every
        row has produced an end token (later positions of a finished row hold padding).

        The same passes and the same random draws as transformers' `generate` with `do_sample`, `top_k=0`,
        `top_p=1` (tested token for token), without its per-step machinery (logits processors, stopping
        criteria, input preparation): that was a quarter of a gate probe's time on the tiny model."""
        rows = input_ids.shape[0]
        cache = None  # the model makes the cache its layers need (attention, sliding window, convolution state)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(self.stop_token_ids, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        step_ids, new = input_ids, []
        for _ in range(max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache, logits = out.past_key_values, out.logits[:, -1].float()
            if temperature is None:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1).squeeze(1)
            token = token.masked_fill(finished, self.pad_token_id)
            new.append(token)
            finished |= torch.isin(token, stop)
            if bool(finished.all()):
                break
            step_ids = token[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((rows, 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1
        return torch.stack(new, dim=1) if new else input_ids.new_zeros((rows, 0))

    def _sample(self, ids: list[int], tenant: str | None) -> Sample:
        end = next((i for i, t in enumerate(ids) if t in self.stop_token_ids), None)
        finished = end is not None
        if finished:
            ids = ids[: end + 1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Sample(text=text, token_ids=tuple(ids), finished=finished, version=None)

    # --- internals ------------------------------------------------------------------------------------
    def _require(self, tenant: str) -> None:
        if tenant not in self._specs:
            raise PolicyError(f"tenant {tenant!r} has no adapter (known: {', '.join(self._specs) or 'none'})")


def _grouped_forward(base: torch.nn.Module, a: Tensor, b: Tensor, rows: int):
    """A LoRA layer's forward for `rows` rows in a.shape[0] equal groups, group g adapted by a[g] [in, r], b[g] [r, out]."""
    groups = a.shape[0]

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        if x.dim() < 2 or x.shape[0] != rows:  # e.g. an expert's share of the tokens: rows cannot be told apart
            raise PolicyError(f"a grouped LoRA layer got input of shape {tuple(x.shape)}, not {rows} rows")
        y = base(x, *args, **kwargs)
        delta = torch.bmm(torch.bmm(x.reshape(groups, -1, x.shape[-1]).to(a.dtype), a), b)
        return y + delta.reshape(y.shape).to(y.dtype)

    return forward


def _has_dropout(model) -> bool:
    """Whether the model's training mode changes its output: some dropout with p > 0 (the adapters' own
    included), or attention dropout in its config."""
    config = getattr(model, "config", None)
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def _lora_layers(model) -> list | None:
    """The model's LoRA layers, if they keep their active adapters and their off switch where `Policy.use`
    and `Policy.adapter` expect (peft's BaseTunerLayer._active_adapter, a list of names, and
    _disable_adapters); None otherwise, and those then call peft's set_adapter and disable_adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers or not all(
        isinstance(getattr(m, "_active_adapter", None), list) and isinstance(getattr(m, "_disable_adapters", None), bool)
        for m in layers
    ):
        return None
    if not hasattr(model, "base_model") or not hasattr(model.base_model, "active_adapter"):
        return None
    return layers


def _copy_state(value):
    """A deep copy of an optimizer state dict: tensors cloned, containers rebuilt (deepcopy's generic
    machinery took several milliseconds per step for AdamW's few dozen tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_state(v) for v in value)
    return copy.deepcopy(value)


def _adapter_of(param_name: str) -> str | None:
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in _LORA_PARTS:
            return parts[i + 1]
    return None


def _peft_keys(model, name: str) -> list[str]:
    """The state-dict keys `save_adapter` writes for adapter `name` (without the adapter name)."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False))


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    return logits if temperature == 1.0 else logits / temperature


def picked_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[token] at every position, [..., C]."""
    return _gather_logprobs(_tempered(logits, temperature), tokens)


def _gather_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log_softmax(logits)[token] without keeping a second [B, C, V] tensor alive: logit - logsumexp."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _without_unsafe_advice(e: Exception) -> str:
    """`type: message` of a failed torch.load, less torch's advice to load the file with weights_only=False
    (which runs whatever code a pickle holds): its first sentence at most."""
    text = str(e).split("\n", 1)[0]
    if "weights_only" in text:
        text = text.split(". ", 1)[0]
    return f"{type(e).__name__}: {text}"


def missing_checkpoint_files(directory: str | Path) -> list[str]:
    """The files `save_checkpoint` writes that `directory` lacks. A committed checkpoint is written whole
    (storage.cursors), so one missing is damage; any other error reading the directory is the disk's, raised."""
    missing = []
    for rel in (f"{CHECKPOINT_ADAPTER_DIR}/{ADAPTER_CONFIG}", f"{CHECKPOINT_ADAPTER_DIR}/{ADAPTER_WEIGHTS}", OPTIMIZER_FILE):
        try:
            (Path(directory) / rel).stat()
        except FileNotFoundError:
            missing.append(rel)
    return missing


def read_adapter_shape(directory: str | Path) -> dict:
    """r, lora_alpha and target_modules of a saved adapter (for rebuilding it with the shape it was saved in)."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise PolicyError(f"cannot read {path}: {e}") from e
    except ValueError as e:
        raise DamagedFile(f"cannot read {path}: {e}") from e
    try:
        targets = data.get("target_modules") or []
        return {
            "rank": int(data["r"]),
            "alpha": float(data["lora_alpha"]),
            "target_modules": tuple(sorted(targets) if isinstance(targets, (list, set)) else [targets]),
            "dropout": float(data.get("lora_dropout", 0.0)),
        }
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # JSON, but not an adapter's config
        raise DamagedFile(f"{path} is not an adapter config: {type(e).__name__}: {e}") from e
