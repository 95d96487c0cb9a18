"""What a local stranger or a rank could take from a daemon (issue 23, rows 6 and 8): the ranks'
sockets live only in private directories of this user's, and no secret given by environment
stays in any process's initial environment (/proc/<pid>/environ) once the daemon has read it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.ipc import socket_path
from ftd.nvrx_server import socket_paths
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
