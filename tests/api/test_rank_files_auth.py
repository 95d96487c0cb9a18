"""A rank's output and stacks are privileged reads (issue row 2, HIGH on shared hosts): another
local user got a secret a rank printed (`HF_TOKEN=...`, HTTP 200 on loopback) though the 0700 run
directory keeps the file itself from them. Now `GET /v1/ranks/{global_rank}/stderr` and `/stacks`
need the bearer token on loopback too (401 saying how to get access), or the admin socket; the
daemon's own account of the job (status, events) stays public on loopback. The rule is one list
(`LOOPBACK_READS`), held here to the routes the app serves and to openapi.yaml."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import signal
import subprocess
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ftd_client.admin import AdminClient, ApiError

from ftd.api.app import build_app
from ftd.api.middlewares import LOOPBACK_READS, OPEN_ROUTES, token_required
from ftd.api.security import HostPolicy
from ftd.config.serve import ServeConfig
from ftd.status.events import EventLog
from ftd.status.model import NodeStatus
from tests.conftest import BIN, Serve, ServeFactory
from tests.support.api import CONTRACT, PROBLEM, stop
from tests.support.api_local import private_registry  # noqa: F401 (an autouse fixture)

RANK = BIN / "secret_rank.py"
SECRET = "hf_rankSecretThatOthersMustNotRead0123"
STDERR = "/v1/ranks/{global_rank}/stderr"
STACKS = "/v1/ranks/{global_rank}/stacks"
pytestmark = [pytest.mark.timeout(240)]


def _nobody() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


NOBODY = _nobody()
SYSTEM_PYTHON = "/usr/bin/python3"
"""An interpreter whose standard library another user may read (this test's own lives under
root's directories, where `nobody` cannot import the modules urllib loads as it goes)."""


# -- the rule: one list, the routes, the spec ---------------------------------------------------


class _Control:
    """Just enough of a NodeControl to build the app and list its routes."""

    config = ServeConfig(entrypoint=__file__)
    status = NodeStatus(node_id="n", run_id="r")
    events = EventLog(None)


def _spec_requires_token(method: str, template: str) -> bool:
    operation = CONTRACT.spec["paths"][template][method.lower()]
    security = operation.get("security", CONTRACT.spec.get("security", []))
    return bool(security) and {} not in security


def test_every_route_needs_the_token_on_loopback_as_the_spec_says() -> None:
    """Every route the app serves: the middleware's rule on a loopback-only API is the
    security openapi.yaml declares; the rank files are privileged; the lists name only routes
    that exist; a route nobody declared public needs the token."""
    app = build_app(_Control(), "t" * 16, HostPolicy(frozenset({"localhost"})))  # type: ignore[arg-type]
    routed: set[str] = set()
    for route in app.router.routes():
        assert route.resource is not None
        template = route.resource.canonical
        routed.add(template)
        assert token_required(route.method, template, loopback_only=True) == (
            _spec_requires_token(route.method, template)
        ), (route.method, template)
    for template in (STDERR, STACKS):
        assert token_required("GET", template, loopback_only=True)
        assert _spec_requires_token("GET", template)
    assert routed >= LOOPBACK_READS | OPEN_ROUTES
    assert token_required("GET", "/v1/ranks/{global_rank}/stdout", loopback_only=True)
    assert not token_required("GET", "/v1/status", loopback_only=True)
    assert token_required("GET", "/v1/status", loopback_only=False)
    assert not token_required("GET", "/healthz", loopback_only=False)


# -- a live daemon whose rank printed a secret ------------------------------------------------


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


async def _until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Await a file's content (written by the daemon's drain or the rank's signal handler)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def secret_job(serve: ServeFactory) -> AsyncIterator[tuple[Serve, str, str]]:
    """(run, API URL, token) of a loopback daemon whose rank 0 printed `HF_TOKEN=<SECRET>`
    into its stderr.log (-r 2)."""
    flags = ("--preload", "none", "--standalone", "--nproc-per-node", "1", "--redirects", "2")
    run = await serve(*flags, script=RANK, script_args=("--secret", SECRET))
    await run.stderr.expect(r"API listening on ")
    info = json.loads((run.run_dir / "api.json").read_text())
    assert info["host"] == "127.0.0.1", info
    token = Path(info["token_file"]).read_text().strip()
    await run.stdout.expect("secret rank 0 up")
    stderr_log = run.attempt_dir(0) / "0" / "stderr.log"
    await _until(lambda: SECRET in _text(stderr_log), "secret in stderr.log")
    yield run, info["url"], token
    assert await stop(run) == 128 + signal.SIGTERM


async def test_rank_output_and_stacks_need_the_token_on_loopback(serve: ServeFactory) -> None:
    async with secret_job(serve) as (run, url, token), aiohttp.ClientSession() as session:

        async def get(
            path: str, template: str, headers: dict[str, str] | None = None
        ) -> tuple[int, str, Any, str]:
            async with session.get(url + path, headers=headers) as r:
                raw = await r.read()
            CONTRACT.check("GET", template, r.status, r.content_type, raw)
            return r.status, r.content_type, r.headers, raw.decode()

        auth = {"Authorization": f"Bearer {token}"}
        status, _, _, body = await get("/v1/status", "/v1/status")
        assert status == 200 and json.loads(body)["state"] == "running"  # still public
        for path, template in (("/v1/ranks/0/stderr", STDERR), ("/v1/ranks/0/stacks", STACKS)):
            status, kind, headers, body = await get(path, template)
            assert (status, kind) == (401, PROBLEM), body
            assert headers["WWW-Authenticate"].startswith("Bearer")
            detail = json.loads(body)["detail"]
            for how in ("Authorization: Bearer", "api.token", "api.sock", "--run-dir"):
                assert how in detail, detail
            assert SECRET not in body
            status, _, _, body = await get(path, template, {"Authorization": "Basic eDp5"})
            assert status == 401 and SECRET not in body
            status, _, _, body = await get(path, template, {"Authorization": "Bearer wrong"})
            assert status == 403 and SECRET not in body

        status, kind, headers, body = await get("/v1/ranks/0/stderr?attempt=0", STDERR, auth)
        assert (status, kind) == (200, "text/plain") and f"HF_TOKEN={SECRET}" in body
        assert headers["Cache-Control"] == "no-store"
        os.kill((await run.rank_pids(0))[0], signal.SIGUSR2)  # ftd_client dumps its stacks
        stacks = run.attempt_dir(0) / "0" / "stacks.txt"
        await _until(lambda: "secret_rank.py" in _text(stacks), "stacks in stacks.txt")
        status, _, _, body = await get("/v1/ranks/0/stacks", STACKS, auth)
        assert status == 200 and "secret_rank.py" in body

        # The admin socket (the daemon's own user, SO_PEERCRED) needs no token.
        admin = AdminClient(socket_path=run.run_dir / "api.sock")
        assert f"HF_TOKEN={SECRET}" in await asyncio.to_thread(admin.rank_stderr, 0, 0)
        assert "secret_rank.py" in await asyncio.to_thread(admin.rank_stacks, 0)
        found = AdminClient.from_run_dir(run.run_dir)
        assert found.socket_path is not None
        assert SECRET in await asyncio.to_thread(found.rank_stderr, 0, None, 4096)
        # Over TCP the client sends its token; without one the daemon says how to get access.
        tcp = AdminClient(url, token)
        assert SECRET in await asyncio.to_thread(tcp.rank_stderr, 0)
        with pytest.raises(ApiError) as refused:
            await asyncio.to_thread(AdminClient(url).rank_stacks, 0)
        assert refused.value.status == 401 and "api.sock" in refused.value.detail


PROBE = """
import json, os, sys, urllib.error, urllib.request
url, log, uid, gid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
seen = {"uid": os.getuid()}
try:
    with open(log) as file:
        seen["file"] = file.read()
except PermissionError:
    seen["file"] = "denied"
for name in ("status", "ranks/0/stderr", "ranks/0/stderr?attempt=0", "ranks/0/stacks"):
    try:
        with opener.open(f"{url}/v1/{name}", timeout=30) as response:
            seen[name] = [response.status, response.read().decode()]
    except urllib.error.HTTPError as error:
        seen[name] = [error.code, error.read().decode()]
print(json.dumps(seen))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a request as another user")
@pytest.mark.skipif(NOBODY is None, reason="no user `nobody` on this machine")
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON}")
async def test_another_local_user_cannot_read_a_ranks_output(serve: ServeFactory) -> None:
    """The audit's attack: another local user (`nobody`, dropped to with setgid/setuid in a
    child) cannot open the rank's stderr.log (the 0700 run directory), and through the API on
    loopback gets a 401 without the secret; the daemon's status stays readable to them."""
    assert NOBODY is not None
    async with secret_job(serve) as (run, url, _token):
        stderr_log = run.attempt_dir(0) / "0" / "stderr.log"
        probe = [SYSTEM_PYTHON, "-c", textwrap.dedent(PROBE), url, str(stderr_log)]
        probe += [str(NOBODY.pw_uid), str(NOBODY.pw_gid)]
        done = await asyncio.to_thread(
            subprocess.run, probe, capture_output=True, text=True, timeout=60, cwd="/"
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["uid"] == NOBODY.pw_uid
        assert seen["file"] == "denied", "the run directory let another user read the file"
        assert seen["status"][0] == 200
        for name in ("ranks/0/stderr", "ranks/0/stderr?attempt=0", "ranks/0/stacks"):
            code, body = seen[name]
            assert SECRET not in body, f"{name}: another local user read the rank's secret"
            assert code == 401, (name, code, body)
