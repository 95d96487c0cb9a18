"""AdminClient: the ftd REST API for Python scripts (standard library only, synchronous).

    from ftd_client.admin import AdminClient
    client = AdminClient.from_run_dir("/logs/my-job")     # the daemon's admin socket
    print(client.status()["state"])
    print(client.rank_stderr(1))                           # privileged: socket or token
    client.restart(reason="bad data shard", count=False)
    for event in client.follow_events():                   # server-sent events
        print(event["kind"])

Where the daemon is (`from_env`): an explicit URL (TCP, with a bearer token); else a run
directory, whose daemon is reached over its admin unix socket (`api.sock`: no token, the
daemon checks that the caller is its own user and the client checks the daemon is too); else
the one daemon this user runs (the registry in `ftd_client.discovery`). A token is only ever
sent to a URL the caller named or that the daemon itself recorded in its run directory, never
to a guessed default address.

Errors are `ApiError` (the daemon's problem+json answer: status, title, detail),
`ApiUnreachable` (nothing answers), `DaemonNotFound` and `AmbiguousDaemon`.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.parse
from collections.abc import Generator
from pathlib import Path
from typing import Any

from ftd_client.admin_http import (
    AdminError,
    AmbiguousDaemon,
    ApiError,
    ApiUnreachable,
    DaemonNotFound,
    UnixConnection,
    api_error,
    quote_node,
    sse_messages,
)
from ftd_client.discovery import (
    NO_ACCESS_BY_OTHERS,
    NO_WRITE_BY_OTHERS,
    UnsafeFile,
    process_start_time,
    read_checked,
    registry_dir,
    running_daemons,
)

__all__ = [
    "AdminClient",
    "AdminError",
    "AmbiguousDaemon",
    "ApiError",
    "ApiUnreachable",
    "DaemonNotFound",
    "read_api_file",
    "read_token_file",
]

TOKEN_ENV = "FTD_API_TOKEN"
URL_ENV = "FTD_API_URL"
API_FILE = "api.json"
STREAM_IDLE_TIMEOUT_S = 60.0
"""An event stream silent for this long (the daemon sends a keep-alive every 15 s) is dead."""
MAX_ERROR_BODY = 64 * 1024


def read_api_file(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The `<run dir>/api.json` of the daemon running there (url, socket, pid, token_file):
    DaemonNotFound when there is none or its daemon is gone; AdminError when the file is not
    this user's own."""
    path = Path(run_dir) / API_FILE
    try:
        info = json.loads(read_checked(path, NO_WRITE_BY_OTHERS))
    except FileNotFoundError:
        raise DaemonNotFound(f"no {path}: no ftd daemon with its API runs on {run_dir}") from None
    except UnsafeFile as error:
        raise AdminError(str(error)) from None
    except (OSError, ValueError) as error:
        raise AdminError(f"cannot read {path}: {error}") from None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        raise AdminError(f"{path} is not an ftd API record")
    started = process_start_time(info["pid"])
    if started is None or info.get("started", started) != started:
        raise DaemonNotFound(
            f"the daemon that wrote {path} (pid {info['pid']}) is no longer running"
        )
    return info


def read_token_file(path: str | os.PathLike[str]) -> str:
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise AdminError(f"cannot read the token file {path}: {reason}") from None


def _recorded_token(path: object) -> str | None:
    """The token file api.json names, read only if it is this user's private file."""
    if not isinstance(path, str) or not path:
        return None
    try:
        return read_checked(path, NO_ACCESS_BY_OTHERS).strip() or None
    except (OSError, UnsafeFile) as error:
        raise AdminError(f"cannot use the token file {path}: {error}") from None


def _env_token() -> str | None:
    return os.environ.get(TOKEN_ENV, "").strip() or None


class AdminClient:
    """The API of one daemon, over TCP (`url`, with `token`) or its admin unix socket
    (`socket_path`, no token)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        *,
        socket_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if (url is None) == (socket_path is None):
            raise ValueError("AdminClient needs exactly one of url and socket_path")
        self.socket_path = None if socket_path is None else os.fspath(socket_path)
        self.url = url.rstrip("/") if url is not None else f"unix:{self.socket_path}"
        self.token = token if url is not None else None
        self.timeout_s = timeout_s

    @classmethod
    def from_env(
        cls,
        url: str | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout_s: float = 10.0,
    ) -> AdminClient:
        """`url` (else FTD_API_URL when no `run_dir`): TCP, token from `token_file`, else
        FTD_API_TOKEN, else the token file `run_dir`'s api.json names. `run_dir`: its
        daemon's admin socket (its recorded URL and token where it has none). Neither: the
        one daemon this user runs (DaemonNotFound for none, AmbiguousDaemon for several)."""
        if url is None and run_dir is None:
            url = os.environ.get(URL_ENV, "").strip() or None
        if url is not None:
            token = read_token_file(token_file) if token_file is not None else _env_token()
            if token is None and run_dir is not None:
                token = _recorded_token(read_api_file(run_dir).get("token_file"))
            return cls(url, token, timeout_s)
        if run_dir is None:
            run_dir = cls._only_daemon()
        info = read_api_file(run_dir)
        sock = info.get("socket")
        if isinstance(sock, str) and Path(sock).is_socket():
            return cls(socket_path=sock, timeout_s=timeout_s)
        recorded = info.get("url")
        if not isinstance(recorded, str) or not recorded.startswith(("http://", "https://")):
            raise AdminError(f"{Path(run_dir) / API_FILE} records neither a socket nor a URL")
        if token_file is not None:
            token = read_token_file(token_file)
        else:
            token = _env_token() or _recorded_token(info.get("token_file"))
        return cls(recorded, token, timeout_s)

    @staticmethod
    def _only_daemon() -> str:
        directory = registry_dir()
        try:
            entries = running_daemons(directory)
        except UnsafeFile as error:
            raise AdminError(f"the daemon registry is not safe to read: {error}") from None
        except OSError as error:
            raise AdminError(f"cannot read the daemon registry {directory}: {error}") from None
        if not entries:
            raise DaemonNotFound(
                f"no running ftd daemon of this user (uid {os.geteuid()}) is registered in "
                f"{directory}: pass --run-dir or --url"
            )
        if len(entries) > 1:
            listed = "; ".join(entry.describe() for entry in entries)
            raise AmbiguousDaemon(
                f"{len(entries)} ftd daemons of this user run: pass --run-dir, one of: {listed}",
                entries,
            )
        return entries[0].run_dir

    @classmethod
    def from_run_dir(
        cls, run_dir: str | os.PathLike[str], token_file: str | os.PathLike[str] | None = None
    ) -> AdminClient:
        return cls.from_env(run_dir=run_dir, token_file=token_file)

    # -- operations ---------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz")

    def ready(self) -> bool:
        try:
            return bool(self._json("GET", "/readyz")["ready"])
        except ApiError as error:
            if error.status == 503:
                return False
            raise

    def status(self) -> dict[str, Any]:
        return self._json("GET", "/v1/status")

    def cluster(self) -> dict[str, Any]:
        return self._json("GET", "/v1/cluster")

    def restart(
        self, reason: str = "operator request", scope: str = "cluster", count: bool = True
    ) -> dict[str, Any]:
        """Force a restart; the `restart_requested` event (`event_id`, `event`)."""
        return self._json("POST", "/v1/restart", {"scope": scope, "reason": reason, "count": count})

    def exclude(self, node_id: str, reason: str = "operator request") -> dict[str, Any]:
        return self._json("POST", f"/v1/nodes/{quote_node(node_id)}/exclude", {"reason": reason})

    def readmit(self, node_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/nodes/{quote_node(node_id)}/exclude")

    def timeouts(self) -> dict[str, Any]:
        return self._json("GET", "/v1/timeouts")

    def set_timeouts(self, **changes: Any) -> dict[str, Any]:
        return self._json("PATCH", "/v1/timeouts", changes)

    def events(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        """`{"events": [...], "last_id": N}`: events with an id above `since`."""
        query = {"since": str(since)} | ({"limit": str(limit)} if limit else {})
        return self._json("GET", "/v1/events?" + urllib.parse.urlencode(query))

    def follow_events(self, since: int | None = None) -> Generator[dict[str, Any], None, None]:
        """Events as they happen (server-sent events), from `since` (default: from now on);
        ends when the daemon stops. When the daemon drops the stream because this reader
        fell behind, it reconnects after the last event it got (the ring still holds them)."""
        cursor = int(self.events(limit=1)["last_id"]) if since is None else since
        while True:
            connection, response = self._send(
                "GET",
                f"/v1/events?since={cursor}",
                None,
                accept="text/event-stream",
                timeout_s=STREAM_IDLE_TIMEOUT_S,
            )
            dropped = False
            try:
                for kind, data in sse_messages(response):
                    if kind == "stream_dropped":
                        dropped = True
                        break
                    event = json.loads(data)
                    if not isinstance(event, dict) or not isinstance(event.get("id"), int):
                        raise AdminError(f"the event stream sent a malformed event: {data[:200]}")
                    cursor = event["id"]
                    yield event
            except (OSError, http.client.HTTPException, ValueError) as error:
                raise ApiUnreachable(f"the event stream from {self.url} broke: {error}") from None
            finally:
                connection.close()
            if not dropped:
                return

    def metrics(self) -> str:
        return self._text("/metrics")

    def rank_stacks(self, global_rank: int, attempt: int | None = None) -> str:
        """The Python stacks a rank of this node wrote (its stacks.txt, escaped text) in
        `attempt` (default the current one). A privileged read, like `rank_stderr`: over TCP
        it needs the token (ApiError 401 without one); the admin socket needs none."""
        return self._text(f"/v1/ranks/{int(global_rank)}/stacks", attempt=attempt)

    def rank_stderr(
        self, global_rank: int, attempt: int | None = None, tail_bytes: int | None = None
    ) -> str:
        """The end of a rank's stderr.log (`tail_bytes`, default 16 KiB, at most 64 KiB), escaped
        text; what the job printed may hold its secrets, hence the token (see `rank_stacks`)."""
        path = f"/v1/ranks/{int(global_rank)}/stderr"
        return self._text(path, attempt=attempt, tail_bytes=tail_bytes)

    # -- transport ----------------------------------------------------------------------------

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self.socket_path is not None:
            return UnixConnection(self.socket_path, timeout_s)
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AdminError(f"not an http(s) URL: {self.url}")
        kind: type[http.client.HTTPConnection] = http.client.HTTPConnection
        if parts.scheme == "https":
            kind = http.client.HTTPSConnection
        try:
            port = parts.port
        except ValueError:
            raise AdminError(f"bad port in {self.url}") from None
        return kind(parts.hostname, port, timeout=timeout_s)

    def _send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        accept: str = "application/json",
        timeout_s: float | None = None,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The open connection and the response's head (2xx/3xx); ApiError for an error
        answer, ApiUnreachable when nothing answers."""
        headers = {"Accept": accept}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        prefix = "" if self.socket_path else urllib.parse.urlsplit(self.url).path.rstrip("/")
        connection = self._connection(self.timeout_s if timeout_s is None else timeout_s)
        try:
            connection.request(method, prefix + path, body=data, headers=headers)
            response = connection.getresponse()
            if response.status >= 400:
                raw = response.read(MAX_ERROR_BODY)
                raise api_error(response.status, response.reason, raw)
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            reason = getattr(error, "strerror", None) or error
            raise ApiUnreachable(f"no ftd daemon answers at {self.url}: {reason}") from None
        except BaseException:
            connection.close()
            raise
        return connection, response

    def _text(self, path: str, **query: int | None) -> str:
        given = {name: str(int(value)) for name, value in query.items() if value is not None}
        if given:
            path += "?" + urllib.parse.urlencode(given)
        connection, response = self._send("GET", path, None, accept="text/plain")
        try:
            return response.read().decode()
        except (OSError, http.client.HTTPException) as error:
            raise ApiUnreachable(f"{self.url} stopped answering: {error}") from None
        finally:
            connection.close()

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        connection, response = self._send(method, path, body)
        try:
            raw = response.read()
        except (OSError, http.client.HTTPException) as error:
            raise ApiUnreachable(f"{self.url} stopped answering: {error}") from None
        finally:
            connection.close()
        try:
            result = json.loads(raw or b"{}")
        except ValueError:
            raise AdminError(f"{self.url} answered {method} {path} with no JSON") from None
        if not isinstance(result, dict):
            raise AdminError(f"{self.url} answered {method} {path} with no JSON object")
        return result
