"""Errors raised by compute and codec code, each carrying the gRPC status it maps to.

Compute modules raise these without importing grpc; the servicers turn them into status codes
(`shared.rpc_errors`). Messages name the offending field and the limit.
"""


class ServiceError(Exception):
    """Base class; `code` is the name of a grpc.StatusCode member."""

    code = "INTERNAL"


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class DataLoss(ServiceError):
    code = "DATA_LOSS"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(ServiceError):
    code = "CANCELLED"


class UpstreamError(ServiceError):
    """An error status returned by the producer, passed on with the same code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
