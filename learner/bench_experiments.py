"""`clora bench experiments`: N RL experiments at once on one always-on stack, against one at a time.

    clora bench experiments --n 1,2,4,8 --steps 12 --out bench-results/experiments   # the tiny model, CPU
    learner/bench_experiments_gpu.sh OUTDIR                         # GPU: random Qwen3-4B shape, bf16, vLLM
    clora bench experiments --from-json OLD/experiments.json --out DIR   # re-read runs, start nothing

An experiment is one tenant with its own adapter and its own objective (a programmatic scorer: uppercase,
length:48, digits, ...; experiment i always has the same name, objective and so initial adapter), trained
in rollouts mode (GRPO through the serving tier) for `--steps` steps from the same prompts file. For each
N in `--n`, experiments 0..N-1 run two ways:

  (a) concurrent: one serving process (one vLLM engine batching every experiment's rollouts) and one
      learner cycling through the N tenants; the wall time runs from the learner's loop start (the stack
      is always on: its start-up is reported, not counted) to the last experiment's last step;
  (b) alone: each experiment as a fresh single-tenant run of the same code, serving and learner processes
      started for it and stopped after it; its time is its run (loop start to last step) plus a stack's
      start-up (what a single-tenant framework pays per experiment). An experiment's alone run does not
      depend on N, so each is run once and (b) for N sums experiments 0..N-1 (`--alone K` runs only the
      first K and takes the others' runs at their mean). The start-up added is the median of every stack
      start in the benchmark: the same code each time, and on a shared machine one slow start would
      otherwise swing the ratio (each measured start-up is in the JSON, and so is (b)'s wall time with
      the measured ones, `wall_b_measured`).

Both are `python -m serving --config FILE` and a learner process running `learner.loop.run`, the loop of
`clora learn` (`python -m learner.bench_experiments`, `worker` below: `learner.__main__`'s construction,
plus a timeline taken through `run(on_step=...)` and a stop once every tenant has done its steps), with
OMP_NUM_THREADS at half the cores, as `clora up` starts the learner. The processes share one embedded
Kafka broker, started once (infrastructure, part of neither stack's cost).

Reported per N: wall time (a) and (b); the experiment-throughput ratio (b)/(a), and the same without
(b)'s start-ups (what concurrency alone buys); per-step latency (the interval between an experiment's
consecutive steps, mean and p90) and time to first step (loop start to an experiment's first step);
each experiment's final reward (mean reward of the samples of its last `--final-window` steps) in (a) and
(b), the mean difference and its 95% half-width (paired t over the experiments, so run-to-run randomness
counts); where the learner's time goes per step (waiting for rollouts, scoring, training, gate probes,
publishing, other; first steps apart, they carry the warm-up), the sampler's time per batch (it runs in the
background), the CPU the serving tier's processes and the learner processes used per step (core-seconds
over the run, sampled from /proc: the engine's work runs beside the learner's, so the wall times alone
do not say which side fills the machine), the serving tier's swap time and publish-to-live lag, and the
most versions (registry numbers, rejected candidates included) a trained sample was behind.

Prints the table, writes experiments.json, experiments.png (ratio vs N, latency vs N) and experiments.md
(the table for BENCHMARKS.md, with date and machine) under --out; the processes' logs and data
directories stay under --out/work. Not part of the test suite; timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from clora.argtypes import non_negative, non_negative_int, positive, positive_int, positive_int_list
from clora.bench import BenchError, BenchInputError, machine
from clora.config import lora_rank_size
from clora.processes import terminate

REPO = Path(__file__).resolve().parents[1]

# Experiment i's objective. On the tiny model's random text, each leaves rewards that differ within half
# or more of the groups of 4 completions, so GRPO has something to learn from most steps.
OBJECTIVES = (
    "uppercase",
    "length:48",
    "length:32",
    "regex:^\\s",
    "digits",
    "regex:[0-9]",
    "regex:^[A-Z]",
    "regex:[A-Z]{2}",
)
PROMPTS = (
    "Write a number.",
    "Tell me about cats.",
    "hello",
    "What is 2 + 2?",
    "Name a colour.",
    "Say something short.",
    "Count to five.",
    "Describe the sea.",
    "What time is it?",
    "Give me a word.",
    "Where do birds live?",
    "Shout a greeting.",
    "List three things.",
    "Tell me a secret.",
    "How are you?",
    "Spell your name.",
)
RATIO_TARGET = 2.81  # C-LoRA's experiment throughput at N = 8
RATIO_AIM = 4.0
LATENCY_FACTOR = 3.0  # per-step latency at the largest N under this times N = 1's
HEALTH_TIMEOUT_S = 600
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # its own serving: never via a proxy


@dataclass(frozen=True)
class Experiment:
    index: int
    name: str
    scorer: str
    api_key: str


def experiments(n: int) -> list[Experiment]:
    return [
        Experiment(i, f"exp-{i}", OBJECTIVES[i % len(OBJECTIVES)], f"bench-exp-{i}-key")
        for i in range(n)
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=positive_int_list, default=[1, 2, 4, 8],
                        help="experiment counts, comma separated (default 1,2,4,8)")
    parser.add_argument("--steps", type=positive_int, default=6, help="training steps per experiment (default 6)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples per step (default 8)")
    parser.add_argument("--group-size", type=positive_int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per completion (default 16)")
    parser.add_argument("--learning-rate", type=positive, default=1e-2, help="Adam learning rate (default 1e-2)")
    parser.add_argument("--rank", type=positive_int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--gate-prompts", type=non_negative_int, default=None,
                        help="learner.gate_prompts: publish-gate probe prompts (default: the config's default)")
    parser.add_argument("--gate-reward-z", type=non_negative, default=None,
                        help="learner.gate_reward_z: standard errors of the probe's per-prompt changes the gate "
                        "allows on top of its tolerance (default: the config's default; 0: tolerance alone)")
    parser.add_argument("--round-tenants", type=positive_int, default=None, metavar="K",
                        help="learner.round_tenants: ready experiments stepping together, their gate probes decoded "
                        "in one batch (default: the config's default; 1: one at a time)")
    parser.add_argument("--update-epochs", type=positive_int, default=None, metavar="K",
                        help="learner.update_epochs: optimizer steps on each batch (default: the config's default, 1)")
    parser.add_argument("--no-sample-ahead", action="store_true",
                        help="sample each step's rollouts only after the previous commit (learner.sample_ahead off)")
    parser.add_argument("--alone", type=positive_int, default=None, metavar="K",
                        help="run only experiments 0..K-1 alone; the others' (b) time is their mean (default: all)")
    parser.add_argument("--final-window", type=positive_int, default=None, metavar="W",
                        help="steps whose samples make the final reward (default: a third of --steps, at least 1)")
    parser.add_argument("--model", type=Path, default=None, help="base model directory (default: the tiny model)")
    parser.add_argument("--dtype", default="float32", help="serving engine dtype (default float32: the learner's "
                        "and the server's log-probs agree on CPU)")
    parser.add_argument("--gpu", action="store_true", help="learner on cuda, engine KV cache --kv-cache-gib")
    parser.add_argument("--kv-cache-gib", type=non_negative, default=None,
                        help="engine KV cache (default 0.5 on CPU, 16 with --gpu)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None, help="engine batch (default 64 on CPU, 128 with --gpu)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="OMP_NUM_THREADS of the learner processes (default: $OMP_NUM_THREADS if set, else "
                        "half the cores, as `clora up` gives the learner)")
    parser.add_argument("--learners", type=positive_int, default=1, metavar="K",
                        help="learner processes of each concurrent stack (learner.processes), each training its shard "
                        "of the experiments, the cores of --threads shared out between them; an experiment alone "
                        "always has one (default 1)")
    parser.add_argument("--max-loras", type=positive_int, default=None,
                        help="serving.max_loras of every stack (default: its experiments + 1); one value for all "
                        "stacks gives every engine the same shape (a GPU then compiles it once)")
    parser.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                        help="start nothing: rewrite the table, JSON and PNG from the runs in an earlier "
                        "experiments.json")
    parser.add_argument("--timeout", type=positive, default=1800, help="seconds one run may take (default 1800)")


# ---------------------------------------------------------------------------------------------------------
# The benchmark


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = from_json(Path(args.from_json)) if args.from_json is not None else analyse(measure(args, out))
    (out / "experiments.json").write_text(json.dumps(result, indent=1) + "\n")  # first: the runs are kept
    markdown = to_markdown(result)
    (out / "experiments.md").write_text(markdown)
    plot(result, out / "experiments.png")
    print(table(result))
    print()
    print(markdown)
    return 0


def from_json(path: Path) -> dict:
    """An earlier experiments.json analysed again; BenchInputError when the file cannot be read or is not such
    a result (its table and markdown are made here once, so that nothing is written from a file that fails
    half-way)."""
    try:
        result = json.loads(path.read_text())
    except OSError as e:
        raise BenchInputError(f"--from-json {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise BenchInputError(f"--from-json {path}: not JSON: {e}") from e
    if not isinstance(result, dict) or not isinstance(result.get("runs"), dict):
        raise BenchInputError(f"--from-json {path}: not an experiments.json of this benchmark (it has no \"runs\")")
    try:
        result = analyse(result)
        table(result)  # what they read beyond the runs: a field missing there fails here, not half-way through
        to_markdown(result)
        return result
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        what = f"no {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise BenchInputError(f"--from-json {path}: not an experiments.json of this benchmark ({what})") from e


def measure(args: argparse.Namespace, out: Path) -> dict:
    """Runs every stack (interleaved: b, a, b, a, ... so a drift in the shared machine's load touches both
    modes); returns the settings and each run's record (`analyse` turns them into the table)."""
    from clora.cli import config_from_args
    from ingest.broker import EmbeddedBroker, free_port
    from clora.cli import base_model_dir

    cfg = config_from_args(args)
    try:  # a list from the command line (positive_int_list); programmatic callers may give "1,2"
        counts = positive_int_list(args.n) if isinstance(args.n, str) else sorted(set(args.n))
    except argparse.ArgumentTypeError:
        counts = []
    if not counts or counts[0] < 1 or args.steps < 1:
        raise BenchInputError(f"--n must list positive experiment counts (got {args.n!r}) and --steps be >= 1")
    if args.learners < 1:
        raise BenchInputError(f"--learners must be >= 1 (got {args.learners})")
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model = (args.model or base_model_dir(cfg)).resolve()
    prompts_file = work / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    settings = _settings(args, model, prompts_file)
    everyone = experiments(counts[-1])
    alone_k = counts[-1] if args.alone is None else max(1, min(args.alone, counts[-1]))

    broker = EmbeddedBroker("127.0.0.1", free_port())
    broker.start([cfg.kafka.interactions_topic, cfg.kafka.feedback_topic], partitions=1)
    alone: dict[int, dict] = {}
    concurrent: dict[int, dict] = {}
    started = time.monotonic()
    try:
        for n in counts:
            for e in everyone[: min(n, alone_k)]:
                if e.index not in alone:
                    alone[e.index] = _timed_run(f"alone-{e.index}", [e], settings, work, broker.bootstrap, args)
            concurrent[n] = _timed_run(f"concurrent-{n}", everyone[:n], settings, work, broker.bootstrap, args)
    finally:
        broker.stop()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(args.gpu),
        "model": str(model),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
        "steps": args.steps,
        "final_window": args.final_window or max(1, args.steps // 3),
        "bench_seconds": time.monotonic() - started,
        "runs": {"concurrent": {str(n): r for n, r in concurrent.items()}, "alone": {str(i): r for i, r in alone.items()}},
    }


def analyse(result: dict) -> dict:
    """`result` with the table's rows (and the median start-up they use) computed from its runs."""
    concurrent = {int(n): r for n, r in result["runs"]["concurrent"].items()}
    alone = {int(i): r for i, r in result["runs"]["alone"].items()}
    steps, window = result["steps"], result["final_window"]
    startup = statistics.median(summarize(r, steps, window)["startup"] for r in [*alone.values(), *concurrent.values()])
    rows = [compare(n, concurrent[n], [alone.get(i) for i in range(n)], steps, window, startup) for n in sorted(concurrent)]
    return {**result, "alone_measured": sorted(alone), "startup_median": startup,
            "stack_starts": len(alone) + len(concurrent), "rows": rows}


def _settings(args: argparse.Namespace, model: Path, prompts_file: Path) -> dict:
    from clora.config import LearnerConfig

    return {
        "model": model,
        "dtype": args.dtype,
        "device": "cuda" if args.gpu else "cpu",
        "threads": args.threads or int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 2) // 2)),
        "learners": args.learners,
        "max_loras": args.max_loras,
        "kv_cache_gib": args.kv_cache_gib if args.kv_cache_gib is not None else (16.0 if args.gpu else 0.5),
        "max_num_seqs": args.max_num_seqs or (128 if args.gpu else 64),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "learning_rate": args.learning_rate,
        "rank": args.rank,
        "gate_prompts": args.gate_prompts if args.gate_prompts is not None else LearnerConfig().gate_prompts,
        "gate_reward_z": args.gate_reward_z if args.gate_reward_z is not None else LearnerConfig().gate_reward_z,
        "sample_ahead": not args.no_sample_ahead,
        "round_tenants": args.round_tenants if args.round_tenants is not None else LearnerConfig().round_tenants,
        "update_epochs": args.update_epochs if args.update_epochs is not None else LearnerConfig().update_epochs,
        "prompts_file": prompts_file,
    }


def _timed_run(label: str, group: list[Experiment], settings: dict, work: Path, bootstrap: str, args) -> dict:
    print(f"[bench experiments] {label}: {len(group)} experiment(s) x {settings['steps']} steps", flush=True)
    record = run_stack(work / label, group, settings, bootstrap=bootstrap, timeout=args.timeout)
    s = summarize(record, settings["steps"], 1)
    print(f"[bench experiments] {label}: start-up {s['startup']:.1f}s, run {s['run']:.1f}s", flush=True)
    return record


# ---------------------------------------------------------------------------------------------------------
# One stack: a serving process and a learner process for a group of experiments


def write_config(path: Path, group: list[Experiment], settings: dict, *, data_dir: Path, bootstrap: str, port: int) -> Path:
    """The clora.toml of one stack (serving and learner read the same file)."""
    n = len(group)
    doc = {
        "data_dir": str(data_dir),
        "log_level": "INFO",
        "kafka": {"bootstrap": bootstrap, "partitions": 1},
        "model": {"path": str(settings["model"])},
        "serving": {
            "host": "127.0.0.1",
            "port": port,
            # every tenant plus the zero adapter that stands in for the base model (CPU)
            "max_loras": settings["max_loras"] or n + 1,
            "max_cpu_loras": 2 * n + 2,  # a tenant's outgoing version stays while its requests finish
            "max_lora_rank": lora_rank_size(max(16, settings["rank"])),
            "max_model_len": 256,
            "max_num_seqs": settings["max_num_seqs"],
            "dtype": settings["dtype"],
            "kv_cache_gib": settings["kv_cache_gib"],
            "registry_poll_seconds": 0.1,
        },
        "learner": {
            "poll_seconds": 0.1,
            "device": settings["device"],
            "max_new_tokens": settings["max_tokens"],
            "gate_prompts": settings["gate_prompts"],
            "gate_reward_z": settings["gate_reward_z"],
            "sample_ahead": settings["sample_ahead"],
            "round_tenants": settings["round_tenants"],
            "update_epochs": settings.get("update_epochs", 1),
        },
        "tenants": [
            {
                "name": e.name,
                "api_key": e.api_key,
                "scorer": e.scorer,
                "mode": "rollouts",
                "prompts_file": str(settings["prompts_file"]),
                "batch_size": settings["batch_size"],
                "group_size": settings["group_size"],
                "learning_rate": settings["learning_rate"],
                "lora": {"rank": settings["rank"], "alpha": 2.0 * settings["rank"]},
            }
            for e in group
        ],
    }
    path.write_text(to_toml(doc), encoding="utf-8")
    return path


def run_stack(directory: Path, group: list[Experiment], settings: dict, *, bootstrap: str, timeout: float) -> dict:
    """Starts serving, waits for it, starts the learner (`settings["learners"]` shard processes when the group
    has several experiments), waits for every experiment's steps, stops them all. Returns the times (epoch
    seconds) and the learners' merged timeline."""
    from ingest.broker import free_port

    if directory.exists():  # a stack starts from nothing: an old run's registry would be resumed
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    port = free_port()
    config = write_config(directory / "clora.toml", group, settings, data_dir=directory / "data", bootstrap=bootstrap,
                          port=port)
    url = f"http://127.0.0.1:{port}"
    record = {"experiments": [e.name for e in group], "objectives": {e.name: e.scorer for e in group},
              "spawned": time.time()}
    serving = _spawn([sys.executable, "-m", "serving", "--config", str(config)], directory / "serving.log")
    learners: list[subprocess.Popen] = []
    cpu = CpuSampler()
    cpu.watch("serving", serving.pid)
    try:
        _wait_healthy(url, serving, directory / "serving.log")
        record["serving_ready"] = time.time()
        shards = min(settings.get("learners", 1), len(group))
        threads = max(1, settings["threads"] // shards)
        for k in range(shards):
            shard = ["--shard", f"{k}/{shards}"] if shards > 1 else []
            learners.append(_spawn(
                [sys.executable, "-m", "learner.bench_experiments", "--config", str(config), "--steps",
                 str(settings["steps"]), "--timeline", str(directory / f"timeline-{k}.json"), *shard],
                directory / f"learner-{k}.log",
                {"OMP_NUM_THREADS": str(threads)},
            ))
        record["learner_spawned"] = time.time()
        for learner in learners:
            cpu.watch("learner", learner.pid)
        cpu.start()
        deadline = time.monotonic() + timeout
        timelines = []
        for k, learner in enumerate(learners):
            log = directory / f"learner-{k}.log"
            try:
                code = learner.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"the learner did not finish within {timeout:.0f}s:\n{_tail(log)}") from None
            timeline = directory / f"timeline-{k}.json"
            if code != 0 or not timeline.exists():
                raise BenchError(f"the learner exited with {code}:\n{_tail(log)}")
            timelines.append(json.loads(timeline.read_text()))
        record["learners"] = shards
        record["timeline"] = merge_timelines(timelines)
        record["serving_metrics"] = serving_metrics(url)
    finally:
        record["cpu"] = cpu.stop()
        for process in (*learners, serving):
            _stop(process)
    record["stopped"] = time.time()
    return record


def merge_timelines(timelines: list[dict]) -> dict:
    """One timeline from the learner shards': the run starts when the first shard is ready (a shard that
    loads later has its loading counted in the run, never hidden in start-up)."""
    return {
        "started": min(t["started"] for t in timelines),
        "ready": min(t["ready"] for t in timelines),
        "finished": max(t["finished"] for t in timelines),
        "steps": sorted((s for t in timelines for s in t["steps"]), key=lambda s: s["t"]),
        "errors": {k: v for t in timelines for k, v in t.get("errors", {}).items()},
    }


class CpuSampler:
    """Samples, every `period` seconds in a thread, the CPU seconds (user + system) used so far by each
    watched role: the processes of each session watched under it (a process `_spawn` started, which leads
    a session of its own, and its descendants, which stay in it: serving's engine core and workers). So
    the table can say how much of the machine each side of the stack used per step, which the phases'
    wall times do not (the engine's work runs beside the learner's). Linux only (/proc); elsewhere it
    records nothing. A process that exits keeps the seconds it was last seen with (a learner shard that
    is done before the others stops counting, but what it used still counts)."""

    def __init__(self, period: float = 0.5):
        self.period = period
        self.sessions: dict[int, str] = {}  # session id -> role
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._seen: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds when last seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def watch(self, role: str, session: int) -> None:
        self.sessions[session] = role

    def start(self) -> None:
        if Path("/proc/self/stat").exists():
            self._thread.start()

    def stop(self) -> dict:
        """Stops sampling; returns {"t": [epoch s], role: [CPU s], ...}, one entry per sample."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        out: dict[str, list[float]] = {"t": [t for t, _ in self.samples]}
        for role in dict.fromkeys(self.sessions.values()):
            out[role] = [by_role.get(role, 0.0) for _, by_role in self.samples]
        return out

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), self._read()))
            if self._stop.wait(self.period):
                self.samples.append((time.time(), self._read()))
                return

    def _read(self) -> dict[str, float]:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):  # gone meanwhile
                continue
            role = self.sessions.get(int(fields[3]))  # after the name: state, ppid, pgrp, session, ...
            if role is not None:
                self._seen[int(entry.name)] = (role, (int(fields[11]) + int(fields[12])) / self._tick)
        by_role: dict[str, float] = {}
        for role, used in self._seen.values():
            by_role[role] = by_role.get(role, 0.0) + used
        return by_role


def cpu_between(cpu: dict | None, role: str, start: float, end: float) -> float:
    """CPU seconds the role used between epoch times `start` and `end`, read off `CpuSampler.stop`'s samples
    (linear between two samples); NaN when the samples do not cover the window."""
    if not cpu or role not in cpu or len(cpu["t"]) < 2 or end < start:
        return math.nan
    times, used = cpu["t"], cpu[role]
    if start < times[0] or end > times[-1]:
        return math.nan

    def at(t: float) -> float:
        i = min(max(1, bisect.bisect_left(times, t)), len(times) - 1)
        t0, t1 = times[i - 1], times[i]
        share = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return used[i - 1] + share * (used[i] - used[i - 1])

    return at(end) - at(start)


def _spawn(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "wb") as log:  # its own process group: `_stop` can end what it leaves behind
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_healthy(url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise BenchError(f"the serving process exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            with _LOCAL.open(url + "/health", timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise BenchError(f"the serving process was not healthy within {HEALTH_TIMEOUT_S}s:\n{_tail(log_path)}")
        time.sleep(0.2)


def _stop(process: subprocess.Popen | None, timeout: float = 60.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; then ends whatever is left in the process's group (a serving
    process stopped while its engine starts can leave the engine's core process behind)."""
    if process is None:
        return
    terminate(process, timeout)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty: nothing was left behind
        pass


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def serving_metrics(url: str) -> dict:
    """Per tenant from the serving tier's /metrics: swaps, swap seconds, publish-to-live seconds (sums)."""
    from prometheus_client.parser import text_string_to_metric_families

    with _LOCAL.open(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted = {
        "clora_serving_adapter_swap_seconds_sum": "swap_seconds",
        "clora_serving_adapter_swap_seconds_count": "swaps",
        "clora_serving_adapter_publish_to_live_seconds_sum": "publish_to_live_seconds",
        "clora_serving_adapter_publish_to_live_seconds_count": "publish_to_live_count",
        "clora_serving_completion_tokens_total": "completion_tokens",
    }
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None and "tenant" in sample.labels:
                out.setdefault(sample.labels["tenant"], {})[key] = sample.value
    return out


def to_toml(doc: dict) -> str:
    """The few TOML shapes the config needs: scalars, inline tables, tables and arrays of tables."""

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"cannot write {v!r} ({type(v).__name__}) as TOML")

    lines = [f"{k} = {value(v)}" for k, v in doc.items() if not isinstance(v, (dict, list))]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]", *(f"{kk} = {value(vv)}" for kk, vv in v.items())]
    for k, v in doc.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                lines += ["", f"[[{k}]]", *(f"{kk} = {value(vv)}" for kk, vv in item.items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# The learner process of a stack


def worker(argv: list[str] | None = None) -> int:
    """`python -m learner.bench_experiments --config FILE --steps S --timeline FILE`: the learner loop
    (`learner.loop.run`, as `clora learn` runs it) until every tenant has committed S steps; writes the
    timeline: when the loop started, and every step's time, rewards and phase timings."""
    parser = argparse.ArgumentParser(prog="python -m learner.bench_experiments",
                                     description="The learner process of `clora bench experiments`.")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--steps", required=True, type=int)
    parser.add_argument("--timeline", required=True, type=Path)
    parser.add_argument("--shard", default=None, metavar="K/N", help="train only this learner shard's experiments")
    args = parser.parse_args(argv)
    started = time.time()

    from clora.cli import setup_logging
    from clora.config import load_config
    from clora.cli import base_model_dir
    from learner.loop import Learner, run as run_loop
    from learner.types import Shard

    cfg = load_config(args.config)
    setup_logging(cfg.log_level)
    path = base_model_dir(cfg)
    shard = Shard.parse(args.shard) if args.shard else None
    learner = Learner(cfg, model_path=path, progress=False, shard=shard)
    configured = [t.name for t in cfg.tenants]
    dealt = shard.deal(configured) if shard is not None else {}
    names = [name for name in configured if shard is None or shard.owns(name, dealt)]
    ready = time.time()
    steps: list[dict] = []
    done: dict[str, int] = {}
    stop = threading.Event()

    def on_step(record) -> None:
        steps.append({
            "tenant": record.tenant,
            "step": record.step,
            "t": time.time(),
            "decision": record.decision,
            "reward_mean": record.row.get("reward_mean"),
            "rewards": list(record.rewards),
            "timings": record.timings,
            "staleness": record.staleness,
            "shard": args.shard,
        })
        done[record.tenant] = record.step
        if record.step >= args.steps and learner.prefetcher is not None:
            learner.prefetcher.discard(record.tenant)  # its samples ahead would take the engine from the rest
        if all(done.get(name, 0) >= args.steps for name in names):
            stop.set()

    # An experiment that has made its steps stops (as it does alone): training it on, or sampling its next
    # batches, would take learner turns and engine time from those still running, which one alone never pays.
    pending, start_prefetch = learner.pending, learner._start_prefetch
    learner.pending = lambda **kw: {name: 0 if done.get(name, 0) >= args.steps else n
                                    for name, n in pending(**kw).items()}

    def prefetch_unfinished(rt, *, ahead: bool = False) -> None:
        if rt.step + (2 if ahead else 1) <= args.steps:  # the step the batch would be for
            start_prefetch(rt, ahead=ahead)

    learner._start_prefetch = prefetch_unfinished
    run_loop(cfg, model_path=path, learner=learner, stop=stop, on_step=on_step,
             max_steps=3 * args.steps * len(names), progress=False)
    errors = {name: t.error for name, t in learner.tenants.items() if t.error}
    args.timeline.write_text(json.dumps({
        "started": started, "ready": ready, "finished": time.time(), "steps": steps, "errors": errors,
    }))
    return 0 if all(done.get(name, 0) >= args.steps for name in names) else 1


# ---------------------------------------------------------------------------------------------------------
# Reading the runs (pure)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# Two-sided 95% quantiles of Student's t by degrees of freedom (the normal's 1.96 beyond the table).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile for `df` degrees of freedom (the nearest tabulated df at or below)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[max(k for k in _T975 if k <= df)] if df <= 60 else 1.96


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def summarize(record: dict, steps: int, window: int) -> dict:
    """One stack's run: start-up, run time, per-step latencies, each tenant's rewards, the time split."""
    timeline = record["timeline"]
    ready = timeline["ready"]
    by_tenant: dict[str, list[dict]] = {name: [] for name in record["experiments"]}
    for s in timeline["steps"]:
        if s["step"] <= steps:
            by_tenant.setdefault(s["tenant"], []).append(s)
    first, intervals, rewards = {}, [], {}
    for name, rows in by_tenant.items():
        rows.sort(key=lambda s: s["step"])
        times = [s["t"] for s in rows]
        if times:
            first[name] = times[0] - ready
            intervals += [b - a for a, b in zip(times, times[1:])]
        tail = [r for s in rows[-window:] for r in s["rewards"]]
        # The final reward's standard error takes the window's steps as the units: one step's samples share
        # an adapter and prompts, so their spread understates the noise. A window of one step: its samples.
        units = [_mean(s["rewards"]) for s in rows[-window:] if s["rewards"]]
        if len(units) < 2:
            units = tail
        rewards[name] = {
            "first": _mean(rows[0]["rewards"]) if rows else math.nan,
            "final": _mean(tail),
            "final_se": statistics.stdev(units) / math.sqrt(len(units)) if len(units) > 1 else math.nan,
            "final_units": len(units),
            "steps": len(rows),
        }
    last = max((s["t"] for rows in by_tenant.values() for s in rows), default=ready)
    all_steps = [s for rows in by_tenant.values() for s in rows]
    later = [s for rows in by_tenant.values() for s in rows[1:]]  # first steps carry the warm-up: apart
    phases = {key: _mean([s["timings"][key] for s in later if key in s["timings"]]) for key in PHASE_COLUMNS}
    cpu = {role: cpu_between(record.get("cpu"), role, ready, last) / len(all_steps) if all_steps else math.nan
           for role in CPU_ROLES}
    metrics = record.get("serving_metrics", {})
    swaps = sum(m.get("swaps", 0) for m in metrics.values())
    lags = sum(m.get("publish_to_live_count", 0) for m in metrics.values())
    return {
        "serving_startup": record["serving_ready"] - record["spawned"],
        "learner_startup": ready - record["learner_spawned"],
        "startup": ready - record["spawned"],
        "run": last - ready,
        "total": last - record["spawned"],
        "teardown": record["stopped"] - last,
        "first_step": first,
        "latencies": intervals,
        "rewards": rewards,
        "phases": phases,
        "cpu": cpu,
        "swap_seconds": sum(m.get("swap_seconds", 0.0) for m in metrics.values()) / swaps if swaps else math.nan,
        "publish_to_live": sum(m.get("publish_to_live_seconds", 0.0) for m in metrics.values()) / lags if lags else math.nan,
        "staleness_max": max((s["staleness"] for s in all_steps if s.get("staleness") is not None), default=None),
        "steps": len(all_steps),
        "rejected": sum(s.get("decision") == "rejected" for s in all_steps),
        "rejected_by": {name: sum(s.get("decision") == "rejected" for s in rows) for name, rows in by_tenant.items()},
        "steps_by": {name: len(rows) for name, rows in by_tenant.items()},
        "errors": timeline.get("errors", {}),
    }


def compare(n: int, concurrent: dict, alone: list[dict | None], steps: int, window: int, startup: float) -> dict:
    """One row of the table: N experiments concurrently (a) against each alone (b).

    (b)'s time is, per experiment, its run (loop start to last step) plus `startup`, the median start-up
    of every stack the benchmark started: the start-up is the same code each time, and on a shared machine
    one slow start would otherwise swing the ratio. The sums of what was measured are kept beside it."""
    a = summarize(concurrent, steps, window)
    measured = [summarize(r, steps, window) for r in alone if r is not None]
    if not measured:
        raise ValueError(f"N={n}: no experiment was run alone")
    missing = n - len(measured)  # experiments not run alone: their run time is the measured ones' mean
    runs_b = sum(b["run"] for b in measured) + missing * _mean([b["run"] for b in measured])
    startup_b = n * startup
    wall_b = runs_b + startup_b
    wall_b_measured = sum(b["total"] for b in measured) + missing * _mean([b["total"] for b in measured])
    experiments_ = []
    b_by_name = {name: b for b in measured for name in b["rewards"]}
    for name, ra in a["rewards"].items():
        rb = b_by_name.get(name, {}).get("rewards", {}).get(name)
        entry = {"name": name, "objective": concurrent["objectives"][name], "first_a": ra["first"],
                 "final_a": ra["final"], "first_b": math.nan, "final_b": math.nan, "diff": math.nan, "noise": math.nan}
        if rb is not None:
            df = ra["final_units"] + rb["final_units"] - 2
            entry.update(first_b=rb["first"], final_b=rb["final"], diff=ra["final"] - rb["final"],
                         noise=t_quantile_975(df) * math.hypot(ra["final_se"], rb["final_se"]) if df >= 1 else math.nan)
        experiments_.append(entry)
    diffs = [e["diff"] for e in experiments_ if not math.isnan(e["diff"])]
    # Rewards and rejections of (a) against (b) over the same experiments: with --alone K < N only the K run
    # alone have a (b), and each experiment has its own objective (and its own reward scale).
    paired = [e for e in experiments_ if not math.isnan(e["diff"])]
    paired_names = {e["name"] for e in paired}
    paired_steps_a = sum(a["steps_by"].get(name, 0) for name in paired_names)
    if len(diffs) >= 2:  # paired over experiments: the spread of the differences includes run-to-run randomness
        noise = t_quantile_975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    else:  # one experiment: the noise of its final reward over the window's steps (one run each)
        noise = next((e["noise"] for e in experiments_ if not math.isnan(e["diff"])), math.nan)
    b_latencies = [x for b in measured for x in b["latencies"]]
    return {
        "n": n,
        "wall_a": a["run"],
        "startup_a": a["startup"],
        "wall_b": wall_b,
        "startup_b": startup_b,
        "wall_b_measured": wall_b_measured,
        "alone_measured": len(measured),
        "ratio": wall_b / a["run"] if a["run"] > 0 else math.nan,
        "ratio_without_startup": runs_b / a["run"] if a["run"] > 0 else math.nan,
        "latency_mean_a": _mean(a["latencies"]),
        "latency_p90_a": percentile(a["latencies"], 90),
        "latency_mean_b": _mean(b_latencies),
        "latency_p90_b": percentile(b_latencies, 90),
        "first_step_a": _mean(list(a["first_step"].values())),
        "first_step_b": _mean([x for b in measured for x in b["first_step"].values()]),
        "serving_startup_b": _mean([b["serving_startup"] for b in measured]),
        "learner_startup_b": _mean([b["learner_startup"] for b in measured]),
        "reward_paired": len(paired),
        "reward_final_a": _mean([e["final_a"] for e in paired]),
        "reward_final_b": _mean([e["final_b"] for e in paired]),
        "reward_final_a_all": _mean([e["final_a"] for e in experiments_]),
        "reward_diff_mean": _mean(diffs),
        "reward_diff_noise": noise,
        "experiments": experiments_,
        "phases_a": a["phases"],
        "phases_b": {k: _mean([b["phases"][k] for b in measured]) for k in a["phases"]},
        "cpu_a": a["cpu"],
        "cpu_b": {k: _mean([b["cpu"][k] for b in measured if not math.isnan(b["cpu"][k])]) for k in CPU_ROLES},
        "swap_seconds_a": a["swap_seconds"],
        "publish_to_live_a": a["publish_to_live"],
        "publish_to_live_b": _mean([b["publish_to_live"] for b in measured if not math.isnan(b["publish_to_live"])]),
        "staleness_max_a": a["staleness_max"],
        "rejected_a": (sum(a["rejected_by"].get(name, 0) for name in paired_names) / paired_steps_a
                       if paired_steps_a else math.nan),
        "rejected_a_all": a["rejected"] / a["steps"] if a["steps"] else math.nan,
        "rejected_b": sum(b["rejected"] for b in measured) / max(1, sum(b["steps"] for b in measured)),
        "errors": {**a["errors"], **{k: v for b in measured for k, v in b["errors"].items()}},
    }


# ---------------------------------------------------------------------------------------------------------
# Output


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


COLUMNS = (
    ("N", lambda r: str(r["n"])),
    ("wall (a) s", lambda r: _f(r["wall_a"])),
    ("wall (b) s", lambda r: _f(r["wall_b"]) + ("" if r["alone_measured"] == r["n"] else "*")),
    ("ratio (b)/(a)", lambda r: _f(r["ratio"], ".2f") + "x"),
    ("ratio w/o start-up", lambda r: _f(r["ratio_without_startup"], ".2f") + "x"),
    ("step latency mean/p90 s", lambda r: f"{_f(r['latency_mean_a'], '.2f')} / {_f(r['latency_p90_a'], '.2f')}"),
    ("first step s (a)/(b)", lambda r: f"{_f(r['first_step_a'])} / {_f(r['first_step_b'])}"),
    ("start-up s (a)/(b) each", lambda r: f"{_f(r['startup_a'])} / {_f(r['startup_b'] / r['n'])}"),
    ("final reward (a)/(b)", lambda r: f"{_f(r['reward_final_a'], '.3f')} / {_f(r['reward_final_b'], '.3f')}" + _paired_mark(r)),
    ("diff +- noise", lambda r: f"{_f(r['reward_diff_mean'], '+.3f')} +- {_f(r['reward_diff_noise'], '.3f')}" + _paired_mark(r)),
    ("gate rejected (a)/(b)", lambda r: f"{_f(100 * r['rejected_a'], '.0f')}% / {_f(100 * r['rejected_b'], '.0f')}%" + _paired_mark(r)),
)


def _paired_mark(row: dict) -> str:
    """Marks reward and rejection cells compared over fewer experiments than N (those run alone)."""
    return "" if row.get("reward_paired", row["n"]) == row["n"] else f" ({row['reward_paired']} of {row['n']})"


PHASE_COLUMNS = ("wait", "score", "train", "probe", "publish", "other", "total", "sampling")
CPU_ROLES = ("serving", "learner")  # `CpuSampler`'s roles: the serving tier's processes, the learner processes


def _rows_text(header: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + [
            "| " + " | ".join(r) + " |" for r in rows
        ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _sections(result: dict, markdown: bool) -> list[str]:
    rows = result["rows"]
    lines = _rows_text([c[0] for c in COLUMNS], [[f(r) for _, f in COLUMNS] for r in rows], markdown)
    lines += ["", "Where a step's time goes (mean seconds per step; (a) concurrent / (b) alone; CPU: core-seconds per "
                  "step over the run, the serving tier's processes and the learners'):"]
    header = ["N", *PHASE_COLUMNS, *(f"CPU {role}" for role in CPU_ROLES), "swap", "publish->live", "staleness max"]
    body = []
    for r in rows:
        cpu_a, cpu_b = r.get("cpu_a", {}), r.get("cpu_b", {})  # runs recorded before CPU was sampled have none
        body.append([str(r["n"])] + [f"{_f(r['phases_a'][k], '.2f')} / {_f(r['phases_b'][k], '.2f')}" for k in PHASE_COLUMNS]
                    + [f"{_f(cpu_a.get(k), '.2f')} / {_f(cpu_b.get(k), '.2f')}" for k in CPU_ROLES]
                    + [_f(r["swap_seconds_a"], ".3f"),
                       f"{_f(r['publish_to_live_a'], '.2f')} / {_f(r['publish_to_live_b'], '.2f')}",
                       _f(r["staleness_max_a"], "d") if r["staleness_max_a"] is not None else "-"])
    lines += [""] + _rows_text(header, body, markdown)
    big = rows[-1]
    one = next((r for r in rows if r["n"] == 1), None)
    lines += ["", f"Start-up of one stack: {result['startup_median']:.1f}s (median of {result['stack_starts']} starts; "
                  f"(b) alone: serving {_f(big['serving_startup_b'])}s + learner {_f(big['learner_startup_b'])}s); "
                  f"(b) at N={big['n']} with the measured start-ups: {big['wall_b_measured']:.1f}s."]
    lines += ["", f"Reward per experiment at N={big['n']} (mean over a step's samples; final: the last "
                  f"{result['final_window']} step(s)):", ""]
    lines += _rows_text(
        ["experiment", "objective", "first (a)/(b)", "final (a)", "final (b)", "diff +- 95% (steps)"],
        [[e["name"], f"`{e['objective']}`" if markdown else e["objective"],
          f"{_f(e['first_a'], '.3f')} / {_f(e['first_b'], '.3f')}", _f(e["final_a"], ".3f"), _f(e["final_b"], ".3f"),
          f"{_f(e['diff'], '+.3f')} +- {_f(e['noise'], '.3f')}"] for e in big["experiments"]],
        markdown,
    )
    lines += [""]
    lines.append(f"Throughput ratio at N={big['n']}: {big['ratio']:.2f}x (target >= {RATIO_TARGET}x, aim >= {RATIO_AIM}x): "
                 f"{'ok' if big['ratio'] >= RATIO_TARGET else 'MISSED'}")
    if one is not None and big is not one:
        factor = big["latency_mean_a"] / one["latency_mean_a"]
        lines.append(f"Per-step latency at N={big['n']}: {factor:.2f}x N=1's (target < {LATENCY_FACTOR:g}x): "
                     f"{'ok' if factor < LATENCY_FACTOR else 'MISSED'}")
    same = all(abs(r["reward_diff_mean"]) <= r["reward_diff_noise"] for r in rows if not math.isnan(r["reward_diff_noise"]))
    lines.append(f"Final reward (a) vs (b): {'equal within noise' if same else 'DIFFERENT beyond noise'} (\"diff +- noise\": "
                 "the mean difference over the experiments run both ways and its 95% half-width, paired t over the "
                 "experiments, so run-to-run randomness counts; for one experiment, a within-run interval: t over the "
                 "final window's step means of each run, which leaves out run-to-run variance and is too narrow)")
    if any(r["alone_measured"] < r["n"] for r in rows):
        lines.append(f"* (b) measured for experiments {result['alone_measured']}; the others' run time at their mean. "
                     "\"(K of N)\": rewards and gate rejections compared over the K experiments run both ways only.")
    errors = {k: v for r in rows for k, v in r["errors"].items()}
    if errors:
        lines.append(f"Tenant errors during the runs: {errors}")
    return lines


def table(result: dict) -> str:
    s = result["settings"]
    head = [
        f"clora bench experiments: {Path(result['model']).name}, {result['steps']} steps x {s['batch_size']} samples "
        f"({s['batch_size'] // s['group_size']} prompts x {s['group_size']}), {s['max_tokens']} tokens, "
        f"sample-ahead {'on' if s['sample_ahead'] else 'off'}, gate probes {s['gate_prompts']} (z {s.get('gate_reward_z', 0):g}), "
        f"rounds of {s.get('round_tenants', 1)}, {s.get('update_epochs', 1)} epoch(s) per batch",
        f"{result['machine']}; bench took {result['bench_seconds']:.0f}s",
        f"(a) N experiments on one always-on stack ({_learners_text(s)}); (b) each alone, fresh serving + learner "
        "processes (start-up included)",
        "",
    ]
    return "\n".join(head + _sections(result, markdown=False))


def _learners_text(settings: dict) -> str:
    k = settings.get("learners", 1)
    return "one learner" if k == 1 else f"{k} learner processes, each training its shard of the N"


def to_markdown(result: dict) -> str:
    s = result["settings"]
    head = [
        f"### `clora bench experiments` — {result['date'][:10]}",
        "",
        f"Machine: {result['machine']}. Model: `{Path(result['model']).name}` ({s['dtype']} engine, learner on "
        f"{s['device']}). {result['steps']} GRPO steps per experiment, {s['batch_size']} samples per step "
        f"({s['batch_size'] // s['group_size']} prompts x {s['group_size']}), {s['max_tokens']} tokens, LoRA r={s['rank']}, "
        f"sample-ahead {'on' if s['sample_ahead'] else 'off'}, {s['gate_prompts']} gate probe prompts "
        f"(gate_reward_z {s.get('gate_reward_z', 0):g}), learner rounds of up to {s.get('round_tenants', 1)} experiments, "
        f"{s.get('update_epochs', 1)} optimizer step(s) per batch. "
        f"(a): N experiments on one always-on stack (one engine, {_learners_text(s)}); (b): each alone in fresh "
        "serving and learner processes, start-up included. Latency: interval between an experiment's consecutive steps.",
        "",
    ]
    return "\n".join(head + _sections(result, markdown=True)) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ns = [r["n"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(ns, [r["ratio"] for r in rows], "o-", label="(b)/(a), start-up included")
    ax1.plot(ns, [r["ratio_without_startup"] for r in rows], "s--", label="(b)/(a), without (b)'s start-up")
    ax1.axhline(RATIO_TARGET, color="gray", linestyle=":", label=f"target {RATIO_TARGET}x")
    ax1.axhline(RATIO_AIM, color="gray", linestyle="-.", label=f"aim {RATIO_AIM:g}x")
    _n_axis(ax1, ns, "experiment throughput ratio")
    ax2.plot(ns, [r["latency_mean_a"] for r in rows], "o-", label="(a) mean")
    ax2.plot(ns, [r["latency_p90_a"] for r in rows], "^--", label="(a) p90")
    ax2.plot(ns, [r["latency_mean_b"] for r in rows], "s:", label="(b) mean")
    one = next((r for r in rows if r["n"] == 1), None)
    if one is not None:
        ax2.axhline(LATENCY_FACTOR * one["latency_mean_a"], color="gray", linestyle=":", label=f"{LATENCY_FACTOR:g}x N=1")
    _n_axis(ax2, ns, "per-step latency (s)")
    fig.suptitle(f"clora bench experiments: {Path(result['model']).name}, {result['steps']} steps; {result['machine']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _n_axis(ax, ns: list[int], ylabel: str) -> None:
    ax.set_xlabel("concurrent experiments N")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.legend(fontsize=8)


if __name__ == "__main__":
    sys.exit(worker())
