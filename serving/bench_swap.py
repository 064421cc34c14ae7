"""`clora bench swap`: how long a published adapter takes to serve traffic, under steady load.

    clora bench swap --tenants 4 --publishes 20 --interval 1.0 --concurrency 8 --out bench-results

Starts a real serving process (`python -m serving`, on a temporary data dir, with its own embedded
broker) with --tenants tenants, each with a first published adapter. --concurrency clients then send
streaming chat requests round-robin over the tenants without pause, while the benchmark publishes
--publishes new versions through the registry (round-robin over tenants, one every --interval seconds on
average, each wait drawn from [0.5, 1.5] x --interval with a fixed seed: with a fixed interval that is a
multiple of the registry poll, every publish would land at the same point of the poll cycle and the
latencies would all be short or all long, run to run), exactly as the learner does. For every publish it finds the first response served by the new version
and reports, over all publishes, p50/p99 of

    publish -> headers    registry publish returned -> first response headers naming the new version
                          (the version is fixed when a request starts: this is the swap latency)
    publish -> complete   ... -> that response's last token

plus failed requests (any error or stream that did not end with a finish reason) and throughput.
The swap latency is bounded below by serving.registry_poll_seconds (the registry is polled).

Prints a table; writes swap.json and swap.png under --out. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from clora.argtypes import positive, positive_int
from clora.bench import BenchError
from clora.processes import terminate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=positive_int, default=4, help="tenants under load (default 4)")
    parser.add_argument("--publishes", type=positive_int, default=20, help="new versions to publish (default 20)")
    parser.add_argument("--interval", type=positive, default=1.0, help="seconds between publishes (default 1.0)")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="concurrent client streams (default 8)")
    parser.add_argument("--tokens", type=positive_int, default=16, help="tokens per response (default 16)")


@dataclass
class Response:
    tenant: str
    label: str
    started: float
    headers_at: float
    done_at: float
    ok: bool
    tokens: int = 0  # completion tokens, from the stream's usage chunk


@dataclass
class Publish:
    tenant: str
    label: str
    at: float


# ---------------------------------------------------------------------------------------------------------
# The serving process


def _write_config(directory: Path, cfg, model_path: Path, bootstrap: str, port: int, tenants: list[str]) -> Path:
    s = cfg.serving
    lines = [
        f'data_dir = "{directory / "data"}"',
        f'log_level = "{cfg.log_level}"',
        "[kafka]", f'bootstrap = "{bootstrap}"',
        "[model]", f'path = "{model_path}"',
        "[serving]", f"port = {port}", f"max_loras = {max(s.max_loras, len(tenants))}",
        f"max_cpu_loras = {max(s.max_cpu_loras, 2 * len(tenants) + 1)}", f"max_lora_rank = {s.max_lora_rank}",
        f"max_model_len = {s.max_model_len}", f"max_num_seqs = {s.max_num_seqs}", f'dtype = "{s.dtype}"',
        f"kv_cache_gib = {s.kv_cache_gib}", f"registry_poll_seconds = {s.registry_poll_seconds}",
    ]
    for t in tenants:
        lines += ["[[tenants]]", f'name = "{t}"', f'api_key = "{t}-bench-key"']
    path = directory / "clora.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _start_server(config: Path, port: int, log_path: Path, timeout: float = 300.0) -> subprocess.Popen:
    import httpx

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(config)], env=env,
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"the serving process exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop_server(process)
    raise BenchError(f"the serving process was not healthy within {timeout:.0f}s; see {log_path}")


def _stop_server(process: subprocess.Popen) -> None:
    terminate(process, 60)


# ---------------------------------------------------------------------------------------------------------
# Load and publishing


async def _load(base_url: str, tenants: list[str], concurrency: int, tokens: int, stop: asyncio.Event,
                responses: list[Response]) -> None:
    import httpx

    async def worker(index: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120, trust_env=False) as http:
            turn = index
            while not stop.is_set():
                tenant = tenants[turn % len(tenants)]
                turn += 1
                started = time.monotonic()
                body = {"model": tenant, "messages": [{"role": "user", "content": f"Request {turn}: five digits?"}],
                        "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
                headers_at, label, finished, generated = started, "?", False, 0
                try:
                    async with http.stream("POST", "/v1/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {tenant}-bench-key"}) as r:
                        headers_at = time.monotonic()
                        label = r.headers.get("x-clora-adapter-version", "?")
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                finished |= any(c.get("finish_reason") for c in chunk.get("choices", []))
                                generated = (chunk.get("usage") or {}).get("completion_tokens", generated)
                        ok = r.status_code == 200 and finished
                except httpx.HTTPError:
                    ok = False
                responses.append(Response(tenant, label, started, headers_at, time.monotonic(), ok, generated))

    await asyncio.gather(*[worker(i) for i in range(concurrency)])


def _publish(data_dir: Path, tenant: str, shapes, rank: int, seed: int) -> str:
    from serving.bench import write_random_adapter
    from storage.registry import Registry

    registry = Registry(data_dir)
    version = registry.create(tenant, parent=None, write=lambda d: write_random_adapter(d, shapes, rank=rank, seed=seed))
    registry.publish(tenant, version.number)
    return version.name


async def _scenario(base_url: str, data_dir: Path, tenants: list[str], shapes, args) -> tuple[list, list, float, float]:
    responses: list[Response] = []
    publishes: list[Publish] = []
    stop = asyncio.Event()
    load = asyncio.create_task(_load(base_url, tenants, args.concurrency, args.tokens, stop, responses))
    await asyncio.sleep(2.0)  # steady state before the first publish
    started = time.monotonic()
    jitter = random.Random(0)
    for i in range(args.publishes):
        tenant = tenants[i % len(tenants)]
        label = await asyncio.to_thread(_publish, data_dir, tenant, shapes, 8, 1000 + i)
        publishes.append(Publish(tenant, label, time.monotonic()))
        await asyncio.sleep(args.interval * jitter.uniform(0.5, 1.5))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(any(r.label == p.label for r in responses) for p in publishes):
        await asyncio.sleep(0.1)
    stop.set()
    await load
    # the rates count the requests that started in the measured window, not the warm-up's before it
    return responses, publishes, time.monotonic() - started, started


def _server_means(metrics_url: str) -> dict[str, float]:
    """Mean swap time and publish -> live time over all swaps, from the server's Prometheus histograms."""
    import httpx

    totals: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=10, trust_env=False).text.splitlines():
        for key, name in (("swap", "clora_serving_adapter_swap_seconds"),
                          ("publish_to_live", "clora_serving_adapter_publish_to_live_seconds")):
            for part in ("sum", "count"):
                if line.startswith(f"{name}_{part}{{"):
                    totals[f"{key}_{part}"] = totals.get(f"{key}_{part}", 0.0) + float(line.rsplit(" ", 1)[1])
    return {key: round(totals.get(f"{key}_sum", 0.0) / max(totals.get(f"{key}_count", 0.0), 1.0), 4)
            for key in ("swap", "publish_to_live")}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


# ---------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from ingest.broker import EmbeddedBroker, free_port
    from clora.cli import base_model_dir
    from serving.adapter_check import base_linear_shapes

    cfg = config_from_args(args)
    model_path = base_model_dir(cfg)
    shapes = base_linear_shapes(model_path)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # before the measurement: a --out that cannot be made loses nothing
    tenants = [f"t{i}" for i in range(args.tenants)]
    print(f"clora bench swap: {model_path}, {args.tenants} tenants, {args.concurrency} streams, "
          f"{args.publishes} publishes every {args.interval}s, registry poll {cfg.serving.registry_poll_seconds}s",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="clora-bench-swap-") as tmp:
        directory = Path(tmp)
        broker = EmbeddedBroker("127.0.0.1", free_port()).start(
            [cfg.kafka.interactions_topic, cfg.kafka.feedback_topic], partitions=1
        )
        port = free_port()
        try:
            config = _write_config(directory, cfg, model_path, broker.bootstrap, port, tenants)
            for i, t in enumerate(tenants):
                _publish(directory / "data", t, shapes, 8, i)
            process = _start_server(config, port, directory / "serving.log")
            try:
                responses, publishes, seconds, window_start = asyncio.run(
                    _scenario(f"http://127.0.0.1:{port}", directory / "data", tenants, shapes, args)
                )
                server_side = _server_means(f"http://127.0.0.1:{port}/metrics")
            finally:
                _stop_server(process)
        finally:
            broker.stop()

    to_headers, to_done, unseen = [], [], []
    for p in publishes:
        first = min((r for r in responses if r.label == p.label and r.ok), key=lambda r: r.headers_at, default=None)
        if first is None:
            unseen.append(p.label)
            continue
        to_headers.append(first.headers_at - p.at)
        to_done.append(first.done_at - p.at)
    failed = sum(1 for r in responses if not r.ok)
    measured = [r for r in responses if r.started >= window_start]  # the warm-up's requests are not in `seconds`
    tokens = sum(r.tokens for r in measured if r.ok)
    result = {
        "benchmark": "swap",
        "model": str(model_path),
        "tenants": args.tenants,
        "concurrency": args.concurrency,
        "publishes": args.publishes,
        "interval_s": args.interval,
        "registry_poll_seconds": cfg.serving.registry_poll_seconds,
        "requests": len(responses),
        "failed_requests": failed,
        "unseen_versions": unseen,
        "publish_to_headers_s": {"p50": _percentile(to_headers, 50), "p99": _percentile(to_headers, 99),
                                 "max": max(to_headers, default=float("nan"))},
        "publish_to_complete_s": {"p50": _percentile(to_done, 50), "p99": _percentile(to_done, 99),
                                  "max": max(to_done, default=float("nan"))},
        "server_mean_s": server_side,
        "requests_per_s": round(len(measured) / seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "samples_publish_to_headers_s": [round(x, 4) for x in to_headers],
    }
    print(f"{'':24}{'p50':>8}{'p99':>8}{'max':>8}")
    for key, name in (("publish_to_headers_s", "publish -> headers"), ("publish_to_complete_s", "publish -> complete")):
        v = result[key]
        print(f"{name:24}{v['p50']:>8.3f}{v['p99']:>8.3f}{v['max']:>8.3f}")
    print(f"server side, mean over swaps: registry publish -> version current "
          f"{server_side['publish_to_live']:.3f}s, of which validate + load {server_side['swap']:.3f}s")
    print(f"requests {len(responses)} ({result['requests_per_s']}/s, {result['tokens_per_s']} tokens/s), "
          f"failed {failed}, versions never seen: {len(unseen)}")

    (out / "swap.json").write_text(json.dumps(result, indent=2))
    _plot(to_headers, to_done, out / "swap.png")
    print(f"wrote {out / 'swap.json'} and {out / 'swap.png'}")
    return 0 if failed == 0 and not unseen else 1


def _plot(to_headers: list[float], to_done: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for values, name in ((to_headers, "publish -> first headers"), (to_done, "publish -> first complete response")):
        xs = sorted(values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("seconds after publish")
    ax.set_ylabel("fraction of publishes")
    ax.set_title("Adapter hot-swap latency under load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
