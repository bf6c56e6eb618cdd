"""Errors a caller gets back, each with a gRPC status code and a message that names the
field and the reason."""

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status


class RequestError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def status(self) -> grpc.Status:
        """The status to abort with: the code and message, plus any rich details."""
        return rpc_status.to_status(status_pb2.Status(code=self.code.value[0], message=self.message))


class InvalidArgument(RequestError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason

    def status(self) -> grpc.Status:
        """Also a google.rpc.BadRequest, so a client can read the field without parsing the
        message (grpc_status.rpc_status.from_call)."""
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.reason)]))
        return rpc_status.to_status(status_pb2.Status(
            code=code_pb2.INVALID_ARGUMENT, message=self.message, details=[detail]))


class ResourceExhausted(RequestError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RequestError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RequestError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(RequestError):
    code = grpc.StatusCode.NOT_FOUND
