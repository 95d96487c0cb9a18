"""Hot spares (issue 40 item 2): a node that joins a round already full waits for its end as a
standby; when an active node is lost, the next round forms with the survivors and the standby,
which takes the lost node's place: the world size stays and the survivors keep their node
ranks. Both backends."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.coordination.records import RoundMember, RoundRecord
from ftd.coordination.shared_rounds import returning_members
from tests.conftest import Backend, ServeFactory, events_in
from tests.support.cluster import Cluster, run_dir
from tests.support.spares import OVERSIZED, UNSIGNED, cluster_until, forger, metrics_of, roles

pytestmark = pytest.mark.timeout(120)

nodes = st.sampled_from("abcdefgh")


@given(st.lists(nodes, unique=True, max_size=6), *(st.sets(nodes) for _ in range(3)))
def test_a_round_waits_only_for_members_of_the_round_before_that_may_come_back(
    previous: list[str], joined: set[str], excluded: set[str], unhealthy: set[str]
) -> None:
    members = tuple(RoundMember(n, "127.0.0.1", 1, 1 + i) for i, n in enumerate(previous))
    record = RoundRecord(number=3, members=members, restarts=0)
    awaited = returning_members(record, joined, excluded, unhealthy)
    assert awaited == [n for n in previous if n not in joined | excluded | unhealthy]
    aborted = record.model_copy(update={"members": (), "aborted": "too few"})
    assert returning_members(aborted, (), (), ()) == returning_members(None, (), (), ()) == []


async def test_a_standby_takes_the_place_of_a_lost_node(
    serve: ServeFactory, backend: Backend
) -> None:
    cluster = Cluster(serve, "2", "--max-restarts", "3", backend=backend)
    hang_first = ("--hang-attempts", "1")  # the first round runs until a node is lost
    a = await cluster.first("a", *hang_first)
    b = await cluster.node("b", *hang_first)
    await b.stdout.expect(r"ready a0 r1", timeout=60)
    spare = await cluster.node("c", *hang_first)
    await spare.stderr.expect(r"round 0 is full \(2 nodes\): waiting for its end", timeout=60)
    b.signal(signal.SIGKILL)
    assert await a.wait(timeout=90) == 0, a.stderr.text[-3000:]
    assert await spare.wait(timeout=30) == 0, spare.stderr.text[-3000:]
    rounds = [e["data"]["members"] for e in events_in(run_dir(a, "a"), "round_closed")]
    assert rounds[0] == ["a", "b"] and rounds[-1] == ["a", "c"], rounds
    assert "ready a1 r0" in a.stdout.text and "ready a1 r1" in spare.stdout.text


async def test_a_node_that_comes_back_under_its_id_restarts_the_round(
    serve: ServeFactory, backend: Backend
) -> None:
    """b's daemon is SIGKILLed and started again at once under the same id (as a scheduler
    restarts a node): its keepalive beats again, so no one would declare it lost, while the
    ranks it ran are gone; it asks its old round to restart, and the job goes on with it."""
    cluster = Cluster(serve, "2", "--max-restarts", "3", backend=backend)
    hang_first = ("--hang-attempts", "1")
    a = await cluster.first("a", *hang_first)
    b = await cluster.node("b", *hang_first)
    await b.stdout.expect(r"ready a0 r1", timeout=60)
    b.signal(signal.SIGKILL)
    await b.wait()
    again = await cluster.node("b", *hang_first)
    assert await a.wait(timeout=90) == 0, a.stderr.text[-3000:]
    assert await again.wait(timeout=30) == 0, again.stderr.text[-3000:]
    [request] = events_in(run_dir(a, "a"), "cluster_request")
    reason = str(request["data"]["reason"])
    assert "node b came back: its ranks of round 0 are gone" in reason or "node b lost" in reason
    assert "ready a1 r1" in again.stdout.text


async def test_an_active_node_that_restarts_keeps_its_place_over_a_standby(
    serve: ServeFactory, backend: Backend, tmp_path: Path
) -> None:
    """b's rank fails: every node of round 0 rejoins, and so does the standby, often first.
    The round that has its MAX joiners gives b, alive and of the round before, a last call:
    round 1 is a and b again (its ranks, and their snapshots, stay where they were), and c
    waits on as a standby until the job ends."""
    out, until = tmp_path / "out", tmp_path / "until"
    cluster = Cluster(serve, "2", "--max-restarts", "3", backend=backend, last_call=30)
    args = ("--out", str(out), "--until", str(until), "--fail-mode", "exit:3")
    a = await cluster.first("a", *args)
    b = await cluster.node("b", *args)
    await b.stdout.expect(r"step a0 r1", timeout=60)
    spare = await cluster.node("c", *args)
    await spare.stderr.expect(r"round 0 is full \(2 nodes\): waiting for its end", timeout=60)
    (out / "fail_a0_r1").touch()
    await b.stdout.expect(r"step a1 r1", timeout=60)
    # b's ranks can run round 1 before a's daemon has heard it closed: a says so after its
    # round_closed event is written (supervisor.py), then its events are read.
    await a.stderr.expect(r"round 1: node rank 0 of 2 \(a, b\)", timeout=60)
    rounds = [e["data"]["members"] for e in events_in(run_dir(a, "a"), "round_closed")]
    assert rounds == [["a", "b"], ["a", "b"]], rounds
    await spare.stderr.expect(r"round 1 is full \(2 nodes\): waiting for its end", timeout=60)
    until.touch()
    assert await a.wait(timeout=60) == 0, a.stderr.text[-3000:]
    assert await b.wait(timeout=60) == 0, b.stderr.text[-3000:]
    code = await spare.wait(timeout=60)
    assert "ready a0" not in spare.stdout.text, spare.stdout.text[-2000:]
    assert code == 0, spare.stderr.text[-3000:]


async def test_a_standby_is_shown_as_one(
    serve: ServeFactory, backend: Backend, tmp_path: Path
) -> None:
    """c, late for a full round, says it is a standby: in its status.json (field and reason),
    its events and its metrics; a's cluster view lists it with the role `standby`, and not the
    standby records someone without the secret put into the store (skipped and counted).
    Once c has taken lost b's place, it is a standby no more."""
    until = tmp_path / "until"
    cluster = Cluster(serve, "2", "--max-restarts", "3", backend=backend)
    args = ("--hang-attempts", "1", "--hang-until", str(until))
    a = await cluster.first("a", *args)
    b = await cluster.node("b", *args)
    await b.stdout.expect(r"ready a0 r1", timeout=60)
    async with forger(cluster, backend) as put:
        await put("r0/standby/mallory", UNSIGNED)
        await put("r0/standby/oversized", OVERSIZED)
    spare = await cluster.node("c", *args)
    reason = "standby: round 0 is full (2 nodes), waiting to take a lost node's place"
    await spare.stderr.expect(re.escape(reason), timeout=60)
    status = json.loads((run_dir(spare, "c") / "status.json").read_text())
    assert status["state"] == "rendezvous"
    assert status["standby"]["round"] == 0 and status["standby"]["members"] == 2, status
    assert status["standby"]["reason"] == reason
    assert "ftd_node_standby 1.0" in (await metrics_of(spare, "c")).splitlines()
    view = await cluster_until(a, "a", lambda body: "c" in roles(body))
    assert roles(view) == {"a": "active", "b": "active", "c": "standby"}, view
    refused = view["refused_records"]
    assert refused.get("unsigned", 0) >= 1 and refused.get("oversized", 0) >= 1, refused
    [began] = events_in(run_dir(spare, "c"), "standby")
    assert began["data"]["round"] == 0 and began["data"]["reason"] == reason
    b.signal(signal.SIGKILL)
    await spare.stdout.expect(r"ready a1 r1", timeout=90)
    status = json.loads((run_dir(spare, "c") / "status.json").read_text())
    assert status["standby"] is None, status
    assert "ftd_node_standby 0.0" in (await metrics_of(spare, "c")).splitlines()
    [ended] = events_in(run_dir(spare, "c"), "standby_ended")
    assert ended["data"]["reason"] == "joined round 1 as an active node (node rank 1)", ended
    view = await cluster_until(a, "a", lambda body: body["round"]["round"] == 1)
    assert roles(view) == {"a": "active", "c": "active"}, view
    until.touch()
    assert await a.wait(timeout=60) == 0, a.stderr.text[-3000:]
    assert await spare.wait(timeout=60) == 0, spare.stderr.text[-3000:]


async def test_hot_spares_read_nnodes_min_max_as_nvrx_does(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """--nnodes 1:2 --hot-spares: the first node runs the job alone; the second waits as a
    standby instead of scaling the job up (torchrun's reading), and ends with the job."""
    until = tmp_path / "until"
    cluster = Cluster(serve, "1:2", "--hot-spares", "--max-restarts", "1")
    a = await cluster.first("a", "--until", str(until))
    await a.stdout.expect(r"step a0 r0", timeout=60)
    assert "--hot-spares: 1 nodes run the job; up to 1 more wait as standbys" in a.stderr.text
    b = await cluster.node("b", "--until", str(until))
    await b.stderr.expect(r"round 0 is full \(1 nodes\): waiting for its end", timeout=60)
    until.touch()
    assert await a.wait(timeout=60) == 0, a.stderr.text[-3000:]
    assert await b.wait(timeout=60) == 0, b.stderr.text[-3000:]
    assert "ready" not in b.stdout.text and "a1" not in a.stdout.text
