"""gRPC server plumbing shared by every specmesh service: error mapping, health, reflection, lifecycle.

- `ServiceInterceptor` wraps every specmesh RPC: a domain error (specmesh.errors) becomes its status code
  with its message; anything else is logged and becomes INTERNAL, so one bad request never takes the
  server down. It also opens the server span (a child of the caller's trace context from the metadata)
  and counts the request by method and final code.
- `GrpcServer` runs a `grpc.aio` server with `grpc.health.v1` and reflection. Shutdown (SIGTERM/SIGINT
  or `stop()`) drains: health turns NOT_SERVING (load balancers and the gateway stop sending work) and
  stays answerable, the service refuses new work with UNAVAILABLE, in-flight work gets up to the grace
  period to finish, then the server stops and cancels what is left.
- `BackgroundServer` runs a server on its own event loop thread: used by tests and benchmarks that
  want real servers on loopback without a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from opentelemetry import trace

from specmesh.errors import ConfigError, InvalidArgument, grpc_code_name
from specmesh.grpc_std import add_standard_services
from specmesh.security import Security, bind
from specmesh.telemetry import incoming_context, serve_metrics, setup_logging, setup_tracing, tracer

log = logging.getLogger("specmesh.serving")


def status_code(exc: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode[grpc_code_name(exc)]


async def _abort(context, exc: BaseException):
    if isinstance(exc, grpc.aio.AioRpcError):
        # A downstream service's error passes through with its code (e.g. the verify service's
        # INVALID_ARGUMENT reaches the draft service's caller as INVALID_ARGUMENT).
        await context.abort(exc.code(), exc.details() or "")
    code = status_code(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=exc)
        await context.abort(code, f"internal error: {type(exc).__name__}: {exc}")
    await context.abort(code, str(exc))


class ServiceTelemetry:
    """What a service's RPCs report to: RPC metrics (optional) and a tracer."""

    def __init__(self, service: str, metrics=None):
        self.service = service
        self.metrics = metrics  # RpcMetrics or None
        self.tracer = tracer(service)


def _code_after(exc: BaseException, context) -> str:
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code() if hasattr(context, "code") else None
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    return status_code(exc).name


class _Call:
    """One RPC's server span (a child of the caller's trace context) and its timing, ended with its code."""

    def __init__(self, tel: ServiceTelemetry, method: str, context):
        self.tel, self.method, self.context = tel, method, context
        self.span = tel.tracer.start_span(
            f"{tel.service}/{method}", context=incoming_context(context), kind=trace.SpanKind.SERVER
        )
        self.t0 = time.perf_counter()
        self.code = "OK"

    async def fail(self, exc: Exception) -> None:
        """Record the error's code and answer the call with it (this raises grpc.aio.AbortError)."""
        self.code = _code_after(exc, self.context)
        await _abort(self.context, exc)

    def end(self) -> None:
        if self.tel.metrics is not None:
            self.tel.metrics.observe(self.method, self.code, time.perf_counter() - self.t0)
        self.span.set_attribute("rpc.grpc.status_code", self.code)
        if self.code not in ("OK", "CANCELLED"):
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, self.code))
        self.span.end()


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Every specmesh RPC of a server, in one place: domain errors become their status codes (anything else
    is logged and becomes INTERNAL, so one bad request never takes the server down), each call gets a
    server span and is counted by method and final code. Health and reflection pass through untouched."""

    def __init__(self, telemetry: ServiceTelemetry, prefix: str = "/specmesh."):
        self.telemetry = telemetry
        self.prefix = prefix

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        parse = _tolerant(handler.request_deserializer)
        ser = dict(request_deserializer=parse, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, method), **ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._streaming(handler.unary_stream, method), **ser)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(self._streaming(handler.stream_stream, method), **ser)
        return handler

    @contextlib.asynccontextmanager
    async def _call(self, method: str, context) -> AsyncIterator[None]:
        """One call of `method`, unary or streaming, from its start to its final code: in its span, errors
        answered as statuses, counted when it ends."""
        call = _Call(self.telemetry, method, context)
        try:
            with trace.use_span(call.span, end_on_exit=False):
                yield
        except (asyncio.CancelledError, grpc.aio.AbortError) as exc:
            call.code = _code_after(exc, context)
            raise
        except Exception as exc:  # every error reaches the caller as a status
            await call.fail(exc)
            raise
        finally:
            call.end()

    def _unary(self, behavior, method: str):
        async def unary(request, context):
            async with self._call(method, context):
                return await behavior(_parsed(request), context)

        return unary

    def _streaming(self, behavior, method: str):
        async def streaming(request, context):
            async with self._call(method, context):
                request = _parsed_all(request) if hasattr(request, "__aiter__") else _parsed(request)
                # Closed here, not when collected: grpc closes this generator when the client goes away,
                # and the handler's own cleanup (a session detached, a call downstream cancelled) must run
                # then. Every layer of a streaming handler closes the generator it reads, for this reason.
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item

        return streaming


@dataclass(frozen=True)
class _Undecodable:
    """A request message that did not parse: the interceptor answers it INVALID_ARGUMENT (grpc itself would
    answer UNKNOWN, or INTERNAL, as if the server had failed)."""

    error: str


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(str(e))

    return parse


def _parsed(request):
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"the request message does not parse: {request.error}")
    return request


async def _parsed_all(requests):
    async for request in requests:
        yield _parsed(request)


class GrpcServer:
    """A grpc.aio server with health, reflection and graceful shutdown."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: list[str],
        add_servicers: Callable[[grpc.aio.Server], None],
        grace_seconds: float = 10.0,
        on_shutdown: Callable[[], Awaitable[None]] | None = None,
        options=None,
        on_drain: Callable[[], None] | None = None,
        active: Callable[[], int] | None = None,
        metrics_registry=None,
        metrics_port: int = -1,
        telemetry: ServiceTelemetry | None = None,
        engine=None,
        metrics=None,
        security: Security | None = None,
    ):
        """`security`: TLS / mTLS of the port and the keys its RPCs need (specmesh.security); None: plaintext
        and open."""
        self.host, self.port = host, port
        self.security = security
        self.engine, self.metrics = engine, metrics  # the domain object and metrics behind the servicers
        self.metrics_registry = metrics_registry  # served over HTTP on metrics_port (>= 0; 0 = any free)
        self.metrics_port = metrics_port if metrics_registry is not None and metrics_port >= 0 else None
        self._metrics_server: WSGIServer | None = None
        self.on_drain = on_drain  # the service starts refusing new work
        self.active = active  # in-flight work items; the drain ends when this reaches 0
        self.service_names = service_names
        self.grace_seconds = grace_seconds
        self.on_shutdown = on_shutdown
        interceptors = [ServiceInterceptor(telemetry)] if telemetry is not None else []
        auth = security.interceptor() if security is not None else None
        if auth is not None:  # after the service interceptor, so refused calls are counted and traced
            interceptors.append(auth)
        options = options or [
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
        ]
        # gRPC binds with SO_REUSEPORT by default: a second server started on a port one already holds would
        # bind too, and the kernel would split connections between the two. Off, it fails to bind instead.
        self.server = grpc.aio.server(interceptors=interceptors, options=[*options, ("grpc.so_reuseport", 0)])
        add_servicers(self.server)
        self.health = add_standard_services(self.server, service_names)  # health (with List), reflection v1 + v1alpha
        self.stopping = False
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Bind and start; returns the bound port (useful with port 0)."""
        try:
            bound = bind(self.server, f"{self.host}:{self.port}", self.security)
        except RuntimeError as e:  # grpc.aio's way of saying so (its reason goes to its own log)
            raise OSError(f"cannot bind {self.host}:{self.port}: in use, or not an address of this machine") from e
        if bound == 0:
            raise OSError(f"cannot bind {self.host}:{self.port}")
        self.port = bound
        if self.metrics_port is not None:
            self._metrics_server = serve_metrics(self.metrics_registry, self.host, self.metrics_port)
            self.metrics_port = self._metrics_server.server_port
            log.info("metrics on http://%s:%d/metrics", self.host, self.metrics_port)
        await self.server.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return bound

    async def stop(self, grace: float | None = None) -> None:
        if self.stopping:
            await self._stopped.wait()
            return
        self.stopping = True
        await self.health.enter_graceful_shutdown()
        if self.on_drain is not None:
            self.on_drain()
        grace = self.grace_seconds if grace is None else grace
        log.info("shutting down: health NOT_SERVING, up to %.1f s for in-flight work", grace)
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while self.active is not None and self.active() > 0 and loop.time() < end:
            await asyncio.sleep(0.05)
        await self.server.stop(max(0.0, min(1.0, end - loop.time())))
        if self.on_shutdown is not None:
            await self.on_shutdown()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self._stopped.set()

    async def serve_forever(self) -> None:
        """Until SIGTERM / SIGINT, then a graceful stop. A server that stops serving on its own (grpc.aio shuts
        a server down when its accept loop fails, and logs why) ends the process with status 1: alive but
        deaf, it would keep its place in the pool's health checks and its port until someone noticed, where
        an exit is what a supervisor restarts."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))
        if await self.stopped_on_its_own():
            raise SystemExit(1)
        await self._stopped.wait()

    async def stopped_on_its_own(self) -> bool:
        """Once the server has stopped: whether it did so without `stop()` (logged)."""
        await self.server.wait_for_termination()
        if self.stopping:
            return False
        log.error("the gRPC server on %s:%d stopped serving on its own", self.host, self.port)
        return True


def engine_server(
    config,
    service: str,
    service_name: str,
    add_servicer: Callable[[grpc.aio.Server], None],
    engine,
    metrics,
    active: Callable[[], int],
    security: Security | None = None,
) -> GrpcServer:
    """The server of a model service (`service` "draft" or "verify", serving the gRPC service `service_name`):
    the address, grace period and metrics port of its `config`; its `engine`, told when the drain starts
    (`shutting_down`) and closed at the end; its `metrics` (a registry and RPC metrics). `active`: the work in
    flight, which the drain waits for."""

    def drain() -> None:
        engine.shutting_down = True

    return GrpcServer(
        config.host,
        config.port,
        [service_name],
        add_servicer,
        config.grace_period_s,
        engine.close,
        on_drain=drain,
        active=active,
        metrics_registry=metrics.registry,
        metrics_port=config.metrics_port,
        telemetry=ServiceTelemetry(service, metrics.rpc),
        engine=engine,
        metrics=metrics,
        security=security,
    )


class BackgroundServer:
    """Run `build()` -> (GrpcServer, extra) on a private event loop thread; `stop()` shuts it down."""

    def __init__(self, build: Callable[[], Awaitable[GrpcServer]]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="grpc-server")
        self.thread.start()
        self.server: GrpcServer = self.call(build())
        self.port = self.call(self.server.start())
        self.address = f"{self.server.host}:{self.port}"
        # What serve_forever ends the process on, said in the log: an in-process server has no process to end.
        self._watching = asyncio.run_coroutine_threadsafe(self.server.stopped_on_its_own(), self.loop)

    def call(self, coro, timeout: float | None = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 0.0) -> None:
        if self.loop.is_closed():
            return
        self.call(self.server.stop(grace))
        self._watching.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def run_service(service: str, build: Callable[..., Awaitable[GrpcServer]], config, process: dict) -> None:
    """The `__main__` of a gRPC service: logging, tracing, torch threads, serve until SIGTERM / SIGINT.
    Prints `<service> listening on HOST:PORT (metrics port N)` once serving (scripts parse it). `build(config,
    security=...)` gets the TLS and keys of the process flags (specmesh.security.add_service_flags)."""
    short = service.removesuffix("_service")  # "verify": the tracing / logging name
    try:
        security = Security.from_flags(process)
    except ValueError as e:
        raise SystemExit(f"{service}: {e}") from None
    setup_logging(process["log_level"], process["log_format"], short)
    setup_tracing(short)
    if process["threads"]:
        import torch

        torch.set_num_threads(process["threads"])

    async def serve() -> None:
        try:
            server = await build(config, security=security)
        except ConfigError as e:
            print(f"{service}: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        try:
            port = await server.start()
        except OSError as e:  # its port (or its metrics port) taken: one line, not a traceback
            print(f"{service}: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        print(f"{service} listening on {config.host}:{port} (metrics port {server.metrics_port})", flush=True)
        await server.serve_forever()

    asyncio.run(serve())
