"""Hostile input on live daemons (issue 23 rows 2, 9, 10, 11): error files, terminal escapes,
scheduler variables and a rendezvous endpoint where no store listens. Each ends with one line
and the right exit code, never a traceback of ftd's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ftd.cli.admin import format_status
from tests.conftest import BIN, ROOT, WORKER, ServeFactory

BAD_ERROR_FILE = BIN / "bad_error_file.py"


def no_ftd_traceback(text: str) -> None:
    assert "Traceback (most recent call last)" not in text.replace("Traceback ...", ""), text[
        -3000:
    ]
    assert "JSONDecodeError" not in text


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("empty", "empty"),
        ("truncated", "not JSON"),
        ("not_json", "not JSON"),
        ("huge", "larger than 256 KiB"),
        ("fifo", "not a regular file"),
    ],
)
async def test_r02_an_unreadable_error_file_is_named_in_the_summary(
    serve: ServeFactory, kind: str, reason: str
) -> None:
    run = await serve(
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        script=BAD_ERROR_FILE,
        script_args=("--kind", kind),
    )
    assert await run.wait() == 1
    text = run.stderr.text
    summary = text[text.index("restarts exhausted") :]
    assert "Root Cause (first observed failure)" in summary
    assert "exitcode  : 1" in summary
    assert f"error file unreadable: {reason}" in summary, summary
    assert str(run.attempt_dir(0) / "0" / "error.json") in summary
    no_ftd_traceback(text)


async def test_r09_escapes_in_an_error_file_are_shown_escaped(serve: ServeFactory) -> None:
    run = await serve(
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        script=BAD_ERROR_FILE,
        script_args=("--kind", "escapes"),
    )
    assert await run.wait() == 1
    summary = run.stderr.text[run.stderr.text.index("restarts exhausted") :]
    assert "RuntimeError: \\x1b[2J\\x1b]0;pwned\\x07 \\u202egnp.exe" in summary, summary
    assert "\x1b" not in summary and "\u202e" not in summary and "\x07" not in summary


@pytest.mark.parametrize(
    "nodelist",
    ["n" + "[1]" * 1300, "n" + "[" * 2000 + "1" + "]" * 2000, "n[0-999999999],m[1-9]" * 100],
)
def test_r10_a_hostile_slurm_nodelist_is_one_line_and_exit_2(tmp_path: Path, nodelist: str) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": nodelist,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", str(WORKER)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftd serve: error: SLURM_JOB_NODELIST: "), lines
    assert len(lines[0]) < 300
    assert list(tmp_path.iterdir()) == []


# -- row 11: something else listens at --rdzv-endpoint -------------------------------------


@contextlib.asynccontextmanager
async def listener(kind: str) -> AsyncIterator[int]:
    """A TCP server on 127.0.0.1 that is no c10d store: `silent` accepts and says nothing,
    `http` is a real HTTP server (aiohttp)."""
    if kind == "http":
        from aiohttp import web

        async def hello(request: web.Request) -> web.Response:
            return web.Response(text="hello")

        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            await runner.cleanup()
        return
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield silent.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


def rdzv_flags(port: int, join_timeout_s: int) -> tuple[str, ...]:
    return (
        *("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1"),
        *("--rdzv-join-timeout", str(join_timeout_s), "--node-id", "a"),
    )


def one_clean_line(text: str, endpoint: str) -> None:
    errors = [line for line in text.splitlines() if " E " in line[:8] or "error" in line]
    naming = [line for line in errors if endpoint in line]
    assert len(naming) == 1, text[-3000:]
    for mark in ("Traceback", "frame #", "Exception raised from", "TCPStore.cpp"):
        assert mark not in text, text[-3000:]


@pytest.mark.parametrize("kind", ["silent", "http"])
async def test_r11_a_listener_that_is_no_store_is_one_line_within_the_join_timeout(
    serve: ServeFactory, kind: str
) -> None:
    async with listener(kind) as port:
        run = await serve(*rdzv_flags(port, 5))
        await run.stderr.expect("connecting to the rendezvous store")
        started = time.monotonic()
        code = await run.wait(timeout=30)
        took = time.monotonic() - started
    assert code == 1, run.stderr.text[-3000:]
    assert took < 5 + 5, took
    one_clean_line(run.stderr.text, f"127.0.0.1:{port}")


async def test_r11_sigterm_while_reaching_the_store_ends_the_daemon_at_once(
    serve: ServeFactory,
) -> None:
    async with listener("silent") as port:
        run = await serve(*rdzv_flags(port, 60))
        await run.stderr.expect("connecting to the rendezvous store")
        run.signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = await run.wait(timeout=30)
        took = time.monotonic() - signalled
    assert code == 128 + signal.SIGTERM, run.stderr.text[-3000:]
    assert took < 2.5, took
    for mark in ("Traceback", "frame #", "Exception raised from"):
        assert mark not in run.stderr.text


# -- row 9: terminal escapes in what `ftd status` shows -------------------------------------

ESCAPED_NAME = "s\\x1b[2J\\x0d\\x07\\u202egnp"


def test_r09_format_status_escapes_every_text_of_the_job() -> None:
    hostile = "x\x1b[2J\r\x07\u202e\x9b"
    status = {
        "node_id": hostile, "run_id": hostile, "state": hostile, "attempt": 0,
        "restart_count": 0, "max_restarts": 0, "pid": 1,
        "last_failure": {"reason": hostile, "kind": hostile, "counted": True},
        "timeouts": {hostile: {hostile: 3.0}},
        "ranks": [{"local_rank": 0, "global_rank": 0, "pid": 2, "state": hostile,
                   "exit_code": None, "section": hostile}],
    }  # fmt: skip
    cluster = {
        "nodes": [{"node_id": hostile, "state": hostile, "attempt": 0}],
        "round": {"round": 1, "members": [hostile]},
        "excluded": [hostile, {"node_id": hostile}],
    }
    text = format_status(status, cluster)
    for char in "\x1b\r\x07\u202e\x9b":
        assert char not in text
    assert text.count("x\\x1b[2J\\x0d\\x07\\u202e\\x9b") >= 10


async def test_r09_ftd_status_shows_a_hostile_section_name_escaped(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "1", script=BIN / "escape_section.py")
    await run.stdout.expect("section opened")
    deadline = time.monotonic() + 30
    while True:  # the section reaches status.json with the daemon's next refresh
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ftd", "status", "--run-dir", str(run.run_dir),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        text = out.decode()
        if ESCAPED_NAME in text or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert ESCAPED_NAME in text, text
    for char in "\x1b\r\x07\u202e":
        assert char not in text
    run.signal(signal.SIGTERM)
    assert await run.wait() == 128 + signal.SIGTERM


def test_r02_the_summary_keeps_torchruns_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built from our decoded record, the report is ChildFailedError's, line for line."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ErrorHandler,
        ProcessFailure,
    )

    from ftd.supervision.summary import format_failures, rank_failure

    good, missing = tmp_path / "1" / "error.json", tmp_path / "0" / "error.json"
    good.parent.mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(good))
    try:
        raise RuntimeError("injected")
    except RuntimeError as error:
        ErrorHandler().record_exception(error)
    torch_failures = {
        1: ProcessFailure(local_rank=1, pid=42, exitcode=1, error_file=str(good)),
        0: ProcessFailure(local_rank=0, pid=41, exitcode=-9, error_file=str(missing)),
    }
    torch_failures[0].timestamp = torch_failures[1].timestamp + 1
    ours = {
        1: rank_failure(1, 1, 42, 1, str(good)),
        0: rank_failure(0, 0, 41, -9, str(missing)),
    }
    # Times aside: ours is when the error file was written, to the millisecond (torch cuts it
    # to the second it recorded); tests/test_cli_truth.py checks it.
    for rank, failure in ours.items():
        ours[rank] = dataclasses.replace(failure, timestamp=torch_failures[rank].timestamp)
    expected = ChildFailedError("train.py", torch_failures).format_msg()
    assert format_failures("train.py", ours, 1) == expected


async def test_r11_a_node_that_starts_before_the_store_host_waits_for_it(
    serve: ServeFactory,
) -> None:
    """The probe retries a refused connection until the host is up (the common case, not an
    attack): b starts first, a hosts the store later, the job runs."""
    from tests.support.cluster import Cluster

    cluster = Cluster(serve, "2")
    b = await cluster.node("b", flags=("--rdzv-conf", "is_host=0"))
    await b.stderr.expect("connecting to the rendezvous store")
    a = await cluster.node("a")
    assert await a.wait() == 0 and await b.wait() == 0
    assert "hosting the rendezvous store" in a.stderr.text
