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
    status = 501
    title = "Not implemented"
    type = "https://ftd.dev/problems/not-implemented"


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


class StartupError(Exception):
    """The daemon cannot start (its run directory is unsafe, its secret is unusable): one line
    saying why, exit 2, nothing started."""
