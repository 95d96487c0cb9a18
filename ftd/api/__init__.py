"""The REST control API of a node daemon: its lifecycle (token, sites, api.json, registry).

Two sites serve one aiohttp app: TCP (`--api-host`/`--api-port`, bearer token for changes
and for a rank's stderr and stacks: `ftd.api.middlewares.token_required`) and the admin unix
socket `<run dir>/api.sock` (mode 0600, callers of the daemon's own user only, checked with
SO_PEERCRED; no token). Both pass a ConnectionGuard (`ftd.api.connections`).
The routes are in `ftd.api.app`, the middlewares in `ftd.api.middlewares`; the contract is
`openapi.yaml` at the repository root, and the tests hold the server to it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from ftd_client.discovery import process_start_time

from ftd.api import publish
from ftd.api.app import build_app
from ftd.api.connections import (
    ApiLimits,
    ConnectionGuard,
    Connections,
    GuardedSite,
    same_user_peer,
    tcp_peer,
)
from ftd.api.control import NodeControl
from ftd.api.middlewares import METRICS, STREAMS
from ftd.api.security import TOKEN_ENV, HostPolicy, load_token
from ftd.api.stats import ApiCollector
from ftd.config.serve import DEFAULT_API_PORT
from ftd.errors import ApiStartupError

__all__ = ["ApiLimits", "ApiServer", "ApiStartupError", "start_api_server"]

log = logging.getLogger("ftd.api")

API_FILE = publish.API_FILE
TOKEN_FILE = "api.token"
SHUTDOWN_TIMEOUT_S = 2.0
BACKLOG = 128


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


def _client_url(host: str, port: int) -> str:
    """The URL a client on this machine uses (wildcard binds are reached over loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ApiServer:
    """A started API: `url`, `port`, `socket_path`; `await close()` ends open event streams,
    stops both sites and removes what it published."""

    def __init__(
        self, runner: web.AppRunner, url: str, port: int, socket_path: Path | None
    ) -> None:
        self._runner = runner
        self.url = url
        self.port = port
        self.socket_path = socket_path
        self._cleanups: list[tuple[str, Callable[[], None]]] = []

    def on_close(self, what: str, cleanup: Callable[[], None]) -> None:
        self._cleanups.append((what, cleanup))

    async def close(self) -> None:
        self._runner.app[STREAMS].close_all()
        try:
            await self._runner.cleanup()
        finally:
            for what, cleanup in reversed(self._cleanups):
                try:
                    cleanup()
                except OSError as error:
                    log.warning("closing the API: cannot remove %s: %s", what, error)


async def start_api_server(control: NodeControl, limits: ApiLimits | None = None) -> ApiServer:
    """Bind the API (the default port falls back to a free one when taken; an explicitly
    requested port that is taken raises ApiStartupError) and its admin socket, write
    `<run dir>/api.json` and the registry entry."""
    limits = limits or ApiLimits()
    config = control.config
    assert config.api_port is not None
    token_file = config.api_token_file or control.run_dir / TOKEN_FILE
    had_token_file = token_file.exists()
    token, from_env = load_token(token_file)
    hosts = HostPolicy.for_bind(config.api_host, await _addresses(config.api_host))
    connections = Connections()
    app = build_app(control, token, hosts, limits, connections)
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logger=http_log,
        keepalive_timeout=limits.idle_timeout_s,
    )
    await runner.setup()
    tcp = ConnectionGuard("tcp", connections, limits, limits.max_connections, tcp_peer)
    admin = ConnectionGuard(
        "unix", connections, limits, limits.max_admin_connections, same_user_peer
    )
    try:
        port = await _bind_tcp(
            runner, tcp, config.api_host, config.api_port, config.api_port_explicit
        )
        socket_path, inode = await _bind_admin(runner, admin, control.run_dir)
    except BaseException:
        await runner.cleanup()
        if not (from_env or had_token_file):  # a start that failed leaves no credential behind
            token_file.unlink(missing_ok=True)
        raise
    app[METRICS].registry.register(ApiCollector([tcp, admin], app[STREAMS]))
    url = _client_url(config.api_host, port)
    server = ApiServer(runner, url, port, socket_path)
    if socket_path is not None:
        server.on_close(str(socket_path), lambda: publish.remove_socket(socket_path, inode))
    info = {
        "url": url,
        "host": config.api_host,
        "port": port,
        "socket": None if socket_path is None else str(socket_path),
        "pid": os.getpid(),
        "started": process_start_time(os.getpid()),
        "node_id": config.node_id,
        "run_id": config.run_id,
        "token_file": None if from_env else str(token_file.absolute()),
    }
    info_path = control.run_dir / API_FILE
    if publish.publish_api_file(info_path, info):
        server.on_close(str(info_path), lambda: info_path.unlink(missing_ok=True))
    entry = publish.register(
        {
            "run_dir": str(control.run_dir.resolve()),
            "node_id": config.node_id,
            "run_id": config.run_id,
            "socket": info["socket"],
            "url": url,
        }
    )
    if entry is not None:
        server.on_close(str(entry), lambda: entry.unlink(missing_ok=True))
    log.info(
        "API listening on %s (token %s); admin socket %s",
        url,
        f"from ${TOKEN_ENV}" if from_env else f"in {token_file}",
        socket_path or "off",
    )
    return server


async def _addresses(host: str) -> list[str]:
    """The addresses binding `host` listens on (what the Host check and reads' auth go by)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as error:
        raise ApiStartupError(f"--api-host {host}: {error}") from None
    return [str(info[4][0]) for info in infos]


async def _bind_tcp(
    runner: web.AppRunner, guard: ConnectionGuard, host: str, port: int, explicit: bool
) -> int:
    loop = asyncio.get_running_loop()
    site = GuardedSite(
        runner,
        guard,
        lambda factory: loop.create_server(factory, host, port, backlog=BACKLOG),
        f"http://{host}:{port}",
    )
    try:
        await site.start()
    except OSError as error:
        await site.stop()  # unregisters the site that did not start
        if error.errno != errno.EADDRINUSE:
            raise ApiStartupError(f"--api-host {host} --api-port {port}: {error}") from None
        if explicit or port != DEFAULT_API_PORT:
            raise ApiStartupError(
                f"--api-port {port} is already in use on {host}: choose another port, "
                "or 0 for a free one"
            ) from None
        log.warning(
            "API port %d is in use on %s: using a free port instead (clients find it in "
            "api.json, or use the admin socket)",
            port,
            host,
        )
        return await _bind_tcp(runner, guard, host, 0, False)
    for sock in site.sockets:
        address = sock.getsockname()
        if isinstance(address, tuple):
            return int(address[1])
    raise ApiStartupError(f"the API bound to {host} but reports no TCP address")


async def _bind_admin(
    runner: web.AppRunner, guard: ConnectionGuard, run_dir: Path
) -> tuple[Path | None, int]:
    """The admin socket's path and inode; (None, 0), with a warning, when it cannot be had
    (the TCP API still serves)."""
    try:
        path = publish.admin_socket_path(run_dir)
        sock = publish.bind_admin_socket(path)
    except publish.AdminSocketUnavailable as error:
        log.warning("no admin socket (the TCP API still serves): %s", error)
        return None, 0
    inode = os.lstat(path).st_ino
    loop = asyncio.get_running_loop()
    site = GuardedSite(
        runner,
        guard,
        lambda factory: loop.create_unix_server(factory, sock=sock, backlog=BACKLOG),
        f"http://unix:{path}:",
    )
    try:
        await site.start()
    except OSError as error:
        await site.stop()
        sock.close()
        publish.remove_socket(path, inode)
        log.warning("no admin socket (the TCP API still serves): %s", error)
        return None, 0
    return path, inode
