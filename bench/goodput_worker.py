"""The rank script of bench/goodput.py: one 2-rank DDP job (gloo, CPU), four ways to keep its
state across a rank's death.

The model: an MLP 1024 -> 2048 -> 2048 -> 1280 -> 1 (8.92 M parameters), trained with Adam, so
weights + Adam's two moments are 107 MB (102 MiB) per rank. Step N's batch comes from a
generator seeded by (N, rank): every run makes the same steps. After each step the ranks agree
(one 1-element allreduce, in every mode) whether the harness's deadline has passed; the job
then ends there, at a step boundary.

  --mode plain     no checkpoint at all (the failure-free step time)
  --mode ftd       ftd_client.checkpoint.save every step, checkpoint.load at start
  --mode dcp       torch.distributed.checkpoint (dcp.save/dcp.load) to --ckpt-dir every --every
                   steps (the newest complete directory kept, plus the one before it)
  --mode dcp-async the same with dcp.async_save on a gloo group of its own
  --mode nvrx      NVRx's LocalCheckpointManager (--ckpt-dir on /dev/shm) every --every steps,
                   heartbeats to ft_launcher's rank monitor every step
  --mode cost      under ftd: blocks of --block steps, alternately without and with
                   checkpoint.save every step (the per-step cost of save)
  --mode calibrate what one save of --keeper (dcp, dcp-async, nvrx) costs: alternating blocks
                   without and with a save every --every steps
  --mode restore   under ftd, one rank: a state of --mb MiB; each attempt times checkpoint.load,
                   saves, and kills itself until attempt --rounds (the restore time)

Each rank writes <out>/pid-<attempt>-<rank>.json at once (the harness's kill list, with the
process's start time against pid reuse) and appends JSON lines to <out>/log-<rank>.jsonl: a
"start" record per attempt (script start, process group up, restore begun/done, resumed step)
and one "step" record per completed step (with the checkpoint's time when there was one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

T_SCRIPT = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

BATCH = 64
WIDTHS = (1024, 2048, 2048, 1280, 1)


def start_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def build() -> tuple[nn.Module, DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    ddp = DistributedDataParallel(model)
    return model, ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4)


def train_step(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    x = torch.randn(BATCH, WIDTHS[0], generator=generator)
    y = torch.randn(BATCH, 1, generator=generator)
    loss = nn.functional.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


class Log:
    def __init__(self, out: Path, rank: int, attempt: int) -> None:
        self.file = (out / f"log-{rank}.jsonl").open("a", buffering=1)
        self.attempt = attempt

    def write(self, kind: str, **fields: Any) -> None:
        # line-buffered: each record is in the kernel before the next step, so a SIGKILL
        # loses none of the steps done
        self.file.write(json.dumps({"kind": kind, "a": self.attempt, **fields}) + "\n")


# -- the checkpointing modes -------------------------------------------------------------------


class NoCheckpoint:
    every = 0

    def restore(self) -> int:
        return 0

    def save(self, step: int) -> None:
        pass


class FtdMemory:
    """ftd_client.checkpoint: the node's memory, every step."""

    every = 1

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from ftd_client import checkpoint

        self.checkpoint = checkpoint
        self.model, self.optimizer = model, optimizer

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "n": step}

    def restore(self) -> int:
        state = self.state(0)
        step = self.checkpoint.load(state)
        if step is None:
            return 0
        self.optimizer.load_state_dict(state["optim"])
        return step

    def save(self, step: int) -> bool:
        return bool(self.checkpoint.save(self.state(step), step))


class Dcp:
    """torch.distributed.checkpoint to a local disk directory, every `every` steps; with
    `asynchronous`, dcp.async_save (staged to memory, written by a thread) on a gloo group of
    its own (as DCP advises), a save waiting for the one before it to be written."""

    def __init__(
        self,
        ddp: nn.Module,
        optimizer: torch.optim.Optimizer,
        root: Path,
        every: int,
        asynchronous: bool = False,
    ):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as sd

        self.dcp, self.sd = dcp, sd
        self.ddp, self.optimizer, self.root, self.every = ddp, optimizer, root, every
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.pending: Any = None

    def state(self) -> dict[str, Any]:
        model, optim = self.sd.get_state_dict(self.ddp, self.optimizer)
        return {"model": model, "optim": optim}

    def restore(self) -> int:
        found = [None]
        if dist.get_rank() == 0:
            done = sorted(p for p in self.root.glob("step_*") if (p / ".metadata").exists())
            found = [done[-1].name if done else None]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return 0
        state = self.state()
        self.dcp.load(state, checkpoint_id=str(self.root / found[0]))
        self.sd.set_state_dict(
            self.ddp,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        return int(found[0].removeprefix("step_"))

    def save(self, step: int) -> None:
        where = str(self.root / f"step_{step:08d}")
        if self.group is None:
            self.dcp.save(self.state(), checkpoint_id=where)
        else:
            self.wait()
            self.pending = self.dcp.async_save(
                self.state(), checkpoint_id=where, process_group=self.group
            )
        if dist.get_rank() == 0:
            done = sorted(p for p in self.root.glob("step_*") if (p / ".metadata").exists())
            for old in done[:-2]:
                shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            getattr(pending, "upload_completion", pending).result()


class Nvrx:
    """NVRx's LocalCheckpointManager on /dev/shm every `every` steps (synchronous: its async
    path calls torch.cuda.synchronize, and BasicTensorAwareStateDict asserts CUDA tensors;
    see CpuStateDict)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, every: int):
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (  # type: ignore[import-untyped]
            LocalCheckpointManager,
        )

        self.manager = LocalCheckpointManager(str(root), session_id="goodput")
        self.model, self.optimizer, self.every = model, optimizer, every
        # The bench's workaround (not NVRx's): a rank SIGKILLed inside save leaves
        # iter_<N>_<rank>_local.dirty.pt, and NVRx opens the next save of N with "bx", so the
        # rank fails with SameMachineReplicationException at step N in every later attempt
        # (seen: a crash loop until --max-restarts ran out). Remove this rank's leftovers.
        for stale in self.manager.local_ckpt_dir.glob("*.dirty.pt"):
            stale.unlink(missing_ok=True)

    def restore(self) -> int:
        iteration = self.manager.find_latest()
        if iteration < 0:
            return 0
        loaded, _ = self.manager.load()
        self.model.load_state_dict(loaded.state_dict["model"])
        self.optimizer.load_state_dict(loaded.state_dict["optim"])
        return int(iteration)

    def save(self, step: int) -> None:
        state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        self.manager.save(CpuStateDict(state), step, is_async=False)


def cpu_state_dict_class() -> type:
    """NVRx's BasicTensorAwareStateDict without its CUDA assumptions: the bench's one shim. Its
    constructor asserts every tensor is on CUDA and restore_tensor_device moves them to "cuda";
    on CPU both are skipped (the tensors already are where they belong). Everything else, the
    file format, the dirty-then-rename write, find_latest's all_gather across ranks and the
    cleanup, is NVRx's own."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (  # type: ignore[import-untyped]
        BasicTensorAwareStateDict,
    )

    class CpuStateDict(BasicTensorAwareStateDict):  # type: ignore[misc]
        def __init__(self, state_dict: dict[str, Any]) -> None:
            self.state_dict = state_dict
            self._is_hollow = False

        def restore_tensor_device(self, non_blocking: bool = True) -> None:
            pass

    CpuStateDict.__module__ = __name__
    CpuStateDict.__qualname__ = "CpuStateDict"
    return CpuStateDict


CpuStateDict: type = object  # set in main() for --mode nvrx (torch.load finds it here)


# -- the loops ----------------------------------------------------------------------------------


def make_keeper(
    mode: str,
    model: nn.Module,
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
) -> Any:
    if mode == "ftd":
        return FtdMemory(model, optimizer)
    if mode in ("dcp", "dcp-async"):
        return Dcp(ddp, optimizer, args.ckpt_dir, args.every, mode == "dcp-async")
    if mode == "nvrx":
        return Nvrx(model, optimizer, args.ckpt_dir, args.every)
    return NoCheckpoint()


def train(args: argparse.Namespace, log: Log) -> None:
    model, ddp, optimizer = build()
    monitor = None
    if args.mode == "nvrx":
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # type: ignore[import-untyped]

        monitor = RankMonitorClient()
        monitor.init_workload_monitoring()
    keeper = make_keeper(args.mode, model, ddp, optimizer, args)
    t_pg = time.time()
    resumed = keeper.restore()
    t_restored = time.time()
    restore_s = None
    if args.mode == "ftd":
        restore_s = keeper.checkpoint.stats().restore_s if resumed else None
    log.write("start", t0=T_SCRIPT, t_dist=args.t_dist, t_pg=t_pg, t_restored=t_restored,
              resumed=resumed, restore_s=restore_s)  # fmt: skip
    stop = torch.zeros(1)
    step = resumed
    while True:
        step += 1
        if monitor is not None:
            monitor.send_heartbeat()
        train_step(ddp, optimizer, step)
        stop[0] = 1.0 if time.time() >= args.deadline or step >= args.steps else 0.0
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        saved_s, took = None, False
        if keeper.every and step % keeper.every == 0:
            began = time.perf_counter()
            took = keeper.save(step) is not False  # ftd: False when no snapshot was taken
            saved_s = time.perf_counter() - began
        log.write("step", s=step, t=time.time(), save_s=saved_s, ck=took)
        if stop[0] > 0:
            break
    if isinstance(keeper, Dcp):
        keeper.wait()
    if args.mode == "ftd":
        keeper.checkpoint.wait()
        stats = keeper.checkpoint.stats()
        log.write("stats", saved=stats.saved, skipped=stats.skipped, failed=stats.failed,
                  waited_s=stats.waited_s, copy_s=stats.copy_s, copy_cpu_s=stats.copy_cpu_s,
                  spaced=stats.spaced, interval_steps=stats.interval_steps)  # fmt: skip
    log.write("end", s=step, t=time.time())
    if monitor is not None:
        monitor.shutdown_workload_monitoring()


def cost(args: argparse.Namespace, log: Log) -> None:
    """Alternating blocks in one process: the machine's load hits both kinds alike."""
    from ftd_client import checkpoint

    model, ddp, optimizer = build()
    log.write("start", t0=T_SCRIPT, t_pg=time.time(), t_restored=time.time(), resumed=0)
    step = 0
    for block in range(args.blocks):
        saving = block % 2 == 1
        for i in range(args.block):
            step += 1
            began = time.perf_counter()
            train_step(ddp, optimizer, step)
            stop = torch.zeros(1)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if saving:
                state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "n": step}
                checkpoint.save(state, step)
            log.write("cost", s=step, block=block, i=i, save=saving,
                      dt=time.perf_counter() - began)  # fmt: skip
        if saving:
            checkpoint.wait()
    stats = checkpoint.stats()
    log.write("stats", saved=stats.saved, skipped=stats.skipped, failed=stats.failed,
              waited_s=stats.waited_s, copy_s=stats.copy_s)  # fmt: skip


def calibrate(args: argparse.Namespace, log: Log) -> None:
    """What one save of `--keeper` costs the job: blocks of --block steps, alternately without
    and with a save every --every steps; a saving block's time includes waiting, at its end,
    for its last save to be written (dcp-async), so (saving - plain) / saves is the whole cost
    of a save, however it is spread over the steps."""
    model, ddp, optimizer = build()
    keeper = make_keeper(args.keeper, model, ddp, optimizer, args)
    log.write("start", t0=T_SCRIPT, t_pg=time.time(), t_restored=time.time(), resumed=0)
    step = 0
    for block in range(args.blocks):
        saving = block % 2 == 1
        began, calls = time.perf_counter(), []
        for _ in range(args.block):
            step += 1
            train_step(ddp, optimizer, step)
            stop = torch.zeros(1)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if saving and step % args.every == 0:
                called = time.perf_counter()
                keeper.save(step)
                calls.append(time.perf_counter() - called)
        if isinstance(keeper, Dcp):
            keeper.wait()
        dist.barrier()
        log.write("block", block=block, saving=saving, saves=len(calls), calls=calls,
                  steps=args.block, dt=time.perf_counter() - began)  # fmt: skip


def restore_probe(args: argparse.Namespace, log: Log, attempt: int) -> None:
    from ftd_client import checkpoint

    state = {"blob": torch.zeros(args.mb << 18), "n": 0}  # float32: MiB * 2^18 elements
    began = time.perf_counter()
    step = checkpoint.load(state)
    around_s = time.perf_counter() - began
    if step is not None:
        expect = float(step)
        ok = bool(state["blob"][0] == expect and state["blob"][-1] == expect)
        log.write("restore", step=step, restore_s=checkpoint.stats().restore_s,
                  around_s=around_s, ok=ok, bytes=state["blob"].nbytes)  # fmt: skip
    state["blob"].fill_(float(attempt + 1))
    checkpoint.save(state, attempt + 1)
    checkpoint.wait()
    if attempt < args.rounds:
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    global CpuStateDict
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True,
                        choices=("plain", "ftd", "dcp", "dcp-async", "nvrx", "cost", "restore",
                                 "calibrate"))  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--deadline", type=float, default=float("inf"), help="time.time()")
    parser.add_argument("--steps", type=int, default=10**9)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--block", type=int, default=25)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keeper", default="dcp", choices=("dcp", "dcp-async", "nvrx"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks on two cores
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    args.out.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    (args.out / f"pid-{attempt}-{rank}.json").write_text(
        json.dumps({"pid": pid, "start_ticks": start_ticks(pid), "rank": rank, "attempt": attempt})
    )
    log = Log(args.out, rank, attempt)
    if args.mode == "restore":
        restore_probe(args, log, attempt)
        return
    if "nvrx" in (args.mode, args.keeper):
        CpuStateDict = cpu_state_dict_class()
    dist.init_process_group("gloo")
    args.t_dist = time.time()
    if args.mode == "cost":
        cost(args, log)
    elif args.mode == "calibrate":
        calibrate(args, log)
    else:
        train(args, log)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
