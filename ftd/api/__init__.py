"""The REST control API of a node daemon: lifecycle of the aiohttp server (bind, token, api.json).

The routes, middlewares and request models are in `ftd.api.app`; the contract is
`openapi.yaml` at the repository root, and the tests hold the server to it.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import secrets
import stat
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ftd.api.app import CLOSING, build_app
from ftd.config import DEFAULT_API_PORT
from ftd.control import DaemonControl

log = logging.getLogger("ftd.api")

TOKEN_ENV = "FTD_API_TOKEN"
API_FILE = "api.json"
TOKEN_FILE = "api.token"
SHUTDOWN_TIMEOUT_S = 2.0


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request its HTTP parser rejects (answered 400) with a traceback; a
    client's malformed bytes are worth one warning line, not a stack."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg = f"{record.msg}: malformed HTTP request ({error.message})"
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


http_log = logging.getLogger("ftd.api.http")
http_log.addFilter(_MalformedRequests())


class ApiStartupError(Exception):
    """The API cannot start (its explicitly requested port is taken, its token file cannot be
    read): the daemon reports it on one line and exits 2 before starting any rank."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_token(path: Path) -> str:
    """FTD_API_TOKEN, else the token in `path`, created with a random token and mode 0600 when
    it does not exist."""
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as error:
        raise ApiStartupError(f"cannot create the API token file {path}: {error}") from None
    else:
        token = secrets.token_urlsafe(32)
        with os.fdopen(fd, "w") as file:
            file.write(token + "\n")
        log.info("created the API token file %s", path)
        return token
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as error:
        raise ApiStartupError(f"cannot read the API token file {path}: {error}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the API token file %s is readable by others: chmod 600 it", path)
    if not token:
        raise ApiStartupError(f"the API token file {path} is empty: delete it or put a token in it")
    return token


def _absolute(path: Path) -> str:
    return os.path.abspath(path)


def _client_url(host: str, port: int) -> str:
    """The URL a client on this machine uses (wildcard binds are reached over loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ApiServer:
    """A started API: `url`, `port`; `await close()` ends open event streams and stops it."""

    def __init__(self, runner: web.AppRunner, url: str, port: int, info_path: Path) -> None:
        self._runner = runner
        self.url = url
        self.port = port
        self._info_path = info_path

    async def close(self) -> None:
        self._runner.app[CLOSING].set()
        try:
            await self._runner.cleanup()
        finally:
            self._info_path.unlink(missing_ok=True)


async def start_api_server(control: DaemonControl) -> ApiServer:
    """Bind the API (the default port falls back to a free one when taken; an explicitly
    requested port that is taken raises ApiStartupError), write `<run dir>/api.json`."""
    config = control.config
    assert config.api_port is not None
    token_file = config.api_token_file or control.run_dir / TOKEN_FILE
    token = load_token(token_file)
    from_env = bool(os.environ.get(TOKEN_ENV, "").strip())
    app = build_app(control, token, reads_need_token=not is_loopback(config.api_host))
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logger=http_log,
    )
    await runner.setup()
    try:
        port = await _bind(runner, config.api_host, config.api_port)
    except BaseException:
        await runner.cleanup()
        raise
    url = _client_url(config.api_host, port)
    info = {
        "url": url,
        "host": config.api_host,
        "port": port,
        "pid": os.getpid(),
        "node_id": config.node_id,
        "run_id": config.run_id,
        "token_file": None if from_env else _absolute(token_file),
    }
    info_path = _publish(control.run_dir / API_FILE, info)
    log.info(
        "API listening on %s (token %s)",
        url,
        "from $FTD_API_TOKEN" if from_env else f"in {token_file}",
    )
    return ApiServer(runner, url, port, info_path)


def _publish(path: Path, info: dict[str, object]) -> Path:
    """Write api.json atomically: readers never see half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    tmp.replace(path)
    return path


async def _bind(runner: web.AppRunner, host: str, port: int) -> int:
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as error:
        await site.stop()  # unregisters the site that did not start
        if error.errno != errno.EADDRINUSE:
            raise ApiStartupError(f"--api-host {host} --api-port {port}: {error}") from None
        if port != DEFAULT_API_PORT:
            raise ApiStartupError(
                f"--api-port {port} is already in use on {host}: choose another port, "
                "or 0 for a free one"
            ) from None
        log.warning("API port %d is in use on %s: using a free port instead", port, host)
        return await _bind(runner, host, 0)
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    raise ApiStartupError(f"the API bound to {host} but reports no TCP address")
