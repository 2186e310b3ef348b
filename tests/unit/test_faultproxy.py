"""The chaos suite's fault proxy on loopback: it forwards, delays, holds and resets on command."""

import contextlib
import socket
import threading
import time

import pytest

from tests.support.faultproxy import FaultProxy


@pytest.fixture
def link():
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn):
        with conn, contextlib.suppress(OSError):  # the proxy's reset reaches this side too
            while data := conn.recv(100):
                conn.sendall(data)

    def accept():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    proxy = FaultProxy(f"127.0.0.1:{server.getsockname()[1]}")
    host, port = proxy.start().rsplit(":", 1)
    client = socket.create_connection((host, int(port)), timeout=5)
    yield proxy, client
    client.close()
    proxy.stop()
    server.close()


def test_forward_delay_blackhole_and_reset(link):
    proxy, client = link
    client.sendall(b"a")
    assert client.recv(10) == b"a"
    proxy.delay(0.2)
    t0 = time.monotonic()
    client.sendall(b"b")
    assert client.recv(10) == b"b"
    assert time.monotonic() - t0 >= 0.4  # both directions
    proxy.blackhole()
    client.sendall(b"c")
    client.settimeout(0.5)
    with pytest.raises(TimeoutError):
        client.recv(10)
    proxy.heal()  # held, not lost
    client.settimeout(5)
    assert client.recv(10) == b"c"
    proxy.reset()
    with pytest.raises(ConnectionResetError):
        client.sendall(b"d")
        client.recv(10)
