"""What a node waiting for a round to form says while it waits (both backends)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from ftd.config.serve import ServeConfig

log = logging.getLogger("ftd.rendezvous")

PROGRESS_S = 5.0
"""A node waiting for others to join says who is there this often."""


async def report_progress(
    config: ServeConfig,
    number: int,
    previous: Sequence[str],
    joined: Callable[[], Awaitable[list[str]]],
    deadline: float,
) -> None:
    """Every PROGRESS_S until cancelled: who joined round `number`, who of the previous round
    (`previous`) is not back yet, and when the join timeout ends the wait. `joined` reads the
    nodes with a valid join record; a read that fails is said and tried again."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(PROGRESS_S)
        try:
            present = await joined()
        except Exception as error:  # the wait itself says what a lost backend means
            log.info("round %d: waiting for nodes (cannot read who joined: %s)", number, error)
            continue
        missing = [n for n in previous if n not in present]
        log.info(
            "round %d: waiting for nodes: %d joined (%s), %d to %d wanted%s; "
            "the join timeout in %.0fs",
            number,
            len(present),
            ", ".join(present) or "none",
            config.nnodes_min,
            config.nnodes_max,
            f"; not back yet: {', '.join(missing)}" if missing else "",
            max(0.0, deadline - loop.time()),
        )
