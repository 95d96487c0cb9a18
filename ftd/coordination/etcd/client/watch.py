"""A watch that outlives the member it talks to: when its stream breaks (the member died, lost
its leader, went quiet past `idle_timeout_s`, or answered garbage), it reconnects to another
member from the last revision it delivered, skipping the events of that revision it already
gave out: no event lost, none twice."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from types import TracebackType

from ftd.coordination.etcd.client.errors import (
    AttemptFailed,
    EtcdBadAnswer,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    TokenExpired,
    clip,
)
from ftd.coordination.etcd.client.records import Key, WatchEvent
from ftd.coordination.etcd.client.transport import RETRY_PAUSE_S, Stream, Transport, parse
from ftd.coordination.etcd.client.wire import Namespace, WatchLine, WatchResult

log = logging.getLogger("ftd.etcd")


class Watch:
    """Events on a key (or every key under a prefix), oldest first, as an async iterator; use
    it as an async context manager so its stream closes. `next_revision` is where it stands:
    every event before it was delivered (etcd's progress notices move it too). Raises
    EtcdUnavailable (EtcdBadAnswer) when no member takes the watch, or its streams keep
    breaking, within the client's timeout: iterating again tries again from where it stood.
    EtcdCompacted when the revision to resume from is gone."""

    def __init__(
        self,
        transport: Transport,
        namespace: Namespace,
        key: Key,
        *,
        prefix: bool,
        start_revision: int | None,
        prev_kv: bool,
        idle_timeout_s: float | None,
    ) -> None:
        if start_revision is not None and start_revision < 1:
            raise ValueError(f"a watch starts at revision 1 or later, not {start_revision}")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, not {idle_timeout_s}")
        self._transport = transport
        self._namespace = namespace
        self._selector: dict[str, object] = {
            **namespace.range(key, prefix),
            "prev_kv": prev_kv,
            "progress_notify": True,
        }
        self._idle_timeout_s = idle_timeout_s
        self._resume = start_revision
        self._delivered_at_resume = 0
        self._skip = 0
        self._last_received = 0
        self._pending: deque[WatchEvent] = deque()
        self._stream: Stream | None = None
        self._breaks: deque[tuple[float, str, str, bool]] = deque()
        self._closed = False
        self.reconnects = 0

    @property
    def next_revision(self) -> int | None:
        """The revision a reconnect starts from (None before the first connect of a watch
        from "now")."""
        return self._resume

    async def __aenter__(self) -> Watch:
        if self._stream is None:
            await self._connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        self._drop_stream()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._receive()
        event = self._pending.popleft()
        if event.revision == self._resume:
            self._delivered_at_resume += 1
        else:
            self._resume, self._delivered_at_resume = event.revision, 1
        return event

    async def _receive(self) -> None:
        if self._stream is None:
            await self._connect()
        stream = self._stream
        assert stream is not None
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                line = await stream.line()
            self._take(self._result(stream.endpoint, parse(WatchLine, line)))
        except AttemptFailed as failure:
            await self._broke(stream, failure.reason, failure.bad_answer)
        except TokenExpired:
            await self._broke(stream, "its auth token expired", False)
        except TimeoutError:
            await self._broke(stream, f"quiet for {self._idle_timeout_s} s", False)
        except EtcdError:
            self._drop_stream()
            raise

    async def _broke(self, stream: Stream, reason: str, bad_answer: bool) -> None:
        """Drop the stream; the next receive reconnects elsewhere. Streams that keep breaking
        (more than twice per member within the client's timeout) end the watch, and
        reconnects back off, so a flapping or hostile member cannot make a busy loop."""
        if self._closed:
            return  # closed meanwhile: the broken stream is the closed one
        log.warning(
            "etcd watch on %s broke (%s); resuming from revision %s",
            stream.endpoint,
            reason,
            self._resume,
        )
        self._transport.demote(stream.endpoint, reason)
        self._drop_stream()
        self.reconnects += 1
        now = time.monotonic()
        self._breaks.append((now, stream.endpoint, reason, bad_answer))
        while self._breaks[0][0] < now - self._transport.timeout_s:
            self._breaks.popleft()
        if len(self._breaks) > 2 * len(self._transport.endpoints):
            breaks, self._breaks = self._breaks, deque()
            reasons = {endpoint: why for _, endpoint, why, _ in breaks}
            if any(bad for *_, bad in breaks):
                listed = "; ".join(f"{ep}: {why}" for ep, why in reasons.items())
                raise EtcdBadAnswer(f"etcd watch streams keep giving bad answers ({listed})")
            raise EtcdUnavailable(
                f"etcd watch streams broke {len(breaks)} times "
                f"within {self._transport.timeout_s:g} s",
                endpoints=list(reasons),
                reasons=list(reasons.values()),
            )
        if len(self._breaks) > 1:
            await asyncio.sleep(min(RETRY_PAUSE_S[0] * 2 ** len(self._breaks), RETRY_PAUSE_S[1]))

    async def _connect(self) -> None:
        request = dict(self._selector)
        if self._resume is not None:
            request["start_revision"] = str(self._resume)

        async def attempt(endpoint: str, budget_s: float) -> tuple[Stream, WatchResult]:
            body: dict[str, object] = {"create_request": request}
            stream = await self._transport.open_stream(endpoint, "/v3/watch", body, budget_s)
            try:
                async with asyncio.timeout(budget_s):
                    line = await stream.line()
                created = self._result(endpoint, parse(WatchLine, line))
                if not created.created:
                    reason = "the first answer did not create the watch"
                    raise AttemptFailed(reason, sent=True, bad_answer=True)
            except TimeoutError:
                stream.close()
                raise AttemptFailed(f"no answer within {budget_s:.2f} s", sent=True) from None
            except BaseException:
                stream.close()
                raise
            return stream, created

        self._stream, created = await self._transport.failover(attempt, mutation=False)
        if self._resume is None:
            self._resume = created.header.revision + 1
            self._delivered_at_resume = 0
        self._skip = self._delivered_at_resume
        self._last_received = 0

    def _result(self, endpoint: str, line: WatchLine) -> WatchResult:
        """The line's result; what an error or a cancellation means, raised."""
        if line.error is not None:
            raise self._transport.stream_error(endpoint, line.error)
        if line.result is None:
            raise AttemptFailed("a watch line without a result", sent=True, bad_answer=True)
        result = line.result
        if not result.canceled:
            return result
        reason = result.cancel_reason
        if result.compact_revision > 0:
            raise EtcdCompacted(
                f"etcd compacted the revisions before {result.compact_revision}",
                compact_revision=result.compact_revision,
                endpoint=endpoint,
            )
        if "permission denied" in reason:
            raise TokenExpired(clip(reason))
        if "no leader" in reason:
            raise AttemptFailed(f"etcd: {clip(reason)}", sent=False)
        raise EtcdError(f"etcd cancelled the watch: {clip(reason)}", endpoint=endpoint)

    def _take(self, result: WatchResult) -> None:
        if not result.events:
            resume = self._resume or 0
            if not result.created and result.header.revision >= resume:
                # A progress notice: every event up to that revision was sent.
                self._resume, self._delivered_at_resume = result.header.revision + 1, 0
                self._skip = 0
            return
        for wire_event in result.events:
            event = self._namespace.event(wire_event)
            if event.revision < self._last_received:
                raise AttemptFailed("events out of revision order", sent=True, bad_answer=True)
            self._last_received = event.revision
            if self._resume is not None and event.revision < self._resume:
                continue
            if event.revision == self._resume and self._skip > 0:
                self._skip -= 1
                continue
            self._pending.append(event)

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
