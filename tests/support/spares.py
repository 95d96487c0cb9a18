"""What the hot-spare tests read and write: a node's metrics and cluster view, and forged
standby records put into the store as someone with its address and no secret would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from ftd.coordination.etcd.client import EtcdClient
from tests.conftest import Backend, Serve
from tests.support.cluster import Attacker, Cluster, api, run_dir

Forge = Callable[[str, bytes], Awaitable[None]]
OVERSIZED = b"ftd1 - " + b"x" * (70 * 1024)
"""Over the 64 KiB a record may have."""
UNSIGNED = b'ftd1 - {"node_id": "mallory", "since": 1.0}'
"""A well-formed standby record of a node that is not there, without the job's signature."""


async def metrics_of(run: Serve, node: str) -> str:
    info = json.loads((run_dir(run, node) / "api.json").read_text())
    async with (
        aiohttp.ClientSession() as session,
        session.get(info["url"] + "/metrics") as response,
    ):
        assert response.status == 200
        return await response.text()


async def cluster_until(
    run: Serve, node: str, ready: Callable[[dict[str, Any]], bool], timeout: float = 60
) -> dict[str, Any]:
    """GET /v1/cluster on `node` until `ready` holds: a standby registers in the store after
    it says so in its own log, with no event on the viewing node to wait on."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = await api(run, node, "GET", "/v1/cluster")
        if code == 200 and ready(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{node}'s cluster view: not within {timeout}s: {body}")
        await asyncio.sleep(0.2)


def roles(cluster: dict[str, Any]) -> dict[str, str]:
    return {str(n["node_id"]): str(n.get("role")) for n in cluster["nodes"]}


@contextlib.asynccontextmanager
async def forger(cluster: Cluster, backend: Backend) -> AsyncIterator[Forge]:
    """put(key, value) under the job's prefix, as someone with the store's address (or
    etcd's) and no secret has it. Under c10d, a `.../standby/<k>` slot is counted first, as
    a standby counts its own."""
    if backend.etcd is None:
        attacker = await asyncio.to_thread(Attacker, cluster.endpoint, cluster.job)

        def take_slot(key: str, value: bytes) -> None:
            counter, _, _ = key.rpartition("/")
            slot = attacker.store.add(counter, 1)
            attacker.set(f"{counter}/{slot}", value)

        async def put(key: str, value: bytes) -> None:
            await asyncio.to_thread(take_slot, key, value)

        yield put
        return
    async with EtcdClient(backend.etcd.endpoints, prefix=f"/ftd/{cluster.job}/") as client:

        async def etcd_put(key: str, value: bytes) -> None:
            await client.put(key, value)

        yield etcd_put
