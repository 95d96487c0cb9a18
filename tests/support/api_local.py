"""The API in this test's own event loop, with short limits: the real server (`start_api_server`,
real sockets on 127.0.0.1 and the admin socket) in front of a small NodeControl, for the
attacks whose bounds are timeouts and caps. Plus raw-socket and log helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ftd.api import ApiLimits, ApiServer, start_api_server
from ftd.api.cluster_view import bounded
from ftd.config.serve import ServeConfig
from ftd.errors import FeatureUnavailable, NotFound
from ftd.status.events import Event, EventLog
from ftd.status.model import DaemonState, NodeStatus


@pytest.fixture(autouse=True)
def private_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own runtime directory (the registry of running daemons is its `ftd/`,
    which daemons and CLIs started by the test inherit), and no token or URL from the
    environment. Autouse where imported."""
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("FTD_API_TOKEN", raising=False)
    monkeypatch.delenv("FTD_API_URL", raising=False)
    return runtime


class LocalControl:
    """A NodeControl with real state and events and no ranks: requests are recorded as
    the daemon would announce them."""

    def __init__(self, run_dir: Path, events_file: bool = True) -> None:
        self.config = ServeConfig(
            entrypoint=__file__, node_id="local", run_id="attacks", api_port=0
        )
        self.status = NodeStatus(node_id="local", run_id="attacks", state=DaemonState.RUNNING)
        self.events = EventLog(run_dir / "events.jsonl" if events_file else None)
        self.run_dir = run_dir
        self.timeouts: dict[str, Any] = {
            "initial_rank_heartbeat_timeout": None,
            "rank_heartbeat_timeout": None,
            "rank_section_timeouts": {},
            "rank_out_of_section_timeout": None,
        }

    def status_snapshot(self) -> dict[str, object]:
        return self.status.to_dict()

    def request_restart(self, scope: str, reason: str, requested_by: str, count: bool) -> Event:
        return self.events.emit(
            "restart_requested", scope=scope, reason=reason, by=requested_by, counted=count
        )

    def cluster(self, offset: int, limit: int) -> dict[str, Any]:
        view = {
            "nodes": [{"node_id": "local", "state": "running"}],
            "round": {"round": 0, "members": ["local"]},
            "excluded": [],
        }
        return bounded(view, offset, limit)

    def get_timeouts(self) -> dict[str, Any]:
        return dict(self.timeouts)

    def set_timeouts(self, patch: dict[str, Any], requested_by: str) -> dict[str, Any]:
        self.timeouts.update(patch)
        self.events.emit("timeouts_changed", timeouts=dict(self.timeouts), by=requested_by)
        return dict(self.timeouts)

    def inject_fault(self, kind: str, rank: int | None, delay_s: float, requested_by: str) -> Event:
        raise NotFound("no ranks here")

    def exclude_node(self, node_id: str, reason: str, requested_by: str) -> Event:
        raise FeatureUnavailable("node exclusion needs the multi-node rendezvous")

    def readmit_node(self, node_id: str, requested_by: str) -> Event:
        raise NotFound(f"node {node_id!r} is not excluded")


@dataclass
class LocalApi:
    server: ApiServer
    control: LocalControl
    token: str

    @property
    def port(self) -> int:
        return self.server.port

    async def metric(self, line_start: str) -> float:
        """The value of the one /metrics sample whose line starts with `line_start`."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        text = (await reader.read()).decode()
        writer.close()
        [line] = [line for line in text.splitlines() if line.startswith(line_start)]
        return float(line.rsplit(" ", 1)[1])


@contextlib.asynccontextmanager
async def local_api(run_dir: Path, limits: ApiLimits, **control: Any) -> AsyncIterator[LocalApi]:
    run_dir.mkdir(parents=True, exist_ok=True)
    control_ = LocalControl(run_dir, **control)
    server = await start_api_server(control_, limits)  # type: ignore[arg-type]
    token = (run_dir / "api.token").read_text().strip()
    try:
        yield LocalApi(server, control_, token)
    finally:
        await server.close()
        control_.events.close()


class LogLines(logging.Handler):
    """The ftd loggers' messages in this process, awaitable."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self._changed.set()

    def count(self, pattern: str) -> int:
        return sum(bool(re.search(pattern, line)) for line in self.lines)

    async def expect(self, pattern: str, timeout: float = 30.0) -> str:
        async def find() -> str:
            while True:
                for line in self.lines:
                    if re.search(pattern, line):
                        return line
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(find(), timeout)


@contextlib.contextmanager
def ftd_log() -> Any:
    handler = LogLines()
    logger = logging.getLogger("ftd")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


class Clients:
    """Raw TCP clients of one port, all closed at the end (whatever the test asserted)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._writers: list[asyncio.StreamWriter] = []

    async def connect(self, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if "sock" in kwargs:
            reader, writer = await asyncio.open_connection(**kwargs)
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port, **kwargs)
        self._writers.append(writer)
        return reader, writer

    async def __aenter__(self) -> Clients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float = 30.0) -> bytes:
    """Everything the server still sends, until it closes the connection (EOF or reset)."""
    received = b""

    async def drain() -> None:
        nonlocal received
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                received += chunk

    await asyncio.wait_for(drain(), timeout)
    return received


async def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], Any]:
    """One request written as raw bytes (headers no HTTP client would send); the status,
    the headers and the JSON body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"Connection: close\r\n\r\n" + body)
        raw = await closed_by_peer(reader)
    finally:
        writer.close()
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        payload = _unchunk(payload)
    return status, headers, json.loads(payload) if payload else None


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out
