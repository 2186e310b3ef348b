"""OpenAI-compatible REST front (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health
(ready: 503 while no verify replica is healthy) and /health/live (the process answers).

Requests are validated field by field here, so a bad one gets a 400 naming the parameter, in OpenAI's
error shape `{"error": {"message", "type", "param", "code"}}`. Streaming uses server-sent events
(`data: {json}` per chunk, `data: [DONE]` last; with `stream_options.include_usage`, a last chunk with
`choices: []` and the usage). An error after the stream began is sent as an error event, never a silent
close. Extensions: `top_k`, `session_id` (or the `X-Session-Id` header) and `num_speculative_tokens` in
the request; a `specmesh` object with the speculation stats in the response (and in the usage chunk).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.core import Gateway, GenRequest, Outcome
from specmesh import telemetry
from specmesh.errors import SpecmeshError
from specmesh.sampling import MAX_STOP_STRINGS, SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(e: HTTPError, retried: bool = False) -> JSONResponse:
    headers = {"x-should-retry": "false"} if retried else None
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status, headers=headers)


def from_domain(e: SpecmeshError) -> HTTPError:
    code = {429: "rate_limit_exceeded", 503: "service_unavailable", 404: "not_found"}.get(e.http_status)
    return HTTPError(e.http_status, str(e), code=code)


# request validation ------------------------------------------------------------------------------------
def _get(body: dict, name: str, types, default=None, check=None, what: str = ""):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise HTTPError(400, f"'{name}' must be {what}, got {json.dumps(v)}", name, "invalid_type")
    if not isinstance(v, types):
        raise HTTPError(400, f"'{name}' must be {what}, got {type(v).__name__}", name, "invalid_type")
    if check is not None and not check(v):
        raise HTTPError(400, f"'{name}' must be {what}, got {json.dumps(v)}", name, "invalid_value")
    return v


def sampling_from(body: dict, max_tokens_key: str = "max_tokens") -> SamplingParams:
    num = (int, float)
    temperature = _get(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")
    top_p = _get(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _get(body, "top_k", int, 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0 = off)")
    max_tokens = _get(body, max_tokens_key, int, None, lambda v: v >= 1, "an integer >= 1")
    if max_tokens is None and max_tokens_key == "max_completion_tokens":
        max_tokens = _get(body, "max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    seed = _get(body, "seed", int, None, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")
    n = _get(body, "n", int, 1, lambda v: v == 1, "1 (only one choice per request is supported)")
    del n
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise HTTPError(400, "'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise HTTPError(400, f"'stop' must hold at most {MAX_STOP_STRINGS} non-empty strings", "stop", "invalid_value")
    for unsupported in ("logprobs", "top_logprobs", "logit_bias", "echo", "suffix", "tools", "functions"):
        v = body.get(unsupported)
        if v not in (None, False, {}, []):
            raise HTTPError(400, f"'{unsupported}' is not supported by specmesh", unsupported, "unsupported")
    for penalty in ("presence_penalty", "frequency_penalty"):
        v = _get(body, penalty, (int, float), 0, lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        if v:
            raise HTTPError(400, f"'{penalty}' is not supported (it would change the target's distribution)",
                            penalty, "unsupported")
    return SamplingParams(temperature=float(temperature), top_k=max(0, top_k), top_p=float(top_p),
                          seed=seed, max_tokens=max_tokens or 16, stop=stop,
                          ignore_eos=bool(_get(body, "ignore_eos", bool, False, None, "a boolean")))


def stream_options(body: dict) -> bool:
    opts = _get(body, "stream_options", dict, {}, None, "an object")
    return bool(_get(opts, "include_usage", bool, False, None, "a boolean")) if opts else False


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise HTTPError(400, "'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise HTTPError(400, "'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(400, f"'{where}' must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise HTTPError(400, f"'{where}.role' must be one of system, developer, user, assistant", f"{where}.role",
                            "invalid_value")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise HTTPError(400, f"'{where}.content' parts must be text parts", f"{where}.content",
                                    "invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise HTTPError(400, f"'{where}.content' must be a string", f"{where}.content", "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


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


# the app ---------------------------------------------------------------------------------------------
def create_app(gateway: Gateway, api_keys: tuple[str, ...] = (), max_body_bytes: int = 1 << 20,
               metrics=None) -> FastAPI:
    """The REST app. `metrics` (GatewayMetrics) adds /metrics and request counting."""
    app = FastAPI(title="specmesh gateway", docs_url=None, redoc_url=None)
    model_name = gateway.config.model_name
    created = int(time.time())
    tracer = telemetry.tracer("gateway")

    if metrics is not None:
        app.add_middleware(CountRequests, rpc=metrics.rpc)

        @app.get("/metrics")
        async def prometheus():
            return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(HTTPError)
    async def _http_error(request, exc: HTTPError):
        return error_response(exc)

    @app.exception_handler(SpecmeshError)
    async def _domain_error(request, exc: SpecmeshError):
        return error_response(from_domain(exc))

    @app.exception_handler(404)
    async def _not_found(request, exc):
        return JSONResponse(error_body(404, f"no route {request.method} {request.url.path}"), status_code=404)

    @app.exception_handler(405)
    async def _not_allowed(request, exc):
        return JSONResponse(error_body(405, f"method {request.method} not allowed on {request.url.path}"),
                            status_code=405)

    def authorize(request: Request) -> None:
        if not api_keys:
            return
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer ") or auth[7:].strip() not in api_keys:
            raise HTTPError(401, "invalid or missing API key (Authorization: Bearer <key>)", None, "invalid_api_key")

    async def read_body(request: Request) -> dict:
        authorize(request)
        # Read (and drop) an oversized body up to a hard cap before answering 413: a client that is still
        # sending when the answer comes would see a broken pipe instead of the error.
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size <= max_body_bytes:
                parts.append(part)
            elif size > 64 * max_body_bytes:
                break
        if size > max_body_bytes:
            raise HTTPError(413, f"request body larger than {max_body_bytes} bytes", None, "body_too_large")
        raw = b"".join(parts)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        if model is None:
            raise HTTPError(400, "'model' is required", "model", "missing_required_parameter")
        if model != model_name:
            raise HTTPError(404, f"the model '{model}' does not exist; this gateway serves '{model_name}'", "model",
                            "model_not_found")
        return body

    def session_of(request: Request, body: dict) -> str:
        sid = _get(body, "session_id", str, None, lambda v: 0 < len(v) <= 256, "a string of 1-256 characters")
        return sid or request.headers.get("x-session-id", "")

    @app.get("/health")
    async def health():
        v, d = len(gateway.verify_pool.healthy), len(gateway.draft_pool.healthy)
        ok = v > 0
        return JSONResponse({"status": "ok" if ok else "unavailable", "verify_healthy": v, "draft_healthy": d,
                             "target_only": ok and d == 0}, status_code=200 if ok else 503)

    @app.get("/health/live")
    async def live():
        return {"status": "ok"}  # liveness: the process serves HTTP (readiness is /health)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specmesh"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = gateway.encode(prompt) if prompt else []
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise HTTPError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                            "prompt", "invalid_type")
        if not ids:
            raise HTTPError(400, "'prompt' must not be empty", "prompt", "invalid_value")
        req = GenRequest(ids, sampling_from(body), session_of(request, body),
                         _get(body, "num_speculative_tokens", int, 0, lambda v: 0 <= v <= 32, "an integer in [0, 32]"))
        stream = _get(body, "stream", bool, False, None, "a boolean")
        return await respond(request, req, stream, stream_options(body) if stream else False, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request)
        messages = chat_messages(body)
        params = sampling_from(body, "max_completion_tokens")
        ids = gateway.chat_prompt(messages)
        req = GenRequest(ids, params, session_of(request, body),
                         _get(body, "num_speculative_tokens", int, 0, lambda v: 0 <= v <= 32, "an integer in [0, 32]"))
        stream = _get(body, "stream", bool, False, None, "a boolean")
        return await respond(request, req, stream, stream_options(body) if stream else False, chat=True)

    def usage(outcome: Outcome) -> dict:
        return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": outcome.cached_prompt_tokens}}

    async def respond(request: Request, req: GenRequest, stream: bool, include_usage: bool, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        outcome = Outcome(prompt_tokens=len(req.prompt_ids))
        telemetry.REQUEST_ID.set(rid)
        span = tracer.start_span("gateway." + ("chat" if chat else "completions"), kind=trace.SpanKind.SERVER,
                                 context=propagate.extract(dict(request.headers)),
                                 attributes={"specmesh.request_id": rid, "specmesh.stream": stream,
                                             "specmesh.prompt_tokens": len(req.prompt_ids),
                                             "specmesh.session_id": req.session_id})
        with trace.use_span(span, end_on_exit=False):
            req.metadata = telemetry.outgoing_metadata()
        ended = False

        def end_span(error: str | None = None):
            nonlocal ended
            if ended:
                return
            ended = True
            span.set_attributes({"specmesh.completion_tokens": outcome.completion_tokens,
                                 "specmesh.failovers": outcome.failovers, "specmesh.target_only": outcome.target_only,
                                 "specmesh.verify_replica": outcome.verify_replica,
                                 "specmesh.accepted": outcome.stats.accepted,
                                 "specmesh.drafted": outcome.stats.drafted})
            if error:
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            span.end()

        gen = gateway.generate(req, outcome)
        # Run up to the first chunk before answering, so errors found before any output (bad input,
        # overload, no replica) are real HTTP statuses rather than stream events.
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except SpecmeshError as e:
            await gen.aclose()
            end_span(str(e))
            return error_response(from_domain(e), retried=e.http_status == 503)
        if not stream:
            pieces, finish = [], None

            async def collect():
                nonlocal finish
                chunk = first
                while chunk is not None:
                    pieces.append(chunk.text)
                    finish = chunk.finish_reason or finish
                    chunk = await gen.__anext__() if chunk.finish_reason is None else None

            collector = asyncio.ensure_future(collect())
            try:
                # A client that goes away stops the work downstream (as a closed stream does).
                while not collector.done():
                    await asyncio.wait({collector}, timeout=0.25)
                    if not collector.done() and await request.is_disconnected():
                        collector.cancel()
                        end_span("client disconnected")
                        return Response(status_code=499)
                collector.result()
            except SpecmeshError as e:
                end_span(str(e))
                return error_response(from_domain(e), retried=e.http_status == 503)
            finally:
                if not collector.done():
                    collector.cancel()
                await gen.aclose()
                end_span()
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                       "finish_reason": finish} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                                 "choices": [choice], "usage": usage(outcome), "specmesh": outcome.spec_dict()},
                                headers={"x-request-id": rid})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        created_at = int(time.time())

        def event(choices: list, **extra) -> str:
            payload: dict[str, Any] = {"id": rid, "object": chunk_obj, "created": created_at, "model": model_name,
                                       "choices": choices}
            if include_usage:
                payload["usage"] = None
            payload.update(extra)
            return f"data: {json.dumps(payload)}\n\n"

        def choice(text: str, finish, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        async def events():
            try:
                chunk, started = first, False
                while chunk is not None:
                    if chat and not started:
                        yield event([choice("", None, role=True)])
                    started = True
                    if chunk.text or chunk.finish_reason is None:
                        if chunk.text:
                            yield event([choice(chunk.text, None)])
                    if chunk.finish_reason is not None:
                        yield event([choice("", chunk.finish_reason)])
                        break
                    chunk = await gen.__anext__()
                if include_usage:
                    yield event([], usage=usage(outcome), specmesh=outcome.spec_dict())
            except SpecmeshError as e:
                end_span(str(e))
                yield f"data: {json.dumps(error_body(e.http_status, str(e)))}\n\n"
            except Exception as e:  # noqa: BLE001 — never a silent close
                end_span(repr(e))
                yield f"data: {json.dumps(error_body(500, f'internal error: {type(e).__name__}: {e}'))}\n\n"
            finally:
                await gen.aclose()  # also when the client went away: cancels the work downstream
                end_span()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                          "x-request-id": rid})

    return app
