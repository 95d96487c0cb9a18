"""Fault-tolerant process groups: real ranks (tests/bin/pg_worker.py), a real TCPStore hosted
here, real gloo; faults are real SIGKILLs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ftd_client.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupNCCL,
    StoreAddress,
    create_store_client,
    parse_store_addr,
)

from tests.conftest import BIN, ROOT

PG_WORKER = BIN / "pg_worker.py"
# A rank waiting on a live peer whose collective already failed is only released by this timeout.
GLOO_TIMEOUT_S = 4.0
FAILS_WITHIN_S = 3.0  # a rank waiting on a dead peer is released at once (its sockets closed)
REPLY_TIMEOUT_S = 40.0
NO_CUDA = "needs CUDA and NCCL; this machine has no GPU"


@dataclass
class Worker:
    """One rank: requests go in as JSON lines, one reply line comes back for each."""

    index: int
    proc: asyncio.subprocess.Process
    stderr: Path

    async def call(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), REPLY_TIMEOUT_S)
        assert line, f"worker {self.index} exited:\n{self.stderr.read_text()[-3000:]}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()


WorkerFactory = Callable[[int], Awaitable[list[Worker]]]


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[WorkerFactory]:
    started: list[Worker] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client")])}

    async def start(n: int) -> list[Worker]:
        batch = []
        for i in range(n):
            stderr = tmp_path / f"worker{len(started)}.err"
            with stderr.open("wb") as err:  # the child keeps its own copy of the descriptor
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, str(PG_WORKER), env=env, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=err,
                )  # fmt: skip
            worker = Worker(i, proc, stderr)
            started.append(worker)
            batch.append(worker)
        for worker in batch:
            assert worker.proc.stdout is not None
            ready = await asyncio.wait_for(worker.proc.stdout.readline(), REPLY_TIMEOUT_S)
            assert json.loads(ready) == {"ready": True}, worker.stderr.read_text()
        return batch

    yield start
    for worker in started:
        if worker.proc.returncode is None and worker.proc.stdin is not None:
            worker.proc.stdin.close()
    for worker in started:
        try:
            await asyncio.wait_for(worker.proc.wait(), 10)
        except TimeoutError:
            await worker.kill()
        # Read stdout to its end so that its transport closes here, not in a later test's GC.
        if worker.proc.stdout is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.proc.stdout.read(), 10)
        transport = getattr(worker.proc, "_transport", None)
        if transport is not None:
            transport.close()


@pytest.fixture
def store() -> Iterator[Callable[[str], str]]:
    """A real TCPStore hosted by the test; `addr(prefix)` is a configuration's address."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def addr(prefix: str) -> str:
        return f"127.0.0.1:{server.port}/{prefix}"

    yield addr


async def each(ranks: list[Worker], **request: Any) -> list[dict[str, Any]]:
    """The same request on every rank at once; "{rank}" in a string or `value=None` becomes
    the rank's index (value: index + 1)."""

    def for_rank(w: Worker) -> dict[str, Any]:
        r = {k: (v.format(rank=w.index) if isinstance(v, str) else v) for k, v in request.items()}
        if r.get("value", 0) is None:
            r["value"] = w.index + 1
        return r

    return list(await asyncio.gather(*(w.call(**for_rank(w)) for w in ranks)))


async def configure(ranks: list[Worker], name: str, addr: str) -> None:
    replies = await asyncio.gather(
        *(w.call(op="configure", name=name, addr=addr, rank=i, world=len(ranks))
          for i, w in enumerate(ranks))
    )  # fmt: skip
    assert all(r["ok"] for r in replies), replies
    for i, w in enumerate(ranks):
        w.index = i


def results(replies: list[dict[str, Any]]) -> list[Any]:
    assert all(r["ok"] for r in replies), replies
    return [r["result"] for r in replies]


async def assert_collectives(ranks: list[Worker], name: str) -> None:
    """allreduce, allgather, broadcast and broadcast_one; rank i contributes i + 1."""
    n = len(ranks)
    total = float(n * (n + 1) // 2)
    assert results(await each(ranks, op="allreduce", name=name, value=None)) == [[total] * 2] * n
    gathered = [[float(i + 1)] * 2 for i in range(n)]
    assert results(await each(ranks, op="allgather", name=name, value=None)) == [gathered] * n
    root = n - 1
    bcast = results(await each(ranks, op="broadcast", name=name, value=None, root=root))
    assert bcast == [[float(root + 1)] * 2] * n
    one = results(await each(ranks, op="broadcast_one", name=name, value=None, root=0))
    assert one == [[1.0] * 2] * n


# --- reconfiguration after a killed rank -------------------------------------------------------


@pytest.mark.timeout(90)
async def test_killed_rank_fails_gloo_is_swallowed_and_survivors_reconfigure(
    workers: WorkerFactory, store: Callable[[str], str]
) -> None:
    ranks = await workers(3)
    kinds = ("gloo", "swallow", "managed")
    for kind in kinds:
        new = await each(ranks, op="new", name=kind, kind=kind, timeout=GLOO_TIMEOUT_S)
        assert all(r["ok"] for r in new), new
        await configure(ranks, kind, store(f"{kind}/1"))
        await assert_collectives(ranks, kind)

    await ranks[2].kill()
    survivors = ranks[:2]

    # Plain gloo: the collective raises on every survivor. The one waiting on the dead peer fails
    # at once (its sockets closed); one waiting on a live survivor whose collective already
    # failed may have to wait for gloo's timeout.
    failed = await each(survivors, op="allreduce", name="gloo", value=None)
    assert not any(r["ok"] for r in failed), failed
    assert min(r["elapsed_s"] for r in failed) < FAILS_WITHIN_S, failed
    assert max(r["elapsed_s"] for r in failed) < GLOO_TIMEOUT_S + FAILS_WITHIN_S, failed

    # Error swallowing: the collective "succeeds" with tensors untouched; error() holds why.
    swallowed = await each(survivors, op="allreduce", name="swallow", value=None)
    assert results(swallowed) == [[1.0] * 2, [2.0] * 2]
    info = await each(survivors, op="info", name="swallow")
    assert all(i["error"] for i in info), info
    skipped = await each(survivors, op="allgather", name="swallow", value=None)
    assert results(skipped) == [[[0.0] * 2] * 3] * 2  # outputs left as they were

    # Managed: same, and the errors went to the manager.
    managed = await each(survivors, op="allreduce", name="managed", value=None)
    assert results(managed) == [[1.0] * 2, [2.0] * 2]
    info = await each(survivors, op="info", name="managed")
    assert all(i["manager_errors"] for i in info), info

    # A new membership of two, under a new prefix: everything works again, errors cleared.
    for kind in kinds:
        await configure(survivors, kind, store(f"{kind}/2"))
        await assert_collectives(survivors, kind)
    info = await each(survivors, op="info", name="swallow")
    assert [(i["error"], i["size"], i["rank"]) for i in info] == [(None, 2, 0), (None, 2, 1)]
    info = await each(survivors, op="info", name="managed")
    assert [i["size"] for i in info] == [2, 2]


# --- baby gloo ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_baby_gloo_survives_a_killed_and_a_hung_child(
    workers: WorkerFactory, store: Callable[[str], str]
) -> None:
    ranks = await workers(2)
    assert all(r["ok"] for r in await each(ranks, op="new", name="b", kind="baby", timeout=20))
    await configure(ranks, "b", store("baby/1"))
    await assert_collectives(ranks, "b")
    via_future = await each(ranks, op="allreduce", name="b", value=None, via="future")
    assert results(via_future) == [[3.0] * 2] * 2
    # Functional collectives find the group by name and reach it through torch's C++ side.
    assert results(await each(ranks, op="functional", name="b", value=None)) == [[3.0] * 2] * 2

    # Killed child: both ranks' next collective fails fast, with a baby error on rank 0.
    pids = [i["child_pid"] for i in await each(ranks, op="info", name="b")]
    os.kill(pids[0], signal.SIGKILL)
    failed = await each(ranks, op="allreduce", name="b", value=None)
    assert not any(r["ok"] for r in failed), failed
    assert "BabyDiedError" in failed[0]["error"], failed
    assert all(r["elapsed_s"] < FAILS_WITHIN_S for r in failed), failed

    await configure(ranks, "b", store("baby/2"))
    new_pids = [i["child_pid"] for i in await each(ranks, op="info", name="b")]
    assert not set(new_pids) & set(pids)
    assert results(await each(ranks, op="allreduce", name="b", value=None)) == [[3.0] * 2] * 2

    # Hung collective: rank 1 never joins; rank 0's wait gives up after 1 s and kills its baby,
    # whose peer then fails at once instead of waiting for gloo's timeout.
    hung = await ranks[0].call(op="allreduce", name="b", value=1, wait_s=1.0)
    assert not hung["ok"] and hung["error"].startswith("TimeoutError"), hung
    assert 1.0 <= hung["elapsed_s"] < 1.0 + FAILS_WITHIN_S, hung
    peer = await ranks[1].call(op="allreduce", name="b", value=2)
    assert not peer["ok"] and peer["elapsed_s"] < FAILS_WITHIN_S, peer

    await configure(ranks, "b", store("baby/3"))
    await assert_collectives(ranks, "b")


# --- collectives through every kind of group ---------------------------------------------------


@pytest.mark.timeout(90)
async def test_collectives_through_wrapper_dummy_and_device_mesh(
    workers: WorkerFactory, store: Callable[[str], str]
) -> None:
    ranks = await workers(2)
    for kind in ("wrapper", "dummy", "gloo"):
        assert all(r["ok"] for r in await each(ranks, op="new", name=kind, kind=kind))
        await configure(ranks, kind, store(f"{kind}/1"))
    await assert_collectives(ranks, "wrapper")
    info = await each(ranks, op="info", name="wrapper")
    described = [(i["backend"], i["size"], i["rank"]) for i in info]
    assert described == [("ftd-gloo", 2, 0), ("ftd-gloo", 2, 1)]

    # Dummy: complete at once, nothing exchanged; allgather repeats this rank's input.
    dummy = lambda op, **kw: each(ranks, op=op, name="dummy", value=None, **kw)  # noqa: E731
    assert results(await dummy("allreduce")) == [[1.0] * 2, [2.0] * 2]
    assert results(await dummy("allgather")) == [[[1.0] * 2] * 2, [[2.0] * 2] * 2]
    assert results(await dummy("broadcast", root=1)) == [[1.0] * 2, [2.0] * 2]
    assert results(await dummy("broadcast_one", root=0)) == [[1.0] * 2, [2.0] * 2]

    # torch's own entry points: dist.* with group=, and a DeviceMesh with the FT group as "dp".
    assert (
        results(await each(ranks, op="dist_all_reduce", name="gloo", value=None)) == [[3.0] * 2] * 2
    )
    mesh = await each(ranks, op="mesh", name="gloo", value=None)
    assert results(mesh) == [[3.0] * 2] * 2
    assert all(m["dims"] == ["dp", "tp"] and m["shape"] == [1, 1] and m["dp_is_pg"] for m in mesh)


@pytest.mark.timeout(60)
async def test_gloo_configure_does_not_wait_for_a_pending_collective(
    workers: WorkerFactory, store: Callable[[str], str]
) -> None:
    ranks = await workers(2)
    new = await each(ranks, op="new", name="g", kind="gloo", timeout=GLOO_TIMEOUT_S * 10)
    assert all(r["ok"] for r in new), new
    await configure(ranks, "g", store("g/1"))
    # Rank 0 starts an allreduce that rank 1 never joins, and rank 1 keeps the group open, so
    # nothing will release it before gloo's timeout; destroying it would block until then.
    assert (await ranks[0].call(op="abandon_allreduce", name="g", value=1))["ok"]
    alone = await ranks[0].call(op="configure", name="g", addr=store("g/2"), rank=0, world=1)
    assert alone["ok"] and alone["elapsed_s"] < FAILS_WITHIN_S, alone
    assert results([await ranks[0].call(op="allreduce", name="g", value=5)]) == [[5.0] * 2]


# --- in this process ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "addr",
    ["localhost:1234", "localhost/prefix", ":1234/p", "localhost:http/p", "localhost:1234/",
     "localhost:0/p", "localhost:70000/p", "[::1/p", "host:12:34/p", ""],
)  # fmt: skip
def test_malformed_store_addresses_are_refused(addr: str) -> None:
    with pytest.raises(ValueError, match="store address"):
        create_store_client(addr)


def test_store_addresses_parse() -> None:
    assert parse_store_addr("localhost:29500/run/3") == StoreAddress("localhost", 29500, "run/3")
    assert parse_store_addr("[::1]:1234/p") == StoreAddress("::1", 1234, "p")
    assert str(parse_store_addr("10.0.0.1:80/a/b")) == "10.0.0.1:80/a/b"


@pytest.mark.timeout(30)
def test_store_client_writes_under_its_prefix(store: Callable[[str], str]) -> None:
    client = create_store_client(store("cfg/7"))
    client.set("key", "value")
    port = parse_store_addr(store("x")).port
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    assert raw.get("cfg/7/key") == b"value"


def test_dummy_group_works_with_torch_distributed_calls() -> None:
    pg = ProcessGroupDummy(0, 1)
    tensor = torch.ones(3)
    dist.all_reduce(tensor, group=pg)
    assert tensor.tolist() == [1.0] * 3
    pg.configure("localhost:1/unused", 1, 4)
    assert (pg.configure_count, pg.rank(), pg.size(), pg.getBackendName()) == (
        1, 1, 4, "ftd-dummy",
    )  # fmt: skip
    outputs = [torch.zeros(2) for _ in range(2)]
    assert pg.allgather(outputs, torch.full((2,), 5.0)).wait()
    assert [o.tolist() for o in outputs] == [[5.0, 5.0]] * 2
    assert pg.broadcast_one(tensor, 0).get_future().wait() == [tensor]


def test_error_swallowing_wrapper_reports_and_skips_until_configure() -> None:
    pg = ErrorSwallowingProcessGroupWrapper(ProcessGroupDummy(0, 1))
    assert pg.error() is None
    pg.report_error(RuntimeError("peer died"))
    work = pg.allreduce([torch.ones(2)])
    assert work.wait() and work.is_completed()
    assert str(pg.error()) == "peer died"
    pg.configure("localhost:1/next", 0, 1)
    assert pg.error() is None


def test_register_and_unregister() -> None:
    from torch._C._distributed_c10d import _resolve_process_group

    pg = ProcessGroupDummy(0, 1)
    assert pg.register("ftd-test-dummy") is pg
    assert pg.group_name == "ftd-test-dummy"
    assert _resolve_process_group("ftd-test-dummy") is pg
    with pytest.raises(RuntimeError, match="already registered"):
        pg.register("again")
    pg.unregister()
    with pytest.raises(RuntimeError):
        _resolve_process_group("ftd-test-dummy")


# --- NCCL --------------------------------------------------------------------------------------


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
@pytest.mark.parametrize("cls", [ProcessGroupNCCL, ProcessGroupBabyNCCL])
def test_nccl_groups_refuse_to_start_without_cuda(cls: type[Any]) -> None:
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cls()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.timeout(60)
def test_nccl_single_rank_allreduce(store: Callable[[str], str]) -> None:
    for cls in (ProcessGroupNCCL, ProcessGroupBabyNCCL):
        pg = cls()
        pg.configure(store(f"nccl/{cls.__name__}"), 0, 1)
        tensor = torch.ones(4, device="cuda")
        pg.allreduce([tensor]).wait()
        torch.cuda.synchronize()
        assert tensor.tolist() == [1.0] * 4
        outputs = [torch.zeros(4, device="cuda")]
        pg.allgather([outputs], [tensor]).wait()
        torch.cuda.synchronize()
        assert outputs[0].tolist() == [1.0] * 4
