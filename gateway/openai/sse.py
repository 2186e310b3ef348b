"""The server-sent events writer of streamed responses.

One event per JSON object (`data: <json>\\n\\n`) and `data: [DONE]\\n\\n` last. An error after the stream
began cannot change the HTTP status any more: it is sent as an event `data: {"error": {...}}` (OpenAI's
error shape), then [DONE], never as a silent close.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from gateway.openai.protocol import APIError
from specmesh.errors import Internal, SpecmeshError

DONE = "data: [DONE]\n\n"
log = logging.getLogger("specmesh.gateway")


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def error_event(error: APIError) -> str:
    return event(error.body())


async def event_stream(
    payloads: AsyncGenerator[dict, None], on_error: Callable[[str], None], close: Callable[[], Awaitable[None]]
) -> AsyncIterator[str]:
    """The events of `payloads`. `on_error(description)` hears of a failure before its error event;
    `close()` runs however the stream ends, also when the client goes away (the ASGI server then closes or
    cancels this generator): that is how work downstream stops."""
    try:
        async for payload in payloads:
            yield event(payload)
    except SpecmeshError as e:
        on_error(str(e))
        yield error_event(APIError.from_domain(e))  # the status and code an HTTP error body would carry
    except Exception as e:  # whatever failed, the client gets an error event, not a silent close
        # The exception's text stays in the log: it may quote internals (or the client's own input).
        log.exception("a stream failed")
        on_error(type(e).__name__)
        yield error_event(APIError.from_domain(Internal("internal error")))
    finally:
        await payloads.aclose()
        await close()
    yield DONE
