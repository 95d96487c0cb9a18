"""What can go wrong talking to etcd, as exceptions that carry what the caller needs to act."""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import aiohttp


class GrpcCode(IntEnum):
    """The gRPC status codes etcd's gateway puts in its error bodies (`code`)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


def clip(text: str, limit: int = 300) -> str:
    """A string from the network made fit for a message: printable, one line, bounded."""
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text[: limit + 1])
    return cleaned if len(cleaned) <= limit else cleaned[:limit] + "..."


class EtcdError(Exception):
    """etcd refused a request (`code` is its gRPC code), or an endpoint's answer was not one
    etcd gives. `endpoint` is the member that said so, where one did."""

    def __init__(
        self, message: str, *, code: int | None = None, endpoint: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.endpoint = endpoint


class EtcdBadAnswer(EtcdError):
    """An endpoint answered something that is not etcd's answer: not JSON, the wrong shape,
    values out of bounds, too large, or compressed. Check that the endpoint is an etcd member."""


class EtcdAuthError(EtcdError):
    """Wrong user name or password, no credentials where etcd has auth enabled, or a user
    without the permission for the key."""


class EtcdCompacted(EtcdError):
    """A watch asked for revisions etcd has compacted away: read the current state again and
    watch from `compact_revision`."""

    def __init__(self, message: str, *, compact_revision: int, endpoint: str | None) -> None:
        super().__init__(message, code=GrpcCode.OUT_OF_RANGE, endpoint=endpoint)
        self.compact_revision = compact_revision


class EtcdUnavailable(EtcdError):
    """No member answered in time. `endpoints` are those tried, `reasons` what each did.
    `maybe_applied` is true when a change was sent and its answer lost: it may have been
    applied, so read before trying it again."""

    def __init__(
        self,
        message: str,
        *,
        endpoints: Sequence[str],
        reasons: Sequence[str],
        maybe_applied: bool = False,
    ) -> None:
        tried = "; ".join(f"{ep}: {why}" for ep, why in zip(endpoints, reasons, strict=True))
        super().__init__(f"{message} ({tried})" if tried else message, code=GrpcCode.UNAVAILABLE)
        self.endpoints = tuple(endpoints)
        self.reasons = tuple(reasons)
        self.maybe_applied = maybe_applied


def lease_gone(error: EtcdError) -> bool:
    """etcd refused a request because the lease it names is no more (expired, revoked)."""
    return error.code == GrpcCode.NOT_FOUND and "lease not found" in error.message


class AttemptFailed(Exception):
    """One endpoint did not give an answer. `sent`: the request may have reached etcd (so a
    change may have been applied); `bad_answer`: what came back was not etcd's."""

    def __init__(self, reason: str, *, sent: bool, bad_answer: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.sent = sent
        self.bad_answer = bad_answer


class TokenExpired(Exception):
    pass


def refusal(endpoint: str, code: int, message: str) -> Exception:
    """What etcd's error means for the caller: an AttemptFailed (another member may do
    better), TokenExpired, or an EtcdError to raise."""
    text = clip(message)
    if code == GrpcCode.UNAUTHENTICATED and "invalid auth token" in message:
        return TokenExpired(text)
    if any(mark in message for mark in ("no leader", "too many requests")):
        return AttemptFailed(f"etcd: {text}", sent=False)
    if code in (GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED) or any(
        mark in message for mark in ("deadline exceeded", "timed out", "leader changed")
    ):
        return AttemptFailed(f"etcd: {text}", sent=True)
    auth_failures = ("authentication failed", "user name is empty", "permission denied")
    if code == GrpcCode.PERMISSION_DENIED or any(mark in message for mark in auth_failures):
        return EtcdAuthError(f"etcd refused the credentials: {text}", code=code, endpoint=endpoint)
    return EtcdError(f"etcd: {text}", code=code, endpoint=endpoint)


def describe(error: BaseException) -> str:
    if isinstance(error, aiohttp.ClientConnectorError):
        return f"cannot connect: {error.os_error.strerror or error.os_error}"
    return clip(str(error) or type(error).__name__)
