"""Hang verdicts turned into explained kills.

The monitor judges; this says who stopped first, has every overdue rank's stacks written
(faulthandler through the rank's own signal, py-spy from outside where installed), then kills
the culprit with the termination signal and ends the attempt. Nothing a rank sent or did can
stop the kill: every step that fails becomes a note in the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ftd import containment
from ftd.health.collectives import AttemptCollectives
from ftd.health.links import RankHealth
from ftd.health.monitor import Monitor
from ftd.health.progress import ProgressVerdict, ProgressWatch
from ftd.health.verdict import Verdict
from ftd.ranks.workers import WorkerGroup
from ftd.status.event_kind import EventKind
from ftd.status.events import EventLog
from ftd.status.model import Failure
from ftd.tasks import Background, within

log = logging.getLogger("ftd.health")

STACK_DUMP_WAIT_S = 1.0
STACK_SETTLE_S = 0.05
"""A dump is done once its file stopped growing this long: a rank descheduled between two of
faulthandler's writes (a busy machine) pauses for milliseconds, and a kill then cuts it."""
NATIVE_DUMP_TIMEOUT_S = 10.0
MAX_TASKS = 4096
"""Threads of a rank looked at to tell its dump is done (past them, the file's settling)."""


class HangHandler:
    """The health service's verdicts, carried out on the attempt's group."""

    def __init__(
        self,
        monitor: Monitor,
        events: EventLog,
        termination_signal: str,
        progress: ProgressWatch | None = None,
    ) -> None:
        self.monitor = monitor
        self.progress = progress or ProgressWatch()
        self.collectives = AttemptCollectives(self.progress)
        """The node's part of the job's culprit, frozen at its verdict (collectives.py)."""
        self.events = events
        self.termination_signal = termination_signal
        self.group: WorkerGroup | None = None
        """The attempt's group, while the health service watches it (`attach`)."""
        self._judged: WorkerGroup | None = None
        self._background = Background()

    def attach(self, group: WorkerGroup) -> None:
        self.group = group
        self.collectives.new_attempt()

    def detach(self) -> None:
        self.group = None

    def close(self) -> None:
        self._background.cancel()

    def fail(self, reason: str) -> None:
        """A part of the health service failed (containment): the attempt ends with it."""
        if self.group is not None:
            self.group.fail(Failure(kind="internal", reason=reason, timestamp=time.time()))

    def _first_verdict(self, culprit: RankHealth) -> bool:
        """One verdict per attempt: a rank that falls due while one is carried out (waiting on
        the culprit, most likely) is among its victims, not a hang of its own."""
        if self.group is not None and self._judged is self.group:
            log.info("rank %d is overdue too: its attempt is already ending", culprit.global_rank)
            return False
        self._judged = self.group
        self.collectives.freeze(judged=True)
        return True

    def on_hang(self, verdict: Verdict) -> None:
        if not self._first_verdict(verdict.first.rank):
            return
        overdue = list(verdict.overdue)
        # Ranks waiting in a collective on an injected hang time out as well, and may do so first.
        simulated = [r for r in self.monitor.ranks() if r.simulated_hang]
        overdue_ranks = [item.rank for item in overdue]
        # Where the ranks report progress: the rank the others wait on, not the first silent.
        by_progress = self.progress.culprit(overdue_ranks, verdict.at)
        culprit = simulated[0] if simulated else by_progress or overdue_ranks[0]
        others = [rank for rank in overdue_ranks if rank is not culprit]
        if by_progress is culprit:  # and the ranks stalled with it, due or not yet
            stalled = self.progress.stalled_ranks(verdict.at)
            others += [r for r in stalled if r is not culprit and all(r is not o for o in others)]
        blame = self.progress.blame(culprit, others) if by_progress is culprit else None
        reason = _verdict_reason(verdict, culprit, blame)
        log.error("%s", reason)
        # The last sign of life as of the verdict: a stopped rank resumed for its stacks speaks
        # again before the kill, and the fault began when it fell silent, not then.
        silent = culprit.last_seen if culprit.last_seen is not None else culprit.connected_at
        origin = time.time() - (time.monotonic() - silent) if silent is not None else None
        self._background.spawn(
            self._explain_and_kill(culprit, others, reason, origin), "explain-and-kill"
        )

    def on_progress_hang(self, verdict: ProgressVerdict) -> None:
        """A rank made no progress past its deadline: it is the culprit, the ranks stalled
        with it its victims."""
        culprit = verdict.culprit.rank
        if not self._first_verdict(culprit):
            return
        reason = verdict.reason
        log.error("%s", reason)
        victims = [v.rank for v in verdict.victims]
        origin = time.time() - (time.monotonic() - verdict.culprit.advanced_at)
        self._background.spawn(
            self._explain_and_kill(culprit, victims, reason, origin), "explain-and-kill"
        )

    async def _explain_and_kill(
        self, rank: RankHealth, others: list[RankHealth], reason: str, origin: float | None
    ) -> None:
        """Stacks of every overdue rank first (bounded), then the kill and the attempt's end.
        Nothing a rank sent or did can stop the kill: every step's error is a note."""
        group = self.group
        if group is None:
            return

        # A rank may die while its stacks are written (faulthandler reads other threads'
        # frames unlocked: a thread that runs meanwhile can crash it): still this hang.
        def died(*known: str) -> None:  # what was learnt of it before it died is kept
            dead = "; ".join([reason, *known, "the rank died while its stacks were written"])
            group.judged(_hang_failure(rank, dead, time.time(), origin))

        died()
        section = max(rank.open_sections, key=rank.open_sections.__getitem__, default=None)
        # The victims' stacks are written beside the culprit's, and never delay its kill.
        victims = asyncio.ensure_future(self._explain_each(group, others))
        victims.add_done_callback(lambda done: done.cancelled() or done.exception())
        notes: list[str] = []
        killed = False
        try:
            containment.inject("hangs")
            notes = await self._explain_each(group, [rank], unnamed=rank, heard=died)
            # Its exit may be seen before the victims' stacks are written: it ends the attempt
            # with what is known of it by then (its own notes).
            killed_as = f"{reason}; {'; '.join(notes)}; terminated with {self.termination_signal}"
            group.judged(_hang_failure(rank, killed_as, time.time(), origin))
            self._signal_culprit(group, rank)
            killed = True
            notes += await victims
        except Exception as error:  # never lose the kill to an explanation
            containment.record("hangs", error)
            notes.append(f"stacks not collected ({error!r})")
        finally:
            victims.cancel()
            if not killed:
                self._signal_culprit(group, rank)
            self._record(group, rank, others, reason, notes, origin, section)

    async def explain_ranks(self, local_ranks: list[int]) -> list[str]:
        """Write these local ranks' stacks (in-process mode: the stragglers that make the
        daemon fall back to a process restart, before it stops them); notes on each."""
        group = self.group
        if group is None:
            return []
        ranks = [rank for rank in self.monitor.ranks() if rank.local_rank in local_ranks]
        return await self._explain_each(group, ranks)

    async def _explain_each(
        self,
        group: WorkerGroup,
        ranks: list[RankHealth],
        unnamed: RankHealth | None = None,
        heard: Callable[[str], None] | None = None,
    ) -> list[str]:
        """Every rank's stacks at once; notes prefixed with the rank (but `unnamed`'s, whose
        note on a stopped rank is `heard` as soon as it is made)."""
        notes: list[str] = []
        results = await asyncio.gather(
            *(self._explain(group, r, heard if r is unnamed else None) for r in ranks),
            return_exceptions=True,
        )
        for who, result in zip(ranks, results, strict=True):
            if isinstance(result, BaseException):
                log.error("could not explain rank %d: %r", who.global_rank, result)
                notes.append(f"rank {who.global_rank}: no stacks ({result!r})")
            else:
                prefix = "" if who is unnamed else f"rank {who.global_rank}: "
                notes.extend(prefix + note for note in result)
        return notes

    async def _explain(
        self, group: WorkerGroup, rank: RankHealth, heard: Callable[[str], None] | None
    ) -> list[str]:
        stacks = Path(group.attempt_log_dir) / str(rank.local_rank)
        stacks_file = stacks / "stacks.txt"
        notes: list[str] = []

        def resume() -> None:
            # A stopped process runs no signal handler: resumed first. Not after the stack
            # signal: a signal sent while every thread is stopped goes to whichever thread
            # wakes first, whose handler then walks the frames of a main thread that runs on
            # (a SIGSEGV in faulthandler, seen); sent to a running process, it goes to the
            # main thread, whose frames stay still while the handler reads them.
            if _is_stopped(rank.pid):
                notes.append("the rank was stopped (SIGSTOP/SIGTSTP): resumed with SIGCONT")
                if heard is not None:
                    heard(notes[-1])
                group.signal_rank(rank.local_rank, signal.SIGCONT)

        if rank.stack_signal is None:
            resume()
            notes.append("the rank did not register a stack dump (no ftd_client)")
        elif await _dump_stacks(
            lambda sig: group.signal_process(rank.local_rank, rank.pid, sig),
            rank.stack_signal,
            stacks_file,
            resume,
            rank.pid,
        ):
            notes.append(f"Python stacks in {stacks_file}")
        else:
            notes.append(f"the rank wrote no stacks within {STACK_DUMP_WAIT_S:g}s")
        # py-spy reads the stacks from outside: the fallback for a rank that cannot run its
        # handler (no ftd_client, a signal blocked, C code that never returns to Python).
        if (native := await _native_dump(rank.pid, stacks / "stacks_native.txt")) is not None:
            notes.append(f"native stacks in {native}")
        return notes

    def _signal_culprit(self, group: WorkerGroup, rank: RankHealth) -> None:
        try:
            group.signal_rank(rank.local_rank, signal.Signals[self.termination_signal])
        except Exception as error:
            containment.record("hangs", error)

    def _record(
        self,
        group: WorkerGroup,
        rank: RankHealth,
        others: list[RankHealth],
        reason: str,
        notes: list[str],
        origin: float | None,
        section: str | None,
    ) -> None:
        """The verdict said (a `rank_hung` event) and the attempt failed with it, once the
        culprit was signalled and the victims' stacks were written; `section`: the one it was
        in at the verdict (its connection, closed by the kill, no longer says)."""
        signal_name = self.termination_signal
        try:
            event = self.events.emit(
                EventKind.RANK_HUNG,
                local_rank=rank.local_rank,
                global_rank=rank.global_rank,
                pid=rank.pid,
                reason=reason,
                section=section,
                culprit=True,
                victims=[r.global_rank for r in others],
                also_overdue=[r.global_rank for r in others],
                notes=notes,
            )
            timestamp = event.time
        except Exception as error:
            containment.record("hangs", error)
            timestamp = time.time()
        full_reason = f"{reason}; {'; '.join(notes)}; terminated with {signal_name}"
        group.fail(_hang_failure(rank, full_reason, timestamp, origin))


def _hang_failure(rank: RankHealth, reason: str, timestamp: float, origin: float | None) -> Failure:
    return Failure(
        kind="hang",
        reason=reason,
        local_rank=rank.local_rank,
        global_rank=rank.global_rank,
        pid=rank.pid,
        timestamp=timestamp,
        origin=origin,
    )


def _verdict_reason(verdict: Verdict, culprit: RankHealth, blame: str | None = None) -> str:
    """The culprit's reason, then who else was overdue and who stopped first (or, where the
    ranks report progress, `blame`: who waits on whom)."""
    by_rank = {id(item.rank): item for item in verdict.overdue}
    own = by_rank.get(id(culprit))
    if blame is not None:
        first = verdict.first
        reason = own.reason(verdict.at) if own is not None else first.reason(verdict.at)
        return f"{reason}; {blame}"
    if own is not None:
        reason = own.reason(verdict.at)
    else:  # an announced simulated hang that has not timed out itself
        first = verdict.first
        reason = (
            f"rank {culprit.global_rank} is carrying out a simulated hang; rank "
            f"{first.rank.global_rank} was the first to time out waiting: "
            f"{first.reason(verdict.at)}"
        )
    others = [item.rank.global_rank for item in verdict.overdue if item.rank is not culprit]
    if others and own is not None:
        silent = culprit.last_seen if culprit.last_seen is not None else culprit.connected_at
        since = f" (silent for {verdict.at - silent:.3f}s)" if silent is not None else ""
        reason += (
            f"; rank {culprit.global_rank} stopped first{since}, ranks {others} stopped "
            "after it (waiting on it, most likely)"
        )
    return reason


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


async def _dump_stacks(
    send: Callable[[int], bool],
    stack_signal: int,
    path: Path,
    before_signal: Callable[[], None],
    pid: int | None = None,
) -> bool:
    """Signal the rank's faulthandler (through its pidfd: `send`) and await its dump: the file
    grew, and every thread of `pid` is back asleep, or the file settled."""
    before = _size(path)
    before_signal()
    if not send(stack_signal):
        return False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STACK_DUMP_WAIT_S
    last, settled_at = before, loop.time()
    while loop.time() < deadline:
        await asyncio.sleep(0.001)  # the dump is written from a signal handler: no event to await
        size = _size(path)
        if size != last:
            last, settled_at = size, loop.time()
        elif size > before and (
            loop.time() - settled_at >= STACK_SETTLE_S or (pid is not None and _asleep(pid))
        ):
            return True
    return _size(path) > before


def _asleep(pid: int) -> bool:
    """No thread of `pid` runs or waits to run: its signal handler (faulthandler's dump)
    returned, and the threads are back where they hung (a dump takes ~1 ms; a thread
    descheduled mid-dump on a busy machine is runnable, 'R', so this waits for it)."""
    try:
        for task in os.listdir(f"/proc/{pid}/task")[:MAX_TASKS]:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as stat:
                if stat.read(4096).rpartition(b")")[2].split()[:1] == [b"R"]:
                    return False
    except (OSError, IndexError):
        return False
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


async def _native_dump(pid: int, path: Path) -> Path | None:
    """py-spy's native stacks, where py-spy is installed (bounded)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return None
    with path.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            py_spy,
            "dump",
            "--native",
            "--pid",
            str(pid),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            await within(proc.wait(), NATIVE_DUMP_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return path
