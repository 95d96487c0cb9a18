"""A node that cannot reach its rendezvous says so from its first second (issue 44, item 2):
its API is up while it tries, and /v1/status (held to openapi.yaml), `ftd status` (found
through the registry, no flag), `ftd top` and the page name the endpoint, the last try's
error and the time left; a listener that accepts and says nothing is said to be silent."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from ftd.coordination.progress import MAX_ERROR_CHARS, Reaching
from tests.conftest import Serve, ServeFactory
from tests.support.api import CONTRACT, cli
from tests.support.cluster import api, run_dir
from tests.support.truth_page import browser, in_chromium, open_page, shot

UNRESOLVABLE = "nonexistent.invalid:29400"
JOIN_TIMEOUT_S = 600.0  # --rdzv-join-timeout's default
SAID = re.compile(
    r"^connecting to (?P<endpoint>\S+): (?P<error>.+) \((?P<tries>\d+) tries\); "
    r"gives up in (?P<left>\d+) s$"
)


async def reaching(serve: ServeFactory, tmp_path: Path, backend: str, endpoint: str) -> Serve:
    """Node `a` of a two-node job whose endpoint does not answer, registered in its own
    registry (XDG_RUNTIME_DIR) so that a plain `ftd status` finds it."""
    run = await serve(
        *("--node-id", "a", "--nnodes", "2", "--rdzv-backend", backend),
        *("--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1"),
        run_id="job",
        env=registry(tmp_path),
    )
    await run.stderr.expect("API listening on")
    return run


def registry(tmp_path: Path) -> dict[str, str]:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return {"XDG_RUNTIME_DIR": str(runtime)}


def said_line(tmp_path: Path, command: str = "status") -> re.Match[str] | None:
    done = cli(command, *(("--once",) if command == "top" else ()), env=registry(tmp_path))
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        if match := SAID.match(re.sub(r"\x1b\[[0-9;]*m", "", line).strip()):
            return match
    return None


async def said(tmp_path: Path, command: str = "status") -> re.Match[str]:
    """The CLI's `connecting to ...` line once a try failed (polled: tries fail on their own
    schedule, with no event to wait on)."""
    for _ in range(600):
        if (match := await asyncio.to_thread(said_line, tmp_path, command)) is not None:
            return match
        await asyncio.sleep(0.1)
    raise AssertionError(f"`ftd {command}` never said it was connecting")


async def status_of(run: Serve) -> dict[str, Any]:
    code, status = await api(run, "a", "GET", "/v1/status")
    assert code == 200, status
    CONTRACT.conforms("Status", status)
    return status


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
async def test_a_node_that_cannot_resolve_its_endpoint_says_so_while_it_tries(
    serve: ServeFactory, tmp_path: Path, backend: str
) -> None:
    run = await reaching(serve, tmp_path, backend, UNRESOLVABLE)
    line = await said(tmp_path)
    assert line["endpoint"].removeprefix("http://") == UNRESOLVABLE, line.string
    assert int(line["tries"]) >= 1 and JOIN_TIMEOUT_S - 120 < int(line["left"]) <= 600, line
    status = await status_of(run)
    reach = status["connecting"]
    assert reach is not None and reach["endpoint"].removeprefix("http://") == UNRESOLVABLE
    assert reach["last_error"] and reach["tries"] >= 1, reach
    assert JOIN_TIMEOUT_S - 120 < reach["left_s"] <= JOIN_TIMEOUT_S, reach
    assert status["waiting"] is None and status["ranks"] == [], status
    top = await said(tmp_path, "top")
    assert top["endpoint"] == line["endpoint"], top.string
    # The cluster view is this node's own while no store answers: never an error.
    code, cluster = await api(run, "a", "GET", "/v1/cluster")
    assert code == 200 and [n["node_id"] for n in cluster["nodes"]] == ["a"], cluster
    # The log says it too, not only once at the start.
    await run.stderr.expect(r"still connecting to \S*nonexistent\.invalid:29400: .+ tries\)")

    run.signal(signal.SIGTERM)
    assert await run.wait() == 128 + signal.SIGTERM
    final = json.loads((run_dir(run, "a") / "status.json").read_text())
    assert final["connecting"] is None and final["state"] == "stopped", final


async def test_a_listener_that_never_answers_is_said_to_be_silent(
    serve: ServeFactory, tmp_path: Path
) -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # holds the connection open and says nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        run = await reaching(serve, tmp_path, "c10d", f"127.0.0.1:{port}")
        line = await said(tmp_path)
        assert line["error"] == "connected, but no answer of a c10d store yet", line.string
        run.signal(signal.SIGTERM)
        assert await run.wait() == 128 + signal.SIGTERM
    finally:
        server.close()
        for writer in accepted:
            writer.close()


@in_chromium
async def test_the_page_says_the_node_is_connecting(serve: ServeFactory, tmp_path: Path) -> None:
    run = await reaching(serve, tmp_path, "c10d", UNRESOLVABLE)
    url: str = json.loads((run_dir(run, "a") / "api.json").read_text())["url"]
    async with browser() as chromium:
        page, errors = await open_page(chromium, url)
        await page.locator("#waiting", has_text=f"connecting to {UNRESOLVABLE}: ").wait_for()
        tried = re.compile(r"tries\); gives up in \d+ s")
        await page.locator("#waiting", has_text=tried).wait_for()
        await shot(page, tmp_path, "connecting")
        assert errors == []
    run.signal(signal.SIGTERM)
    assert await run.wait() == 128 + signal.SIGTERM


class Board:
    def __init__(self) -> None:
        self.told: list[Any] = []

    def standby(self, wait: Any) -> None: ...

    def waiting(self, wait: Any) -> None: ...

    def connecting(self, reach: Any) -> None:
        self.told.append(reach)


def test_an_error_from_the_endpoint_is_kept_bounded_and_escaped() -> None:
    """What an endpoint answers (etcd's text, a name's error) is anyone's: one escaped line of
    at most MAX_ERROR_CHARS in the status, however long or hostile."""
    board = Board()
    reaching = Reaching("h:1", 600, board)
    reaching.failed("\x1b[2J\r\nforged line\n" + "x" * 10_000_000, "http://h:1")
    reaching.failed("refused", "http://other:2")
    first, hostile, refused = board.told
    assert first.tries == 0 and first.last_error is None
    assert hostile.tries == 1 and len(hostile.last_error) <= MAX_ERROR_CHARS
    assert "\x1b" not in hostile.last_error and "\n" not in hostile.last_error
    assert hostile.last_error.startswith("http://h:1: \\x1b[2J forged line xxx")
    assert (refused.tries, refused.last_error) == (2, "http://other:2: refused")
    reaching.done()
    assert board.told[-1] is None
