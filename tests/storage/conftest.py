"""Fixtures of the storage tests: table builders and a dummy PEFT writer (the registry needs no peft).

`data_dir` (a fresh data directory) comes from tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def trajectories(ids: list[str], tenant: str = "acme", *, start: int = 0, reward: float = 0.5) -> pa.Table:
    """Trajectory rows; row k of the table was ingested at T0 + (start + k) seconds."""
    n = len(ids)
    at = [T0 + timedelta(seconds=start + k) for k in range(n)]
    return pa.table(
        {
            "id": ids,
            "tenant": [tenant] * n,
            "ts": at,
            "prompt": [f"prompt {i}" for i in ids],
            "messages_json": [json.dumps([{"role": "user", "content": f"prompt {i}"}]) for i in ids],
            "completion": [f"completion {i}" for i in ids],
            "reward": [reward] * n,
            "reward_source": ["inline"] * n,
            "adapter_version": [None] * n,
            "completion_token_ids": [[1, 2, 3]] * n,
            "completion_logprobs": [[-0.5, -0.25, -1.0]] * n,
            "metadata_json": ["{}"] * n,
            "kafka_topic": ["clora.interactions"] * n,
            "kafka_partition": [0] * n,
            "kafka_offset": list(range(start, start + n)),
            "ingested_at": at,
        }
    )


def train_steps(tenant: str, steps: list[int], version: str | None = None) -> pa.Table:
    n = len(steps)
    return pa.table(
        {
            "tenant": [tenant] * n,
            "step": steps,
            "version": [version] * n,
            "mode": ["logs"] * n,
            "reward_mean": [0.1 * s for s in steps],
            "loss": [1.0] * n,
            "kl": [0.01] * n,
            "clip_frac": [0.0] * n,
            "tokens": [100] * n,
            "seconds": [0.4] * n,
            "n_trajectories": [16] * n,
            "ts": [T0 + timedelta(seconds=s) for s in steps],
        }
    )


def write_peft(directory: Path, *, payload: bytes = b"\0" * 1024) -> None:
    """Dummy PEFT files: what the learner's save_pretrained would leave."""
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    (directory / "adapter_model.safetensors").write_bytes(payload)


def run_python(code: str, *args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with the repository importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=REPO, timeout=timeout, capture_output=True, text=True, **kwargs
    )


def popen_python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture
def make_trajectories():
    return trajectories


@pytest.fixture
def make_train_steps():
    return train_steps


@pytest.fixture
def peft_writer():
    return write_peft


@pytest.fixture
def python_subprocess():
    """(run, popen): run code in a fresh interpreter, to completion or in the background."""
    return run_python, popen_python


def run_compactor(config: Path, done, timeout: float = 60, args: tuple[str, ...] = ()) -> tuple[int, str, int]:
    """Runs `clora compact --every 0.2 --grace 0 --config <config> [args]` until `done()` holds (or `timeout`),
    then stops it with SIGTERM; returns (exit code, output, pid)."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "clora", "compact", "--every", "0.2", "--grace", "0", "--config", str(config), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not done(proc):
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, proc.pid


@pytest.fixture
def compactor_loop():
    """run_compactor: `clora compact --every` in a child process until a condition holds."""
    return run_compactor
