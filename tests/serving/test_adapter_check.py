"""Adapter validation against the tiny base model: a good adapter passes, a bad one lists every problem."""

import errno
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from serving.adapter_check import AdapterRejected, base_linear_shapes, validate_adapter

pytestmark = pytest.mark.unit

MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")


@pytest.fixture(scope="module")
def shapes(tiny_model):
    return base_linear_shapes(tiny_model)


def write_adapter(directory, shapes, *, rank=4, config=None, tensors=None):
    """A PEFT-layout adapter over MODULES; `config`/`tensors` override or add entries."""
    directory.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], "bias": "none"}
    base.update(config or {})
    (directory / "adapter_config.json").write_text(json.dumps(base))
    weights = {}
    for module in MODULES:
        out_f, in_f = shapes[module]
        weights[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_f)
        weights[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, rank)
    weights.update(tensors or {})
    save_file({k: v for k, v in weights.items() if v is not None}, str(directory / "adapter_model.safetensors"))
    return directory


def test_base_shapes_are_the_linear_layers(shapes):
    out_f, in_f = shapes["model.layers.0.self_attn.q_proj"]
    assert in_f == 256 and out_f == 4 * 64
    assert not any("norm" in name for name in shapes)


def test_good_adapter_passes(tmp_path, shapes):
    info = validate_adapter(write_adapter(tmp_path / "a", shapes), max_rank=8, base_shapes=shapes)
    assert (info.rank, info.alpha, info.modules) == (4, 8.0, 2)
    assert info.target_modules == ("q_proj", "down_proj")


def test_peft_written_adapter_passes(tmp_path, tiny_model, shapes):
    from make_adapter import write_peft_adapter

    out = write_peft_adapter(tiny_model, tmp_path / "peft", seed=1, rank=8)
    info = validate_adapter(out, max_rank=16, base_shapes=shapes)
    assert info.rank == 8 and info.modules == 4 * 7  # every projection of every layer


def test_every_problem_is_reported_at_once(tmp_path, shapes):
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    nan_b = torch.randn(shapes[MODULES[0]][0], 32)
    nan_b[0, 0] = float("nan")
    bad = write_adapter(
        tmp_path / "bad", shapes, rank=32,
        config={"target_modules": ["q_proj", "wq"], "use_dora": True, "lora_alpha": -1},
        tensors={f"{q}.lora_A.weight": torch.randn(32, 256), f"{q}.lora_B.weight": nan_b,
                 "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight": None,
                 "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 256),
                 "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(256, 4)},
    )
    # down_proj: rank 32 A without B
    with pytest.raises(AdapterRejected) as e:
        validate_adapter(bad, max_rank=16, base_shapes=shapes)
    text = "\n".join(e.value.problems)
    assert "rank 32 exceeds the engine's max_lora_rank 16" in text
    assert "['wq'] are not linear layers" in text
    assert "DoRA" in text and "lora_alpha must be a finite positive number" in text
    assert "has 1 non-finite values" in text
    assert "model.layers.1.mlp.down_proj' has no lora_B" in text
    assert "model.layers.9.self_attn.q_proj' is not a linear layer of the base model" in text
    assert len(e.value.problems) >= 7
    assert str(bad) in str(e.value)


@pytest.mark.parametrize("config, problem", [
    ({"lora_alpha": float("inf")}, "lora_alpha must be a finite positive number, got inf"),
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite positive number, got nan"),
    ({"alpha_pattern": {"q_proj": float("inf")}}, "alpha_pattern['q_proj'] = inf is not a finite positive number"),
    ({"alpha_pattern": {"q_proj": 0}}, "alpha_pattern['q_proj'] = 0 is not a finite positive number"),
    ({"rank_pattern": {"q_proj": True}}, "rank_pattern['q_proj'] = True is not a rank in 1..16"),
    ({"alpha_pattern": [8]}, "alpha_pattern must be a JSON object (module pattern -> value), got list"),
    ({"rank_pattern": "q"}, "rank_pattern must be a JSON object (module pattern -> value), got str"),
])
def test_scales_that_are_not_finite_positive_numbers_are_refused(tmp_path, shapes, config, problem):
    """JSON as Python writes and reads it carries Infinity and NaN; the engine scales B·A by alpha / r."""
    adapter = write_adapter(tmp_path / "a", shapes, config=config)
    with pytest.raises(AdapterRejected) as e:
        validate_adapter(adapter, max_rank=16, base_shapes=shapes)
    assert problem in e.value.problems


def test_shape_mismatch_means_another_base(tmp_path, shapes):
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    bad = write_adapter(tmp_path / "other", shapes, tensors={f"{q}.lora_A.weight": torch.randn(4, 128)})
    with pytest.raises(AdapterRejected, match=r"do not fit the base layer \[out=256, in=256\]"):
        validate_adapter(bad, max_rank=16, base_shapes=shapes)


def test_missing_or_unreadable_files(tmp_path, shapes):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterRejected) as e:
        validate_adapter(empty, max_rank=16, base_shapes=shapes)
    assert e.value.problems == ["adapter_config.json is missing", "adapter_model.safetensors is missing"]
    # tenants read the reason (a 404's message): the path, serving's copy (host, pid, data directory), is the log's
    assert e.value.reason == "(1) adapter_config.json is missing; (2) adapter_model.safetensors is missing"
    assert str(empty) in str(e.value)

    broken = write_adapter(tmp_path / "broken", shapes)
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(AdapterRejected) as e:
        validate_adapter(broken, max_rank=16, base_shapes=shapes)
    assert len(e.value.problems) == 2
    assert "does not parse" in e.value.problems[0] and "cannot be read" in e.value.problems[1]


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.EACCES, errno.EMFILE])
def test_an_error_opening_the_weights_is_raised_not_a_refusal(tmp_path, shapes, monkeypatch, code):
    """A flaky disk, NFS or a process out of file descriptors says nothing about the adapter: the caller must
    be able to try again, so the error is raised as the OSError it is, not turned into a refusal (which
    serving keeps for good). The weights file is opened in Python first, where the real errno shows."""
    adapter = write_adapter(tmp_path / "a", shapes)
    weights = str(adapter / "adapter_model.safetensors")
    real_open = os.open

    def fake_os_open_failing_for_the_weights(path, flags, *args, **kwargs):
        if str(path) == weights:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_os_open_failing_for_the_weights)
    with pytest.raises(OSError) as e:
        validate_adapter(adapter, max_rank=16, base_shapes=shapes)
    assert e.value.errno == code and not isinstance(e.value, AdapterRejected)


def test_safetensors_no_such_file_for_a_file_that_is_there_is_raised_not_a_refusal(tmp_path, shapes, monkeypatch):
    """safetensors reports every failure to open its file (EACCES, EMFILE, seen with 0.8) as FileNotFoundError
    "No such file or directory": taken at its word, a good adapter was refused for good as missing."""
    import safetensors

    adapter = write_adapter(tmp_path / "a", shapes)

    def fake_safe_open_as_safetensors_fails_to_open(filename, framework):
        raise FileNotFoundError("No such file or directory (os error 2)")

    monkeypatch.setattr(safetensors, "safe_open", fake_safe_open_as_safetensors_fails_to_open)
    with pytest.raises(OSError, match="is there but could not be opened now") as e:
        validate_adapter(adapter, max_rank=16, base_shapes=shapes)
    assert not isinstance(e.value, AdapterRejected)


def test_weights_that_are_no_file_are_refused(tmp_path, shapes):
    adapter = write_adapter(tmp_path / "a", shapes)
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").mkdir()
    with pytest.raises(AdapterRejected) as e:
        validate_adapter(adapter, max_rank=16, base_shapes=shapes)
    assert e.value.problems == ["adapter_model.safetensors is not a file"]
