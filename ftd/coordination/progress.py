"""What a node says while it waits for the rendezvous (both backends), to its board and to the
log every PROGRESS_S: reaching for the endpoint (the status's `connecting`: each failed try's
error, the time left), then waiting in a round to form (`waiting`: who joined, who is missing,
the time left) each time it reads who joined."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

from ftd.config.serve import ServeConfig
from ftd.coordination.base import Round, RoundWaits
from ftd.coordination.shared_rounds import JOINED_NAMES_MAX
from ftd.status.model import Connecting, Waiting
from ftd.text import escape

log = logging.getLogger("ftd.rendezvous")

PROGRESS_S = 5.0
"""A node waiting for others to join says who is there this often."""
FIRST_LOOK_S = 1.0
"""Its board hears it first this long into the wait: a round that forms at once (nearly
every round) costs no read of who joined (tests/coordination/test_multinode.py counts them)."""


MAX_ERROR_CHARS = 300
"""A try's error as the status keeps it (the backend's text may be anyone's)."""


class Reaching:
    """A node reaching for its rendezvous endpoint: said to the board (`waits`) at once and at
    each failed try, to the log every PROGRESS_S; `done()` once reached or given up."""

    def __init__(self, endpoint: str, timeout_s: float, waits: RoundWaits | None) -> None:
        now = time.time()
        self._waits = waits
        self._record = Connecting(endpoint, now, now + timeout_s)
        self._said = time.monotonic()
        self._tell(self._record)

    def _tell(self, record: Connecting | None) -> None:
        if self._waits is not None:
            self._waits.connecting(record)

    def failed(self, error: str, where: str | None = None) -> None:
        """A try failed with `error`; `where`: which of several endpoints (etcd's members)."""
        if where is not None and where != self._record.endpoint:
            error = f"{where}: {error}"
        record = self._record = replace(
            self._record,
            tries=self._record.tries + 1,
            last_error=escape(" ".join(error[: 4 * MAX_ERROR_CHARS].split()), MAX_ERROR_CHARS),
        )
        self._tell(record)
        if time.monotonic() - self._said >= PROGRESS_S:
            self._said = time.monotonic()
            log.info(
                "still connecting to %s: %s (%d tries); the join timeout in %.0fs",
                record.endpoint,
                record.last_error,
                record.tries,
                max(0.0, record.gives_up_at - time.time()),
            )

    def done(self) -> None:
        self._tell(None)


async def report_progress(
    config: ServeConfig,
    number: int,
    last: Round | None,
    joined: Callable[[bool], Awaitable[tuple[int, list[str]]]],
    deadline: float,
    waits: RoundWaits | None,
    known: int = 0,
) -> None:
    """Until cancelled: who joined round `number` and who of the round before (`last`) is not
    back yet, read FIRST_LOOK_S into the wait for the board (`waits`), then every PROGRESS_S
    for the board and the log, with when the join timeout (`deadline`, the loop's clock) ends
    the wait. `joined(names)` reads how many joined and, with `names`, the names of at most
    JOINED_NAMES_MAX of them (who is not back is known only while every name is read). Names
    are read while at most JOINED_NAMES_MAX joined (`known`: as many as this node saw, its
    joiner number at first); past that a look reads the count alone (every node of a restart
    looks at once, as the round closes: 64 records each at 1,024 nodes cost 0.8 ms of CPU a
    look, the count 0.2). A read that fails is said and tried again. The board hears that the
    wait is over when this ends."""
    loop = asyncio.get_running_loop()
    # A node that holds no list of the round before (a large round) names nobody missing.
    previous: Sequence[str] = (last.node_ids or ()) if last is not None else ()
    seen = known

    async def look(say: bool) -> None:
        nonlocal seen
        named = seen <= JOINED_NAMES_MAX
        try:
            count, present = await joined(named)
        except Exception as error:  # the wait itself says what a lost backend means
            if say:
                log.info("round %d: waiting for nodes (cannot read who joined: %s)", number, error)
            return
        seen = count
        left = max(0.0, deadline - loop.time())
        every_name = named and count <= JOINED_NAMES_MAX
        missing = [n for n in previous if n not in present] if every_name else []
        if waits is not None:
            waits.waiting(
                Waiting(
                    number,
                    config.rdzv_endpoint,
                    tuple(present),
                    tuple(missing),
                    config.nnodes_min,
                    config.nnodes_max,
                    gives_up_at=time.time() + left,
                    joined_count=count,
                )
            )
        if say:
            log.info(
                "round %d: waiting for nodes: %d joined (%s%s), %d to %d wanted%s; "
                "the join timeout in %.0fs",
                number,
                count,
                ", ".join(present) or "none",
                "" if every_name else ", ...",
                config.nnodes_min,
                config.nnodes_max,
                f"; not back yet: {', '.join(missing)}" if missing else "",
                left,
            )

    try:
        await asyncio.sleep(FIRST_LOOK_S)
        await look(say=False)
        while True:
            await asyncio.sleep(PROGRESS_S)
            await look(say=True)
    finally:
        if waits is not None:
            waits.waiting(None)
