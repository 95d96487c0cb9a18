"""--checkpoint-persist DIR against another local user and against its own damage (docs/security.md
"Files", docs/checkpoint.md "Security"): a DIR another user owns or can write to, or a link, is
refused with one line and nothing is written into it; a planted step whose skeleton is a pickle
is never unpickled, and a step cut short is skipped: both named, and the job restores the
newest step every rank can read; what the ranks write is 0700/0600."""

from __future__ import annotations

import logging
import os
import pickle
import pwd
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from ftd.checkpoint.holder import CheckpointHolder, Persist
from ftd.config.shared_paths import PathRefused, prepare_private_dir
from ftd.status.events import EventLog
from tests.conftest import MEMORY_TRAIN, Serve, ServeFactory

FLAGS = ("--nproc-per-node", "2", "--api-port", "off", "--preload", "torch._dynamo")
FIRST_STEPS = 5
"""The first run persists its step 5 only (one write: none skipped while another runs)."""


def nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user `nobody` on this machine")
    if os.geteuid() == entry.pw_uid:
        pytest.skip("the tests run as `nobody`")
    return entry.pw_uid, entry.pw_gid


async def train(serve: ServeFactory, persist: Path, out: Path, steps: int, run_id: str) -> Serve:
    flags = (*FLAGS, "--checkpoint-persist", str(persist), "--checkpoint-persist-every", "5")
    run = await serve(
        *flags,
        script=MEMORY_TRAIN,
        script_args=("--out", str(out), "--steps", str(steps)),
        run_id=run_id,
        api_port=None,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert await run.wait(240) == 0, run.stderr.text[-3000:]
    return run


def persisted_twice(good: Path, number: int) -> Path:
    """A copy of the persisted step `good` (DIR/w2/step_<S>) as a newer step `number`."""
    step = good.parent / f"step_{number}"
    shutil.copytree(good, step, symlinks=True)
    return step


def modes(tree: Path) -> set[tuple[str, str]]:
    """Each kind of entry under `tree` with its mode."""
    found = set()
    for path in [tree, *tree.rglob("*")]:
        info = path.lstat()
        kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
        found.add((kind, oct(stat.S_IMODE(info.st_mode))))
    return found


def refusals(lines: list[str]) -> list[str]:
    return [line for line in lines if "no persistence (--checkpoint-persist)" in line]


@pytest.mark.timeout(240)
async def test_a_directory_another_user_owns_is_refused_and_nothing_written(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """(a) a /tmp squat: another user made DIR before the job. One line says why, the job runs
    on with the memory tier alone, and DIR stays empty."""
    uid, gid = nobody()
    squat = tmp_path / "squat"
    squat.mkdir(mode=0o755)
    os.chown(squat, uid, gid)
    run = await train(serve, squat, tmp_path / "out", FIRST_STEPS, "squat")
    said = refusals(run.stderr.lines)
    assert len(said) == 1, run.stderr.text[-3000:]
    assert f"belongs to uid {uid}" in said[0] and str(squat) in said[0]
    assert list(squat.iterdir()) == []
    assert [(tmp_path / "out" / f"resumed-0-{r}").read_text() for r in (0, 1)] == ["none"] * 2


@pytest.mark.timeout(360)
async def test_a_planted_step_whose_skeleton_is_a_pickle_is_never_unpickled(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """(c) a newer step whose skeletons are pickles that would create a marker file if
    unpickled: the marker never appears, each rank names the step it skipped, and the job
    restores the older good step. (e) What the ranks wrote is 0700/0600."""
    persist, out = tmp_path / "persist", tmp_path / "out"
    await train(serve, persist, out, FIRST_STEPS, "first")
    world = persist / "w2"
    good = world / f"step_{FIRST_STEPS}"
    assert modes(persist) == {("dir", "0o700"), ("file", "0o600")}
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(marker), "w"))

    planted = persisted_twice(good, 50)
    for rank in (0, 1):
        (planted / f"rank_{rank}" / "ftd.skeleton").write_bytes(pickle.dumps({"x": Planted()}))
    second = await train(serve, persist, out, FIRST_STEPS + 3, "second")
    assert not marker.exists()
    assert [(out / f"resumed-0-{r}").read_text() for r in (0, 1)] == [str(FIRST_STEPS)] * 2
    for rank in (0, 1):
        skipped = [
            line for line in second.stderr.lines if f"step 50 of rank {rank} skipped" in line
        ]
        assert len(skipped) == 1 and "not a skeleton of this ftd" in skipped[0], skipped


@pytest.mark.timeout(360)
async def test_a_step_cut_short_on_one_rank_is_skipped_by_every_rank(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """(d) rank 1's DCP file of the newest step is cut short (rank 0's is whole): rank 1 names
    it, the ranks agree again and both restore the step before; nothing escapes load()."""
    persist, out = tmp_path / "persist", tmp_path / "out"
    await train(serve, persist, out, FIRST_STEPS, "first")
    newer = persisted_twice(persist / "w2" / f"step_{FIRST_STEPS}", 30)
    (data,) = (newer / "rank_1").glob("*.distcp")
    os.truncate(data, data.stat().st_size // 2)
    second = await train(serve, persist, out, FIRST_STEPS + 3, "second")
    assert [(out / f"resumed-0-{r}").read_text() for r in (0, 1)] == [str(FIRST_STEPS)] * 2
    skipped = [line for line in second.stderr.lines if "persisted step 30" in line]
    assert len(skipped) == 1 and "of rank 1 skipped" in skipped[0], skipped
    assert "Traceback" not in second.stderr.text


def start_holder(persist: Path, tmp_path: Path) -> CheckpointHolder:
    holder = CheckpointHolder(
        tmp_path, 1 << 20, EventLog(None), base=tmp_path, persist=Persist(persist, 1)
    )
    holder.start()
    return holder


@pytest.mark.parametrize("kind", ["group-writable", "world-writable", "symlink", "nobody"])
def test_a_directory_others_could_change_is_refused_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """(b) refused with one line naming the reason; nothing is created in it, the memory tier
    goes on, and no grant names it."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    persist = real
    if kind == "group-writable":
        real.chmod(0o770)
    elif kind == "world-writable":
        real.chmod(0o707)
    elif kind == "symlink":
        persist = tmp_path / "link"
        persist.symlink_to(real)
    else:
        os.chown(real, *nobody())
    with caplog.at_level(logging.INFO, logger="ftd.checkpoint"):
        holder = start_holder(persist, tmp_path)
    try:
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "no persistence (--checkpoint-persist)" in errors[0]
        reason = {
            "group-writable": "writable by others (mode 770)",
            "world-writable": "writable by others (mode 707)",
            "symlink": "is a symbolic link",
            "nobody": "belongs to uid",
        }[kind]
        assert reason in errors[0], errors
        assert holder.persist is None and list(real.iterdir()) == []
    finally:
        holder.close()


def test_nothing_is_made_below_a_directory_others_can_change(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could rename what is made in it
    with pytest.raises(PathRefused, match="another user could replace the directory"):
        prepare_private_dir(shared / "a" / "b", "--checkpoint-persist directory")
    assert list(shared.iterdir()) == []
    shared.chmod(0o1777)  # sticky, as /tmp: made 0700, parents too
    prepare_private_dir(shared / "a" / "b", "--checkpoint-persist directory")
    assert modes(shared / "a") == {("dir", "0o700")}


def persisted_step(tmp_path: Path) -> Path:
    """A rank's persisted checkpoint written by the persist thread's own function."""
    import torch
    from ftd_client.checkpoint._persist import Work, write

    from tests.checkpoint.test_persist import _slot

    state = {"w": torch.arange(6.0), "n": 3}
    _slot(tmp_path / "slot", state, 20, 1, 0)
    write(Work(str(tmp_path / "slot"), 20, 1, 0, str(tmp_path / "dir")))
    return tmp_path / "dir" / "w1" / "step_20" / "rank_0"


def test_what_a_rank_writes_is_its_own_only_and_it_reads_nothing_else(tmp_path: Path) -> None:
    """(e) 0700 directories, 0600 files, whatever the umask; a rank refuses a checkpoint
    reached through a link, or one a file of which another user owns."""
    import torch
    from ftd_client.checkpoint import CheckpointError
    from ftd_client.checkpoint._persist_load import load

    old = os.umask(0o022)
    try:
        rank_dir = persisted_step(tmp_path)
    finally:
        os.umask(old)
    assert modes(tmp_path / "dir") == {("dir", "0o700"), ("file", "0o600")}
    state: dict[str, Any] = {"w": torch.zeros(6)}
    load(rank_dir, state)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["n"] == 3
    step_dir = rank_dir.parent
    elsewhere = tmp_path / "elsewhere"
    step_dir.rename(elsewhere)
    step_dir.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        load(rank_dir, {})
    step_dir.unlink()
    elsewhere.rename(step_dir)
    os.chown(rank_dir / "ftd.index", *nobody())
    with pytest.raises(CheckpointError, match=r"ftd\.index is owned by uid"):
        load(rank_dir, {})
