"""Helpers for the learner tests: trajectory tables in the real Parquet schema, and configs as objects or
clora.toml files. Plain functions (the fixtures they use, `tiny_model` and `data_dir`, are in
tests/conftest.py)."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
from cursor_support import committed_ids

from storage.parquet import write_dataset
from storage.schema import TRAJECTORIES

# The targets the tests train: the attention and MLP projections, which the serving tier loads too (the
# tiny model's lm_head is tied to its embeddings, so it is no LoRA target).
LEARNABLE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def trajectories(tenant: str, rows: list[dict], *, start: int = 0) -> pa.Table:
    """A TRAJECTORIES table; each row needs at least id, prompt, completion, reward."""
    full = []
    for i, r in enumerate(rows):
        full.append(
            {
                "id": r["id"],
                "tenant": tenant,
                "ts": T0 + timedelta(seconds=start + i),
                "prompt": r.get("prompt"),
                "messages_json": r.get("messages_json"),
                "completion": r.get("completion"),
                "reward": r["reward"],
                "reward_source": r.get("reward_source", "feedback"),
                "adapter_version": r.get("adapter_version"),
                "prompt_token_ids": r.get("prompt_token_ids"),
                "completion_token_ids": r.get("completion_token_ids"),
                "completion_logprobs": r.get("completion_logprobs"),
                "metadata_json": json.dumps(r["metadata"]) if "metadata" in r else None,
                "kafka_topic": "clora.interactions",
                "kafka_partition": 0,
                "kafka_offset": start + i,
                "ingested_at": T0 + timedelta(seconds=start + i),
            }
        )
    return pa.Table.from_pylist(full, schema=TRAJECTORIES)


def chat_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# Logs-mode trajectories in storage, and what the learner's cursors say it trained.

COMPLETIONS = ["12 34", "cats and dogs", "7", "hello there", "BIG NEWS", "ok"]


def rows(prefix: str, n: int, *, seed: int = 0, reward=None, **extra) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "id": f"{prefix}{i}",
            "prompt": chat_prompt(f"question {i % 4}"),
            "completion": rng.choice(COMPLETIONS),
            "reward": rng.uniform(-1, 1) if reward is None else reward,
            **extra,
        }
        for i in range(n)
    ]


def write(data_dir, tenant, table_rows, file_id, start=0):
    write_dataset(data_dir, "trajectories", trajectories(tenant, table_rows, start=start), file_id=file_id)


def step_ids(data_dir, tenant) -> list[list[str]]:
    """The trajectory ids committed at each step, from the cursor's step directories."""
    return list(committed_ids(data_dir, tenant).values())


def assert_each_id_once(data_dir, tenant, expected: set[str]):
    per_step = step_ids(data_dir, tenant)
    flat = [i for ids in per_step for i in ids]
    assert len(flat) == len(set(flat)), "a trajectory id was committed at two steps"
    assert set(flat) == expected


def unavailable_scorer(completion: str, prompt: str) -> float:
    """A python scorer (`python:learner_support:unavailable_scorer`) whose scoring service is down."""
    raise RuntimeError("scoring service unavailable")


def picky_scorer(completion: str, prompt: str) -> float:
    """A python scorer (`python:learner_support:picky_scorer`) that fails on the completion "a"."""
    if completion == "a":
        raise ValueError("too short to judge")
    return min(1.0, len(completion) / 20)


def full_marks(completion: str, prompt: str) -> float:
    """A python scorer (`python:learner_support:full_marks`) that rates every completion 1."""
    return 1.0


def no_marks(completion: str, prompt: str) -> float:
    """A python scorer (`python:learner_support:no_marks`) that rates every completion 0."""
    return 0.0


# Learner settings of every test config. Tests write their batches whole, so a partial one is trained at
# once (test_loop tests the wait), and count steps of batch_size (test_loop tests catch-up steps).
TEST_LEARNER = {"poll_seconds": 0.1, "gate_prompts": 0, "batch_wait_seconds": 0, "catch_up": 1}


def make_config(data_dir: Path, model_path: Path, tenants: list[dict], **learner):
    from clora.config import Config

    settings = {**TEST_LEARNER, **learner}
    return Config.model_validate(
        {
            "data_dir": str(data_dir),
            "model": {"path": str(model_path)},
            "learner": settings,
            "tenants": [{"api_key": f"sk-{t['name']}-0000", **t} for t in tenants],
        }
    )


def write_toml(path: Path, data_dir: Path, model_path: Path, tenants: list[dict], **learner) -> Path:
    """The same config as a clora.toml file (for the learner run as a process)."""

    def value(v):
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return str(v)

    lines = [f"data_dir = {value(str(data_dir))}", "log_level = \"INFO\"", "", "[model]", f"path = {value(str(model_path))}", "", "[learner]"]
    lines += [f"{k} = {value(v)}" for k, v in {**TEST_LEARNER, **learner}.items()]
    for t in tenants:
        lines += ["", "[[tenants]]"]
        lines += [f"{k} = {value(v)}" for k, v in {"api_key": f"sk-{t['name']}-0000", **t}.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
