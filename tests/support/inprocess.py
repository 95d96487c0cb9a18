"""What the in-process restart tests share: the training rank and its world, the ranks'
environment, and ranks applying a rank assignment in threads against a real TCPStore."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

from ftd_client import inprocess
from ftd_client.inprocess import FrozenState
from ftd_client.inprocess.exceptions import RestartError
from ftd_client.inprocess.runner import GROUP_CAPTURING_MODULES
from ftd_client.store import tcp_store_client

from tests.conftest import BIN, ROOT

ra = inprocess.rank_assignment

TRAIN = BIN / "inprocess_train.py"
WORLD = 4
ENV = {
    "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]
    )
}
"""The ranks import this checkout's ftd_client, whatever is installed."""
PRELOAD = ("--preload", ",".join(GROUP_CAPTURING_MODULES))
"""The zygote imports what every rank's Wrapper imports before its first round (the modules
that capture the default group): once per daemon instead of once per rank, ~0.7 s of CPU each.
test_inprocess_ddp.py's DDP tests keep the default preload: there the Wrapper's own import is
tested."""


def initial_state(slot: int, world: int) -> FrozenState:
    return FrozenState(slot, world, slot, world, 1, active_rank=slot, active_world_size=world)


def run_ranks(
    assignments: Mapping[int, Callable[[ra.RankAssignmentCtx], ra.RankAssignmentCtx]],
    world: int,
    members: list[int],
    port: int,
) -> dict[int, FrozenState | RestartError]:
    """Each member applies its assignment in its own thread with its own store client, as in
    its own process."""
    results: dict[int, FrozenState | RestartError] = {}

    def rank(slot: int) -> None:
        store = tcp_store_client("127.0.0.1", port, 30)
        try:
            results[slot] = ra.assign(assignments[slot], initial_state(slot, world), members, store)
        except RestartError as error:
            results[slot] = error

    threads = [threading.Thread(target=rank, args=(slot,)) for slot in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(results) == set(members)
    return results
