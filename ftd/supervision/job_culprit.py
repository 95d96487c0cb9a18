"""This node's part in naming the job's culprit of a hang (ftd/coordination/job_culprit.py says
how it is decided): once a round ended on a hang verdict, wherever it was judged, the node shares
what its ranks had entered; the round's node rank 0 gathers every node's and decides; every node
reads the decision and tells it (a `job_culprit` event, the status's `job_culprit`, GET
/v1/cluster, the restart's recovery cause). Off the restart's path: the next round is joined
meanwhile, and a store that does not answer costs the name, never the restart.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ftd import containment
from ftd.coordination.base import Round
from ftd.coordination.job_culprit import DECISION_WAIT_S, decide
from ftd.coordination.records import Collectives, JobCulprit, RequestRecord
from ftd.status.event_kind import EventKind

if TYPE_CHECKING:
    from ftd.supervision.attempt import AttemptTools
    from ftd.supervision.restarts import RecoveryTimeline
    from ftd.tasks import Background

log = logging.getLogger("ftd.daemon")


class JobCulpritShare:
    def __init__(
        self, tools: AttemptTools, background: Background, recovery: RecoveryTimeline
    ) -> None:
        self._tools = tools
        self._background = background
        self._recovery = recovery

    def round_ended(self, rnd: Round, request: RequestRecord) -> None:
        """`request` ended `rnd`: where it was a hang verdict, this node's part, in the
        background."""
        if request.hang:
            self._background.spawn(self._take_part(rnd), "job-culprit")

    async def _take_part(self, rnd: Round) -> None:
        try:
            culprit = await self._decided(rnd)
        except Exception as error:  # the store lost or refusing: the name is lost, not the job
            containment.record("job culprit", error)
            return
        if culprit is None:
            log.info("round %d: the job's culprit was not named", rnd.number)
            return
        self._tell(rnd, culprit)

    async def _decided(self, rnd: Round) -> JobCulprit | None:
        coordinator, me = self._tools.coordinator, self._tools.config.node_id
        mine = self._tools.health.collectives()
        shared = Collectives(
            round=rnd.number,
            node_id=me,
            group_rank=rnd.group_rank,
            lowest=mine.lowest if mine else None,
            rank=mine.rank if mine else None,
            since=mine.since if mine else None,
            waiting=mine.waiting if mine else 0,
            ranks=mine.ranks if mine else 0,
            judged=mine.judged if mine else False,
        )
        if rnd.group_rank != 0:
            return await coordinator.await_culprit(rnd, DECISION_WAIT_S, shared)
        await coordinator.share_collectives(rnd, shared)
        found = await coordinator.gather_collectives(rnd)
        decision = decide(rnd.number, found, time.time())
        if decision is not None:
            return await coordinator.decide_culprit(rnd, decision)
        return await coordinator.await_culprit(rnd, DECISION_WAIT_S)

    def _tell(self, rnd: Round, culprit: JobCulprit) -> None:
        tools, me = self._tools, self._tools.config.node_id
        mine = tools.health.collectives()
        victim = culprit.node_id != me
        view: dict[str, Any] = {
            **culprit.model_dump(),
            "victim": victim,
            "own_verdict_rank": mine.rank if mine is not None and mine.judged else None,
        }
        if victim and mine is not None and mine.judged:
            log.warning(
                "round %d: this node's verdict named rank %d, a victim: %s",
                rnd.number,
                mine.rank,
                culprit.reason,
            )
        else:
            log.warning("round %d: %s", rnd.number, culprit.reason)
        tools.board.job_culprit(view)
        tools.events.emit(EventKind.JOB_CULPRIT, **view)
        self._recovery.culprit_named(culprit.reason)
