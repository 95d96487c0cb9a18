"""AdminClient: the ftd REST API for Python scripts (standard library only, synchronous).

    from ftd_client.admin import AdminClient
    client = AdminClient.from_run_dir("/logs/my-job")     # reads api.json and the token file
    print(client.status()["state"])
    client.restart(reason="bad data shard", count=False)
    for event in client.follow_events():                   # server-sent events
        print(event["kind"])

Errors are `ApiError` (the daemon's problem+json answer: status, title, detail) or
`ApiUnreachable` (no daemon at the URL).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Generator
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:29610"
TOKEN_ENV = "FTD_API_TOKEN"
URL_ENV = "FTD_API_URL"
API_FILE = "api.json"


class AdminError(Exception):
    """Base of the client's errors; `str()` is a one-line message for a terminal."""


class ApiUnreachable(AdminError):
    """No daemon answered at the URL (not running, wrong address, api.json stale)."""


class ApiError(AdminError):
    """The daemon answered with an error (a problem+json body)."""

    def __init__(self, status: int, title: str, detail: str, body: dict[str, Any]) -> None:
        super().__init__(f"{status} {title}: {detail}" if detail else f"{status} {title}")
        self.status = status
        self.title = title
        self.detail = detail
        self.body = body


def read_api_file(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The `<run dir>/api.json` a running daemon wrote (url, host, port, pid, token_file)."""
    path = Path(run_dir) / API_FILE
    try:
        info: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdminError(f"no {path}: is `ftd serve` running with this run directory?") from None
    except (OSError, ValueError) as error:
        raise AdminError(f"cannot read {path}: {error}") from None
    return info


def read_token_file(path: str | os.PathLike[str]) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as error:
        raise AdminError(f"cannot read the token file {path}: {error.strerror}") from None


class AdminClient:
    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    @classmethod
    def from_env(
        cls,
        url: str | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout_s: float = 10.0,
    ) -> AdminClient:
        """URL: `url`, else the run directory's api.json, else FTD_API_URL, else the default.
        Token: `token_file`, else FTD_API_TOKEN, else the token file named in api.json."""
        info = read_api_file(run_dir) if run_dir is not None else {}
        resolved_url = url or info.get("url") or os.environ.get(URL_ENV) or DEFAULT_URL
        token: str | None = None
        if token_file is not None:
            token = read_token_file(token_file)
        elif os.environ.get(TOKEN_ENV, "").strip():
            token = os.environ[TOKEN_ENV].strip()
        elif info.get("token_file"):
            token = read_token_file(info["token_file"])
        return cls(str(resolved_url), token, timeout_s)

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
        return self._json("POST", f"/v1/nodes/{_quote(node_id)}/exclude", {"reason": reason})

    def readmit(self, node_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/nodes/{_quote(node_id)}/exclude")

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
        ends when the daemon stops."""
        if since is None:
            since = int(self.events(limit=1)["last_id"])
        request = self._request("GET", f"/v1/events?since={since}", None)
        request.add_header("Accept", "text/event-stream")
        with self._open(request, timeout_s=None) as response:
            data: list[str] = []
            for raw in response:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line:
                    if data:
                        event: dict[str, Any] = json.loads("\n".join(data))
                        yield event
                    data = []
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))

    def metrics(self) -> str:
        with self._open(self._request("GET", "/metrics", None)) as response:
            text: str = response.read().decode()
            return text

    # -- transport ----------------------------------------------------------------------------

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> urllib.request.Request:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return urllib.request.Request(self.url + path, data, headers, method=method)

    def _open(self, request: urllib.request.Request, timeout_s: float | None = -1.0) -> Any:
        timeout = self.timeout_s if timeout_s == -1.0 else timeout_s
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as error:
            raise _api_error(error) from None
        except (TimeoutError, urllib.error.URLError, ConnectionError) as error:
            reason = getattr(error, "reason", error)
            raise ApiUnreachable(f"no ftd daemon answers at {self.url}: {reason}") from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        with self._open(self._request(method, path, body)) as response:
            result: dict[str, Any] = json.loads(response.read() or b"{}")
            return result


def _quote(node_id: str) -> str:
    return urllib.parse.quote(node_id, safe="")


def _api_error(error: urllib.error.HTTPError) -> ApiError:
    raw = error.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"title": error.reason, "detail": raw.decode(errors="replace")[:200]}
    if error.code == 503 and "ready" in body:  # /readyz: not an error body
        return ApiError(503, "Not ready", f"state {body.get('state')}", body)
    return ApiError(
        error.code, str(body.get("title", error.reason)), str(body.get("detail", "")), body
    )
