"""Builds clora's own base models: the tiny local model, and random-weight models of real shapes.

No model can be downloaded where clora runs its tests and demo, so clora makes one. `build_tiny` writes a
Qwen3-architecture model of a few million parameters in the Hugging Face layout (config.json,
generation_config.json, model.safetensors, tokenizer files), which transformers, peft and vLLM all load
as they would load Qwen3. Its tokenizer is a byte-level BPE trained with `tokenizers` on the generated
text of `learner/corpus.py` (so any UTF-8 text round-trips), with Qwen's pre-tokenizer (digits split one
by one) and special tokens, and a ChatML chat template. Its weights are random.

`build_random` writes a random-weight model with the shape of a real one (Qwen3-4B, Qwen3-0.6B) for GPU
benchmarks, where only the shape matters. It never holds the model in memory: tensors are drawn one at a
time and written in safetensors shards of about 2 GB.

Determinism: every tensor is drawn from its own generator, seeded from the model seed and the tensor's
name, so the same seed gives byte-identical weight files whatever the order of writing, and the
tokenizer (trained on a fixed corpus, independent of the model seed) is identical too. Weight files do
not depend on the transformers version; config.json carries that version, as transformers writes it.

Crash safety: a model is built in a temporary sibling directory and renamed into place; the marker file
`clora-model.json` (what was built, and every file with its size) is written last, so a directory with a
valid marker is complete. `ensure_tiny` reuses such a directory.

Deliberately not here: training (learner/), serving (serving/), where models live (the caller passes
directories; `clora model` derives the default from the config).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from learner.corpus import corpus_texts

MARKER_FILE = "clora-model.json"
MARKER_FORMAT = 1

# Special tokens, in id order: Qwen's names, so ChatML templates written for Qwen fit.
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
PAD_ID, IM_START_ID, EOS_ID = 0, 1, 2

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, spaces.
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

# ChatML; the generation prompt opens the assistant's turn. With tools, Qwen's Hermes format, short of Qwen's
# instructions (the model is random, and its test contexts small): a system turn lists them (after the
# conversation's own system message), an assistant's calls are <tool_call> blocks, and a run of tool results
# is one user turn of <tool_response> blocks. Without tools, plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (args if args is string else args | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DTYPES = ("float32", "bfloat16", "float16")

# Weight std of the tiny model. The embeddings are tied, so a logit is at most sqrt(hidden) x the norm of an
# embedding row: at the usual 0.02 that caps logits near 5, and a LoRA cannot make any token likely
# (REINFORCE on "fraction of digits" stayed near 0.003 for 12 steps at lr 1e-3, 1e-2 and 3e-2). At 0.1 the next-token
# entropy is ~6.5 nats of 7.6, greedy decoding does not repeat one token, and the same REINFORCE (LoRA r=8,
# 16 samples of 16 tokens, lr 1e-2) reaches 1.0 in 8 steps.
TINY_INIT_STD = 0.1
DEFAULT_SHARD_BYTES = 2 * 1024**3


class ModelBuildError(RuntimeError):
    """A model could not be built where asked (the message names the directory and the cause)."""


# ---------------------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class Shape:
    """The Qwen3 hyper-parameters that decide a model's tensors."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True


TINY_SHAPE = Shape(
    vocab_size=2048,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    max_position_embeddings=2048,
)

# Real architectures for `build_random`; "tiny-test" exists so the sharded writer can be tested quickly
# (its vocabulary is larger than the tokenizer's, as Qwen's is).
RANDOM_SHAPES: dict[str, Shape] = {
    "qwen3-4b": Shape(
        vocab_size=151936,
        hidden_size=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=9728,
        max_position_embeddings=40960,
    ),
    "qwen3-0.6b": Shape(
        vocab_size=151936,
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40960,
    ),
    "tiny-test": Shape(
        vocab_size=4096,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=1024,
    ),
}


def qwen3_config(shape: Shape, dtype: str):
    """The transformers config of `shape`, with the tiny tokenizer's special-token ids."""
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        dtype=dtype,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        max_window_layers=shape.num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def tensor_specs(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor stored in the checkpoint, sorted by name.

    Taken from a Qwen3ForCausalLM built on the meta device (no memory), so the names are exactly the ones
    transformers and vLLM expect. A tied lm_head is not stored, as transformers does not store it.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    specs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        specs.pop("lm_head.weight", None)
    return sorted(specs.items())


def parameter_count(specs: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    total = 0
    for _, shape in specs:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


# ---------------------------------------------------------------------------------------------------------
# Random weights


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: a hash of the model seed and the tensor name (63 bits)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def random_tensor(name: str, shape: Sequence[int], *, seed: int, std: float, dtype: str):
    """Norm weights are ones (as a trained model starts); every other tensor is N(0, std^2)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if name.endswith("norm.weight"):
        return torch.ones(tuple(shape), dtype=torch_dtype)
    generator = torch.Generator().manual_seed(tensor_seed(seed, name))
    values = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
    return values.mul_(std).to(torch_dtype)


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Groups tensors, in the given order, into shards of at most `max_bytes` (a larger tensor alone)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes:
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def write_random_weights(
    config,
    out_dir: Path,
    *,
    seed: int,
    dtype: str,
    std: float,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = False,
) -> int:
    """Writes the safetensors file(s) (and the index when sharded); returns the parameter count.

    Only one shard's tensors are in memory at a time. `progress`: says on stderr how far it is (a real
    shape's gigabytes take minutes).
    """
    import torch
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    specs = tensor_specs(config)
    shapes = dict(specs)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    sizes = [(name, parameter_count([(name, shape)]) * itemsize) for name, shape in specs]
    shards = plan_shards(sizes, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    report = _Progress(parameter_count(specs), sum(s for _, s in sizes), len(files)) if progress else None
    size_of = dict(sizes)
    for k, (file, names) in enumerate(zip(files, shards), 1):
        tensors = {}
        for n in names:
            tensors[n] = random_tensor(n, shapes[n], seed=seed, std=std, dtype=dtype)
            if report is not None:
                report.tensor(size_of[n])
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        del tensors
        if report is not None:
            report.shard(k, file)
    if report is not None:
        report.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s for _, s in sizes)}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return parameter_count(specs)


class _Progress:
    """How far `write_random_weights` is, on stderr: a bar of the bytes made on a terminal, a line per file
    written elsewhere (a log, where a bar is only its cursor moves)."""

    def __init__(self, parameters: int, total_bytes: int, files: int) -> None:
        self.total, self.files, self.done = total_bytes, files, 0
        print(f"writing {parameters:,} random parameters ({total_bytes / 2**30:.1f} GiB in {files} file(s))",
              file=sys.stderr, flush=True)
        self.bar = None
        if sys.stderr.isatty():  # decided here, not by TQDM_DISABLE (clora sets it for logs: they get the lines)
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="weights",
                            file=sys.stderr, leave=False, disable=False)

    def tensor(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)

    def shard(self, k: int, file: str) -> None:
        if self.bar is None:
            print(f"wrote {file} ({k} of {self.files}; {self.done / 2**30:.1f} of {self.total / 2**30:.1f} GiB)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(vocab_size: int = TINY_SHAPE.vocab_size, corpus: Iterable[str] | None = None):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the clora corpus (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the 256 bytes and {len(SPECIAL_TOKENS)} special tokens")
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts() if corpus is None else corpus, trainer=trainer)
    for token, expected in zip(SPECIAL_TOKENS, (PAD_ID, IM_START_ID, EOS_ID)):
        if tokenizer.token_to_id(token) != expected:
            raise ModelBuildError(f"special token {token!r} got id {tokenizer.token_to_id(token)}, expected {expected}")
    return tokenizer


def pad_vocabulary(tokenizer, size: int):
    """The tokenizer with filler tokens `<|unused_N|>` appended so that it has exactly `size` ids.

    A model can sample any id below its vocab_size; an id the tokenizer lacks breaks detokenizing, so
    every id gets a token. Fillers have no merges: text never encodes to them, and one decodes to its name.
    Needed for real shapes (a vocabulary of 151936 ids over ~2k trained tokens).
    """
    from tokenizers import Tokenizer

    have = tokenizer.get_vocab_size()
    if have >= size:
        return tokenizer
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for i in range(have, size):
        vocab[f"<|unused_{i}|>"] = i
    return Tokenizer.from_str(json.dumps(data))


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json: readable by transformers 4.x and 5.x alike (chat template inline)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": [IM_START, EOS_TOKEN],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir: Path, tokenizer, model_max_length: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(model_max_length))
    _write_json(
        out_dir / "special_tokens_map.json",
        {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START, EOS_TOKEN]},
    )


# ---------------------------------------------------------------------------------------------------------
# Building


def build_tiny(
    out_dir: str | Path,
    *,
    seed: int = 0,
    shape: Shape = TINY_SHAPE,
    init_std: float = TINY_INIT_STD,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Builds the tiny local model into `out_dir` and returns it (see the module note)."""
    return _build(
        Path(out_dir),
        shape,
        train_tokenizer(shape.vocab_size),
        seed=seed,
        std=init_std,
        dtype=dtype,
        max_shard_bytes=DEFAULT_SHARD_BYTES,
        marker={"kind": "tiny", "seed": seed, "init_std": init_std},
        overwrite=overwrite,
    )


def build_random(
    shape: str,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    init_std: float = 0.02,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Builds a random-weight model of a named shape (`RANDOM_SHAPES`) with the tiny tokenizer; `progress`:
    says on stderr how far the weights are."""
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; expected one of {', '.join(RANDOM_SHAPES)}")
    return _build(
        Path(out_dir),
        RANDOM_SHAPES[shape],
        train_tokenizer(),
        seed=seed,
        std=init_std,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        marker={"kind": "random", "shape": shape, "seed": seed, "init_std": init_std},
        overwrite=overwrite,
        progress=progress,
    )


def ensure_tiny(models_dir: str | Path, seed: int = 0, *, adapters_on_it: Callable[[], bool] = lambda: False) -> Path:
    """`<models_dir>/tiny-<seed>`, built unless a complete build of the current recipe is already there
    (a cache left by an older recipe, e.g. another init std, is rebuilt rather than silently reused).
    `adapters_on_it()` (asked only before a rebuild): adapters were trained on the model there, so a finished build of another recipe or
    format is not replaced (ModelBuildError): the adapters would go on, unawares, on other weights."""
    out = Path(models_dir) / f"tiny-{seed}"
    if is_complete(out) and _same_recipe(read_marker(out), seed):
        return out
    marker = read_marker(out)
    if marker is not None and adapters_on_it():  # a finished build (its marker is written last) of another kind
        raise ModelBuildError(
            f"the base model {out} was built by another clora (build {_recipe(marker)}, this one builds "
            f"{_recipe({'format': MARKER_FORMAT, 'kind': 'tiny', 'seed': seed, 'init_std': TINY_INIT_STD})}), and "
            "the registry holds adapters trained on it: rebuilding it would leave them on other weights. Set "
            f"model.path = \"{out}\" to go on with it, or move the data dir's registry and state aside to start "
            "over on a new build")
    try:
        return build_tiny(out, seed=seed, overwrite=out.exists())  # replaces an incomplete or outdated build
    except ModelBuildError:
        if is_complete(out) and _same_recipe(read_marker(out), seed):  # another process finished it first
            return out
        raise


def _recipe(marker: dict) -> str:
    return ", ".join(f"{k} {marker.get(k)}" for k in ("format", "kind", "seed", "init_std"))


def _same_recipe(marker: dict | None, seed: int) -> bool:
    return bool(marker) and marker.get("kind") == "tiny" and marker.get("seed") == seed and \
        marker.get("init_std") == TINY_INIT_STD


def read_marker(model_dir: str | Path) -> dict | None:
    """The build marker of `model_dir`, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a finished build: a marker, and every file it lists at its size."""
    marker = read_marker(model_dir)
    if not marker or marker.get("format") != MARKER_FORMAT or not isinstance(marker.get("files"), dict):
        return False
    for name, size in marker["files"].items():
        try:
            if (Path(model_dir) / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _build(
    out: Path,
    shape: Shape,
    tokenizer,
    *,
    seed: int,
    std: float,
    dtype: str,
    max_shard_bytes: int,
    marker: dict,
    overwrite: bool,
    progress: bool = False,
) -> Path:
    """Builds under a hidden temporary name beside `out`, then moves it into place. An OSError while it
    writes is a ModelBuildError naming `out`, never the temporary name."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if tokenizer.get_vocab_size() > shape.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size {shape.vocab_size}")
    tokenizer = pad_vocabulary(tokenizer, shape.vocab_size)
    if out.exists() and not out.is_dir():
        raise ModelBuildError(f"{out} is a file, not a directory: choose another --out")
    if out.exists() and not replaceable_by_build(out):  # before the next check, whose hint is --force
        raise ModelBuildError(f"{out} is not a model clora built (no {MARKER_FILE} in it); not replacing it: "
                              f"remove it yourself or choose another --out")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    except FileExistsError as e:  # a file where a directory above `out` should be
        raise ModelBuildError(f"cannot write {out}: {e.filename} is not a directory") from e
    except OSError as e:
        raise ModelBuildError(f"cannot write {out}: {e.strerror or e}") from e
    try:
        config = qwen3_config(shape, dtype)
        # Full config, plus the top-level rope_theta that transformers 4.x reads (5.x reads rope_parameters).
        config_json = json.loads(config.to_json_string(use_diff=False))
        _write_json(tmp / "config.json", {**config_json, "rope_theta": shape.rope_theta})
        # No sampling defaults: vLLM would apply them to every request that sets none.
        _write_json(
            tmp / "generation_config.json",
            {"bos_token_id": PAD_ID, "eos_token_id": [EOS_ID, PAD_ID], "pad_token_id": PAD_ID},
        )
        parameters = write_random_weights(
            config, tmp, seed=seed, dtype=dtype, std=std, max_shard_bytes=max_shard_bytes, progress=progress
        )
        write_tokenizer(tmp, tokenizer, shape.max_position_embeddings)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes its files private
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        _write_json(
            tmp / MARKER_FILE,
            {"format": MARKER_FORMAT, **marker, "dtype": dtype, "parameters": parameters, "files": files},
        )
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        _replace_dir(tmp, out, overwrite=overwrite)
    except OSError as e:  # a full disk, a file system gone read-only: said of `out`, not of the temporary name
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelBuildError(f"cannot write {out}: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def replaceable_by_build(path: Path) -> bool:
    """Whether a build may replace `path`: an earlier build (it has the marker) or an empty directory; never
    a file or a directory of someone else's (`--out . --force` would have removed the working directory)."""
    if path.is_symlink() or not path.is_dir():
        return False
    return read_marker(path) is not None or not any(path.iterdir())


def _replace_dir(src: Path, dst: Path, *, overwrite: bool) -> None:
    """Moves `src` to `dst`. With `overwrite`, an existing `dst` is moved aside first, restored if the move
    fails, else removed; without, the move fails if `dst` appeared meanwhile (another builder won)."""
    aside = None
    if overwrite and dst.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent)) / dst.name
        os.rename(dst, aside)
    try:
        os.rename(src, dst)
    except OSError as e:
        if aside is not None and not dst.exists():
            os.rename(aside, dst)
        raise ModelBuildError(f"could not move the finished build {src} to {dst}: {e}") from e
    finally:
        if aside is not None and aside.exists():
            shutil.rmtree(aside.parent, ignore_errors=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
