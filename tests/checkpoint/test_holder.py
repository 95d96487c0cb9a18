"""The daemon's side of the memory tier without ranks (ftd/checkpoint/holder.py): its private
directory's life, the refusal of a job of several nodes, and what --checkpoint-memory 0 means."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from ftd_client import protocol
from ftd_client.snapshot_format import layout

from ftd.checkpoint.holder import MULTI_NODE, CheckpointHolder
from ftd.checkpoint.memory_dir import pid_namespace
from ftd.status.events import EventLog
from tests.support.wire import message


def begin(step: int, world: int = 1) -> dict[str, object]:
    return {
        "v": 1,
        "t": protocol.CHECKPOINT_BEGIN,
        "id": 1,
        "step": step,
        "bytes": 1,
        "world": world,
    }


def test_the_directory_is_private_recorded_and_removed(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    holder = CheckpointHolder(tmp_path, 1 << 20, EventLog(None), base=base)
    holder.start()
    assert holder.directory is not None
    assert stat.S_IMODE(holder.directory.stat().st_mode) == 0o700
    record = tmp_path / "checkpoint.json"
    assert json.loads(record.read_text()) == {"directory": str(holder.directory)}
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    left = holder.directory
    # A daemon killed here leaves its directory; the next one on this run directory removes it.
    again = CheckpointHolder(tmp_path, 1 << 20, EventLog(None), base=base)
    again.start()
    assert not left.exists() and again.directory is not None and again.directory.exists()
    again.close()
    assert not record.exists() and list(base.iterdir()) == []


def test_a_job_of_several_nodes_tells_its_ranks_what_they_hold_to_agree_on(
    tmp_path: Path,
) -> None:
    holder = CheckpointHolder(tmp_path, 1 << 30, EventLog(None), base=tmp_path, multi_node=True)
    holder.start()
    try:
        for step in (1, 2, 3, 4):  # three slots: the newest two complete and one being written
            grant = holder.answer(1, message(begin(step, world=2)))
            done = {"v": 1, "t": protocol.CHECKPOINT_DONE, "id": 2, "step": step}
            assert grant["ok"] is True
            Path(str(grant["path"])).write_bytes(layout(step, 2, 1, 0, 0).pack().ljust(4096, b"\0"))
            assert holder.answer(1, message({**done, "slot": grant["slot"]}))["ok"] is True
        restore = {"v": 1, "t": protocol.CHECKPOINT_RESTORE, "id": 3, "world": 2}
        assert holder.answer(1, message(restore)) == {"ok": True, "agree": True, "steps": [2, 3, 4]}
        agreed = holder.answer(1, message({**restore, "step": 3}))
        assert agreed["step"] == 3 and str(agreed["path"]).startswith(str(holder.directory))
        assert holder.answer(1, message({**restore, "step": 1}))["step"] is None  # no longer held
        place = holder.answer(0, message({"v": 1, "t": protocol.CHECKPOINT_PLACE, "id": 4}))
        assert place == {"ok": False, "refused": "unsupported", "error": MULTI_NODE}
    finally:
        holder.close()


def test_directories_of_daemons_that_are_gone_are_removed(tmp_path: Path) -> None:
    """A SIGKILLed daemon's memory is freed by the next daemon of this user on the machine,
    whatever its run directory; a live daemon's, and another pid namespace's, are kept."""
    ns = pid_namespace()
    names = {
        "gone": f"ftd-checkpoint-{ns}-{_exited_pid()}-abc123",
        "alive": f"ftd-checkpoint-{ns}-{os.getpid()}-def456",
        "elsewhere": f"ftd-checkpoint-1{ns}-{_exited_pid()}-ghi789",
        "other": "not-ftd-1-2-x",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.0").write_bytes(b"x")
    holder = CheckpointHolder(tmp_path / "run", 1 << 20, EventLog(None), base=tmp_path)
    (tmp_path / "run").mkdir()
    holder.start()
    try:
        left = {p.name for p in tmp_path.iterdir()}
        assert names["gone"] not in left
        assert {names["alive"], names["elsewhere"], names["other"]} <= left
        assert holder.directory is not None
        assert holder.directory.name.startswith(f"ftd-checkpoint-{ns}-{os.getpid()}-")
    finally:
        holder.close()


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_no_memory_no_directory(tmp_path: Path) -> None:
    holder = CheckpointHolder(tmp_path, 0, EventLog(None), base=tmp_path)
    holder.start()
    assert holder.directory is None and not (tmp_path / "checkpoint.json").exists()
    assert holder.answer(0, message(begin(1)))["ok"] is False
