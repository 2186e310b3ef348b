"""The REST app (FastAPI): the OpenAI-compatible routes of `gateway.openai`, errors in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` (unknown routes and methods included), and with metrics,
/metrics and a count of requests by route and status. With API keys, every route needs one (the one check of
`specmesh.security`), but those the operator leaves open: health by default, metrics on request.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import sglang
from gateway.core import Gateway, shown
from gateway.openai import chat, completions, models, responses, tokens
from gateway.openai.protocol import APIError
from gateway.openai.serving import Front
from specmesh.errors import SpecmeshError, Unauthenticated
from specmesh.security import KeyRing, RequireKey


class CountRequests:
    """Plain ASGI middleware (it leaves streaming and disconnects alone): requests by route and status,
    and their duration to the last byte."""

    def __init__(self, app, rpc):
        self.app, self.rpc = app, rpc

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.rpc.observe(f"{scope['method']} {scope['path']}", str(status["code"]), time.perf_counter() - t0)


log = logging.getLogger("specmesh.gateway")


class CatchAll:
    """Plain ASGI middleware: an exception that reaches it is logged and answered as an OpenAI-shaped 500
    ("internal error", no exception text: it may quote internals or the client's input). Starlette's own
    answer would be plain text, and the server would then close the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # the answer is under way: nothing better than closing the connection is left
            await APIError(500, "internal error", code="internal_error").response()(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(SpecmeshError)
    async def _domain_error(request: Request, exc: SpecmeshError):
        return APIError.from_domain(exc).response()

    @app.exception_handler(404)
    async def _not_found(request: Request, exc):
        return APIError(404, f"no route {request.method} {shown(request.url.path)}").response()

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc):
        return APIError(405, f"method {request.method} not allowed on {shown(request.url.path)}").response()


def create_app(
    gateway: Gateway,
    api_keys: tuple[str, ...] = (),
    max_body_bytes: int = 1 << 20,
    metrics=None,
    *,
    open_health: bool = True,
    open_metrics: bool = False,
    metrics_route: bool = True,
) -> FastAPI:
    """The REST app. `metrics` (GatewayMetrics) adds request counting, and /metrics unless `metrics_route` is
    False (metrics served on a port of their own). With `api_keys`, every request needs one, but /health and
    /health/live when `open_health` and /metrics when `open_metrics`."""
    app = FastAPI(title="specmesh gateway", docs_url=None, redoc_url=None)
    app.add_middleware(CatchAll)  # added first: the innermost, so what answers errors and counts sees its 500
    open_paths = ["/health", "/health/live"] if open_health else []
    open_paths += ["/metrics"] if open_metrics else []
    # Added before the counting middleware, which wraps it: refused requests are counted too.
    app.add_middleware(
        RequireKey,
        keys=KeyRing(api_keys),
        open_paths=open_paths,
        reject=lambda message: APIError.from_domain(Unauthenticated(message)).response(),
    )
    if metrics is not None:
        app.add_middleware(CountRequests, rpc=metrics.rpc)
    if metrics is not None and metrics_route:

        @app.get("/metrics")
        async def prometheus():
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _add_error_handlers(app)
    front = Front(gateway, (), max_body_bytes, keyed_tenants=bool(api_keys))  # the key was checked by RequireKey
    for family in (models, tokens, completions, chat, responses, sglang):
        app.include_router(family.router(front))
    return app
