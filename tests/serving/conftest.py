"""The serving process as a fixture: `server` runs `python -m serving` once per test session.

It writes a clora.toml (five tenants with keys, the session `broker`, the cached `tiny_model`, a free
port, a fresh data directory), starts the process, waits for `/health`, and stops it by its pid at the
end; it yields a `ServerHandle` (base_url, data_dir, config_path, keys, bootstrap). Tests publish
adapters into `server.data_dir` through the registry and see them hot-swapped in. It depends only on
fixtures of tests/conftest.py and on serving_process.py, so it can move to tests/conftest.py as is.
"""

from __future__ import annotations

import pytest

from serving_process import start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory, broker, tiny_model):
    handle = start_server(tmp_path_factory.mktemp("serving"), bootstrap=broker.bootstrap, model_path=tiny_model)
    try:
        yield handle
    finally:
        stop_server(handle)
