"""The whole loop, as a user runs it: `clora demo` (broker, serving, ingest, learner as child processes, plus
simulated apps), and Ctrl-C during `clora up` followed by a resume.

These start the real broker and the real vLLM engine inside the processes under test (that is what is being
tested), so they cannot share the session fixtures.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
import pytest
import torch
from cursor_support import committed_ids

from storage import files as storage_files
from storage.cursors import Cursors
from storage.query import query
from storage.registry import Registry

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def clora(*args, cwd, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "clora", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        **kw,
    )


def test_demo_runs_the_whole_loop_and_every_tenant_improves(tmp_path, tiny_model):
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n[model]\npath = "{tiny_model}"\n')
    # Two tenants whose users grade every answer (upper case, short answers). Their reward takes off after
    # some 8 to 20 versions: one to two minutes in here, and a CI run had made only 12 of them, with neither
    # tenant off yet, at 3 minutes. So the traffic may run for 8 minutes and stops once both have learned
    # (halfway from the base reward to 1), which is what the test waits for. `digits` is left to `make demo`:
    # from a reward of ~0.001 on the random tiny model it takes off later and over a wider range.
    proc = clora("demo", "--config", str(config), "--minutes", "8", "--tenants", "upper,short",
                 "--out", str(tmp_path / "demo.png"), cwd=tmp_path)
    try:
        out, _ = proc.communicate(timeout=1500)
    finally:
        stop(proc)
    assert proc.returncode == 0, out[-6000:]
    assert "every tenant improved" in out
    # Children's output is prefixed line by line: a progress bar's cursor moves would garble it.
    assert "\x1b[" not in out
    assert "learner.loop: tenant upper-app: step 1," in out  # a log line per step instead of a bar

    demo_data = tmp_path / "data" / "demo" / "data"
    records = json.loads((tmp_path / "data" / "demo" / "records.json").read_text())
    assert records and all(r["ok"] for r in records), [r for r in records if not r["ok"]][:3]
    for tenant in ("upper-app", "short-app"):
        mine = sorted((r for r in records if r["tenant"] == tenant), key=lambda r: r["t"])
        served = list(dict.fromkeys(r["adapter_version"] for r in mine))
        assert served[0] == "base", served
        assert len([v for v in served if v.startswith(f"{tenant}@")]) >= 2, served  # two versions went live
        published = [v for v in Registry(demo_data).versions(tenant) if v.published_at is not None]
        assert len(published) >= 2
        # every request the app made reached Parquet through Kafka and ingest
        (ingested,) = query(demo_data, f"select count(*) from interactions where tenant = '{tenant}'").to_pylist()
        assert list(ingested.values())[0] == len(mine)
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("clora up did not become healthy")


def test_ctrl_c_during_up_leaves_no_orphans_and_up_resumes(tmp_path, tiny_model):
    from ingest.broker import free_ports

    port, broker_port = free_ports(2)
    data = tmp_path / "data"
    config = tmp_path / "clora.toml"
    config.write_text(
        f"""data_dir = "{data}"
[kafka]
bootstrap = "127.0.0.1:{broker_port}"
partitions = 2
[broker]
port = {broker_port}
[ingest]
processes = 2
[model]
path = "{tiny_model}"
[serving]
port = {port}
max_loras = 2
dtype = "float32"
[[tenants]]
name = "acme"
api_key = "sk-acme-0000"
scorer = "feedback"
batch_size = 6
learning_rate = 1e-3
"""
    )
    url = f"http://127.0.0.1:{port}"
    key = {"Authorization": "Bearer sk-acme-0000"}
    body = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    rounds = []
    for round_ in range(2):
        up = clora("up", "--config", str(config), cwd=tmp_path)
        try:
            rounds.append(run_round(up, round_, url, key, body, data, after=rounds[-1].version if rounds else 0))
        finally:
            stop(up)
    assert_resumed(data, *rounds)


class Round(NamedTuple):
    """What one `clora up` life left: the newest published version, the learner's last committed step, the
    trajectory ids trained up to it, and the optimizer steps its checkpoint's AdamW state counts."""

    version: int
    step: int
    trained: set[str]
    optimizer_steps: int


def left_by(data: Path, tenant: str = "acme") -> Round:
    """What the data dir holds of `tenant` once a `clora up` stopped."""
    latest = Registry(data).latest_published(tenant)
    cursors = Cursors(data)
    _, checkpoint = cursors.latest_checkpoint(tenant)
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    return Round(version=0 if latest is None else latest.number, step=cursors.latest_step(tenant),
                 trained=cursors.trained_ids(tenant),
                 optimizer_steps=int(next(iter(state.values()))["step"]) if state else 0)


def assert_resumed(data: Path, first: Round, second: Round) -> None:
    """The second run resumed from the first: a newer version, trained on from the first run's (its lineage
    reaches it, and its step numbers go on), and none of the first run's trained trajectories trained again."""
    registry = Registry(data)
    newest, before = registry.get("acme", second.version), registry.get("acme", first.version)
    lineage, v = [newest.name], newest
    while v.parent is not None and v.number > before.number:
        v = registry.get_name(v.parent)
        lineage.append(v.name)
    assert lineage[-1] == before.name, f"{newest.name} does not descend from {before.name}: {lineage}"
    assert newest.metrics["step"] > first.step >= before.metrics["step"], (newest.metrics, first.step)
    assert second.step > first.step
    resumed = {step: set(ids) for step, ids in committed_ids(data, "acme").items() if step > first.step}
    assert newest.metrics["step"] in resumed, sorted(resumed)  # its step dir keeps its checkpoint: not compacted
    for step, ids in resumed.items():
        assert ids and not ids & first.trained, f"step {step} trained again: {sorted(ids & first.trained)}"
    assert Cursors(data).trained_ids("acme") > first.trained
    # the weights trained on too, not only the records: the optimizer's state came back from the checkpoint
    # (a new version's step moves it at least once; a fresh optimizer would count only the second run's)
    assert second.optimizer_steps > first.optimizer_steps, (first.optimizer_steps, second.optimizer_steps)


def stop(proc: subprocess.Popen) -> None:
    """Stops a `clora up` that a failed assertion left running (its children follow it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def run_round(up, round_, url, key, body, data, after: int) -> Round:
    """One `clora up` life: healthy, traffic with feedback, a version newer than `after` published, Ctrl-C,
    checks; returns what it left (read once it stopped)."""
    wait_healthy(url, up)
    children = psutil.Process(up.pid).children(recursive=True)
    assert len(children) >= 5  # broker, serving (+ its engine), two ingest processes, learner
    for i in range(6):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=key, timeout=60)
        assert r.status_code == 200, r.text
        fb = httpx.post(url + "/v1/feedback", json={"id": r.json()["id"], "score": (i % 3) / 2}, headers=key)
        assert fb.status_code == 202, fb.text
    # let ingest and the learner see the traffic: a new version gets published (after the first round, one
    # newer than that round's: its version is still published, and would pass for this round's)
    def published() -> int:
        latest = Registry(data).latest_published("acme")
        return 0 if latest is None else latest.number

    deadline = time.monotonic() + 180
    while published() <= after and time.monotonic() < deadline:
        assert up.poll() is None, up.stdout.read()[-4000:]
        time.sleep(1)
    assert published() > after, f"no version newer than acme@{after} was published"
    up.send_signal(signal.SIGINT)
    out, _ = up.communicate(timeout=240)
    assert up.returncode == 0, out[-4000:]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.pid for p in alive]
    assert "stopping serving" in out and "broker stopped" in out
    # two ingest processes in one group, stopped together (each drains its own partitions)
    assert "stopping ingest-0, ingest-1" in out
    assert "ingest-0 stopped (exit code 0)" in out and "ingest-1 stopped (exit code 0)" in out
    # no half-written file: every Parquet file is complete and readable, no temporary names left behind
    leftovers = [p for p in data.rglob("*") if p.is_file() and p.name.startswith(storage_files.TMP_PREFIX)
                 and "locks" not in p.parts]
    assert not leftovers, leftovers
    (row,) = query(data, "select count(*) as n from interactions where tenant = 'acme'").to_pylist()
    assert row["n"] == 6 * (round_ + 1)  # nothing acknowledged was lost across the stop
    return left_by(data)
