"""`clora bench learner`: what one learner step costs, what switching tenants costs, what a tenant weighs.

    clora bench learner                        # the tiny model on this machine
    clora bench learner --model /models/qwen3-4b --device cuda --batch-size 16

Three measurements on one Policy (one base model, N tenant adapters), with logs-mode steps on synthetic
trajectories (random prompt and completion tokens, random rewards; the numbers do not depend on them):
  1. step time: one tenant trained `--steps` times in a row (median; all N tenants are loaded);
  2. tenant switch: `Policy.use` between two tenants (median of many switches), as a fraction of a step
     (target <= 5%); also the steps of N tenants taken in turn against the same tenant in a row, which
     includes any cache effects of switching;
  3. memory: process RSS with 1 trained tenant, then with N; the growth is compared with
     1.5 x (N - 1) x (adapter + optimizer bytes of one tenant);
  4. gate probes: the greedy decode of `--probe-prompts` prompts for each of the N tenants, one tenant at
     a time (`Policy.generate`) against all N in one grouped decode (`Policy.generate_grouped`, what a
     learner round does), median of 5 each, and whether both gave the same tokens;
  5. GRPO groups: one rollouts-mode update of `--group-size` completions per prompt with each distinct
     prompt run once for its whole group (the learner's way) against one full pass per row, the two
     alternating step by step (median of `--steps` each), and the largest log-prob difference between them.
Prints a table and writes learner.json and learner.png under --out. Timings on a shared machine are
noisy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from clora.argtypes import positive_int

SWITCH_TARGET = 0.05
MEMORY_FACTOR = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="base model directory (default: the tiny local model)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument("--tenants", type=positive_int, default=8, help="tenants for the switch and memory runs (default 8)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per measurement (default 20)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="trajectories per step (default 16)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=64, help="prompt length (default 64)")
    parser.add_argument("--completion-tokens", type=positive_int, default=32, help="completion length (default 32)")
    parser.add_argument("--rank", type=positive_int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--probe-prompts", type=positive_int, default=4, help="gate probe prompts per tenant (default 4)")
    parser.add_argument("--probe-tokens", type=positive_int, default=16, help="tokens per probe completion (default 16)")
    parser.add_argument("--group-size", type=positive_int, default=4, help="completions per prompt in the GRPO measurement (default 4)")


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable), after garbage collection and
    handing freed heap back to the OS: without that, what the allocator happens to keep swung the 1 -> 8
    tenant growth by tens of MiB from run to run (-11 to +19 MiB), more than the adapters themselves."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def synthetic_examples(vocab: int, n: int, prompt_tokens: int, completion_tokens: int, rng: random.Random):
    from learner.types import Example

    return [
        Example(
            id=f"x{i}",
            group=f"p{i}",
            prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt_tokens)),
            completion_ids=tuple(rng.randrange(3, vocab) for _ in range(completion_tokens)),
            reward=rng.uniform(-1, 1),
        )
        for i in range(n)
    ]


def run(args: argparse.Namespace) -> int:
    import torch

    from clora.cli import config_from_args
    from clora.cli import base_model_dir
    from learner.batch import pack
    from learner.logs_mode import train_step
    from learner.update import pg_update
    from learner.policy import Policy
    from learner.types import TenantSpec

    cfg = config_from_args(args)
    path = args.model or base_model_dir(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    torch.manual_seed(0)

    policy = Policy(path, device=args.device)
    vocab = len(policy.tokenizer)
    names = [f"bench-{i}" for i in range(args.tenants)]
    spec = replace(TenantSpec.default(names[0]), rank=args.rank, alpha=2.0 * args.rank)

    def sync():
        if policy.device.type == "cuda":
            torch.cuda.synchronize()

    def step(name: str) -> float:
        examples = synthetic_examples(vocab, args.batch_size, args.prompt_tokens, args.completion_tokens, rng)
        sync()
        t = time.perf_counter()
        train_step(policy, name, examples, baseline=0.0, clip_eps=0.2, kl_coef=0.0, max_grad_norm=1.0, max_len=4096,
                   current_version=0)
        sync()
        return time.perf_counter() - t

    base_rss = rss_bytes()
    policy.add_tenant(replace(spec, name=names[0]))
    for _ in range(3):  # warm-up: allocator pools, optimizer state, kernels
        step(names[0])
    gc.collect()
    one_rss = rss_bytes()
    per_tenant = policy.adapter_bytes(names[0]) + policy.optimizer_bytes(names[0])

    for name in names[1:]:
        policy.add_tenant(replace(spec, name=name))
        step(name)  # creates its optimizer state
    gc.collect()
    all_rss = rss_bytes()

    same = [step(names[0]) for _ in range(args.steps)]
    rotating = [step(names[i % len(names)]) for i in range(args.steps)]

    switches = []
    for i in range(200):
        a, b = names[i % len(names)], names[(i + 1) % len(names)]
        policy.use(a)
        sync()
        t = time.perf_counter()
        policy.use(b)
        sync()
        switches.append(time.perf_counter() - t)

    probe_prompts = [
        policy.tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about topic {i}, please."}],
                                             tokenize=False, add_generation_prompt=True)
        for i in range(args.probe_prompts)
    ]

    def probes_alone():
        return [policy.generate(n, probe_prompts, max_new_tokens=args.probe_tokens, greedy=True) for n in names]

    def probes_grouped():
        return policy.generate_grouped([(n, probe_prompts) for n in names], max_new_tokens=args.probe_tokens)

    def timed(fn):
        sync()
        t = time.perf_counter()
        got = fn()
        sync()
        return time.perf_counter() - t, [[s[0].token_ids for s in g] for g in got]

    alone_runs = [timed(probes_alone) for _ in range(5)]
    grouped_runs = [timed(probes_grouped) for _ in range(5)]
    probe_alone_s = statistics.median(t for t, _ in alone_runs)
    probe_grouped_s = statistics.median(t for t, _ in grouped_runs)

    groups = max(1, args.batch_size // args.group_size)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(groups)]
    grpo = pack([p for p in prompts for _ in range(args.group_size)],
                [[rng.randrange(3, vocab) for _ in range(args.completion_tokens)] for _ in range(groups * args.group_size)],
                pad_id=policy.pad_token_id, max_len=4096)
    advantages = torch.randn(grpo.size)

    def grpo_step(share: bool) -> float:
        policy.share_prompts = share
        sync()
        t = time.perf_counter()
        pg_update(policy, names[0], grpo, advantages, clip_eps=0.2)
        sync()
        return time.perf_counter() - t

    grpo_step(True), grpo_step(False)  # warm-up of both shapes
    shared_steps, per_row_steps = [], []
    for _ in range(args.steps):
        shared_steps.append(grpo_step(True))
        per_row_steps.append(grpo_step(False))
    with torch.no_grad():
        policy.share_prompts = False
        per_row_logp = policy.token_logprobs(grpo, names[0])
        policy.share_prompts = True
        shared_logp = policy.token_logprobs(grpo, names[0])
    mask = grpo.completion_mask.bool().to(shared_logp.device)
    grpo_diff = float((shared_logp - per_row_logp).abs()[mask].max())

    step_s = statistics.median(same)
    switch_s = statistics.median(switches)
    growth = all_rss - one_rss
    budget = MEMORY_FACTOR * (len(names) - 1) * per_tenant
    result = {
        "model": str(path),
        "device": str(policy.device),
        "batch_size": args.batch_size,
        "prompt_tokens": args.prompt_tokens,
        "completion_tokens": args.completion_tokens,
        "rank": args.rank,
        "tenants": len(names),
        "step_seconds_median": step_s,
        "step_seconds_rotating_median": statistics.median(rotating),
        "rotation_overhead_fraction": statistics.median(rotating) / step_s - 1.0,
        "switch_seconds_median": switch_s,
        "switch_fraction_of_step": switch_s / step_s,
        "switch_target": SWITCH_TARGET,
        "switch_ok": switch_s / step_s <= SWITCH_TARGET,
        "rss_base_bytes": base_rss,
        "rss_1_tenant_bytes": one_rss,
        f"rss_{len(names)}_tenants_bytes": all_rss,
        "rss_growth_bytes": growth,
        "adapter_plus_optimizer_bytes": per_tenant,
        "rss_growth_budget_bytes": budget,
        "memory_ok": growth <= budget,
        "probe_prompts": args.probe_prompts,
        "probe_tokens": args.probe_tokens,
        "probe_alone_seconds_median": probe_alone_s,
        "probe_grouped_seconds_median": probe_grouped_s,
        "probe_speedup": probe_alone_s / probe_grouped_s,
        "probe_same_tokens": alone_runs[0][1] == grouped_runs[0][1],
        "group_size": args.group_size,
        "grpo_rows": grpo.size,
        "grpo_shared_prompt_seconds_median": statistics.median(shared_steps),
        "grpo_per_row_seconds_median": statistics.median(per_row_steps),
        "grpo_speedup": statistics.median(per_row_steps) / statistics.median(shared_steps),
        "grpo_max_logprob_difference": grpo_diff,
    }
    (out / "learner.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, same, rotating, out / "learner.png")
    _print(result)
    return 0


def _print(r: dict) -> None:
    mib = 1024 * 1024
    all_key = f"rss_{r['tenants']}_tenants_bytes"
    rows = [
        ("model", f"{r['model']} on {r['device']}"),
        ("batch", f"{r['batch_size']} x ({r['prompt_tokens']} prompt + {r['completion_tokens']} completion tokens), LoRA r={r['rank']}"),
        ("step (one tenant)", f"{r['step_seconds_median'] * 1000:.1f} ms"),
        (f"step ({r['tenants']} tenants in turn)", f"{r['step_seconds_rotating_median'] * 1000:.1f} ms ({r['rotation_overhead_fraction']:+.1%})"),
        ("tenant switch", f"{r['switch_seconds_median'] * 1e6:.0f} us = {r['switch_fraction_of_step']:.2%} of a step "
         f"(target <= {r['switch_target']:.0%}: {'ok' if r['switch_ok'] else 'MISSED'})"),
        ("adapter + optimizer", f"{r['adapter_plus_optimizer_bytes'] / mib:.2f} MiB per tenant"),
        ("RSS base / 1 / N tenants", f"{r['rss_base_bytes'] / mib:.0f} / {r['rss_1_tenant_bytes'] / mib:.0f} / "
         f"{r[all_key] / mib:.0f} MiB"),
        (f"RSS growth 1 -> {r['tenants']}", f"{r['rss_growth_bytes'] / mib:.2f} MiB (budget {r['rss_growth_budget_bytes'] / mib:.2f} MiB: "
         f"{'ok' if r['memory_ok'] else 'MISSED'})"),
        (f"gate probes of {r['tenants']} tenants", f"{r['probe_alone_seconds_median'] * 1000:.0f} ms one at a time, "
         f"{r['probe_grouped_seconds_median'] * 1000:.0f} ms in one grouped decode ({r['probe_speedup']:.2f}x; "
         f"{r['probe_prompts']} prompts x {r['probe_tokens']} tokens each; same tokens: {r['probe_same_tokens']})"),
        (f"GRPO update, {r['grpo_rows']} rows in groups of {r['group_size']}",
         f"{r['grpo_shared_prompt_seconds_median'] * 1000:.0f} ms with each prompt run once, "
         f"{r['grpo_per_row_seconds_median'] * 1000:.0f} ms with a pass per row ({r['grpo_speedup']:.2f}x; "
         f"log-probs differ by at most {r['grpo_max_logprob_difference']:.1e})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _plot(r: dict, same: list[float], rotating: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1024 * 1024
    all_key = f"rss_{r['tenants']}_tenants_bytes"
    fig, (ax1, ax2, ax3, ax4) = plt.subplots(1, 4, figsize=(18, 4))
    ax1.boxplot([[s * 1000 for s in same], [s * 1000 for s in rotating]], tick_labels=["one tenant", f"{r['tenants']} in turn"])
    ax1.set_ylabel("step time (ms)")
    ax1.set_title(f"switch = {r['switch_fraction_of_step']:.2%} of a step")
    labels = ["1 tenant", f"{r['tenants']} tenants", "budget"]
    values = [
        (r["rss_1_tenant_bytes"] - r["rss_base_bytes"]) / mib,
        (r[all_key] - r["rss_base_bytes"]) / mib,
        (r["rss_1_tenant_bytes"] - r["rss_base_bytes"] + r["rss_growth_budget_bytes"]) / mib,
    ]
    ax2.bar(labels, values, color=["tab:blue", "tab:blue", "tab:gray"])
    ax2.set_ylabel("RSS above the base model (MiB)")
    ax2.set_title("memory per tenant")
    ax3.bar(["one at a time", "grouped"], [r["probe_alone_seconds_median"] * 1000, r["probe_grouped_seconds_median"] * 1000],
            color=["tab:gray", "tab:blue"])
    ax3.set_ylabel(f"gate probes of {r['tenants']} tenants (ms)")
    ax3.set_title(f"grouped decode {r['probe_speedup']:.2f}x")
    ax4.bar(["a pass per row", "prompt once per group"],
            [r["grpo_per_row_seconds_median"] * 1000, r["grpo_shared_prompt_seconds_median"] * 1000], color=["tab:gray", "tab:blue"])
    ax4.set_ylabel(f"GRPO update, {r['grpo_rows']} rows (ms)")
    ax4.set_title(f"shared prompt pass {r['grpo_speedup']:.2f}x")
    fig.suptitle(f"clora learner: {Path(r['model']).name} on {r['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
