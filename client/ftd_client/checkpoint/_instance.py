"""The rank's one Checkpointer, made on first use (the public functions and DCP's pair share
it)."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from ftd_client.checkpoint._link import CheckpointLink
from ftd_client.checkpoint._writer import Checkpointer

_lock = threading.Lock()
_checkpointer: Checkpointer | None = None


def checkpointer() -> Checkpointer:
    global _checkpointer
    with _lock:
        if _checkpointer is None:
            path = os.environ.get("FTD_SOCKET")
            if not path:
                print(
                    "ftd_client.checkpoint: not under ftd (no FTD_SOCKET): save does nothing",
                    file=sys.stderr,
                )
            _checkpointer = Checkpointer(
                CheckpointLink(path) if path else None,
                int(os.environ.get("RANK", "0")),
                int(os.environ.get("WORLD_SIZE", "1")),
            )
            atexit.register(_checkpointer.close)
        return _checkpointer
