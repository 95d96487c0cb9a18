"""The API under attack: what was seen on live daemons, as tests. Each waits on the server's
own reaction (a closed socket, a log line, an answer), never on a guessed duration; bounds
that are timeouts run in process with short limits (tests/support/api_local.py), the rest against a
real `ftd serve`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from pathlib import Path

import aiohttp
from ftd_client.admin import AdminClient

from ftd.api import ApiLimits
from tests.conftest import ServeFactory
from tests.support.api import CONTRACT, PROBLEM, api_of, stop
from tests.support.api_local import (  # noqa: F401 (private_registry: an autouse fixture)
    Clients,
    closed_by_peer,
    ftd_log,
    local_api,
    private_registry,
    raw_request,
)

CLOSED = 'ftd_api_connections_closed_total{reason="%s",site="tcp"}'
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"


# -- connections: header deadline, idle timeout, cap ------------------------------------------


async def test_slowloris_sockets_are_cut_at_the_header_deadline(tmp_path: Path) -> None:
    limits = ApiLimits(header_timeout_s=0.5, idle_timeout_s=60)
    async with local_api(tmp_path / "run", limits) as api, Clients(api.port) as clients:
        loop = asyncio.get_running_loop()
        began = loop.time()
        sockets = [await clients.connect() for _ in range(20)]
        for _, writer in sockets:
            writer.write(HEALTHZ)  # a head that never ends

        async def trickle(writer: asyncio.StreamWriter) -> None:
            # A byte now and then must not move the deadline (the attacker paces itself).
            with contextlib.suppress(ConnectionError):
                while not writer.is_closing():
                    writer.write(b"X-Slow: 1\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.05)

        tricklers = [asyncio.create_task(trickle(writer)) for _, writer in sockets[:5]]
        answers = await asyncio.gather(*(closed_by_peer(reader) for reader, _ in sockets))
        assert answers == [b""] * 20  # cut, not answered
        assert loop.time() - began >= limits.header_timeout_s
        for task in tricklers:
            task.cancel()
        assert await api.metric(CLOSED % "header_timeout") == 20
        status, _, body = await raw_request(api.port, HEALTHZ)
        assert (status, body["status"]) == (200, "ok")


async def test_idle_keep_alive_connections_are_closed(tmp_path: Path) -> None:
    limits = ApiLimits(header_timeout_s=0.5, idle_timeout_s=0.5)
    async with local_api(tmp_path / "run", limits) as api, Clients(api.port) as clients:
        reader, writer = await clients.connect()
        silent_reader, _ = await clients.connect()
        for _ in range(2):  # keep-alive serves several requests on one connection
            writer.write(HEALTHZ + b"\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        assert await closed_by_peer(reader) == b""  # then idle: closed
        assert await closed_by_peer(silent_reader) == b""  # connected, never a byte: closed
        assert await api.metric(CLOSED % "idle_timeout") == 1
        assert await api.metric(CLOSED % "header_timeout") == 1


async def test_a_connection_flood_is_refused_beyond_the_cap(tmp_path: Path) -> None:
    limits = ApiLimits(max_connections=20, header_timeout_s=60, max_admin_connections=4)
    with ftd_log() as logs:
        async with local_api(tmp_path / "run", limits) as api, Clients(api.port) as clients:
            held = [await clients.connect() for _ in range(20)]
            extra = [await clients.connect() for _ in range(30)]
            answers = await asyncio.gather(*(closed_by_peer(reader, 10) for reader, _ in extra))
            assert answers == [b""] * 30
            # The operator's admin socket has a budget of its own: it answers meanwhile.
            admin = AdminClient(socket_path=api.server.socket_path)
            metrics = await asyncio.to_thread(admin.metrics)
            assert f"{CLOSED % 'cap'} 30.0" in metrics
            assert f"{CLOSED % 'header_timeout'} 0.0" in metrics
            assert 'ftd_api_connections{site="tcp"} 20.0' in metrics
            assert logs.count("connections open, the most it keeps") == 1  # logged once
            for _, writer in held + extra:  # the flood ends
                writer.close()
            for reader, _ in held:
                await closed_by_peer(reader)
            status, _, _ = await raw_request(api.port, HEALTHZ)  # a new client is served
            assert status == 200
            await logs.expect(r"API \(tcp\): accepting again; refused 30 \(cap\) meanwhile")


async def test_a_body_that_does_not_arrive_is_408(tmp_path: Path) -> None:
    limits = ApiLimits(body_timeout_s=0.5)
    async with local_api(tmp_path / "run", limits) as api, Clients(api.port) as clients:
        reader, writer = await clients.connect()
        writer.write(
            b"POST /v1/restart HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + api.token.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"rea'
        )
        raw = await closed_by_peer(reader)  # answered, then closed
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        CONTRACT.check("POST", "/v1/restart", 408, PROBLEM, body)
        assert json.loads(body)["detail"] == "body: not received within 0.5 s"
        assert api.control.events.last_id == 0  # nothing was restarted


# -- event streams: readers that fall behind or stop reading ----------------------------------

SSE_REQUEST = b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"


async def test_a_reader_that_falls_behind_gets_a_last_message(tmp_path: Path) -> None:
    limits = ApiLimits(stream_max_pending=10)
    async with local_api(tmp_path / "run", limits) as api, Clients(api.port) as clients:
        reader, writer = await clients.connect()
        writer.write(SSE_REQUEST)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        await reader.readuntil(b"retry: 1000\n\n")
        for i in range(50):  # faster than this reader takes them
            api.control.events.emit("flood", i=i)
        rest = (await closed_by_peer(reader)).decode()
        assert "event: stream_dropped\ndata: " in rest
        last = json.loads(rest.split("event: stream_dropped\ndata: ")[1].split("\n")[0])
        assert "fell behind by more than 10 events" in last["reason"]
        # It has no id, so a reconnecting EventSource resumes where it was: nothing is lost.
        block = rest.split("event: stream_dropped")[0].rsplit("\n\n", 2)[-1]
        assert "id:" not in block
        status, _, page = await raw_request(
            api.port,
            f"GET /v1/events?since={last['last_id']} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode(),
        )
        assert status == 200 and [e["data"]["i"] for e in page["events"]][-1] == 49
        assert len(page["events"]) == 50 - last["last_id"]
        assert await api.metric('ftd_api_event_streams_dropped_total{reason="lagged"}') == 1
        assert await api.metric("ftd_api_event_streams ") == 0


async def test_a_reader_that_stops_reading_is_cut_off(tmp_path: Path) -> None:
    limits = ApiLimits(stream_max_pending=100_000, stream_write_timeout_s=0.5)
    with ftd_log() as logs:
        async with (
            local_api(tmp_path / "run", limits, events_file=False) as api,
            Clients(api.port) as clients,
        ):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", api.port))
            reader, writer = await clients.connect(sock=sock)
            writer.write(SSE_REQUEST)
            await reader.readuntil(b"retry: 1000\n\n")
            blob = "x" * 65536
            for i in range(200):  # 13 MB the reader never takes
                api.control.events.emit("big", i=i, blob=blob)
            await logs.expect(r"dropped the event stream of .*: a write did not complete in 0.5 s")
            assert await api.metric('ftd_api_event_streams_dropped_total{reason="stalled"}') == 1
            assert await api.metric("ftd_api_event_streams ") == 0


# -- a real daemon ----------------------------------------------------------------------------


async def test_hostile_headers_and_bodies_get_4xx_problems(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "1", script_args=("--hang",))
    async with api_of(run) as api:
        port, token = api.info["port"], api.token.encode()
        auth = b"Authorization: Bearer " + token + b"\r\n"

        async def post(path: str, body: bytes, template: str | None = None) -> dict[str, object]:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n"
            ).encode() + auth
            status, headers, problem = await raw_request(port, head, body)
            content_type = headers["content-type"].split(";")[0]
            CONTRACT.check(
                "POST", template or path, status, content_type, json.dumps(problem).encode()
            )
            assert status == 400, problem
            return problem

        # Deep JSON: was a 500 RecursionError.
        problem = await post("/v1/restart", b"[" * 60_000)
        assert problem["detail"] == "body: JSON nested deeper than 32 levels"
        problem = await post("/v1/restart", b'{"reason": ' + b'{"a": ' * 40 + b"1" + b"}" * 41)
        assert problem["detail"] == "body: JSON nested deeper than 32 levels"
        problem = await post("/v1/restart", b'{"reason": "line\\nforged log line"}')
        assert (
            problem["detail"]
            == "reason: must not contain control characters (line breaks, escapes)"
        )

        # Authorization that is not UTF-8, or not ASCII, or twice: 401, never 500.
        restart = b"POST /v1/restart HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n"
        for header in (
            b"Authorization: Bearer \xff\xfe\xfa" + token + b"\r\n",
            "Authorization: Bearer tökén-0123456789abcdef\r\n".encode(),
            b"Authorization: Bearer\xa0" + token + b"\r\n",
            auth + auth,
        ):
            status, headers, problem = await raw_request(port, restart + header)
            assert status == 401 and headers["www-authenticate"].startswith("Bearer"), problem
            CONTRACT.check("POST", "/v1/restart", 401, PROBLEM, json.dumps(problem).encode())

        # DNS rebinding: a page whose name now points at 127.0.0.1 sends its own Host.
        for host, expected in (
            (b"evil.example", 421),
            (b"evil.example:" + str(port).encode(), 421),
            (b"127.0.0.1.evil.example", 421),
            (b"a:b:c", 421),
            (b"localhost\xff", 421),
            (b"localhost:" + str(port).encode(), 200),
            (b"LOCALHOST.", 200),
            (b"127.0.0.2", 200),
            (b"[::1]:" + str(port).encode(), 200),
        ):
            head = b"GET /v1/status HTTP/1.1\r\nHost: " + host + b"\r\n"
            status, headers, body = await raw_request(port, head)
            assert status == expected, (host, body)
            if status == 421:
                CONTRACT.check("GET", "/v1/status", 421, PROBLEM, json.dumps(body).encode())
                assert body["type"] == "https://ftd.dev/problems/misdirected"

        # Query integers: ASCII digits within the declared bounds.
        for query in ("since=%D9%A1%D9%A2", "since=9223372036854775808", "since=1_0", "since=+1"):
            status, _, problem = await raw_request(
                port, f"GET /v1/events?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
            )
            assert status == 400 and str(problem["detail"]).startswith("since:"), (query, problem)
        # A Last-Event-ID that is no event id is ignored, not a 500.
        headers = {"Accept": "text/event-stream", "Last-Event-ID": "²"}
        async with api.session.get(f"{api.url}/v1/events?since=0", headers=headers) as response:
            assert response.status == 200
            assert (await response.content.readline()).startswith(b"retry:")

        status, _, _ = await api.call("GET", "/v1/status")
        assert status == 200  # all along, the daemon served
        assert await stop(run) == 128 + signal.SIGTERM
    assert "Traceback" not in run.stderr.text
    assert "unexpected error" not in run.stderr.text


async def test_300_event_streams_meet_the_cap_and_timeouts_change_fast(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "1", script_args=("--hang",))
    async with api_of(run) as api:
        cap = ApiLimits().max_event_streams
        headers = {"Accept": "text/event-stream"}
        streams: list[aiohttp.ClientResponse] = []
        refused = 0
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                for _ in range(300):
                    response = await session.get(f"{api.url}/v1/events", headers=headers)
                    if response.status == 200:
                        streams.append(response)
                        continue
                    body = await response.read()
                    assert response.status == 429, body
                    assert response.headers["Retry-After"] == "5"
                    CONTRACT.check("GET", "/v1/events", 429, response.content_type, body)
                    refused += 1
                assert (len(streams), refused) == (cap, 300 - cap)

                began = time.perf_counter()
                status, changed, _ = await api.call(
                    "PATCH", "/v1/timeouts", body={"rank_heartbeat_timeout": 77}
                )
                took = time.perf_counter() - began
                assert status == 200 and changed["rank_heartbeat_timeout"] == 77

                async def announced(response: aiohttp.ClientResponse) -> None:
                    while line := await response.content.readline():
                        if line.startswith(b"event: timeouts_changed"):
                            return
                    raise AssertionError("stream ended")

                await asyncio.wait_for(asyncio.gather(*map(announced, streams)), 60)
                # It was 123 ms with 300 subscribers when each event scanned the ring for
                # each of them; now a few ms. The bound is loose: the machine is shared.
                assert took < 2.0, took
                _, text, _ = await api.call("GET", "/metrics")
                assert f"ftd_api_event_streams {cap}.0" in text
                assert f"ftd_api_event_streams_refused_total {300 - cap}.0" in text
            finally:
                for response in streams:
                    response.close()
        assert await stop(run) == 128 + signal.SIGTERM
    assert run.stderr.text.count("event streams open, the most it keeps") == 1
