"""The admin channel and where tokens go: the admin unix socket (its owner needs no token;
nobody else gets in), the registry the CLI finds daemons in, a squatter on the default port
that must never see a token, token files of other users, and `ftd events` after the daemon
has gone."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ftd_client import discovery
from ftd_client.admin import AdminClient, AdminError

from ftd.api.security import load_token
from ftd.config.serve import DEFAULT_API_PORT
from ftd.errors import ApiStartupError
from tests.conftest import ServeFactory
from tests.support.api import api_of, cli, stop
from tests.support.api_local import private_registry  # noqa: F401 (an autouse fixture)

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
"""An interpreter another user may run (this test's own lives under root's directories)."""
AS_NOBODY = os.geteuid() == 0 and os.access(SYSTEM_PYTHON, os.X_OK)


class Squatter:
    """Another local user's server on a port: records every request head it gets."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def squatting(port: int) -> AsyncIterator[Squatter]:
    squatter = Squatter()
    try:
        server = await asyncio.start_server(squatter.handle, "127.0.0.1", port)
    except OSError as error:
        assert error.errno == errno.EADDRINUSE
        pytest.skip(f"port {port} is taken by another process: cannot play the squatter")
    async with server:
        yield squatter


async def test_the_cli_finds_its_daemon_and_never_guesses(serve: ServeFactory) -> None:
    registry = discovery.registry_dir()  # this test's own (private_registry)
    async with squatting(DEFAULT_API_PORT) as squatter:
        bait = {"FTD_API_TOKEN": "operator-token-0123456789"}
        # No daemon registered: the CLI says so; it does not try the default port.
        done = cli("restart", env=bait)
        assert done.returncode == 1, done
        assert done.stderr.startswith("ftd restart: error: no running ftd daemon of this user")

        # The daemon finds the default port taken and moves: clients follow api.json or
        # the admin socket, never the squatter.
        run = await serve(script_args=("--hang",), api_port=None)  # the default port
        await run.stderr.expect(f"API port {DEFAULT_API_PORT} is in use on 127.0.0.1")
        async with api_of(run) as api:
            await api.ready(0, 1)
            assert api.info["socket"] == str(run.run_dir / "api.sock")
            done = cli("status", env=bait)  # found in the registry, over the admin socket
            assert done.returncode == 0, done.stderr
            assert "state running" in done.stdout
            done = cli("restart", "--no-count", "--reason", "via the registry", env=bait)
            assert done.returncode == 0, done.stderr
            # A run directory whose socket is gone: its recorded URL, with its token.
            socket_path = run.run_dir / "api.sock"
            socket_path.rename(run.run_dir / "api.sock.away")
            try:
                client = AdminClient.from_env(run_dir=run.run_dir)
                assert client.url == api.url and client.token == api.token
                done = cli("timeouts", "--run-dir", str(run.run_dir), env=bait)
                assert done.returncode == 0, done.stderr
            finally:
                (run.run_dir / "api.sock.away").rename(socket_path)
            _, page, _ = await api.call("GET", "/v1/events")
            [requested] = [e for e in page["events"] if e["kind"] == "restart_requested"]
            assert requested["data"]["by"].startswith("api unix socket pid ")

            # Several daemons of this user: name one (exit 2, listing them).
            other = run.log_dir / "other"
            other.mkdir()
            extra = discovery.register({"run_dir": str(other), "node_id": "x", "run_id": "y"})
            done = cli("status", env=bait)
            assert done.returncode == 2 and "2 ftd daemons of this user run" in done.stderr
            assert str(run.run_dir) in done.stderr and str(other) in done.stderr
            extra.unlink()
            # An entry whose process is gone does not count.
            gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "")
            await gone.wait()
            stale = registry / f"{gone.pid}-dead.json"
            entry = {"version": 1, "pid": gone.pid, "started": 1, "run_dir": str(other)}
            stale.write_text(json.dumps(entry))
            stale.chmod(0o600)
            assert cli("status", env=bait).returncode == 0
            assert await stop(run) == 128 + signal.SIGTERM
        assert squatter.heads == []  # not one request, let alone a token

    # Gone: its registry entry and socket with it; its events stay readable.
    assert [p.name for p in registry.glob("*.json")] == [stale.name]
    assert not (run.run_dir / "api.sock").exists()
    done = cli("status", env=bait)
    assert done.returncode == 1 and "no running ftd daemon" in done.stderr
    where = ("--run-dir", str(run.run_dir))
    done = cli("status", *where)  # the run's last status, said to be final (test_cli_truth.py)
    assert done.returncode == 0 and "(final)" in done.stdout, done.stderr
    written = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
    done = cli("events", *where, "--json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == written
    assert done.stderr.startswith(f"ftd events: no daemon runs on {run.run_dir}")
    with (run.run_dir / "events.jsonl").open("a") as file:
        file.write('{"id": "x"}\nnot json\n[1]\n')
    done = cli("events", *where, "--since", str(written[-2]["id"]), "--follow")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()] == [str(written[-1]["id"])]
    assert "not following" in done.stderr and "skipped 3 malformed lines" in done.stderr


async def test_the_admin_socket_serves_its_owner_only(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "1", script_args=("--hang",))
    async with api_of(run) as api:
        await api.ready(0, 1)
        path = Path(api.info["socket"])
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        # The owner: no token, no Host check, every operation.
        client = AdminClient(socket_path=path)
        assert client.token is None
        assert (await asyncio.to_thread(client.status))["state"] == "running"
        body = b'{"rank_heartbeat_timeout": 42.5}'
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(
            b"PATCH /v1/timeouts HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json"
            + f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"rank_heartbeat_timeout": 42.5' in answer
        accepted = await asyncio.to_thread(client.restart, "over the socket", "cluster", False)
        assert accepted["event"]["data"]["by"].startswith("api unix socket pid ")
        await api.ready(1, 1)

        if AS_NOBODY:
            # Another user who gets at the socket anyway (here: its mode opened up; the
            # probe starts in the run directory, whose parents it could not traverse).
            path.chmod(0o666)
            path.parent.chmod(0o711)  # the run directory is 0700: let it pass through
            probe = (
                "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('api.sock')\n"
                "try:\n s.sendall(b'GET /v1/status HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n"
                " print(repr(s.recv(100)))\nexcept (BrokenPipeError, ConnectionResetError):\n"
                " print('cut')"
            )
            done = await asyncio.to_thread(
                subprocess.run, [SYSTEM_PYTHON, "-c", probe], cwd=path.parent,
                capture_output=True, text=True, timeout=60, user=NOBODY,
            )  # fmt: skip
            path.chmod(0o600)
            path.parent.chmod(0o700)
            assert done.stdout.strip() in ("b''", "cut"), done
            await run.stderr.expect(
                rf"API \(unix\): a process of uid {NOBODY} \(pid \d+\) connected to the admin"
            )
        assert await stop(run) == 128 + signal.SIGTERM
    assert not path.exists()


def test_token_files_that_are_not_private_are_refused(tmp_path: Path) -> None:
    token = tmp_path / "api.token"
    token.write_text("a-perfectly-good-token-0123456789\n")
    token.chmod(0o600)
    assert load_token(token) == ("a-perfectly-good-token-0123456789", False)
    token.chmod(0o644)
    with pytest.raises(ApiStartupError, match=r"has mode 0644, open to other users.*chmod 600"):
        load_token(token)
    token.chmod(0o600)
    if os.geteuid() == 0:  # a planted file: 0600, but another user's
        os.chown(token, NOBODY, NOBODY)
        with pytest.raises(ApiStartupError, match=f"is owned by uid {NOBODY}, not by this user"):
            load_token(token)
        link = tmp_path / "link.token"
        link.symlink_to(token)
        with pytest.raises(ApiStartupError, match=f"is owned by uid {NOBODY}"):
            load_token(link)
    fifo = tmp_path / "fifo.token"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ApiStartupError, match="is not a regular file"):
        load_token(fifo)  # and does not block
    for text, message in (
        ("short\n", "a token has 16 to 1024 characters"),
        ("with spaces inside of it\n", "visible ASCII"),
        ("tökén-0123456789abcdef\n", "visible ASCII"),
        ("\n", "is empty"),
    ):
        bad = tmp_path / "bad.token"
        bad.write_text(text)
        bad.chmod(0o600)
        with pytest.raises(ApiStartupError, match=message):
            load_token(bad)
        bad.unlink()


async def test_a_token_file_open_to_others_stops_the_daemon(
    serve: ServeFactory, tmp_path: Path
) -> None:
    token = tmp_path / "shared.token"
    token.write_text("a-perfectly-good-token-0123456789\n")
    token.chmod(0o644)
    run = await serve("--api-token-file", str(token), script_args=("--hang",))
    assert await run.wait() == 2
    errors = [line for line in run.stderr.lines if "error" in line.lower()]
    assert errors == [
        f"ftd serve: error: the API token file: {token} has mode 0644, open to other users: "
        f"refusing to trust it (chmod 600 {token})"
    ]
    assert not run.out.exists()  # no rank started
    run = await serve(script_args=("--hang",), env={"FTD_API_TOKEN": "short"}, run_id="env")
    assert await run.wait() == 2
    assert "ftd serve: error: $FTD_API_TOKEN: a token has 16 to 1024 characters" in run.stderr.text


def test_a_socket_served_by_another_user_is_not_trusted(tmp_path: Path) -> None:
    """The client's side of SO_PEERCRED: it talks to its own user's daemon only."""
    if not AS_NOBODY:
        pytest.skip(f"needs root and {SYSTEM_PYTHON} to serve a socket as another user")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    server = (
        "import os, socket; s = socket.socket(socket.AF_UNIX); s.bind('api.sock');"
        "os.chmod('api.sock', 0o666); s.listen(); print('up', flush=True);"
        "c, _ = s.accept(); c.recv(1000)"
    )
    with subprocess.Popen(
        [SYSTEM_PYTHON, "-c", server], cwd=shared, stdout=subprocess.PIPE, text=True, user=NOBODY
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        with pytest.raises(AdminError, match=f"is served by uid {NOBODY}, not by this user"):
            AdminClient(socket_path=shared / "api.sock").status()
        proc.wait(timeout=30)
