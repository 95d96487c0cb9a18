"""What a node waiting for a round to form says while it waits (both backends): to its board
(the status's `waiting`: who joined, who is missing, the time left) each time it reads who
joined, and to the log every PROGRESS_S."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ftd.config.serve import ServeConfig
from ftd.coordination.base import Round, RoundWaits
from ftd.status.model import Waiting

log = logging.getLogger("ftd.rendezvous")

PROGRESS_S = 5.0
"""A node waiting for others to join says who is there this often."""
FIRST_LOOK_S = 1.0
"""Its board hears it first this long into the wait: a round that forms at once (nearly
every round) costs no read of who joined (tests/coordination/test_multinode.py counts them)."""


async def report_progress(
    config: ServeConfig,
    number: int,
    last: Round | None,
    joined: Callable[[], Awaitable[list[str]]],
    deadline: float,
    waits: RoundWaits | None,
) -> None:
    """Until cancelled: who joined round `number` and who of the round before (`last`) is not
    back yet, read FIRST_LOOK_S into the wait for the board (`waits`), then every PROGRESS_S
    for the board and the log, with when the join timeout (`deadline`, the loop's clock) ends
    the wait. `joined` reads the nodes with a valid join record; a read that fails is said and
    tried again. The board hears that the wait is over when this ends."""
    loop = asyncio.get_running_loop()
    previous = last.node_ids if last is not None else []

    async def look(say: bool) -> None:
        try:
            present = await joined()
        except Exception as error:  # the wait itself says what a lost backend means
            if say:
                log.info("round %d: waiting for nodes (cannot read who joined: %s)", number, error)
            return
        left = max(0.0, deadline - loop.time())
        missing = [n for n in previous if n not in present]
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
                )
            )
        if say:
            log.info(
                "round %d: waiting for nodes: %d joined (%s), %d to %d wanted%s; "
                "the join timeout in %.0fs",
                number,
                len(present),
                ", ".join(present) or "none",
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
