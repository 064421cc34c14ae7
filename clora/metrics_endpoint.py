"""A process's Prometheus endpoint (the learner's and ingest's; serving's metrics are a route of its API).

`serve_metrics` listens on host:port for one registry, or says in one line why it cannot (a port taken, not
allowed, out of range), naming the setting that chose the port; `stop_metrics` lets the port go.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)


class MetricsPortError(RuntimeError):
    """The metrics endpoint cannot listen on its port (in use, not allowed)."""


def serve_metrics(registry: CollectorRegistry, *, port: int, host: str, setting: str, what: str) -> WSGIServer:
    """Serves `registry` on http://host:port/metrics (a thread of its own). `setting`: how the config names the
    port, for the error (say, "ingest.metrics_port 9464"); `what`: whose metrics, for the log line."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except (OSError, OverflowError) as e:  # taken, or out of range: one line from the command, not a traceback
        raise MetricsPortError(f"{setting} on {host}: {getattr(e, 'strerror', None) or e}") from e
    logger.info("%s metrics on http://%s:%d/metrics", what, host, port)
    return server


def stop_metrics(server: WSGIServer | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()  # the port too, not only the serving thread
