"""Snapshots persisted to disk (--checkpoint-persist, docs/checkpoint.md "Persistence"): a job
that lost its node's memory resumes from DIR bit-identical to a run that never failed; the
daemon tells a rank which steps to write and where to look when memory holds nothing; a DIR it
cannot make is one error and the memory tier goes on; the ranks take only complete, well-named
checkpoints from DIR, keep their newest three, and count a write that fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ftd_client import protocol

from ftd.checkpoint.holder import CheckpointHolder, Persist
from ftd.cli.serve_args import parse_serve_argv
from ftd.config.resolve import UsageError, serve_config_from_args
from ftd.status.events import EventLog
from tests.conftest import MEMORY_TRAIN, MEMORY_TRAIN_STEPS, ServeFactory
from tests.support.snapshots import assert_identical
from tests.support.wire import message

FLAGS = ("--nproc-per-node", "2", "--api-port", "off", "--preload", "torch._dynamo")
PAUSE = 35
EVERY = 10


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
        for made in (persist, persist.parent):
            assert made.is_dir() and oct(made.stat().st_mode & 0o777) == "0o700"
        reply = holder.answer(0, message(restore()))
        assert reply is not None and reply["persist_every"] == 10  # the ranks take those steps
        assert {k: reply[k] for k in ("ok", "step", "persist")} == {
            "ok": True,
            "step": None,
            "persist": str(persist),
        }
        grants = {step: holder.answer(0, message(begin(step))) for step in (9, 10, 11, 20)}
        assert [s for s, g in grants.items() if g and g.get("persist") == str(persist)] == [10, 20]
        assert all(g and g["ok"] for g in grants.values())
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
        grant = holder.answer(0, message(begin(1)))
        assert grant["ok"] is True and "persist" not in grant
        assert "persist" not in holder.answer(0, message(restore()))
    finally:
        holder.close()


def newest_common(world_dir: Path) -> int | None:
    from ftd_client.checkpoint._persist import steps_of

    held = [set(steps_of(world_dir, rank)) for rank in (0, 1)]
    return max(held[0] & held[1], default=None)


@pytest.mark.timeout(240)  # two daemons in a row, each with its zygote's imports
async def test_a_job_that_lost_its_node_resumes_from_disk_bit_identical(
    serve: ServeFactory, tmp_path: Path, memory_train_reference: Path
) -> None:
    """The whole node is lost in step 35 (its daemon and both ranks SIGKILLed: the memory
    with them); a new daemon starts the job again and it resumes from the newest step both
    ranks persisted (30, unless the write of 10 still ran at 30: the thread skips a step
    then), past what was cut short or misnamed in DIR; the new daemon says so."""
    persist = tmp_path / "persist"
    out = tmp_path / "out"
    train = ("--out", str(out), "--steps", str(MEMORY_TRAIN_STEPS))
    flags = (*FLAGS, "--checkpoint-persist", str(persist), "--checkpoint-persist-every", "10")
    env = {"OMP_NUM_THREADS": "1"}
    first = await serve(
        *flags, script=MEMORY_TRAIN, script_args=(*train, "--pause-at-step", str(PAUSE)),
        run_id="first", api_port=None, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 150
    while not (out / "paused").exists():  # every rank's persist settled before it is written
        assert first.proc.returncode is None, first.stderr.text[-3000:]
        assert time.monotonic() < deadline, first.stderr.text[-3000:]
        await asyncio.sleep(0.1)
    assert [(out / f"resumed-0-{rank}").read_text() for rank in (0, 1)] == ["none"] * 2
    world = persist / "w2"
    step = newest_common(world)
    assert step in (10, 20, 30), sorted(p.name for p in world.iterdir())
    pids = await first.rank_pids()
    first.signal(signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await first.wait(30)
    for bad in ("step_40/rank_0", "step_40/rank_1", "step_x/rank_0", "step_050/rank_0"):
        (world / bad).mkdir(parents=True)  # no .metadata: cut short, or not a step's name
        (world / bad / "ftd.skeleton").write_bytes(b"not one")
    (world / f"step_{step}" / ".rank_0.tmp-1").mkdir()  # a write a kill cut short
    second = await serve(
        *flags, script=MEMORY_TRAIN, script_args=train, run_id="second", api_port=None, env=env
    )
    assert await second.wait(240) == 0, second.stderr.text[-3000:]
    for rank in (0, 1):
        assert (out / f"resumed-0-{rank}").read_text() == str(step)  # the second daemon's
        assert_identical(memory_train_reference / f"final-{rank}.pt", out / f"final-{rank}.pt")
    from ftd_client.checkpoint._persist import steps_of

    for rank in (0, 1):  # the newest three of each rank stay
        held = steps_of(world, rank)
        assert len(held) <= 3 and held[-1] >= 40, held
    if step not in steps_of(world, 0):  # rank 0's part gone, with the write a kill cut short
        # (rank 1's part goes with its own prune, which may still be under way as the job ends)
        assert not (world / f"step_{step}" / "rank_0").exists()
        assert not (world / f"step_{step}" / ".rank_0.tmp-1").exists()
    assert "not persisted" not in second.stderr.text
    assert "torch.distributed is disabled" not in second.stderr.text
    restored = second.event_data("checkpoint_restored")  # the daemon hears of it
    assert {(e["global_rank"], e["step"], e.get("source")) for e in restored} >= {
        (0, step, "disk"),
        (1, step, "disk"),
    }
    view = second.status()["checkpoint"]
    assert isinstance(view, dict) and view["last_restore"]["source"] == "disk"
    assert view["last_restore"]["step"] == step


def test_a_listing_takes_only_whole_well_named_steps_and_the_newest_three_stay(
    tmp_path: Path,
) -> None:
    from ftd_client.checkpoint._persist import doomed, steps_of

    for name in ("step_5", "step_7", "step_12", "step_x", "step_012", "step_-1", "stepp_3"):
        rank = tmp_path / name / "rank_0"
        rank.mkdir(parents=True)
        for part in (".metadata", "ftd.skeleton", "ftd.index"):
            (rank / part).touch()
    (tmp_path / "step_9" / "rank_0").mkdir(parents=True)  # no metadata: cut short
    (tmp_path / "step_9" / "rank_0" / "ftd.skeleton").touch()
    (tmp_path / "step_3").write_text("a file")
    assert steps_of(tmp_path, 0) == [5, 7, 12]
    assert steps_of(tmp_path, 1) == []
    assert steps_of(tmp_path / "absent", 0) == []
    assert doomed([1, 2, 3, 4], 4) == [1]
    assert doomed([1, 2, 3], 3) == []
    assert doomed([10, 20, 30, 40], 20) == [30, 40]  # the history went back: newer ones go


def _slot(path: Path, state: dict[str, Any], step: int, world: int, rank: int) -> None:
    """A snapshot file as the copy thread writes it."""
    from ftd_client.checkpoint._plan import plan, tensor_in
    from ftd_client.snapshot_format import HEADER_BYTES, layout

    snapshot = plan(state)
    header = layout(step, world, rank, len(snapshot.skeleton), snapshot.data_bytes)
    data = bytearray(header.total_bytes)
    for tensor, stored in snapshot.tensors:
        if stored.nbytes:
            tensor_in(data, header.data_offset, stored).copy_(tensor)
    data[HEADER_BYTES : HEADER_BYTES + len(snapshot.skeleton)] = snapshot.skeleton
    data[: len(header.pack())] = header.pack()
    path.write_bytes(bytes(data))


def test_a_persisted_snapshot_loads_back_whole_and_a_failed_write_is_counted(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from ftd_client.checkpoint import Stats
    from ftd_client.checkpoint._persist import Persister, Work, write
    from ftd_client.checkpoint._persist_load import load

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "n": 7, "t": (1, 2.5)}
    _slot(tmp_path / "slot", state, 20, 2, 1)
    write(Work(str(tmp_path / "slot"), 20, 2, 1, str(tmp_path / "dir")))
    rank_dir = tmp_path / "dir" / "w2" / "step_20" / "rank_1"
    fresh: dict[str, Any] = {"model": torch.nn.Linear(1, 1).state_dict(), "optim": {}}
    load(rank_dir, fresh)
    assert list(fresh["optim"]["state"]) == [0, 1, 2, 3]  # int keys, as the optimizer's
    assert (fresh["n"], fresh["t"]) == (7, (1, 2.5))
    assert fresh["optim"]["param_groups"] == state["optim"]["param_groups"]
    for key, value in state["model"].items():
        assert torch.equal(fresh["model"][key], value), key
    for key, value in state["optim"]["state"][0].items():
        assert torch.equal(fresh["optim"]["state"][0][key], value), key
    outside = {"model": torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))}
    target = {"model": outside["model"].state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(target, checkpoint_id=rank_dir, no_dist=True)  # DCP's own reader, no ftd
    assert torch.equal(target["model"]["0.weight"], state["model"]["0.weight"])

    (tmp_path / "in-the-way").write_text("a file")
    stats = Stats()
    persister = Persister(stats)
    work = Work(str(tmp_path / "slot"), 20, 2, 1, str(tmp_path / "in-the-way"))
    for _ in range(2):
        assert persister.offer(work)
        assert persister.wait(30) and persister.reading is None
    assert (stats.persisted, stats.persist_failed) == (0, 2)
    said = [line for line in capfd.readouterr().err.splitlines() if "not persisted" in line]
    assert len(said) == 1 and "step 20" in said[0] and "is not a directory" in said[0], said


def test_one_persist_at_a_time_the_next_one_skipped_and_its_slot_left_alone(
    tmp_path: Path,
) -> None:
    """A write under way (its slot a FIFO: the thread waits in open until the test lets it go):
    the next offer is refused (the caller counts it skipped) and the slot is named as read."""
    from ftd_client.checkpoint import Stats
    from ftd_client.checkpoint._persist import Persister, Work

    fifo = tmp_path / "slot"
    os.mkfifo(fifo)
    stats = Stats()
    persister = Persister(stats)
    assert persister.offer(Work(str(fifo), 10, 1, 0, str(tmp_path / "dir")))
    assert persister.reading == str(fifo)
    assert not persister.offer(Work(str(tmp_path / "other"), 20, 1, 0, str(tmp_path / "dir")))
    assert not persister.wait(0.05)
    os.close(os.open(fifo, os.O_WRONLY))  # the reader opens, finds no snapshot: a failure
    assert persister.wait(30) and persister.reading is None
    assert (stats.persisted, stats.persist_failed) == (0, 1)
