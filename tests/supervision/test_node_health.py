"""Node health before every rendezvous (issue 40 item 3): an unhealthy node sits out — an
event, its status and its log say why — the round forms without it where a node waiting beyond
the round's size (a spare) can take its place, and waits, saying who is missing, where not; a
node unhealthy in N looks in a row excludes itself."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from ftd.config.ft import FaultToleranceConfig
from ftd.supervision.node_health import link_states, run_check, storage_reason
from tests.conftest import ServeFactory, events_in
from tests.support.api import cli
from tests.support.cluster import Cluster, run_dir

FAKE_NVML = Path(__file__).parents[1] / "support" / "fake_nvml"


async def test_a_check_command_is_healthy_at_exit_0_and_says_why_not() -> None:
    assert await run_check("true", 5) is None
    said = await run_check(
        f"{sys.executable} -c \"print('ok so far'); print('disk full'); exit(3)\"", 5
    )
    assert said == "the health check failed: disk full"
    assert await run_check("false", 5) == "the health check failed: exit status 1"
    assert "cannot run" in (await run_check("/nonexistent/check", 5) or "")
    assert "cannot run" in (await run_check("unbalanced 'quote", 5) or "")
    slow = await run_check(f'{sys.executable} -c "import time; time.sleep(60)"', 0.3)
    assert slow == "the health check did not end within 0.3s"
    escaped = await run_check(f"{sys.executable} -c \"print(chr(27) + '[2J'); exit(1)\"", 5)
    assert escaped is not None and "\x1b" not in escaped


async def test_storage_paths_must_be_reachable_directories(tmp_path: Path) -> None:
    assert await storage_reason(str(tmp_path)) is None
    assert "No such file" in (await storage_reason(str(tmp_path / "gone")) or "")
    (tmp_path / "file").write_text("x")
    assert "no readable directory" in (await storage_reason(str(tmp_path / "file")) or "")
    assert "not absolute" in (await storage_reason("relative/path") or "")


async def test_a_nic_port_that_was_active_and_is_not_makes_the_node_unhealthy(
    tmp_path: Path,
) -> None:
    from ftd.status.events import EventLog
    from ftd.supervision.node_health import NodeHealth

    for nic in ("mlx5_0", "mlx5_1"):
        (tmp_path / nic).mkdir()
        (tmp_path / nic / "state").write_text("4: ACTIVE\n")
    template = str(tmp_path / "{nic}" / "state")
    assert set(link_states(template)) == {str(tmp_path / n / "state") for n in ("mlx5_0", "mlx5_1")}

    class Config:
        ft = FaultToleranceConfig(link_state_path_template=template)
        node_id = "n"

    health = NodeHealth(Config(), EventLog(None), Board(), None)  # type: ignore[arg-type]
    assert await health.check() is None  # the first look learns which ports are ACTIVE
    (tmp_path / "mlx5_1" / "state").write_text("1: DOWN\n")
    reason = await health.check()
    assert reason is not None and "mlx5_1" in reason and "DOWN" in reason


class Board:
    """The status board's one method the health checks call."""

    def health_checked(self, unhealthy: str | None) -> None:
        self.unhealthy = unhealthy


async def test_an_unhealthy_node_sits_out_and_a_spare_takes_its_place(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Three nodes for a job of two: b's check fails (it says why), so a and c form the round
    and finish; b, unhealthy in 3 looks in a row, excludes itself."""
    cluster = Cluster(serve, "2", "--max-restarts", "0")
    check = ("--node-health-check", "sh -c 'echo scratch disk full; exit 1'",
             "--ft-node-health-check-interval", "0.2")  # fmt: skip
    a = await cluster.first("a")
    b = await cluster.node("b", flags=check)
    await b.stderr.expect("node unhealthy, sitting out of the rendezvous: the health check "
                          "failed: scratch disk full")  # fmt: skip
    c = await cluster.node("c")
    codes = await asyncio.gather(a.wait(), b.wait(), c.wait())
    assert codes == [0, 1, 0], (a.stderr.text[-2000:], b.stderr.text[-2000:])
    [closed] = events_in(run_dir(a, "a"), "round_closed")
    assert closed["data"]["members"] == ["a", "c"], closed
    unhealthy = events_in(run_dir(b, "b"), "node_unhealthy")
    assert [e["data"]["failures"] for e in unhealthy] == [1, 2, 3], unhealthy
    assert unhealthy[0]["data"]["reason"] == "the health check failed: scratch disk full"
    assert "unhealthy in 3 checks in a row" in b.stderr.text
    status = json.loads((run_dir(b, "b") / "status.json").read_text())
    assert status["unhealthy"] == "the health check failed: scratch disk full", status
    shown = cli("status", "--run-dir", str(run_dir(b, "b"))).stdout
    assert "unhealthy, sitting out of the rendezvous: the health check failed: scratch" in shown


async def test_without_a_spare_the_job_waits_saying_who_is_missing(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Two nodes for a job of two, b unhealthy until its storage path appears: a waits and
    says who is missing; once b is healthy the job runs."""
    storage = tmp_path / "scratch"
    cluster = Cluster(serve, "2", "--max-restarts", "0")
    flags = ("--ft-storage-healthcheck-path", str(storage), "--ft-node-health-check-interval",
             "0.2", "--ft-node-health-check-failures", "0")  # fmt: skip
    a = await cluster.first("a")
    b = await cluster.node("b", flags=flags)
    await b.stderr.expect(f"sitting out of the rendezvous: storage path {storage}")
    await a.stderr.expect(r"waiting for nodes: 1 joined \(a\)", timeout=60)
    storage.mkdir()
    assert await asyncio.gather(a.wait(), b.wait()) == [0, 0]
    assert [e["kind"] for e in events_in(run_dir(b, "b"), "node_healthy")] == ["node_healthy"]


@pytest.mark.parametrize("used", [[100.0], [100.0, None]])
async def test_a_gpu_that_does_not_answer_nvml_makes_the_node_unhealthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, used: list[object]
) -> None:
    from ftd.status.events import EventLog
    from ftd.supervision.node_health import NodeHealth

    state = tmp_path / "used.json"
    state.write_text(json.dumps(used))
    monkeypatch.setenv("FTD_TEST_FAKE_NVML", str(state))
    monkeypatch.syspath_prepend(str(FAKE_NVML))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)

    class Config:
        ft = FaultToleranceConfig()
        node_id = "n"

    health = NodeHealth(Config(), EventLog(None), Board(), None)  # type: ignore[arg-type]
    reason = await health.check()
    if used == [100.0]:
        assert reason is None
    else:
        assert reason is not None and reason.startswith("GPU 1 does not answer NVML"), reason
