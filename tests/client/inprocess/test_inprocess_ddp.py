"""In-process restart under DDP: twenty faults in one run, every one recovered in the same
processes (tests/bin/inprocess_ddp.py, DistributedDataParallel over gloo, 2 ranks).

Two torch 2.13 behaviours used to stall such a restart until the hard timeout: a module imported
during the first round pinned that round's default group (its sockets stayed open, so the peer
blocked in DDP's allreduce was never released), and DDP's Reducer, freed with the failed call's
frames, destroyed its gloo group with the GIL held while a gloo worker waited for the GIL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import BIN, ServeFactory
from tests.support.inprocess import ENV, PRELOAD

FAULTS = 20
WORLD = 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("faults", "options"),
    [(FAULTS, ()), (5, ("--nvrx-api",))],
    ids=["twenty-faults", "nvrx-wrapper-arguments"],
)
async def test_ddp_faults_all_recover_in_process(
    serve: ServeFactory, tmp_path: Path, faults: int, options: tuple[str, ...]
) -> None:
    """The second case passes NVRx's Wrapper arguments (store_kwargs, CudaHealthCheck and
    FaultCounter composed, RetryController, ThreadedFinalize, timeouts) and writes a checkpoint
    inside call_wrapper.atomic() every step, as NVIDIA's basic_example does."""
    out = tmp_path / "out"
    run = await serve(
        "--nproc-per-node", str(WORLD), "--restart-mode", "inprocess", "--max-restarts", "0",
        script=BIN / "inprocess_ddp.py",
        script_args=("--out", str(out), "--faults", str(faults), *options),
        env=ENV,
    )  # fmt: skip
    assert await run.wait(timeout=110) == 0, run.stderr.text[-3000:]
    recorded = run.event_data("inprocess_fault")
    assert len(recorded) == faults, recorded
    assert all(f["kind"] == "exception" and "injected fault" in f["reason"] for f in recorded)
    assert not run.event_data("inprocess_gave_up")
    assert not run.event_data("attempt_failed")
    finals = [json.loads((out / f"final_s{slot}").read_text()) for slot in range(WORLD)]
    assert {f["iteration"] for f in finals} == {faults}
    assert finals[0]["params"] == finals[1]["params"]  # DDP kept the replicas equal
    pids = {json.loads((out / f"round_i0_s{slot}").read_text())["pid"] for slot in range(WORLD)}
    assert pids == {f["pid"] for f in finals}  # the same processes from first to last round


@pytest.mark.timeout(90)
async def test_a_reserve_rank_takes_a_dead_ranks_place(serve: ServeFactory, tmp_path: Path) -> None:
    """3 ranks, at most 2 active: slot 2 waits as a reserve until slot 1 dies (not respawned),
    then joins round 1 as rank 1 of 2."""
    out = tmp_path / "out"
    run = await serve(
        "--nproc-per-node", "3", "--restart-mode", "inprocess", "--no-inprocess-respawn",
        *PRELOAD, script=BIN / "inprocess_reserve.py", script_args=("--out", str(out)), env=ENV,
    )  # fmt: skip
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]

    def call(name: str) -> dict[str, int]:
        data: dict[str, int] = json.loads((out / name).read_text())
        return data

    assert call("call_i0_s0.json") == {"rank": 0, "world": 2}
    assert call("call_i0_s1.json") == {"rank": 1, "world": 2}
    assert not (out / "call_i0_s2.json").exists()  # the reserve did not call the function
    assert call("call_i1_s0.json") == {"rank": 0, "world": 2}
    assert call("call_i1_s2.json") == {"rank": 1, "world": 2}
    assert call("final_s2.json")["sum"] == 2.0
    assert (out / "returned_s0.json").exists() and (out / "returned_s2.json").exists()
