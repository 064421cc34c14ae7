"""`clora up`: the whole loop on one machine as supervised child processes.

Children, in start order: the embedded broker (unless an external Kafka is configured), serving, ingest,
learner, and the compactor (`clora compact --every`, unless [compaction] every_seconds is 0). Each is the same process a deployment runs alone (`python -m serving`, ...), so `up` adds no
behaviour of its own: it starts them, waits until each is healthy (a child that exits while starting is
started again, with backoff, up to 3 attempts in all), prefixes their output, restarts a child that
crashes (with exponential backoff, and says so), and stops them in a safe order on Ctrl-C/SIGTERM/SIGHUP
(SIGHUP only when it is not ignored: `nohup clora up &` keeps running when the terminal closes):

  serving first (no new traffic; its last interaction events reach Kafka or its disk spool),
  learner (finishes or abandons its step; the checkpoint protocol makes either safe),
  ingest (drains the topics and commits: the embedded broker keeps topics in memory only),
  broker last.

Several learner shards ([learner] processes) or ingest processes ([ingest] processes) are stopped
together, each group as one step of that order: one at a time, every ingest stop would move its
partitions to the others (a rebalance, and a batch read again) and each could take its whole drain time.

Before starting anything, `up` checks that the ports its own children will bind (the embedded broker's,
serving's, the ingest processes' metrics ports) are distinct and free, and refuses to start otherwise: a stale process from an earlier run on one of them
would answer the health check while our child failed to bind. Children get SIGTERM if `clora up` itself
dies (Linux parent-death signal), so nothing is orphaned. Each child leads its own process group: what it
forked (vLLM's engine core) is killed with it when it crashes or has to be killed, and whatever it left
behind once it stopped.
A signal during the stop says how long the child being stopped may still take; another one kills every
child at once. Output that can no longer be written (a closed terminal, `clora up | tee` whose tee went
with the Ctrl-C) is dropped: the stop goes on in order.
What this module does not do: any work of the children, or choosing ports (the config does).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from clora.processes import die_with_parent, kill_group, terminate

logger = logging.getLogger("clora.up")

INGEST_DRAIN_EMBEDDED_S = 900.0  # how long a stopping ingest may drain the embedded broker's topics
# How long a stopping serving may take beyond [serving] shutdown_grace_seconds: the last answers (503 for
# generations still running), its event log's drain to Kafka or the spool (15 s at most), the engine's stop.
SERVING_STOP_AFTER_GRACE_S = 30.0
KILLED_WHILE_STOPPING = 3  # up's exit code when the stack ran but a child had to be killed while it stopped


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    healthy: Callable[[int], bool]  # given the child's pid
    start_timeout: float = 120.0
    stop_timeout: float = 60.0
    env: dict[str, str | None] = field(default_factory=dict)  # on top of up's own environment; None: unset
    restart_note: str = ""  # said each time the child is restarted after a crash: what the restart cost
    # Where the child marks itself ready (storage.files.mark_ready), removed before each start: an earlier
    # process's mark must not pass for this one's (its pid may have been reused).
    ready_file: Path | None = None
    # Descriptors the child keeps (subprocess's pass_fds): a lock given so stays held while the child lives.
    keep_fds: tuple[int, ...] = ()


class ChildExited(RuntimeError):
    """A child exited before it was healthy (as opposed to: still running, but not healthy in time)."""


class Child:
    def __init__(self, spec: ChildSpec, emit: Callable[[str, str], None]) -> None:
        self.spec = spec
        self.emit = emit
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.killed = False  # killed while being stopped (past its stop_timeout, or a third Ctrl-C): work lost

    def start(self) -> None:
        if self.spec.ready_file is not None:
            self.spec.ready_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            self.spec.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={k: v for k, v in {**os.environ, **self.spec.env}.items() if v is not None},
            # Ctrl-C reaches only `up`, which stops children in order; and the child leads a process group that
            # holds what it forks, killed with it (kill_group)
            start_new_session=True,
            preexec_fn=die_with_parent(),
            pass_fds=self.spec.keep_fds,
            text=True,
            errors="replace",
            bufsize=1,
        )
        self.started_at = time.monotonic()
        self.restart_at = None
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True, name=f"log-{self.spec.name}").start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                self.emit(self.spec.name, line.rstrip("\n"))
            except Exception:  # noqa: BLE001 - reading goes on: a child blocked on a full pipe would never stop
                pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, stop: StopFlag, tick: Callable[[], None] = lambda: None) -> None:
        """Returns once healthy; `tick` runs between checks (the supervisor watches the other children)."""
        deadline = time.monotonic() + self.spec.start_timeout
        while not stop.is_set():
            tick()
            healthy = self.spec.healthy(self.proc.pid)
            # Alive checked after the health check: a port that answered for a child that has exited by now
            # was another process's.
            if not self.alive():
                raise ChildExited(f"{self.spec.name} exited with code {self.proc.returncode} while starting")
            if healthy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.spec.name} was not healthy within {self.spec.start_timeout:.0f}s")
            stop.wait(0.3)

    def stop(self, tick: Callable[[], None] | None = None) -> int | None:
        """SIGTERM, then after stop_timeout SIGKILL to its process group; what it left behind once it stopped
        is killed too. `tick`: called about every 0.1 s while waiting."""
        if self.proc is None:
            return None

        def on_kill() -> None:
            self.killed = True
            self.emit("up", f"{self.spec.name} did not stop within {self.spec.stop_timeout:.0f}s; killing it")

        return terminate(self.proc, self.spec.stop_timeout, on_kill=on_kill, group=True, tick=tick)


class StopFlag:
    """Whether to stop: a plain attribute, set from signal handlers too. Never a lock: a handler runs in the
    main thread between two of its bytecodes, possibly while that thread holds the very lock
    (threading.Event.set in a handler deadlocked against the main thread's Event.wait). The stack's, and
    the stop of each of its children's loops (ingest, learner, `clora compact --every`, `clora broker`)."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleeps up to `timeout` seconds, less once the flag is set (within 50 ms); returns the flag."""
        deadline = time.monotonic() + timeout
        while not self._set and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        return self._set


class Supervisor:
    """Starts children in order (again, with backoff, one that exits while starting), restarts crashed ones
    with backoff, stops them in `stop_order`: names, or tuples of names stopped together (SIGTERM to each
    at once, then waiting for all of them)."""

    def __init__(
        self,
        specs: list[ChildSpec],
        stop_order: list[str | tuple[str, ...]],
        *,
        emit: Callable[[str, str], None] | None = None,
        max_backoff: float = 30.0,
        start_attempts: int = 3,
    ) -> None:
        self.emit = emit or _print_prefixed
        self.children = {s.name: Child(s, self.emit) for s in specs}
        # Only children that exist (no "broker" child when an external Kafka is used), then any others.
        stages = [tuple(n for n in ((s,) if isinstance(s, str) else s) if n in self.children) for s in stop_order]
        named = {n for stage in stages for n in stage}
        self.stop_order = [stage for stage in stages if stage] + [(n,) for n in self.children if n not in named]
        self.max_backoff = max_backoff
        self.start_attempts = start_attempts
        self.stopping = StopFlag()
        self.signals = 0  # Ctrl-C/SIGTERM/SIGHUP received (`signalled`)
        self._stop_signals: int | None = None  # `signals` when stop_all began; those after it, see _while_stopping
        self._stopping_child: tuple[str, float] | None = None  # (names, deadline) of the children being stopped
        self._warned = self._forced = False

    def signalled(self) -> None:
        """What a signal handler calls: plain attributes only (see StopFlag); the main thread acts on it."""
        self.signals += 1
        self.stopping.set()

    def start_all(self) -> None:
        for child in self.children.values():
            if self.stopping.is_set():
                return
            self.emit("up", f"starting {child.spec.name}")
            self._start_healthy(child)
            if self.stopping.is_set():  # the wait was cut short: not healthy, and not started further
                return
            self.emit("up", f"{child.spec.name} is healthy ({time.monotonic() - child.started_at:.1f}s)")

    def _start_healthy(self, child: Child) -> None:
        """Starts `child` and waits until it is healthy. A child that exits while starting is started again
        with the backoff of `watch_once`, `start_attempts` times in all, before the start fails; one still
        running but not healthy within its start_timeout fails it at once."""
        for attempt in range(1, self.start_attempts + 1):
            child.start()
            try:
                # The children started before keep being watched: serving may take minutes to start, and
                # a broker that dies meanwhile is restarted, not left to fail the next child's start.
                child.wait_healthy(self.stopping, tick=lambda: self.watch_once(skip=child))
                return
            except ChildExited as e:
                kill_group(child.proc.pid)  # what it forked before it died
                if attempt == self.start_attempts:
                    raise ChildExited(f"{e} ({attempt} attempts; giving up)") from e
                delay = min(self.max_backoff, 2.0 ** (attempt - 1))
                self.emit("up", f"{e}; starting it again in {delay:.0f}s (attempt {attempt + 1} of {self.start_attempts})")
                deadline = time.monotonic() + delay
                while time.monotonic() < deadline:
                    if self.stopping.wait(min(0.3, max(0.0, deadline - time.monotonic()))):
                        return
                    self.watch_once(skip=child)

    def watch_once(self, skip: Child | None = None) -> None:
        """Restarts children that died; called periodically by `run`, and by `start_all` for the children
        started before the one it is starting (`skip`; those not started yet are left alone)."""
        now = time.monotonic()
        for child in self.children.values():
            if child is skip or child.proc is None or child.alive() or self.stopping.is_set():
                continue
            if child.restart_at is None:
                if now - child.started_at > 60:  # it ran well for a while: start the backoff afresh
                    child.restarts = 0
                kill_group(child.proc.pid)  # what it forked (vLLM's engine core) goes with it
                delay = min(self.max_backoff, 2.0**child.restarts)
                child.restart_at = now + delay
                self.emit(
                    "up",
                    f"{child.spec.name} exited with code {child.proc.returncode}; restarting in {delay:.0f}s "
                    f"(restart #{child.restarts + 1})",
                )
                if child.spec.restart_note:
                    self.emit("up", child.spec.restart_note)
            elif now >= child.restart_at:
                child.restarts += 1
                child.start()

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Watches until stopped (signal) or `until()` is true."""
        while not self.stopping.is_set() and not until():
            self.watch_once()
            self.stopping.wait(0.5)

    def stop_all(self) -> None:
        self.stopping.set()
        self._stop_signals = self.signals
        for stage in self.stop_order:
            children = [self.children[name] for name in stage if self.children[name].proc is not None]
            if not children:
                continue
            timeout = max(child.spec.stop_timeout for child in children)
            names = ", ".join(child.spec.name for child in children)
            self.emit("up", f"stopping {names} (up to {timeout:.0f}s)")
            self._stopping_child = (names, time.monotonic() + timeout)
            if len(children) == 1:
                self._stopped(children[0], children[0].stop(tick=self._while_stopping))
            else:
                self._stop_together(children)
        self._stopping_child = None

    def _stopped(self, child: Child, code: int | None) -> None:
        self.emit("up", f"{child.spec.name} stopped (exit code {code})")

    def _stop_together(self, children: list[Child]) -> None:
        """Stops `children` at once, one thread each (each its own SIGTERM, wait and kill after its
        stop_timeout); this thread keeps answering signals meanwhile (_while_stopping)."""
        threads = [threading.Thread(target=lambda c=child: self._stopped(c, c.stop()), name=f"stop-{child.spec.name}")
                   for child in children]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.1)
                self._while_stopping()

    def _while_stopping(self) -> None:
        """A signal during the stop (ingest may drain for many minutes) says how long the child being stopped
        may still take and how to cut it short; the next one kills every child at once."""
        since = self.signals - (self._stop_signals or 0)
        if since >= 1 and not self._warned and self._stopping_child is not None:
            self._warned = True
            names, deadline = self._stopping_child
            self.emit("up", f"already stopping: {names} may take up to {max(0.0, deadline - time.monotonic()):.0f}s "
                            "more; Ctrl-C (or SIGTERM) again kills every child at once (what they have not "
                            "finished is lost, e.g. events ingest has not stored yet)")
        elif since >= 2 and not self._forced:
            self._forced = True
            self.emit("up", "killing every child now")
            for child in self.children.values():
                if child.alive():
                    child.killed = True
                    kill_group(child.proc.pid)


_emit_lock = threading.Lock()
_stdout_gone = False  # writing to stdout failed once: nothing more is written to it


def _print_prefixed(name: str, line: str) -> None:
    """Prints one prefixed line; never raises for stdout that cannot be written any more: a closed terminal
    (EIO after the hangup), or the reader of a pipe gone (`clora up | tee`: Ctrl-C ends tee too; EPIPE). The
    ordered stop that follows must not end there (its children would all get the parent-death SIGTERM at
    once: the broker gone while ingest drains)."""
    global _stdout_gone
    with _emit_lock:
        if _stdout_gone:
            return
        try:
            print(f"{name:>8} | {line}", flush=True)
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.EIO, errno.ENXIO):  # nobody reads it any more: for good
                _stdout_gone = True
                _stdout_to_devnull()
            # otherwise (a full disk under `> up.log`): this line is lost, later ones are tried


def _stdout_to_devnull() -> None:
    """What is still buffered for stdout (and any later write) goes to /dev/null, not to an error at exit."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's stand-in): nothing to redirect
        pass


# ---------------------------------------------------------------------------------------------------------
# The clora stack


def stack_specs(cfg, config_path: str | None, *, file_only: bool = False) -> tuple[list[ChildSpec], list[str | tuple[str, ...]]]:
    """The children of `clora up` for this config, and their stop order (several learners, or several ingest
    processes, stopped together: Supervisor). `file_only`: the children read
    `config_path` without the environment's overrides (CLORA_DATA_DIR and the like), as `cfg` was loaded
    (the demo: its own data and ports, whatever the shell has set for a real deployment)."""
    import httpx

    from ingest.broker import port_in_use
    from ingest.cli import member_name
    from learner.types import Shard, learner_process_name
    from storage.files import ready_pid
    from storage.layout import DataDir

    py = [sys.executable, "-P", "-m"]  # -P: a module in the current directory never shadows clora (cli.py)
    conf = ["--config", config_path] if config_path else []
    specs = []
    if cfg.broker.embedded:
        specs.append(
            ChildSpec(
                "broker",
                [*py, "clora", "broker", *conf],
                # The port answering is ours: `up` found it free before starting (ports_taken), and the
                # supervisor counts it only while this child is alive.
                healthy=lambda _pid: port_in_use(cfg.broker.host, cfg.broker.port),
                start_timeout=30,
                stop_timeout=10,
                # Tansu here keeps topics in memory only (this build stores to memory:// or s3:// alone).
                restart_note="the embedded broker keeps topics in memory only: events it held that ingest had "
                "not yet stored are lost, and the restarted broker has empty topics and no committed offsets "
                "(it creates the topics again); an external Kafka (kafka.bootstrap, with broker.embedded = "
                "false) is the durable choice",
            )
        )

    def serving_healthy(pid: int) -> bool:
        """/health answers 200 from this very process (not from an earlier serving still on the port)."""
        try:
            # Its own child on this machine: never through a proxy (the address may be a LAN one, not loopback).
            r = httpx.get(f"{cfg.serving.local_url}/health", timeout=1, trust_env=False)
            return r.status_code == 200 and r.json().get("pid") == pid
        except (httpx.HTTPError, ValueError):
            return False

    state = DataDir(cfg.data_dir).state

    def marked_ready(name: str) -> dict:
        """Healthy once this very process marked itself ready (learner: model loaded; ingest: in its group);
        the mark of an earlier one is removed before each start (storage.files.mark_ready writes it)."""
        return {"healthy": lambda pid: ready_pid(state, name) == pid, "ready_file": state / "ready" / f"{name}.json"}

    specs.append(ChildSpec("serving", [*py, "serving", *conf], healthy=serving_healthy, start_timeout=300,
                           stop_timeout=cfg.serving.shutdown_grace_seconds + SERVING_STOP_AFTER_GRACE_S))
    # Ingest drains the topics when stopped. The embedded broker keeps them in memory only and stops right
    # after ingest, so what ingest has not stored by then is lost: it gets long to finish. An external
    # Kafka keeps what is left for the next start.
    # Several ingest processes split the partitions as one consumer group; each marks itself ready by its
    # own name (and serves its metrics on its own port).
    members = cfg.ingest.processes
    ingests = []
    for k in range(members):
        member = None if members == 1 else k
        name, flag = member_name(member), ([] if member is None else ["--member", str(k)])
        drain = ["--drain-on-stop"] if cfg.broker.embedded else []  # an external Kafka keeps what is left
        specs.append(ChildSpec(name, [*py, "ingest", *drain, *conf, *flag], **marked_ready(name),
                               stop_timeout=INGEST_DRAIN_EMBEDDED_S if cfg.broker.embedded else 60.0))
        ingests.append(name)
    # On one machine the CPU engine binds its threads to its own cores; the learners' torch gets half of them
    # (shared out between learner processes) so they do not fight over the same cores (an explicit
    # OMP_NUM_THREADS wins).
    shards = cfg.learner.processes
    threads = max(1, (os.cpu_count() or 2) // 2 // shards)
    learner_env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(threads)}
    learners = []
    for k in range(shards):
        shard = None if shards == 1 else Shard(k, shards)
        name, flag = ("learner", []) if shard is None else (f"learner-{k}", ["--shard", f"{k}/{shards}"])
        specs.append(ChildSpec(name, [*py, "learner", *conf, *flag], **marked_ready(learner_process_name(shard)),
                               start_timeout=600, stop_timeout=120, env=learner_env))
        learners.append(name)
    if cfg.compaction.every_seconds > 0:  # any moment is a safe one to stop it (compact.py)
        specs.append(ChildSpec("compactor", [*py, "clora", "compact", "--every", f"{cfg.compaction.every_seconds:g}",
                                             *conf], **marked_ready("compactor"), stop_timeout=30))
    from clora.config import CONFIG_ENV, env_variables, unknown_env_variables

    # CLORA_* variables nothing reads: `up` warned of them once (config_from_args); not once per child again.
    unset: dict[str, str | None] = dict.fromkeys(unknown_env_variables())
    if file_only:
        unset.update(dict.fromkeys([CONFIG_ENV, *env_variables()]))
    specs = [replace(spec, env={**unset, **spec.env}) for spec in specs]

    def together(names: list[str]) -> list[str | tuple[str, ...]]:
        return [tuple(names)] if len(names) > 1 else list(names)

    return specs, ["compactor", "serving", *together(learners), *together(ingests), "broker"]


def config_problems(cfg) -> list[str]:
    """What would keep `up`'s children from working that the config alone decides, one line each, checked
    before anything starts (exit 2: the config must change): the embedded broker somewhere else than
    kafka.bootstrap says (serving and ingest would never reach it), two of its children given one port."""
    return [p for p in [embedded_broker_problem(cfg)] if p is not None] + port_clashes(cfg)


def held_ports(cfg) -> list[str]:
    """What would keep `up`'s children from working that another process causes: ports it holds now (a child
    that cannot bind its port exits, and a health check would see the other process answering; exit 1: it
    may go away)."""
    problems = []
    if cfg.broker.embedded:
        problems += ports_in_use([("broker.port and kafka.bootstrap", cfg.broker.host, cfg.broker.port)])
    return problems + ports_in_use(children_ports(cfg))


def children_ports(cfg) -> list[tuple[str, str, int]]:
    """(setting, host, port) of each port `up`'s children other than the embedded broker bind: serving's, and
    each ingest process's and learner shard's metrics endpoint."""
    wanted = [("serving.port", cfg.serving.host, cfg.serving.port)]
    if cfg.ingest.metrics_port:  # each ingest process's metrics endpoint
        members = cfg.ingest.processes
        wanted += [("ingest.metrics_port", cfg.ingest.metrics_host, cfg.ingest.metrics_port + k) for k in range(members)]
    if cfg.learner.metrics_port:  # each learner shard's
        wanted += [("learner.metrics_port", cfg.learner.metrics_host, cfg.learner.metrics_port + k)
                   for k in range(cfg.learner.processes)]
    return wanted


def ports_in_use(wanted: list[tuple[str, str, int]]) -> list[str]:
    """One line for each (setting, host, port) of `wanted` another process holds now."""
    return [
        f"port {port} on {host} is already in use by another process (perhaps an earlier clora still "
        f"running): stop it, or set {key} to a free port"
        for key, host, port in wanted
        if not _can_bind(host, port)
    ]


def port_clashes(cfg) -> list[str]:
    """Ports the config gives two of `up`'s children, one line each: serving's and the embedded broker's, and
    ingest and learner metrics ports (metrics_port + K) on any of them. Each port on its own may well be free, and
    the second child to bind it fails (serving, started after the broker, three times). Hosts are not
    compared: a wildcard address (0.0.0.0) clashes with every other."""
    problems = []
    if cfg.broker.embedded and cfg.serving.port == cfg.broker.port:
        problems.append(f"serving.port and broker.port are both {cfg.serving.port}, where serving and the embedded "
                        "broker cannot both listen: set serving.port to another port (or broker.port and "
                        "kafka.bootstrap)")
    if cfg.ingest.metrics_port:
        members = cfg.ingest.processes
        clashes = sorted({cfg.serving.port, *([cfg.broker.port] if cfg.broker.embedded else [])}
                         & set(range(cfg.ingest.metrics_port, cfg.ingest.metrics_port + members)))
        problems += [f"ingest.metrics_port {cfg.ingest.metrics_port} puts an ingest process's metrics on port {port}, "
                     "which serving or the broker listens on: set ingest.metrics_port to a free range" for port in clashes]
    if cfg.learner.metrics_port:
        taken = {cfg.serving.port, *([cfg.broker.port] if cfg.broker.embedded else [])}
        if cfg.ingest.metrics_port:
            taken |= set(range(cfg.ingest.metrics_port, cfg.ingest.metrics_port + cfg.ingest.processes))
        clashes = sorted(taken & set(range(cfg.learner.metrics_port, cfg.learner.metrics_port + cfg.learner.processes)))
        problems += [f"learner.metrics_port {cfg.learner.metrics_port} puts a learner's metrics on port {port}, which "
                     "serving, the broker or an ingest process listens on: set learner.metrics_port to a free range"
                     for port in clashes]
    return problems


def embedded_broker_problem(cfg) -> str | None:
    """The embedded broker somewhere else than kafka.bootstrap says: serving and ingest would never reach it."""
    if not cfg.broker.embedded or _names_broker(cfg.kafka.bootstrap, cfg.broker.host, cfg.broker.port):
        return None
    return (f"kafka.bootstrap is {cfg.kafka.bootstrap!r} but the embedded broker listens on "
            f"{cfg.broker.host}:{cfg.broker.port} (broker.host, broker.port): set kafka.bootstrap to it, or "
            "broker.embedded = false to use the Kafka at kafka.bootstrap")


def config_line(cfg, config_path: str | None) -> str:
    """Which config the stack runs on and how many tenants it has: a stack on the built-in defaults (no
    --config, no $CLORA_CONFIG, no ./clora.toml) has none, and answers every tenant's key with 401."""
    from clora.config import resolve_config_path

    file = resolve_config_path(config_path)
    source = str(file) if file is not None else "the built-in defaults (no --config, $CLORA_CONFIG or ./clora.toml)"
    n = len(cfg.tenants)
    return f"config {source}: {n} tenant{'s' if n != 1 else ''}, data in {cfg.data_dir}"


def setup_warnings(cfg) -> list[str]:
    """What works but wastes or exposes something, one line each: no tenants (every request with an API key is
    a 401, and nothing is trained); more ingest processes than the topics clora creates have partitions (a
    consumer group gives each partition to one member, so the rest wait idle); serving on an address other
    hosts reach without an admin key, and the embedded broker or a metrics endpoint on such an address (they
    have no authentication); the example's placeholder keys; versions deleted while their samples may still
    be trained."""
    warnings = []
    if not cfg.tenants:
        warnings.append("no tenants are configured: every API key gets 401 and nothing is trained; add a "
                        "[[tenants]] table per adapter owner (see clora.example.toml)")
    processes, partitions = cfg.ingest.processes, cfg.kafka.partitions
    if processes > partitions:
        idle = processes - partitions
        warnings.append(
            f"ingest.processes = {processes} is more than kafka.partitions = {partitions}: {idle} ingest "
            f"process{'es' if idle > 1 else ''} will wait idle without a partition (unless the topics exist "
            "already with more partitions: kafka.partitions applies to the topics clora creates)"
        )
    host = cfg.serving.host
    if cfg.serving.admin_key is None and not is_loopback(host):
        warnings.append(f"serving.host {host} is reachable from other hosts and serving.admin_key is unset: /metrics "
                        "and /health's details (every tenant's name, versions and traffic) are open to whoever reaches "
                        f"port {cfg.serving.port}; set serving.admin_key (or $CLORA_ADMIN_KEY)")
    if cfg.broker.embedded and not is_loopback(cfg.broker.host):
        warnings.append(f"broker.host {cfg.broker.host} is reachable from other hosts, and the embedded broker has no "
                        "authentication: whoever reaches it can read every tenant's prompts and completions and send "
                        "events for any tenant; keep it on 127.0.0.1, or use a Kafka with TLS and SASL (kafka.*)")
    for name, section in (("ingest", cfg.ingest), ("learner", cfg.learner)):
        metrics_host = section.metrics_host
        if section.metrics_port and not is_loopback(metrics_host):
            warnings.append(f"{name}.metrics_host {metrics_host} is reachable from other hosts: its metrics (every "
                            "tenant's name and traffic) are open to whoever reaches them, with no key")
    keep, staleness = cfg.learner.keep_versions, cfg.learner.max_staleness
    if keep <= staleness:
        warnings.append(
            f"learner.keep_versions = {keep} is not more than learner.max_staleness = {staleness}: a version's files "
            "are deleted while samples it drew may still be trained, and those drawn at a temperature other than 1 "
            "(or with top-k, top-p, a penalty...) then train uncorrected, their behaviour log-probs unknown; set "
            f"keep_versions to at least {staleness + 1}")
    placeholders = [t.name for t in cfg.tenants if "change-me" in t.api_key.get_secret_value()]
    if placeholders:
        warnings.append(f"tenant{'s' if len(placeholders) > 1 else ''} {', '.join(placeholders)}: api_key is the "
                        "example's placeholder (it contains \"change-me\"): give each tenant a secret key")
    return warnings


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (a name that does not resolve counts as not)."""
    import ipaddress

    try:
        return all(ipaddress.ip_address(a).is_loopback for a in _addresses(host))
    except (OSError, ValueError):
        return False


def _names_broker(bootstrap: str, host: str, port: int) -> bool:
    """Whether one of the bootstrap servers is the broker at host:port: that port, and a name for the same
    address ("localhost" for 127.0.0.1), or any name when the broker binds every address. Read as the Kafka
    clients read it (a missing port is 9092, a `PLAINTEXT://` prefix is allowed)."""
    from kafka.cluster import collect_hosts

    for name, given, _ in collect_hosts(bootstrap, randomize=False):
        if given != port:
            continue
        if name == host or host in ("0.0.0.0", "::", ""):
            return True
        try:
            if _addresses(name) & _addresses(host):
                return True
        except OSError:  # a name that does not resolve names nothing here
            continue
    return False


def _addresses(host: str) -> set[str]:
    return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}


def _can_bind(host: str, port: int) -> bool:
    """False only when the address is in use (as serving binds it: SO_REUSEADDR, so TIME_WAIT is no
    obstacle); any other problem with the address is left for the child to report."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE
    return True


def up(cfg, config_path: str | None, *, until: Callable[[], bool] = lambda: False,
       emit: Callable[[str, str], None] | None = None, on_stop: Callable[[], None] = lambda: None,
       file_only: bool = False, keep_fds: tuple[int, ...] = ()) -> int:
    """Runs the stack until Ctrl-C/SIGTERM (or `until()`); returns an exit code. `on_stop` is called once the
    stop is decided, before the children are stopped (which can take minutes: ingest drains). `file_only`:
    as for `stack_specs`. `keep_fds`: descriptors every child keeps (a lock that must outlive a `up`
    killed outright, until its children, stopping on its death, are gone)."""
    specs, order = stack_specs(cfg, config_path, file_only=file_only)
    specs = [replace(s, keep_fds=keep_fds) for s in specs]
    sup = Supervisor(specs, order, emit=emit)
    sup.emit("up", config_line(cfg, config_path))  # first, whatever follows: which config the errors are of
    wrong = config_problems(cfg)
    problems = wrong + held_ports(cfg)
    if problems:
        for problem in problems:
            sup.emit("up", f"error: {problem}")
        return 2 if wrong else 1  # the config must change; or another process holds a port (and may let it go)
    for warning in setup_warnings(cfg):
        sup.emit("up", f"warning: {warning}")
    # SIGHUP too: a closed terminal must stop the stack in order (ingest drains before the broker goes);
    # unless it is ignored (`nohup clora up &`: meant to outlive the terminal).
    # A SIGHUP only starts the stop, never hurries it: a closed terminal sends its jobs more than one (the
    # shell's, then the kernel's), which must not count as "Ctrl-C again".
    previous = {s: signal.signal(s, lambda *_: sup.signalled()) for s in (signal.SIGINT, signal.SIGTERM)}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: sup.stopping.set())
    code = 0
    try:
        sup.start_all()
        if not sup.stopping.is_set():
            sup.emit("up", f"clora is up: {cfg.serving.local_url}/v1 (Ctrl-C to stop)")
        sup.run(until)
    except RuntimeError as e:
        sup.emit("up", f"error: {e}")
        code = 1
    finally:
        try:
            on_stop()
        finally:
            sup.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
    killed = [child.spec.name for child in sup.children.values() if child.killed]
    if killed:  # what they had not finished is lost (ingest: events the embedded broker held)
        sup.emit("up", f"stopped, but {', '.join(killed)} had to be killed: what it had not finished is lost")
        return code or KILLED_WHILE_STOPPING
    return code
