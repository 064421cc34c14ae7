"""Fixtures every test tier shares.

- `data_dir`: a fresh clora data directory per test.
- `tiny_model`: the local tiny model, built once and cached under the repository's `.clora/models` (the
  same cache `make setup` and the demo use), so a test session never rebuilds it.
- `broker`: the real embedded Kafka-compatible broker on a free port, started once per session with
  clora's topics, stopped at the end.
- `server`: the real serving process (`python -m serving`: the vLLM engine with LoRA enabled on the tiny
  model, the HTTP API, the Kafka event log) once per session, with the tenants of
  `serving_process.TENANT_KEYS`, a fresh data directory, the session broker; stopped by its pid at the end.

Services bind to 127.0.0.1 only and are stopped by the handle that started them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO / ".clora" / "models"

# Keep vLLM's CPU KV cache small: tests run on a shared 2-core machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture
def proxied(monkeypatch):
    """An environment whose HTTP proxy (nothing listens on port 9) is set for outside traffic only: no NO_PROXY."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from learner.tiny_model import ensure_tiny

    return ensure_tiny(MODEL_CACHE, seed=0)


@pytest.fixture(scope="session")
def broker():
    from clora.config import KafkaConfig
    from ingest.broker import EmbeddedBroker, free_port

    kafka = KafkaConfig()
    b = EmbeddedBroker("127.0.0.1", free_port())
    b.start([kafka.interactions_topic, kafka.feedback_topic, kafka.dead_letter_topic], partitions=kafka.partitions)
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory, broker, tiny_model):
    from serving_process import start_server, stop_server

    handle = start_server(tmp_path_factory.mktemp("serving"), bootstrap=broker.bootstrap, model_path=tiny_model)
    try:
        yield handle
    finally:
        stop_server(handle)
