"""A round's end and, after a hang, its culprit on etcd, heard through one watch per node.

Every node watches its round's request (what ends the round) from the round's start. The
culprit's decision is written under the request's key (`r<N>/request/culprit`), so that same
watch, kept open after a hang's request for HOLD_S, hears the decision too: a node that shares
its collectives makes one transaction (share, and read the decision) and opens no watch of its
own. At 1,024 nodes those watches, opened at once, each a connection and a stream to set up on a
loaded etcd, were the larger part of what naming a culprit cost; the ends of the nodes still to
hear the request waited behind them. A node without its end's watch (it was dropped, or it
stopped listening) watches the decision itself, as before (kv.await_decided).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from ftd.coordination.base import CoordinationError
from ftd.coordination.etcd.client import (
    EtcdBadAnswer,
    EtcdCompacted,
    EtcdUnavailable,
    EventType,
    KeyValue,
)
from ftd.coordination.etcd.client.records import TxnOp
from ftd.coordination.etcd.kv import RETRY_PAUSE_S, RecordKv
from ftd.coordination.job_culprit import DECISION_WAIT_S
from ftd.coordination.records import JobCulprit, RequestRecord
from ftd.coordination.shared_rounds import key
from ftd.tasks import within

CULPRIT = "request/culprit"
Heard = asyncio.Future["JobCulprit | None"]
HOLD_S = 2 * DECISION_WAIT_S
"""How long a node's end watch listens for the culprit after a hang's request (a node waits
DECISION_WAIT_S from its share, made once it heard the request)."""

Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]


class RoundEnds:
    """This node's watches of its rounds' ends; per round, the culprit one of them heard."""

    def __init__(self, kv: RecordKv, spawn: Spawn) -> None:
        self._kv = kv
        self._spawn = spawn
        self._closed_at: dict[int, int] = {}
        """By round: the revision it closed at, until its end's first watch starts there."""
        self._culprits: dict[int, tuple[asyncio.Future[RequestRecord], Heard]] = {}
        """By round: the request its end watch heard (its first, or a later one once that one
        stopped), and the decision it heard (None once it stopped listening without one)."""

    def began(self, number: int, closed_at: int | None) -> None:
        """This node has round `number`, closed at revision `closed_at`."""
        self._closed_at = {} if closed_at is None else {number: closed_at}

    def ended(self, number: int) -> asyncio.Future[RequestRecord]:
        """Round `number`'s request, once decided (cancel it to stop watching). The round's
        first watch, made as it began, starts at its closing revision, with no read: no
        request comes before the round closed (1,024 reads fewer as a round forms). A later
        one (the round is older: etcd would replay every revision since) starts now, and
        reads."""
        loop = asyncio.get_running_loop()
        since = self._closed_at.pop(number, None)
        for old in [n for n in self._culprits if n < number - 1]:
            del self._culprits[old]
        end: asyncio.Future[RequestRecord] = loop.create_future()
        culprit: Heard = loop.create_future()
        if number not in self._culprits or self._culprits[number][1].done():
            self._culprits[number] = (end, culprit)  # else the round's first, still listening
        task = self._spawn(self._watch(number, end, culprit, since), f"round-{number}-request")

        def stopped(done: asyncio.Task[None]) -> None:
            if not culprit.done():
                culprit.set_result(None)
            if end.done():
                return
            if done.cancelled():
                end.cancel()
            elif (error := done.exception()) is not None:
                end.set_exception(error)

        task.add_done_callback(stopped)
        end.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
        end.add_done_callback(lambda f: f.cancelled() or f.exception())  # the caller's to read
        return end

    async def await_culprit(
        self, number: int, shared: Sequence[TxnOp], within_s: float
    ) -> JobCulprit | None:
        """The decision of round `number`: `shared` made and the decision read in one call,
        then heard by the end's watch; None when none came within `within_s`."""
        slot = key(number, CULPRIT)
        end, heard = self._culprits.get(number, (None, None))
        # The watch hears what comes after its start only: it is used once it heard the request
        # (so it began before this call's read), as every node's has when it takes part.
        if not _heard(end) or heard is None or (heard.done() and heard.result() is None):
            decided = self._kv.await_decided(slot, JobCulprit, changes=shared)
            try:
                return (await within(decided, within_s))[0]
            except TimeoutError:
                return None
        listening, kv = heard, self._kv

        def read() -> Awaitable[tuple[JobCulprit | None, int]]:
            if shared:
                return kv.read_decided_with(shared, slot, JobCulprit)
            return kv.read_decided(slot, JobCulprit)  # no read-only transaction (kv.reads)

        async def read_then_hear() -> JobCulprit | None:
            record, _ = await kv.call(f"read {slot}", read, None)
            if record is None:
                record = await asyncio.shield(listening)
            if record is None:  # the end's watch stopped first (dropped): watch it here
                record, _ = await kv.await_decided(slot, JobCulprit)
            return record

        try:
            return await within(read_then_hear(), within_s)
        except TimeoutError:
            return None

    async def _watch(
        self,
        number: int,
        end: asyncio.Future[RequestRecord],
        culprit: asyncio.Future[JobCulprit | None],
        since: int | None,
    ) -> None:
        """Hear the request, and after a hang's the culprit, until both are heard or HOLD_S
        passed since the request; an absent etcd is waited out, as long as it takes."""
        kv, loop = self._kv, asyncio.get_running_loop()
        request_key, culprit_key = key(number, "request"), key(number, CULPRIT)

        def over() -> bool:
            return end.done() and (end.cancelled() or not end.result().hang or culprit.done())

        def took(request: RequestRecord) -> None:
            end.set_result(request)
            hold.reschedule(loop.time() + HOLD_S)

        def heard(name: str, raw: KeyValue) -> None:
            """A put under the request's key: the request, the culprit, or neither (a key
            planted beside them is not read)."""
            if name == request_key and not end.done():
                if (request := kv.decode(raw, RequestRecord)) is not None:
                    took(request)
            elif name == culprit_key and not culprit.done():  # noqa: SIM102 (decoded only then)
                if (found := kv.decode(raw, JobCulprit)) is not None:
                    culprit.set_result(found)

        try:
            async with asyncio.timeout(None) as hold:
                while not over():
                    if kv.closing:
                        raise CoordinationError("the daemon is stopping", "stopped")
                    start = None if since is None else since + 1
                    watch = kv.etcd.watch(request_key, prefix=True, start_revision=start)
                    try:
                        async with watch as events:
                            kv.ops += 1
                            if not end.done() and start is None:
                                record, _ = await kv.call(
                                    f"read {request_key}",
                                    lambda: kv.read_decided(request_key, RequestRecord),
                                    None,
                                )
                                if record is not None:
                                    took(record)
                            if over():
                                return
                            async for event in events:
                                kv.availability.answered()
                                if event.type is EventType.PUT:
                                    heard(event.kv.key.decode(errors="replace"), event.kv)
                                    if over():
                                        return
                    except EtcdCompacted:
                        since = None  # gone: from now on, and a read
                        continue
                    except (EtcdUnavailable, EtcdBadAnswer) as error:
                        kv.availability.failed(f"watch {request_key}", error)
                        if watch.next_revision is not None:  # on from where it stood
                            since = watch.next_revision - 1
                        await asyncio.sleep(RETRY_PAUSE_S[1])  # back-off: etcd is away
        except TimeoutError:
            if not hold.expired():
                raise


def _heard(end: asyncio.Future[RequestRecord] | None) -> bool:
    return end is not None and end.done() and not end.cancelled() and end.exception() is None
