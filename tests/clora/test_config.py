"""The typed config: loading, environment overrides, validation that lists every problem, the CLI surface."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clora.cli import build_parser
from clora.config import Config, ConfigError, ConfigRereads, env_variables, load_config, show_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, text: str) -> Path:
    """`text` as tmp_path/clora.toml (test_cli_errors.py uses it too)."""
    p = tmp_path / "clora.toml"
    p.write_text(text)
    return p


def test_example_config_is_valid():
    cfg = load_config(REPO / "clora.example.toml", environ={})
    assert [t.name for t in cfg.tenants] == ["acme", "digits-lab"]
    assert cfg.tenant("digits-lab").mode == "rollouts"
    assert cfg.tenant_by_key("sk-acme-change-me").name == "acme"


def test_the_example_config_names_every_setting():
    """It is the commented configuration to copy: a setting missing there is one a user never hears of."""
    import re

    from pydantic import BaseModel

    from clora.config import Config, TenantConfig

    text = (REPO / "clora.example.toml").read_text()
    named = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, re.M)) | set(re.findall(r"[{,]\s*([a-z_]+)\s*=", text))
    sections = {name: field.annotation for name, field in Config.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)}
    sections["tenants"], sections["lora"] = TenantConfig, TenantConfig.model_fields["lora"].annotation
    missing = [f"{section}.{name}" for section, model in sections.items() for name in model.model_fields
               if name not in named]
    missing += [name for name in Config.model_fields if name not in sections and name not in named]
    assert missing == []


def test_defaults_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, environ={})
    assert cfg == Config()
    assert cfg.model_path == Path(".clora/models/tiny-0")


def test_env_overrides_file(tmp_path):
    p = write_config(tmp_path, 'data_dir = "/from/file"\n[kafka]\nbootstrap = "file:9092"\n')
    cfg = load_config(p, environ={"CLORA_DATA_DIR": "/from/env", "CLORA_KAFKA_BOOTSTRAP": "env:1234"})
    assert cfg.data_dir == Path("/from/env")
    assert cfg.kafka.bootstrap == "env:1234"


def test_config_env_var_names_the_file(tmp_path):
    p = write_config(tmp_path, 'log_level = "DEBUG"\n')
    assert load_config(None, environ={"CLORA_CONFIG": str(p)}).log_level == "DEBUG"


def test_every_problem_is_listed_at_once(tmp_path):
    p = write_config(
        tmp_path,
        """
bogus = 1
[serving]
port = 70000
[[tenants]]
name = "bad name!"
api_key = "short"
scorer = "regex:("
[[tenants]]
name = "b"
api_key = "long-enough-key"
scorer = "telepathy"
""",
    )
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    msg = str(e.value)
    for fragment in ("bogus", "serving.port", "tenants.0.name", "tenants.0.api_key", "tenants.0.scorer",
                     "tenants.1.scorer", "telepathy"):
        assert fragment in msg, fragment
    assert "6 problem(s)" in msg and msg.count("\n  - ") == 6


def test_cross_field_problems(tmp_path):
    p = write_config(
        tmp_path,
        """
[[tenants]]
name = "a"
api_key = "same-key-123"
lora = { rank = 64 }
[[tenants]]
name = "a"
api_key = "same-key-123"
""",
    )
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    msg = str(e.value)
    assert "'a' appears more than once" in msg
    assert "share an api_key" in msg
    assert "lora.rank 64 exceeds serving.max_lora_rank 16" in msg


def problems(e: pytest.ExceptionInfo) -> list[str]:
    """The problem lines of a ConfigError, without their "  - "."""
    return [line.removeprefix("  - ") for line in str(e.value).splitlines()[1:]]


def test_problems_between_fields_are_listed_with_the_fields_own(tmp_path):
    """A bad field used to hide every problem between fields (pydantic skips "after" model validators then):
    fixing the file took a round per kind of problem."""
    p = write_config(tmp_path, """
bogus = 1
[serving]
port = 70000
[kafka]
partitions = 0
session_timeout_ms = 1000
heartbeat_interval_ms = 2000
[ingest]
metrics_port = 65535
processes = 2
[[tenants]]
name = "a"
api_key = "sk-aaaaaaaa"
scorer = "telepathy"
lora = { rank = 64 }
[[tenants]]
name = "a"
api_key = "sk-aaaaaaaa"
""")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    found = problems(e)
    assert str(e.value).splitlines()[0].endswith(f"{len(found)} problem(s)")
    where = [line.split(": ", 1)[0] for line in found]
    assert sorted(where) == sorted(["serving.port", "kafka.partitions", "tenants.0.scorer", "bogus",
                                    "kafka.heartbeat_interval_ms", "tenants.1.name", "tenants.1.api_key",
                                    "tenants.0.lora.rank", "ingest.metrics_port"])
    assert "tenants.1.name: tenant name 'a' appears more than once (also tenants.0)" in found
    assert "tenants.1.api_key: two tenants share an api_key (this one and tenants.0's)" in found
    assert "tenants.0.lora.rank: tenant 'a': lora.rank 64 exceeds serving.max_lora_rank 16" in found
    assert "kafka.heartbeat_interval_ms: heartbeat_interval_ms (2000) must be below session_timeout_ms (1000)" in found
    assert ("ingest.metrics_port: metrics_port 65535 leaves no port for all 2 ingest processes (process K serves on "
            "metrics_port + K, at most 65535)") in found


def test_each_problem_between_fields_is_a_line_at_its_field(tmp_path):
    from serving.protocol import MIN_TEMPERATURE

    p = write_config(tmp_path, """
[serving]
admin_key = "sk-bbbbbbbb"
[learner]
temperature = 1e-6
[[tenants]]
name = "a"
api_key = "sk-aaaaaaaa"
lora = { rank = 64 }
[[tenants]]
name = "base"
api_key = "sk-bbbbbbbb"
mode = "rollouts"
scorer = "length:5"
group_size = 32
""")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert problems(e) == [
        "tenants.1.name: tenant name 'base' collides with model.name",
        "serving.admin_key: serving.admin_key is also a tenant's api_key (tenants.1)",
        "tenants.0.lora.rank: tenant 'a': lora.rank 64 exceeds serving.max_lora_rank 16",
        "tenants.1.group_size: tenant 'base': group_size 32 is more than the 16 completions a serving request may ask for (n)",
        f"learner.temperature: learner.temperature 1e-06 is outside {MIN_TEMPERATURE:g} to 2 (the engine samples "
        f"at {MIN_TEMPERATURE:g} at least, and the learner would train another policy)",
    ]
    assert str(e.value).splitlines()[0].endswith("5 problem(s)")


def test_a_check_between_fields_skips_a_field_that_is_bad_itself(tmp_path):
    """max_lora_rank = 0 is reported as such; the tenant's rank is not then said to exceed it (or a default)."""
    p = write_config(tmp_path, '[serving]\nmax_lora_rank = 0\n[[tenants]]\nname = "a"\napi_key = "sk-aaaaaaaa"\n'
                        'lora = { rank = 64 }\n')
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert [line.split(":")[0] for line in problems(e)] == ["serving.max_lora_rank"]
    for text in ("serving = 5\n[[tenants]]\nname = 'a'\napi_key = 'sk-aaaaaaaa'\n", "tenants = [1, 'x']\n",
                 "[[tenants]]\nlora = 3\nname = 7\n"):  # bad sections and tenants: their own problems only
        with pytest.raises(ConfigError) as e:
            load_config(write_config(tmp_path, text), environ={})
        assert not [line for line in problems(e) if "more than once" in line or "exceeds" in line]


def test_a_problem_with_an_environment_override_names_the_variable(tmp_path):
    p = write_config(tmp_path, '[[tenants]]\nname = "a"\napi_key = "sk-aaaaaaaa"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={"CLORA_PORT": "eighty", "CLORA_ADMIN_KEY": "sk-aaaaaaaa", "CLORA_LOG_LEVEL": "INFO"})
    found = problems(e)
    assert len(found) == 2
    assert found[0].startswith("serving.port: ") and found[0].endswith(" (from $CLORA_PORT)")
    assert found[1] == "serving.admin_key: serving.admin_key is also a tenant's api_key (tenants.0) (from $CLORA_ADMIN_KEY)"
    p = write_config(tmp_path, "[serving]\nport = 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={"CLORA_ADMIN_KEY": "short"})
    found = dict(line.split(": ", 1) for line in problems(e))
    assert "$" not in found["serving.port"]  # the file's own
    assert found["serving.admin_key"] == "admin_key must be at least 8 characters (from $CLORA_ADMIN_KEY)"


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write_config(tmp_path, "data_dir = [unclosed"), environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'log_level = "INFO" # caf\xe9\n')
    with pytest.raises(ConfigError, match="not UTF-8"):  # a config reload must not kill the learner over it
        load_config(latin, environ={})
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path, environ={})  # a directory


def test_infinite_and_nan_numbers_are_refused_at_their_fields(tmp_path):
    """TOML writes inf and nan; `[retention] days = inf` made `clora prune` fail with a traceback."""
    p = write_config(tmp_path, "[retention]\ndays = inf\n[ingest]\nflush_seconds = nan\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    found = dict(line.split(": ", 1) for line in problems(e))
    assert set(found) == {"retention.days", "ingest.flush_seconds"}
    assert all("finite number" in why for why in found.values()), found


@pytest.mark.parametrize("bootstrap", ["localhost:9092x", "[::1", "kafka:0", "kafka:70000", "a:1,,b:2", ":9092",
                                       "k a:9092", "1:2:3:x"])
def test_a_bootstrap_that_is_not_host_port_is_refused(bootstrap):
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={"CLORA_KAFKA_BOOTSTRAP": bootstrap})
    (line,) = problems(e)
    assert line.startswith(f"kafka.bootstrap: {bootstrap!r}: ") and "is not host:port" in line


@pytest.mark.parametrize("bootstrap", ["127.0.0.1:9092", "kafka-1:9092, kafka-2:9093", "[::1]:9092", "[::1]", "::1",
                                       "kafka", "PLAINTEXT://127.0.0.1:9092"])  # the Kafka client's forms
def test_host_port_bootstraps_are_taken(bootstrap):
    assert load_config(None, environ={"CLORA_KAFKA_BOOTSTRAP": bootstrap}).kafka.bootstrap == bootstrap


def test_a_data_dir_with_a_nul_character_is_refused():
    with pytest.raises(ConfigError, match="data_dir must not contain a NUL character"):
        load_config(None, environ={"CLORA_DATA_DIR": "/tmp/a\x00b"})


def test_empty_paths_mean_the_default_model_and_no_data_dir():
    assert load_config(None, environ={"CLORA_MODEL_PATH": ""}).model.path is None  # the tiny local model
    with pytest.raises(ConfigError, match="data_dir must not be empty"):
        load_config(None, environ={"CLORA_DATA_DIR": " "})


def test_a_data_dir_under_home_is_the_same_directory_for_every_process(tmp_path, monkeypatch):
    """`~` was expanded by storage's DataDir but not by the config: the tiny model went to a literal ./~/."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, environ={"CLORA_DATA_DIR": "~/clora-data"})
    assert cfg.data_dir == tmp_path / "clora-data"
    assert cfg.model_path == tmp_path / "clora-data" / "models" / "tiny-0"


def test_model_path_and_prompts_files_under_home_are_expanded_as_data_dir_is(tmp_path, monkeypatch):
    """`path = "~/models/..."` was taken literally ("model.path ~/m does not exist") while data_dir's `~` was
    the home."""
    monkeypatch.setenv("HOME", str(tmp_path))
    p = write_config(tmp_path, '[model]\npath = "~/m"\n[[tenants]]\nname = "a"\napi_key = "sk-aaaaaaaa"\n'
                               'mode = "rollouts"\nscorer = "digits"\nprompts_file = "~/prompts.txt"\n')
    cfg = load_config(p, environ={})
    assert cfg.model.path == tmp_path / "m" and cfg.tenants[0].prompts_file == tmp_path / "prompts.txt"
    assert load_config(p, environ={"CLORA_MODEL_PATH": "~/other"}).model.path == tmp_path / "other"


@pytest.mark.parametrize("toml, field, message", [
    # accepted, then every start of serving failed in vLLM (`clora up` tried three times)
    ("[serving]\nmax_lora_rank = 12\n", "serving.max_lora_rank", "1, 8, 16, 32, 64, 128, 256, 320 or 512"),
    ("[serving]\ndtype = \"fp16\"\n", "serving.dtype", "'bfloat16'"),
    ("[learner]\ndevice = \"gpu\"\n", "learner.device", "auto|cpu|mps"),
    # ingest read its own dead letters back and rejected them again, for ever
    ("[kafka]\ndead_letter_topic = \"clora.interactions\"\n", "kafka.dead_letter_topic", "reject them again for ever"),
    ("[kafka]\nfeedback_topic = \"clora.interactions\"\n", "kafka.feedback_topic", "a topic of its own"),
    ("[kafka]\ninteractions_topic = \"my topic\"\n", "kafka.interactions_topic", "A-Za-z0-9._-"),
    ("[kafka]\nfeedback_topic = \"\"\n", "kafka.feedback_topic", "A-Za-z0-9._-"),
    ("[kafka]\nfeedback_topic = \"..\"\n", "kafka.feedback_topic", "not a topic name Kafka accepts"),
    # intervals that make a poll or a compaction a busy loop taking a core
    ("[serving]\nregistry_poll_seconds = 1e-9\n", "serving.registry_poll_seconds", "0.01"),
    ("[ingest]\nflush_seconds = 0.001\n", "ingest.flush_seconds", "0.01"),
    ("[learner]\npoll_seconds = 1e-6\n", "learner.poll_seconds", "0.01"),
])
def test_values_the_engine_kafka_or_torch_would_refuse_are_config_errors(tmp_path, toml, field, message):
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, toml), environ={})
    (line,) = problems(e)
    assert line.startswith(field) and message in line, line


def test_the_max_lora_rank_sizes_are_vllms():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    from clora.config import LORA_RANK_SIZES, ServingConfig, lora_rank_size

    assert LORA_RANK_SIZES == get_args(MaxLoRARanks) == get_args(ServingConfig.model_fields["max_lora_rank"].annotation)
    assert [lora_rank_size(r) for r in (1, 2, 8, 9, 17, 512)] == [1, 8, 8, 16, 32, 512]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        lora_rank_size(513)


def test_a_bad_path_field_beside_a_problem_between_fields_is_listed_not_a_crash(tmp_path):
    """pydantic could not rebuild a Path field's error type ("path_type"): a KeyError traceback, and a
    learner's config reload died instead of keeping the previous config."""
    p = write_config(tmp_path, '[model]\npath = 5\n[kafka]\nheartbeat_interval_ms = 9000\n')
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert "model.path" in str(e.value) and "heartbeat_interval_ms" in str(e.value)


@pytest.mark.parametrize("toml, line", [
    ("[serving]\nprot = 8000\n", "serving.prot: unknown setting; did you mean serving.port?"),
    ("port = 8000\n", "port: unknown setting; did you mean broker.port or serving.port?"),  # in no table
    ("[servng]\nport = 8000\n", "servng: unknown table; did you mean serving?"),
    ('[[tenants]]\nname = "a"\napi_key = "sk-a-00000"\nscorr = "digits"\n',
     "tenants.0.scorr: unknown setting; did you mean tenants.0.scorer?"),
    ('[[tenants]]\nname = "a"\napi_key = "sk-a-00000"\n[tenants.lora]\nrnak = 4\n',
     "tenants.0.lora.rnak: unknown setting; did you mean tenants.0.lora.rank?"),
    ("bogus = 1\n", "bogus: unknown setting (clora.example.toml names every setting)"),
    ("serving = 5\n", "serving: must be a table"),
    ("tenants = [5]\n", "tenants.0: must be a table"),
    ("tenants = 5\n", "tenants: must be an array of tables ([[tenants]])"),
    ("data_dir = 5\n", "data_dir: must be a path (a string)"),
    ("[model]\npath = 5\n", "model.path: must be a path (a string)"),
])
def test_problems_pydantic_words_in_its_own_terms_read_as_what_to_write(tmp_path, toml, line):
    """`serving.prot: Extra inputs are not permitted` (no word of serving.port), `serving: Input should be a valid
    dictionary or instance of ServingConfig`, `data_dir: Input is not a valid path for <class 'pathlib.Path'>`."""
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, toml), environ={})
    assert str(e.value).splitlines()[1:] == [f"  - {line}"]


def test_pydantics_words_are_replaced_beside_a_problem_between_fields_too(tmp_path):
    """Beside a problem between fields, the fields' own errors are rebuilt (Config._whole_config): by type."""
    p = write_config(tmp_path, "[serving]\nprot = 8000\n[kafka]\nheartbeat_interval_ms = 9000\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert "  - serving.prot: unknown setting; did you mean serving.port?" in str(e.value).splitlines()


def test_a_data_dir_whose_home_cannot_be_found_is_a_config_error():
    with pytest.raises(ConfigError, match="data_dir"):
        load_config(None, environ={"CLORA_DATA_DIR": "~no-such-user-clora/x"})


def test_a_variable_set_to_nothing_overrides_nothing(tmp_path):
    # compose passes `CLORA_MODEL_PATH: ${CLORA_MODEL:-}` to every service: unset CLORA_MODEL must leave the
    # file's model, not swap in the tiny one
    p = write_config(tmp_path, '[model]\npath = "/models/Qwen3-4B"\n[kafka]\nbootstrap = "k:9092"\n')
    cfg = load_config(p, environ={"CLORA_MODEL_PATH": "", "CLORA_KAFKA_BOOTSTRAP": ""})
    assert str(cfg.model.path) == "/models/Qwen3-4B" and cfg.kafka.bootstrap == "k:9092"
    assert str(load_config(p, environ={"CLORA_MODEL_PATH": "/other"}).model.path) == "/other"


def test_the_learners_serving_url_and_the_log_level(tmp_path):
    assert load_config(None, environ={}).learner.serving_url is None  # serving.host:port on this machine
    assert load_config(None, environ={"CLORA_SERVING_URL": "http://serving:8000"}).learner.serving_url == "http://serving:8000"
    assert load_config(None, environ={"CLORA_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    with pytest.raises(ConfigError, match="log_level"):
        load_config(None, environ={"CLORA_LOG_LEVEL": "VERBOSE"})  # was silently INFO


def test_a_length_scorer_needs_a_target_above_zero(tmp_path):
    p = write_config(tmp_path, '[[tenants]]\nname = "a"\napi_key = "long-enough-key"\nscorer = "length:0"\n')
    with pytest.raises(ConfigError, match="positive integer target"):  # ingest's scorer refused it at start
        load_config(p, environ={})


@pytest.mark.parametrize("scorer, message", [
    ("digits:strict", "scorer 'digits' takes no argument"),
    ("json_valid:", "scorer 'json_valid' takes no argument"),
    ("feedback:app", "scorer 'feedback' takes no argument"),
    ("python:os:", "scorer 'python' needs module:function"),
    ("python::f", "scorer 'python' needs module:function"),
])
def test_a_scorer_spec_ingest_would_refuse_at_start_is_refused_by_the_config(tmp_path, scorer, message):
    """Accepted here, they stopped ingest at start (exit 2), after `clora up` had waited for serving."""
    from ingest.scorers import ScorerSpecError, build_scorer

    p = write_config(tmp_path, f'[[tenants]]\nname = "a"\napi_key = "long-enough-key"\nscorer = "{scorer}"\n')
    with pytest.raises(ConfigError, match=message):
        load_config(p, environ={})
    if not scorer.startswith("feedback"):
        with pytest.raises(ScorerSpecError):  # what ingest says of it
            build_scorer(scorer)


def test_a_rollouts_tenant_needs_a_programmatic_scorer():
    """With the default scorer (feedback) a rollouts tenant passed every check, then failed every step."""
    for scorer in ("feedback", "inline"):
        with pytest.raises(ConfigError, match=f"tenant 'lab': rollouts mode needs a programmatic scorer.*'{scorer}'"):
            Config_of(tenants=[{"name": "lab", "api_key": "long-enough-key", "mode": "rollouts", "scorer": scorer}])
    with pytest.raises(ConfigError, match="rollouts mode needs a programmatic scorer"):  # the default
        Config_of(tenants=[{"name": "lab", "api_key": "long-enough-key", "mode": "rollouts"}])
    assert Config_of(tenants=[{"name": "lab", "api_key": "long-enough-key", "mode": "rollouts",
                               "scorer": "contains:a"}]).tenants[0].mode == "rollouts"


def test_show_masks_keys():
    cfg = load_config(REPO / "clora.example.toml", environ={})
    text = show_config(cfg)
    assert "sk-acme" not in text
    assert json.loads(text)["tenants"][0]["api_key"] == "********"


def test_every_field_has_a_description():
    from pydantic import BaseModel

    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation)

    walk(Config)
    from clora.config import LoraConfig, TenantConfig

    walk(TenantConfig)
    walk(LoraConfig)


def test_env_variables_listed():
    assert env_variables()["CLORA_DATA_DIR"] == "data_dir"
    assert env_variables()["CLORA_KAFKA_BOOTSTRAP"] == "kafka.bootstrap"


def test_every_subcommand_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = set(sub.choices)
    assert {"config", "broker", "bench"} <= names
    for name, p in sub.choices.items():
        assert p.format_help().startswith("usage: clora " + name), name


def test_cli_help_and_bad_config_exit_code(tmp_path):
    out = subprocess.run([sys.executable, "-m", "clora", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "commands" in out.stdout
    bad = write_config(tmp_path, "[kafka]\npartitions = 0\n")
    out = subprocess.run([sys.executable, "-m", "clora", "config", "show", "--config", str(bad)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert "kafka.partitions" in out.stderr


def test_tenant_names_that_would_share_a_directory_are_refused(tmp_path):
    p = tmp_path / "clora.toml"
    p.write_text(
        '[[tenants]]\nname = "Acme"\napi_key = "key-one-123"\n'
        '[[tenants]]\nname = "acme"\napi_key = "key-two-123"\n'
    )
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert "tenants.1.name: tenant name 'acme' differs from another only in case ('Acme', tenants.0)" in str(e.value)
    p.write_text('[[tenants]]\nname = "globex."\napi_key = "key-three-123"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert "'globex.'" in str(e.value) and "not ending with '.'" in str(e.value)
    # the registry's own file is registry/HEAD.json: a tenant of that name would break every tenant's publishes
    for name in ("HEAD.json", "head.JSON"):
        p.write_text(f'[[tenants]]\nname = "{name}"\napi_key = "key-four-123"\n')
        with pytest.raises(ConfigError) as e:
            load_config(p, environ={})
        assert f"{name!r}" in str(e.value) and "not 'HEAD.json'" in str(e.value)
    from storage.layout import InvalidName, check_tenant

    with pytest.raises(InvalidName):  # nor through ingest's unknown_tenant = "create"
        check_tenant("HEAD.json")
    assert check_tenant("HEAD.json2") == "HEAD.json2" and check_tenant("HEAD") == "HEAD"


def test_a_tenant_spec_never_shows_its_api_key():
    from clora.config import TenantConfig
    from learner.types import TenantSpec

    spec = TenantSpec.from_config(TenantConfig(name="acme", api_key="sk-secret-key-123"))
    assert spec.api_key == "sk-secret-key-123" and "sk-secret-key-123" not in repr(spec)


def test_the_learner_builds_a_tenants_scorer_with_its_time_limit(tmp_path):
    from clora.config import TenantConfig
    from ingest.scorers import ScorerError, apply
    from learner.loop import tenant_scorer
    from learner.types import TenantSpec

    spec = TenantSpec.from_config(TenantConfig(name="acme", api_key="sk-secret-key-123", scorer=r"regex:(a+)+$",
                                               scorer_time_limit_s=0.2))
    assert spec.scorer_time_limit_s == 0.2 and TenantSpec.default("x").scorer_time_limit_s == 1.0
    scorer = tenant_scorer(spec)
    with pytest.raises(ScorerError, match="stopped after 0.2 s"):
        apply(scorer, "a" * 40 + "b", "p")
    with pytest.raises(ConfigError, match="scorer_time_limit_s"):
        p = tmp_path / "clora.toml"
        p.write_text('[[tenants]]\nname = "acme"\napi_key = "sk-acme-key-1"\nscorer_time_limit_s = 0\n')
        load_config(p, environ={})


@pytest.mark.parametrize("name", ["", " ", "qwen@4b"])
def test_the_base_model_name_cannot_look_like_a_version(tmp_path, name):
    p = tmp_path / "clora.toml"
    p.write_text(f'[model]\nname = "{name}"\n')
    with pytest.raises(ConfigError, match="must not contain '@'"):
        load_config(p, environ={})


def test_the_admin_key_is_checked_and_never_shown(tmp_path):
    from clora.config import show_config

    p = tmp_path / "clora.toml"
    p.write_text('[serving]\nadmin_key = "short"\n')
    with pytest.raises(ConfigError, match="admin_key must be at least 8 characters"):
        load_config(p, environ={})
    p.write_text('[serving]\nadmin_key = "shared-key-123"\n[[tenants]]\nname = "acme"\napi_key = "shared-key-123"\n')
    with pytest.raises(ConfigError, match="admin_key is also a tenant's api_key"):
        load_config(p, environ={})
    cfg = load_config(None, environ={"CLORA_ADMIN_KEY": "admin-key-123"})
    assert cfg.serving.admin_key.get_secret_value() == "admin-key-123"
    assert "admin-key-123" not in show_config(cfg)


@pytest.mark.parametrize("host, url", [("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://127.0.0.1:8000"),
                                       ("::1", "http://[::1]:8000"), ("::", "http://[::1]:8000"),
                                       ("serving.internal", "http://serving.internal:8000")])
def test_the_serving_tiers_url_from_this_machine(host, url):
    from clora.config import ServingConfig

    assert ServingConfig(host=host).local_url == url


def test_rollouts_through_serving_ask_only_for_what_serving_allows(tmp_path):
    def tenant(**kw):
        return {"name": "lab", "api_key": "long-enough-key", "mode": "rollouts", "scorer": "length:10", **kw}

    with pytest.raises(ConfigError) as e:
        Config_of(tenants=[tenant(group_size=32)])
    assert "group_size 32 is more than the 16 completions" in str(e.value)
    with pytest.raises(ConfigError, match="serving.max_inflight_per_tenant 4"):
        Config_of(tenants=[tenant(group_size=8)], serving={"max_inflight_per_tenant": 4})
    # a quarter of the room is kept for production requests: a rollout request that large would wait for an idle tenant
    with pytest.raises(ConfigError, match=r"group_size 4 is more than serving.max_inflight_per_tenant 4 less the quarter"):
        Config_of(tenants=[tenant(group_size=4)], serving={"max_inflight_per_tenant": 4})
    Config_of(tenants=[tenant(group_size=3)], serving={"max_inflight_per_tenant": 4})
    with pytest.raises(ConfigError, match="learner.max_new_tokens 512 leaves no room in serving.max_model_len 512"):
        Config_of(tenants=[tenant()], learner={"max_new_tokens": 512})
    with pytest.raises(ConfigError, match="learner.temperature 1e-06 is outside"):
        Config_of(tenants=[tenant()], learner={"temperature": 1e-6})
    # the learner's own sampler has no such limits
    Config_of(tenants=[tenant(group_size=32)], learner={"rollout_sampler": "local"})


@pytest.mark.parametrize("sampler", ["serving", "local"])
def test_a_rollouts_group_of_one_is_refused_it_would_never_learn(sampler):
    rollouts = {"name": "lab", "api_key": "long-enough-key", "mode": "rollouts", "scorer": "length:10"}
    with pytest.raises(ConfigError, match="tenant .lab.: group_size 1 in rollouts mode never learns"):
        Config_of(tenants=[{**rollouts, "group_size": 1}], learner={"rollout_sampler": sampler})
    logs = {"name": "app", "api_key": "another-long-key", "mode": "logs", "group_size": 1}
    assert Config_of(tenants=[logs]).tenants[0].group_size == 1  # logs mode has no groups


def Config_of(**sections):
    """Config.model_validate, failing as load_config does."""
    from pydantic import ValidationError

    from clora.config import Config

    try:
        return Config.model_validate(sections)
    except ValidationError as e:
        raise ConfigError(str(e)) from None


def test_config_env_lists_every_variable_clora_reads(capsys):
    from clora.cli import main

    assert main(["config", "env"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["CLORA_CONFIG", *env_variables()]  # CLORA_CONFIG names the file; the others override fields
    table = (Path(__file__).resolve().parents[2] / "README.md").read_text().split("| variable | field |", 1)[1]
    table = table.split("\n\n", 1)[0]
    assert [v for v in listed if f"`{v}`" not in table] == [], "the README's table of variables misses these"


def test_clora_variables_nothing_reads_are_named_with_the_nearest_real_one():
    """An exported CLORA_MODEL (compose's .env name) or CLORA_SERVING_PORT was silently ignored: the tiny model,
    port 8000, and nothing said why."""
    from clora.config import unknown_env_variables

    environ = {"CLORA_MODEL": "/m", "CLORA_SERVING_PORT": "9000", "CLORA_DATADIR": "d", "CLORA_FOO": "1",
               "CLORA_PORT": "9000", "CLORA_CONFIG": "c.toml", "CLORA_CPU_LORA_OPS": "vllm", "OTHER": "x"}
    assert list(unknown_env_variables(environ).values()) == [
        "CLORA_DATADIR is not a clora setting and is ignored (did you mean CLORA_DATA_DIR?); `clora config env` lists them",
        "CLORA_FOO is not a clora setting and is ignored; `clora config env` lists them",
        "CLORA_MODEL is not a clora setting and is ignored (did you mean CLORA_MODEL_PATH?); `clora config env` lists them",
        "CLORA_SERVING_PORT is not a clora setting and is ignored (did you mean CLORA_PORT?); `clora config env` lists them",
    ]


def test_up_warns_of_them_once_not_once_per_child(monkeypatch, tmp_path):
    from clora.up import stack_specs

    monkeypatch.setenv("CLORA_SERVING_PORT", "9000")
    specs, _ = stack_specs(Config.model_validate({"data_dir": str(tmp_path)}), None)
    assert specs and all(spec.env["CLORA_SERVING_PORT"] is None for spec in specs)  # unset in every child


def test_commands_warn_of_clora_variables_nothing_reads(tmp_path):
    env = {**os.environ, "CLORA_SERVING_PORT": "9000", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("CLORA_CONFIG", None)
    for action in ("show", "env"):  # env, where one looks the real name up, reads no config
        done = subprocess.run([sys.executable, "-m", "clora", "config", action], capture_output=True, text=True,
                              env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "clora: warning: CLORA_SERVING_PORT is not a clora setting and is ignored (did you mean CLORA_PORT?)" \
            in done.stderr, action


def test_kafka_security_settings_reach_every_kafka_client_as_kafka_python_options(tmp_path, monkeypatch):
    from ingest.process import build

    path = tmp_path / "clora.toml"
    path.write_text(f'data_dir = "{tmp_path}"\n[kafka]\nbootstrap = "kafka-1:9093,kafka-2:9093"\n'
                    'security_protocol = "SASL_SSL"\nsasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "clora"\n'
                    'ssl_cafile = "~/ca.pem"\n')
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(path, environ={"CLORA_KAFKA_SASL_PASSWORD": "from-the-env"})
    expected = {"bootstrap_servers": "kafka-1:9093,kafka-2:9093", "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "clora",
                "sasl_plain_password": "from-the-env", "ssl_check_hostname": True, "ssl_cafile": f"{tmp_path}/ca.pem"}
    assert cfg.kafka.client_options() == expected
    assert build(cfg).client_options == expected  # ingest's consumer and producer
    assert "from-the-env" not in show_config(cfg), "the password is masked"
    assert Config().kafka.client_options() == {"bootstrap_servers": "127.0.0.1:9092", "security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("kafka, field, message", [
    ('security_protocol = "SASL_PLAINTEXT"\nsasl_mechanism = "PLAIN"\nsasl_username = "u"', "kafka.sasl_password",
     "security_protocol SASL_PLAINTEXT needs kafka.sasl_password (or $CLORA_KAFKA_SASL_PASSWORD)"),
    ('security_protocol = "SSL"\nssl_certfile = "/etc/clora/client.pem"', "kafka.ssl_keyfile",
     "ssl_certfile and ssl_keyfile go together"),
    ('security_protocol = "TLS"', "kafka.security_protocol", "SASL_SSL"),
    ("replication_factor = 0", "kafka.replication_factor", ""),
])
def test_kafka_connection_settings_that_cannot_work_are_config_errors(tmp_path, kafka, field, message):
    path = tmp_path / "clora.toml"
    path.write_text(f"[kafka]\n{kafka}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={})
    assert field in str(e.value) and message in str(e.value), str(e.value)


def test_a_config_read_again_is_handed_on_once_two_reads_in_a_row_agree(tmp_path):
    path = tmp_path / "clora.toml"
    one = '[[tenants]]\nname = "acme"\napi_key = "sk-acme-0000"\n'
    two = one + '\n[[tenants]]\nname = "zeta"\napi_key = "sk-zeta-0000"\n'
    path.write_text(one)
    rereads = ConfigRereads(lambda: load_config(path, environ={}), load_config(path, environ={}))
    assert [t.name for t in rereads.read().tenants] == ["acme"], "unchanged: handed on at once"
    path.write_text("")  # an editor's truncation, read before its write
    assert rereads.read() is None
    path.write_text(two)
    assert rereads.read() is None, "differs from the read before (the empty one)"
    path.write_text("[[tenants]\n")  # a read that fails raises, and is not a read
    with pytest.raises(ConfigError):
        rereads.read()
    path.write_text(two)
    assert [t.name for t in rereads.read().tenants] == ["acme", "zeta"]
    path.write_text(two.replace("sk-zeta-0000", "sk-zeta-1111"))  # a rotated key is a change
    assert rereads.read() is None
    assert rereads.read().tenants[1].api_key.get_secret_value() == "sk-zeta-1111"


def test_a_config_followed_by_its_file_is_read_again_only_when_the_file_changed(tmp_path):
    path = tmp_path / "clora.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_key = "sk-acme-0000"\n')
    reads = []

    def reread():
        reads.append(1)
        return load_config(path, environ={})

    rereads = ConfigRereads(reread, load_config(path, environ={}), path=path)
    first = rereads.read()
    assert rereads.read() is first and rereads.read() is first and len(reads) == 1
    # Another size: a rewrite within the clock tick of the first write would keep its times.
    path.write_text('[[tenants]]\nname = "zeta"\napi_key = "sk-zeta-00000"\n')
    assert rereads.read() is None and rereads.read().tenants[0].name == "zeta" and len(reads) == 3
    assert rereads.read().tenants[0].name == "zeta" and len(reads) == 3


def test_a_followed_config_logs_a_failed_read_once_per_error_and_a_change_that_waits_for_a_restart(tmp_path, caplog):
    path = tmp_path / "clora.toml"
    tenant = '[[tenants]]\nname = "acme"\napi_key = "sk-acme-0000"\n'
    path.write_text(tenant)
    rereads = ConfigRereads(lambda: load_config(path, environ={}), load_config(path, environ={}), service="ingest",
                            at_restart=(lambda c: c.ingest, "the [ingest] settings"))
    caplog.set_level("INFO", logger="clora.config")
    path.write_text("[[tenants]\n")
    assert rereads.follow() is None and rereads.follow() is None, "a failed read gives None, not an exception"
    assert caplog.text.count("config re-read failed; ingest goes on as it is") == 1, caplog.text
    path.write_text("[ingest\n")  # another error is said
    assert rereads.follow() is None
    assert caplog.text.count("config re-read failed") == 2
    path.write_text(tenant + "[ingest]\nflush_rows = 7\n")
    assert rereads.follow() is None, "not yet settled"
    assert rereads.follow().ingest.flush_rows == 7 and rereads.follow().ingest.flush_rows == 7
    assert caplog.text.count("the [ingest] settings changed in the config: ingest applies them when it starts again") == 1
    path.write_text("[[tenants]\n")
    rereads.follow()
    assert caplog.text.count("config re-read failed") == 3, "the same error after a good read is said again"
