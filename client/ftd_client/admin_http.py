"""The admin client's HTTP plumbing and errors: the admin socket's connection (served by this
very user, or refused), server-sent events, the daemon's problem+json answers."""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

from ftd_client.discovery import DaemonEntry, peer_credentials

MAX_SSE_LINE = 16 * 1024 * 1024


class AdminError(Exception):
    """Base of the client's errors; `str()` is a one-line message for a terminal."""


class ApiUnreachable(AdminError):
    """No daemon answered at the address (not running, wrong address, connection cut)."""


class DaemonNotFound(AdminError):
    """No running daemon where the client looked (a run directory, this user's registry)."""


class AmbiguousDaemon(AdminError):
    """This user runs several daemons: the caller must say which (`entries`)."""

    def __init__(self, message: str, entries: list[DaemonEntry]) -> None:
        super().__init__(message)
        self.entries = entries


class ApiError(AdminError):
    """The daemon answered with an error (a problem+json body)."""

    def __init__(self, status: int, title: str, detail: str, body: dict[str, Any]) -> None:
        super().__init__(f"{status} {title}: {detail}" if detail else f"{status} {title}")
        self.status = status
        self.title = title
        self.detail = detail
        self.body = body


class UnixConnection(http.client.HTTPConnection):
    """HTTP over the daemon's admin socket, which must be served by this very user."""

    def __init__(self, path: str, timeout_s: float | None) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
            _pid, uid, _gid = peer_credentials(sock)
            if uid != os.geteuid():
                raise AdminError(
                    f"{self._path} is served by uid {uid}, not by this user "
                    f"(uid {os.geteuid()}): refusing to talk to it"
                )
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def sse_messages(response: http.client.HTTPResponse) -> Iterator[tuple[str, str]]:
    """(event name, data) of each server-sent message; comments and ids skipped."""
    kind, data = "message", list[str]()
    while raw := response.readline(MAX_SSE_LINE):
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield kind, "\n".join(data)
            kind, data = "message", []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            kind = line[6:].strip()


def quote_node(node_id: str) -> str:
    return urllib.parse.quote(node_id, safe="")


def api_error(status: int, reason: str, raw: bytes) -> ApiError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"title": reason, "detail": raw.decode(errors="replace")[:200]}
    if status == 503 and "ready" in body:  # /readyz: not an error body
        return ApiError(503, "Not ready", f"state {body.get('state')}", body)
    return ApiError(status, str(body.get("title", reason)), str(body.get("detail", "")), body)
