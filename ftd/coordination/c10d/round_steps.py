"""The round rules' steps (ftd/coordination/round_rules.py) on c10d's TCPStore: each a short
call on the operations connection, or a blocking wait on a connection of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

from ftd.coordination.assignment import Assignment
from ftd.coordination.c10d.assigned import assigned_now, await_assigned
from ftd.coordination.c10d.connections import StoreConnections
from ftd.coordination.c10d.liveness import Keepalive
from ftd.coordination.c10d.rounds import StoreRounds
from ftd.coordination.records import Member, RequestRecord, RoundRecord
from ftd.coordination.shared_rounds import Late, key

T = TypeVar("T")


class StoreRoundSteps:
    def __init__(
        self, connections: StoreConnections, rounds: StoreRounds, keepalive: Keepalive
    ) -> None:
        self._connections = connections
        self.book = rounds
        self._keepalive = keepalive

    async def enter(self, me: Member, deadline: float) -> tuple[int, int] | Late:
        return await self._connections.call(self.book.enter, me)

    async def closing(self, number: int, me: str) -> tuple[RoundRecord | Assignment, int | None]:
        wait = self._connections.wait_decided
        slot = key(number, "closed")  # the backup look's
        waiting = partial(await_assigned, me=me)
        now = partial(assigned_now, me=me)
        return await wait(waiting, now, number, slot, "its closing record"), None

    async def close(self, number: int, abort: bool, deadline: float) -> None:
        await self._connections.call(self.book.close, number, abort)

    async def returning(self, number: int, deadline: float) -> list[str]:
        return await self._connections.call(self.book.returning, number)

    async def joined(self, number: int, names: bool) -> tuple[int, list[str]]:
        return await self._connections.call(self.book.joined_some, number, names)

    async def ask(self, number: int, request: RequestRecord, deadline: float) -> None:
        decided = key(number, "request")
        await self._connections.call(lambda s: s.decide(decided, request, RequestRecord))

    async def ending(self, number: int) -> RequestRecord:
        rounds, wait = self.book, self._connections.wait_decided
        slot = key(number, "request")
        return await wait(rounds.await_request, rounds.request_now, number, slot, "its request")

    async def register_standby(self, late: Late, since: float) -> None:
        await self._connections.call(self.book.stand_by, late, since)

    def spawn(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Future[T]:
        return asyncio.ensure_future(work)

    def watch(self, node_ids: list[str], revision: int | None) -> None:
        self._keepalive.watch(node_ids)
