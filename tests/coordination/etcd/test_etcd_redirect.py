"""The etcd client follows no redirect (issue 23, item 6): an endpoint answering 3xx would have
aiohttp re-send the request body, `/v3/auth/authenticate`'s password included, to wherever it
points. A 3xx is a failed attempt, and the other origin hears nothing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from ftd.coordination.etcd.client import EtcdAuthError, EtcdBadAnswer, EtcdClient, EtcdUnavailable
from tests.support.etcd_cluster import ClusterFactory


async def _site(app: web.Application, runners: list[web.AppRunner]) -> str:
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    runners.append(runner)
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[str, list[bytes]]]:
    """(the URL of a server answering every POST with 307 to a second local server, the
    bodies that second server received)."""
    received: list[bytes] = []
    runners: list[web.AppRunner] = []

    async def record(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"header": {}, "token": "stolen"})

    recorder = web.Application()
    recorder.router.add_route("POST", "/{path:.*}", record)
    elsewhere = await _site(recorder, runners)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(elsewhere + request.path)

    redirector = web.Application()
    redirector.router.add_route("POST", "/{path:.*}", redirect)
    yield await _site(redirector, runners), received
    for runner in runners:
        await runner.cleanup()


async def test_a_redirect_is_a_failed_attempt_and_sends_nothing_elsewhere(
    redirecting: tuple[str, list[bytes]],
) -> None:
    url, received = redirecting
    async with EtcdClient([url], username="root", password="the-password", timeout_s=0.5) as client:
        for call in (lambda: client.get("k"), lambda: client.put("k", b"v")):
            started = time.monotonic()
            with pytest.raises((EtcdBadAnswer, EtcdUnavailable, EtcdAuthError)):
                await call()
            assert time.monotonic() - started < 2
    async with EtcdClient([url], timeout_s=0.5) as client:
        with pytest.raises((EtcdBadAnswer, EtcdUnavailable)):
            await client.get("k")
    assert received == []


async def test_reads_move_on_from_a_redirecting_endpoint_to_a_real_one(
    etcd: ClusterFactory, redirecting: tuple[str, list[bytes]]
) -> None:
    url, received = redirecting
    cluster = await etcd()
    async with EtcdClient([url, *cluster.endpoints]) as client:
        assert await client.get("k") is None
        await client.put("k", b"v")
        assert (await client.get("k")) is not None
    assert received == []
