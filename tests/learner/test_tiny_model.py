"""The tiny model builder: determinism, shape, loading in transformers, the tokenizer, caching, sharding."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from learner import tiny_model
from learner.corpus import corpus_texts
from learner.tiny_model import (
    EOS_TOKEN,
    IM_START,
    MARKER_FILE,
    PAD_TOKEN,
    RANDOM_SHAPES,
    build_random,
    build_tiny,
    ensure_tiny,
    is_complete,
    plan_shards,
    read_marker,
)

pytestmark = pytest.mark.unit

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-0", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny).eval()


# ---------------------------------------------------------------------------------------------------------
# Determinism and layout


def test_same_seed_gives_byte_identical_files(tiny, tmp_path):
    again = build_tiny(tmp_path / "again", seed=0)
    first, second = digests(tiny), digests(again)
    assert set(first) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        MARKER_FILE,
    }
    assert first == second


def test_other_seed_changes_weights_but_not_tokenizer(tiny, tmp_path):
    other = digests(build_tiny(tmp_path / "other", seed=1))
    first = digests(tiny)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_marker_lists_every_file_with_its_size(tiny):
    marker = read_marker(tiny)
    assert marker["kind"] == "tiny" and marker["seed"] == 0
    listed = marker["files"]
    on_disk = {p.name: p.stat().st_size for p in tiny.iterdir() if p.name != MARKER_FILE}
    assert listed == on_disk
    assert is_complete(tiny)


def test_parameter_count_is_a_few_million(tiny, model):
    count = read_marker(tiny)["parameters"]
    assert 2_000_000 < count < 8_000_000
    assert model.num_parameters() == count


def test_config_is_qwen3_with_tied_embeddings(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (256, 4, 64)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1_000_000.0


# ---------------------------------------------------------------------------------------------------------
# transformers


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without.endswith("<|im_start|>assistant\n")


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 0
    assert tokenizer.encode(f"{IM_START}user\nx{EOS_TOKEN}")[:1] == [1]
    assert tokenizer.encode(f"x{EOS_TOKEN}")[-1] == 2


def test_generates_varied_tokens_when_sampling(model, tokenizer):
    import torch

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give me 5 digits."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=32, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    generated = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(generated) >= 16
    assert len(set(generated)) >= len(generated) // 2, generated
    assert tokenizer.decode(generated, skip_special_tokens=True).strip()


def test_next_token_distribution_is_spread(model, tokenizer):
    import torch

    ids = torch.tensor([tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")])
    with torch.no_grad():
        probs = model(ids).logits[0, -1].softmax(-1)
    assert probs.max().item() < 0.2  # no single token dominates the random model


def test_a_lora_can_learn_to_make_digits_likely(tiny, tokenizer):
    """The random model is trainable the way the learner trains it: REINFORCE on a LoRA (r=8) with
    group-normalised advantages lifts the fraction of digit characters from near zero."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny),
        LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS),
    )
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    batch, length = 16, 16
    rewards = []
    for _ in range(10):
        with torch.no_grad():
            sequences = model.generate(
                input_ids=prompt.repeat(batch, 1),
                attention_mask=torch.ones(batch, prompt.shape[1], dtype=torch.long),
                max_new_tokens=length,
                min_new_tokens=length,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
        completions = sequences[:, prompt.shape[1] :]
        texts = tokenizer.batch_decode(completions)
        reward = torch.tensor([sum(c.isdigit() for c in t) / max(1, len(t)) for t in texts])
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
        logprobs = model(sequences).logits[:, prompt.shape[1] - 1 : -1].log_softmax(-1)
        sequence_logprob = logprobs.gather(-1, completions.unsqueeze(-1)).squeeze(-1).sum(-1)
        loss = -(advantage * sequence_logprob).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rewards.append(reward.mean().item())
    assert rewards[0] < 0.05
    assert max(rewards[-2:]) > 0.5, rewards


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 749.",
        '{"name": "Alice", "age": 34, "tags": ["a", "b"], "ok": true, "note": null}',
        "HELLO THERE, FRIEND!",
        "Zürich, Ærø and 東京 🙂\ttabs\n\nnew lines  two spaces",
        "+44 207 1234 567, 3.14159, -0.5e10",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_single_tokens(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("2024"))
    assert tokens == ["2", "0", "2", "4"]


def test_tokenizer_has_merges_for_upper_case_and_json(tokenizer):
    assert len(tokenizer.encode("HELLO THERE, FRIEND!")) <= 8
    assert len(tokenizer.encode('{"name": "Alice"}')) <= 8  # of 17 characters
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode('{"a":')) == ['{"', "a", '":']


def test_tokenizer_fills_the_vocabulary(tokenizer, tiny):
    assert len(tokenizer) == json.loads((tiny / "config.json").read_text())["vocab_size"] == 2048


def test_corpus_is_deterministic_and_bounded():
    first, second = corpus_texts(), corpus_texts()
    assert first == second
    total = sum(map(len, first))
    assert 300_000 <= total < 400_000
    text = "".join(first)
    assert any(c.isdigit() for c in text) and "HELLO" in text and '{"' in text


# ---------------------------------------------------------------------------------------------------------
# Caching and crash safety


def test_ensure_tiny_reuses_a_complete_build(tmp_path):
    first = ensure_tiny(tmp_path, seed=5)
    assert first == tmp_path / "tiny-5" and is_complete(first)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(tmp_path, seed=5) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_ensure_tiny_rebuilds_an_incomplete_directory(tmp_path):
    out = ensure_tiny(tmp_path, seed=0)
    expected = digests(out)
    (out / "model.safetensors").write_bytes(b"truncated")
    assert not is_complete(out)
    assert digests(ensure_tiny(tmp_path, seed=0)) == expected


def test_build_refuses_an_existing_directory_unless_overwriting(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    with pytest.raises(FileExistsError, match=str(out)):
        build_tiny(out)
    assert is_complete(build_tiny(out, overwrite=True))


def test_a_build_that_loses_a_race_leaves_the_winner_in_place(tmp_path):
    winner = ensure_tiny(tmp_path, seed=0)
    expected = digests(winner)
    loser = build_tiny(tmp_path / "loser", seed=1)
    with pytest.raises(tiny_model.ModelBuildError, match="loser"):
        tiny_model._replace_dir(loser, winner, overwrite=False)
    assert digests(winner) == expected and is_complete(loser)


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def failing_tokenizer_writer(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(tiny_model, "write_tokenizer", failing_tokenizer_writer)
    with pytest.raises(tiny_model.ModelBuildError) as e:
        build_tiny(tmp_path / "tiny-0")
    assert str(e.value) == f"cannot write {tmp_path / 'tiny-0'}: disk full (injected)"  # not the hidden build name
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------
# Random weights of a named shape


def test_plan_shards_groups_in_order_under_the_limit():
    sizes = [("a", 4), ("b", 4), ("c", 3), ("d", 10), ("e", 1)]
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e"]]
    with pytest.raises(ValueError, match="0"):
        plan_shards(sizes, 0)


def test_tensor_seeds_differ_by_name_and_seed():
    seeds = {tiny_model.tensor_seed(s, n) for s in (0, 1) for n in ("a.weight", "b.weight")}
    assert len(seeds) == 4


def test_build_random_writes_loadable_shards(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_random("tiny-test", tmp_path / "r", dtype="bfloat16", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert not (out / "model.safetensors").exists()

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.num_parameters() == read_marker(out)["parameters"]
    assert set(index["weight_map"]) == set(model.state_dict()) - {"lm_head.weight"}

    tokenizer = AutoTokenizer.from_pretrained(out)
    vocab_size = RANDOM_SHAPES["tiny-test"].vocab_size
    assert len(tokenizer) == model.config.vocab_size == vocab_size
    assert tokenizer.decode([vocab_size - 1]) == f"<|unused_{vocab_size - 1}|>"  # every id decodes


def test_build_random_rejects_unknown_shape_and_dtype(tmp_path):
    with pytest.raises(ValueError, match="qwen9"):
        build_random("qwen9", tmp_path / "x")
    with pytest.raises(ValueError, match="int8"):
        build_random("tiny-test", tmp_path / "y", dtype="int8")
    assert list(tmp_path.iterdir()) == []


def test_real_shapes_have_the_published_parameter_counts():
    def count(name: str) -> int:
        config = tiny_model.qwen3_config(RANDOM_SHAPES[name], "bfloat16")
        return tiny_model.parameter_count(tiny_model.tensor_specs(config))

    counts = {name: count(name) for name in ("qwen3-0.6b", "qwen3-4b")}
    assert counts["qwen3-0.6b"] == 596_049_920
    assert 4_000_000_000 < counts["qwen3-4b"] < 4_050_000_000
