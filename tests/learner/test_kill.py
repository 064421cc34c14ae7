"""SIGKILL the learner process at random moments and restart it: the cursor and the adapter resume, no
trajectory is trained at two steps, none is skipped, and what the registry publishes is what the learner
continues from; and the per-step log line of a learner run without progress bars."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner_support import chat_prompt, step_ids, trajectories, write_toml
from storage.cursors import Cursors
from storage.parquet import read_dataset, write_dataset
from storage.registry import Registry

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TENANTS = {"acme": 48, "beta": 32}
KILLS = 4


def committed_steps(data_dir: Path, tenant: str) -> list[Path]:
    d = data_dir / "cursors" / tenant
    return sorted(d.glob("step-*")) if d.is_dir() else []


def steps_committed(data_dir: Path) -> int:
    return sum(len(committed_steps(data_dir, t)) for t in TENANTS)


def start(config: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-m", "learner", "--config", str(config), "--no-progress", *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_sigkill_at_random_moments_then_resume(tiny_model, data_dir, tmp_path):
    rng = random.Random(1234)
    expected = {}
    for tenant, n in TENANTS.items():
        rows = [
            {"id": f"{tenant}-{i}", "prompt": chat_prompt(f"q{i % 5}"), "completion": rng.choice(["12 34", "cats", "HELLO there", "ok"]), "reward": rng.uniform(-1, 1)}
            for i in range(n)
        ]
        write_dataset(data_dir, "trajectories", trajectories(tenant, rows), file_id="batch-0")
        expected[tenant] = {r["id"] for r in rows}
    config = write_toml(
        tmp_path / "clora.toml",
        data_dir,
        tiny_model,
        [{"name": t, "batch_size": 4, "learning_rate": 1e-3} for t in TENANTS],
        max_staleness=1000,
        scheduler="round_robin",
        gate_max_kl=1000.0,  # only kills may leave rejected versions here
    )

    kills = 0
    while kills < KILLS:
        proc = start(config)
        before = steps_committed(data_dir)
        deadline = time.monotonic() + 120
        # wait until this incarnation has committed at least one step, then kill it at a random moment
        while time.monotonic() < deadline and proc.poll() is None and steps_committed(data_dir) == before:
            time.sleep(0.02)
        if proc.poll() is None and steps_committed(data_dir) == before:
            proc.kill()
            proc.wait(timeout=30)
            err = proc.stderr.read().decode()[-3000:]
            pytest.fail(f"kill {kills}: no step committed within 120 s, so the kill would not interrupt training:\n{err}")
        time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:
            err = proc.stderr.read().decode()[-3000:]
            pytest.fail(f"the learner exited with {proc.returncode} before it was killed:\n{err}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
        print(f"kill {kills}: committed steps {before} -> {steps_committed(data_dir)}")
        kills += 1

    done = start(config, "--until-idle")
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err.decode()[-3000:]

    cursors, registry = Cursors(data_dir), Registry(data_dir)
    steps_table = read_dataset(data_dir, "train_steps").to_pylist()
    for tenant, ids in expected.items():
        per_step = step_ids(data_dir, tenant)
        flat = [i for step in per_step for i in step]
        assert len(flat) == len(set(flat)), f"{tenant}: a trajectory was committed at two steps"
        assert set(flat) == ids, f"{tenant}: skipped {sorted(ids - set(flat))[:5]}"
        assert cursors.backlog()[tenant] == 0

        # one train_steps row per committed step, each with its batch
        rows = sorted((r for r in steps_table if r["tenant"] == tenant), key=lambda r: r["step"])
        assert [r["step"] for r in rows] == list(range(1, len(per_step) + 1))
        assert [r["n_trajectories"] for r in rows] == [len(s) for s in per_step]

        # no candidate is left; the lineage is a chain of published versions (a killed step leaves at most
        # an abandoned, rejected candidate, or, killed between a create's files and its record, a number the
        # next create records as skipped: retired, never published)
        versions = registry.versions(tenant)
        assert not [v for v in versions if v.status == "candidate"]
        skipped = [v for v in versions if v.status == "retired" and v.published_at is None]
        assert all(v.reason.startswith("number skipped") for v in skipped)
        published = [v for v in versions if v.published_at is not None]
        assert len(published) == len(per_step)
        for prev, cur in zip(published, published[1:]):
            assert cur.parent == prev.name
        for v in versions:
            if v.status == "rejected":
                assert "abandoned" in v.reason

        # the adapter the learner continues from is the one the registry serves
        step, checkpoint = cursors.latest_checkpoint(tenant)
        served = load_file(str(registry.latest_published(tenant).path / "adapter_model.safetensors"))
        mine = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
        assert served.keys() == mine.keys() and all(torch.equal(served[k], mine[k]) for k in served)


def test_no_progress_logs_a_line_per_step(tiny_model, data_dir, tmp_path):
    """`--no-progress` turned the progress bars off and with them the learner's only report of each step."""
    write_dataset(data_dir, "trajectories", trajectories("acme", [
        {"id": f"a{i}", "prompt": chat_prompt(f"q{i % 3}"), "completion": ["12", "cats", "HELLO"][i % 3], "reward": i % 2}
        for i in range(8)]), file_id="batch-0")
    config = write_toml(tmp_path / "clora.toml", data_dir, tiny_model, [{"name": "acme", "batch_size": 4}])
    done = start(config, "--until-idle")
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err.decode()[-3000:]
    steps = re.findall(rb"INFO learner\.loop: tenant acme: step (\d+), v\d+ ", err)
    assert steps == [b"1", b"2"], err.decode()[-3000:]
