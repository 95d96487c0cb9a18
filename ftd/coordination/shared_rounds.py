"""What both rendezvous backends (c10d/, etcd/) say the same way about rounds: their keys, the
record of a round that could not form, the refusal of an excluded node, a node that came late,
the last call for a round's returning members."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError, new_request
from ftd.coordination.records import RequestRecord, RoundRecord

log = logging.getLogger("ftd.rendezvous")

JOINED_NAMES_MAX = 64
"""A waiting node reads who joined its round every few seconds (progress.py): how many (one
counter, or the count of one range), and their names while at most this many joined. Every name
on every node would be N records read by each of N nodes per look: at 1,024 nodes ~30 ms of CPU
each time on each node, 1,000,000 records read from the store (bench/SCALE.md); this many on
every node is 64 N records at once as a restart's round closes."""


def key(number: int, name: str) -> str:
    return f"r{number}/{name}"


def aborted_round(
    cfg: ServeConfig,
    number: int,
    joined: int,
    unverified: int,
    restarts: int,
    excluded: dict[str, str],
) -> RoundRecord:
    """Round `number` could not form: fewer than MIN nodes joined by the join deadline."""
    return RoundRecord(
        number=number,
        members=(),
        restarts=restarts,
        excluded=excluded,
        aborted=(
            f"round {number}: only {joined} of at least {cfg.nnodes_min} nodes joined within "
            f"--rdzv-join-timeout ({cfg.rdzv_join_timeout_s:g}s)"
            + (
                f"; {unverified} join records failed to verify (do the nodes share one secret?)"
                if unverified
                else ""
            )
        ),
    )


def excluded_error(node_id: str, run_id: str, reason: str) -> CoordinationError:
    return CoordinationError(
        f"node {node_id} is excluded from job {run_id} ({reason}); readmit it with "
        f"`ftd readmit {node_id}` before it may join",
        "excluded",
    )


@dataclass(frozen=True)
class Late:
    """This node found round `number` closed without it."""

    number: int
    record: RoundRecord


def late_request(late: Late, node_id: str, nnodes_max: int) -> RequestRecord | None:
    """What a node that found round `late.number` closed asks of it (both backends): a restart
    when the round counts this node among its members (its daemon started again under the same
    id: the ranks it ran there are gone, and its keepalive, beating again, hides that from the
    others), a scale-up where the round has room, else nothing: it waits for the round's end
    as a standby, and joins the next."""
    members = late.record.node_ids()
    if node_id in members:
        reason = f"node {node_id} came back: its ranks of round {late.number} are gone"
        return new_request("restart", reason, node_id)
    if len(members) < nnodes_max:
        reason = f"node {node_id} joined: scaling up from {len(members)} nodes"
        return new_request("restart", reason, node_id)
    log.info("round %d is full (%d nodes): waiting for its end", late.number, len(members))
    return None


def restarts_kept(number: int, carried: int, known: int) -> int:
    """The restarts used as round `number` carries them, never fewer than seen before."""
    if carried < known:
        log.warning(
            "round %d carries %d restarts used, fewer than the %d seen before "
            "(forged or lost records): keeping %d",
            number,
            carried,
            known,
            known,
        )
    return max(known, carried)


def job_over(request: RequestRecord) -> CoordinationError | None:
    """A round's end that ends the job for every node, a standby's too (both backends)."""
    if request.action == "restart":
        return None
    return CoordinationError(f"the job is over: {request.reason}", request.action)


LAST_CALL_POLL_S = 0.1


def returning_members(
    previous: RoundRecord | None,
    joined: Collection[str],
    excluded: Collection[str],
    unhealthy: Collection[str],
) -> list[str]:
    """The members of the round before that the next round still waits for: not joined yet,
    not excluded, not marked unhealthy in it (a lost node is, once its loss ended the round; a
    node sitting out unhealthy marks itself). A round that has MAX joiners gives them a last
    call before it closes without them, so a standby that joined first does not take the place
    of an active node coming back from a restart."""
    if previous is None or previous.aborted:
        return []
    gone = {*joined, *excluded, *unhealthy}
    return [node for node in previous.node_ids() if node not in gone]


async def last_call(
    number: int, window_s: float, awaited: Callable[[], Awaitable[list[str]]]
) -> None:
    """Round `number` has MAX joiners: wait up to `window_s` until `awaited()` (the returning
    members not joined yet) is empty. Polled: a round closes a few times per job, and a read
    is a fraction of a millisecond."""
    loop = asyncio.get_running_loop()
    until = loop.time() + window_s
    said = False
    while (missing := await awaited()) and loop.time() < until:
        if not said:
            log.info(
                "round %d is full; waiting up to %gs for %s of the round before "
                "(a standby takes the place of a node that does not come back)",
                number,
                window_s,
                ", ".join(missing),
            )
            said = True
        await asyncio.sleep(min(LAST_CALL_POLL_S, max(0.0, until - loop.time())))
