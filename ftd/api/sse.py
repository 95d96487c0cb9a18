"""`GET /v1/events` as a server-sent-event stream: monotonic ids, `Last-Event-ID` resume,
keep-alive comments, and an end when the daemon closes the API."""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp import web

from ftd.events import Event, EventLog

KEEPALIVE_S = 15.0


def format_event(event: Event) -> bytes:
    data = json.dumps(event.to_dict(), default=str)
    return f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n".encode()


async def stream_events(
    request: web.Request, events: EventLog, since: int, closing: asyncio.Event
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    cursor = since
    await response.write(b"retry: 1000\n\n")
    closed = asyncio.ensure_future(closing.wait())
    try:
        while not closing.is_set():
            waiter = asyncio.ensure_future(events.wait_after(cursor))
            done, _ = await asyncio.wait(
                {waiter, closed}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter not in done:
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
                if not done:
                    await response.write(b": keep-alive\n\n")
                continue
            for event in waiter.result():
                await response.write(format_event(event))
                cursor = event.id
    except ConnectionResetError:
        pass  # the client went away
    finally:
        closed.cancel()
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response
