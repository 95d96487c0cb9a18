"""`GET /v1/events` as a server-sent-event stream: monotonic ids, `Last-Event-ID` resume,
keep-alive comments, an end when the daemon closes the API, and bounds: at most
`max_event_streams` streams (429 with Retry-After beyond), a bounded queue per stream (a
reader that falls behind gets a final `stream_dropped` message and the stream ends), and a
deadline on every write (a reader that stopped reading is cut off)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter

from aiohttp import web

from ftd.api.connections import ApiLimits, RefusalLog
from ftd.errors import TooManyRequests
from ftd.status.events import Event, EventLog, Lagged, Subscription

log = logging.getLogger("ftd.api")

ENCODED_CACHE = 4096
"""Encoded events kept for the streams (each event is encoded once, not once per reader)."""
DROPPED_EVENT = "stream_dropped"


DROP_REPORT_INTERVAL_S = 60.0


class _Stalled(Exception):
    """A write to the stream did not complete within its deadline."""


class _DropReports:
    """A warning for the first dropped reader, then at most one a minute with the count
    since: readers that keep falling behind must not flood the log."""

    def __init__(self) -> None:
        self._last = -math.inf
        self._since_last = 0

    def dropped(self, peer: str, why: str) -> None:
        now = time.monotonic()
        if now - self._last < DROP_REPORT_INTERVAL_S:
            self._since_last += 1
            return
        more = ""
        if self._since_last:
            more = f" ({self._since_last} more dropped since the last report)"
        log.warning("dropped the event stream of %s: %s%s", peer, why, more)
        self._last, self._since_last = now, 0


class StreamHub:
    """The open event streams of one API: the cap, the counts, the shared encodings."""

    def __init__(self, limits: ApiLimits) -> None:
        self.limits = limits
        self._open: set[Subscription] = set()
        self.refused = 0
        self.dropped: Counter[str] = Counter()
        """Streams ended because the reader fell behind (lagged) or stopped reading (stalled)."""
        self._encoded: dict[int, bytes] = {}
        self._refusals = RefusalLog("API event streams")
        self.reports = _DropReports()
        self._closed = False

    @property
    def open(self) -> int:
        return len(self._open)

    def subscribe(self, events: EventLog, since: int) -> Subscription:
        if self._closed or len(self._open) >= self.limits.max_event_streams:
            self.refused += 1
            self._refusals.refused("cap", f"{self.open} event streams open, the most it keeps")
            raise TooManyRequests(
                f"{len(self._open)} event streams are open, the most this daemon serves: retry "
                "later, or read `GET /v1/events?since=ID` as JSON",
                self.limits.stream_retry_after_s,
            )
        self._refusals.admitted()
        subscription = events.subscribe(since, self.limits.stream_max_pending)
        self._open.add(subscription)
        return subscription

    def release(self, subscription: Subscription) -> None:
        subscription.close()
        self._open.discard(subscription)

    def encode(self, event: Event) -> bytes:
        encoded = self._encoded.get(event.id)
        if encoded is None:
            encoded = format_event(event)
            if len(self._encoded) >= ENCODED_CACHE:
                del self._encoded[next(iter(self._encoded))]
            self._encoded[event.id] = encoded
        return encoded

    def close_all(self) -> None:
        """End every stream (the API is closing) and accept no new ones."""
        self._closed = True
        for subscription in self._open:
            subscription.end()


def format_event(event: Event) -> bytes:
    data = json.dumps(event.to_dict(), default=str)
    return f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n".encode()


def dropped_message(subscription: Subscription, reason: str) -> bytes:
    """The final message to a reader that fell behind. It has no id, so a reconnecting
    EventSource resumes after the last event it did get."""
    data = json.dumps({"reason": reason, "last_id": subscription.cursor})
    return f"event: {DROPPED_EVENT}\ndata: {data}\n\n".encode()


async def _write(response: web.StreamResponse, data: bytes, limits: ApiLimits) -> None:
    try:
        async with asyncio.timeout(limits.stream_write_timeout_s):
            await response.write(data)
    except TimeoutError:
        raise _Stalled from None


async def stream_events(
    request: web.Request, events: EventLog, since: int, hub: StreamHub
) -> web.StreamResponse:
    subscription = hub.subscribe(events, since)  # TooManyRequests beyond the cap
    limits = hub.limits
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    response.force_close()  # a stream ends its connection (an EventSource reconnects)
    peer = request.remote or "the admin socket"
    try:
        await response.prepare(request)
        await _write(response, b"retry: 1000\n\n", limits)
        while True:
            try:
                async with asyncio.timeout(limits.stream_keepalive_s):
                    batch = await subscription.next_batch()
            except TimeoutError:
                await _write(response, b": keep-alive\n\n", limits)
                continue
            except Lagged as lagged:
                hub.dropped["lagged"] += 1
                hub.reports.dropped(peer, f"it {lagged}")
                await _write(response, dropped_message(subscription, str(lagged)), limits)
                break
            if not batch:
                break  # the API is closing
            await _write(response, b"".join(hub.encode(event) for event in batch), limits)
        async with asyncio.timeout(limits.stream_write_timeout_s):
            await response.write_eof()
    except (_Stalled, TimeoutError):
        hub.dropped["stalled"] += 1
        hub.reports.dropped(
            peer, f"a write did not complete in {limits.stream_write_timeout_s:g} s"
        )
        if request.transport is not None:
            request.transport.abort()
    except ConnectionResetError:
        pass  # the client went away
    finally:
        hub.release(subscription)
    return response
