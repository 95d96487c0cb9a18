"""One rank that tries what a careless or hostile script can do to the memory tier, and writes
what happened to <out>/probe.json (the test asserts on it; the daemon runs with
--checkpoint-memory 8M):
- a good snapshot of step 1 (its tensor holds 1.0), then:
- a state with a value that does not pickle (a lambda);
- a state bigger than --checkpoint-memory;
- a forged `ckd` for a step never begun; a `ckb` whose file is then left without its header;
- a packet with a negative size, one with an interval of 0 steps;
- torch.distributed.checkpoint through MemoryWriter/MemoryReader, and a checkpoint id that
  names a path;
and after each, what load() restores (step 1, 1.0: the older snapshot stays usable).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import torch
from ftd_client import checkpoint, protocol


def packet(message: dict[str, Any]) -> bytes:
    """`message` as one raw packet (written here as a rank may, not through ftd_client.wire)."""
    return json.dumps({"v": protocol.PROTOCOL_VERSION, **message}).encode()


def ask(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any] | None:
    sock.send(packet(message))
    try:
        reply: dict[str, Any] = json.loads(sock.recv(65536))
    except TimeoutError:
        return None
    return reply


def restored() -> list[object]:
    state: dict[str, Any] = {"w": torch.zeros(4)}
    step = checkpoint.load(state)
    return [step, float(state["w"][0])]


def dcp_in_memory() -> dict[str, Any]:
    """torch.distributed.checkpoint through MemoryWriter/MemoryReader (one process, no group)."""
    import torch.distributed.checkpoint as dcp

    for step in (1, 2, 3):
        dcp.save({"w": torch.full((4,), float(step))}, storage_writer=checkpoint.MemoryWriter(step))
    newest = checkpoint.newest_dcp()
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=checkpoint.MemoryReader(newest))
    kept = sorted(p.name for p in checkpoint.dcp.memory_directory().iterdir())
    try:
        checkpoint.MemoryWriter("../escape")
        refused = ""
    except checkpoint.CheckpointError as error:
        refused = str(error)
    return {"newest": newest, "loaded": float(state["w"][0]), "kept": kept, "refused": refused}


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    result: dict[str, Any] = {}
    assert checkpoint.save({"w": torch.ones(4)}, 1)
    checkpoint.wait()
    result["first"] = restored()
    try:
        checkpoint.save({"w": torch.ones(4) * 2, "f": lambda: 0}, 2)
        result["unpicklable"] = "saved"
    except checkpoint.CheckpointError as error:
        result["unpicklable"] = str(error)
    result["after_unpicklable"] = restored()
    try:
        checkpoint.save({"w": torch.ones(4 << 20) * 3}, 3)  # 16 MiB
        result["too_large"] = "saved"
    except checkpoint.CheckpointError as error:
        result["too_large"] = str(error)
    result["after_too_large"] = restored()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ["FTD_SOCKET"])
    sock.settimeout(2.0)
    result["forged_done"] = ask(sock, {"t": "ckd", "id": 1, "step": 99, "slot": 0})
    begun = ask(sock, {"t": "ckb", "id": 2, "step": 4, "bytes": 1 << 20, "world": 1})
    assert begun and begun["ok"], begun
    path = Path(begun["path"])
    path.write_bytes(b"\0" * 4096)  # no header: the rank "finished" a file it never wrote
    result["headerless_done"] = ask(sock, {"t": "ckd", "id": 3, "step": 4, "slot": begun["slot"]})
    result["negative"] = ask(sock, {"t": "ckb", "id": 4, "step": 5, "bytes": -1, "world": 1})
    no_interval = {"t": "ckb", "id": 5, "step": 5, "bytes": 1 << 20, "world": 1, "every": 0}
    result["no_interval"] = ask(sock, no_interval)
    result["after_forged"] = restored()
    result["directory_mode"] = oct(stat.S_IMODE(path.parent.stat().st_mode))
    result["file_modes"] = sorted(  # the snapshots' files (not the one this probe wrote)
        {oct(stat.S_IMODE(f.stat().st_mode)) for f in path.parent.iterdir() if f != path}
    )
    result["stats"] = vars(checkpoint.stats())
    result["dcp"] = dcp_in_memory()
    (out / "probe.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
