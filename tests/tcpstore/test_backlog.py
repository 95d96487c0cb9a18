"""The store's accept queue is the one it was made with (LISTEN_BACKLOG), not the event loop's
100: asyncio and uvloop listen on a given socket again with their own backlog, and a burst of
thousands of ranks' connections past 100 was dropped and retried 1 s, 2 s later (4,096 ranks'
init took 1.9x torch's server: bench/workers_store.py, found by a helper's measurement)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from ftd_client.store import LISTEN_BACKLOG

from ftd.tcpstore.server import TcpStoreServer


@pytest.mark.skipif(shutil.which("ss") is None, reason="no ss (iproute2)")
async def test_the_store_listens_with_its_own_backlog() -> None:
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    store = await TcpStoreServer.start("127.0.0.1")
    try:
        ss = await asyncio.create_subprocess_exec(
            "ss", "-ltnH", f"sport = :{store.port}", stdout=asyncio.subprocess.PIPE
        )
        shown = (await ss.communicate())[0].decode().split()
    finally:
        await store.close()
    assert int(shown[2]) == min(LISTEN_BACKLOG, somaxconn), shown  # Send-Q: the backlog
