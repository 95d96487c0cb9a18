"""The rendezvous rules, written once above the backends: how a node joins a round, when the
round is closed and by whom, and what a node does that finds a round running without it.

Each backend (c10d/, etcd/) provides the few steps the rules take (`RoundSteps`: enter a round,
await its closing record, close it, read who joined or who is returning, ask or await a
round's end, stand by, watch the members) over its own store, and the rules run the same on
both; the backends still know nothing of each other.

The rules: the n-th joiner of round N closes it, as the MAX-th once the round before's members
came back (or their last call ended), after the last call once MIN joined, aborted at the join
deadline. A node that finds round N closed without it is late: it asks what a late node asks
(`late_request`: a restart where the round has room for it) and waits for the round's end, or
stands by where it asks nothing. A node that joined as the round closed without it is late too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Protocol, TypeVar

from ftd.config.serve import ServeConfig
from ftd.coordination.assignment import Assignment, round_of
from ftd.coordination.base import CoordinationError, Round, RoundWaits
from ftd.coordination.exclusion_ledger import Excluding, ExclusionLedger
from ftd.coordination.progress import report_progress
from ftd.coordination.records import Member, RequestRecord, RoundRecord
from ftd.coordination.shared_rounds import (
    Late,
    excluded_error,
    job_over,
    last_call,
    late_request,
    restarts_kept,
)
from ftd.coordination.standby import stand_by

T = TypeVar("T")


class RoundBook(Protocol):
    """What a backend's rounds remember from one join to the next."""

    exclusions: ExclusionLedger
    round_hint: int
    """The round to try first (the newest this node knows of)."""
    known_restarts: int
    """The highest restart count this node has seen (never taken lower: restarts_kept)."""


class RoundSteps(Protocol):
    """A backend's steps for the rules; each bounded (by `deadline`, the loop's clock, where it
    waits out an absent store) and raising CoordinationError when the store is gone."""

    @property
    def book(self) -> RoundBook: ...

    async def enter(self, me: Member, deadline: float) -> tuple[int, int] | Late:
        """Join the newest open round: (its number, this node's place among its joiners), or
        Late for a round that closed without this node."""

    async def closing(self, number: int, me: str) -> tuple[RoundRecord | Assignment, int | None]:
        """Round `number` once closed: `me`'s assignment where it has a place other than node
        rank 0's, else the closing record (assignment.py); and the store's revision of the
        closing record, where the store has one: what the members' watch starts from."""

    async def close(self, number: int, abort: bool, deadline: float) -> None: ...

    async def returning(self, number: int, deadline: float) -> list[str]:
        """The members of the round before `number` that have joined `number`."""

    async def joined(self, number: int, names: bool) -> tuple[int, list[str]]:
        """How many joined round `number` so far, and (`names`) the names of at most
        JOINED_NAMES_MAX of them (shared_rounds.py)."""

    async def ask(self, number: int, request: RequestRecord, deadline: float) -> None:
        """Decide round `number`'s request (the first decided wins)."""

    async def ending(self, number: int) -> RequestRecord:
        """Round `number`'s decided request, once there is one."""

    async def register_standby(self, late: Late, since: float) -> None: ...

    def spawn(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Future[T]: ...

    def watch(self, node_ids: list[str], revision: int | None) -> None:
        """Watch these members' liveness (node rank 0 every other; the others node rank 0)."""


async def join(
    config: ServeConfig,
    steps: RoundSteps,
    me: Member,
    deadline: float,
    last: Round | None,
    waits: RoundWaits | None,
    on_record: Callable[[Excluding], None],
) -> Round:
    """This node's next round (`last`: its round before); `on_record` hears each closing record
    it read (its excluded nodes), before the round is returned or refused."""
    book = steps.book
    while True:
        entry = await steps.enter(me, deadline)
        if isinstance(entry, Late):
            await _as_late(config, steps, entry, deadline, waits)
            continue
        number, joiner = entry
        got, revision = await _await_close(
            config, steps, me.node_id, (number, joiner), deadline, last, waits
        )
        if isinstance(got, Assignment) and got.place is not None:
            book.exclusions.learn(got)
            on_record(got)
            book.round_hint = number + 1
            book.known_restarts = restarts_kept(number, got.restarts, book.known_restarts)
            rnd = round_of(got, got.place, book.known_restarts)
            steps.watch([rnd.leader_id], revision)
            return rnd
        assert isinstance(got, RoundRecord)  # the steps read the record for any other
        record = got
        if record.aborted:
            raise CoordinationError(record.aborted)
        book.exclusions.learn(record)
        on_record(record)
        ids = record.node_ids()
        if me.node_id not in ids and me.node_id in record.excluded:
            raise excluded_error(me.node_id, config.run_id, record.excluded[me.node_id])
        book.round_hint = number + 1
        if me.node_id not in ids:
            # It closed as this node joined: late for it, as if it had been found closed (a
            # scale-up where it has room). Not a round of its own next, which would close
            # without the nodes it runs on (seen on a busy machine: two jobs of one node each).
            await _as_late(config, steps, Late(number, record), deadline, waits)
            continue
        book.known_restarts = restarts_kept(number, record.restarts, book.known_restarts)
        rnd = Round.of_members(
            number, record.members, book.known_restarts, ids.index(me.node_id), record.excluded
        )
        steps.watch(ids[1:] if rnd.group_rank == 0 else ids[:1], revision)
        return rnd


async def _await_close(
    config: ServeConfig,
    steps: RoundSteps,
    node_id: str,
    entry: tuple[int, int],
    deadline: float,
    last: Round | None,
    waits: RoundWaits | None,
) -> tuple[RoundRecord | Assignment, int | None]:
    """Wait for round `number` (`entry`: it, and this node's place among its joiners) to
    close; close it when it is this node's turn."""
    number, joiner = entry
    closed = steps.spawn(steps.closing(number, node_id), f"round-{number}-closed")

    async def close_when_due() -> None:
        loop = asyncio.get_running_loop()
        if joiner >= config.nnodes_max:
            await last_call(
                number, config.rdzv_last_call_timeout_s, lambda: steps.returning(number, deadline)
            )
            await steps.close(number, False, deadline)
        elif joiner >= config.nnodes_min:
            await asyncio.sleep(config.rdzv_last_call_timeout_s)
            await steps.close(number, False, deadline)
        await asyncio.sleep(max(0.0, deadline - loop.time()))
        await steps.close(number, True, deadline)

    closer = steps.spawn(close_when_due(), f"round-{number}-closer")
    progress = steps.spawn(
        report_progress(
            config, number, last, partial(steps.joined, number), deadline, waits, known=joiner
        ),
        f"round-{number}-progress",
    )
    try:
        both: set[asyncio.Future[Any]] = {closed, closer}
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        if not closed.done():
            closer.result()  # it ended before the round closed: only by raising
        return await closed
    finally:
        for task in (closer, closed, progress):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _as_late(
    config: ServeConfig, steps: RoundSteps, late: Late, deadline: float, waits: RoundWaits | None
) -> None:
    """Round `late.number` runs without this node: ask what a late node asks (late_request),
    then await its end (as a standby, where it asks nothing)."""
    request = late_request(late, config.node_id, config.nnodes_max)
    if request is not None:
        await steps.ask(late.number, request, deadline)
    else:
        await stand_by(late, waits, lambda since: steps.register_standby(late, since))
    if (over := job_over(await steps.ending(late.number))) is not None:
        raise over
