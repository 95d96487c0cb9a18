"""The replica channel's budgets on live `ftd serve` daemons (two nodes of one job, a job secret,
a memory tier, one rank each, tests/bin/replica_flood_rank.py): each rank asks to restore in
3000 worlds (audit row 4): each daemon starts one pull, refuses the rest (said once), and no
replica server is flooded. Then the test, holding the job's key, plays a pull of another
connection at node a's replica server (row 5): refused as `replayed`, nothing read."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from ftd.checkpoint.replica_frame import FrameHeader
from ftd.checkpoint.replica_wire import client_handshake, read_header, send
from ftd.coordination.records import RecordCodec
from tests.conftest import BIN, Serve, ServeFactory
from tests.support.cluster import JOB_SECRET, Cluster, api

pytestmark = pytest.mark.timeout(120)


async def until_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name} in {timeout:.0f} s"
        await asyncio.sleep(0.05)


async def test_restores_in_thousands_of_worlds_and_a_replayed_pull_on_live_daemons(
    serve: ServeFactory, tmp_path: Path
) -> None:
    nodes = Cluster(
        serve, "2", "--nproc-per-node", "1", "--checkpoint-memory", "8M", "--preload", "none"
    )
    out = tmp_path / "flood"
    out.mkdir()

    async def node(name: str) -> Serve:
        flags = ("--node-id", name, *nodes.flags)
        script, args = BIN / "replica_flood_rank.py", ("--out", str(out))
        return await nodes.serve(
            *flags, script=script, script_args=args, run_id=nodes.job, env=nodes.env
        )

    a = await node("a")
    b = await node("b")
    runs = {"a": a, "b": b}
    for rank in (0, 1):
        await until_file(out / f"flood-{rank}.json")
        answers = json.loads((out / f"flood-{rank}.json").read_text())
        assert sum(answers.values()) == 3000 and answers.get("other", 0) == 0, answers
    _, cluster = await api(a, "a", "GET", "/v1/cluster")
    summaries: list[dict[str, str]] = cluster["nodes"]  # type: ignore[assignment]
    (address,) = [n["replica_addr"] for n in summaries if n["node_id"] == "a"]
    key = RecordCodec(nodes.job, JOB_SECRET.encode()).replica_key()
    assert key is not None
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    _, theirs = await client_handshake(reader, writer, key, "b", "a")
    played = FrameHeader(kind="pull", source="b", to="a", rank=1, world=2, echo="0" * 32)
    await send(writer, key, played)
    with pytest.raises((EOFError, ConnectionError)):
        await read_header(reader, key, "b", 1 << 20, theirs)
    writer.close()
    await a.stderr.expect(r"refused a replica frame from 127\.0\.0\.1:\d+ \(replayed\)")
    (out / "stop").touch()
    codes = await asyncio.gather(a.wait(60), b.wait(60))
    texts = {name: run.stderr.text for name, run in runs.items()}
    assert codes == [0, 0], {name: text[-3000:] for name, text in texts.items()}
    for text in texts.values():
        assert "too_many_connections" not in text, text[-3000:]
        assert text.count("no pull of a rank's replicas (other_world)") == 1, text[-3000:]
