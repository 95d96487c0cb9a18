"""The workers' store in a process of its own (ftd/ranks/store_process.py): torch's own client
sets and gets through it, every attempt gets a new empty one, it never outlives the daemon
(closed, or SIGKILLed), and a line on its pipe that is no port is refused and said in one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from ftd.config.serve import ServeConfig
from ftd.ranks.store_process import PORT_LINE_MAX_BYTES, StoreProcess, StoreProcessError
from ftd.ranks.workers_store import OWN_PROCESS_FROM_RANKS, AttemptStores, own_process
from ftd.refusals import Refusals
from tests.conftest import ROOT, ServeFactory, wait_pids_gone

HOST = "127.0.0.1"


def torch_client(port: int) -> object:
    from torch.distributed import TCPStore

    return TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=30))


def set_and_get(port: int, key: str, value: bytes) -> tuple[bytes, int, bool]:
    store = torch_client(port)
    store.set(key, value)  # type: ignore[attr-defined]
    return (
        store.get(key),  # type: ignore[attr-defined]
        store.add("counter", 5),  # type: ignore[attr-defined]
        store.check(["never-set"]),  # type: ignore[attr-defined]
    )


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


def children(pid: int) -> set[int]:
    return {
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    }


def holds(port: int, key: str) -> bool:
    return bool(torch_client(port).check([key]))  # type: ignore[attr-defined]


async def test_a_torch_client_sets_and_gets_through_a_store_of_its_own_without_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FTD_API_TOKEN", "not-for-the-store")
    stores = AttemptStores(HOST, own_process=True)
    try:
        _, port = await stores.fresh()
        [pid] = stores.pids
        got = await asyncio.to_thread(set_and_get, port, "init/addr", b"10.0.0.1:1234")
        assert got == (b"10.0.0.1:1234", 5, False)
        assert pid in children(os.getpid())
        assert "ftd.ranks.store_process" in cmdline(pid)
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "torch" not in maps and "uvloop" in maps
        assert b"FTD_API_TOKEN" not in Path(f"/proc/{pid}/environ").read_bytes()
    finally:
        await stores.close()


async def test_fresh_twice_gives_two_different_empty_stores_and_ends_the_first() -> None:
    stores = AttemptStores(HOST, own_process=True)
    try:
        _, first = await stores.fresh()
        [first_pid] = stores.pids
        await asyncio.to_thread(set_and_get, first, "stale", b"attempt 0")
        await stores.prepared()
        _, second = await stores.fresh()
        [second_pid, *_] = stores.pids
        assert second != first and second_pid != first_pid
        assert await wait_pids_gone([first_pid], timeout=30) == []
        assert not await asyncio.to_thread(holds, second, "stale")
    finally:
        await stores.close()


async def test_a_fixed_port_is_rebound_by_a_process_started_before_the_switch() -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    stores = AttemptStores(HOST, port, own_process=True)
    try:
        assert (await stores.fresh())[1] == port
        await asyncio.to_thread(set_and_get, port, "stale", b"attempt 0")
        await stores.prepared()
        waiting = stores.pids[1]  # started, not listening: the port is the current store's
        assert (await stores.fresh())[1] == port
        assert stores.pids[0] == waiting
        assert not await asyncio.to_thread(holds, port, "stale")
    finally:
        await stores.close()


async def test_every_store_process_ends_when_the_stores_are_closed() -> None:
    stores = AttemptStores(HOST, own_process=True)
    await stores.fresh()
    await stores.prepared()
    pids = stores.pids
    assert len(pids) == 2  # this attempt's and the next one
    await stores.close()
    assert stores.pids == []
    assert not children(os.getpid()) & set(pids)  # reaped: not even a zombie is left


PARENT = textwrap.dedent(
    """
    import asyncio, json, sys
    import uvloop
    from ftd.ranks.workers_store import AttemptStores

    async def main():
        stores = AttemptStores("127.0.0.1", own_process=True)
        await stores.fresh()
        await stores.prepared()
        print(json.dumps(stores.pids), flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())
    """
)


async def test_the_store_processes_die_with_a_daemon_that_is_sigkilled() -> None:
    parent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PARENT,
        stdout=asyncio.subprocess.PIPE,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'client'}"},
    )
    assert parent.stdout is not None
    try:
        pids = json.loads(await asyncio.wait_for(parent.stdout.readline(), 60))
        assert len(pids) == 2
        assert children(parent.pid) == set(pids)
        parent.kill()
        await parent.wait()
        assert await wait_pids_gone(pids, timeout=30) == []
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()


HOSTILE = {
    "too_long": (b"7" * (PORT_LINE_MAX_BYTES * 4), "store_process_line_too_long"),
    "endless": (b"1" * 65536, "store_process_line_too_long"),
    "out_of_range": (b"65536\n", "store_process_port_out_of_range"),
    "zero": (b"0\n", "store_process_port_out_of_range"),
    "no_port": (b"12ab\n", "store_process_no_port"),
    "signed": (b"+80\n", "store_process_no_port"),
    "not_ascii": ("٣٣\n".encode(), "store_process_no_port"),
    "terminal": (b"\x1b]0;owned\x07\n", "store_process_no_port"),
    "cut": (b"4242", "store_process_line_cut"),
    "silent": (b"", None),
    "its_error": (b"error \x1b[2J[Errno 98] Address in use\n", None),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
async def test_a_line_on_the_pipe_that_is_no_port_is_refused_in_one_line(name: str) -> None:
    said, cause = HOSTILE[name]
    script = f"import os; os.write(1, {said!r})"
    refusals = Refusals("tcp_store")
    with pytest.raises(StoreProcessError) as raised:
        await StoreProcess.start(HOST, 0, refusals, argv=[sys.executable, "-c", script])
    why = str(raised.value)
    assert "\n" not in why and "\x1b" not in why and len(why) < 400, why
    assert dict(refusals) == ({cause: 1} if cause else {})


async def test_a_store_process_that_cannot_listen_is_an_os_error_the_stores_retry() -> None:
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        stores = AttemptStores(HOST, holder.getsockname()[1], own_process=True)
        stop = asyncio.Event()
        with pytest.raises(Exception, match=r"cannot host the workers' store: .*in use"):
            await stores.fresh_port(stop, timeout_s=0.1)
        await stores.close()


def test_auto_gives_a_process_of_its_own_to_large_jobs_only(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")

    def config(nnodes: int, nproc: int, setting: str = "auto") -> ServeConfig:
        return ServeConfig(
            entrypoint=str(script),
            nnodes_min=1,
            nnodes_max=nnodes,
            nproc_per_node=nproc,
            workers_store_process=setting,
        )

    assert own_process(config(1, 8))[0] is False
    assert own_process(config(OWN_PROCESS_FROM_RANKS // 8, 8))[0] is True
    assert own_process(config(OWN_PROCESS_FROM_RANKS // 8 - 1, 8))[0] is False
    assert own_process(config(1, 1, "on")) == (True, "--workers-store-process on")
    assert own_process(config(4096, 8, "off"))[0] is False


def test_the_flags_help_names_the_threshold_the_daemon_uses() -> None:
    from ftd.cli import serve_args

    assert serve_args.OWN_PROCESS_FROM_RANKS == OWN_PROCESS_FROM_RANKS
    help_text = serve_args.build_serve_parser().format_help()
    assert "--workers-store-process" in help_text


async def test_a_daemon_restarts_gloo_ranks_through_store_processes_and_leaves_none(
    serve: ServeFactory,
) -> None:
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1", "--workers-store-process", "on",
        script_args=("--allreduce", "--fail-attempts", "1"),
    )  # fmt: skip
    assert await run.wait() == 0, run.stderr.text[-3000:]
    assert "runs in a process of its own (--workers-store-process on)" in run.stderr.text
    marks = {f"allreduce_a{attempt}_r{rank}" for attempt in (0, 1) for rank in (0, 1)}
    assert marks <= {path.name for path in run.out.iterdir()}
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                said = cmdline(int(entry.name))
                if "ftd.ranks.store_process" in said and str(run.proc.pid) in said:
                    left.append(int(entry.name))
    assert left == []
