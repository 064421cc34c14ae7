"""`clora bench WHAT`: runs one package's benchmark. Each benchmark prints a table, writes JSON and a PNG under
--out, and is never part of the test suite (timings on a shared machine are compared as ratios within one run).

The benchmarks themselves live beside the code they measure (`<package>/bench.py`, function `run(args) -> int`).
This file checks what every benchmark is given before it starts (--out can be written, --model is a model
directory: a benchmark runs for up to an hour, and one that fails at its end loses the hour) and turns the
errors a benchmark can meet (bad input, a process it started dying, a disk error) into one line naming the
benchmark; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
from pathlib import Path

BENCHMARKS = {
    "ingest": ("ingest.bench", "Kafka -> Parquet ingest rate vs a bare consumer"),
    "learner": ("learner.bench", "per-step time, tenant switch cost, memory with 1 vs 8 tenants"),
    "serving": ("serving.bench", "multi-LoRA batching: mixed vs one tenant at a time vs base model"),
    "swap": ("serving.bench_swap", "publish -> first response from the new adapter version under load"),
    "experiments": ("learner.bench_experiments", "N concurrent RL experiments vs one at a time"),
    "registry": ("storage.bench", "a learner step's registry cost as a tenant's version history grows"),
}


class BenchError(RuntimeError):
    """A benchmark failed while it ran: a process it started died or never became ready, a result it needs did
    not come (the message may carry the tail of that process's log). `clora bench` exits 1."""


class BenchInputError(ValueError):
    """What a benchmark was given cannot be used (a --from-json file that is not an earlier result of it).
    `clora bench` exits 2."""


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "bench",
        parents=[common],
        help="run a benchmark (prints a table, writes JSON and a PNG)",
        description="Benchmarks: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHMARKS.items()),
    )
    bench_sub = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, (module, summary) in BENCHMARKS.items():
        b = bench_sub.add_parser(name, parents=[common], help=summary)
        b.add_argument("--out", default="bench-results", help="directory for the JSON and PNG (default: bench-results)")
        b.set_defaults(func=_runner(module), bench_module=module)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(b)


def _runner(module: str):
    def run(args: argparse.Namespace) -> int:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            print(f"clora bench: the {args.bench} benchmark is not built yet")
            return 2
        problem = input_problem(args)
        if problem is not None:
            print(f"clora bench {args.bench}: {problem}", file=sys.stderr)
            return 2
        try:
            return int(mod.run(args) or 0)
        except Exception as e:
            code = _exit_code(e)
            if code is None:
                raise
            print(f"clora bench {args.bench}: {_error_text(e)}", file=sys.stderr)
            return code

    return run


def input_problem(args: argparse.Namespace) -> str | None:
    """Why the benchmark cannot start with `args`, or None. Creates --out (and checks it by writing a file
    there); checks --model where the benchmark has one."""
    from clora.cli import model_path_problem, prepare_data_dir

    try:
        prepare_data_dir(Path(args.out))
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) != Path(args.out) else ""
        return f"--out {args.out}: {e.strerror or e}{where}"
    model = getattr(args, "model", None)
    if model is not None:
        problem = model_path_problem(Path(model))
        if problem is not None:  # said of the config's model.path; here the path came from --model
            return problem.replace("model.path", "--model", 1)
    return None


def _exit_code(e: Exception) -> int | None:
    """The exit code of an error a benchmark can meet (2: bad input, 1: a failure while it ran), or None for
    one it should not (a bug: its traceback is shown). PolicyError and BrokerError are looked up only where
    their modules were imported (importing learner.policy imports torch): if not, neither was raised."""
    if isinstance(e, BenchInputError):
        return 2
    policy = sys.modules.get("learner.policy")
    if policy is not None and isinstance(e, policy.PolicyError):
        return 2  # the base model does not load, as `clora learn` says it
    broker = sys.modules.get("ingest.broker")
    if isinstance(e, (BenchError, OSError)) or (broker is not None and isinstance(e, broker.BrokerError)):
        return 1
    return None


def _error_text(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def machine(gpu: bool = False) -> str:
    """The line every benchmark's results carry: CPU model, cores, memory and (with `gpu`) the GPU."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores"
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        text += f", {pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    if gpu:
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=30).stdout.strip().splitlines()
            text += f", GPU {name[0]}" if name else ", GPU"
        except (OSError, subprocess.SubprocessError):
            text += ", GPU"
    return text
