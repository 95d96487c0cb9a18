"""torch.distributed.checkpoint in the node's memory: a storage writer and reader over the
daemon's memory directory, for jobs whose state is sharded (DTensor, FSDP) or that already use
`dcp.save`/`dcp.load`:

    dcp.save(state, storage_writer=checkpoint.MemoryWriter(step))
    step = checkpoint.newest_dcp()
    if step is not None:
        dcp.load(state, storage_reader=checkpoint.MemoryReader(step))

Each checkpoint id is one directory of DCP's own layout (so it can be copied to a disk and read
by FileSystemReader); the writer keeps the newest `keep` complete ones and removes older ones
once a newer one is complete. The files live as long as the daemon's job, like the snapshots.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ftd_client.checkpoint._instance import checkpointer
from ftd_client.checkpoint._plan import CheckpointError
from ftd_client.checkpoint_messages import CheckpointPlace

METADATA = ".metadata"
"""DCP's metadata file, written last by the coordinator: a checkpoint id with it is complete."""
KEEP = 2
_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def memory_directory() -> Path:
    """The node's directory for DCP files; CheckpointError outside ftd or without the tier."""
    link = checkpointer().link
    reply = None if link is None else link.request(CheckpointPlace())
    if not reply or not reply.get("ok"):
        raise CheckpointError(
            "no node memory for torch.distributed.checkpoint: "
            + (str(reply.get("error")) if reply else "not under ftd (no FTD_SOCKET)")
        )
    return Path(str(reply["path"]))


def _name(checkpoint_id: object) -> str:
    name = str(checkpoint_id)
    if not _ID.fullmatch(name) or name in (".", ".."):
        raise CheckpointError(f"checkpoint id {name!r:.60} is not a plain name (A-Z a-z 0-9 _ . -)")
    return name


class MemoryWriter(FileSystemWriter):  # type: ignore[misc]
    def __init__(self, checkpoint_id: object, keep: int = KEEP, **options: Any) -> None:
        self._root = memory_directory()
        self._keep = max(1, keep)
        options.setdefault("sync_files", False)  # memory: nothing to sync
        super().__init__(self._root / _name(checkpoint_id), **options)

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        complete = _complete(self._root)
        for old in complete[: -self._keep]:
            shutil.rmtree(self._root / old, ignore_errors=True)


class MemoryReader(FileSystemReader):  # type: ignore[misc]
    def __init__(self, checkpoint_id: object) -> None:
        super().__init__(memory_directory() / _name(checkpoint_id))


def newest_dcp() -> str | None:
    """The newest complete checkpoint id in the node's memory (ids compared as numbers where
    they are numbers), or None."""
    try:
        complete = _complete(memory_directory())
    except CheckpointError:
        return None
    return complete[-1] if complete else None


def _complete(root: Path) -> list[str]:
    try:
        names = [e.name for e in os.scandir(root) if (Path(e.path) / METADATA).is_file()]
    except OSError:
        return []
    return sorted(names, key=lambda n: (0, int(n), n) if n.isdigit() else (1, 0, n))
