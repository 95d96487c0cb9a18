"""Domain errors: each carries what happened and maps 1:1 to an HTTP problem response."""

from __future__ import annotations


class FtdError(Exception):
    """Base: `status` is the HTTP status, `title` a short fixed summary, `detail` the specifics
    (what to do about it, where there is something to do)."""

    status = 400
    title = "Bad request"
    type = "about:blank"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def headers(self) -> dict[str, str]:
        """Response headers the problem needs besides its body."""
        return {}

    def to_problem(self) -> dict[str, object]:
        return {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }


class InvalidRequest(FtdError):
    status = 400
    title = "Invalid request"
    type = "https://ftd.dev/problems/invalid-request"


class Forbidden(FtdError):
    status = 403
    title = "Forbidden"
    type = "https://ftd.dev/problems/forbidden"


class NotFound(FtdError):
    status = 404
    title = "Not found"
    type = "https://ftd.dev/problems/not-found"


class Conflict(FtdError):
    status = 409
    title = "Conflict with the daemon's state"
    type = "https://ftd.dev/problems/conflict"


class FeatureUnavailable(FtdError):
    """What was asked exists, but not in the mode this daemon runs in (node exclusion on a
    single node, say): a conflict with its configuration, not a server error."""

    status = 409
    title = "Not available in this mode"
    type = "https://ftd.dev/problems/unavailable-in-this-mode"


class RequestTimeout(FtdError):
    status = 408
    title = "Request timeout"
    type = "https://ftd.dev/problems/request-timeout"


class Misdirected(FtdError):
    status = 421
    title = "Misdirected request"
    type = "https://ftd.dev/problems/misdirected"


class TooManyRequests(FtdError):
    status = 429
    title = "Too many requests"
    type = "https://ftd.dev/problems/too-many-requests"

    def __init__(self, detail: str, retry_after_s: int) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class StartupError(Exception):
    """The daemon cannot start (its run directory is unsafe, its secret is unusable): one line
    saying why, exit 2, nothing started."""


class ApiStartupError(StartupError):
    """The API cannot start (its explicitly requested port is taken, its token is unusable):
    the daemon reports it on one line and exits 2 before starting any rank."""


def format_validation_error(error: object) -> str:
    """One line per problem, each naming the field: `nproc_per_node: must be >= 1`."""
    from pydantic import ValidationError

    assert isinstance(error, ValidationError)
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{field}: {message}" if field else message)
    return "; ".join(problems)
