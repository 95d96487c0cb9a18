"""Attacks on a live job through its rendezvous store, by someone who can reach the store's port
but has no secret; and what listens where.

What must hold: every forged, replayed or malformed value is ignored or refused with a log line;
the job's result, the ranks' addresses and the restart budget are untouched; no daemon task dies.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Serve, ServeFactory, events_in
from tests.support.cluster import JOB_SECRET, Attacker, Cluster, api, ready_together, run_dir

pytestmark = pytest.mark.timeout(150)

CAREFUL = ("Traceback", "background task", "never retrieved", "store lost")


def forged(record: dict[str, Any], mac: str = "-") -> str:
    """A record in ftd's wire form, unsigned (`-`) or with a made-up signature."""
    return f"ftd1 {mac} {json.dumps(record)}"


def env_of(run: Serve, rank: int) -> dict[str, str]:
    data: dict[str, str] = json.loads((run.out / f"env_{rank}.json").read_text())
    return data


def careless(run: Serve) -> list[str]:
    return [line for line in run.stderr.lines if any(mark in line for mark in CAREFUL)]


async def test_forged_replayed_and_malformed_records_change_nothing(
    serve: ServeFactory, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    cluster = Cluster(serve, "2", "--max-restarts", "3")  # signed with JOB_SECRET
    args = ("--until", str(release), "--dump-env")
    a = await cluster.node("a", *args)
    await a.stderr.expect("hosting the rendezvous store")
    b = await cluster.node("b", *args)
    n = await ready_together(a, b)
    attacker = await asyncio.to_thread(Attacker, cluster.endpoint, cluster.job)
    planted = {"number": n + 1, "restarts": 0, "excluded": {}, "aborted": None}
    planted["members"] = [
        {"node_id": "a", "addr": "203.0.113.7", "nproc": 1, "store_port": 4444},
        {"node_id": "b", "addr": "203.0.113.7", "nproc": 1, "store_port": 4444},
    ]
    request = {"reason": "forged", "by": "a", "counted": False, "nonce": "x"}
    values: dict[str, str | bytes] = {
        # the round's end: succeed, fail, restart, unsigned, with a made-up signature, not JSON
        f"r{n}/request": forged({**request, "action": "succeed"}),
        f"r{n}/request#1": forged({**request, "action": "fail"}, mac="ab" * 32),
        f"r{n}/request#2": forged({**request, "action": "restart", "counted": True}),
        f"r{n}/request#3": b"x" * 100_000,
        f"r{n}/request#4": b"ftd1 - \xff{not json",
        # the next round: its members (a planted master), a negative restart count, a counter
        f"r{n + 1}/closed": forged(planted),
        f"r{n + 1}/closed#1": forged({**planted, "restarts": -100}),
        f"r{n + 1}/joined": "not a number",
        f"r{n + 1}/node/1": forged(planted["members"][0]),
        # exclusion, marks, liveness, status, the round hint; one oversized value
        "excluded/b": forged({"node_id": "b", "reason": "forged"}),
        "excluded": "[1, 2, 3]",
        f"r{n}/succeeded/a": forged({"node_id": "a"}),
        f"r{n}/unhealthy/b": "x",
        f"r{n}/respawns": "x",
        "alive/b": "x",
        "status/a": b"x" * (2 * 1024 * 1024),
        "round": "-7",
    }
    for key, value in values.items():
        await asyncio.to_thread(attacker.set, key, value)
    for run in (a, b):  # both woke to the forged request and refused it
        await run.stderr.expect(r"ignored the rendezvous record at 'r\d+/request#4'")
    for run, node in ((a, "a"), (b, "b")):
        assert events_in(run_dir(run, node), "cluster_request") == []
        assert json.loads((run_dir(run, node) / "status.json").read_text())["state"] == "running"
    code, view = await api(a, "a", "GET", "/v1/cluster")  # a malformed status, shown as unknown
    assert code == 200 and {n["node_id"] for n in view["nodes"]} == {"a", "b"}  # type: ignore[index, union-attr]
    # A real restart: the next round steps over the planted records and repairs the counter.
    code, body = await api(a, "a", "POST", "/v1/restart")
    assert code == 202, body
    await ready_together(a, b)
    # ... and a replay of this round's genuine signed request into the next round is refused.
    genuine = await asyncio.to_thread(attacker.get, f"r{n}/request#5")
    assert genuine.startswith(b"ftd1 ") and b'"action":"restart"' in genuine
    await asyncio.to_thread(attacker.set, f"r{n + 1}/request", genuine)
    await a.stderr.expect(rf"ignored the rendezvous record at 'r{n + 1}/request' \(bad_signature\)")
    for rank, run in ((0, a), (1, b)):  # every rank's store is node a's, never the planted one
        env = env_of(run, rank)
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] != "4444", env
    release.touch()
    assert await a.wait() == 0 and await b.wait() == 0
    for run, node in ((a, "a"), (b, "b")):
        status = json.loads((run_dir(run, node) / "status.json").read_text())
        assert (status["state"], status["restart_count"]) == ("succeeded", 1), status
        assert careless(run) == [], careless(run)
    refused = "\n".join(a.stderr.lines + b.stderr.lines)
    for cause in ("unsigned", "bad_signature", "malformed", "oversized"):
        assert f"({cause})" in refused, cause
    assert "held b'not a number' (forged): repaired" in refused
    assert "ignored the round hint b'-7'" in refused


async def test_nodes_with_different_secrets_refuse_to_form_a_round(serve: ServeFactory) -> None:
    # b must join within a's join timeout: on a busy machine its start alone (a re-exec that
    # takes the secret out of its environment, torch's import) took over 8 s.
    cluster = Cluster(serve, "2", "--rdzv-join-timeout", "20")
    a = await cluster.node("a", "--hang")
    await a.stderr.expect("hosting the rendezvous store")
    cluster.env = {"FTD_RDZV_SECRET": JOB_SECRET.upper()}
    b = await cluster.node("b", "--hang")
    assert await a.wait(timeout=60) == 1 and await b.wait(timeout=60) == 1
    # The first to reach its join deadline says why the round did not form; the other, whose
    # store host left with it, saw the other node's records fail to verify.
    assert "1 join records failed to verify (do the nodes share one secret?)" in a.stderr.text
    for run in (a, b):
        assert "the nodes' secrets (FTD_RDZV_SECRET / secret_file) differ" in run.stderr.text
        assert "ready a0" not in run.stdout.text


async def test_a_secret_file_must_be_private(serve: ServeFactory, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(JOB_SECRET)
    secret.chmod(0o644)
    cluster = Cluster(serve, "2", "--rdzv-conf", f"secret_file={secret}")
    run = await cluster.node("a", "--hang")
    assert await run.wait(timeout=60) == 2
    assert "is readable by others (mode 644): chmod 600 it" in run.stderr.text
    assert "ready" not in run.stdout.text


def listeners_of(pids: set[int]) -> list[str]:
    """The TCP addresses these processes listen on (from /proc: no tool needed)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(_address(fields[1].split(":")[0]))
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    return ":".join(b"".join(words)[i : i + 2].hex() for i in range(0, 16, 2))


def descendants(pid: int) -> set[int]:
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


LOOPBACK = (
    "127.0.0.1",
    "0000:0000:0000:0000:0000:0000:0000:0001",
    "0000:0000:0000:0000:0000:ffff:7f00:0001",
)


async def test_standalone_job_listens_on_loopback_only(serve: ServeFactory) -> None:
    run = await serve("--standalone", "--nproc-per-node", "2", script_args=("--hang",))
    await run.stdout.expect("ready a0 r1")
    await run.stdout.expect("ready a0 r0")
    addresses = listeners_of(descendants(run.proc.pid))
    assert addresses, "the daemon listens somewhere (its API, the workers' store)"
    assert all(a in LOOPBACK for a in addresses), addresses


async def test_hosted_rendezvous_store_binds_the_endpoint_address(serve: ServeFactory) -> None:
    cluster = Cluster(serve, "1:2", last_call=0.3, secret=None)
    a = await cluster.node("a", "--hang")
    await a.stdout.expect("ready a0 r0")
    # Without a secret the daemon says the store is open, as torchrun's is, and runs.
    assert "is open: anyone who reaches it can end or" in a.stderr.text
    addresses = listeners_of(descendants(a.proc.pid))
    assert all(a in LOOPBACK for a in addresses), addresses


async def test_a_planted_far_round_hint_loses_no_restart(serve: ServeFactory) -> None:
    """The round hint is the one unsigned key: a far one planted before a restart is not
    followed (the rounds between would carry no budget), the restart is counted."""
    cluster = Cluster(serve, "2", "--max-restarts", "3")  # signed with JOB_SECRET
    a = await cluster.node("a", "--hang")
    await a.stderr.expect("hosting the rendezvous store")
    b = await cluster.node("b", "--hang")
    n = await ready_together(a, b)
    attacker = await asyncio.to_thread(Attacker, cluster.endpoint, cluster.job)
    await asyncio.to_thread(attacker.set, "round", str(n + 50))
    marks = len(a.stdout.lines), len(b.stdout.lines)
    code, body = await api(a, "a", "POST", "/v1/restart")
    assert code == 202, body
    await a.stdout.expect(r"ready a\d+ r0", start=marks[0])
    await b.stdout.expect(r"ready a\d+ r1", start=marks[1])
    for run, node in ((a, "a"), (b, "b")):
        await run.stderr.expect(rf"ignored the round hint {n + 50}: round {n + 49} never closed")
        code, status = await api(run, node, "GET", "/v1/status")
        assert code == 200 and (status["round"], status["restart_count"]) == (n + 1, 1), status
        assert careless(run) == [], careless(run)
