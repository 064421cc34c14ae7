"""The tiny model in the real vLLM engine, with and without PEFT LoRA adapters.

In-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine-core subprocess), one run eagerly and one
compiled (how clora's plugin runs LoRA engines on CPU, serving/cpu_lora.py: the LoRA op is opaque to the
compiler and reads the step's adapter mapping when the graph runs). float32, as the learner computes, so
the engine's logprobs can be compared with transformers' and peft's. An explicit KV-cache size skips
vLLM's CPU memory-fraction check, which looks at one NUMA node and fails on small machines.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from learner.tiny_model import build_tiny

pytestmark = pytest.mark.integration

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [
    [{"role": "user", "content": "Give me 5 digits."}],
    [{"role": "system", "content": "Reply in UPPER CASE."}, {"role": "user", "content": "Say hello."}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The session's `tiny_model` build, but at a path of its own: vLLM keys its compile cache by the model's
    path (among others), so at the session's fixed path the "compiled" engine would load a graph an earlier
    run left in ~/.cache/vllm instead of compiling one, and the compile would go untested."""
    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-0", seed=0)


def random_adapter(tiny: Path, out: Path, seed: int) -> Path:
    """A PEFT LoRA (r=8) on every projection, with random non-zero B so it changes the model. (What
    tests/serving/make_adapter.py's write_peft_adapter makes, with scale=0.1; that module is not on the
    import path of tests/learner.)"""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny),
        LoraConfig(r=8, lora_alpha=16, target_modules=TARGET_MODULES, task_type="CAUSAL_LM"),
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory) -> Path:
    return random_adapter(tiny, tmp_path_factory.mktemp("adapters") / "t1", seed=1)


@pytest.fixture(scope="module")
def adapter2(tiny, tmp_path_factory) -> Path:
    return random_adapter(tiny, tmp_path_factory.mktemp("adapters") / "t2", seed=2)


_compiled: set[str] = set()  # the tiny models whose compiled graph an engine of this module saved


@pytest.fixture(scope="module", params=["eager", "compiled", "compiled-from-cache"])
def llm(tiny, request):
    """The third engine has the second's configuration, so it loads the graph the second compiled and saved
    (vLLM's compile cache; serving/cpu_lora.py makes it loadable on CPU). Selected on its own, it builds the
    second first. In this process, not serving's: these check vLLM's own LLM with clora's CPU LoRA layers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.compilation.counter import compilation_counter

        def build(eager: bool):
            engine = LLM(
                model=str(tiny),
                dtype="float32",
                enable_lora=True,
                max_lora_rank=16,
                max_loras=2,
                max_model_len=512,
                max_num_seqs=4,
                kv_cache_memory_bytes=256 * 1024**2,
                enforce_eager=eager,
                seed=0,
            )
            if not eager:
                _compiled.add(str(tiny))
            return engine

        if request.param == "compiled-from-cache" and str(tiny) not in _compiled:
            first = build(eager=False)  # the graph it loads, saved
            del first
        loaded_before = compilation_counter.num_aot_artifacts_loaded
        engine = build(eager=request.param == "eager")
        if request.param != "eager":
            from vllm.config import CompilationMode

            config = engine.llm_engine.vllm_config.compilation_config
            assert config.mode == CompilationMode.DYNAMO_TRACE_ONCE, config.mode
        if request.param == "compiled-from-cache":
            assert compilation_counter.num_aot_artifacts_loaded == loaded_before + 1
        yield engine
        del engine


def lora_request(adapter: Path, name: str = "t1", number: int = 1):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, number, str(adapter))


def greedy(max_tokens: int = 12, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)


def test_base_model_generates_varied_tokens_when_sampling(llm):
    from vllm import SamplingParams

    outputs = llm.chat(PROMPTS, SamplingParams(temperature=1.0, max_tokens=24, seed=3))
    assert len(outputs) == len(PROMPTS)
    for output in outputs:
        ids = list(output.outputs[0].token_ids)
        assert len(ids) >= 12
        assert len(set(ids)) >= len(ids) // 2, ids
        assert output.outputs[0].text


def test_adapter_changes_the_generated_text(llm, adapter):
    base = llm.chat(PROMPTS, greedy())
    tuned = llm.chat(PROMPTS, greedy(), lora_request=lora_request(adapter))
    assert len(base) == len(tuned) == len(PROMPTS)
    for b, t in zip(base, tuned):
        assert list(b.outputs[0].token_ids) != list(t.outputs[0].token_ids)


def test_one_batch_mixes_base_and_adapter_rows(llm, adapter):
    prompt = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    alone_base = llm.generate([prompt], greedy())[0].outputs[0].token_ids
    alone_tuned = llm.generate([prompt], greedy(), lora_request=lora_request(adapter))[0].outputs[0].token_ids
    mixed = llm.generate([prompt, prompt], greedy(), lora_request=[None, lora_request(adapter)])
    assert list(mixed[0].outputs[0].token_ids) == list(alone_base)
    assert list(mixed[1].outputs[0].token_ids) == list(alone_tuned)


def test_one_batch_mixes_two_adapters_and_base_rows(llm, adapter, adapter2):
    """Each row follows its own adapter, however the batch mixes them (and in whatever slots they land)."""
    prompt = "<|im_start|>user\nName a city.<|im_end|>\n<|im_start|>assistant\n"
    requests = [lora_request(adapter), lora_request(adapter2, "t2", 2), None, lora_request(adapter2, "t2", 2)]
    params = greedy(max_tokens=10, logprobs=0)
    alone = [llm.generate([prompt], params, lora_request=r)[0].outputs[0] for r in requests[:3]]
    assert len({tuple(c.token_ids) for c in alone}) == 3  # the adapters and the base model all differ
    mixed = [o.outputs[0] for o in llm.generate([prompt] * 4, params, lora_request=requests)]
    for got, want in zip(mixed, alone + alone[1:2]):
        assert list(got.token_ids) == list(want.token_ids)
        got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
        want_lp = [step[t].logprob for step, t in zip(want.logprobs, want.token_ids)]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)


def sequence_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0].log_softmax(-1)
    start = len(prompt_ids)
    return [logprobs[start - 1 + i, tok].item() for i, tok in enumerate(completion_ids)]


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_engine_logprobs_match_transformers_and_peft(llm, tiny, adapter, with_adapter):
    """What the learner computes for a completion is what the engine sampled it with."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    request = lora_request(adapter) if with_adapter else None
    output = llm.chat(PROMPTS[:1], greedy(max_tokens=8, logprobs=0), lora_request=request)[0]
    completion = output.outputs[0]
    engine_logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]

    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    if with_adapter:
        model = PeftModel.from_pretrained(model, adapter).eval()
    reference = sequence_logprobs(model, list(output.prompt_token_ids), list(completion.token_ids))
    assert len(engine_logprobs) == len(completion.token_ids) > 0
    assert all(math.isfinite(x) for x in engine_logprobs)
    assert engine_logprobs == pytest.approx(reference, abs=1e-4)
