"""What both rendezvous backends (c10d/, etcd/) say the same way about rounds: their keys, the
record of a round that could not form, the refusal of an excluded node, a node that came late."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError, new_request
from ftd.coordination.records import RequestRecord, RoundRecord

log = logging.getLogger("ftd.rendezvous")


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
    members = [m.node_id for m in late.record.members]
    if node_id in members:
        reason = f"node {node_id} came back: its ranks of round {late.number} are gone"
        return new_request("restart", reason, node_id)
    if len(members) < nnodes_max:
        reason = f"node {node_id} joined: scaling up from {len(members)} nodes"
        return new_request("restart", reason, node_id)
    log.info("round %d is full (%d nodes): waiting for its end", late.number, len(members))
    return None
