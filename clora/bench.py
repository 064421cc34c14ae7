"""`clora bench WHAT`: runs one package's benchmark. Each benchmark prints a table, writes JSON and a PNG under
--out, and is never part of the test suite (timings on a shared machine are compared as ratios within one run).

The benchmarks themselves live beside the code they measure (`<package>/bench.py`, function `run(args) -> int`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
from pathlib import Path

BENCHMARKS = {
    "ingest": ("ingest.bench", "Kafka -> Parquet ingest rate vs a bare consumer"),
    "learner": ("learner.bench", "per-step time, tenant switch cost, memory with 1 vs 8 tenants"),
    "serving": ("serving.bench", "multi-LoRA batching: mixed vs one tenant at a time vs base model"),
    "swap": ("serving.bench_swap", "publish -> first response from the new adapter version under load"),
    "experiments": ("learner.bench_experiments", "N concurrent RL experiments vs one at a time"),
    "registry": ("storage.bench", "a learner step's registry cost as a tenant's version history grows"),
}


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
        return int(mod.run(args) or 0)

    return run


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
