"""A REST request's body, as the generation routes read it: within a size, as JSON that Python can hold.

Whatever a client sends, the answer is in OpenAI's shape, never a 500. The size is enforced as the body
arrives: no more than the limit is ever kept, and a body declared (Content-Length) or found to be far past
it gets its 413 at once, its connection closed. A body only somewhat past the limit (up to DRAIN_BYTES) is
read to its end and dropped before the 413: most clients send their whole body before they read an answer,
and would otherwise see a broken pipe instead of the error; the connection then stays usable.

JSON that Python's parser cannot take (nested too deeply, an integer of thousands of digits, NaN or an
infinite number) is a 400, and so are strings that are not Unicode: a lone surrogate ("\\ud800") fails in
every tokenizer and JSON encoder, so the parameter that holds it is named before anything else sees it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

from gateway.core import shown
from gateway.openai.protocol import APIError

# Past the limit, at most this much more of a body is read (and dropped) to answer it cleanly.
DRAIN_BYTES = 4 << 20

# Bodies larger than this are parsed on the gateway's worker threads rather than on the event loop.
PARSE_OFF_LOOP_BYTES = 64 << 10
# Deeper JSON is refused: no request of this API nests more than a few levels.
MAX_JSON_DEPTH = 64


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {shown(text, 32)} is out of range")
    return value


def _invalid_json(reason: str) -> APIError:
    return APIError(400, f"the body is not valid JSON: {reason}", None, "invalid_json")


def _path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _check_json(body) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, and strings (keys included) that are not Unicode: a
    lone surrogate (JSON's "\\ud800") fails in the tokenizer and in every JSON encoder, so the parameter
    holding it is named now. Iterative, so no depth of nesting can exhaust the stack."""
    # (value, its parent's path, its key there, depth): a path is only spelled out for containers and for
    # the value refused, so a list of a hundred thousand numbers costs one isinstance each.
    stack: list[tuple[Any, str, str | int, int]] = [(body, "", "", 0)]
    while stack:
        value, parent, key, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    param = shown(_path(parent, key) or "body", 80).strip('"')
                    raise APIError(
                        400, f"'{param}' holds a lone surrogate: not valid Unicode", param, "invalid_value"
                    ) from None
            continue
        if depth >= MAX_JSON_DEPTH:
            raise APIError(400, f"the body nests more than {MAX_JSON_DEPTH} levels deep", None, "invalid_json")
        path = _path(parent, key) if key != "" else parent
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, parent, key, depth))  # a key is checked as part of its object
                if isinstance(v, (str, dict, list)):
                    stack.append((v, path, k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, path, i, depth + 1) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))


def parse_json(raw: bytes):
    """The body's JSON value; an OpenAI 400 whatever is wrong with it (and no exception's text but ours)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise APIError(400, f"the body nests more than {MAX_JSON_DEPTH} levels deep", None, "invalid_json") from None
    except UnicodeDecodeError:
        raise _invalid_json("it is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise _invalid_json(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:
        # Python refuses integers of more than 4300 digits; _no_constant and _finite say what they refused.
        reason = str(e) if str(e).startswith(("the number", "NaN", "Infinity", "-Infinity")) else "a number is too long"
        raise _invalid_json(reason) from None
    _check_json(body)
    return body


def too_large(limit: int, close: bool) -> APIError:
    """The 413; `close`: the rest of the body is left unread, so the connection cannot carry another request."""
    return APIError(413, f"request body larger than {limit} bytes", None, "body_too_large", close=close)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, if it is at most `limit` bytes; else a 413 as soon as that is known."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit + DRAIN_BYTES):
        raise too_large(limit, close=True)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size <= limit:
            parts.append(part)
        elif size > limit + DRAIN_BYTES:
            raise too_large(limit, close=True)
    if size > limit:
        raise too_large(limit, close=False)
    return b"".join(parts)


async def read_json_object(request: Request, limit: int, off_loop: Callable[..., Awaitable[Any]] | None = None) -> dict:
    """The body's JSON object (`read_body`, `parse_json`); a large one is parsed by `off_loop(fn, arg)`."""
    raw = await read_body(request, limit)
    body = (
        await off_loop(parse_json, raw) if off_loop is not None and len(raw) > PARSE_OFF_LOOP_BYTES else parse_json(raw)
    )
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    return body
