"""`clora bench experiments` (learner/bench_experiments.py) in a tiny configuration: it proves the benchmark
runs end to end (real broker, serving and learner processes) and that its numbers hang together; it does
not time anything. Also: the config it writes is a valid clora.toml, and its arithmetic (sums, ratios,
the paired reward test, percentiles) on records worked out by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clora.cli import main
from clora.config import load_config
from learner.bench_experiments import (CpuSampler, compare, cpu_between, experiments, merge_timelines, percentile,
                                      t_quantile_975, write_config)

pytestmark = pytest.mark.integration


def test_the_benchmark_runs_end_to_end_with_two_experiments(tiny_model, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "experiments", "--n", "2", "--steps", "2", "--alone", "1", "--gate-prompts", "1",
                 "--learners", "2", "--model", str(tiny_model), "--out", str(out)])
    assert code == 0
    result = json.loads((out / "experiments.json").read_text())
    (row,) = result["rows"]
    assert row["n"] == 2 and row["alone_measured"] == 1 and row["reward_paired"] == 1 and not row["errors"]

    # (a): one stack trained both experiments, each for exactly the asked steps, each by its own learner shard
    concurrent = result["runs"]["concurrent"]["2"]
    steps = concurrent["timeline"]["steps"]
    assert sorted((s["tenant"], s["step"]) for s in steps) == [("exp-0", 1), ("exp-0", 2), ("exp-1", 1), ("exp-1", 2)]
    shard_of = {s["tenant"]: s["shard"] for s in steps}
    assert concurrent["learners"] == 2 and sorted(shard_of.values()) == ["0/2", "1/2"]
    assert all(s["shard"] == shard_of[s["tenant"]] for s in steps)
    assert all(len(s["rewards"]) == 8 and s["staleness"] is not None for s in steps)
    # the serving tier hot-swapped the learner's published versions
    assert sum(m.get("swaps", 0) for m in concurrent["serving_metrics"].values()) >= 1
    # (b): experiment 0 alone in its own stack; experiment 1's alone time is estimated by the mean
    alone = result["runs"]["alone"]["0"]
    assert alone["experiments"] == ["exp-0"] and alone["learners"] == 1
    assert [s["step"] for s in alone["timeline"]["steps"]] == [1, 2]
    alone_run = alone["timeline"]["steps"][-1]["t"] - alone["timeline"]["ready"]
    startups = [r["timeline"]["ready"] - r["spawned"] for r in (alone, concurrent)]
    assert result["startup_median"] == pytest.approx(sum(startups) / 2)  # the median of two starts
    assert row["startup_b"] == pytest.approx(2 * result["startup_median"])
    assert row["wall_b"] == pytest.approx(2 * alone_run + row["startup_b"])  # experiment 1 at experiment 0's run
    assert row["wall_b_measured"] == pytest.approx(2 * (alone_run + startups[0]))
    assert row["ratio"] == pytest.approx(row["wall_b"] / row["wall_a"])
    assert row["wall_a"] == pytest.approx(max(s["t"] for s in steps) - concurrent["timeline"]["ready"])
    assert row["startup_a"] == pytest.approx(startups[1]) and row["startup_a"] > 0
    assert row["latency_mean_a"] > 0 and row["first_step_a"] > 0
    rewards = {e["name"]: e for e in row["experiments"]}
    assert set(rewards) == {"exp-0", "exp-1"}
    assert all(0.0 <= e["final_a"] <= 1.0 for e in rewards.values())
    assert 0.0 <= rewards["exp-0"]["final_b"] <= 1.0 and math.isnan(rewards["exp-1"]["final_b"])

    # CPU per step over the run, of the serving tier's processes and of the learners, both ways
    for cpu in (row["cpu_a"], row["cpu_b"]):
        assert cpu["serving"] > 0 and cpu["learner"] > 0, cpu
    assert concurrent["cpu"]["t"][0] <= concurrent["timeline"]["ready"] and len(concurrent["cpu"]["learner"]) >= 2

    assert (out / "experiments.png").stat().st_size > 0
    markdown = (out / "experiments.md").read_text()
    assert "| 2 |" in markdown and result["machine"] in markdown and "2 learner processes" in markdown
    printed = capsys.readouterr().out
    assert "ratio (b)/(a)" in printed and "Where a step's time goes" in printed and "CPU learner" in printed


def test_the_stack_config_is_a_valid_clora_toml(tmp_path):
    group = experiments(3)
    settings = {"model": tmp_path / "model", "dtype": "float32", "device": "cpu", "threads": 1, "max_loras": None,
                "kv_cache_gib": 0.5,
                "max_num_seqs": 64, "steps": 2, "batch_size": 8, "group_size": 4, "max_tokens": 16,
                "learning_rate": 1e-2, "rank": 8, "gate_prompts": 2, "gate_reward_z": 0.5, "sample_ahead": True,
                "round_tenants": 3, "update_epochs": 2, "prompts_file": tmp_path / "prompts.txt"}
    path = write_config(tmp_path / "clora.toml", group, settings, data_dir=tmp_path / "data", bootstrap="127.0.0.1:1",
                        port=8123)
    cfg = load_config(path, environ={})
    assert [t.name for t in cfg.tenants] == ["exp-0", "exp-1", "exp-2"]
    assert [t.scorer for t in cfg.tenants] == [e.scorer for e in group]
    assert all(t.mode == "rollouts" and t.prompts_file == Path(settings["prompts_file"]) for t in cfg.tenants)
    assert cfg.serving.max_loras == 4 and cfg.serving.dtype == "float32" and cfg.serving.port == 8123
    assert cfg.learner.sample_ahead is True and cfg.learner.device == "cpu" and cfg.learner.max_new_tokens == 16
    assert cfg.learner.gate_prompts == 2 and cfg.learner.gate_reward_z == 0.5 and cfg.learner.round_tenants == 3
    assert cfg.learner.update_epochs == 2
    assert cfg.serving.max_loras == 4  # experiments + 1 unless --max-loras sets one shape for every stack
    settings["max_loras"] = 9
    path = write_config(tmp_path / "clora.toml", group, settings, data_dir=tmp_path / "data", bootstrap="127.0.0.1:1",
                        port=8123)
    assert load_config(path, environ={}).serving.max_loras == 9


def test_cpu_between_reads_the_samples_linearly_between_them():
    cpu = {"t": [10.0, 11.0, 13.0], "serving": [1.0, 1.5, 3.5], "learner": [0.0, 1.0, 1.0]}
    assert cpu_between(cpu, "serving", 10.0, 13.0) == pytest.approx(2.5)
    assert cpu_between(cpu, "serving", 10.5, 12.0) == pytest.approx(2.5 - 1.25)  # 1.25 at 10.5, 2.5 at 12
    assert cpu_between(cpu, "learner", 11.0, 13.0) == pytest.approx(0.0)
    assert math.isnan(cpu_between(cpu, "serving", 9.0, 12.0))  # before the first sample: unknown, not 0
    assert math.isnan(cpu_between(cpu, "serving", 12.0, 14.0))
    assert math.isnan(cpu_between(cpu, "other", 10.0, 13.0)) and math.isnan(cpu_between(None, "serving", 10.0, 11.0))


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s"
        time.sleep(0.01)


def test_the_cpu_sampler_counts_a_watched_session_under_its_role_and_keeps_what_an_exited_one_used():
    """A process that burns CPU in a session of its own (as the benchmark starts serving and learners) is
    counted under its role while it runs, and what it used still counts once it has exited (a learner
    shard done before the others)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    sampler = CpuSampler(period=0.05)
    sampler.watch("learner", burner.pid)
    try:
        sampler.start()
        # a few samples that have seen it burn
        wait_until(lambda: len(sampler.samples) >= 3 and sampler.samples[-1][1].get("learner", 0.0) > 0,
                   "three samples, the last with the burner's CPU seconds")
    finally:
        burner.kill()
        burner.wait()
    exited = time.time()
    wait_until(lambda: sampler.samples[-1][0] > exited, "a sample taken after the burner exited")
    cpu = sampler.stop()
    assert set(cpu) == {"t", "learner"} and len(cpu["t"]) >= 3
    used = cpu_between(cpu, "learner", cpu["t"][0], cpu["t"][-1])
    assert 0 < used <= (cpu["t"][-1] - cpu["t"][0]) + 0.05  # one process: at most one core
    assert cpu["learner"] == sorted(cpu["learner"]) and cpu["learner"][-1] == cpu["learner"][-2] > 0


def record(names, *, spawned, ready, step_times, rewards, rejected=()):
    """A run record as `run_stack` returns it: step k of every tenant at ready + step_times[k-1], with the
    tenant's `rewards[name][k-1]` as its samples' rewards; the (tenant, step)s in `rejected` were rejected."""
    steps = [{"tenant": name, "step": k + 1, "t": ready + t, "rewards": rewards[name][k],
              "timings": {"wait": 0.0, "train": 0.5, "total": 0.6}, "staleness": 1,
              "decision": "rejected" if (name, k + 1) in rejected else "published"}
             for name in names for k, t in enumerate(step_times)]
    return {"experiments": names, "objectives": {n: "digits" for n in names}, "spawned": spawned,
            "serving_ready": spawned + 20.0, "learner_spawned": spawned + 20.0, "stopped": ready + step_times[-1] + 5,
            "timeline": {"ready": ready, "steps": steps, "errors": {}}, "serving_metrics": {}}


def test_compare_sums_the_alone_runs_and_tests_rewards_paired_over_experiments():
    rewards = {"exp-0": [[0.0, 0.2], [0.4, 0.6]], "exp-1": [[0.1, 0.1], [0.3, 0.5]]}
    concurrent = record(["exp-0", "exp-1"], spawned=0.0, ready=30.0, step_times=[2.0, 4.0], rewards=rewards,
                        rejected={("exp-1", 2)})
    alone = [
        record(["exp-0"], spawned=100.0, ready=125.0, step_times=[1.0, 2.0], rewards={"exp-0": [[0.0], [0.2, 0.4]]},
               rejected={("exp-0", 1), ("exp-0", 2)}),
        record(["exp-1"], spawned=200.0, ready=225.0, step_times=[1.0, 3.0], rewards={"exp-1": [[0.0], [0.4, 0.4]]}),
    ]
    row = compare(2, concurrent, alone, steps=2, window=1, startup=25.0)
    assert row["wall_a"] == pytest.approx(4.0)  # loop start to the last step
    assert row["wall_b"] == pytest.approx((2.0 + 3.0) + 2 * 25.0)  # runs + the median start-up each
    assert row["wall_b_measured"] == pytest.approx(27.0 + 28.0)  # spawn to last step, as measured
    assert row["ratio"] == pytest.approx(55.0 / 4.0) and row["ratio_without_startup"] == pytest.approx(5.0 / 4.0)
    assert row["latency_mean_a"] == pytest.approx(2.0) and row["first_step_a"] == pytest.approx(2.0)
    # final rewards (last step): a = 0.5, 0.4; b = 0.3, 0.4 -> differences 0.2, 0.0
    assert row["reward_diff_mean"] == pytest.approx(0.1)
    assert row["reward_diff_noise"] == pytest.approx(12.706 * 0.2 / math.sqrt(2) / math.sqrt(2))  # t(1) sd/sqrt(n)
    assert row["rejected_a"] == pytest.approx(1 / 4) and row["rejected_b"] == pytest.approx(2 / 4)
    assert t_quantile_975(7) == 2.365 and t_quantile_975(12) == 2.228 and t_quantile_975(1000) == 1.96


def test_with_fewer_experiments_alone_rewards_and_rejections_compare_the_same_experiments():
    """--alone 1 at N = 2: (a)'s reward and rejection rate are taken over experiment 0 only, the one with a
    (b); each experiment has its own objective, so averaging (a) over all of them compares unlike things."""
    concurrent = record(["exp-0", "exp-1"], spawned=0.0, ready=30.0, step_times=[2.0, 4.0],
                        rewards={"exp-0": [[0.1], [0.1]], "exp-1": [[0.9], [0.9]]}, rejected={("exp-1", 1), ("exp-1", 2)})
    alone = [record(["exp-0"], spawned=100.0, ready=125.0, step_times=[1.0, 2.0], rewards={"exp-0": [[0.1], [0.1]]}),
             None]
    row = compare(2, concurrent, alone, steps=2, window=1, startup=25.0)
    assert row["reward_paired"] == 1
    assert row["reward_final_a"] == pytest.approx(0.1) and row["reward_final_b"] == pytest.approx(0.1)
    assert row["reward_final_a_all"] == pytest.approx(0.5)
    assert row["rejected_a"] == 0.0 and row["rejected_a_all"] == pytest.approx(0.5)
    assert row["reward_diff_mean"] == pytest.approx(0.0)


def test_one_experiments_reward_noise_takes_the_windows_steps_as_units():
    """A step's samples share an adapter and prompts: the noise of one experiment's final reward is the
    spread of the window's step means, not of its samples."""
    a = record(["exp-0"], spawned=0.0, ready=30.0, step_times=[1.0, 2.0, 3.0],
               rewards={"exp-0": [[0.0], [0.2, 0.4], [0.6, 0.6]]})
    b = record(["exp-0"], spawned=100.0, ready=130.0, step_times=[1.0, 2.0, 3.0],
               rewards={"exp-0": [[0.0], [0.1, 0.1], [0.3, 0.5]]})
    row = compare(1, a, [b], steps=3, window=2, startup=25.0)
    # (a) step means 0.3, 0.6: se 0.15; (b) 0.1, 0.4: se 0.15; df 2
    assert row["reward_diff_mean"] == pytest.approx(0.45 - 0.25)
    assert row["reward_diff_noise"] == pytest.approx(4.303 * math.hypot(0.15, 0.15))
    # a window of one step: its samples are the units
    row = compare(1, a, [b], steps=3, window=1, startup=25.0)
    assert row["reward_diff_noise"] == pytest.approx(4.303 * math.hypot(0.0, 0.1))  # 2 + 2 samples: df 2


def test_percentile_interpolates_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0, 1.0, 3.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 90))


def test_the_learner_shards_timelines_merge_into_one_that_starts_at_the_first_ready():
    first = {"started": 1.0, "ready": 5.0, "finished": 20.0, "errors": {},
             "steps": [{"tenant": "exp-0", "step": 1, "t": 7.0}, {"tenant": "exp-0", "step": 2, "t": 9.0}]}
    second = {"started": 1.5, "ready": 6.0, "finished": 21.0, "errors": {"exp-1": "boom"},
              "steps": [{"tenant": "exp-1", "step": 1, "t": 8.0}]}
    merged = merge_timelines([first, second])
    assert (merged["started"], merged["ready"], merged["finished"]) == (1.0, 5.0, 21.0)
    assert [(s["tenant"], s["t"]) for s in merged["steps"]] == [("exp-0", 7.0), ("exp-1", 8.0), ("exp-0", 9.0)]
    assert merged["errors"] == {"exp-1": "boom"}


def test_from_json_rewrites_the_table_json_and_plot_of_earlier_runs(tmp_path, capsys):
    """`--from-json` of an earlier result starts nothing and writes what the run wrote; one that is not such a
    result is refused before anything is written (tests/clora/test_bench_cli.py)."""
    rewards = {"exp-0": [[0.0, 0.2], [0.4, 0.6]]}
    earlier = {
        "date": "2026-01-02T03:04:05+00:00", "machine": "a test machine", "model": "/models/tiny-0", "steps": 2,
        "final_window": 1, "bench_seconds": 99.0,
        "settings": {"batch_size": 8, "group_size": 4, "max_tokens": 16, "sample_ahead": True, "gate_prompts": 0,
                     "dtype": "float32", "device": "cpu", "rank": 8},
        "runs": {"concurrent": {"1": record(["exp-0"], spawned=0.0, ready=30.0, step_times=[2.0, 4.0], rewards=rewards)},
                 "alone": {"0": record(["exp-0"], spawned=100.0, ready=125.0, step_times=[1.0, 2.0], rewards=rewards)}},
    }
    old = tmp_path / "old.json"
    old.write_text(json.dumps(earlier))
    out = tmp_path / "out"
    assert main(["bench", "experiments", "--from-json", str(old), "--out", str(out)]) == 0
    result = json.loads((out / "experiments.json").read_text())
    assert [r["n"] for r in result["rows"]] == [1] and result["runs"] == earlier["runs"]
    assert (out / "experiments.png").stat().st_size > 0 and "| 1 |" in (out / "experiments.md").read_text()
    assert "ratio (b)/(a)" in capsys.readouterr().out
