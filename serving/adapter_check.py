"""Is this directory a LoRA adapter the engine can serve on this base model? Every problem, in one error.

The serving tier loads adapters it did not make: the learner publishes them, and an operator may drop one
in by hand. A bad one must be refused before it reaches the engine, where it would fail inside the engine
process or, worse, load and produce garbage. Like vLLM's `PEFTHelper.validate_legal`, the check gathers
every problem it finds and raises them together, so one refusal tells the whole story:

- `adapter_config.json` exists, parses, and describes a plain LoRA (peft_type LORA, no DoRA, no bias, no
  modules_to_save) with a positive rank no larger than the engine's `max_lora_rank`;
- its `target_modules` name linear layers that the base model has;
- `adapter_model.safetensors` exists and holds lora_A/lora_B pairs for modules of the base model, with
  shapes that fit those modules and the rank, and every value finite.

An I/O error while opening or reading either file (EIO, ESTALE, EACCES, EMFILE: anything but the file
missing) says nothing about the adapter: it is raised as an `OSError`, never turned into a refusal, so the
caller tries again later (serving/adapters.py backs off) instead of refusing a good adapter for good. The
weights file is opened in Python before safetensors opens it, as safetensors reports every failure to open
it as "No such file or directory"; its "no such file" for a file that is there is raised so too.

What this module does not do: load anything into the engine or decide which version is current
(serving/adapters.py does).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT writes tensor names as base_model.model.<module path>.lora_A.weight (optionally with an adapter name).
_PEFT_PREFIX = "base_model.model."
_LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")


class AdapterRejected(ValueError):
    """The adapter at `path` cannot be served; `problems` lists every reason. `reason` is what a tenant may
    read: the problems without the path, which names serving's copy (its host, pid and data directory)."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        self.reason = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        super().__init__(f"adapter {path} refused: {self.reason}")


@dataclass(frozen=True)
class AdapterInfo:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    modules: int  # modules that carry a lora_A/lora_B pair


def base_linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Module path -> (out, in) for every 2-D `.weight` of the base model, read from safetensors headers only."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in base model directory {model_dir}")
    shapes: dict[str, tuple[int, int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(".weight"):
                    continue
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2:
                    shapes[name.removesuffix(".weight")] = (int(shape[0]), int(shape[1]))
    return shapes


def validate_adapter(path: Path, *, max_rank: int, base_shapes: dict[str, tuple[int, int]]) -> AdapterInfo:
    """Checks the adapter directory against the engine's rank limit and the base model; `AdapterRejected` if bad."""
    path = Path(path)
    problems: list[str] = []
    config = _read_config(path, problems)
    rank, alpha, targets = 0, 0.0, ()
    if config is not None:
        try:
            rank, alpha, targets = _check_config(config, max_rank, base_shapes, problems)
        except (TypeError, AttributeError, KeyError, ValueError) as e:  # a shape no check above foresaw: the file's
            problems.append(f"{CONFIG_FILE} has a value of an unexpected type ({type(e).__name__}: {e})")
    modules = _check_weights(path, max_rank, base_shapes, problems)
    if problems:
        raise AdapterRejected(path, problems)
    return AdapterInfo(rank=rank, alpha=alpha, target_modules=targets, modules=modules)


# ---------------------------------------------------------------------------------------------------------
# adapter_config.json


def _read_config(path: Path, problems: list[str]) -> dict | None:
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(f"{CONFIG_FILE} is missing")
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problems.append(f"{CONFIG_FILE} does not parse: {e}")
        return None
    if not isinstance(config, dict):
        problems.append(f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}")
        return None
    return config


def _check_config(
    config: dict, max_rank: int, base_shapes: dict[str, tuple[int, int]], problems: list[str]
) -> tuple[int, float, tuple[str, ...]]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        problems.append(f"peft_type is {peft_type!r}; only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        problems.append(f"r must be a positive integer, got {rank!r}")
        rank = 0
    elif rank > max_rank:
        problems.append(f"rank {rank} exceeds the engine's max_lora_rank {max_rank}")
    for key, value in _pattern(config, "rank_pattern", problems).items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value > max_rank:
            problems.append(f"rank_pattern[{key!r}] = {value!r} is not a rank in 1..{max_rank}")
    alpha = config.get("lora_alpha")
    if not _positive_finite(alpha):  # the engine scales B·A by alpha / r: Infinity (valid JSON here) breaks every output
        problems.append(f"lora_alpha must be a finite positive number, got {alpha!r}")
        alpha = 0.0
    for key, value in _pattern(config, "alpha_pattern", problems).items():
        if not _positive_finite(value):
            problems.append(f"alpha_pattern[{key!r}] = {value!r} is not a finite positive number")
    if config.get("use_dora"):
        problems.append("DoRA adapters (use_dora) are not supported by the engine")
    if config.get("bias", "none") != "none":
        problems.append(f"bias is {config.get('bias')!r}; only 'none' is supported")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']!r} is not supported")
    targets = _check_targets(config.get("target_modules"), base_shapes, problems)
    return rank, float(alpha), targets


def _pattern(config: dict, key: str, problems: list[str]) -> dict:
    """config[key] (a module-name pattern -> value map), or {} where it is missing, null or not a map (a
    problem then)."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{key} must be a JSON object (module pattern -> value), got {type(value).__name__}")
        return {}
    return value


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _check_targets(targets: object, base_shapes: dict[str, tuple[int, int]], problems: list[str]) -> tuple[str, ...]:
    leaves = {name.rsplit(".", 1)[-1] for name in base_shapes}
    if isinstance(targets, str):  # PEFT also accepts one regex over full module paths
        try:
            pattern = re.compile(targets)
        except re.error as e:
            problems.append(f"target_modules regex {targets!r} does not compile: {e}")
            return ()
        if not any(pattern.fullmatch(name) for name in base_shapes):
            problems.append(f"target_modules regex {targets!r} matches no linear layer of the base model")
        return (targets,)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        problems.append(f"target_modules must be a non-empty list of module names, got {targets!r}")
        return ()
    unknown = sorted(t for t in targets if t not in leaves and t not in base_shapes)
    if unknown:
        problems.append(
            f"target_modules {unknown} are not linear layers of the base model (it has {', '.join(sorted(leaves))})"
        )
    return tuple(targets)


# ---------------------------------------------------------------------------------------------------------
# adapter_model.safetensors


def _check_weights(
    path: Path, max_rank: int, base_shapes: dict[str, tuple[int, int]], problems: list[str]
) -> int:
    from safetensors import SafetensorError, safe_open
    import torch

    file = path / WEIGHTS_FILE
    try:
        regular = stat.S_ISREG(file.stat().st_mode)  # not is_file(): it hides the stat's own errors
    except (FileNotFoundError, NotADirectoryError):
        regular = None
    if not regular:
        problems.append(f"{WEIGHTS_FILE} is missing" if regular is None else f"{WEIGHTS_FILE} is not a file")
        return 0
    try:  # opened here first: safetensors reports any failure to open (EACCES, EMFILE) as "No such file"
        os.close(os.open(file, os.O_RDONLY))
    except FileNotFoundError:  # removed since the stat
        problems.append(f"{WEIGHTS_FILE} is missing")
        return 0
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            if not names:
                problems.append(f"{WEIGHTS_FILE} holds no tensors")
            for name in names:
                match = _LORA_TENSOR.match(name)
                if match is None:
                    problems.append(f"tensor {name!r} is not a lora_A/lora_B weight")
                    continue
                tensor = f.get_tensor(name)
                if not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    problems.append(f"tensor {name!r} has {bad} non-finite values (NaN or inf)")
                module = match["module"].removeprefix(_PEFT_PREFIX)
                pairs.setdefault(module, {})[match["side"]] = tuple(tensor.shape)
    except FileNotFoundError as e:  # safetensors' word for any failure to open: gone only if it is gone
        if not os.path.lexists(file):
            problems.append(f"{WEIGHTS_FILE} is missing")
            return 0
        raise OSError(f"{file} is there but could not be opened now: {e}") from e
    except (SafetensorError, RuntimeError) as e:  # what the file holds is no safetensors file, or not whole
        problems.append(f"{WEIGHTS_FILE} cannot be read: {e}")
        return 0
    for module, sides in sorted(pairs.items()):
        _check_pair(module, sides, max_rank, base_shapes, problems)
    return len(pairs)


def _check_pair(
    module: str,
    sides: dict[str, tuple[int, ...]],
    max_rank: int,
    base_shapes: dict[str, tuple[int, int]],
    problems: list[str],
) -> None:
    if set(sides) != {"A", "B"}:
        missing = "lora_B" if "A" in sides else "lora_A"
        problems.append(f"module {module!r} has no {missing}")
        return
    base = base_shapes.get(module)
    if base is None:
        problems.append(f"module {module!r} is not a linear layer of the base model")
        return
    a, b = sides["A"], sides["B"]
    out_features, in_features = base
    if len(a) != 2 or len(b) != 2:
        problems.append(f"module {module!r}: lora_A {a} and lora_B {b} must be 2-D")
        return
    if a[1] != in_features or b[0] != out_features or a[0] != b[1]:
        problems.append(
            f"module {module!r}: lora_A {list(a)} / lora_B {list(b)} do not fit the base layer "
            f"[out={out_features}, in={in_features}]"
        )
    elif a[0] > max_rank:  # rank_pattern may give a module its own rank, but never above the limit
        problems.append(f"module {module!r}: rank {a[0]} exceeds the engine's max_lora_rank {max_rank}")
