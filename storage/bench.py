"""`clora bench registry`: what a learner's step costs the registry as a tenant's history grows.

    clora bench registry --history 100,1000,10000 --samples 40 --out bench-results

A continual learner adds a version per step and never deletes metadata, so a tenant's history grows
without end (a step every 2 s is 43,000 versions a day). This benchmark grows one tenant's history in a
temporary data dir through the real registry: mostly rejected steps, a published one every tenth, so old
versions are retired or lose their files as they would. Three more tenants keep a short history beside it.
At each size in --history it times --samples steps of the learner's work, each `create` + `publish` (or
`reject`), and the readers' `latest_published` and `published()`, side by side in one run:

    hint        the registry as it is: the per-tenant index hint names the versions not yet settled
    no hint     the same operations with the hint deleted before each one, so every operation lists and
                reads the tenant's whole history (what the registry did before it kept the hint)

Then, in a data dir of its own, the number of tenants grows (each with a short history) to each size in
--tenants, and at each size --samples steps of one tenant are timed, and a reader's `published()` right
after a change (what serving does after every one), side by side:

    one entry     the registry as it is: a change rewrites its own tenant's entry of HEAD.json
    rebuild       every change rebuilds HEAD.json from every tenant's records (what the registry did before;
                  it still does every FULL_HEAD_EVERY-th change)

The adapter files are a few bytes (the registry's cost does not depend on their size; the fsyncs do not
either). Prints two tables; writes registry.json and registry.png under --out. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from clora.argtypes import positive_int
from clora.bench import machine
from storage.registry import FULL_HEAD_EVERY, Registry

TENANT = "long"
OTHERS = ("a", "b", "c")
PUBLISH_EVERY = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--history", type=sizes, default="100,1000,10000",
                        help="history sizes (versions of one tenant) to measure at, ascending (default 100,1000,10000)")
    parser.add_argument("--samples", type=positive_int, default=40, help="timed steps per size and mode (default 40)")
    parser.add_argument("--keep-last", type=positive_int, default=5, help="the registry's keep_last (default 5)")
    parser.add_argument("--tenants", type=sizes, default="10,100,1000",
                        help="numbers of tenants to measure a step at, ascending (default 10,100,1000)")


def sizes(text: str) -> list[int]:
    """--history: comma-separated whole numbers of at least 1, ascending without repeats; anything else is a
    usage error naming the option (argparse catches ArgumentTypeError)."""
    try:
        values = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} names no size")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the sizes must be at least 1")
    return sorted(values)


def _write_adapter(directory: Path) -> None:
    (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (directory / "adapter_model.safetensors").write_bytes(b"\0" * 64)


def _step(reg: Registry, tenant: str) -> None:
    """One learner step: a candidate from the served version, then the gate's verdict."""
    served = reg.latest_published(tenant)
    v = reg.create(tenant, parent=served.name if served else None, write=_write_adapter, metrics={"reward": 0.5})
    if v.number % PUBLISH_EVERY == 1:
        reg.publish(tenant, v.number, gate={"passed": True}, if_parent_served=True)
    else:
        reg.reject(tenant, v.number, reason="probe reward fell", gate={"passed": False})


def _timed(fn, samples: int, before=lambda: None) -> list[float]:
    out = []
    for _ in range(samples):
        before()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _summary(ms: list[float]) -> dict:
    ordered = sorted(ms)
    return {"median_ms": statistics.median(ordered), "p90_ms": ordered[int(0.9 * (len(ordered) - 1))]}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="clora-bench-registry-") as tmp:
        reg = Registry(tmp, keep_last=args.keep_last)
        index = reg.dd.registry / TENANT / "index.json"
        for t in OTHERS:
            for _ in range(20):
                _step(reg, t)
        grown = 0
        for size in args.history:
            _grow(reg, size - grown, f"history {grown} -> {size}")
            grown = max(grown, size)  # the previous size's timed steps may have passed this one
            row = {"history": grown}
            for mode, before in (("hint", lambda: None), ("no hint", lambda: index.unlink(missing_ok=True))):
                # Each mode's steps add versions; both modes' counts are within 2 x samples of the size.
                row[mode] = {
                    "step": _summary(_timed(lambda: _step(reg, TENANT), args.samples, before)),
                    "latest_published": _summary(_timed(lambda: reg.latest_published(TENANT), args.samples, before)),
                    "published": _summary(_timed(reg.published, args.samples, before)),
                }
                grown += args.samples
            rows.append(row)
            print(_row_text(row), flush=True)
    with tempfile.TemporaryDirectory(prefix="clora-bench-registry-tenants-") as tmp:
        tenant_rows = _tenants(Registry(tmp, keep_last=args.keep_last), args.tenants, args.samples)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "samples": args.samples,
        "keep_last": args.keep_last,
        "publish_every": PUBLISH_EVERY,
        "rows": rows,
        "tenant_rows": tenant_rows,
        "bench_seconds": time.monotonic() - started,
    }
    (out / "registry.json").write_text(json.dumps(result, indent=1))
    print()
    print(table(result))
    _plot(result, out / "registry.png")
    print(f"\nwrote {out / 'registry.json'} and {out / 'registry.png'}")
    return 0


def _tenants(reg: Registry, sizes: list[int], samples: int) -> list[dict]:
    """At each number of tenants: a step of one tenant, and a reader's `published()` after it, in both modes."""
    from tqdm import tqdm

    reader = Registry(reg.dd.root)  # serving's: its parse of HEAD.json is its own
    rows, made = [], 0
    for size in sizes:
        for i in tqdm(range(made, size), desc=f"tenants {made} -> {size}", unit="tenant", leave=False,
                      disable=size - made < 50):
            for _ in range(3):
                _step(reg, f"t{i}")
        made = size
        row = {"tenants": size}
        for mode, every in (("one entry", 10**9), ("rebuild", 1)):
            reg.full_head_every = every
            reader.published()  # parsed as it is now: each timed read parses what one change made
            row[mode] = {
                "step": _summary(_timed(lambda: _step(reg, "t0"), samples)),
                "published_after_change": _summary(_timed(reader.published, samples,
                                                          before=lambda: _step(reg, "t1"))),
            }
        reg.full_head_every = FULL_HEAD_EVERY
        rows.append(row)
        one, full = row["one entry"]["step"]["median_ms"], row["rebuild"]["step"]["median_ms"]
        print(f"tenants {size}: step {one:.2f} ms (rebuild {full:.2f})", flush=True)
    return rows


def _grow(reg: Registry, count: int, label: str) -> None:
    from tqdm import tqdm

    for _ in tqdm(range(count), desc=label, unit="version", leave=False, disable=count < 50):
        _step(reg, TENANT)


def _row_text(row: dict) -> str:
    h, n = row["hint"], row["no hint"]
    return (f"history {row['history']}: step {h['step']['median_ms']:.2f} ms (no hint "
            f"{n['step']['median_ms']:.2f}), latest_published {h['latest_published']['median_ms']:.3f} ms "
            f"(no hint {n['latest_published']['median_ms']:.3f})")


def table(result: dict) -> str:
    lines = [
        f"clora bench registry: median (p90) ms per operation; {result['samples']} samples; keep_last "
        f"{result['keep_last']}; one published step in {result['publish_every']}; {result['machine']}",
        "",
        "| history | step (create + publish/reject) | no hint | latest_published | no hint | published() | no hint |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cells = [str(r["history"])]
        for op in ("step", "latest_published", "published"):
            for mode in ("hint", "no hint"):
                s = r[mode][op]
                cells.append(f"{s['median_ms']:.2f} ({s['p90_ms']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    first, last = result["rows"][0], result["rows"][-1]
    if last is not first:
        growth = last["hint"]["step"]["median_ms"] / first["hint"]["step"]["median_ms"]
        growth_no = last["no hint"]["step"]["median_ms"] / first["no hint"]["step"]["median_ms"]
        lines += ["", f"A step at {last['history']} versions costs {growth:.2f}x what it costs at {first['history']} "
                      f"(no hint: {growth_no:.2f}x)."]
    tenant_rows = result.get("tenant_rows") or []
    if tenant_rows:
        lines += ["", "| tenants | step | step, rebuild | published() after a change | after a change, rebuild |",
                  "|---|---|---|---|---|"]
        for r in tenant_rows:
            cells = [f"{r['tenants']:,}"] + [
                f"{r[mode][op]['median_ms']:.2f} ({r[mode][op]['p90_ms']:.2f})"
                for op in ("step", "published_after_change") for mode in ("one entry", "rebuild")]
            lines.append("| " + " | ".join(cells) + " |")
        last = tenant_rows[-1]
        lines += ["", f"At {last['tenants']:,} tenants a step costs {last['rebuild']['step']['median_ms'] / last['one entry']['step']['median_ms']:.1f}x "
                      "as much when every change rebuilds HEAD.json."]
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenant_rows = result.get("tenant_rows") or []
    fig, axes = plt.subplots(1, 2 if tenant_rows else 1, figsize=(11 if tenant_rows else 6, 4), squeeze=False)
    _panel(axes[0][0], "history", "versions in the tenant's history", result["rows"],
           {"hint": "o", "no hint": "s"}, ("step", "latest_published"))
    if tenant_rows:
        _panel(axes[0][1], "tenants", "tenants", tenant_rows, {"one entry": "o", "rebuild": "s"},
               ("step", "published_after_change"))
    fig.suptitle(f"clora bench registry; {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _panel(ax, size_key: str, xlabel: str, rows: list[dict], modes: dict[str, str], ops: tuple[str, str]) -> None:
    """One log-log panel: the median of each of `ops` (a solid and a dotted line) per mode (a marker each)."""
    sizes = [r[size_key] for r in rows]
    for mode, marker in modes.items():
        for op, line in zip(ops, ("-", ":")):
            ax.plot(sizes, [r[mode][op]["median_ms"] for r in rows], f"{marker}{line}", label=f"{op}, {mode}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("median ms per operation")
    ax.legend(fontsize=8)
