"""`clora demo` (what `make demo` runs): the whole loop on the tiny model, then a verdict.

It writes a demo config (its own data directory, free ports, one tenant per simulated preference), runs
`clora up` with `clora simulate` against it for up to `--minutes` (sooner once every tenant has learned, see
`learned`; `--full` runs them all), and then reports per tenant: versions published, reward of the base model's answers vs the last window, adapter swaps seen by the app,
interactions ingested.
`demo.png` shows reward over time per tenant with the moments each new adapter went live. The exit code
is 0 only when every tenant's reward improved; otherwise it says which did not. Interrupted (Ctrl-C,
SIGTERM), it says so above the partial figures, gives no verdict and exits with 130.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import threading
import time
from pathlib import Path

DEMO_PREFERENCES = ["digits", "upper", "short"]
IMPROVEMENT = 0.05  # the last window must beat the base model's answers by at least this much reward
LEARNED = 0.5  # the traffic stops early once every tenant's last window is this far from its base reward to 1
DEMO_LOCK = "demo.lock"  # in the data dir, held for the whole demo: one demo at a time per data dir
PROGRESS_SECONDS = 10.0  # how often the demo prints the rewards and checks whether every tenant has learned


def toml_string(text: str) -> str:
    """`text` as a TOML basic string: JSON's escapes are TOML's (backslash, quote, control characters as
    \\uXXXX), and DEL, which TOML wants escaped too, is."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def demo_config_text(data_dir: Path, model_path: Path, broker_port: int, serving_port: int,
                     preferences: list[str]) -> str:
    tenants = "\n".join(
        f"""
[[tenants]]
name = "{p}-app"
api_key = "sk-demo-{p}-0000"
scorer = "feedback"
mode = "logs"
learning_rate = 1e-2
batch_size = 8
lora = {{ rank = 8, alpha = 16 }}
"""
        for p in preferences
    )
    return f"""# written by `clora demo`; safe to delete
data_dir = {toml_string(str(data_dir))}

[kafka]
bootstrap = "127.0.0.1:{broker_port}"
partitions = 2

[broker]
port = {broker_port}

[model]
path = {toml_string(str(model_path))}

[serving]
port = {serving_port}
max_loras = {len(preferences) + 1}  # + the zero adapter base-model rows use on CPU
dtype = "float32"                   # served log-probs match the learner's
default_max_tokens = 24

[ingest]
flush_seconds = 0.5

[learner]
poll_seconds = 0.5
max_staleness = 8
keep_versions = 9                   # every version whose samples may still be trained keeps its files
# The tiny model is random: its next-token distribution is near uniform over 2,048 tokens, so a policy that
# has learned a preference sits ~log(2048) = 7.6 nats per token from it by construction; the default
# limit of 10 (meant for real models) stopped a demo tenant at KL 10.1 with its reward still climbing.
gate_max_kl = 20.0
{tenants}"""


def learned(summary: dict[str, dict]) -> bool:
    """Whether every tenant has learned its users' preference: an adapter version answered, and the reward
    of its last window (the verdict's) is at least `LEARNED` of the way from its base reward to 1, the most
    a feedback score gives. A stricter bar than the verdict's `IMPROVEMENT`, so that a demo stopped by it
    shows a tenant that has learned, not one whose reward has just started to move; and a run it stops
    passes the verdict."""
    return bool(summary) and all(
        not math.isnan(s["reward_base"])
        and any("@" in v for v in s["versions_seen"])
        and s["reward_last"] >= s["reward_base"] + LEARNED * (1.0 - s["reward_base"])
        for s in summary.values()
    )


def run_demo(cfg, **settings) -> int:
    """The demo (`_run`), one at a time per data dir: a second one would delete the first's live data
    (`<data_dir>/demo`) before anything else, so it holds `<data_dir>/demo.lock` and a second one exits 2."""
    import contextlib

    from clora.cli import data_dir_error, prepare_data_dir
    from storage.files import FileLock, LockBusy

    root = Path(cfg.data_dir).resolve()
    try:
        prepare_data_dir(root)
    except OSError as e:
        print(data_dir_error(root, e), file=sys.stderr)
        return 2
    with contextlib.ExitStack() as held:
        try:
            lock = held.enter_context(FileLock(root / DEMO_LOCK, blocking=False))
        except LockBusy:
            print(f"clora demo: another clora demo is running on {root} (it holds {root / DEMO_LOCK}), or the "
                  "processes of one that was killed are still stopping; wait for it to finish, or give this one "
                  "another data_dir", file=sys.stderr)
            return 2
        return _run(cfg, root, lock=lock, **settings)


def _run(cfg, root: Path, *, lock: int, minutes: float, rate: float, preferences: list[str], seed: int,
         out_png: Path, keep_data: bool = False, full: bool = False) -> int:
    """The demo; `minutes` is the most the simulated apps send traffic: it stops once every tenant has
    `learned` unless `full`. The verdict is the same either way. `lock`: the descriptor holding the demo's
    lock, which the stack's processes hold too: a demo killed outright (SIGKILL) leaves them stopping on
    its death (draining, writing), and the next demo must not delete their data under them meanwhile."""
    from clora.config import load_config
    from clora.simulate import MAX_ANSWER_SECONDS, Simulator, records_to_json, summarise, tenants_from_config
    from clora.up import KILLED_WHILE_STOPPING, up
    from ingest.broker import free_ports
    from clora.cli import base_model_dir, data_dir_error

    demo_dir = root / "demo"
    config_path = demo_dir / "clora.toml"
    try:
        model = base_model_dir(cfg)  # the tiny model unless model.path names one (checked: one line if bad)
        if demo_dir.exists() and not keep_data:
            shutil.rmtree(demo_dir)
        demo_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(
            demo_config_text(demo_dir / "data", Path(model).resolve(), *free_ports(2), preferences),
            encoding="utf-8",
        )
    except OSError as e:
        print(data_dir_error(root, e), file=sys.stderr)
        return 2
    demo_cfg = load_config(config_path, environ={})
    sim_tenants = tenants_from_config(demo_cfg, preferences)
    base_url = demo_cfg.serving.local_url
    # answer_grace: on a CPU the engine shares its cores with training, and an answer that comes late still
    # counts towards the verdict (the demo is not held to an end time, as `clora simulate --seconds` is).
    sim = Simulator(base_url, sim_tenants, rate=rate, duration=minutes * 60, seed=seed,
                    progress_seconds=PROGRESS_SECONDS, answer_grace=MAX_ANSWER_SECONDS)
    done = threading.Event()
    started = {}

    def progress(sim) -> None:
        _progress(sim)
        if not full and learned(summarise(sim.records, sim.tenants)):
            print(f"    demo | every tenant has learned (its last quarter's reward is at least "
                  f"{LEARNED:.0%} of the way from its base reward to 1): stopping the traffic early", flush=True)
            sim.stop.set()  # run() returns, `done` is set: a finished run, with its verdict

    def simulate_when_up() -> None:
        import httpx

        while not sim.stop.is_set():
            try:
                if httpx.get(f"{base_url}/health", timeout=1, trust_env=False).status_code == 200:  # its own child
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if sim.stop.is_set():  # stopped before serving was up
            return
        started["t"] = time.time()
        until = "" if full else ", or until every tenant has learned"
        print(f"    demo | simulating {len(sim_tenants)} tenants at {rate:g} requests/s for up to {minutes:g} min{until}",
              flush=True)
        try:
            sim.run(progress=progress)
        finally:
            done.set()

    threading.Thread(target=simulate_when_up, daemon=True, name="simulate").start()
    outcome = {}

    def stop_traffic() -> None:
        """Before the stack stops (minutes, while ingest drains): whether the simulation had finished, and no
        more requests to a stack that is going away."""
        outcome["finished"] = done.is_set()
        outcome["stopped_at"] = time.time()
        sim.stop.set()

    # The children read the demo's own file only, as demo_cfg was: CLORA_DATA_DIR or CLORA_KAFKA_BOOTSTRAP set
    # for a real deployment must not send the demo's processes into its data or its Kafka group.
    code = up(demo_cfg, str(config_path), until=done.is_set, on_stop=stop_traffic, file_only=True, keep_fds=(lock,))
    finished = outcome.get("finished", done.is_set())
    if code not in (0, KILLED_WHILE_STOPPING):  # a child killed while stopping: the figures are in memory all the same
        print("demo: the stack failed; see the log above")
        return code
    interrupted_after = None
    if not finished:  # `up` returned 0 with the simulation unfinished: Ctrl-C or SIGTERM stopped it
        if "t" not in started:
            print("\ndemo: interrupted before the simulated traffic started")
            return 130
        interrupted_after = outcome.get("stopped_at", time.time()) - started["t"]

    if sim.unreachable is not None:  # the verdict below is of a run cut short: say why
        print(f"demo: the simulated apps stopped early: {sim.unreachable}", flush=True)
    (demo_dir / "records.json").write_text(records_to_json(sim.records))
    summary = summarise(sim.records, sim_tenants)
    stats = _store_stats(demo_cfg.data_dir)
    code = _report(summary, stats, interrupted_after=interrupted_after)  # first: a plot that fails loses none of it
    try:
        _plot(sim.records, sim_tenants, out_png)
    except Exception as e:  # noqa: BLE001 (the figures and the verdict above stand; the plot is an extra)
        print(f"demo: cannot write the reward plot to {out_png}: {type(e).__name__}: {e}", file=sys.stderr)
    else:
        print(f"reward over time: {out_png}")
    return code


def _progress(sim) -> None:
    from clora.simulate import summarise

    parts = []
    for name, s in summarise(sim.records, sim.tenants, window=0.2).items():
        last = s["versions_seen"][-1] if s["versions_seen"] else "-"
        parts.append(f"{name}: reward {s['reward_last']:.2f} ({last})")
    print("    demo | " + "; ".join(parts), flush=True)


def _store_stats(data_dir: Path) -> dict[str, dict]:
    from storage.query import query
    from storage.registry import Registry

    stats: dict[str, dict] = {}
    for row in query(data_dir, "select tenant, count(*) as n from interactions group by 1").to_pylist():
        stats.setdefault(row["tenant"], {})["ingested"] = row["n"]
    for v in Registry(data_dir).versions():
        s = stats.setdefault(v.tenant, {})
        s["published"] = s.get("published", 0) + (v.published_at is not None)
        s["rejected"] = s.get("rejected", 0) + (v.status == "rejected")
    return stats


def _report(summary: dict[str, dict], stats: dict[str, dict], *, interrupted_after: float | None = None) -> int:
    """Prints the per-tenant table; returns the exit code: 0 if every tenant improved, 1 if not, 130 (no
    verdict) for a run interrupted `interrupted_after` seconds into the simulated traffic."""
    header = f"{'tenant':<12} {'prefers':<8} {'requests':>8} {'failed':>6} {'ingested':>8} {'published':>9} " \
             f"{'swaps':>5} {'reward base':>11} {'reward last':>11}  improved"
    if interrupted_after is not None:
        print(f"\ndemo: interrupted after {interrupted_after:.0f}s of simulated traffic; partial figures:")
    print("\n" + header + "\n" + "-" * len(header))
    not_improved = []
    for name, s in summary.items():
        st = stats.get(name, {})
        improved = (
            not math.isnan(s["reward_base"]) and s["reward_last"] >= s["reward_base"] + IMPROVEMENT
        )
        if not improved:
            not_improved.append(name)
        print(
            f"{name:<12} {s['preference']:<8} {s['requests']:>8} {s['failed']:>6} {st.get('ingested', 0):>8} "
            f"{st.get('published', 0):>9} {max(0, len(s['versions_seen']) - 1):>5} {s['reward_base']:>11.3f} "
            f"{s['reward_last']:>11.3f}  {'yes' if improved else 'NO'}"
        )
    failed = sum(s["failed"] for s in summary.values())
    if failed:
        print(f"{failed} request(s) failed")
    if interrupted_after is not None:
        print("interrupted: no verdict on a partial run")
        return 130
    if not_improved:
        print(f"not improved (by at least {IMPROVEMENT}): {', '.join(not_improved)}")
        return 1
    print("every tenant improved")
    return 0


def out_problem(out_png: Path) -> str | None:
    """Why the plot cannot be written to `out_png`, or None. Checked before the run, which takes minutes:
    savefig finds the same only after it. Its directory must exist and be writable, and its extension name
    a format matplotlib writes (savefig picks the format by it)."""
    import os

    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out_png.suffix.lower().removeprefix(".") not in formats:
        return (f"--out {out_png}: the extension must be an image format matplotlib writes "
                f"({', '.join(sorted(formats))})")
    if out_png.is_dir():
        return f"--out {out_png} is a directory"
    if not out_png.parent.is_dir():
        return f"--out {out_png}: {out_png.parent} is not a directory"
    if not os.access(out_png.parent, os.W_OK):
        return f"--out {out_png}: cannot write in {out_png.parent}"
    return None


def _plot(records, tenants, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for i, tenant in enumerate(tenants):
        recs = sorted((r for r in records if r.tenant == tenant.name and r.ok), key=lambda r: r.t)
        if not recs:
            continue
        color = f"C{i}"
        k = max(1, len(recs) // 15)
        xs = [r.t for r in recs]
        ys = [sum(r.score for r in recs[max(0, j - k + 1): j + 1]) / len(recs[max(0, j - k + 1): j + 1])
              for j in range(len(recs))]
        ax.plot(xs, ys, color=color, label=f"{tenant.name} (likes {tenant.preference})")
        seen = set()
        for r in recs:
            if r.adapter_version not in seen:
                seen.add(r.adapter_version)
                if "@" in r.adapter_version:  # a version, not the base model (whatever model.name is)
                    ax.axvline(r.t, color=color, alpha=0.25, linestyle=":")
    ax.set_xlabel("seconds since the simulation started")
    ax.set_ylabel("user feedback score (rolling mean)")
    ax.set_title("clora demo: reward per tenant; dotted lines = a new adapter version went live")
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:  # none when no request succeeded
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)

