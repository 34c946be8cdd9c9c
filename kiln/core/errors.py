"""One error type per gRPC status code. Stage logic raises these; servers map them to codes."""


class KilnError(Exception):
    code = "INTERNAL"


class InvalidArgument(KilnError):
    code = "INVALID_ARGUMENT"


class NotFound(KilnError):
    code = "NOT_FOUND"


class FailedPrecondition(KilnError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(KilnError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(KilnError):
    code = "UNAVAILABLE"


class DeadlineExceeded(KilnError):
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(KilnError):
    code = "UNAUTHENTICATED"


class DataLoss(KilnError):
    """A stored blob does not hash to its digest (truncated or corrupted)."""
    code = "DATA_LOSS"


BY_CODE = {c.code: c for c in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable,
                               DeadlineExceeded, Unauthenticated, DataLoss)}
