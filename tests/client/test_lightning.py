"""The Lightning callback under ftd serve (skipped where lightning does not install)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import BIN, ServeFactory

# Found, not imported: importing lightning costs each test worker ~1.8 CPU-s at collection.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="lightning is an optional extra"
)


@pytest.mark.timeout(300)
async def test_lightning_callback_sections_hang_and_resume(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await serve(
        "--nproc-per-node", "1", "--max-restarts", "1",
        "--ft-param-rank_section_timeouts=setup:120,step:3,checkpointing:60",
        "--ft-param-simulated_fault=hang:0:2", "--ft-param-safety_factor=200",
        script=BIN / "lightning_train.py", script_args=(str(tmp_path / "ck"),),
    )  # fmt: skip
    assert await run.wait(timeout=280) == 0, run.stderr.text[-3000:]
    assert "finished at step 40" in run.stdout.text
    lines = (run.run_dir / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    [hung] = [e["data"] for e in events if e["kind"] == "rank_hung"]
    [injected] = [e["data"] for e in events if e["kind"] == "fault_injected"]
    assert hung["section"] == (injected["open_sections"] or [None])[-1]
    state = json.loads((run.run_dir / "ft_state.json").read_text())
    assert "section:checkpointing" in state["learned"]
