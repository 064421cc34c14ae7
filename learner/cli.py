"""The learner package's command-line surface: `clora model` (and, beside it, the learner process's own
command).

`clora model tiny` builds (or reuses) the tiny local base model; `clora model random` writes a
random-weight model of a real architecture's shape for GPU benchmarks. Each command group has its own
`_add_*_commands(sub, common)` helper, called from `add_commands`. Only argparse is imported at module
level, so `clora --help` stays fast; the builders are imported inside the commands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clora.argtypes import positive_int

# The keys of tiny_model.RANDOM_SHAPES, repeated so that `clora --help` imports nothing (a test keeps them equal).
MODEL_SHAPES = ("qwen3-4b", "qwen3-0.6b", "tiny-test")
DTYPES = ("bfloat16", "float16", "float32")


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    _add_learn_commands(sub, common)
    _add_model_commands(sub, common)


# ---------------------------------------------------------------------------------------------------------
# clora learn


def _add_learn_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    learn = sub.add_parser(
        "learn",
        parents=[common],
        help="run the learner: per-tenant RL on new trajectories, gate, publish (runs until stopped)",
        description="Runs the learner process: picks the next tenant (learner.scheduler), trains its LoRA "
        "one step on its new trajectories (logs mode) or on fresh rollouts (rollouts mode), gates the result "
        "and publishes or rejects it. Runs until SIGTERM/Ctrl-C; same as `python -m learner`.",
    )
    add_learn_arguments(learn)
    learn.set_defaults(func=_learn)


def add_learn_arguments(parser: argparse.ArgumentParser) -> None:
    """The learner's options (shared by `clora learn` and `python -m learner`)."""
    parser.add_argument("--once", action="store_true", help="one pass: at most one step per tenant with work, then exit")
    parser.add_argument("--until-idle", action="store_true", help="exit when no tenant has new work (a rollouts tenant with a prompts_file always has: bound it with --max-steps)")
    parser.add_argument("--max-steps", type=positive_int, default=None, metavar="N", help="exit after N steps in all")
    parser.add_argument("--no-progress", action="store_true", help="no per-tenant progress bars on a terminal: a log line per step instead (as "
                        "when stderr is not a terminal)")
    parser.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                        help="train only shard K of N learner processes sharing this data dir (tenants dealt by "
                        "rendezvous hashing, the config's balanced across shards); e.g. 0/2 and 1/2")


def _shard(text: str):
    from learner.types import Shard

    try:
        return Shard.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _learn(args: argparse.Namespace) -> int:
    from learner.__main__ import main_from_args

    return main_from_args(args)


# ---------------------------------------------------------------------------------------------------------
# clora model


def _add_model_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    model = sub.add_parser(
        "model",
        parents=[common],
        help="build clora's own base models (tiny local model, random weights of a real shape)",
        description="Build base models without downloading anything.",
    )
    model_sub = model.add_subparsers(dest="model_command", metavar="KIND", title="kinds", required=True)

    tiny = model_sub.add_parser(
        "tiny",
        parents=[common],
        help="the tiny Qwen3-architecture model with random weights (a few million parameters)",
        description="Build the tiny local model. Without --out it goes to <data_dir>/models/tiny-<seed> "
        "and an existing complete build there is reused.",
    )
    tiny.add_argument("--out", type=Path, default=None, metavar="DIR", help="directory to write the model to")
    tiny.add_argument("--seed", type=int, default=None, help="weight seed (default: model.seed of the config)")
    tiny.add_argument("--force", action="store_true",
                      help="replace --out if it is an earlier clora build or an empty directory")
    tiny.set_defaults(func=_model_tiny)

    random = model_sub.add_parser(
        "random",
        parents=[common],
        help="random weights with the shape of a real model, for GPU benchmarks",
        description="Write a random-weight model of a real architecture's shape (safetensors shards of "
        "about 2 GB, tensors drawn one at a time) with the tiny model's tokenizer.",
    )
    random.add_argument("--shape", required=True, choices=MODEL_SHAPES, help="architecture shape")
    random.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory to write the model to")
    random.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype (default bfloat16)")
    random.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    random.add_argument("--force", action="store_true",
                        help="replace --out if it is an earlier clora build or an empty directory")
    random.set_defaults(func=_model_random)


def _model_tiny(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from learner.tiny_model import build_tiny, ensure_tiny

    cfg = config_from_args(args, writes_data_dir=args.out is None)
    seed = cfg.model.seed if args.seed is None else args.seed
    if args.out is None:
        return _built("tiny", lambda: ensure_tiny(cfg.data_dir / "models", seed), args.out)
    return _built("tiny", lambda: build_tiny(args.out, seed=seed, overwrite=args.force), args.out)


def _model_random(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from learner.tiny_model import build_random

    config_from_args(args)
    return _built(
        "random", lambda: build_random(args.shape, args.out, dtype=args.dtype, seed=args.seed, overwrite=args.force,
                                       progress=True),
        args.out,
    )


def _built(kind: str, build, out) -> int:
    """Runs `build`; prints what it built, or one line on why it could not (exit 1)."""
    from learner.tiny_model import ModelBuildError

    try:
        path = build()
    except FileExistsError as e:
        hint = " (--force replaces it)" if out is not None and Path(e.filename or str(out)) == Path(out) else ""
        print(f"clora model {kind}: {e}{hint}", file=sys.stderr)
        return 1
    except (ModelBuildError, OSError) as e:
        print(f"clora model {kind}: {e}", file=sys.stderr)
        return 1
    _print_built(path)
    return 0


def _print_built(path: Path) -> None:
    from learner.tiny_model import read_marker

    print(path)
    print(f"parameters: {read_marker(path)['parameters']:,}")
