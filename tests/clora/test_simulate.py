"""Simulated user preferences and the per-tenant summary (pure logic)."""

import math

import pytest

from clora.simulate import (
    Record,
    SimTenant,
    likes_digits,
    likes_json,
    likes_short_answers,
    likes_upper_case,
    summarise,
)

pytestmark = pytest.mark.unit


def test_preferences_by_hand():
    assert likes_digits("a1 b2") == pytest.approx(2 / 4)  # spaces are ignored: a,1,b,2
    assert likes_digits("") == 0.0
    assert likes_upper_case("ABc d") == pytest.approx(2 / 4)
    assert likes_short_answers("hello") == 1.0
    assert likes_short_answers("x" * 42) == pytest.approx(1 - 30 / 100)
    assert likes_short_answers("x" * 112) == pytest.approx(0.0)
    assert likes_short_answers("x" * 200) == 0.0
    assert likes_json('{"a": 1}') == 1.0
    assert likes_json("[1, 2]") < 1.0  # valid JSON but not an object
    assert likes_json("plain words") == 0.0
    assert 0.3 <= likes_json('{"a": ') < 1.0


def test_summary_windows_and_versions():
    t = SimTenant("a", "k" * 8, "digits")
    recs = [Record(i, "a", f"r{i}", "base" if i < 4 else "a@1", i / 10, "", True) for i in range(8)]
    recs.append(Record(9, "a", "", "", 0.0, "", False, "boom"))
    s = summarise(recs, [t], window=0.25)["a"]
    assert s["requests"] == 9 and s["failed"] == 1
    assert s["reward_base"] == pytest.approx((0.0 + 0.1 + 0.2 + 0.3) / 4)  # the base model's answers
    assert s["reward_last"] == pytest.approx((0.6 + 0.7) / 2)
    assert s["versions_seen"] == ["base", "a@1"]
    # Without a base-model answer (every one came from an adapter): the first window.
    adapted = [Record(i, "a", f"r{i}", "a@1", i / 10, "", True) for i in range(8)]
    assert summarise(adapted, [t], window=0.25)["a"]["reward_base"] == pytest.approx((0.0 + 0.1) / 2)
    empty = summarise([], [t])["a"]
    assert empty["requests"] == 0 and math.isnan(empty["reward_base"])


def test_the_base_models_answers_are_those_without_a_version_whatever_its_name():
    """model.name need not be "base": any label without "@" is the base model's."""
    t = SimTenant("a", "k" * 8, "digits")
    recs = [Record(i, "a", f"r{i}", "qwen3-4b" if i < 2 else "a@1", 0.1 if i < 2 else 0.9, "", True) for i in range(8)]
    assert summarise(recs, [t], window=0.5)["a"]["reward_base"] == pytest.approx(0.1)


def test_a_failure_other_than_the_apis_is_counted_and_logged_once(monkeypatch, caplog):
    """Without the openai package (or on any bug) every request raised in its pool future, unseen: the run
    sent nothing and said nothing."""
    import sys

    from clora.simulate import Simulator

    monkeypatch.setitem(sys.modules, "openai", None)  # import openai fails
    sim = Simulator("http://127.0.0.1:9", [SimTenant("a", "k" * 8, "digits"), SimTenant("b", "k" * 9, "upper")],
                    rate=40, duration=0.3)
    with caplog.at_level("ERROR", logger="clora.simulate"):
        records = sim.run()
    assert len(records) >= 4 and not any(r.ok for r in records)
    assert all(r.error.startswith("ModuleNotFoundError") and "openai" in r.error for r in records)
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    s = summarise(records, sim.tenants)
    assert s["a"]["failed"] == s["a"]["requests"] > 0


def simulate_config(tmp_path):
    p = tmp_path / "clora.toml"
    p.write_text(f'data_dir = "{tmp_path / "data"}"\n[[tenants]]\nname = "digits-app"\napi_key = "sk-digits-0000"\n')
    return str(p)


def test_simulate_exits_1_when_a_tenant_had_no_request_succeed(tmp_path, capsys):
    from clora.cli import main
    from ingest.broker import free_port

    code = main(["simulate", "--config", simulate_config(tmp_path), "--url", f"http://127.0.0.1:{free_port()}",
                 "--seconds", "0.3", "--rate", "10"])  # nothing listens there
    assert code == 1
    err = capsys.readouterr().err
    assert "no request succeeded for digits-app" in err


def test_simulate_does_not_fail_for_a_tenant_that_got_no_request(tmp_path, monkeypatch, capsys):
    """A short run at a low rate reaches only some tenants (round robin): no request is no failure."""
    from clora import simulate as simulate_module
    from clora.cli import main

    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n[[tenants]]\nname = "a"\napi_key = "sk-a-00000000"\n'
                      '[[tenants]]\nname = "b"\napi_key = "sk-b-00000000"\n')

    def one_request(self):
        self.records.append(simulate_module.Record(0.1, "a", "r1", "a@1", 1.0, "ok", True))

    monkeypatch.setattr(simulate_module.Simulator, "run", one_request)
    assert main(["simulate", "--config", str(config), "--seconds", "1", "--rate", "1"]) == 0
    assert "no request succeeded" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--rate", "0"], ["--rate", "-1"], ["--seconds", "0"], ["--seconds", "nan"],
                                  ["--rate", "inf"], ["--max-tokens", "0"]])
def test_simulate_refuses_a_rate_or_duration_that_is_not_above_0(tmp_path, capsys, args):
    from clora.cli import main

    with pytest.raises(SystemExit) as e:
        main(["simulate", "--config", simulate_config(tmp_path), *args])
    assert e.value.code == 2
    assert "must be" in capsys.readouterr().err
