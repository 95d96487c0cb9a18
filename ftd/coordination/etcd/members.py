"""Which etcd member stopped answering, and when it is back: for the operator.

The client moves on to another member at once (etcd_client/transport.py); this only tells
the operator, with a `coordination_endpoint_down` event when a member does not answer a
health probe and `coordination_endpoint_up` when it does again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ftd.coordination.base import Report
from ftd.status.event_kind import EventKind
from ftd.tasks import Background

log = logging.getLogger("ftd.rendezvous")

PROBE_PAUSE_S = (0.5, 10.0)


class MemberWatch:
    """One probe task per member that failed a request, until it answers again."""

    def __init__(self, probe: Callable[[str], Awaitable[str | None]], report: Report) -> None:
        self._probe = probe
        """None when the member answers a health check, else why not."""
        self._report = report
        self._down: set[str] = set()
        """The endpoints being watched until they answer again."""
        self._watches = Background()
        self.reaching: Callable[[str, str], object] | None = None
        """Hears each failure while the node reaches etcd at start (progress.Reaching)."""

    def failed(self, endpoint: str, reason: str) -> None:
        if self.reaching is not None:
            self.reaching(reason, endpoint)
        if endpoint not in self._down and self._watches.spawn(
            self._watch(endpoint, reason), f"ftd-etcd-member-{endpoint}"
        ):
            self._down.add(endpoint)

    async def close(self) -> None:
        await self._watches.close()

    async def _watch(self, endpoint: str, reason: str) -> None:
        try:
            if await self._probe(endpoint) is None:
                return  # it answers: a passing fault (a leader election, a busy member)
            log.warning("etcd member %s does not answer (%s)", endpoint, reason)
            self._report(
                EventKind.COORDINATION_ENDPOINT_DOWN, {"endpoint": endpoint, "reason": reason}
            )
            since, pause = time.monotonic(), PROBE_PAUSE_S[0]
            while await self._probe(endpoint) is not None:
                await asyncio.sleep(pause)  # a health check of a member that is away
                pause = min(pause * 2, PROBE_PAUSE_S[1])
            after_s = round(time.monotonic() - since, 3)
            log.warning("etcd member %s answers again after %.1f s", endpoint, after_s)
            self._report(
                EventKind.COORDINATION_ENDPOINT_UP, {"endpoint": endpoint, "after_s": after_s}
            )
        finally:
            self._down.discard(endpoint)
