"""Errors a caller gets back, protocol-neutral: a code, a message that names the field
and the reason, and the field itself where one is to blame. Each door renders them in
its own protocol (a gRPC status with rich details, an HTTP status and JSON body); the
code names are gRPC's, which the metrics' `code` label carries for every door."""

import enum

Code = enum.Enum("Code", "INVALID_ARGUMENT NOT_FOUND RESOURCE_EXHAUSTED UNAUTHENTICATED UNAVAILABLE "
                         "DEADLINE_EXCEEDED INTERNAL")


class RequestError(Exception):
    code = Code.INTERNAL
    field: str | None = None
    """the request field to blame, in the door's own names, or None"""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(RequestError):
    code = Code.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class NotFound(RequestError):
    code = Code.NOT_FOUND

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ResourceExhausted(RequestError):
    code = Code.RESOURCE_EXHAUSTED


class RetryLater(ResourceExhausted):
    """A refusal that says how many seconds to wait before trying again (HTTP Retry-After,
    gRPC `retry-after` metadata)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooLarge(ResourceExhausted):
    """A request too big for any server setting to serve as it is: retrying the same
    request is pointless (HTTP 413, not 429)."""


class Unauthenticated(RequestError):
    code = Code.UNAUTHENTICATED


class Unavailable(RequestError):
    code = Code.UNAVAILABLE


class DeadlineExceeded(RequestError):
    code = Code.DEADLINE_EXCEEDED


# Caller input quoted in a message is cut to this many characters: a gRPC status travels
# in trailers that clients cap at 8 KiB, and a message is for a person to read.
QUOTE_CHARS = 64


def quote(value: object) -> str:
    """`value` as Python's repr, cut to QUOTE_CHARS characters with the length said."""
    text = repr(value)
    if len(text) <= QUOTE_CHARS:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:QUOTE_CHARS]}… ({size})"
