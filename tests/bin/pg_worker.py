"""A rank holding fault-tolerant process groups, driven by JSON lines on stdin.

Each request names a group and an op; each gets one JSON reply line on stdout:
{"ok": true, ...} or {"ok": false, "error": "Type: text"}, both with "elapsed_s".
Values are float tensors of length 2 filled with the request's "value".
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from ftd_client.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupWrapper,
    extend_device_mesh,
)

N = 2


class MiniManager:
    """The smallest real manager: one reconfigurable gloo group; errors are kept, not raised."""

    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg
        self.errors: list[Exception] = []

    def num_participants(self) -> int:
        return self.pg.size()

    def allreduce(self, tensor: torch.Tensor) -> Any:
        return self.pg.allreduce([tensor], dist.ReduceOp.SUM)

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


def make(kind: str, timeout_s: float) -> tuple[ProcessGroup, MiniManager | None]:
    timeout = timedelta(seconds=timeout_s)
    if kind == "gloo":
        return ProcessGroupGloo(timeout), None
    if kind == "baby":
        return ProcessGroupBabyGloo(timeout_s), None
    if kind == "wrapper":
        return ProcessGroupWrapper(ProcessGroupGloo(timeout)), None
    if kind == "swallow":
        return ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout)), None
    if kind == "managed":
        manager = MiniManager(ProcessGroupGloo(timeout))
        return ManagedProcessGroup(manager), manager
    if kind == "dummy":
        return ProcessGroupDummy(0, 1), None
    raise ValueError(f"unknown kind {kind!r}")


def full(value: float) -> torch.Tensor:
    return torch.full((N,), float(value))


class Worker:
    def __init__(self) -> None:
        self.groups: dict[str, ProcessGroup] = {}
        self.managers: dict[str, MiniManager] = {}
        self.mesh_ready = False

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "new":
            pg, manager = make(req["kind"], req.get("timeout", 10.0))
            self.groups[req["name"]] = pg
            if manager is not None:
                self.managers[req["name"]] = manager
            return {}
        pg = self.groups[req["name"]]
        if op == "configure":
            pg.configure(req["addr"], req["rank"], req["world"])
            return {}
        if op == "info":
            return self.info(req["name"], pg)
        if op == "abandon_allreduce":  # start one, never wait for it
            pg.allreduce([full(req["value"])], dist.ReduceOp.SUM)
            return {}
        if op == "allreduce":
            tensor = full(req["value"])
            finish(pg.allreduce([tensor], dist.ReduceOp.SUM), req)
            return {"result": tensor.tolist()}
        if op == "allgather":
            tensor = full(req["value"])
            outputs = [torch.zeros(N) for _ in range(pg.size())]
            finish(pg.allgather([outputs], [tensor]), req)
            return {"result": [o.tolist() for o in outputs]}
        if op == "broadcast":
            tensor = full(req["value"])
            finish(pg.broadcast(tensor, req["root"]), req)
            return {"result": tensor.tolist()}
        if op == "broadcast_one":
            tensor = full(req["value"])
            finish(pg.broadcast_one(tensor, req["root"]), req)
            return {"result": tensor.tolist()}
        if op == "dist_all_reduce":
            tensor = full(req["value"])
            dist.all_reduce(tensor, group=pg)
            return {"result": tensor.tolist()}
        if op == "functional":
            if not pg.group_name:
                pg.register(f"ft-{req['name']}")
            return {"result": functional_all_reduce(full(req["value"]), pg.group_name).tolist()}
        if op == "mesh":
            return self.mesh(req, pg)
        raise ValueError(f"unknown op {op!r}")

    def info(self, name: str, pg: ProcessGroup) -> dict[str, Any]:
        info: dict[str, Any] = {
            "size": pg.size(),
            "rank": pg.rank(),
            "backend": pg.getBackendName(),
        }
        if isinstance(pg, ErrorSwallowingProcessGroupWrapper):
            info["error"] = None if pg.error() is None else repr(pg.error())
        if isinstance(pg, ProcessGroupBabyGloo):
            info["child_pid"] = pg.child_pid
        if name in self.managers:
            info["manager_errors"] = [repr(e) for e in self.managers[name].errors]
        return info

    def mesh(self, req: dict[str, Any], pg: ProcessGroup) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh

        if not self.mesh_ready:  # this rank's own replica group: a world of one
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.mesh_ready = True
        if not pg.group_name:
            pg.register(f"ft-{req['name']}")
        local = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        mesh = extend_device_mesh(local, pg, name="dp", dim=0)
        dp = mesh.get_group("dp")
        return {
            "result": functional_all_reduce(full(req["value"]), dp.group_name).tolist(),
            "dims": list(mesh.mesh_dim_names),
            "shape": list(mesh.mesh.shape),
            "dp_is_pg": dp is pg,
        }


def functional_all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """The op that functional collectives and compiled graphs run: the group is found by name
    in c10d's registry and called through torch's C++ -> Python trampoline. (Called directly:
    the Python wrapper's first call costs seconds of lazy imports.)"""
    functional = torch.ops._c10d_functional
    return functional.wait_tensor(functional.all_reduce(tensor, "sum", group_name))


def finish(work: Any, req: dict[str, Any]) -> None:
    if req.get("via") == "future":
        work.get_future().wait()
    elif "wait_s" in req:
        work.wait(timedelta(seconds=req["wait_s"]))
    else:
        work.wait()


def main() -> None:
    worker = Worker()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        start = time.monotonic()
        try:
            reply = {"ok": True, **worker.handle(req)}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        reply["elapsed_s"] = round(time.monotonic() - start, 3)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
