"""Domain errors, raised by code that knows nothing of transports, and the one table that maps them to
every front's status: the gRPC code, the HTTP status and the OpenAI error `code`.

The message says what was wrong and is shown to the caller as is. A downstream gRPC status comes back
into the domain through `from_grpc_code`, so an error keeps its meaning across every hop.
"""

from __future__ import annotations


class SpecmeshError(Exception):
    """Base class; `code` is the gRPC status name, `http_status` the REST one, `openai_code` the OpenAI
    error code (None where OpenAI's API has none). `retryable`: a caller may try again elsewhere or later."""

    code = "INTERNAL"
    http_status = 500
    openai_code: str | None = "internal_error"
    retryable = False


class InvalidArgument(SpecmeshError, ValueError):
    code, http_status = "INVALID_ARGUMENT", 400
    openai_code: str | None = None  # declared as the base's: a subclass may name one (gateway.core.BadInput)


class OutOfRange(InvalidArgument):
    code, http_status, openai_code = "OUT_OF_RANGE", 400, None


class Unauthenticated(SpecmeshError):
    code, http_status, openai_code = "UNAUTHENTICATED", 401, "invalid_api_key"


class PermissionDenied(SpecmeshError):
    code, http_status, openai_code = "PERMISSION_DENIED", 403, "permission_denied"


class NotFound(SpecmeshError):
    code, http_status, openai_code = "NOT_FOUND", 404, "not_found"


class FailedPrecondition(SpecmeshError):
    code, http_status, openai_code = "FAILED_PRECONDITION", 409, None


class Aborted(SpecmeshError):
    """The work was taken over by a newer request (a session's stream superseded by its next turn)."""

    code, http_status, openai_code, retryable = "ABORTED", 409, None, True


class ResourceExhausted(SpecmeshError):
    code, http_status, openai_code, retryable = "RESOURCE_EXHAUSTED", 429, "rate_limit_exceeded", True


class DeadlineExceeded(SpecmeshError):
    code, http_status, openai_code, retryable = "DEADLINE_EXCEEDED", 504, "timeout", True


class Unavailable(SpecmeshError):
    code, http_status, openai_code, retryable = "UNAVAILABLE", 503, "service_unavailable", True


class Internal(SpecmeshError):
    retryable = True


# gRPC code name -> domain error class: the one status map (HTTP statuses hang off the classes).
BY_GRPC_CODE: dict[str, type[SpecmeshError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        OutOfRange,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        FailedPrecondition,
        Aborted,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Internal,
    )
}
# A caller's mistake: retrying it anywhere gives the same answer.
CALLER_ERRORS = frozenset(c.code for c in BY_GRPC_CODE.values() if 400 <= c.http_status < 500 and not c.retryable)


def from_grpc_code(code_name: str, details: str = "") -> SpecmeshError:
    """The domain error for a downstream gRPC status (by name, e.g. "NOT_FOUND"); unknown codes are internal."""
    return BY_GRPC_CODE.get(code_name, Internal)(details or code_name)


def grpc_code_name(exc: BaseException) -> str:
    """The gRPC status name an exception is answered with: its own for a domain error, INTERNAL otherwise."""
    return exc.code if isinstance(exc, SpecmeshError) else "INTERNAL"


class ConfigError(ValueError):
    """Settings that cannot work together, found only once a service knows its model (a KV budget too small
    for its context): the service exits 2 with the message, as for a bad flag. Not a request's error."""
