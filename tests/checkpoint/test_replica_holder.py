"""The holder's side of the replicas (ftd/checkpoint/holder.py with a `Replicas`): a completed
snapshot wakes the pusher; a rank this node holds nothing of is answered `pending` while its
snapshots are fetched from the peers, and then with what was fetched (adopted as complete
snapshots of this node, oldest first); a node that holds the rank asks no peer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftd_client import protocol
from ftd_client.snapshot_format import layout

from ftd.checkpoint.holder import CheckpointHolder
from ftd.status.events import EventLog
from tests.support.wire import message


class FakeReplicas:
    def __init__(self) -> None:
        self.completions = 0
        self.asked: list[tuple[int, int]] = []

    def completed(self) -> None:
        self.completions += 1

    def restoring(self, rank: int, world: int) -> bool:
        self.asked.append((rank, world))
        return True

    def view(self) -> dict[str, Any]:
        return {"replica_lag_steps": 0, "replica": None}


def snapshot(path: Path, step: int, rank: int, world: int) -> None:
    path.write_bytes(layout(step, world, rank, 0, 0).pack().ljust(4096, b"\0"))


def test_a_rank_the_node_lacks_waits_for_the_peers_replicas(tmp_path: Path) -> None:
    replicas = FakeReplicas()
    holder = CheckpointHolder(
        tmp_path,
        1 << 30,
        EventLog(None),
        multi_node=True,
        replicas=lambda _: replicas,
        base=tmp_path,
    )
    holder.start()
    try:
        restore = {"v": 1, "t": protocol.CHECKPOINT_RESTORE, "id": 1, "world": 2}
        assert holder.answer(1, message(restore)) == {"ok": True, "pending": True}
        assert holder.answer(1, message(restore)) == {"ok": True, "pending": True}
        fetched = tmp_path / "fetched"
        fetched.mkdir()
        for step in (3, 4):  # what the pull adopts, oldest first
            snapshot(fetched / str(step), step, 1, 2)
            assert holder.adopt(1, 2, step, fetched / str(step))
        assert holder.answer(1, message(restore)) == {"ok": True, "agree": True, "steps": [3, 4]}
        agreed = holder.answer(1, message({**restore, "step": 4}))
        assert agreed["step"] == 4 and Path(agreed["path"]).read_bytes()[:8] == b"FTDSNAP1"
        assert replicas.asked == [(1, 2)] * 2  # held now: the peers are not asked again

        grant = holder.answer(0, message({"v": 1, "t": protocol.CHECKPOINT_BEGIN, "id": 2,
                                          "step": 5, "bytes": 4096, "world": 2}))  # fmt: skip
        snapshot(Path(grant["path"]), 5, 0, 2)
        done = {"v": 1, "t": protocol.CHECKPOINT_DONE, "id": 3, "step": 5, "slot": grant["slot"]}
        assert holder.answer(0, message(done))["ok"] is True and replicas.completions == 1
        assert holder.answer(0, message(restore))["steps"] == [5]  # held here: no peer asked
        assert replicas.asked == [(1, 2)] * 2
        view = holder.view()
        assert view is not None and view["replica_lag_steps"] == 0
    finally:
        holder.close()
