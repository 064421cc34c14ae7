"""The supervisor behind `clora up`, on real child processes: start order and health, restart with backoff,
stop order, no orphans."""

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from process_support import gone
from signal_support import handlers_restored, locks_taken_by_handler

from clora.up import ChildSpec, Supervisor, stack_specs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time, signal, sys; print('ready', flush=True); time.sleep(600)"]


def spec(name, argv=SLEEPER, lines=None, **kw):
    """Healthy at once, or (given the collected `lines`) once the child has printed "ready"."""
    healthy = (lambda _pid: True) if lines is None else (lambda _pid: (name, "ready") in lines)
    return ChildSpec(name, argv, healthy=healthy, stop_timeout=5, **kw)


def free_port_but(taken: int) -> int:
    """A free port other than `taken` (serving's beside the broker's: two free_port() draws can give one port,
    and serving on the broker's port is a setup problem of its own)."""
    from ingest.broker import free_ports

    return next(p for p in free_ports(2) if p != taken)


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


# On SIGTERM: marks itself, then exits 0 once the other child (argv[2]) has had its SIGTERM too, or 3 after
# 20 s without it (what stopping one child after the other gives).
WAITS_FOR_PARTNER = [sys.executable, "-c", """
import os, signal, sys, time
me, partner = sys.argv[1], sys.argv[2]
def on_term(*_):
    open(me, "w").close()
    deadline = time.monotonic() + 20
    while not os.path.exists(partner):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""]


def test_children_in_one_stop_stage_get_their_sigterm_together(tmp_path):
    lines, emit = collect()
    a, b = str(tmp_path / "a.term"), str(tmp_path / "b.term")
    sup = Supervisor([spec("first", lines=lines), ChildSpec("a", [*WAITS_FOR_PARTNER, a, b], healthy=lambda _pid: (
        "a", "ready") in lines, stop_timeout=60), ChildSpec("b", [*WAITS_FOR_PARTNER, b, a], healthy=lambda _pid: (
        "b", "ready") in lines, stop_timeout=60), spec("last", lines=lines)],
        stop_order=["first", ("a", "b"), "last"], emit=emit)
    sup.start_all()
    sup.stop_all()
    said = [line for n, line in lines if n == "up" and "stop" in line]
    assert said[:2] == ["stopping first (up to 5s)", "first stopped (exit code -15)"]
    assert said[2] == "stopping a, b (up to 60s)"
    assert sorted(said[3:5]) == ["a stopped (exit code 0)", "b stopped (exit code 0)"]  # 3: one after the other
    assert said[5:] == ["stopping last (up to 5s)", "last stopped (exit code -15)"]


def test_a_stop_order_naming_a_child_that_is_not_there_stops_the_others():
    """With an external Kafka there is no "broker" child, but the stop order still ends with it."""
    lines, emit = collect()
    sup = Supervisor([spec("a", lines=lines)], stop_order=["a", "broker"], emit=emit)
    sup.start_all()
    sup.stop_all()  # no KeyError
    assert [line for n, line in lines if n == "up" and line.startswith("stopping")] == ["stopping a (up to 5s)"]


def test_crashed_child_is_restarted_with_backoff(tmp_path):
    """The wait before each restart doubles from 1 s up to max_backoff, and starts afresh for a child that ran
    well for over a minute. The waits themselves are skipped (restart_at moved to now): no back-off time."""
    starts = tmp_path / "starts"
    lines, emit = collect()
    sup = Supervisor([spec("crashy", counting(starts, "raise SystemExit(3)"))], stop_order=[], emit=emit, max_backoff=4)
    child = sup.children["crashy"]

    def crash_noticed() -> str:
        """Waits for the child's exit, lets the supervisor notice it; returns the restart note it gave."""
        child.proc.wait(timeout=30)
        before = time.monotonic()
        sup.watch_once()
        after = time.monotonic()
        note = [line for n, line in lines if n == "up" and "restarting in" in line][-1]
        delay = float(note.split("restarting in ")[1].split("s ")[0])
        assert before + delay <= child.restart_at <= after + delay, "the restart is not scheduled as the note says"
        return note

    def restart_now() -> None:
        child.restart_at = time.monotonic()  # its wait is over
        sup.watch_once()
        assert child.restart_at is None, "not started again"

    child.start()
    try:
        notes = []
        for _ in range(5):
            notes.append(crash_noticed())
            restart_now()
        child.started_at = time.monotonic() - 61  # this run went well for over a minute before it crashed
        notes.append(crash_noticed())
    finally:
        sup.stop_all()
    assert [note.split("; ")[1] for note in notes] == [
        "restarting in 1s (restart #1)", "restarting in 2s (restart #2)", "restarting in 4s (restart #3)",
        "restarting in 4s (restart #4)", "restarting in 4s (restart #5)", "restarting in 1s (restart #1)"]
    assert all(note.startswith("crashy exited with code 3;") for note in notes)
    assert starts.read_text() == "x" * 6


def _kill(up: subprocess.Popen, child: int | None) -> None:
    """What a test of a killed supervisor leaves running, killed: the supervisor and its child."""
    if up.poll() is None:
        up.kill()
        up.wait()
    if child is not None:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_children_get_sigterm_when_up_itself_dies(tmp_path):
    """A `clora up` killed outright (SIGKILL, the OOM killer) runs no stop: its children must go all the same
    (parent-death signal), or they would hold the ports the next `clora up` needs."""
    script = ("import sys, time\n"
              "from clora.up import ChildSpec, Supervisor\n"
              "sleeper = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
              "sup = Supervisor([ChildSpec('sleeper', sleeper, healthy=lambda _pid: True)], stop_order=[],"
              " emit=lambda *a: None)\n"
              "sup.start_all()\n"
              "print(sup.children['sleeper'].proc.pid, flush=True)\n"
              "time.sleep(600)\n")
    up = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    pid = None
    try:
        pid = int(up.stdout.readline())
        os.kill(pid, 0)  # running (a pid that never was one would pass for gone)
        up.kill()
        up.wait()
        assert gone(pid), "the child outlived the SIGKILLed supervisor"
    finally:
        _kill(up, pid)


def test_a_lock_given_to_the_children_stays_held_until_the_last_of_them_is_gone(tmp_path):
    """What `clora demo` relies on: killed outright, its stack's processes still stop on its death for a
    while (ingest drains, writing to the data dir); its lock, which they hold too, keeps the next demo from
    deleting that data under them until they are gone."""
    from storage.files import FileLock, LockBusy

    lock, ready = tmp_path / "demo.lock", tmp_path / "stops-slowly"
    child = tmp_path / "child.py"  # stops 2 s after its SIGTERM, as ingest drains
    child.write_text("import signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(2), sys.exit(0)))\n"
                     f"open({str(ready)!r}, 'w').close()\n"
                     "time.sleep(600)\n")
    supervisor = tmp_path / "supervisor.py"
    supervisor.write_text("import sys, time\n"
                          "from pathlib import Path\n"
                          "from clora.up import ChildSpec, Supervisor\n"
                          "from storage.files import FileLock\n"
                          f"with FileLock(Path({str(lock)!r})) as fd:\n"
                          f"    spec = ChildSpec('slow', [sys.executable, {str(child)!r}], healthy=lambda _pid: True,\n"
                          "                     keep_fds=(fd,))\n"
                          "    sup = Supervisor([spec], stop_order=[], emit=lambda *a: None)\n"
                          "    sup.start_all()\n"
                          "    print(sup.children['slow'].proc.pid, flush=True)\n"
                          "    time.sleep(600)\n")
    up = subprocess.Popen([sys.executable, str(supervisor)], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    pid = None
    try:
        pid = int(up.stdout.readline())
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:  # its SIGTERM handler is in place
            time.sleep(0.05)
        up.kill()
        up.wait()
        with pytest.raises(LockBusy):  # the supervisor is gone; its child, stopping, still holds the lock
            with FileLock(lock, blocking=False):
                pass
        assert gone(pid), "the child outlived the SIGKILLed supervisor"
        with FileLock(lock, blocking=False):  # the last holder gone: free
            pass
    finally:
        _kill(up, pid)


def test_a_restarted_embedded_broker_says_what_was_lost(tmp_path):
    """The embedded broker keeps topics in memory: its restart loses what ingest had not stored yet."""
    import dataclasses

    from clora.config import Config

    specs, _ = stack_specs(Config.model_validate({"data_dir": str(tmp_path)}), None)
    (broker,) = [s for s in specs if s.name == "broker"]
    crasher = dataclasses.replace(broker, argv=[sys.executable, "-c", "raise SystemExit(3)"])
    lines, emit = collect()
    sup = Supervisor([crasher], stop_order=[], emit=emit)
    sup.children["broker"].start()
    sup.children["broker"].proc.wait()
    sup.watch_once()
    sup.stop_all()
    notes = [line for n, line in lines if n == "up"]
    assert notes[0].startswith("broker exited with code 3; restarting in")
    assert "events it held that ingest had not yet stored are lost" in notes[1]
    assert "an external Kafka (kafka.bootstrap" in notes[1] and "durable" in notes[1]


def counting(starts, code):
    """A child that appends to the file `starts` at each start, then runs `code`."""
    return [sys.executable, "-c", f"open({str(starts)!r}, 'a').write('x'); {code}"]


def test_a_child_that_exits_while_starting_is_started_again(tmp_path):
    starts = tmp_path / "starts"
    # Exits the first time; the second time it stays up.
    flaky = counting(starts, f"import sys, time; len(open({str(starts)!r}).read()) > 1 or sys.exit(5); "
                             "print('ready', flush=True); time.sleep(600)")
    lines, emit = collect()
    sup = Supervisor([spec("flaky", flaky, lines=lines)], stop_order=[], emit=emit, max_backoff=0.1)
    sup.start_all()
    try:
        assert sup.children["flaky"].alive() and starts.read_text() == "xx"
        assert ("up", "flaky exited with code 5 while starting; starting it again in 0s (attempt 2 of 3)") in lines
        assert ("up", "flaky is healthy") in [(n, line.split(" (")[0]) for n, line in lines]
    finally:
        sup.stop_all()


def test_children_started_before_are_watched_while_a_slow_one_starts(tmp_path):
    starts = tmp_path / "starts"
    # The broker stand-in dies at once the first time (after being healthy), then stays up.
    broker = counting(starts, f"import sys, time; len(open({str(starts)!r}).read()) > 1 or (time.sleep(0.3), "
                              "sys.exit(3)); time.sleep(600)")
    ready = tmp_path / "slow-ready"
    slow = [sys.executable, "-c", "import time; time.sleep(600)"]
    lines, emit = collect()
    sup = Supervisor([spec("broker", broker), ChildSpec("slow", slow, healthy=lambda _pid: ready.exists(), stop_timeout=5)],
                     stop_order=[], emit=emit, max_backoff=0.1)
    threading.Timer(3.0, ready.touch).start()  # the slow child becomes healthy after 3 s
    try:
        sup.start_all()
        assert starts.read_text() == "xx", "the broker was restarted while the slow child started"
        assert sup.children["broker"].alive() and sup.children["slow"].alive()
        assert any("broker exited with code 3; restarting" in line for _, line in lines)
    finally:
        sup.stop_all()


def test_a_child_that_keeps_exiting_while_starting_fails_the_start(tmp_path):
    starts = tmp_path / "starts"
    lines, emit = collect()
    sup = Supervisor([ChildSpec("dies", counting(starts, "raise SystemExit(4)"), healthy=lambda _pid: False)],
                     stop_order=[], emit=emit, max_backoff=0.1)
    with pytest.raises(RuntimeError, match=r"dies exited with code 4 while starting \(3 attempts; giving up\)"):
        sup.start_all()
    sup.stop_all()
    assert starts.read_text() == "xxx"
    assert [line.split("; ")[1] for n, line in lines if "starting it again" in line] == [
        "starting it again in 0s (attempt 2 of 3)", "starting it again in 0s (attempt 3 of 3)"]


def test_a_child_not_healthy_in_time_fails_the_start_without_another_attempt(tmp_path):
    starts = tmp_path / "starts"
    sup = Supervisor([ChildSpec("slow", counting(starts, "import time; time.sleep(600)"), healthy=lambda _pid: False,
                                start_timeout=0.5, stop_timeout=5)],
                     stop_order=[], emit=lambda *a: None, max_backoff=0.1)
    with pytest.raises(RuntimeError, match="slow was not healthy within 0s"):
        sup.start_all()
    sup.stop_all()
    assert starts.read_text() == "x"


def test_the_stack_runs_one_learner_per_configured_shard(tmp_path, monkeypatch):
    from clora.config import Config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    one = Config.model_validate({"data_dir": str(tmp_path)})
    specs, stop_order = stack_specs(one, "clora.toml")
    (learner,) = [s for s in specs if s.name.startswith("learner")]
    assert learner.name == "learner" and "--shard" not in learner.argv and learner.env == {"OMP_NUM_THREADS": "4"}
    assert stop_order == ["compactor", "serving", "learner", "ingest", "broker"]

    two = Config.model_validate({"data_dir": str(tmp_path), "learner": {"processes": 2}})
    specs, stop_order = stack_specs(two, "clora.toml")
    learners = [s for s in specs if s.name.startswith("learner")]
    assert [s.name for s in learners] == ["learner-0", "learner-1"]
    assert [s.argv[-2:] for s in learners] == [["--shard", "0/2"], ["--shard", "1/2"]]
    assert all(s.env == {"OMP_NUM_THREADS": "2"} for s in learners)  # the learners' half of the cores, shared
    assert stop_order == ["compactor", "serving", ("learner-0", "learner-1"), "ingest", "broker"]  # shards together


def test_the_stack_runs_the_configured_ingest_processes_in_one_group(tmp_path):
    from clora.config import Config

    specs, _ = stack_specs(Config.model_validate({"data_dir": str(tmp_path)}), "clora.toml")
    (ingest,) = [s for s in specs if s.name.startswith("ingest")]
    assert ingest.name == "ingest" and "--member" not in ingest.argv
    assert ingest.ready_file == tmp_path / "state" / "ready" / "ingest.json"

    three = Config.model_validate({"data_dir": str(tmp_path), "ingest": {"processes": 3}})
    specs, stop_order = stack_specs(three, "clora.toml")
    ingests = [s for s in specs if s.name.startswith("ingest")]
    assert [s.name for s in ingests] == ["ingest-0", "ingest-1", "ingest-2"]
    assert [s.argv[-2:] for s in ingests] == [["--member", "0"], ["--member", "1"], ["--member", "2"]]
    assert all("--drain-on-stop" in s.argv for s in ingests)
    assert [s.ready_file.name for s in ingests] == ["ingest-0.json", "ingest-1.json", "ingest-2.json"]
    assert stop_order == ["compactor", "serving", "learner", ("ingest-0", "ingest-1", "ingest-2"), "broker"]


def test_the_stack_runs_the_compactor_unless_it_is_turned_off(tmp_path):
    from clora.config import Config

    specs, _ = stack_specs(Config.model_validate({"data_dir": str(tmp_path)}), "clora.toml")
    (compactor,) = [s for s in specs if s.name == "compactor"]
    assert compactor.argv[-5:] == ["compact", "--every", "600", "--config", "clora.toml"]
    off = Config.model_validate({"data_dir": str(tmp_path), "compaction": {"every_seconds": 0}})
    assert "compactor" not in [s.name for s in stack_specs(off, "clora.toml")[0]]


# ---------------------------------------------------------------------------------------------------------
# Ports held by another process (a stale clora from an earlier run)


def listening(host="127.0.0.1"):
    """A socket listening on a free port: another process holding it, as far as `up` can tell."""
    import socket

    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s


@pytest.mark.parametrize("key", ["broker.port", "serving.port"])
def test_up_refuses_to_start_when_another_process_holds_a_port(tmp_path, monkeypatch, key):
    from clora import up as up_module
    from clora.config import Config
    from ingest.broker import free_port

    held = listening()
    port = held.getsockname()[1]
    broker_port = free_port()
    ports = {"broker": {"port": broker_port}, "serving": {"port": free_port_but(broker_port)}}
    ports[key.split(".")[0]]["port"] = port
    bootstrap = f"127.0.0.1:{ports['broker']['port']}"
    cfg = Config.model_validate({"data_dir": str(tmp_path), **ports, "kafka": {"bootstrap": bootstrap}})
    started = []
    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: (
        [ChildSpec("a", SLEEPER, healthy=lambda pid: started.append(pid) or True, stop_timeout=5)], ["a"]))
    lines, emit = collect()
    try:
        code = up_module.up(cfg, None, until=lambda: True, emit=emit)
    finally:
        held.close()
    assert code == 1
    assert not started, "no child may start"
    assert lines[0][1].startswith("config the built-in defaults"), "which config the errors are of, first"
    (error,) = [line for n, line in lines if n == "up" and line.startswith("error")]
    assert f"port {port} on 127.0.0.1 is already in use by another process" in error
    assert "earlier clora" in error and f"set {key}" in error and "to a free port" in error
    if key == "broker.port":  # both: the broker's clients find it through kafka.bootstrap
        assert "set broker.port and kafka.bootstrap to a free port" in error


def test_up_refuses_an_embedded_broker_that_kafka_bootstrap_does_not_name(tmp_path, monkeypatch):
    from clora import up as up_module
    from clora.config import Config
    from ingest.broker import free_port

    port = free_port()
    cfg = Config.model_validate({"data_dir": str(tmp_path), "broker": {"port": port}, "serving": {"port": free_port_but(port)}})
    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: ([spec("a")], ["a"]))
    lines, emit = collect()
    assert up_module.up(cfg, None, until=lambda: True, emit=emit) == 2  # a config problem, as `up --help` says
    (error,) = [line for n, line in lines if n == "up" and line.startswith("error")]
    assert f"kafka.bootstrap is '127.0.0.1:9092' but the embedded broker listens on 127.0.0.1:{port}" in error
    external = Config.model_validate({"data_dir": str(tmp_path), "broker": {"embedded": False, "port": port},
                                      "serving": {"port": free_port_but(port)}})
    assert (up_module.config_problems(external) + up_module.held_ports(external)) == []  # the Kafka at kafka.bootstrap is used as it is
    for bootstrap in (f"localhost:{port}", f"kafka.example:9092,127.0.0.1:{port}",  # other names for it, as
                      f"PLAINTEXT://127.0.0.1:{port}", f" [::1]:9093 , localhost:{port}"):  # Kafka clients read them
        named = Config.model_validate({"data_dir": str(tmp_path), "broker": {"port": port},
                                       "kafka": {"bootstrap": bootstrap}, "serving": {"port": free_port_but(port)}})
        assert (up_module.config_problems(named) + up_module.held_ports(named)) == [], bootstrap


def test_up_refuses_ingest_metrics_ports_that_are_taken_or_clash_with_its_own(tmp_path):
    from clora import up as up_module
    from clora.config import Config
    from ingest.broker import free_port

    broker = free_port()
    held = listening()
    taken = held.getsockname()[1]
    try:
        cfg = Config.model_validate({
            "data_dir": str(tmp_path), "broker": {"port": broker}, "serving": {"port": free_port_but(broker)},
            "kafka": {"bootstrap": f"127.0.0.1:{broker}"}, "ingest": {"processes": 3, "metrics_port": taken - 2},
        })
        problems = (up_module.config_problems(cfg) + up_module.held_ports(cfg))
    finally:
        held.close()
    # member 2's port: held by another process (members 0 and 1 may or may not be free; only the held one is asserted)
    assert (f"port {taken} on 127.0.0.1 is already in use by another process (perhaps an earlier clora still "
            "running): stop it, or set ingest.metrics_port to a free port") in problems
    clash = Config.model_validate({
        "data_dir": str(tmp_path), "broker": {"port": broker}, "serving": {"port": broker + 1},
        "kafka": {"bootstrap": f"127.0.0.1:{broker}"}, "ingest": {"processes": 2, "metrics_port": broker}})
    assert [p for p in (up_module.config_problems(clash) + up_module.held_ports(clash)) if "puts an ingest process" in p] == [
        f"ingest.metrics_port {broker} puts an ingest process's metrics on port {port}, which serving or the broker "
        "listens on: set ingest.metrics_port to a free range" for port in (broker, broker + 1)]
    fine = Config.model_validate({
        "data_dir": str(tmp_path), "broker": {"port": broker}, "serving": {"port": free_port_but(broker)},
        "kafka": {"bootstrap": f"127.0.0.1:{broker}"}, "ingest": {"processes": 2}})  # metrics off: nothing to check
    assert (up_module.config_problems(fine) + up_module.held_ports(fine)) == []


def test_up_refuses_serving_on_the_embedded_brokers_port(tmp_path, monkeypatch):
    """Each port is free on its own; the broker, started first, would take it and serving fail three times."""
    from clora import up as up_module
    from clora.config import Config
    from ingest.broker import free_port

    port = free_port()
    cfg = Config.model_validate({"data_dir": str(tmp_path), "broker": {"port": port}, "serving": {"port": port},
                                 "kafka": {"bootstrap": f"127.0.0.1:{port}"}})
    started = []
    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: (
        [ChildSpec("a", SLEEPER, healthy=lambda pid: started.append(pid) or True, stop_timeout=5)], ["a"]))
    lines, emit = collect()
    assert up_module.up(cfg, None, until=lambda: True, emit=emit) == 2  # a config problem
    assert not started, "no child may start"
    assert [line for n, line in lines if n == "up" and line.startswith("error")] == [
        f"error: serving.port and broker.port are both {port}, where serving and the embedded broker cannot both "
        "listen: set serving.port to another port (or broker.port and kafka.bootstrap)"]
    external = Config.model_validate({"data_dir": str(tmp_path), "broker": {"embedded": False, "port": port},
                                      "serving": {"port": port}, "kafka": {"bootstrap": f"kafka.example:{port}"}})
    assert (up_module.config_problems(external) + up_module.held_ports(external)) == []  # no broker of its own: the port is serving's alone


def test_up_warns_of_ingest_processes_beyond_the_partitions_and_starts(tmp_path, monkeypatch):
    from clora import up as up_module
    from clora.config import Config
    from ingest.broker import free_port

    def config(processes, partitions=4):
        port = free_port()
        return Config.model_validate({
            "data_dir": str(tmp_path), "broker": {"port": port}, "serving": {"port": free_port_but(port)},
            "kafka": {"bootstrap": f"127.0.0.1:{port}", "partitions": partitions}, "ingest": {"processes": processes},
            "tenants": [{"name": "acme", "api_key": "sk-acme-key"}],
        })

    assert up_module.setup_warnings(config(4)) == []  # one partition each
    assert up_module.setup_warnings(config(2, partitions=1)) == [
        "ingest.processes = 2 is more than kafka.partitions = 1: 1 ingest process will wait idle without a "
        "partition (unless the topics exist already with more partitions: kafka.partitions applies to the "
        "topics clora creates)"
    ]
    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: ([spec("a")], ["a"]))
    lines, emit = collect()
    assert up_module.up(config(6), None, until=lambda: True, emit=emit) == 0  # a warning, not a refusal
    (warning,) = [line for n, line in lines if n == "up" and line.startswith("warning")]
    assert warning.startswith("warning: ingest.processes = 6 is more than kafka.partitions = 4: 2 ingest processes")
    assert any(line.startswith("clora is up") for n, line in lines if n == "up")


def test_ingest_may_drain_the_embedded_brokers_topics_for_long(tmp_path):
    from clora.config import Config
    from clora.up import INGEST_DRAIN_EMBEDDED_S

    def ingest_stop_timeout(embedded):
        cfg = Config.model_validate({"data_dir": str(tmp_path), "broker": {"embedded": embedded}})
        (ingest,) = [s for s in stack_specs(cfg, None)[0] if s.name == "ingest"]
        return ingest.stop_timeout

    # in memory only, stopped right after ingest: what ingest has not stored by then is lost
    assert ingest_stop_timeout(True) == INGEST_DRAIN_EMBEDDED_S >= 600
    assert ingest_stop_timeout(False) == 60  # an external Kafka keeps the rest for the next start


def test_ingest_drains_on_stop_only_before_the_embedded_broker_goes(tmp_path):
    """With an external Kafka, chasing the end of topics that apps keep producing to ran into the 60 s limit
    and the kill at every stop."""
    from clora.config import Config

    for embedded in (True, False):
        cfg = Config.model_validate({"data_dir": str(tmp_path), "broker": {"embedded": embedded}})
        (ingest,) = [s for s in stack_specs(cfg, None)[0] if s.name == "ingest"]
        assert ("--drain-on-stop" in ingest.argv) is embedded


def test_a_child_killed_while_the_stack_stops_makes_up_exit_3(tmp_path, monkeypatch):
    from clora import up as up_module
    from clora.config import Config

    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(600)"]
    port = free_port_but(9092)
    cfg = Config.model_validate({"data_dir": str(tmp_path), "broker": {"embedded": False},
                                 "serving": {"host": "0.0.0.0", "port": port}})
    for argv, code in ((SLEEPER, 0), (deaf, up_module.KILLED_WHILE_STOPPING)):
        lines, emit = collect()
        healthy = lambda _pid, lines=lines: ("ingest", "ready") in lines  # noqa: E731 (its SIGTERM handler is set)
        monkeypatch.setattr(up_module, "stack_specs", lambda *_, argv=argv, healthy=healthy, **__: (
            [ChildSpec("ingest", argv, healthy=healthy, stop_timeout=1)], ["ingest"]))
        assert up_module.up(cfg, None, until=lambda: True, emit=emit) == code
        said = [line for n, line in lines if n == "up"]
        assert f"clora is up: http://127.0.0.1:{port}/v1 (Ctrl-C to stop)" in said  # a URL a client can use
        killed = "stopped, but ingest had to be killed: what it had not finished is lost"
        assert (killed in said) is bool(code), said


def test_file_only_children_do_not_see_the_environments_overrides(tmp_path, monkeypatch):
    from clora.config import Config
    from clora.up import Child

    monkeypatch.setenv("CLORA_DATA_DIR", "/somewhere/real")
    monkeypatch.setenv("CLORA_KAFKA_BOOTSTRAP", "kafka.prod:9092")
    monkeypatch.setenv("UNRELATED", "kept")
    specs, _ = stack_specs(Config.model_validate({"data_dir": str(tmp_path)}), "demo.toml", file_only=True)
    assert all(s.env["CLORA_DATA_DIR"] is None and s.env["CLORA_CONFIG"] is None for s in specs)
    learner = next(s for s in specs if s.name == "learner")
    assert learner.env.get("OMP_NUM_THREADS") not in (None, "")  # the spec's own settings stay
    # What a child started from such a spec sees
    show = [sys.executable, "-c", "import os; print([os.environ.get(k) for k in "
            "('CLORA_DATA_DIR', 'CLORA_KAFKA_BOOTSTRAP', 'UNRELATED')], flush=True); import time; time.sleep(60)"]
    lines, emit = collect()
    child = Child(ChildSpec("probe", show, healthy=lambda _pid: True, stop_timeout=5, env=specs[0].env), emit)
    child.start()
    try:
        deadline = time.monotonic() + 20
        while not any(n == "probe" for n, _ in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.stop()
    assert ("probe", "[None, None, 'kept']") in lines


def test_a_child_that_exits_while_the_health_check_runs_is_not_healthy():
    """The health check of a child that exits meanwhile answered for someone else (a stale process on
    its port): the child failed; it is not healthy."""
    def slow_yes(_pid):
        time.sleep(0.6)
        return True

    exits = [sys.executable, "-c", "import time; time.sleep(0.2); raise SystemExit(1)"]
    sup = Supervisor([ChildSpec("stale", exits, healthy=slow_yes)], stop_order=[], emit=lambda *a: None,
                     max_backoff=0.1)
    with pytest.raises(RuntimeError, match="stale exited with code 1 while starting"):
        sup.start_all()
    sup.stop_all()


@pytest.mark.parametrize("environment", ["plain", "proxied"])
def test_serving_is_healthy_only_when_its_health_answer_names_the_childs_pid(tmp_path, environment, request):
    """Proxied: an http_proxy set for outside traffic (no NO_PROXY) took the check to the proxy, and `up` waited
    for a serving it never saw healthy."""
    import json

    if environment == "proxied":
        request.getfixturevalue("proxied")
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from clora.config import Config

    class FakeServingHealth(BaseHTTPRequestHandler):  # serving's /health, answered for pid 4242
        def do_GET(self):
            body = json.dumps({"status": "ok", "pid": 4242}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = HTTPServer(("127.0.0.1", 0), FakeServingHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = Config.model_validate({"data_dir": str(tmp_path), "serving": {"port": server.server_address[1]}})
        specs, _ = stack_specs(cfg, None)
        (serving,) = [s for s in specs if s.name == "serving"]
        assert serving.healthy(4242)
        assert not serving.healthy(4243)  # another process's serving answered
    finally:
        server.shutdown()
        server.server_close()



# ---------------------------------------------------------------------------------------------------------
# Stopping in order whatever happens meanwhile


class FakeUnwritableStdout:
    """stdout after the terminal hung up (EIO), or with `clora up | tee` once tee is gone (EPIPE)."""

    def __init__(self, error):
        self.error = error
        self.writes = 0

    def write(self, _text):
        self.writes += 1
        raise self.error

    def flush(self):
        raise self.error


@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"), BrokenPipeError(errno.EPIPE, "Broken pipe")])
def test_output_that_cannot_be_written_does_not_end_the_ordered_stop(tmp_path, monkeypatch, error):
    """Ctrl-C with `clora up | tee` ends tee too; a closed terminal makes every write fail. The stop must still
    go child by child (the broker stays until ingest has drained), and children that print a lot while they
    stop must not block on a pipe no one reads."""
    from clora import up as up_module

    stopped = tmp_path / "stopped"
    code = ("import signal, sys, time\n"
            "def stop(*_):\n"
            "    for i in range(3000): print('draining', i, 'x' * 80, flush=True)\n"  # ~270 KB: more than a pipe holds
            f"    open({str(stopped)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            f"open({str(tmp_path)!r} + '/' + sys.argv[1], 'w')\n"
            "time.sleep(600)")
    specs = [ChildSpec(name, [sys.executable, "-c", code, name], healthy=lambda _pid, n=name: (tmp_path / n).exists(),
                       stop_timeout=30) for name in ("broker", "ingest")]
    monkeypatch.setattr(up_module, "_stdout_gone", False)
    sup = Supervisor(specs, stop_order=["ingest", "broker"])  # the default output: stdout
    sup.start_all()
    out = FakeUnwritableStdout(error)
    monkeypatch.setattr(sys, "stdout", out)
    sup.stop_all()
    assert stopped.read_text() == "ingest\nbroker\n"
    assert [c.proc.returncode for c in sup.children.values()] == [0, 0], "stopped by themselves, not killed"
    assert out.writes == 1, "nothing more is written once stdout failed"


def test_up_under_nohup_keeps_ignoring_sighup(tmp_path, monkeypatch):
    """`nohup clora up &` is meant to outlive the terminal: its SIGHUP must not stop the stack."""
    from clora import up as up_module
    from clora.config import Config

    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: ([spec("a")], ["a"]))
    monkeypatch.setattr(up_module, "held_ports", lambda _cfg: [])  # the default ports may be in use here
    cfg = Config.model_validate({"data_dir": str(tmp_path)})
    seen = []

    def until():
        seen.append(signal.getsignal(signal.SIGHUP))
        return True

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert up_module.up(cfg, None, until=until, emit=collect()[1]) == 0
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's `clora up`: the hangup stops it in order
        assert up_module.up(cfg, None, until=until, emit=collect()[1]) == 0
        assert callable(seen[-1]) and seen[-1] not in (signal.SIG_IGN, signal.SIG_DFL)
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_hangups_start_the_stop_but_never_hurry_it(tmp_path, monkeypatch):
    """A closed terminal sends a job more than one SIGHUP (the shell's, then the kernel's): they must not
    count as a second and third Ctrl-C, which kill every child at once."""
    from clora import up as up_module
    from clora.config import Config

    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: ([spec("a")], ["a"]))
    monkeypatch.setattr(up_module, "held_ports", lambda _cfg: [])  # the default ports may be in use here
    sup = Supervisor([spec("a")], ["a"], emit=collect()[1])
    monkeypatch.setattr(up_module, "Supervisor", lambda *a, **kw: sup)

    def until():  # the handler `up` installed, called twice as two hangups would call it
        hangup = signal.getsignal(signal.SIGHUP)
        hangup(signal.SIGHUP, None)
        hangup(signal.SIGHUP, None)
        return True

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        up_module.up(Config.model_validate({"data_dir": str(tmp_path)}), None, until=until, emit=collect()[1])
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert sup.stopping.is_set() and sup.signals == 0, "hangups stop the stack, and count as no Ctrl-C"


def test_the_signal_handler_takes_no_lock(tmp_path, monkeypatch):
    """A handler runs in the main thread between two of its bytecodes, perhaps while that thread holds a lock
    (threading.Event.wait's): a handler taking the same lock deadlocks `up`. It only records the signal, and
    the main loop stops the stack."""
    from clora import up as up_module
    from clora.config import Config

    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: ([spec("a")], ["a"]))
    monkeypatch.setattr(up_module, "held_ports", lambda _cfg: [])  # the default ports may be in use here
    lock_calls, calls = [], []

    def until():
        calls.append(time.monotonic())
        if len(calls) == 1:
            lock_calls.extend(locks_taken_by_handler())
        return len(calls) > 50  # not the way out: the signal is

    lines, emit = collect()
    assert up_module.up(Config.model_validate({"data_dir": str(tmp_path)}), None, until=until, emit=emit) == 0
    assert lock_calls == []
    assert len(calls) == 1, "the main loop stopped on the signal"
    assert ("up", "stopping a (up to 5s)") in lines


def test_the_broker_commands_signal_handler_takes_no_lock(tmp_path, monkeypatch, capsys):
    """`clora broker`, a child of `up`, waits in a loop too: its handler must take no lock either."""
    import argparse

    from clora.config import Config
    from ingest import broker as broker_module
    from ingest.cli import run_broker

    lock_calls, polls = [], []

    class FakeBrokerProcess:
        def poll(self):  # SIGTERM while the loop runs; it stops before another poll
            polls.append(True)
            if len(polls) == 1:
                lock_calls.extend(locks_taken_by_handler())

    class FakeEmbeddedBroker:  # what run_broker uses of ingest.broker.EmbeddedBroker
        def __init__(self, host, port):
            self.bootstrap, self.process = f"{host}:{port}", FakeBrokerProcess()

        def start(self, topics, partitions):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(broker_module, "EmbeddedBroker", FakeEmbeddedBroker)
    monkeypatch.setattr("clora.cli.config_from_args", lambda _args: Config.model_validate({"data_dir": str(tmp_path)}))
    with handlers_restored():
        code = run_broker(argparse.Namespace(host=None, port=None))
    assert code == 0 and "broker stopped" in capsys.readouterr().out
    assert lock_calls == []
    assert len(polls) == 1, "the loop stopped on the signal"


def test_a_stop_while_a_child_starts_does_not_call_it_healthy():
    lines, emit = collect()
    sup = Supervisor([ChildSpec("slow", SLEEPER, healthy=lambda _pid: False, start_timeout=60, stop_timeout=5)],
                     stop_order=[], emit=emit)
    threading.Timer(0.5, sup.signalled).start()  # Ctrl-C while it starts
    try:
        sup.start_all()
    finally:
        sup.stop_all()
    assert not [line for n, line in lines if "healthy" in line]


def test_a_stale_ready_mark_is_removed_before_the_child_starts(tmp_path):
    """An earlier process's ready mark (its pid perhaps reused since) must not pass for the new child's."""
    import dataclasses

    from clora.config import Config
    from clora.up import Child
    from storage.files import mark_ready, ready_pid
    from storage.layout import DataDir

    specs, _ = stack_specs(Config.model_validate({"data_dir": str(tmp_path)}), None)
    state = DataDir(tmp_path).state
    assert {s.name: s.ready_file for s in specs if s.ready_file} == {
        name: state / "ready" / f"{name}.json" for name in ("ingest", "learner", "compactor")}
    ingest = next(s for s in specs if s.name == "ingest")
    mark_ready(state, "ingest")  # left by an earlier ingest, whose pid is ours here
    assert ingest.healthy(os.getpid())
    child = Child(dataclasses.replace(ingest, argv=SLEEPER, env={}, stop_timeout=5), collect()[1])
    child.start()
    try:
        assert ready_pid(state, "ingest") is None
        assert not ingest.healthy(os.getpid())
    finally:
        child.stop()


def test_the_helpers_a_crashed_child_forked_are_killed(tmp_path):
    """serving's vLLM engine core is a forked helper with no parent-death watch: serving crashing must not
    leave it running (holding the GPU) while serving is started again."""
    helper = tmp_path / "helper.pid"
    crasher = [sys.executable, "-c", "import subprocess, sys\n"
               "h = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               f"open({str(helper)!r}, 'w').write(str(h.pid))\nsys.exit(3)"]
    lines, emit = collect()
    sup = Supervisor([ChildSpec("serving", crasher, healthy=lambda _pid: True, stop_timeout=5)], stop_order=[],
                     emit=emit, max_backoff=30)
    sup.children["serving"].start()
    sup.children["serving"].proc.wait()
    pid = int(helper.read_text())
    try:
        sup.watch_once()
        assert any("serving exited with code 3" in line for _, line in lines)
        assert gone(pid), "the crashed child's helper is still running"
    finally:
        sup.stop_all()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_signals_during_the_stop_say_how_long_and_then_kill_every_child():
    """Ingest may drain for up to 15 minutes: a second Ctrl-C says so and how to cut it short; a third kills
    every child at once."""
    lines, emit = collect()
    slow = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(600)"]
    sup = Supervisor([spec("broker", lines=lines), ChildSpec("ingest", slow, healthy=lambda _pid: ("ingest", "ready") in lines,
                                                             stop_timeout=120)],
                     stop_order=["ingest", "broker"], emit=emit)
    sup.start_all()
    pids = [c.proc.pid for c in sup.children.values()]

    def presses():
        def wait_for(text):
            deadline = time.monotonic() + 20
            while not any(text in line for _, line in list(lines)) and time.monotonic() < deadline:
                time.sleep(0.05)

        wait_for("stopping ingest (up to 120s)")
        sup.signalled()  # the second Ctrl-C
        wait_for("already stopping")
        sup.signalled()  # the third

    sup.signalled()  # the Ctrl-C that stops the stack
    threading.Thread(target=presses, daemon=True).start()
    started = time.monotonic()
    sup.stop_all()
    assert time.monotonic() - started < 30, "the third Ctrl-C stops at once"
    said = [line for n, line in lines if n == "up"]
    (warning,) = [line for line in said if line.startswith("already stopping")]
    assert "ingest may take up to 1" in warning and "again kills every child at once" in warning
    assert "killing every child now" in said
    assert ("up", "ingest stopped (exit code -9)") in lines
    assert all(gone(pid) for pid in pids)


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_up_with_a_data_dir_it_cannot_use_says_so_in_one_line(tmp_path, monkeypatch, capsys, kind):
    from clora import up as up_module
    from clora.cli import main

    monkeypatch.setattr(up_module, "up", lambda *a, **kw: pytest.fail("the stack must not start"))
    taken = tmp_path / "a-file"
    taken.write_text("")
    data_dir = taken if kind == "a file" else taken / "data"
    config = tmp_path / "clora.toml"
    config.write_text(f'data_dir = "{data_dir}"\n[model]\npath = "{tmp_path / "model"}"\n')
    assert main(["up", "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip() == f"clora: data_dir {data_dir}: Not a directory"


def test_up_says_which_config_it_runs_on_and_warns_of_no_tenants(tmp_path, monkeypatch):
    """`--config "$UNSET"`, or a shell in another directory, ran the stack on the built-in defaults: no
    tenants, every request a 401, and nothing said so."""
    from clora import up as up_module
    from clora.config import Config
    from ingest.broker import free_port

    monkeypatch.chdir(tmp_path)  # no ./clora.toml here
    monkeypatch.delenv("CLORA_CONFIG", raising=False)
    port = free_port()
    cfg = Config.model_validate({"data_dir": str(tmp_path / "d"), "broker": {"port": port},
                                 "serving": {"port": free_port_but(port)}, "kafka": {"bootstrap": f"127.0.0.1:{port}"}})
    monkeypatch.setattr(up_module, "stack_specs", lambda *_, **__: ([spec("a")], ["a"]))
    lines, emit = collect()
    assert up_module.up(cfg, None, until=lambda: True, emit=emit) == 0
    said = [line for n, line in lines if n == "up"]
    assert f"config the built-in defaults (no --config, $CLORA_CONFIG or ./clora.toml): 0 tenants, data in {tmp_path / 'd'}" in said
    assert any(line.startswith("warning: no tenants are configured: every API key gets 401") for line in said)
    (tmp_path / "mine.toml").write_text("")
    assert up_module.config_line(cfg, "mine.toml").startswith("config mine.toml: 0 tenants")


def test_an_empty_config_option_is_a_usage_error(capsys):
    from clora.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["up", "--config", ""])
    assert exit_.value.code == 2 and "argument --config: is empty (an unset variable?)" in capsys.readouterr().err
