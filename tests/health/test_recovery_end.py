"""A restart is over at a defined point, the same for every job: where the job's ranks were
seen making optimizer steps, at every new rank's first step; else at their first sign of life
(a heartbeat, a section, resumed()). A rank that says it is alive at once and then loads for a
while is not back before it steps again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.test_hang_building_up import rank_progress
from tests.conftest import BIN, ServeFactory
from tests.support.api import api_of, until

pytestmark = pytest.mark.timeout(120)
LOAD_S = 1.5


async def test_a_restart_ends_at_the_first_step_not_the_first_heartbeat(
    serve: ServeFactory, tmp_path: Path
) -> None:
    fail = tmp_path / "fail"
    run = await serve(
        "--nproc-per-node", "1", "--max-restarts", "1",
        script=BIN / "slow_start_rank.py",
        script_args=("--fail-file", str(fail), "--load-s", str(LOAD_S)),
    )  # fmt: skip
    async with api_of(run) as api:  # until the daemon has seen attempt 0's steps
        await until(api, "a step seen", lambda status: bool(rank_progress(status).get("steps")))
    fail.touch()
    assert await run.wait(timeout=90) == 0, run.stderr.text[-3000:]
    [recovery] = run.event_data("recovery")
    # The new rank beat at once, then loaded for LOAD_S: its start-up is all of `init`.
    assert recovery["stages"]["init"] >= LOAD_S, recovery
