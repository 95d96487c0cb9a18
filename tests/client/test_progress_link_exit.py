"""A rank whose script is done tells its daemon before its interpreter exits
(ftd_client/progress_link.py): its last counts, then the progress connection closed, while
the process lives on through its exit (the time collecting torch's objects can take)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from ftd_client import protocol, wire
from ftd_client.messages import ProgressReport

from tests.conftest import ROOT

RANK = """
import atexit, sys, time
atexit.register(time.sleep, 60)  # registered first, runs last: a slow exit
from ftd_client.progress_link import install_from_env
observer = install_from_env()
assert observer is not None
observer.tick()
print("ready", flush=True)
"""


def test_the_progress_connection_closes_when_the_script_is_done(tmp_path: Path) -> None:
    path = tmp_path / "ftd.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(4)
    env = {"FTD_PROGRESS": "1", "FTD_SOCKET": str(path), "PYTHONPATH": f"{ROOT}:{ROOT}/client"}
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        listener.settimeout(30)
        conn, _ = listener.accept()
        conn.settimeout(20)  # without the close at exit it ends only with the process
        records = []
        while data := conn.recv(protocol.MAX_MESSAGE_BYTES):
            records.append(wire.decode(data).message)
        assert rank.poll() is None, "the connection closed before the process ended"
        conn.close()
        assert records and all(isinstance(r, ProgressReport) for r in records)
        assert rank.stdout is not None and rank.stdout.readline() == b"ready\n"
    finally:
        rank.kill()
        rank.communicate()
        listener.close()
