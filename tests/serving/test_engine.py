"""Pieces of the engine wrapper that need no running engine: the zero adapter and the logprob conversion."""

from dataclasses import dataclass

import pytest
from safetensors.torch import load_file

from serving.adapter_check import base_linear_shapes, validate_adapter
from serving.engine import _token_logprobs, write_zero_adapter

pytestmark = pytest.mark.unit


def test_zero_adapter_is_a_valid_all_zero_lora_over_every_projection(tmp_path, tiny_model):
    shapes = base_linear_shapes(tiny_model)
    out = write_zero_adapter(tmp_path / "zero", shapes)
    info = validate_adapter(out, max_rank=1, base_shapes=shapes)
    assert info.rank == 1 and info.modules == 4 * 7
    tensors = load_file(out / "adapter_model.safetensors")
    assert all(float(t.abs().sum()) == 0.0 for t in tensors.values())


@dataclass
class Logprob:  # the attributes of vllm.logprobs.Logprob that the conversion reads
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def test_sampled_token_logprob_and_top_alternatives():
    positions = [
        {7: Logprob(-0.1, 1, "a"), 8: Logprob(-2.0, 2, "b"), 9: Logprob(-3.0, 3, "c")},
        {5: Logprob(-4.0, 9, "x"), 1: Logprob(-0.5, 1, "y"), 2: Logprob(-1.0, 2, "z")},  # sampled token outside top-2
    ]
    out = _token_logprobs([7, 5], positions, 2, token_text=lambda t: f"<{t}>")
    assert [(t.token_id, t.token, t.logprob) for t in out] == [(7, "a", -0.1), (5, "x", -4.0)]
    assert out[0].top == ((7, "a", -0.1), (8, "b", -2.0))
    assert out[1].top == ((1, "y", -0.5), (2, "z", -1.0))
    only_sampled = _token_logprobs([3], [{3: Logprob(-1.5)}], 0, token_text=lambda t: f"<{t}>")
    assert only_sampled[0].token == "<3>" and only_sampled[0].top == ()
