"""Test helper: real PEFT LoRA adapters for the tiny model, and publishing them through the registry.

The adapters are made by peft itself (so they are exactly what the learner publishes), with B drawn
non-zero so that an adapter visibly changes the model's output (a fresh LoRA has B = 0, a no-op).
"""

from __future__ import annotations

import functools
from pathlib import Path

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@functools.lru_cache(maxsize=2)
def _base(base_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")


def write_peft_adapter(
    base_dir: Path, out_dir: Path, *, seed: int, rank: int = 8, scale: float = 0.5,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
) -> Path:
    """Saves a LoRA adapter for the model in `base_dir` to `out_dir` (adapter_config.json + safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _base(str(base_dir)), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets))
    )
    try:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(str(out_dir))
    finally:
        model.unload()  # gives the shared base model back unwrapped
    return Path(out_dir)


def publish_adapter(data_dir: Path, tenant: str, base_dir: Path, *, seed: int, **kwargs) -> int:
    """Creates and publishes a new version of `tenant`'s adapter; returns its number."""
    from storage.registry import Registry

    registry = Registry(data_dir)
    latest = registry.latest_published(tenant)
    version = registry.create(
        tenant,
        parent=latest.name if latest else None,
        write=lambda d: write_peft_adapter(base_dir, d, seed=seed, **kwargs),
    )
    registry.publish(tenant, version.number)
    return version.number
