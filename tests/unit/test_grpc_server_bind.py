"""A service's gRPC port is its own: gRPC binds with SO_REUSEPORT by default, so a second server started on a
port one already holds used to bind too (the kernel then splits connections between the two: sessions on
one, their next blocks on the other). specmesh's servers turn it off: the second one fails to start, with
an OSError naming the address."""

import asyncio

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
