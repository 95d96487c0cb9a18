"""Snapshots persisted to disk (--checkpoint-persist, docs/checkpoint.md "Persistence"): the
daemon tells a rank which steps to write and where to look when memory holds nothing; a DIR it
cannot make is one error and the memory tier goes on; the ranks' listing of what is on disk
takes only complete, well-named checkpoints and keeps the newest three."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from ftd_client import protocol

from ftd.checkpoint.holder import CheckpointHolder, Persist
from ftd.cli.serve_args import parse_serve_argv
from ftd.config.resolve import UsageError, serve_config_from_args
from ftd.status.events import EventLog


def begin(step: int) -> dict[str, object]:
    return {"v": 1, "t": protocol.CHECKPOINT_BEGIN, "id": 1, "step": step, "bytes": 1, "world": 1}


def restore() -> dict[str, object]:
    return {"v": 1, "t": protocol.CHECKPOINT_RESTORE, "id": 1, "world": 1}


def test_the_flags_make_the_config_and_every_needs_a_directory(tmp_path: Path) -> None:
    script = tmp_path / "x.py"
    script.touch()

    def config(*flags: str) -> tuple[Path | None, int]:
        served = serve_config_from_args(parse_serve_argv([*flags, str(script)]).namespace)
        return served.checkpoint_persist_dir, served.checkpoint_persist_every

    assert config() == (None, 100)
    assert config("--checkpoint-persist", str(tmp_path)) == (tmp_path, 100)
    assert config("--checkpoint_persist", "d", "--checkpoint-persist-every", "7") == (
        Path("d").absolute(),
        7,
    )
    with pytest.raises(UsageError, match="needs --checkpoint-persist DIR"):
        config("--checkpoint-persist-every", "7")
    for bad in ("0", "x", "-3"):
        proc = subprocess.run(
            [sys.executable, "-m", "ftd", "serve", "--checkpoint-persist", "d",
             "--checkpoint-persist-every", bad, "x.py"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "is not a whole number of steps >= 1" in lines[0]


def test_the_grant_of_every_nth_step_and_each_restore_name_the_directory(
    tmp_path: Path,
) -> None:
    persist = tmp_path / "a" / "b"
    holder = CheckpointHolder(
        tmp_path, 1 << 20, EventLog(None), base=tmp_path, persist=Persist(persist, 10)
    )
    holder.start()
    try:
        assert persist.is_dir() and oct(persist.stat().st_mode & 0o777) == "0o700"
        assert holder.answer(0, restore()) == {"ok": True, "step": None, "persist": str(persist)}
        grants = {step: holder.answer(0, begin(step)) for step in (9, 10, 11, 20)}
        assert [s for s, g in grants.items() if g.get("persist") == str(persist)] == [10, 20]
        assert all(g["ok"] for g in grants.values())
        view = holder.view()
        assert view is not None and (view["persist_dir"], view["persist_every"]) == (
            str(persist),
            10,
        )
    finally:
        holder.close()
    assert persist.is_dir()  # the job's persisted steps outlive it


def test_a_directory_that_cannot_be_made_is_one_error_and_memory_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("in the way")
    holder = CheckpointHolder(
        tmp_path, 1 << 20, EventLog(None), base=tmp_path,
        persist=Persist(tmp_path / "file" / "persist", 1),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="ftd.checkpoint"):
        holder.start()
    try:
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "no persistence (--checkpoint-persist)" in errors[0].message
        grant = holder.answer(0, begin(1))
        assert grant["ok"] is True and "persist" not in grant
        assert "persist" not in holder.answer(0, restore())
    finally:
        holder.close()
