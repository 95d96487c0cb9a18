"""In-process rounds under attack (issue 23, row 7): someone who reaches the rounds' store but
has no job secret writes faults, wakes, members, arrivals and dead slots there. Under a secret
every record is sealed (ftd_client/inprocess/keys.py), so none of it restarts a round: the job
ends as if nobody had written, and the daemon says what it ignored."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from ftd_client.inprocess.keys import (
    DAEMON,
    FAULT,
    Fault,
    Forged,
    Keys,
    Members,
    Seal,
    derive_key,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import C10D, ServeFactory, pids_with_env
from tests.support.cluster import JOB_SECRET
from tests.support.fuzzing import budget, fuzz_target
from tests.support.inprocess import ENV, PRELOAD, TRAIN, WORLD


def test_seals_bind_the_key_and_the_attempt() -> None:
    seal = Seal(derive_key(JOB_SECRET.encode(), "ftd/inprocess/job/attempt_0"))
    other = Seal(derive_key(JOB_SECRET.encode(), "ftd/inprocess/job/attempt_1"))
    sealed = seal.seal("p/round/0/fault", b"{}")
    assert seal.unseal("p/round/0/fault", sealed) == b"{}"
    bad_reads: list[Callable[[], bytes]] = [
        lambda: seal.unseal("p/round/1/fault", sealed),  # replayed into another round
        lambda: other.unseal("p/round/0/fault", sealed),  # into another attempt
        lambda: seal.unseal("p/round/0/fault", b"{}"),  # unsealed
        lambda: seal.unseal("p/round/0/fault", b"ftds1 00 {}"),
    ]
    for bad in bad_reads:
        with pytest.raises(ValueError):
            bad()
    assert Seal().unseal("k", b"plain") == b"plain"  # no secret: values pass as they are


def _rounds_store() -> tuple[str, int, str]:
    """The rounds' store and prefix, from a rank's environment (any local user can read the
    address elsewhere: the store listens on the network)."""
    for pid in pids_with_env("FTD_RESTART_MODE", "inprocess"):
        try:
            with open(f"/proc/{pid}/environ", "rb") as file:
                pairs = [item.split(b"=", 1) for item in file.read().split(b"\0") if b"=" in item]
        except OSError:
            continue
        env = {k.decode(): v.decode(errors="replace") for k, v in pairs}
        if "FTD_STORE_ADDR" in env and "FTD_INPROCESS_PREFIX" in env:
            host, _, port = env["FTD_STORE_ADDR"].rpartition(":")
            return host, int(port), env["FTD_INPROCESS_PREFIX"]
    raise AssertionError("no rank with the in-process rounds' store in its environment")


def _attack(host: str, port: int, prefix: str) -> None:
    """Blocking: three forged faults for round 0 (each with every watcher's wake), a forged
    members record, arrivals and a dead slot for round 1."""
    from ftd_client.store import tcp_store_client

    store = tcp_store_client(host, port, 10)
    keys = Keys(prefix)
    for n in range(3):
        fault = Fault.now("exception", 1, f"forged {n}", 0, "rank 1")
        store.set(keys.fault(0), fault.encode())
        for who in [*range(WORLD), DAEMON]:
            store.set(keys.wake(0, who), FAULT)
    store.set(keys.members(1), Members((0, 1, 2, 3), "203.0.113.9", 4242, "daemon a").encode())
    for slot in range(WORLD):
        store.set(keys.arrive(1, slot), json.dumps({"pid": 1, "hard_timeout_s": 1}).encode())
    count = int(store.add(keys.dead_count, 1))
    store.set(keys.dead(count), "1")


@pytest.mark.timeout(150)
async def test_forged_inprocess_records_restart_nothing(
    serve: ServeFactory, tmp_path: Path
) -> None:
    endpoint = C10D.endpoint()
    out = tmp_path / "out"
    nodes = [
        await serve(
            "--nnodes", "2", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
            "--rdzv-last-call-timeout", "1", "--node-id", node, "--nproc-per-node", "2",
            "--max-restarts", "0", "--restart-mode", "inprocess", *PRELOAD,
            script=TRAIN,
            script_args=(
                "--out", str(out), "--inject", "none", "--steps", "60", "--step-time", "0.1",
            ),
            env={**ENV, "FTD_RDZV_SECRET": JOB_SECRET},
        )
        for node in ("a", "b")
    ]  # fmt: skip
    a = nodes[0]
    await a.stderr.expect(r"in-process round 0: ranks", timeout=90)
    host, port, prefix = await asyncio.to_thread(_rounds_store)
    await asyncio.to_thread(_attack, host, port, prefix)
    for node in nodes:
        assert await node.wait(timeout=120) == 0, node.stderr.text[-3000:]
    assert not list(out.glob("round_i1_*")), sorted(p.name for p in out.iterdir())
    finals = [json.loads((out / f"final_s{slot}").read_text()) for slot in range(WORLD)]
    assert all(f["world"] == WORLD for f in finals), finals
    events = [json.loads(line) for line in (a.log_dir / "a" / a.run_id / "events.jsonl")
              .read_text().splitlines()]  # fmt: skip
    assert "inprocess_fault" not in [e["kind"] for e in events]
    assert "in-process: ignored a fault record" in a.stderr.text
    assert os.stat(a.log_dir / "a" / a.run_id / "inprocess_0.key").st_mode & 0o077 == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("inject", "flags"),
    [("raise", ()), ("exit", ()), ("exit", ("--no-inprocess-respawn",))],
    ids=["raise", "exit-respawn", "exit-written-off"],
)
async def test_sealed_rounds_restart_in_process_on_a_real_fault(
    serve: ServeFactory, tmp_path: Path, inject: str, flags: tuple[str, ...]
) -> None:
    """The sealed records carry the genuine protocol: a rank's exception (announced by the
    rank), a death (announced by its daemon, respawned or written off for good)."""
    endpoint = C10D.endpoint()
    out = tmp_path / "out"
    nodes = [
        await serve(
            "--nnodes", "2", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
            "--rdzv-last-call-timeout", "1", "--node-id", node, "--nproc-per-node", "2",
            "--max-restarts", "1", "--restart-mode", "inprocess", *PRELOAD, *flags,
            script=TRAIN,
            script_args=("--out", str(out), "--inject", inject, "--step-time", "0.05"),
            env={**ENV, "FTD_RDZV_SECRET": JOB_SECRET},
        )
        for node in ("a", "b")
    ]  # fmt: skip
    for node in nodes:
        assert await node.wait(timeout=120) == 0, node.stderr.text[-3000:]
    assert list(out.glob("round_i1_*")), sorted(p.name for p in out.iterdir())
    for node in nodes:
        assert "in-process: ignored" not in node.stderr.text


@fuzz_target("store_records", 150)
@given(st.binary(max_size=4096), st.sampled_from(["p/round/0/fault", "p/dead/1"]))
def test_unsealing_any_value_is_a_record_or_forged_in_linear_time(data: bytes, key: str) -> None:
    seal = Seal(derive_key(JOB_SECRET.encode(), "p"))
    try:
        with budget(0.05):
            payload = seal.unseal(key, data)
    except Forged:
        pass
    else:
        assert data.endswith(payload) and len(payload) < len(data)
    assert seal.unseal(key, seal.seal(key, data)) == data
