"""The local SGLang stack's port choice: every port SGLang derives from an engine's own is valid."""
import socket

import pytest

from april_workbench import localstack
from april_workbench.localstack import ENGINE_PORT_LIMIT, LocalEngine, free_port


def test_an_engine_port_leaves_room_for_the_grpc_port_sglang_derives(monkeypatch, tmp_path):
    # SGLang 0.5.15 validates --port + 10000 at start; the kernel's ephemeral ports reach 60999
    launched = []
    engine = LocalEngine(tmp_path)
    monkeypatch.setattr(engine._process, "launch", lambda command: launched.append(command))
    for _ in range(50):
        engine.port = None
        engine.launch()
        port = int(launched[-1][launched[-1].index("--port") + 1])
        assert port == engine.port and port + 10000 <= 65535
    assert ENGINE_PORT_LIMIT + 10000 <= 65535


def test_a_bounded_free_port_is_free_and_below_the_bound():
    port = free_port(below=ENGINE_PORT_LIMIT)
    assert 20000 <= port < min(ENGINE_PORT_LIMIT, 32768)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_no_free_port_in_the_range_is_an_error_naming_the_range(monkeypatch):
    class Taken:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def bind(self, address):
            raise OSError("in use")

    monkeypatch.setattr(localstack.socket, "socket", Taken)
    with pytest.raises(OSError, match="20000-"):
        free_port(below=ENGINE_PORT_LIMIT)
