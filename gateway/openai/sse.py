"""The server-sent events writer of streamed responses.

One event per JSON object (`data: <json>\n\n`) and `data: [DONE]\n\n` last. An error after the stream
began cannot change the HTTP status any more: it is sent as an event `data: {"error": {...}}` (OpenAI's
error shape), then [DONE], never as a silent close. Typed streams (the Responses API's) name each event's
`type` in an `event:` line too, end without [DONE], and report an error with events of their own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from gateway.openai.protocol import APIError
from specmesh.errors import Internal, SpecmeshError

DONE = "data: [DONE]\n\n"
log = logging.getLogger("specmesh.gateway")

# A typed stream's events that report an error after the stream began.
ErrorEvents = Callable[[APIError], list[dict]]


def event(payload: dict, typed: bool = False) -> str:
    data = f"data: {json.dumps(payload)}\n\n"
    return f"event: {payload['type']}\n{data}" if typed else data


def error_event(error: APIError) -> str:
    return event(error.body())


def _error_events(error: APIError, typed: ErrorEvents | None) -> list[str]:
    return [error_event(error)] if typed is None else [event(p, True) for p in typed(error)]


async def event_stream(
    payloads: AsyncGenerator[dict, None],
    on_error: Callable[[str], None],
    close: Callable[[], Awaitable[None]],
    typed: ErrorEvents | None = None,
) -> AsyncIterator[str]:
    """The events of `payloads`. `on_error(description)` hears of a failure before its error event;
    `close()` runs however the stream ends, also when the client goes away (the ASGI server then closes or
    cancels this generator): that is how work downstream stops. `typed`: the stream is typed, and this
    gives the events that report an error."""
    try:
        async for payload in payloads:
            yield event(payload, typed is not None)
    except SpecmeshError as e:
        on_error(str(e))
        for text in _error_events(APIError.from_domain(e), typed):  # the status and code an HTTP error would carry
            yield text
    except Exception as e:  # whatever failed, the client gets an error event, not a silent close
        # The exception's text stays in the log: it may quote internals (or the client's own input).
        log.exception("a stream failed")
        on_error(type(e).__name__)
        for text in _error_events(APIError.from_domain(Internal("internal error")), typed):
            yield text
    finally:
        await payloads.aclose()
        await close()
    if typed is None:
        yield DONE
