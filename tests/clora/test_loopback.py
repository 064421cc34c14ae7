"""Calls to clora's own services on this machine do not go through the environment's HTTP proxy."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clora.config import Config
from clora.loopback import is_loopback, trust_env
from clora.up import stack_specs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("url, loopback", [
    ("http://127.0.0.1:8000", True),
    ("http://127.8.9.1", True),
    ("http://[::1]:8000/v1", True),
    ("http://localhost:8000", True),
    ("http://LOCALHOST", True),
    ("http://10.0.0.5:8000", False),
    ("https://serving.example.com/v1", False),
    ("http://0.0.0.0:8000", False),
])
def test_is_loopback(url, loopback):
    assert is_loopback(url) is loopback and trust_env(url) is not loopback


@pytest.fixture
def proxied(monkeypatch):
    """An environment whose proxy (nothing listens on port 9) is set for outside traffic only."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def health_server():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            data = json.dumps({"status": "ok", "pid": os.getpid()}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_clora_up_sees_serving_healthy_with_a_proxy_set(tmp_path, proxied, health_server):
    cfg = Config.model_validate({"data_dir": str(tmp_path), "serving": {"port": health_server}})
    specs, _ = stack_specs(cfg, None)
    (serving,) = [s for s in specs if s.name == "serving"]
    assert serving.healthy(os.getpid())
