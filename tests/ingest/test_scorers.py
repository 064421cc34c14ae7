"""Scorers against hand-computed rewards, spec parsing, and apply's failure reporting."""

import json
import math
import signal
import sys
import threading
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest import scorers
from ingest.scorers import ScorerError, ScorerSpecError, apply, build_scorer, digits, is_function, json_valid, uppercase

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
        ("uppercase", "ǅx", 0.0),  # a titlecase letter is a letter but not upper case
        ("digits", "x\ud800y1", 0.25),  # a lone surrogate counts as one character
        ("json_valid", "true", 1.0),
        ("json_valid", "\n\t[1]", 1.0),
        ("json_valid", "truth", 0.0),
        ("json_valid", "-Infinity", 0.0),
        ("json_valid", "1e999", 1.0),  # strict JSON syntax, even though the number overflows
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


@pytest.mark.parametrize("source, error", [
    ("def f(completion, prompt)\n    return 1.0\n", "SyntaxError"),
    ("raise RuntimeError('no judge model configured')\n", "RuntimeError: no judge model configured"),
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
])
def test_a_python_scorer_module_that_fails_as_it_loads_is_a_spec_error(tmp_path, monkeypatch, source, error):
    """Only ImportError was: a module with a syntax error or failing top-level code was a traceback (and
    `clora ingest` did not exit 2 with one line)."""
    (tmp_path / "clora_broken_scorer_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "clora_broken_scorer_mod", raising=False)
    with pytest.raises(ScorerSpecError, match=f"importing module 'clora_broken_scorer_mod' failed: {error}"):
        build_scorer("python:clora_broken_scorer_mod:f")


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


def test_json_with_a_very_long_integer_is_valid_json():
    assert json_valid("[" + "9" * 5000 + "]", "") == 1.0 and json_valid("[1, 2", "") == 0.0


def test_a_scorer_that_exits_is_a_scorer_error_and_numpy_scalars_are_numbers():
    """sys.exit() in a user's scorer raised SystemExit out of ingest (and again on every replay); numpy's
    float32 and int64 were dead-lettered as "not a finite number"."""
    import numpy as np

    with pytest.raises(ScorerError, match="SystemExit"):
        apply(lambda c, p: sys.exit(3), "c", "p")
    assert apply(lambda c, p: np.float32(0.5), "c", "p") == 0.5 and apply(lambda c, p: np.int64(1), "c", "p") == 1.0
    with pytest.raises(ScorerError, match="not a finite number"):
        apply(lambda c, p: np.bool_(True), "c", "p")


class _Unshowable:
    def __repr__(self):
        raise RuntimeError("no repr")


class _Unprintable(Exception):
    def __str__(self):
        raise ValueError("no str")


@pytest.mark.parametrize(("returned", "match"), [
    (10**400, "integer of 1329 bits, outside"),  # float() overflows: math.isfinite raised out of apply
    (-(10**400), "integer of 1329 bits, outside"),
    (10**5000, "integer of 16610 bits, outside"),  # repr() of it raises ValueError (over 4300 digits)
    (10**300, "1e\\+300, outside"),  # a float can hold this one
    ([10**5000], "not a finite number"),  # repr() of the list raises as well
    (_Unshowable(), "_Unshowable \\(its repr\\(\\) failed\\), not a finite number"),
], ids=["1e400", "-1e400", "1e5000", "1e300", "list", "unshowable"])  # the default ids would str() 10**5000
def test_apply_turns_any_returned_value_into_a_reward_or_scorer_error(returned, match):
    with pytest.raises(ScorerError, match=match):
        apply(lambda c, p: returned, "c", "p")


def test_a_scorer_out_of_memory_is_a_scorer_error_and_ctrl_c_still_goes_up():
    """numpy's "Unable to allocate 596 GiB" (a MemoryError) went up out of apply and stopped ingest, at that
    event again at every restart. The allocation was never made: the process is fine, the event is not."""
    def allocate(completion, prompt):
        raise MemoryError("Unable to allocate 596. GiB for an array with shape (640000000000,) and data type uint8")

    with pytest.raises(ScorerError, match="scorer raised MemoryError: Unable to allocate 596. GiB"):
        apply(allocate, "c", "p")

    def interrupted(completion, prompt):
        raise KeyboardInterrupt  # what Ctrl-C raises in whatever code runs: not to be told from a scorer's own

    with pytest.raises(KeyboardInterrupt):
        apply(interrupted, "c", "p")


def test_apply_reports_a_scorer_exception_that_cannot_be_printed():
    def boom(completion, prompt):
        raise _Unprintable()

    with pytest.raises(ScorerError, match="_Unprintable: \\(its message cannot be shown\\)"):
        apply(boom, "c", "p")


# ---------------------------------------------------------------------------------------------------------
# The counting scorers take shortcuts (bytes.translate, a first-character check); they must agree with
# the plain definitions on any text.


def _reference_digits(completion: str) -> float:
    return sum(c in "0123456789" for c in completion) / len(completion) if completion else 0.0


def _reference_uppercase(completion: str) -> float:
    letters = [c for c in completion if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def _reference_json_valid(completion: str) -> float:
    def reject(name):
        raise ValueError(name)

    try:
        json.loads(completion, parse_constant=reject)
    except (ValueError, RecursionError):
        return 0.0
    return 1.0


_json_texts = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
).map(json.dumps)
_texts = st.text() | st.text(alphabet="aZ09 \t\n{}[]\"-.eEtrufalsn:,ÉéǅΣσ٣") | st.tuples(st.sampled_from(["", " ", "\n "]), _json_texts).map("".join)


@settings(max_examples=500, deadline=None)
@given(_texts)
def test_counting_scorers_agree_with_their_definitions(text):
    assert digits(text, "") == _reference_digits(text)
    assert uppercase(text, "") == _reference_uppercase(text)
    assert json_valid(text, "") == _reference_json_valid(text)


# ---------------------------------------------------------------------------------------------------------
# The time limit of regex and python scorers


def spin_forever(completion, prompt):
    while True:
        pass


def spin_swallowing_exceptions(completion, prompt):
    while True:
        try:
            while True:
                pass
        except Exception:  # a scorer that swallows errors must not swallow the time limit
            pass


def wait_for_an_answer_that_never_comes(completion, prompt):
    """A judge model called over the network with no timeout, its server gone quiet: a blocking read."""
    import socket

    mine, theirs = socket.socketpair()
    try:
        return float(mine.recv(1))  # nothing is ever sent
    finally:
        mine.close()
        theirs.close()


def retry_after_a_bare_except(completion, prompt):
    try:
        while True:
            pass
    except:  # noqa: E722 - bare: it swallows the time limit's own exception, then tries again
        while True:
            pass


def _alarm_left() -> float:
    return signal.getitimer(signal.ITIMER_REAL)[0]


@pytest.mark.parametrize(
    "spec, completion",
    [
        (r"regex:(a+)+$", "a" * 40 + "b"),  # catastrophic backtracking: ~2^40 steps
        (f"python:{__name__}:spin_forever", "x"),
        (f"python:{__name__}:spin_swallowing_exceptions", "x"),
        (f"python:{__name__}:retry_after_a_bare_except", "x"),  # stopped by the alarm's repeat
        # A blocking system call: restarted by the kernel after the alarm (SA_RESTART), it never returned to
        # Python to be stopped, and hung ingest for every tenant on its partitions.
        (f"python:{__name__}:wait_for_an_answer_that_never_comes", "x"),
    ],
)
def test_a_scorer_past_its_time_limit_is_stopped_as_a_scorer_error(spec, completion):
    scorer = build_scorer(spec, time_limit_s=0.2)
    start = time.monotonic()
    with pytest.raises(ScorerError, match=r"ScorerTimeout: stopped after 0.2 s"):
        apply(scorer, completion, "p")
    assert time.monotonic() - start < 60  # not run to its end (~2^40 steps, or for ever); margin for a slow machine
    assert _alarm_left() == 0  # no alarm left armed for what runs next
    assert apply(build_scorer("regex:b$", time_limit_s=0.2), "a" * 40 + "b", "p") == 1.0  # the next call runs


def test_a_regex_stopped_once_scores_the_next_completion():
    scorer = build_scorer(r"regex:(a+)+$", time_limit_s=0.2)
    with pytest.raises(ScorerError, match="ScorerTimeout"):
        apply(scorer, "a" * 40 + "b", "p")
    assert apply(scorer, "aaa", "p") == 1.0
    assert apply(scorer, "a" * 12 + "b", "p") == 0.0


def test_only_unbounded_kinds_are_limited_and_none_means_no_limit():
    assert build_scorer("digits") is digits  # bounded by the completion's length: called as is
    assert apply(build_scorer("regex:a", time_limit_s=None), "a", "p") == 1.0
    assert build_scorer("regex:a", time_limit_s=None).__name__ == "score"  # the bare regex scorer, no wrapper
    assert build_scorer("regex:a").__qualname__.startswith("time_limited")  # the default: limited


def test_the_limit_leaves_a_programs_own_sigalrm_handler_alone(monkeypatch):
    seen = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: seen.append(signum))
    try:
        assert apply(build_scorer("regex:(a+)+$", time_limit_s=0.05), "a" * 18 + "b", "p") == 0.0  # unlimited: finishes
        assert signal.getsignal(signal.SIGALRM) is not scorers._on_alarm and not seen
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_a_scorer_runs_unlimited():
    scorer = build_scorer("regex:(a+)+$", time_limit_s=0.001)
    results = []
    worker = threading.Thread(target=lambda: results.append(apply(scorer, "a" * 18 + "b", "p")))
    worker.start()
    worker.join(60)
    assert results == [0.0]
