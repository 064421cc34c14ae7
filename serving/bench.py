"""`clora bench serving`: what multi-LoRA batching costs and saves, on the engine the serving tier uses.

    clora bench serving --tenants 1,2,4,8 --prompts 8 --tokens 32 --out bench-results

For each N in --tenants, the same N x --prompts requests (distinct chat prompts, --tokens generated
tokens each, EOS ignored so every request generates exactly that many) run four ways:

    mixed       all N tenants' requests at once in one engine, each row with its own adapter
    one-by-one  the same engine, one tenant's batch at a time (what a server without multi-LoRA
                batching, or with max_loras=1, does)
    zero-lora   the same requests at once through the LoRA engine on the all-zero adapter: the cost of
                the LoRA ops themselves with a single adapter in the batch
    base        the same requests at once on a plain engine without LoRA (the floor)

Reading the table: zero-lora / base is what the punica ops cost at all (on CPU: serving/cpu_lora.py's
ops, or with --cpu-lora-ops vllm vLLM's own, which gather and einsum per row); mixed / zero-lora is what N distinct adapters in one batch add (each row gathers its
own adapter's weights); one-by-one / mixed is what batching tenants together saves. Throughput is
generated tokens per second of wall time, after a warm-up pass, the median of --repeats runs (the modes
interleaved); timings on a shared machine are compared as ratios within one run.

Adapters are random rank-`--rank` LoRAs in PEFT layout over every projection, written to a temporary
directory. Prints a table; writes serving.json and serving.png under --out. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from clora.argtypes import positive_int, positive_int_list
from clora.bench import BenchError

MODES = ("mixed", "one-by-one", "zero-lora", "base")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=positive_int_list, default=[1, 2, 4, 8],
                        help="tenant counts to measure, comma separated (default 1,2,4,8)")
    parser.add_argument("--prompts", type=positive_int, default=8,
                        help="requests per tenant (default 8: one step's rollouts in `clora bench experiments`)")
    parser.add_argument("--tokens", type=positive_int, default=32, help="generated tokens per request (default 32)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each measurement; the median counts (default 3)")
    parser.add_argument("--rank", type=positive_int, default=8, help="LoRA rank of the adapters (default 8)")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: serving.dtype of the config)")
    parser.add_argument("--cpu-lora-ops", choices=("clora", "vllm"), default="clora",
                        help="on CPU: clora's multi-LoRA ops (default) or vLLM's own (serving/cpu_lora.py)")
    parser.add_argument("--eager-lora", action="store_true",
                        help="on CPU: run the LoRA engine eagerly, as vLLM does, instead of compiled (serving/cpu_lora.py)")


def write_random_adapter(out_dir: Path, base_shapes: dict[str, tuple[int, int]], *, rank: int, seed: int) -> Path:
    """A PEFT-layout LoRA over every projection with random A and B (so it changes the output)."""
    import torch
    from safetensors.torch import save_file

    from serving.engine import LORA_TARGETS

    generator = torch.Generator().manual_seed(seed)
    modules = sorted(m for m in base_shapes if m.rsplit(".", 1)[-1] in LORA_TARGETS)
    tensors = {}
    for module in modules:
        out_f, in_f = base_shapes[module]
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=generator) / in_f**0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=generator) * 0.1
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "task_type": "CAUSAL_LM",
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def prompts(engine, tenant: int, count: int) -> list[list[int]]:
    return [
        engine.encode(engine.render_chat([{"role": "user", "content": f"Tenant {tenant}, request {i}: list five "
                                                                      f"digits and name a city."}]))
        for i in range(count)
    ]


async def timed(engine, jobs, sampling) -> float:
    """Runs (prompt ids, adapter) jobs concurrently; seconds of wall time."""
    started = time.perf_counter()
    results = await asyncio.gather(*[
        engine.generate(ids, sampling, adapter, f"bench-{time.monotonic_ns()}-{i}") for i, (ids, adapter) in enumerate(jobs)
    ])
    seconds = time.perf_counter() - started
    generated = sum(len(c.token_ids) for choices in results for c in choices)
    if generated != len(jobs) * sampling.max_tokens:
        raise BenchError(f"expected {len(jobs) * sampling.max_tokens} tokens, got {generated}")
    return seconds


async def measure(model_path: Path, counts: list[int], args, dtype: str) -> dict[str, dict[int, float]]:
    from clora.config import lora_rank_size
    from serving.adapter_check import base_linear_shapes
    from serving.engine import Sampling, build_engine

    top = max(counts)
    sampling = Sampling(max_tokens=args.tokens, temperature=1.0, seed=0, ignore_eos=True)
    seconds: dict[str, dict[int, float]] = {mode: {} for mode in MODES}
    common = dict(max_model_len=256, max_num_seqs=top * args.prompts, dtype=dtype, max_lora_rank=lora_rank_size(max(args.rank, 8)))

    with tempfile.TemporaryDirectory(prefix="clora-bench-serving-") as tmp:
        shapes = base_linear_shapes(model_path)
        engine = build_engine(model_path, max_loras=top, max_cpu_loras=top + 1, **common)
        try:
            await engine.start()
            adapters = []
            for t in range(top):
                handle = engine.new_handle(f"t{t}@1", write_random_adapter(Path(tmp) / f"t{t}", shapes, rank=args.rank, seed=t))
                await engine.load_adapter(handle)
                adapters.append(handle)
            batches = {t: prompts(engine, t, args.prompts) for t in range(top)}
            await timed(engine, [(ids, adapters[t]) for t in range(top) for ids in batches[t][:2]], sampling)  # warm-up
            for n in counts:
                runs = {"mixed": [], "one-by-one": [], "zero-lora": []}
                for _ in range(args.repeats):  # interleaved, so a noisy moment touches every mode alike
                    runs["mixed"].append(await timed(engine, [(ids, adapters[t]) for t in range(n) for ids in batches[t]], sampling))
                    runs["one-by-one"].append(sum([
                        await timed(engine, [(ids, adapters[t]) for ids in batches[t]], sampling) for t in range(n)
                    ]))
                    runs["zero-lora"].append(await timed(engine, [(ids, None) for t in range(n) for ids in batches[t]], sampling))
                for mode, values in runs.items():
                    seconds[mode][n] = statistics.median(values)
                print(f"  N={n}: mixed {seconds['mixed'][n]:.2f}s, one-by-one {seconds['one-by-one'][n]:.2f}s, "
                      f"zero-lora {seconds['zero-lora'][n]:.2f}s", flush=True)
        finally:
            engine.shutdown()

        engine = build_engine(model_path, max_loras=1, max_cpu_loras=1, enable_lora=False, **common)
        try:
            await timed(engine, [(ids, None) for ids in batches[0][:2]], sampling)  # warm-up
            for n in counts:
                seconds["base"][n] = statistics.median([
                    await timed(engine, [(ids, None) for t in range(n) for ids in batches[t]], sampling)
                    for _ in range(args.repeats)
                ])
                print(f"  N={n}: base {seconds['base'][n]:.2f}s", flush=True)
        finally:
            engine.shutdown()
    return seconds


def run(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from clora.cli import base_model_dir
    from serving.cpu_lora import COMPILE_ENV, ENV

    os.environ[ENV] = args.cpu_lora_ops  # read by the plugin in the engine's processes
    os.environ[COMPILE_ENV] = "0" if args.eager_lora else "1"
    cfg = config_from_args(args)
    counts = args.tenants
    dtype = args.dtype or cfg.serving.dtype
    model_path = base_model_dir(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the measurement: a --out that cannot be made loses nothing
    print(f"clora bench serving: {model_path}, tenants {counts}, {args.prompts} prompts x {args.tokens} tokens "
          f"per tenant, rank {args.rank}, dtype {dtype}, CPU LoRA ops {args.cpu_lora_ops}"
          f"{', eager LoRA engine' if args.eager_lora else ''}", flush=True)
    seconds = asyncio.run(measure(model_path, counts, args, dtype))

    rows = []
    for n in counts:
        tokens = n * args.prompts * args.tokens
        row = {"tenants": n, "tokens": tokens}
        row.update({f"{mode}_s": round(seconds[mode][n], 3) for mode in MODES})
        row.update({f"{mode}_tok_s": round(tokens / seconds[mode][n], 1) for mode in MODES})
        row["mixed_over_base"] = round(seconds["mixed"][n] / seconds["base"][n], 2)
        row["zero_lora_over_base"] = round(seconds["zero-lora"][n] / seconds["base"][n], 2)
        row["mixed_over_zero_lora"] = round(seconds["mixed"][n] / seconds["zero-lora"][n], 2)
        row["one_by_one_over_mixed"] = round(seconds["one-by-one"][n] / seconds["mixed"][n], 2)
        rows.append(row)

    header = f"{'N':>3} {'tokens':>7} " + " ".join(f"{m + ' tok/s':>17}" for m in MODES) + \
        f" {'mixed/base':>11} {'zero/base':>10} {'mixed/zero':>11} {'1by1/mixed':>11}"
    print(header)
    for r in rows:
        print(f"{r['tenants']:>3} {r['tokens']:>7} " + " ".join(f"{r[m + '_tok_s']:>17.1f}" for m in MODES)
              + f" {r['mixed_over_base']:>11.2f} {r['zero_lora_over_base']:>10.2f} {r['mixed_over_zero_lora']:>11.2f}"
              f" {r['one_by_one_over_mixed']:>11.2f}")
    last = rows[-1]
    print(f"\nat N={last['tenants']}: LoRA-mixed time / base time = {last['mixed_over_base']:.2f}; of that, the LoRA "
          f"ops with one adapter cost {last['zero_lora_over_base']:.2f}x and {last['tenants']} distinct adapters per "
          f"batch a further {last['mixed_over_zero_lora']:.2f}x; serving tenants one at a time instead takes "
          f"{last['one_by_one_over_mixed']:.2f}x the mixed time.")

    result = {"benchmark": "serving", "model": str(model_path), "dtype": dtype, "prompts_per_tenant": args.prompts,
              "tokens_per_request": args.tokens, "rank": args.rank, "cpu_lora_ops": args.cpu_lora_ops, "eager_lora": args.eager_lora,
              "repeats": args.repeats, "rows": rows}
    (out / "serving.json").write_text(json.dumps(result, indent=2))
    _plot(rows, out / "serving.png")
    print(f"wrote {out / 'serving.json'} and {out / 'serving.png'}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    xs = range(len(rows))
    for i, mode in enumerate(MODES):
        ax.bar([x + (i - 1.5) * width for x in xs], [r[f"{mode}_tok_s"] for r in rows], width, label=mode)
    ax.set_xticks(list(xs), [str(r["tenants"]) for r in rows])
    ax.set_xlabel("tenants (adapters) in the workload")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("Multi-LoRA serving throughput")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
