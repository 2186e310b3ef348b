"""A fault-injecting TCP proxy on loopback, for chaos tests: it forwards a listening port to a target
address and, on command, adds latency, black-holes traffic, or resets connections.

Modes (set from any thread; they apply to data already flowing and to new connections):
- `heal()`: plain forwarding.
- `delay(seconds)`: every chunk waits this long before it is forwarded, in both directions.
- `blackhole()`: connections stay open but nothing is forwarded (a hung peer, a dropped route); new
  connections are accepted and held the same way.
- `reset()`: every open connection is closed with a TCP RST (SO_LINGER 0), and so is every new one, until
  the mode changes.

It runs its own event loop on a daemon thread: `FaultProxy(target).start()` returns the address to dial.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from concurrent.futures import Future


class FaultProxy:
    def __init__(self, target: str, host: str = "127.0.0.1"):
        self.target_host, _, port = target.rpartition(":")
        self.target_port = int(port)
        self.host = host
        self.mode = "pass"
        self.latency = 0.0
        self.connections = 0  # accepted so far
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="faultproxy")
        self._server: asyncio.AbstractServer | None = None
        self.address = ""

    # control (any thread) -------------------------------------------------------------------------
    def start(self) -> str:
        self._thread.start()
        self._call(self._start())
        return self.address

    def heal(self) -> None:
        self._set("pass")

    def delay(self, seconds: float) -> None:
        self.latency = seconds
        self._set("delay")

    def blackhole(self) -> None:
        self._set("blackhole")

    def reset(self) -> None:
        self._set("reset")
        self._call(self._reset_all())

    def stop(self) -> None:
        if self._server is not None:
            self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _set(self, mode: str) -> None:
        self.mode = mode

    def _call(self, coro):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(10)

    # the proxy (its own loop) ---------------------------------------------------------------------
    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._reset_all()

    async def _reset_all(self) -> None:
        for w in list(self._writers):
            _rst(w)
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == "reset":
            _rst(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _rst(writer)
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                if not w.is_closing():
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                while self.mode == "blackhole":  # held, not lost: TCP would retransmit after a real outage
                    await asyncio.sleep(0.05)
                if self.mode == "reset":
                    break
                if self.mode == "delay" and self.latency > 0:
                    await asyncio.sleep(self.latency)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if self.mode == "reset":
                _rst(writer)
            elif not writer.is_closing():
                writer.close()


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN: what a peer that crashed or a middlebox that dropped the flow
    sends."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
