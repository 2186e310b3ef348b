"""A service's gRPC port is its own: gRPC binds with SO_REUSEPORT by default, so a second server started on a
port one already holds used to bind too (the kernel then splits connections between the two: sessions on
one, their next blocks on the other). specmesh's servers turn it off: the second one fails to start, with
an OSError naming the address."""

import asyncio

import pytest

from specmesh.serving import GrpcServer


def test_a_second_server_on_a_taken_port_fails_to_start():
    async def body():
        first = GrpcServer("127.0.0.1", 0, [], lambda s: None)
        port = await first.start()
        second = GrpcServer("127.0.0.1", port, [], lambda s: None)
        try:
            await second.start()
        except OSError as e:
            refused: OSError | None = e
        else:  # it bound beside the first: stop it, so the failure below is a failure and not a hang
            refused = None
            await second.server.stop(0)
        finally:
            await first.server.stop(0)
        again = GrpcServer("127.0.0.1", port, [], lambda s: None)  # free again once the first has stopped
        assert await again.start() == port
        await again.server.stop(0)
        return port, refused

    port, refused = asyncio.run(body())
    assert refused is not None and f"cannot bind 127.0.0.1:{port}" in str(refused)


def test_a_server_that_stops_serving_on_its_own_ends_its_process():
    """grpc.aio shuts a server down by itself when its accept loop fails; the service's process then exits
    with status 1 (a supervisor restarts it) instead of living on with no port."""

    async def body():
        server = GrpcServer("127.0.0.1", 0, [], lambda s: None)
        await server.start()

        async def grpc_shuts_it_down():  # grpc's own shutdown, not the service's drain
            await asyncio.sleep(0.05)
            await server.server.stop(0)

        shutdown = asyncio.create_task(grpc_shuts_it_down())
        try:
            await asyncio.wait_for(server.serve_forever(), 10)  # without the exit: a TimeoutError, not a hang
        finally:
            await shutdown

    with pytest.raises(SystemExit) as e:
        asyncio.run(body())
    assert e.value.code == 1


def test_a_drained_server_returns_from_serving():
    async def body():
        server = GrpcServer("127.0.0.1", 0, [], lambda s: None, grace_seconds=0.1)
        await server.start()
        serving = asyncio.create_task(server.serve_forever())
        await asyncio.sleep(0.05)
        await server.stop()
        await asyncio.wait_for(serving, 10)

    asyncio.run(body())
