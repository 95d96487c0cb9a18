"""What both rendezvous backends (c10d/, etcd/) say the same way about rounds: their keys, the
record of a round that could not form, the refusal of an excluded node, a node that came late."""

from __future__ import annotations

from dataclasses import dataclass

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError
from ftd.coordination.records import RoundRecord


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
