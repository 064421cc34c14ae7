"""The supervisor behind `clora up`, on real child processes: start order and health, restart with backoff,
stop order, no orphans."""

import os
import sys
import threading
import time

import pytest

from clora.up import ChildSpec, Supervisor, stack_specs

pytestmark = pytest.mark.unit

SLEEPER = [sys.executable, "-c", "import time, signal, sys; print('ready', flush=True); time.sleep(600)"]


def spec(name, argv=SLEEPER, lines=None, **kw):
    """Healthy at once, or (given the collected `lines`) once the child has printed "ready"."""
    healthy = (lambda _pid: True) if lines is None else (lambda _pid: (name, "ready") in lines)
    return ChildSpec(name, argv, healthy=healthy, stop_timeout=5, **kw)


def collect():
    lines = []
    lock = threading.Lock()

    def emit(name, line):
        with lock:
            lines.append((name, line))

    return lines, emit


def test_start_stop_order_and_no_orphans():
    lines, emit = collect()
    sup = Supervisor([spec("a", lines=lines), spec("b", lines=lines), spec("c", lines=lines)], stop_order=["b", "c", "a"], emit=emit)
    sup.start_all()
    pids = [c.proc.pid for c in sup.children.values()]
    sup.stop_all()
    starts = [line.split()[1] for n, line in lines if n == "up" and line.startswith("starting")]
    stops = [line.split()[1] for n, line in lines if n == "up" and line.startswith("stopping")]
    assert starts == ["a", "b", "c"]
    assert stops == ["b", "c", "a"]
    assert ("a", "ready") in lines  # output is prefixed with the child's name
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_stop_order_naming_a_child_that_is_not_there_stops_the_others():
    """With an external Kafka there is no "broker" child, but the stop order still ends with it."""
    lines, emit = collect()
    sup = Supervisor([spec("a", lines=lines)], stop_order=["a", "broker"], emit=emit)
    sup.start_all()
    sup.stop_all()  # no KeyError
    assert [line for n, line in lines if n == "up" and line.startswith("stopping")] == ["stopping a"]


def test_crashed_child_is_restarted_with_backoff(tmp_path):
    counter = tmp_path / "starts"
    crasher = [sys.executable, "-c",
               f"import sys; open({str(counter)!r}, 'a').write('x'); sys.exit(3)"]
    lines, emit = collect()
    sup = Supervisor([spec("crashy", crasher, )], stop_order=[], emit=emit, max_backoff=0.5)
    sup.children["crashy"].start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(counter.read_text() if counter.exists() else "") < 3:
        sup.watch_once()
        time.sleep(0.05)
    sup.stop_all()
    assert len(counter.read_text()) >= 3
    notes = [line for n, line in lines if n == "up" and "restarting in" in line]
    assert notes and "exited with code 3" in notes[0]


def test_unhealthy_child_fails_start():
    sup = Supervisor([ChildSpec("dies", [sys.executable, "-c", "raise SystemExit(4)"], healthy=lambda _pid: False)],
                     stop_order=[], emit=lambda *a: None)
    with pytest.raises(RuntimeError, match="dies exited with code 4 while starting"):
        sup.start_all()
    sup.stop_all()


def test_the_stack_runs_one_learner_per_configured_shard(tmp_path, monkeypatch):
    from clora.config import Config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    one = Config.model_validate({"data_dir": str(tmp_path)})
    specs, stop_order = stack_specs(one, "clora.toml")
    (learner,) = [s for s in specs if s.name.startswith("learner")]
    assert learner.name == "learner" and "--shard" not in learner.argv and learner.env == {"OMP_NUM_THREADS": "4"}
    assert stop_order == ["serving", "learner", "ingest", "broker"]

    two = Config.model_validate({"data_dir": str(tmp_path), "learner": {"processes": 2}})
    specs, stop_order = stack_specs(two, "clora.toml")
    learners = [s for s in specs if s.name.startswith("learner")]
    assert [s.name for s in learners] == ["learner-0", "learner-1"]
    assert [s.argv[-2:] for s in learners] == [["--shard", "0/2"], ["--shard", "1/2"]]
    assert all(s.env == {"OMP_NUM_THREADS": "2"} for s in learners)  # the learners' half of the cores, shared
    assert stop_order == ["serving", "learner-0", "learner-1", "ingest", "broker"]
