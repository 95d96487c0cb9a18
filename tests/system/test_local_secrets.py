"""What a local stranger or a rank could take from a daemon (issue 23, rows 6 and 8): the ranks'
sockets live only in private directories of this user's, and no secret given by environment
stays in any process's initial environment (/proc/<pid>/environ) once the daemon has read it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.api import TOKEN_FILE
from ftd.api.security import TOKEN_ENV
from ftd.config import secrets as env_secrets
from ftd.coordination.secret import SECRET_ENV
from ftd.health.unix_socket import socket_path
from ftd.ranks.launch import socket_paths
from tests.conftest import BIN, ServeFactory

PROBE = BIN / "probe_rank.py"


def _run_dir_of_length(base: Path, total: int) -> Path:
    """A run directory whose `ftd.sock` path is `total` bytes long (run id `test`)."""
    room = total - len(os.fsencode(base / "x" / "test" / "ftd.sock")) + 1
    assert room >= 1, "tmp_path is too long for this test"
    return base / ("d" * room) / "test"


@contextlib.contextmanager
def _squatted(paths: list[Path]) -> Iterator[None]:
    """Names in /tmp taken first by a 'stranger': a directory cannot be unlinked like a stale
    socket, which is what another user's socket in the sticky /tmp is to us."""
    for path in paths:
        path.mkdir()
    try:
        yield
    finally:
        for path in paths:
            path.rmdir()


def test_socket_paths_are_in_a_private_directory_when_the_run_dir_is_long(tmp_path: Path) -> None:
    short = socket_path(tmp_path / "r", "abc")
    assert short == tmp_path / "r" / "ftd.sock"
    deep = socket_path(tmp_path / ("d" * 120), "abc")
    try:
        info = deep.parent.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        assert deep.parent.name.startswith("ftd-abc-")
        for path in (deep, *socket_paths(deep)):
            assert path.parent == deep.parent and len(os.fsencode(path)) < 104
        assert socket_path(tmp_path / ("d" * 120), "abc") != deep  # a fresh name every time
    finally:
        deep.parent.rmdir()
    edge = socket_path(_run_dir_of_length(tmp_path, 89), "abc")
    assert all(len(os.fsencode(path)) < 104 for path in socket_paths(edge))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("length", [95, 160])
async def test_ranks_get_only_served_sockets_in_private_directories(
    serve: ServeFactory, tmp_path: Path, length: int
) -> None:
    run_dir = _run_dir_of_length(tmp_path, length)
    # Where today's main put NVRx's sockets for such a run dir: a name anyone can compute.
    digest = hashlib.sha256(os.fsencode(run_dir / "ftd.sock")).hexdigest()[:16]
    squats = [Path(f"/tmp/ftd-{digest}-nvrx-{kind}.sock") for kind in ("rmon", "launcher")]
    out = tmp_path / "out"
    with _squatted(squats):
        run = await serve(
            "--nproc-per-node", "2", "--log-dir", str(run_dir.parent),
            script=PROBE, script_args=("--out", str(out)),
        )  # fmt: skip
        assert await run.wait() == 0, run.stderr.text[-3000:]
    private_dirs = set()
    for rank in (0, 1):
        report = json.loads((out / f"{rank}.json").read_text())["sockets"]
        assert set(report) == {
            "FTD_SOCKET",
            "FT_RANK_MONITOR_IPC_SOCKET",
            "FT_LAUNCHER_IPC_SOCKET",
        }
        for name, found in report.items():
            assert Path(found["path"]) not in squats, (name, found)
            assert found["served"], (name, found)
            assert found["dir_uid"] == os.geteuid() and found["dir_mode"] == 0o700, (name, found)
            private_dirs.add(Path(found["path"]).parent)
    assert len(private_dirs) == 1
    (directory,) = private_dirs
    assert directory != run_dir and directory.name.startswith("ftd-")
    assert not directory.exists(), "the private socket directory outlived the daemon"
    assert "are not served" not in run.stderr.text


def test_the_secret_names_are_the_readers_names() -> None:
    assert env_secrets.NAMES == (SECRET_ENV, TOKEN_ENV)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["zygote", "spawn"])
async def test_no_ancestor_of_a_rank_holds_a_secret_in_its_initial_environment(
    serve: ServeFactory, tmp_path: Path, method: str
) -> None:
    job_secret, token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    out = tmp_path / "out"
    run = await serve(
        "--nproc-per-node", "2", "--start-method", method,
        script=PROBE, script_args=("--out", str(out)),
        env={SECRET_ENV: job_secret, TOKEN_ENV: token},
    )  # fmt: skip
    assert await run.wait() == 0, run.stderr.text[-3000:]
    for rank in (0, 1):
        processes = json.loads((out / f"{rank}.json").read_text())["processes"]
        roles = [found["role"] for found in processes.values()]
        assert roles.count("daemon") == 1, roles
        assert any("ftd.ranks.guard" in role for role in roles), roles
        if method == "zygote":
            assert any("zygote_server" in role for role in roles), roles
        for pid, found in processes.items():
            for value in (job_secret, token):
                assert value not in found["environ"], (pid, found["role"])
            assert "FTD_SECRETS_FD" not in found["environ"] or found["role"] == "daemon"
    # The token still reached the API: it did not make a token file of its own.
    assert "created the API token file" not in run.stderr.text
    assert not (run.run_dir / TOKEN_FILE).exists()


def test_the_reexec_hands_the_secrets_over_a_pipe(tmp_path: Path) -> None:
    """The re-exec itself, in a small program: same pid, the secrets out of /proc/self/environ
    and still known to the new image; values too long are cut, still too long to be valid."""
    program = (
        "import json, os, sys\n"
        "from ftd.config import secrets as env_secrets\n"
        "pid = os.getpid()\n"
        "env_secrets.isolate()\n"
        "print(json.dumps({'pid': pid, 'ppid': os.getppid(),\n"
        "  'environ': open('/proc/self/environ', 'rb').read().decode(errors='replace'),\n"
        "  'secret': env_secrets.get('FTD_RDZV_SECRET'),\n"
        "  'token': env_secrets.get('FTD_API_TOKEN'),\n"
        "  'in_os_environ': [n for n in env_secrets.NAMES if n in os.environ],\n"
        "  'fds': sorted(os.listdir('/proc/self/fd'))}))\n"
    )
    long_token = "t" * 100_000
    env = {**os.environ, SECRET_ENV: "s" * 40, TOKEN_ENV: long_token}
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["ppid"] == os.getpid()  # the same process, re-exec'd (its parent is us)
    assert seen["secret"] == "s" * 40
    assert seen["token"] == long_token[: env_secrets.MAX_VALUE_CHARS]
    assert "s" * 40 not in seen["environ"] and "t" * 40 not in seen["environ"]
    assert seen["in_os_environ"] == []
    assert len(seen["fds"]) <= 4, seen["fds"]  # stdin, stdout, stderr, the listing: no pipe


@pytest.mark.parametrize("fd", ["x", "999", "0"])
def test_a_daemon_that_cannot_read_its_secrets_stops_with_one_line(fd: str) -> None:
    env = {**os.environ, env_secrets.FD_ENV: fd}
    done = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", "--print-config", "x.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot read the secrets handed over at restart" in done.stderr
    assert "Traceback" not in done.stderr
