"""Domain errors, raised by code that knows nothing of transports; each front maps them to its status
(gRPC code, HTTP status). The message says what was wrong and is shown to the caller as is."""


class SpecmeshError(Exception):
    """Base class; `code` is the gRPC status name, `http_status` the REST one."""

    code = "INTERNAL"
    http_status = 500


class InvalidArgument(SpecmeshError, ValueError):
    code, http_status = "INVALID_ARGUMENT", 400


class NotFound(SpecmeshError):
    code, http_status = "NOT_FOUND", 404


class FailedPrecondition(SpecmeshError):
    code, http_status = "FAILED_PRECONDITION", 409


class ResourceExhausted(SpecmeshError):
    code, http_status = "RESOURCE_EXHAUSTED", 429


class Unavailable(SpecmeshError):
    code, http_status = "UNAVAILABLE", 503
