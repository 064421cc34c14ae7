"""Test helper: run the serving process (`python -m serving`) on a written clora.toml, and read events back.

`start_server` writes a clora.toml (tenants with keys, a broker, a base model, a free port, a fresh data
directory), starts the process, waits for `/health` and returns a `ServerHandle`; `stop_server` stops it
by its pid. `read_events` reads events by id from a topic without a consumer group. The session fixture
`server` (conftest.py) is built on these; a test that needs a server of its own calls them directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from clora.processes import terminate

REPO = Path(__file__).resolve().parents[1]  # this file is tests/serving_process.py
assert (REPO / "serving" / "__main__.py").is_file(), f"{REPO} is not the repository"  # the code under test
TENANT_KEYS = {
    "acme": "acme-key-0001",
    "globex": "globex-key-0002",
    "initech": "initech-key-0003",
    "umbrella": "umbrella-key-0004",
    "hooli": "hooli-key-0005",
    "lab": "lab-key-0006",  # the learner's rollouts test trains this one; no serving test touches it
}
STARTUP_TIMEOUT_S = 300


@dataclass
class ServerHandle:
    base_url: str  # http://127.0.0.1:<port>  (the OpenAI base_url is base_url + "/v1")
    data_dir: Path
    config_path: Path
    keys: dict[str, str]  # tenant -> api key
    bootstrap: str
    log_path: Path
    process: subprocess.Popen = field(repr=False)

    def health(self) -> dict:
        with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
            return json.loads(r.read())

    def wait_for_version(self, tenant: str, label: str, timeout: float = 30.0) -> None:
        """Blocks until /health says `tenant` is served by `label` (e.g. "acme@2")."""
        deadline = time.monotonic() + timeout
        while self.health()["adapters"].get(tenant) != label:
            if time.monotonic() > deadline:
                raise AssertionError(f"{tenant} not served by {label} after {timeout}s: {self.health()}")
            time.sleep(0.05)


def write_config(directory: Path, *, bootstrap: str, model_path: Path, port: int, **serving) -> Path:
    settings = {"max_loras": 2, "max_cpu_loras": 8, "max_model_len": 256, "max_num_seqs": 16,
                "registry_poll_seconds": 0.1, "dtype": "float32", "default_max_tokens": 16, "port": port}
    settings.update(serving)
    lines = [
        f'data_dir = "{directory / "data"}"',
        "[kafka]",
        f'bootstrap = "{bootstrap}"',
        "[model]",
        f'path = "{model_path}"',
        "[serving]",
        *(f"{k} = {json.dumps(v)}" for k, v in settings.items()),
    ]
    for name, key in TENANT_KEYS.items():
        lines += ["[[tenants]]", f'name = "{name}"', f'api_key = "{key}"']
    path = directory / "clora.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_server(directory: Path, *, bootstrap: str, model_path: Path, **serving) -> ServerHandle:
    from ingest.broker import free_port

    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = write_config(directory, bootstrap=bootstrap, model_path=model_path, port=port, **serving)
    log_path = directory / "serving.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("CLORA_ADMIN_KEY", None)  # the tests read /health's details, open without an admin key
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "serving", "--config", str(config)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    handle = ServerHandle(f"http://127.0.0.1:{port}", directory / "data", config, dict(TENANT_KEYS), bootstrap,
                          log_path, process)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the serving process exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            if handle.health()["status"] == "ok":
                return handle
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(handle)
            raise RuntimeError(f"the serving process was not healthy within {STARTUP_TIMEOUT_S}s:\n{_tail(log_path)}")
        time.sleep(0.5)


def stop_server(handle: ServerHandle, timeout: float = 60.0) -> None:
    terminate(handle.process, timeout)


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _from_the_beginning(bootstrap: str, topic: str, timeout: float, done: Callable[[], bool]):
    """(message, event) of every message on `topic`, from its beginning (no consumer group), until `done()`
    (asked whenever the topic has nothing more for half a second) or `timeout` seconds."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=500)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            for message in consumer:
                yield message, json.loads(message.value)
    finally:
        consumer.close()


def count_events(bootstrap: str, topic: str, ids: set[str], until: str, timeout: float = 30.0) -> dict[str, int]:
    """How many events on `topic` carry each of these ids, read from the beginning until the event `until`
    (one logged after them by the same tenant, so on the same partition after theirs)."""
    counts = dict.fromkeys(ids, 0)
    seen = set()
    for _, event in _from_the_beginning(bootstrap, topic, timeout, done=lambda: until in seen):
        if event["id"] in counts:
            counts[event["id"]] += 1
        if event["id"] == until:
            seen.add(until)
    assert until in seen, f"event {until} not found on {topic} within {timeout} s"
    return counts


def read_events(bootstrap: str, topic: str, ids: set[str], timeout: float = 30.0) -> dict[str, dict]:
    """The events with these ids on `topic` (read from the beginning, no consumer group); each message's
    key must be its event's tenant."""
    found: dict[str, dict] = {}
    for message, event in _from_the_beginning(bootstrap, topic, timeout, done=lambda: not set(ids) - set(found)):
        if event["id"] in ids:
            assert message.key.decode() == event["tenant"], message
            found[event["id"]] = event
    return found
