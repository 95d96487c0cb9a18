"""The REST control API end to end: real daemons, real ranks, real HTTP; every response is
held to openapi.yaml."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ftd.supervision.recovery import STAGES
from tests.conftest import BIN, ROOT, Serve, ServeFactory, await_api_event
from tests.support.api import (
    CONTRACT,
    PROBLEM,
    SPEC_PATH,
    Api,
    api_of,
    cli,
    python,
    stop,
)

# -- the event stream -------------------------------------------------------------------------


class EventStream:
    """`GET /v1/events` as server-sent events, parsed."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(
        self,
        kind: str,
        where: Callable[[dict[str, Any]], bool] = lambda e: True,
        timeout: float = 60,
    ) -> dict[str, Any]:
        async def find() -> dict[str, Any]:
            data: list[str] = []
            fields: dict[str, str] = {}
            while line := await self.response.content.readline():
                text = line.decode().rstrip("\n")
                if text.startswith("data: "):
                    data.append(text[6:])
                elif text.startswith(("id: ", "event: ")):
                    key, _, value = text.partition(": ")
                    fields[key] = value
                elif not text and data:
                    event: dict[str, Any] = json.loads("\n".join(data))
                    assert fields == {"id": str(event["id"]), "event": event["kind"]}, fields
                    if event["kind"] == kind and where(event):
                        return event
                    data, fields = [], {}
            raise AssertionError(f"the event stream ended before a {kind!r} event")

        return await asyncio.wait_for(find(), timeout)


@contextlib.asynccontextmanager
async def event_stream(api: Api, since: int | None = None) -> AsyncIterator[EventStream]:
    query = "" if since is None else f"?since={since}"
    headers = {"Accept": "text/event-stream", "Authorization": f"Bearer {api.token}"}
    async with api.session.get(f"{api.url}/v1/events{query}", headers=headers) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        CONTRACT.check("GET", "/v1/events", 200, "text/event-stream", b"")
        yield EventStream(response)


# -- the contract itself ----------------------------------------------------------------------


def test_spec_is_valid_openapi_31() -> None:
    from openapi_spec_validator import validate
    from openapi_spec_validator.validation.validators import OpenAPIV31SpecValidator

    assert CONTRACT.spec["openapi"].startswith("3.1")
    validate(CONTRACT.spec, cls=OpenAPIV31SpecValidator)


@pytest.mark.parametrize("name", ["RestartRequest", "ExcludeRequest"])
def test_request_models_match_the_spec(name: str) -> None:
    from ftd.api import app

    model = getattr(app, name).model_json_schema()
    spec = CONTRACT.spec["components"]["schemas"][name]
    assert spec["additionalProperties"] is False and model["additionalProperties"] is False
    assert set(spec["properties"]) == set(model["properties"])
    for field, prop in model["properties"].items():
        declared = spec["properties"][field]
        assert declared.get("default") == prop.get("default"), field
        assert declared.get("enum") == prop.get("enum"), field
        assert declared.get("maxLength") == prop.get("maxLength"), field
        assert declared.get("pattern") == prop.get("pattern"), field
        assert declared["type"] == prop["type"], field
    assert set(spec.get("required", [])) == set(model.get("required", []))


def test_timeouts_match_the_daemons_model() -> None:
    from ftd.config.ft import RankTimeouts

    schemas = CONTRACT.spec["components"]["schemas"]
    fields = set(RankTimeouts.model_fields)
    assert set(schemas["Timeouts"]["properties"]) == fields == set(schemas["Timeouts"]["required"])
    assert set(schemas["TimeoutsPatch"]["properties"]) == fields
    CONTRACT._validate("/components/schemas/Timeouts", RankTimeouts().model_dump())


# -- a running daemon -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def hanging_job(serve: ServeFactory) -> AsyncIterator[tuple[Serve, Api]]:
    """A job of two hanging ranks, its attempt 0 up: (the daemon, its API). Once the test's body
    is done: the ranks were never touched by its calls, SIGTERM ends the daemon, which removes
    its api.json and printed no traceback."""
    run = await serve("--nproc-per-node", "2", script_args=("--hang",))
    async with api_of(run) as api:
        await api.ready(0, 2)
        yield run, api
        # the ranks were never touched by all this
        pids = {json.loads((run.out / f"ready_a0_r{r}").read_text()) for r in (0, 1)}
        _, after, _ = await api.call("GET", "/v1/status")
        assert after["attempt"] == 0 and {r["pid"] for r in after["ranks"]} == pids
        assert await stop(run) == 128 + signal.SIGTERM
    assert not (run.run_dir / "api.json").exists()
    assert "Traceback" not in run.stderr.text


async def test_api_json_and_the_token_file(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (run, api):
        # api.json and the token file
        assert api.info["pid"] == run.proc.pid and api.info["host"] == "127.0.0.1"
        assert api.url == f"http://127.0.0.1:{api.info['port']}"
        token_file = Path(api.info["token_file"])
        assert token_file == run.run_dir / "api.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert len(api.token) >= 32


async def test_probes_and_reads_need_no_token_on_loopback(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (run, api):
        # probes and reads: no token needed on loopback
        status, body, _ = await api.call("GET", "/healthz", token=None)
        assert (status, body) == (200, {"status": "ok", "state": "running"})
        status, body, _ = await api.call("GET", "/readyz", token=None)
        assert status == 200 and body["ready"] is True and body["ranks_running"] == 2
        status, doc, _ = await api.call("GET", "/v1/status", token=None)
        assert status == 200
        assert doc["state"] == "running" and doc["node_id"] and doc["run_id"] == "test"
        assert (doc["attempt"], doc["round"], doc["restart_count"]) == (0, 0, 0)
        assert doc["policy"]["max_restarts"] == 0
        assert doc["policy"]["restart_policy"] == "any-failed"
        pids = {json.loads((run.out / f"ready_a0_r{r}").read_text()) for r in (0, 1)}
        assert {rank["pid"] for rank in doc["ranks"]} == pids
        assert [rank["state"] for rank in doc["ranks"]] == ["running", "running"]
        status, cluster, _ = await api.call("GET", "/v1/cluster", token=None)
        assert status == 200 and cluster["nodes"][0]["node_id"] == doc["node_id"]
        assert cluster["round"]["members"] == [doc["node_id"]] and cluster["excluded"] == []


async def test_event_pages_and_the_jsonl_file(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (run, api):
        status, page, _ = await api.call("GET", "/v1/events", token=None)
        kinds = [event["kind"] for event in page["events"]]
        assert kinds[:2] == ["daemon_started", "state_changed"] and "attempt_started" in kinds
        assert page["last_id"] == page["events"][-1]["id"]
        status, later, _ = await api.call("GET", f"/v1/events?since={page['last_id'] - 1}")
        assert [event["id"] for event in later["events"]] == [page["last_id"]]
        status, limited, _ = await api.call("GET", "/v1/events?limit=2")
        assert [event["id"] for event in limited["events"]] == [1, 2]
        # the JSONL file holds the same events
        lines = (run.run_dir / "events.jsonl").read_text().splitlines()
        assert [json.loads(line)["id"] for line in lines][: len(kinds)] == [
            event["id"] for event in page["events"]
        ]
        for query, field in (("since=x", "since"), ("since=-1", "since"), ("limit=0", "limit")):
            status, problem, _ = await api.call("GET", f"/v1/events?{query}", "/v1/events")
            assert status == 400 and problem["detail"].startswith(f"{field}:"), problem


async def test_metrics_need_no_token_on_loopback(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (_run, api):
        # set-up: one status read, counted below
        await api.call("GET", "/v1/status", token=None)
        status, text, response = await api.call("GET", "/metrics", token=None)
        assert status == 200 and response.content_type == "text/plain"
        for line in (
            'ftd_state{state="running"} 1.0',
            "ftd_attempt 0.0",
            'ftd_restarts_total{counted="true"} 0.0',
            'ftd_ranks{state="running"} 2.0',
            'ftd_rank_failures_total{reason="exit"} 0.0',
            "ftd_hangs_total 0.0",
            "ftd_rank_messages_lost_total 0.0",
            'ftd_budget_refusals_total{budget="section_names"} 0.0',
            'ftd_api_requests_total{code="200",method="GET",route="/v1/status"} 1.0',
        ):
            assert line in text.splitlines(), line
        assert "# TYPE ftd_store_operation_seconds histogram" in text


async def test_changes_need_the_token(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (_run, api):
        # auth: changes need the token; 401 without, 403 with a wrong one
        status, problem, response = await api.call("POST", "/v1/restart", token=None, body={})
        assert status == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in problem["detail"]
        status, problem, _ = await api.call("POST", "/v1/restart", token="wrong", body={})
        assert status == 403 and problem["title"] == "Forbidden"
        status, _, _ = await api.call(
            "PATCH", "/v1/timeouts", headers={"Authorization": "Basic Zm9vOmJhcg=="}, token=None
        )
        assert status == 401


async def test_invalid_bodies_are_400_naming_the_field(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (_run, api):
        # invalid bodies: 400 naming the field
        for body, field in (
            ({"scope": "galaxy"}, "scope"),
            ({"count": 0}, "count"),
            ({"reason": "x" * 1001}, "reason"),
            ({"scope": "node", "extra": 1}, "extra"),
            ([1, 2], "body"),
        ):
            status, problem, _ = await api.call("POST", "/v1/restart", body=body)
            assert status == 400 and problem["detail"].startswith(f"{field}:"), problem
            assert problem["type"] == "https://ftd.dev/problems/invalid-request"
        status, problem, _ = await api.call("POST", "/v1/restart", data=b"{not json")
        assert status == 400 and problem["detail"].startswith("body: not valid JSON")
        status, problem, _ = await api.call("PATCH", "/v1/timeouts", body={})
        assert status == 400 and problem["detail"].startswith("body:")


async def test_413_404_405_are_problems(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (_run, api):
        # 413, 404, 405: problem bodies too
        status, problem, _ = await api.call("POST", "/v1/restart", data=b" " * (65 * 1024))
        assert status == 413 and "65536" in problem["detail"]
        status, problem, _ = await api.call("GET", "/v2/status", None)
        assert status == 404 and problem["status"] == 404
        status, problem, response = await api.call("PUT", "/v1/status", None)
        assert status == 405 and response.headers["Allow"] == "GET"
        status, problem, _ = await api.call("DELETE", "/v1/restart", None, token=None)
        assert status == 405  # before auth: a wrong method reveals nothing


async def test_timeouts_read_and_tuned_live(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (_run, api):
        # set-up: the status and the events so far
        _, doc, _ = await api.call("GET", "/v1/status", token=None)
        _, page, _ = await api.call("GET", "/v1/events", token=None)

        # timeouts: read, tuned live (validated, announced, persisted)
        status, timeouts, _ = await api.call("GET", "/v1/timeouts", token=None)
        assert status == 200 and timeouts == doc["timeouts"]
        patch = {"rank_heartbeat_timeout": 45, "rank_section_timeouts": {"step": 120.5}}
        status, changed, _ = await api.call("PATCH", "/v1/timeouts", body=patch)
        assert status == 200 and changed == {**timeouts, **patch}
        _, doc2, _ = await api.call("GET", "/v1/status")
        assert doc2["timeouts"] == changed
        _, page, _ = await api.call("GET", f"/v1/events?since={page['last_id']}")
        [announced] = [e for e in page["events"] if e["kind"] == "timeouts_changed"]
        assert announced["data"]["timeouts"] == changed
        assert announced["data"]["by"].startswith("api ")
        for body, field in (
            ({"rank_heartbeat_timeout": -1}, "rank_heartbeat_timeout"),
            ({"rank_heartbeat_timeout": "none"}, "rank_heartbeat_timeout"),
            ({"rank_heartbeat_timeout": True}, "rank_heartbeat_timeout"),
            ({"rank_section_timeouts": {"step": 0}}, "rank_section_timeouts"),
            ({"rank_section_timeouts": {"step": "x"}}, "rank_section_timeouts.step"),
            ({"heartbeat_s": 3}, "heartbeat_s"),
        ):
            status, problem, _ = await api.call("PATCH", "/v1/timeouts", body=body)
            assert status == 400 and problem["detail"].startswith(f"{field}"), problem
        status, problem, _ = await api.call(
            "PATCH", "/v1/timeouts", data=b'{"rank_heartbeat_timeout": Infinity}'
        )
        assert status == 400 and "Infinity" in problem["detail"]
        _, still, _ = await api.call("GET", "/v1/timeouts")
        assert still == changed


async def test_a_single_node_offers_no_exclusion(serve: ServeFactory) -> None:
    async with hanging_job(serve) as (_run, api):
        # set-up: the node's id
        _, doc, _ = await api.call("GET", "/v1/status", token=None)

        # what a single node does not offer: 409 problems of their own type; unknown nodes 404
        template = "/v1/nodes/{node_id}/exclude"
        node = doc["node_id"]
        status, problem, _ = await api.call(
            "POST", f"/v1/nodes/{node}/exclude", template, body={"reason": "bad gpu"}
        )
        assert status == 409 and "rendezvous" in problem["detail"]
        assert problem["type"] == "https://ftd.dev/problems/unavailable-in-this-mode"
        status, problem, _ = await api.call("POST", "/v1/nodes/nope/exclude", template)
        assert status == 404 and "nope" in problem["detail"]
        status, problem, _ = await api.call("DELETE", f"/v1/nodes/{node}/exclude", template)
        assert status == 404


async def test_restart_through_the_api(serve: ServeFactory, tmp_path: Path) -> None:
    token_file = tmp_path / "custom.token"
    token_file.write_text("custom-token-0123456789\n")
    token_file.chmod(0o600)
    run = await serve(
        "--api-token-file",
        str(token_file),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--shutdown-timeout",
        "1",
        script_args=("--hang", "--ignore-sigterm"),
    )
    async with api_of(run) as api:
        assert api.token == "custom-token-0123456789"  # an existing token file is used as is
        await api.ready(0, 2)
        _, before, _ = await api.call("GET", "/v1/status")
        # SSE resume: a reconnecting client gets what follows its Last-Event-ID
        headers = {"Accept": "text/event-stream", "Last-Event-ID": "1"}
        async with api.session.get(f"{api.url}/v1/events?since=0", headers=headers) as response:
            second = await EventStream(response).next("state_changed")
            assert second["id"] == 2
        async with event_stream(api) as stream:
            status, accepted, _ = await api.call(
                "POST", "/v1/restart", body={"scope": "cluster", "reason": "bad shard"}
            )
            assert status == 202 and accepted["event"]["kind"] == "restart_requested"
            assert accepted["event"]["data"]["counted"] is True
            streamed = await stream.next("restart_requested")
            assert streamed == accepted["event"] and streamed["id"] == accepted["event_id"]
            # While the ranks (ignoring SIGTERM) are being stopped: 409, nothing changes.
            await stream.next("state_changed", lambda e: e["data"]["state"] == "restarting")
            status, problem, _ = await api.call("POST", "/v1/restart", body={})
            assert status == 409 and "restarting" in problem["detail"], problem
            status, ready, _ = await api.call("GET", "/readyz")
            assert status == 503 and ready["ready"] is False
            await stream.next("attempt_started", lambda e: e["data"]["attempt"] == 1)
            await api.ready(1, 2)
            _, after, _ = await api.call("GET", "/v1/status")
            assert (after["attempt"], after["restart_count"]) == (1, 1)
            assert after["policy"]["restarts_left"] == 1
            assert after["last_failure"]["kind"] == "request"
            assert "bad shard" in after["last_failure"]["reason"]
            old_pids = {rank["pid"] for rank in before["ranks"]}
            new_pids = {rank["pid"] for rank in after["ranks"]}
            assert not old_pids & new_pids and None not in new_pids

            status, accepted, _ = await api.call("POST", "/v1/restart", body={"count": False})
            assert status == 202 and accepted["event"]["data"]["counted"] is False
            await stream.next("attempt_started", lambda e: e["data"]["attempt"] == 2)
            await api.ready(2, 2)
            _, after, _ = await api.call("GET", "/v1/status")
            assert (after["attempt"], after["restart_count"]) == (2, 1)
            assert after["last_failure"]["counted"] is False
            _, text, _ = await api.call("GET", "/metrics")
            assert 'ftd_restarts_total{counted="true"} 1.0' in text
            assert 'ftd_restarts_total{counted="false"} 1.0' in text
            assert "ftd_attempt 2.0" in text
            assert 'ftd_rank_failures_total{reason="exit"} 0.0' in text  # requests are no failures

            # Stopping: a restart now is a conflict.
            run.signal(signal.SIGTERM)
            await stream.next("state_changed", lambda e: e["data"]["state"] == "stopping")
            status, problem, _ = await api.call("POST", "/v1/restart", body={})
            assert status == 409 and "stopping" in problem["detail"]
            # The stream ends when the daemon closes the API.
            with pytest.raises(AssertionError, match="stream ended"):
                await stream.next("never")
        assert await run.wait() == 128 + signal.SIGTERM
    events = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
    requested = [e["data"] for e in events if e["kind"] == "restart_requested"]
    assert [(r["reason"], r["counted"]) for r in requested] == [
        ("bad shard", True),
        ("operator request", False),
    ]
    assert all(r["by"].startswith("api ") for r in requested)


# -- the admin command line and the Python client ------------------------------------------------


@contextlib.asynccontextmanager
async def admin_job(serve: ServeFactory) -> AsyncIterator[tuple[Serve, Api, tuple[str, str]]]:
    """A job of two hanging ranks (up to 5 restarts), its attempt 0 up: (the daemon, its API,
    the CLI's `--run-dir` arguments). SIGTERM ends it once the test's body is done."""
    run = await serve("--nproc-per-node", "2", "--max-restarts", "5", script_args=("--hang",))
    async with api_of(run) as api:
        await api.ready(0, 2)
        yield run, api, ("--run-dir", str(run.run_dir))
        assert await stop(run) == 128 + signal.SIGTERM


async def test_admin_cli_status(serve: ServeFactory) -> None:
    async with admin_job(serve) as (run, api, where):
        done = cli("status", *where)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith("node ") and "state running" in lines[0]
        assert "restarts 0/5" in lines[0]
        header = next(i for i, line in enumerate(lines) if line.startswith("LOCAL"))
        assert lines[header].split() == [
            "LOCAL", "RANK", "PID", "STATE", "EXIT", "HEARTBEAT", "SECTION", "FOR", "NO",
            "PROGRESS", "STEPS", "STEP", "TIME", "STRAGGLER",
        ]  # fmt: skip
        assert [line.split()[3] for line in lines[header + 1 : header + 3]] == ["running"] * 2
        assert any(line.startswith("cluster: round 0") for line in lines)
        done = cli("status", "--json", "--url", api.url)
        assert done.returncode == 0
        both = json.loads(done.stdout)
        CONTRACT._validate("/components/schemas/Status", both["status"])
        CONTRACT._validate("/components/schemas/Cluster", both["cluster"])

        # `ftd status` needs neither torch nor pydantic nor aiohttp
        probe = (
            "import sys; from ftd.cli.main import main; "
            "code = main(['status', '--run-dir', sys.argv[1]]); "
            "heavy = {'torch', 'pydantic', 'aiohttp'} & set(sys.modules); "
            "assert not heavy, heavy; sys.exit(code)"
        )
        done = python("-c", probe, str(run.run_dir))
        assert done.returncode == 0, done.stderr


async def test_admin_cli_restart_and_events(serve: ServeFactory) -> None:
    async with admin_job(serve) as (_run, api, where):
        async with event_stream(api) as stream:
            follow = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ftd", "events", "--follow", *where,
                stdout=asyncio.subprocess.PIPE, cwd=ROOT,
            )  # fmt: skip
            try:
                assert follow.stdout is not None
                # the backlog (the last events) comes first
                first = await asyncio.wait_for(follow.stdout.readline(), 30)
                assert first.split()[0].isdigit()
                done = cli("restart", "--no-count", "--reason", "from the cli", *where)
                assert done.returncode == 0, done.stderr
                assert done.stdout.startswith("restart requested (cluster, not counted): event ")
                event_id = int(done.stdout.split()[-1])
                await stream.next("restart_requested", lambda e: e["id"] == event_id)
                while True:
                    line = (await asyncio.wait_for(follow.stdout.readline(), 30)).decode()
                    if line.split()[:1] == [str(event_id)]:
                        assert "restart_requested" in line and "reason=from the cli" in line
                        break
            finally:
                follow.kill()
                await follow.wait()
            await stream.next("attempt_started", lambda e: e["data"]["attempt"] == 1)
        await api.ready(1, 2)

        done = cli("events", *where)
        assert done.returncode == 0 and "restart_requested" in done.stdout
        done = cli("events", "--json", "--since", str(event_id - 1), *where)
        assert json.loads(done.stdout.splitlines()[0])["id"] == event_id


async def test_admin_cli_timeouts(serve: ServeFactory) -> None:
    async with admin_job(serve) as (_run, _api, where):
        done = cli(
            "timeouts", "set", "rank_heartbeat_timeout=30", "rank_out_of_section_timeout=none",
            "rank_section_timeouts=setup:600,step:none", *where,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        shown = dict(line.split(" = ") for line in done.stdout.splitlines())
        assert shown["rank_heartbeat_timeout"] == "30"
        assert shown["rank_out_of_section_timeout"] == "off"  # `none` in, `off` out as everywhere
        assert shown["rank_section_timeouts"] == "setup:600,step:off"
        done = cli("timeouts", "--json", *where)
        assert json.loads(done.stdout)["rank_section_timeouts"] == {"setup": 600, "step": None}
        done = cli("status", *where)
        assert "timeouts: " in done.stdout and "rank_heartbeat_timeout=30" in done.stdout


async def test_admin_cli_errors_are_one_line(serve: ServeFactory) -> None:
    async with admin_job(serve) as (run, api, where):
        # errors: one line on stderr, non-zero exit
        node = api.info["node_id"]
        for args, code, message in (
            (("exclude", node), 1, "409 Not available in this mode: node exclusion"),
            (("exclude", "ghost"), 1, "404 Not found: no node 'ghost'"),
            (("readmit", node), 1, f"404 Not found: node '{node}' is not excluded"),
            (("timeouts", "set", "heartbeat_s=5"), 1, "400 Invalid request: heartbeat_s"),
            (("timeouts", "set", "rank_heartbeat_timeout=-2"), 1, "rank_heartbeat_timeout"),
            (("timeouts", "set", "heartbeat_s"), 2, "expected NAME=VALUE"),
            (("timeouts", "get", "a=1"), 2, "timeouts set"),
        ):
            done = cli(*args, *where)
            assert done.returncode == code, (args, done)
            assert len(done.stderr.splitlines()) == 1, done.stderr
            assert done.stderr.startswith(f"ftd {args[0]}: error: "), done.stderr
            assert message in done.stderr, done.stderr
        bad_token = run.run_dir / "bad.token"
        bad_token.write_text("nope\n")
        done = cli("restart", "--url", api.url, "--token-file", str(bad_token))
        assert done.returncode == 1 and "403 Forbidden" in done.stderr
        done = cli("restart", "--url", api.url, env={"FTD_API_TOKEN": ""})
        assert done.returncode == 1 and "401 Unauthorized" in done.stderr
        done = cli("status", "--url", "http://127.0.0.1:1")
        assert done.returncode == 1
        assert done.stderr.startswith("ftd status: error: no ftd daemon answers at")
        done = cli("status", "--run-dir", str(run.run_dir / "missing"))
        # no daemon and no run's record there: a bad --run-dir, exit 2 (tests/test_cli_truth.py)
        assert done.returncode == 2 and "no ftd daemon, and no run's record" in done.stderr


async def test_admin_python_client(serve: ServeFactory) -> None:
    from ftd_client import AdminClient, ApiError, ApiUnreachable

    async with admin_job(serve) as (run, api, where):
        # set-up: one restart through the CLI first (the client then finds attempt 1)
        done = cli("restart", "--no-count", "--reason", "from the cli", *where)
        assert done.returncode == 0, done.stderr
        await api.ready(1, 2)
        node = api.info["node_id"]

        # the Python client: the same operations
        def client_flow() -> None:
            client = AdminClient.from_run_dir(run.run_dir)
            assert client.health()["status"] == "ok"
            assert client.ready() is True
            assert client.status()["attempt"] == 1
            assert client.cluster()["round"]["members"] == [node]
            page = client.events(since=0, limit=3)
            assert [e["id"] for e in page["events"]] == [1, 2, 3]
            assert "ftd_state" in client.metrics()
            assert client.set_timeouts(rank_heartbeat_timeout=50)["rank_heartbeat_timeout"] == 50
            assert client.timeouts()["rank_heartbeat_timeout"] == 50
            with pytest.raises(ApiError) as info:
                client.set_timeouts(heartbeat_s=1)
            assert info.value.status == 400 and info.value.detail.startswith("heartbeat_s")
            with pytest.raises(ApiError) as info:
                client.exclude("ghost")
            assert info.value.status == 404
            with pytest.raises(ApiError) as info:
                client.readmit(node)
            assert info.value.status == 404
            with pytest.raises(ApiError) as info:
                client.restart(scope="everything")
            assert info.value.status == 400 and info.value.detail.startswith("scope:")
            with pytest.raises(ApiError) as info:
                AdminClient(api.url, token="wrong").restart()
            assert info.value.status == 403
            with pytest.raises(ApiUnreachable):
                AdminClient("http://127.0.0.1:1").status()
            stream = client.follow_events(since=client.events(limit=1)["last_id"])
            accepted = client.restart(reason="from python", count=False)
            for event in stream:
                if event["id"] == accepted["event_id"]:
                    assert event["data"]["reason"] == "from python"
                    break
            stream.close()

        await asyncio.to_thread(client_flow)
        await api.ready(2, 2)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the curl binary is not installed")
async def test_curl_flow_of_the_readme(serve: ServeFactory) -> None:
    run = await serve("--nproc-per-node", "2", "--max-restarts", "1", script_args=("--hang",))
    async with api_of(run) as api:
        await api.ready(0, 2)
        env = {**os.environ, "RUN_DIR": str(run.run_dir)}

        def curl(command: str) -> tuple[int, Any]:
            # The README's lines, verbatim but for -w, which prints the status after the body.
            script = (
                "URL=$(python3 -c \"import json,sys; print(json.load(open(sys.argv[1]))['url'])\""
                ' "$RUN_DIR/api.json")\nTOKEN=$(cat "$RUN_DIR/api.token")\n'
                f"{command} -w '\\n%{{http_code}}'"
            )
            done = subprocess.run(
                ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30
            )
            assert done.returncode == 0, done.stderr
            body, _, code = done.stdout.rpartition("\n")
            return int(code), json.loads(body) if body.startswith("{") else body

        code, status = await asyncio.to_thread(curl, 'curl -s "$URL/v1/status"')
        assert code == 200 and status["state"] == "running"
        code, _ = await asyncio.to_thread(curl, 'curl -s "$URL/v1/cluster"')
        assert code == 200
        code, status = await asyncio.to_thread(
            curl, 'curl -s --unix-socket "$RUN_DIR/api.sock" http://localhost/v1/status'
        )
        assert code == 200 and status["state"] == "running"
        code, timeouts = await asyncio.to_thread(
            curl,
            'curl -s --unix-socket "$RUN_DIR/api.sock" -X PATCH http://localhost/v1/timeouts '
            "-d '{\"rank_heartbeat_timeout\": 31}'",
        )
        assert code == 200 and timeouts["rank_heartbeat_timeout"] == 31  # no token needed
        code, accepted = await asyncio.to_thread(
            curl,
            'curl -s -X POST "$URL/v1/restart" -H "Authorization: Bearer $TOKEN" '
            '-H "Content-Type: application/json" -d \'{"reason": "curl", "count": false}\'',
        )
        assert code == 202 and accepted["event"]["kind"] == "restart_requested"
        code, page = await asyncio.to_thread(
            curl, f'curl -s "$URL/v1/events?since={accepted["event_id"] - 1}"'
        )
        assert code == 200 and page["events"][0]["data"]["reason"] == "curl"
        code, timeouts = await asyncio.to_thread(
            curl, 'curl -s "$URL/v1/timeouts" -H "Authorization: Bearer $TOKEN"'
        )
        assert code == 200 and "rank_heartbeat_timeout" in timeouts
        code, timeouts = await asyncio.to_thread(
            curl,
            'curl -s -X PATCH "$URL/v1/timeouts" -H "Authorization: Bearer $TOKEN" '
            "-d '{\"rank_heartbeat_timeout\": 30}'",
        )
        assert code == 200 and timeouts["rank_heartbeat_timeout"] == 30
        code, _problem = await asyncio.to_thread(
            curl,
            'curl -s -X POST "$URL/v1/nodes/$(hostname)/exclude" '
            '-H "Authorization: Bearer $TOKEN" -d \'{"reason": "flaky NIC"}\'',
        )
        assert code in (404, 409)
        code, text = await asyncio.to_thread(curl, 'curl -s "$URL/metrics"')
        assert code == 200 and "ftd_restarts_total" in text
        code, _ = await asyncio.to_thread(curl, 'curl -s -X POST "$URL/v1/restart"')
        assert code == 401
        await api.ready(1, 2)
        assert await stop(run) == 128 + signal.SIGTERM


SCHEMATHESIS_EXAMPLES = int(os.environ.get("FTD_SCHEMATHESIS_EXAMPLES", "15"))
"""Examples per operation; docs/api.md gives the command for the 100-example run."""


async def test_schemathesis_finds_nothing(serve: ServeFactory, tmp_path: Path) -> None:
    """`--checks all`: no 5xx, no status, header, content type or body the spec does not
    declare, invalid input refused, valid input accepted."""
    pytest.importorskip("schemathesis")
    schemathesis = Path(sys.executable).parent / "schemathesis"
    if not schemathesis.exists():
        pytest.skip("the schemathesis command is not installed")
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1000", script_args=("--hang",)
    )  # fmt: skip
    async with api_of(run) as api:
        await api.ready(0, 2)
        done = await asyncio.create_subprocess_exec(
            str(schemathesis),
            "--config-file", str(ROOT / "tests" / "schemathesis.toml"),
            "run", str(SPEC_PATH),
            "--url", api.url,
            "-H", f"Authorization: Bearer {api.token}",
            "--max-examples", str(SCHEMATHESIS_EXAMPLES),
            "--checks", "all",
            "--generation-deterministic",
            "--workers", "1",
            "--report-dir", str(tmp_path / "st"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
            env={**os.environ, "FTD_SCHEMATHESIS_NODE_ID": api.info["node_id"]},
        )  # fmt: skip
        out, _ = await asyncio.wait_for(done.communicate(), 110 * SCHEMATHESIS_EXAMPLES / 15)
        assert done.returncode == 0, out.decode()[-6000:]
        _, doc, _ = await api.call("GET", "/v1/status")
        assert doc["state"] in ("running", "restarting", "rendezvous")
        assert await stop(run) == 128 + signal.SIGTERM
    assert "Traceback" not in run.stderr.text


async def test_ports_tokens_and_remote_reads(serve: ServeFactory) -> None:
    # An explicitly requested port that is taken: one line, exit 2, no rank started.
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        run = await serve("--api-port", str(port), script_args=("--hang",))
        assert await run.wait() == 2
    assert f"ftd serve: error: --api-port {port} is already in use" in run.stderr.text
    assert "Traceback" not in run.stderr.text
    assert not run.out.exists()
    assert not (run.run_dir / "api.token").exists()  # this start made it: it is taken back

    # The default port, taken: a free one instead, with a warning. A non-loopback bind:
    # reads need the token too (not the probes). FTD_API_TOKEN: no token file.
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            blocker.bind(("0.0.0.0", 29610))
            blocker.listen()
        except OSError as error:  # someone else holds it: just as good
            assert error.errno == errno.EADDRINUSE
        run = await serve(
            "--api-host", "0.0.0.0", script_args=("--hang",), api_port=None,
            run_id="remote", env={"FTD_API_TOKEN": "s3cret-token-0123456789"},
        )  # fmt: skip
        await run.stderr.expect("API port 29610 is in use on 0.0.0.0: using a free port")
        async with api_of(run, token="s3cret-token-0123456789") as api:
            assert api.info["port"] != 29610 and api.info["token_file"] is None
            assert api.url.startswith("http://127.0.0.1:")
            assert not (run.run_dir / "api.token").exists()
            await api.ready(0, 1)
            status, _, _ = await api.call("GET", "/healthz", token=None)
            assert status == 200
            status, _, _ = await api.call("GET", "/readyz", token=None)
            assert status == 200
            for path in ("/v1/status", "/v1/cluster", "/v1/events", "/metrics"):
                status, _, _ = await api.call("GET", path, token=None)
                assert status == 401, path
                status, _, _ = await api.call("GET", path, token="wrong")
                assert status == 403, path
                status, _, _ = await api.call("GET", path)
                assert status == 200, path
            # The dashboard's own files carry no data: they load without a token anywhere,
            # and the page asks for the token for its reads.
            for path in ("/", "/dashboard/app.js"):
                async with api.session.get(api.url + path) as response:
                    assert response.status == 200, path
            assert await stop(run) == 128 + signal.SIGTERM


async def test_unexpected_errors_are_500_problems_without_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The one path a healthy daemon never takes, so it runs in process: a control surface
    that raises something unexpected."""
    from aiohttp.test_utils import TestServer

    from ftd.api.app import build_app
    from ftd.api.security import HostPolicy
    from ftd.config.serve import ServeConfig
    from ftd.status.events import EventLog
    from ftd.status.model import NodeStatus

    class Broken:
        config = ServeConfig(entrypoint=__file__)
        status = NodeStatus(node_id="n", run_id="r")
        events = EventLog(None)

        def cluster(self, offset: int, limit: int) -> dict[str, Any]:
            raise RuntimeError("secret internals")

    app = build_app(Broken(), "t" * 16, HostPolicy(frozenset({"localhost"})))  # type: ignore[arg-type]
    server = TestServer(app)
    async with server, aiohttp.ClientSession() as session:
        async with session.get(server.make_url("/v1/cluster")) as response:
            raw = await response.read()
            assert response.status == 500 and response.content_type == PROBLEM
        CONTRACT.check("GET", None, 500, response.content_type, raw)
        assert b"secret" not in raw and b"Traceback" not in raw
    assert "secret internals" in caplog.text  # the traceback went to the daemon's log


async def test_hang_shows_in_status_and_metrics(serve: ServeFactory) -> None:
    from tests.conftest import BIN

    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-rank_heartbeat_timeout=0.5",
        script=BIN / "health_worker.py",
        script_args=("--mode", "stop-heartbeats", "--beats", "100000", "--interval", "0.05"),
    )  # fmt: skip
    async with api_of(run) as api, event_stream(api, since=0) as stream:
        hung = await stream.next("rank_hung")
        assert hung["data"]["local_rank"] == 1
        failed = await stream.next("attempt_failed")
        assert failed["data"]["failure"]["kind"] == "hang"
        await stream.next("attempt_started", lambda e: e["data"]["attempt"] == 1)
        for rank in (0, 1):
            await run.stdout.expect(rf"rank {rank} attempt 1 up pid")
        # Heartbeats are datagrams with no event of their own: ask until both ranks' arrived.
        for _ in range(100):
            _, doc, _ = await api.call("GET", "/v1/status")
            if all(rank["last_heartbeat_age_s"] is not None for rank in doc["ranks"]):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no heartbeats in /v1/status: {doc['ranks']}")
        assert doc["last_failure"]["kind"] == "hang" and doc["restart_count"] == 1
        assert all(0 <= rank["last_heartbeat_age_s"] < 30 for rank in doc["ranks"])
        recovery = await stream.next("recovery")
        stages = recovery["data"]["stages"]
        assert list(stages) == list(STAGES)
        measured = [stage for stage in stages if stage not in ("restore", "redo")]
        assert all(stages[stage] is not None and stages[stage] >= 0 for stage in measured), stages
        assert stages["restore"] is None and stages["redo"] is None  # no snapshot restored
        _, text, _ = await api.call("GET", "/metrics")
        lines = text.splitlines()
        for stage in measured:
            assert f'ftd_recovery_stage_seconds_count{{stage="{stage}"}} 1.0' in lines
        assert "ftd_hangs_total 1.0" in lines
        assert 'ftd_rank_failures_total{reason="hang"} 1.0' in lines
        assert 'ftd_restarts_total{counted="true"} 1.0' in lines
        stamps = [line for line in lines if line.startswith("ftd_rank_last_heartbeat_timestamp")]
        assert [line.split("{")[1].split("}")[0] for line in stamps] == [
            'local_rank="0"',
            'local_rank="1"',
        ]
        done = cli("status", "--run-dir", str(run.run_dir))
        assert "last failure: rank 1" in done.stdout or "last failure:" in done.stdout
        rows = done.stdout.split("HEARTBEAT")[1].splitlines()[1:3]
        assert all(row.split()[6] in ("ms", "s") for row in rows), done.stdout  # `21 ms`
        assert await stop(run) == 128 + signal.SIGTERM


async def test_fault_injection_through_the_api(serve: ServeFactory) -> None:
    """Off unless enabled (403); enabled, a hang goes into the rank and is caught and replaced."""
    plain = await serve("--nproc-per-node", "1", script_args=("--hang",))
    async with api_of(plain) as api:
        status, body, _ = await api.call("POST", "/v1/faults", body={"kind": "hang"})
        assert status == 403 and "--enable-fault-injection" in body["detail"]
    await stop(plain)

    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1", "--enable-fault-injection",
        "--ft-param-rank_heartbeat_timeout=1",
        script=BIN / "health_worker.py", script_args=("--mode", "relay", "--bad-rank", "-1"),
    )  # fmt: skip
    async with api_of(run) as api:
        await run.stdout.expect("relay ready")
        await await_api_event(api.url, "attempt_started", token=api.token, attempt=0)
        status, body, _ = await api.call("POST", "/v1/faults", body={"kind": "nope"})
        assert status == 400 and "kind" in body["detail"]
        status, body, _ = await api.call("POST", "/v1/faults", body={"kind": "kill", "rank": 9})
        assert status == 404
        status, body, _ = await api.call(
            "POST", "/v1/faults", body={"kind": "hang", "rank": 1, "delay_s": 0.1}
        )
        assert status == 202 and body["event"]["kind"] == "fault_requested"
        await run.stderr.expect(r"rank 1 \(local 1, pid \d+\) hung: sent no heartbeat")
        await run.stderr.expect(r"attempt 1: started")
        lines = (run.run_dir / "events.jsonl").read_text().splitlines()
        kinds = [json.loads(line)["kind"] for line in lines]
        assert (
            kinds.index("fault_requested")
            < kinds.index("fault_injected")
            < kinds.index("rank_hung")
        )
    await stop(run)
