"""Scorers against hand-computed rewards, spec parsing, and apply's failure reporting."""

import math
import sys
import types

import pytest

from ingest.scorers import ScorerError, ScorerSpecError, apply, build_scorer, is_function

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("spec", "completion", "expected"),
    [
        ("contains:42", "the answer is 42.", 1.0),
        ("contains:42", "the answer is 24.", 0.0),
        ("contains:a:b", "x a:b y", 1.0),  # only the first ':' separates kind and argument
        ("regex:^\\d+$", "12345", 1.0),
        ("regex:^\\d+$", "123a", 0.0),
        ("regex:cat|dog", "hotdog", 1.0),
        ("length:10", "x" * 10, 1.0),
        ("length:10", "x" * 5, 0.5),  # 1 - |5 - 10| / 10
        ("length:10", "x" * 13, 0.7),  # 1 - 3 / 10
        ("length:10", "x" * 20, 0.0),
        ("length:10", "x" * 35, 0.0),  # floored at 0
        ("length:4", "", 0.0),
        ("json_valid", '{"a": [1, 2]}', 1.0),
        ("json_valid", " 3 ", 1.0),
        ("json_valid", "{'a': 1}", 0.0),
        ("json_valid", "NaN", 0.0),  # not strict JSON
        ("json_valid", "", 0.0),
        ("digits", "a1b2", 0.5),
        ("digits", "2024", 1.0),
        ("digits", "", 0.0),
        ("digits", "١٢", 0.0),  # Arabic-Indic digits are not ASCII digits
        ("digits", "ab 12 cd 3", 0.3),
        ("uppercase", "ABcd", 0.5),
        ("uppercase", "AB 12!", 1.0),  # only letters count
        ("uppercase", "123", 0.0),
        ("uppercase", "Éa", 0.5),
    ],
)
def test_rewards(spec, completion, expected):
    assert math.isclose(build_scorer(spec)(completion, "prompt"), expected)


def test_python_scorer(monkeypatch):
    mod = types.ModuleType("clora_test_scorer_mod")
    mod.half_if_prompt_echoed = lambda completion, prompt: 0.5 if prompt in completion else -0.5
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    fn = build_scorer("python:clora_test_scorer_mod:half_if_prompt_echoed")
    assert fn("say hi: hi", "hi") == 0.5 and fn("nope", "hi") == -0.5


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("feedback", "takes its reward from events"),
        ("inline", "takes its reward from events"),
        ("nope", "unknown scorer kind"),
        ("contains", "needs an argument"),
        ("digits:3", "takes no argument"),
        ("length:abc", "positive integer"),
        ("length:0", "positive"),
        ("regex:(", "does not compile"),
        ("python:no_such_module_xyz:f", "cannot import"),
        ("python:math:no_such_function", "no callable"),
        ("python:math", "module:function"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ScorerSpecError, match=match):
        build_scorer(spec)


def test_is_function():
    assert not is_function("feedback") and not is_function("inline")
    assert is_function("digits") and is_function("contains:x")


def test_apply_turns_failures_into_scorer_error():
    def boom(completion, prompt):
        return {}["missing"]

    with pytest.raises(ScorerError, match="KeyError") as e:
        apply(boom, "c", "p")
    assert "boom" in str(e.value)  # the traceback summary names the failing function
    with pytest.raises(ScorerError, match="outside"):
        apply(lambda c, p: 1.5, "c", "p")
    with pytest.raises(ScorerError, match="not a finite number"):
        apply(lambda c, p: float("nan"), "c", "p")
    with pytest.raises(ScorerError, match="not a finite number"):
        apply(lambda c, p: "1", "c", "p")
    assert apply(lambda c, p: 1, "c", "p") == 1.0
