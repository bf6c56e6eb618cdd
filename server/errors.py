"""Errors a caller gets back, each with a gRPC status code and a message that names the
field and the reason."""

import grpc


class RequestError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(RequestError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")


class ResourceExhausted(RequestError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RequestError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RequestError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(RequestError):
    code = grpc.StatusCode.NOT_FOUND
