"""The serving process: `python -m serving [--config clora.toml] [--host H] [--port P]` (or `clora serve`).

`main()` reads the config and hands plain values to `run()`, which builds, in order: the base model
(the tiny local one unless `model.path` is set), the engine, the adapter set (synced with the registry
once before the port opens, so the first request already gets each tenant's newest version), the
event log, and the HTTP app; then it serves until SIGINT/SIGTERM and stops them in reverse order (the
event log drains to Kafka or its spool before the process exits). `/health` answers only once all of
that is ready, which is what scripts and tests wait for. If the engine dies, the process stops with
exit code 1 instead of answering 503 forever, so a supervisor (`clora up`, systemd, Kubernetes) restarts it.
A stop lets running generations finish for `serving.shutdown_grace_seconds`; those still running then end
with a 503 `server_stopping` (a stream: its last event), so a supervisor's stop timeout must exceed the grace
period by the event log's drain and the engine's stop (`clora up` allows 30 s more).

The engine's core runs in a child process started with "spawn", so everything here stays behind
`if __name__ == "__main__"` (Python skips a package's `__main__` module in spawned children).

uvicorn takes at most `connection_limit` connections and requests at once (503 past it) and closes idle
connections after KEEP_ALIVE_SECONDS. A port other hosts can reach with no `serving.admin_key` is warned
about at start: /health and /metrics name every tenant.

The port is bound first, before the engine starts: a port that is taken fails the start at once with a
clear message, and a port chosen free a moment ago cannot be taken by another process during the
engine's start (it was, under load, with ports picked by binding port 0).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

logger = logging.getLogger("serving")

WATCH_SECONDS = 1.0  # how often the engine's death, and a stop, are looked for
LAST_ANSWERS_SECONDS = 5.0  # after the grace period, for the 503s of the generations it ended to go out
# An idle connection is closed after this: longer than clients (httpx, so OpenAI's SDK: 5 s) and proxies (nginx's
# upstream keep-alive and cloud load balancers: 60 s) keep one, so they close it first, never racing a request.
KEEP_ALIVE_SECONDS = 75
CONNECTIONS_MIN = 1024  # uvicorn's limit_concurrency, at least
CONNECTIONS_PER_TENANT = 4  # room for each tenant's idle keep-alive connections beside its requests


def connection_limit(tenants: int, max_num_seqs: int) -> int:
    """Connections (idle ones too) and requests uvicorn takes at once; past it, every new request but /health
    and /metrics is answered 503 server_busy (http_timeouts.py; OpenAI's SDK and the learner retry it).
    Twice what the engine runs at once, plus a few per tenant: an unbounded number held memory for each (a
    body read, a stream waiting for the engine).
    uvicorn still accepts connections past it; one whose request headers are slow is closed after
    http_timeouts.HEADER_TIMEOUT_S. A proxy in front limits connections per client where untrusted clients
    connect."""
    return max(CONNECTIONS_MIN, 2 * max_num_seqs + CONNECTIONS_PER_TENANT * tenants)


def warn_if_open(host: str, admin_key_set: bool) -> None:
    """A WARNING when the port is reachable from other hosts while /health and /metrics, which name every
    tenant, need no key."""
    from clora.up import is_loopback

    if admin_key_set or is_loopback(host):
        return
    logger.warning("serving listens on %s with no serving.admin_key: /health and /metrics, which name every tenant, "
                   "are open to anyone who reaches the port; set serving.admin_key (env CLORA_ADMIN_KEY)", host)


def listen(host: str, port: int) -> socket.socket:
    """The HTTP port, bound (not yet listening: clients are refused, not queued, until /health can answer).
    Exits with a clear message when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"serving: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


CONFIG_RELOAD_SECONDS = 5.0  # how often the config file is read again for its tenants (as the learner does)


def tenant_keys(cfg) -> list[tuple[str, str]]:
    return [(t.name, t.api_key.get_secret_value()) for t in cfg.tenants]


async def follow_config(reload, cfg, api, adapters, stop: asyncio.Event, *, every: float = CONFIG_RELOAD_SECONDS,
                        on_tenants=None):
    """Until `stop` is set: reads the config again every `every` seconds (`reload()`, in a worker thread) and
    applies its tenants and their keys (a tenant added gets its adapter, one removed is refused from its next
    request, a key changed takes over from the old one). A change is acted on once two reads in a row agree; a
    config that does not load (the tenants stay as they were) and other changed settings, which take effect at
    the next start, are logged (`ConfigRereads.follow`).
    `on_tenants(n)`: called with the number of tenants after each change of them."""
    from clora.config import ConfigRereads

    keys = tenant_keys(cfg)
    rereads = ConfigRereads(reload, cfg, service="serving", at_restart=(_others, "settings other than [[tenants]]"))
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=every)
            return
        except asyncio.TimeoutError:
            pass
        new = await asyncio.to_thread(rereads.follow)
        if new is None:  # not loaded, or not yet settled: acted on if the next read still says so
            continue
        if tenant_keys(new) == keys:
            continue
        before = {name for name, _ in keys}
        keys = tenant_keys(new)
        names = [name for name, _ in keys]
        api.set_tenants(names, keys)  # first: keys take effect now, not after a refresh the adapters wait for
        if on_tenants is not None:
            on_tenants(len(names))
        await adapters.set_tenants(names)
        added, gone = sorted(set(names) - before), sorted(before - set(names))
        logger.info("config re-read: %d tenant(s)%s%s%s", len(names), f"; added {', '.join(added)}" if added else "",
                    f"; removed {', '.join(gone)}" if gone else "", "" if added or gone else "; api keys changed")


def _others(cfg) -> tuple[str, str]:
    """The config but its tenants, to tell whether anything else changed (its secrets by their digest: the
    dump masks them, and a rotated admin key must be said to wait for a restart too)."""
    secrets = [s.get_secret_value() for s in (cfg.serving.admin_key, cfg.kafka.sasl_password) if s is not None]
    return (cfg.model_copy(update={"tenants": []}).model_dump_json(),
            hashlib.sha256(json.dumps(secrets).encode()).hexdigest())


def event_log(cfg, metrics):
    """The event log (not started): interactions and feedback to the config's topics, through a producer
    connecting as the config's Kafka settings say (TLS, SASL), spooled to disk while Kafka is away."""
    from serving.events_log import MAX_REQUEST_BYTES, EventLog, kafka_producer
    from storage.layout import DataDir

    return EventLog(
        bootstrap=cfg.kafka.bootstrap,
        interactions_topic=cfg.kafka.interactions_topic,
        feedback_topic=cfg.kafka.feedback_topic,
        spool_dir=DataDir(cfg.data_dir).serving_spool,
        metrics=metrics,
        # Every event ingest would store fits (its limit plus room for the key and the batch framing).
        producer_factory=functools.partial(
            kafka_producer, max_request_size=max(MAX_REQUEST_BYTES, cfg.ingest.max_message_bytes + 4096),
            client=cfg.kafka.client_options()),
    )


class RefusalLog(logging.Filter):
    """uvicorn logs a WARNING for every request it refuses past the connection limit: a flood of them is
    when the log matters most. One line every `every` seconds, with how many were refused since."""

    MESSAGE = "Exceeded concurrency limit."

    def __init__(self, limit: int, every: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.limit, self.every, self.clock = limit, every, clock
        self.refused, self.logged_at = 0, None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != self.MESSAGE:
            return True
        self.refused += 1
        now = self.clock()
        if self.logged_at is not None and now - self.logged_at < self.every:
            return False
        record.msg, record.args = (f"{self.refused} request(s) past the connection limit, more than {self.limit} "
                                   f"connections and requests at once: answered 503 server_busy (those to /health "
                                   f"and /metrics answered all the same); at most one such line a {self.every:g} s"), ()
        self.refused, self.logged_at = 0, now
        return True


def http_server(app, host: str, port: int, *, connections: int, grace: float, on_refused=None):
    """uvicorn's server for `app`: at most `connections` at once (`connection_limit`), idle ones closed after
    KEEP_ALIVE_SECONDS, one whose request headers are slow closed (http_timeouts.py), and `grace` seconds at a
    stop for the requests still running. `on_refused()` is called for each request refused past the limit."""
    import uvicorn

    from serving.http_timeouts import HeaderTimeoutProtocol

    protocol = HeaderTimeoutProtocol
    if on_refused is not None:
        protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"on_refused": staticmethod(on_refused)})
    errors = logging.getLogger("uvicorn.error")
    for old in [f for f in errors.filters if isinstance(f, RefusalLog)]:  # one server's at a time
        errors.removeFilter(old)
    errors.addFilter(RefusalLog(connections))

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         http=protocol, limit_concurrency=connections,
                                         timeout_keep_alive=KEEP_ALIVE_SECONDS, timeout_graceful_shutdown=grace))


def set_connection_limit(server, connections: int) -> None:
    """The connection limit from the next connection on (uvicorn reads it as each connection opens): a config
    re-read that adds or removes tenants moves it as a start would (`connection_limit`)."""
    server.config.limit_concurrency = connections
    for f in logging.getLogger("uvicorn.error").filters:
        if isinstance(f, RefusalLog):
            f.limit = connections


async def watch(server, engine, api, stop: asyncio.Event, *, grace: float) -> bool:
    """Until `stop` is set: stops the HTTP server (uvicorn's) when the engine dies, and once the server is
    stopping (a signal, or that) ends the generations still running `grace` seconds later
    (`Api.stop_generations`: each gets its 503 while uvicorn still waits for it). True when the engine died."""
    died = False
    while not stop.is_set() and not engine.errored and not server.should_exit:
        await asyncio.sleep(WATCH_SECONDS)
    if engine.errored:
        died = True
        logger.error("the engine died; stopping the serving process")
        server.should_exit = True
    if not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=grace)
        except asyncio.TimeoutError:
            api.stop_generations()
    return died


async def ended(task: asyncio.Task, what: str, *, failed=None):
    """The task's result once it ends, or `failed` where it raised (logged with its traceback): the stop
    goes on whatever a helper task did, so the event log still drains and the engine still stops."""
    try:
        return await task
    except Exception:
        logger.exception("%s failed; stopping anyway", what)
        return failed


class StartInterrupted(Exception):
    """A stop asked for while the engine was being built."""


class StopDuringStart:
    """SIGINT/SIGTERM handlers for the engine's start, which blocks this thread for up to a minute (a model
    loaded, its kernels warmed) and heard no signal meanwhile. While the engine is being built a signal
    cuts that short (StartInterrupted, raised where the build is); in the short rest of the start it is
    noted, and serving stops once the start is over. `end()` puts the previous handlers back and says
    whether a stop was asked for."""

    def __init__(self) -> None:
        self.asked = False
        self.building = True
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum, frame) -> None:
        self.asked = True
        if self.building:
            self.building = False  # once: the clean-up that follows is not cut short again
            raise StartInterrupted

    def end(self) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return self.asked


async def serve(cfg, host: str, port: int, reload=None) -> int:
    """Runs until stopped; 0 after a requested stop, 1 when the engine died (a supervisor restarts us).
    `reload()`: the config read again, for its tenants (`follow_config`); None: read once."""
    from clora.cli import base_model_dir
    from clora.processes import close_watchdog, outlived_by_none
    from ingest.broker import ensure_topics, unreachable
    from serving.adapter_check import base_linear_shapes, validate_adapter
    from serving.adapters import AdapterSet, ipc_directory, stage_directory
    from serving.api import Api, create_app, default_request_bytes
    from serving.auth import Authenticator
    from serving.engine import ZERO_ADAPTER_NAME, build_engine
    from serving.metrics import ServingMetrics
    from storage.layout import DataDir
    from storage.registry import Registry

    s = cfg.serving
    listener = listen(host, port)  # before the engine's long start: the port is ours, or we say so at once
    warn_if_open(host, s.admin_key is not None)  # of a host it listens on (not one it cannot bind)
    model_path = base_model_dir(cfg)
    metrics = ServingMetrics()
    ipc = None
    if "VLLM_RPC_BASE_PATH" not in os.environ:  # a path the user chose stays theirs
        ipc = ipc_directory()
        os.environ["VLLM_RPC_BASE_PATH"] = str(ipc)  # unset again at stop
    # This process's folder for adapter copies, and the CPU engine's zero adapter: a start after a crash
    # removes a gone process's (a temporary folder of its own was left for good by every SIGKILL).
    stage = stage_directory(DataDir(cfg.data_dir).serving_adapters)
    # vLLM's engine core (and its workers) would outlive this process killed with SIGKILL, holding the
    # model's memory: a watchdog following this process's children stops them then, from the engine's
    # start on (clora up also kills serving's process group).
    watchdog = outlived_by_none()
    starting = StopDuringStart()  # the engine's start does not hear a signal until it ends: cut it short
    try:
        engine = build_engine(
            model_path,
            max_loras=s.max_loras,
            max_cpu_loras=s.max_cpu_loras,
            max_lora_rank=s.max_lora_rank,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            dtype=s.dtype,
            kv_cache_bytes=int(s.kv_cache_gib * 2**30) or None,
            zero_adapter_dir=stage / ZERO_ADAPTER_NAME,
        )
    except StartInterrupted:  # the watchdog stays: it stops whatever the engine started once this process ends
        starting.end()
        logger.info("serving stopped during the engine's start")
        for mine in (stage, ipc):
            if mine is not None:
                shutil.rmtree(mine, ignore_errors=True)
        return 0
    except BaseException:  # the watchdog stays, as above
        starting.end()
        raise
    starting.building = False
    events = None
    stop = asyncio.Event()
    watcher = monitor = follower = None
    engine_died = False
    try:
        await engine.start()
        metrics.watch_slots(engine.lora_slots)
        if starting.end():  # a stop asked for while the engine started
            return 0
        registry = Registry(cfg.data_dir, keep_last=cfg.learner.keep_versions)
        tenants = [t.name for t in cfg.tenants]
        check = functools.partial(
            validate_adapter, max_rank=s.max_lora_rank, base_shapes=base_linear_shapes(model_path)
        )
        adapters = AdapterSet(engine, registry, tenants, check, metrics, base_name=cfg.model.name, stage_dir=stage)
        await adapters.refresh()
        # An unreachable broker must not keep serving down (events spool meanwhile): a TCP check first, as
        # kafka-python's admin client would retry for ~30 s, logging each attempt, before giving up.
        why = unreachable(cfg.kafka.bootstrap)
        if why is not None:
            logger.warning("Kafka is not reachable at %s (kafka.bootstrap): %s; events spool to disk until it is",
                           cfg.kafka.bootstrap, why)
        else:
            try:
                await asyncio.to_thread(functools.partial(
                    ensure_topics, cfg.kafka.bootstrap, [cfg.kafka.interactions_topic, cfg.kafka.feedback_topic],
                    cfg.kafka.partitions, replication_factor=cfg.kafka.replication_factor,
                    client=cfg.kafka.client_options()))
            except Exception as e:
                logger.warning("could not check Kafka topics at %s (%s); continuing", cfg.kafka.bootstrap, e)
        events = event_log(cfg, metrics).start()
        api = Api(
            engine=engine,
            adapters=adapters,
            authenticator=Authenticator(tenant_keys(cfg)),
            tenants=tenants,
            base_name=cfg.model.name,
            events=events,
            metrics=metrics,
            registry=registry,
            default_max_tokens=s.default_max_tokens,
            max_request_bytes=s.max_request_bytes or default_request_bytes(s.max_model_len),
            max_inflight_per_tenant=s.max_inflight_per_tenant,
            max_inflight_wait_s=s.max_inflight_wait_seconds,
            max_feedback_per_second=s.max_feedback_per_second,
            admin_key=s.admin_key.get_secret_value() if s.admin_key is not None else None,
            idempotency_ttl_s=s.idempotency_ttl_seconds,
            idempotency_max_bytes=int(s.idempotency_cache_mib * (1 << 20)),
        )
        watcher = asyncio.create_task(adapters.watch(s.registry_poll_seconds, stop))
        # At a stop, uvicorn stops taking requests and waits for the running ones; past the grace period
        # `watch` ends the generations left with a 503, and uvicorn's own deadline, later, leaves time for those
        # answers to go out before it cancels whatever still runs.
        server = http_server(create_app(api), host, port, connections=connection_limit(len(tenants), s.max_num_seqs),
                             grace=s.shutdown_grace_seconds + WATCH_SECONDS + LAST_ANSWERS_SECONDS,
                             on_refused=api.metrics.connections_refused.inc)
        if reload is not None:
            follower = asyncio.create_task(follow_config(
                reload, cfg, api, adapters, stop,
                on_tenants=lambda n: set_connection_limit(server, connection_limit(n, s.max_num_seqs))))
        logger.info("serving %s with %d tenant(s) on http://%s:%d", model_path, len(tenants), host, port)
        # uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal to the handler it found; make that
        # one harmless so the shutdown below (event log drain, engine stop) runs.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)

        monitor = asyncio.create_task(watch(server, engine, api, stop, grace=s.shutdown_grace_seconds))
        # The ~640k objects of vLLM, torch and transformers loaded by now are never freed: out of the collector's
        # reach, a full collection takes ~25 ms instead of ~280 ms, for which every stream and request stood
        # still (as vLLM's own server does it).
        gc.collect()
        gc.freeze()
        await server.serve(sockets=[listener])
    finally:
        starting.end()
        listener.close()
        stop.set()
        if watcher is not None:
            await ended(watcher, "the adapter watcher")
        if follower is not None:
            await ended(follower, "the config follower")
        if monitor is not None:
            engine_died = await ended(monitor, "the engine monitor", failed=True)
        if events is not None:
            events.close()
        engine.shutdown()
        close_watchdog(watchdog)
        for mine in (stage, ipc):
            if mine is not None:
                shutil.rmtree(mine, ignore_errors=True)
        if ipc is not None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        logger.info("serving stopped")
    return 1 if engine_died else 0


def run(cfg, host: str | None = None, port: int | None = None, config_path: str | None = None) -> int:
    from clora.config import load_config

    return asyncio.run(serve(cfg, host or cfg.serving.host, port or cfg.serving.port,
                             reload=lambda: load_config(config_path)))


def main(argv: list[str] | None = None) -> int:
    from clora.cli import common_parser, keep_the_current_directory_off_the_path, config_from_args
    from serving.cli import add_arguments

    keep_the_current_directory_off_the_path()  # nothing there shadows clora or an installed module

    parser = argparse.ArgumentParser(prog="python -m serving", parents=[common_parser()],
                                     description="Run the clora serving process.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, writes_data_dir=True)
    return run(cfg, args.host, args.port, getattr(args, "config_path", None))


if __name__ == "__main__":
    sys.exit(main())
