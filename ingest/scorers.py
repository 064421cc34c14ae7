"""Scorers: pure functions (completion, prompt) -> reward, built from a tenant's `scorer` spec string.

A spec is "kind" or "kind:argument" (validated in clora/config.py, `TenantConfig.scorer`):

    feedback            no function: the reward comes from feedback events (or an inline reward)
    inline              no function: the reward travels in the interaction event (`reward`); feedback
                        events still score interactions that came without one
    contains:TEXT       1.0 if TEXT occurs in the completion, else 0.0
    regex:PATTERN       1.0 if the pattern matches anywhere in the completion (re.search), else 0.0
    length:N            1 - |len(completion) - N| / N, floored at 0: 1.0 at N characters, 0.0 at 0 or 2N
    json_valid          1.0 if the completion parses as strict JSON (no NaN/Infinity), else 0.0
    digits              fraction of the completion's characters that are ASCII digits (0.0 when empty)
    uppercase           fraction of the completion's letters that are upper case (0.0 without letters)
    python:MOD:FUNC     FUNC(completion, prompt) from importable module MOD; must return a finite number
                        in [-1, 1]

A regex (which can backtrack for ages on a short text) and a python function (which can do anything) get a
time limit per call, the tenant's `scorer_time_limit_s`: past it the call is stopped and fails like a
scorer that raised. The limit is a SIGALRM timer, so it holds on the main thread (ingest's loop, the
learner's loop), where Python delivers signals, and stops Python code, regular expressions (which check
for signals as they run) and blocking system calls (the alarm interrupts them while a limited call runs);
a call into C that never returns to Python is stopped only once it does.
Elsewhere (another thread, or a process whose SIGALRM handler is someone else's) the call runs unlimited.

Ingest scores interactions with these; the learner's rollouts mode imports `build_scorer` too. `apply`
runs a scorer and turns any failure into one `ScorerError` whose message is a traceback summary (ingest
dead-letters that event with reason `scorer_error`). A MemoryError counts as a failure too: a scorer that
asks numpy for an impossible array ("Unable to allocate 596 GiB") fails that one call, the allocation never
made, and raising it on would stop ingest at that event again at every restart. KeyboardInterrupt alone
goes up: Ctrl-C lands in whatever code runs (the learner's second Ctrl-C raises it from its signal handler),
and nothing tells that apart from a scorer's own `raise KeyboardInterrupt`. Checking what a python scorer
returned cannot raise anything else either: an int past a float's range (10**400 made `math.isfinite` raise
OverflowError, which stopped ingest) is converted with its overflow caught, and values are shown without a
repr that could fail or run to thousands of digits. Nothing here does I/O beyond importing a python scorer
(from the current directory too, searched last: `_searched_last`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import math
import numbers
import os
import re
import signal
import string
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from clora.config import EVENT_SCORERS
from ingest.events import exception_text, shown

Scorer = Callable[[str, str], float]  # (completion, prompt) -> reward in [-1, 1]

# Kinds whose reward comes from events rather than from a function.
EVENT_REWARDS = EVENT_SCORERS
# Kinds whose time the completion's length does not bound: they get a time limit per call.
UNBOUNDED_KINDS = ("regex", "python")
DEFAULT_TIME_LIMIT_S = 1.0


class ScorerSpecError(ValueError):
    """A scorer spec that cannot be turned into a function (unknown kind, bad argument, failed import)."""


class ScorerError(RuntimeError):
    """A scorer raised or returned something other than a finite number in [-1, 1]."""


class Unbuilt:
    """Stands for a tenant's scorer function that cannot be built now (a python: scorer whose module does not
    import yet): each call is a ScorerError saying so, so the tenant's interactions are dead-lettered with
    the reason, as a failing scorer's are, while the other tenants go on; ingest tries to build it again."""

    def __init__(self, spec: str, error: str) -> None:
        self.spec, self.error = spec, error

    def __call__(self, completion: str, prompt: str) -> float:
        raise ScorerError(f"the scorer cannot be built (ingest tries again every minute): {self.error}")


# ---------------------------------------------------------------------------------------------------------
# The scorers


def contains(text: str) -> Scorer:
    def score(completion: str, prompt: str) -> float:
        return 1.0 if text in completion else 0.0

    return score


def regex(pattern: str) -> Scorer:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ScorerSpecError(f"scorer regex {pattern!r} does not compile: {e}") from e

    def score(completion: str, prompt: str) -> float:
        return 1.0 if compiled.search(completion) else 0.0

    return score


def length(target: int) -> Scorer:
    if target <= 0:
        raise ScorerSpecError(f"scorer length needs a positive target, got {target}")

    def score(completion: str, prompt: str) -> float:
        return max(0.0, 1.0 - abs(len(completion) - target) / target)

    return score


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


# What strict JSON text can start with, after whitespace: the rest fails json.loads at its first
# character, so json_valid answers 0.0 for it without paying for the parser's exception.
_JSON_FIRST = frozenset('{["-0123456789')
_JSON_WORDS = ("true", "false", "null")
_JSON_SPACE = " \t\n\r"


def json_valid(completion: str, prompt: str) -> float:
    text = completion.lstrip(_JSON_SPACE)
    if not text or (text[0] not in _JSON_FIRST and not text.startswith(_JSON_WORDS)):
        return 0.0
    try:
        # parse_int: only the grammar matters, and int() refuses over 4300 digits (valid JSON all the same)
        json.loads(completion, parse_constant=_reject_constant, parse_int=len)
    except (ValueError, RecursionError):
        return 0.0
    return 1.0


# digits and uppercase count characters with bytes.translate (C speed) rather than a Python loop per
# character. ASCII digits are single bytes in UTF-8, and no multi-byte sequence holds a byte below 0x80,
# so digit bytes in the UTF-8 text are digit characters; for ASCII text, isalpha/isupper are exactly
# membership in these tables.
_DIGITS = b"0123456789"
_ASCII_LETTERS = string.ascii_letters.encode()
_ASCII_UPPER = string.ascii_uppercase.encode()


def digits(completion: str, prompt: str) -> float:
    if not completion:
        return 0.0
    text = completion.encode("utf-8", "surrogatepass")
    return (len(text) - len(text.translate(None, _DIGITS))) / len(completion)


def uppercase(completion: str, prompt: str) -> float:
    if completion.isascii():
        text = completion.encode("ascii")
        letters = len(text) - len(text.translate(None, _ASCII_LETTERS))
        upper = len(text) - len(text.translate(None, _ASCII_UPPER))
    else:
        letters = sum(map(str.isalpha, completion))
        upper = sum(map(str.isupper, filter(str.isalpha, completion)))
    if not letters:
        return 0.0
    return upper / letters


def python(target: str) -> Scorer:
    module_name, _, func_name = target.partition(":")
    if not module_name or not func_name:
        raise ScorerSpecError(f"scorer python needs module:function, got {target!r}")
    try:
        finder = _DirectoryFinder(os.getcwd())
    except OSError:  # the directory was deleted: nothing there to import
        finder = None
    try:
        with _searched_last(finder):
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ScorerSpecError(f"scorer python: cannot import module {module_name!r}: {e}") from e
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the module's own code failed as it loaded
        raise ScorerSpecError(f"scorer python: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ScorerSpecError(f"scorer python: {module_name!r} has no callable {func_name!r}")

    if finder is None:
        return fn

    @functools.wraps(fn)
    def score(completion: str, prompt: str) -> float:
        with _searched_last(finder):  # what it imports as it runs, beside it too
            return fn(completion, prompt)

    return score


class _DirectoryFinder(importlib.abc.MetaPathFinder):
    """Finds top-level modules in one directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def find_spec(self, fullname, path=None, target=None):
        if path is not None:  # a submodule: its package's own __path__ finds it
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.directory])


@contextmanager
def _searched_last(finder: _DirectoryFinder | None) -> Iterator[None]:
    """While a python scorer's module loads (and, in `python`'s wrapper, while the scorer runs), a top-level
    module no other finder knows is looked for by `finder` in the directory clora started in (so a
    `MODULE.py` beside clora.toml imports, and so do the modules it imports, as it loads or later), after
    every installed one (so it never shadows clora or a library). Only then: every process keeps that
    directory off sys.path (clora.cli.keep_the_current_directory_off_the_path), or a library's probe for an
    optional module (kafka-python's `snappy`, `lz4`) would run a file of that name there."""
    if finder is None:
        yield
        return
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


# kind -> builder taking the spec's argument; kinds without an argument map to the scorer itself.
_WITH_ARGUMENT: dict[str, Callable[[str], Scorer]] = {
    "contains": contains,
    "regex": regex,
    "length": lambda arg: length(_positive_int(arg)),
    "python": python,
}
_PLAIN: dict[str, Scorer] = {"json_valid": json_valid, "digits": digits, "uppercase": uppercase}


def _positive_int(arg: str) -> int:
    if not arg.isdigit():
        raise ScorerSpecError(f"scorer length needs a positive integer target, got {arg!r}")
    return int(arg)


# ---------------------------------------------------------------------------------------------------------
# The time limit


class ScorerTimeout(Exception):
    """A scorer call ran past its time limit and was stopped."""


class _TimeUp(BaseException):
    """Raised inside the scorer by the alarm. A BaseException, so that a scorer's own `except Exception`
    does not swallow it and go on."""


_running = [False]  # a limited call is under way: the alarm may stop it (not after it returned)
ALARM_REPEAT_S = 0.05  # past the limit, the alarm fires again this often until the call has unwound


def _on_alarm(signum, frame) -> None:
    # Again at every repeat while the call runs: a scorer's bare `except:` (or `except BaseException`)
    # swallows one _TimeUp and goes on, and only the next one can stop it.
    if _running[0]:
        raise _TimeUp


def _alarm_usable() -> bool:
    """Whether this thread can limit a call with SIGALRM, installing the handler on first use."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGALRM)
    if handler is _on_alarm:
        return True
    if handler not in (signal.SIG_DFL, None):
        return False  # the program's own SIGALRM handler: not ours to replace
    signal.signal(signal.SIGALRM, _on_alarm)
    # The alarm interrupts a system call it lands in (no SA_RESTART): a scorer blocked in one (a read from a
    # judge model that never answers) is then stopped, where a restarted call never returned to Python. It
    # fires only past a limited call's limit, so only then may a call on another thread (a writer's, the Kafka
    # client's) see EINTR; Python's own calls retry it.
    signal.siginterrupt(signal.SIGALRM, True)
    return True


def time_limited(fn: Scorer, seconds: float) -> Scorer:
    """`fn`, stopped with ScorerTimeout when one call takes longer than `seconds` (see the module note)."""

    def score(completion: str, prompt: str) -> float:
        if not _alarm_usable():
            return fn(completion, prompt)
        try:
            _running[0] = True
            signal.setitimer(signal.ITIMER_REAL, seconds, ALARM_REPEAT_S)
            try:
                return fn(completion, prompt)
            finally:
                _running[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _TimeUp as e:  # also when the alarm came between the return and the disarm: at the limit
            _running[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            raise ScorerTimeout(f"stopped after {seconds:g} s (the tenant's scorer_time_limit_s)") from e

    return score


# ---------------------------------------------------------------------------------------------------------
# Building and applying


def is_function(spec: str) -> bool:
    """Whether `spec` names a function (as opposed to a reward carried by events)."""
    return spec.partition(":")[0] not in EVENT_REWARDS


def build_scorer(spec: str, *, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S) -> Scorer:
    """The function a spec names, with a time limit per call for the UNBOUNDED_KINDS (None: none).
    `feedback` and `inline` name none: they raise ScorerSpecError."""
    kind, sep, arg = spec.partition(":")
    if kind in EVENT_REWARDS:
        raise ScorerSpecError(f"scorer {spec!r} takes its reward from events; it has no function")
    if kind in _PLAIN:
        if sep:
            raise ScorerSpecError(f"scorer {kind!r} takes no argument, got {spec!r}")
        return _PLAIN[kind]
    if kind in _WITH_ARGUMENT:
        if not arg:
            raise ScorerSpecError(f"scorer {kind!r} needs an argument: {kind}:...")
        fn = _WITH_ARGUMENT[kind](arg)
        return time_limited(fn, time_limit_s) if kind in UNBOUNDED_KINDS and time_limit_s is not None else fn
    known = ", ".join([*EVENT_REWARDS, *_PLAIN, *_WITH_ARGUMENT])
    raise ScorerSpecError(f"unknown scorer kind {kind!r} in {spec!r}; expected one of {known}")


def apply(scorer: Scorer, completion: str, prompt: str) -> float:
    """Runs `scorer`; returns its reward as a float, or raises ScorerError with a traceback summary."""
    try:
        reward = scorer(completion, prompt)
    except (KeyboardInterrupt, ScorerError):  # Ctrl-C (see the module docstring); Unbuilt's own error
        raise
    except BaseException as e:  # a user's scorer may raise anything (sys.exit(), MemoryError): it must not stop the consumer
        summary = "".join(traceback.format_exception(e, limit=-3)).strip()
        raise ScorerError(f"scorer raised {type(e).__name__}: {exception_text(e)}\n{summary}"[:2000]) from e
    if type(reward) is float:  # what the built-in scorers return: no ABC check, and float() would return it
        value = reward
    else:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):  # numpy's scalars are Reals too
            raise ScorerError(f"scorer returned {shown(reward)}, not a finite number")
        try:
            value = float(reward)
        except OverflowError:  # an int beyond a float's range: outside [-1, 1] by far
            raise ScorerError(f"scorer returned {shown(reward)}, outside [-1, 1]") from None
        except Exception as e:  # an int or float subclass whose __float__ fails: the scorer's value, not ingest
            raise ScorerError(f"scorer returned {shown(reward)}, which float() refuses: {exception_text(e)}") from e
    if not math.isfinite(value):
        raise ScorerError(f"scorer returned {value!r}, not a finite number")
    if not -1.0 <= value <= 1.0:
        raise ScorerError(f"scorer returned {value!r}, outside [-1, 1]")
    return value
