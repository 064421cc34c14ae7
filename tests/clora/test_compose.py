"""compose.yaml describes a real deployment: Kafka in KRaft mode, serving, ingest, learner, one data volume."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"


def test_services_volumes_and_health():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"kafka", "serving", "ingest", "learner"} <= set(services)
    assert "KAFKA_PROCESS_ROLES" in services["kafka"]["environment"]  # KRaft, no ZooKeeper
    for name in ("kafka", "serving"):
        assert "healthcheck" in services[name], name
    for name in ("serving", "ingest", "learner"):
        svc = services[name]
        assert any(str(v).startswith("clora-data:") for v in svc["volumes"]), name
        assert svc["environment"]["CLORA_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert svc["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert all(p.startswith("127.0.0.1:") for p in services["serving"]["ports"])


def _compose_cli():
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.mark.skipif(_compose_cli() is None, reason="no docker compose CLI on this machine to validate with")
def test_docker_compose_validates():
    out = subprocess.run([*_compose_cli(), "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
