"""--checkpoint-every: a snapshot every N-th step, or as many as pay off (Young/Daly's interval
as a power of two). The ranks of a job always share a step to resume from, whatever intervals
they chose; a job killed between snapshots resumes at the newest and ends bit-identical."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

from ftd_client import protocol
from ftd_client.checkpoint._spacing import MAX_AUTO_EVERY, Spacing, auto_interval
from ftd_client.snapshot_format import layout
from hypothesis import given
from hypothesis import strategies as st

from ftd.checkpoint.holder import CheckpointHolder
from ftd.checkpoint.spacing import SnapshotSpacing
from ftd.cli.serve_args import parse_serve_argv
from ftd.config.resolve import serve_config_from_args
from ftd.status.events import EventLog
from tests.checkpoint.test_memory_tier import PRELOAD, STEPS, TRAIN, ftd_status, resumed
from tests.conftest import ServeFactory
from tests.support.clock import FakeClock
from tests.support.snapshots import assert_identical
from tests.support.wire import message

known = st.floats(1e-6, 1e6)
unknown = st.one_of(st.none(), st.just(0.0))


@given(known, known, known)
def test_the_auto_interval_is_a_power_of_two_near_young_and_daly_s(
    cost_s: float, mtbf_s: float, step_s: float
) -> None:
    steps = auto_interval(cost_s, mtbf_s, step_s)
    assert 1 <= steps <= MAX_AUTO_EVERY and steps & (steps - 1) == 0
    best = math.sqrt(2 * cost_s * mtbf_s) / step_s
    if 1 < best < MAX_AUTO_EVERY:
        assert best / math.sqrt(2) <= steps <= best * math.sqrt(2)
    assert auto_interval(cost_s * 4, mtbf_s, step_s) >= steps  # dearer snapshots: fewer
    assert auto_interval(cost_s, mtbf_s * 4, step_s) >= steps  # rarer failures: fewer


@given(st.one_of(unknown, known), st.one_of(unknown, known), st.one_of(unknown, known))
def test_until_everything_is_known_every_step_is_taken(
    cost_s: float | None, mtbf_s: float | None, step_s: float | None
) -> None:
    if not (cost_s and mtbf_s and step_s):
        assert auto_interval(cost_s, mtbf_s, step_s) == 1


@given(st.lists(st.lists(st.integers(0, 10), min_size=1, max_size=8), min_size=2, max_size=6))
def test_ranks_whose_intervals_differ_still_share_a_step_to_resume_from(
    exponents: list[list[int]],
) -> None:
    """Each rank's interval changes as it measures (any powers of two, in any order): in any
    run of steps as long as the largest interval any rank has, one step is taken by all."""
    ranks = []
    for mine in exponents:
        spacing = Spacing()
        spacing.learn({"every": 1 << mine[0]})
        ranks.append((spacing, mine))
    longest = 1 << max(e for _, mine in ranks for e in mine)
    taken: list[set[int]] = [set() for _ in ranks]
    steps = 4 * longest
    for step in range(1, steps + 1):
        for (spacing, mine), took in zip(ranks, taken, strict=True):
            spacing.learn({"every": 1 << mine[step * len(mine) // (steps + 1)]})
            if spacing.due(step):
                took.add(step)
    common = set.intersection(*taken)
    assert {s for s in range(1, steps + 1) if s % longest == 0} <= common


def test_the_flag_is_a_whole_number_of_steps_or_auto(tmp_path: Path) -> None:
    script = tmp_path / "x.py"
    script.touch()

    def every(*flags: str) -> int | None:
        return serve_config_from_args(
            parse_serve_argv([*flags, str(script)]).namespace
        ).checkpoint_every

    assert (every(), every("--checkpoint-every", "auto"), every("--checkpoint-every", "16")) == (
        1,
        None,
        16,
    )
    for bad in ("0", "x", "-3", "2097152", "Auto"):
        proc = subprocess.run(
            [sys.executable, "-m", "ftd", "serve", "--checkpoint-every", bad, "x.py"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "--checkpoint-every" in lines[0] and bad in lines[0]


def test_what_the_daemon_says_is_learned_and_anything_else_ignored() -> None:
    spacing = Spacing()
    for bad in ({"every": 0}, {"every": True}, {"every": "7"}, {"every": 2**40},
                {"mtbf_s": -1}, {"mtbf_s": float("nan")}, {"mtbf_s": True}, {"persist_every": 0},
                {"every": [4]}, {}):  # fmt: skip
        spacing.learn(bad)
    assert (spacing.fixed, spacing.mtbf_s, spacing.persist_every) == (1, None, None)
    spacing.learn({"every": "auto", "mtbf_s": 60.0, "persist_every": 100})
    assert spacing.fixed is None and spacing.interval() == 1  # no cost measured yet
    spacing.step_s, spacing.cost_s = 0.2, 0.02
    assert spacing.interval() == 8  # sqrt(2 * 0.02 * 60) / 0.2 = 7.7
    spacing.learn({"every": 8})
    assert spacing.due(5)  # the process's first save
    assert not spacing.due(7) and spacing.due(8) and spacing.due(100)  # 100: persisted
    taken = [s for s in (105, 115, 125, 127, 133, 135) if spacing.due(s)]
    assert taken == [105, 115, 125, 133]  # a script that saves some steps: the first past each 8


def test_the_daemon_s_mean_time_between_failures_is_its_run_time_over_failures_plus_one() -> None:
    clock = FakeClock()
    spacing = SnapshotSpacing(None, clock=clock.now)
    assert spacing.reply() == {"every": "auto", "mtbf_s": 0.0}
    clock.advance_to(120.0)
    assert spacing.mtbf_s() == 120.0
    spacing.failed()
    spacing.failed()
    assert spacing.mtbf_s() == 40.0
    spacing.reported(0, 4)
    spacing.reported(1, 8)
    spacing.reported(2, None)
    assert spacing.view() == {"every": "auto", "interval_steps": 8, "mtbf_s": 40.0}


def test_the_daemon_counts_the_steps_done_between_snapshots_as_lost(tmp_path: Path) -> None:
    """Ranks that took step 8's snapshot and did steps 9-11 without one (each said so in a
    message that has no answer): a restore of 8 lost 3 steps, and the job is back once a rank
    did 11 again; a restore from disk that the ranks report counts the same."""
    holder = CheckpointHolder(tmp_path, 1 << 30, EventLog(None), base=tmp_path, every=8)
    holder.start()
    try:
        for rank in (0, 1):
            grant = holder.answer(rank, message({"t": protocol.CHECKPOINT_BEGIN, "step": 8,
                                                 "bytes": 1, "world": 2, "every": 8}))  # fmt: skip
            assert grant is not None and grant["every"] == 8 and "mtbf_s" in grant
            Path(str(grant["path"])).write_bytes(layout(8, 2, rank, 0, 0).pack().ljust(4096, b"\0"))
            done = {"t": protocol.CHECKPOINT_DONE, "step": 8, "slot": grant["slot"]}
            assert holder.answer(rank, message(done)) == {"ok": True}
            for step in (9, 10, 11):
                seen = message({"t": protocol.CHECKPOINT_SEEN, "step": step})
                assert holder.answer(rank, seen) is None
        holder.spacing.failed()
        restore = holder.answer(0, message({"t": protocol.CHECKPOINT_RESTORE, "world": 2}))
        assert restore is not None and restore["step"] == 8 and restore["every"] == 8
        restores = holder.restores
        assert restores.last_restore is not None and restores.last_restore["steps_lost"] == 3
        assert restores.last_restore["source"] == "memory" and not restores.caught_up.is_set()
        holder.answer(1, message({"t": protocol.CHECKPOINT_SEEN, "step": 10}))
        assert not holder.restores.caught_up.is_set()
        holder.answer(1, message({"t": protocol.CHECKPOINT_SEEN, "step": 11}))
        assert holder.restores.caught_up.is_set()
        holder.answer(0, message({"t": protocol.CHECKPOINT_SEEN, "step": 13}))
        holder.spacing.failed()
        disk = message({"t": protocol.CHECKPOINT_SEEN, "step": 10, "restored": 1})
        assert holder.answer(0, disk) is None and holder.answer(1, disk) is None
        assert restores.last_restore == {**restores.last_restore, "source": "disk", "steps_lost": 3}
        assert holder.restores.steps_lost == 6
        view = holder.view()
        assert view is not None and (view["every"], view["interval_steps"]) == (8, 8)
    finally:
        holder.close()


async def test_a_job_killed_between_snapshots_resumes_at_the_newest_bit_identical(
    serve: ServeFactory, tmp_path: Path, memory_train_reference: Path
) -> None:
    """--checkpoint-every 4: killed in step 50, the job resumes after step 48; auto: after
    the newest step its interval took. Both end as a run that never failed, and the daemon
    counts the steps done since that snapshot as lost (the ranks tell it of each step)."""
    runs = {}
    for every in ("4", "auto"):
        out = tmp_path / every
        runs[every] = await serve(
            "--nproc-per-node", "2", "--max-restarts", "1", "--api-port", "off",
            "--checkpoint-every", every, *PRELOAD,
            script=TRAIN, run_id=f"every-{every}", api_port=None,
            script_args=("--out", str(out), "--steps", str(STEPS), "--kill-at-step", "50"),
            env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    codes = await asyncio.gather(*(run.wait(240) for run in runs.values()))
    assert codes == [0, 0], {n: r.stderr.text[-3000:] for n, r in runs.items()}
    for every, run in runs.items():
        out = tmp_path / every
        for rank in (0, 1):
            assert_identical(memory_train_reference / f"final-{rank}.pt", out / f"final-{rank}.pt")
        (zero,), (one,) = resumed(out, 0), resumed(out, 1)
        assert zero == one and int(zero) <= 49
        view = json.loads((run.run_dir / "status.json").read_text())["checkpoint"]
        assert view["every"] == (4 if every == "4" else "auto")
        interval = view["interval_steps"]
        assert interval >= 1 and interval & (interval - 1) == 0
        lost = view["last_restore"]["steps_lost"]
        assert lost == 49 - int(zero)  # step 49 took no snapshot, and the daemon heard of it
        shown = await ftd_status(run.run_dir)
        if every == "4":
            assert zero == "48" and interval == 4 and ", every 4 steps;" in shown
        else:
            assert f", every {interval} steps (auto);" in shown
