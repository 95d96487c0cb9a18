"""A daemon's REST API as the tests see it: openapi.yaml as a response validator (CONTRACT),
`api_of` (a session on a running daemon's API, every answer held to the contract), and the
`ftd` command line run as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.conftest import ROOT, Serve, await_api_event

SPEC_PATH = ROOT / "openapi.yaml"
SPEC_URI = "urn:ftd:openapi"
PROBLEM = "application/problem+json"


# -- the contract -----------------------------------------------------------------------------


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


class Contract:
    """openapi.yaml as a response validator: status, content type and body schema."""

    def __init__(self, path: Path) -> None:
        self.spec: dict[str, Any] = yaml.safe_load(path.read_text())
        resource = Resource.from_contents(self.spec, default_specification=DRAFT202012)
        self.registry: Registry[Any] = Registry().with_resource(SPEC_URI, resource)
        self.seen: set[tuple[str, str, int]] = set()

    def _validate(self, pointer: str, instance: object) -> None:
        validator = Draft202012Validator({"$ref": f"{SPEC_URI}#{pointer}"}, registry=self.registry)
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
        assert not errors, f"{pointer}: {errors[0].message} at {list(errors[0].path)}"

    def conforms(self, schema: str, instance: object) -> None:
        """`instance` is a `schema` of openapi.yaml's components."""
        self._validate(f"/components/schemas/{schema}", instance)

    def check(
        self, method: str, template: str | None, status: int, content_type: str, body: bytes
    ) -> None:
        if template is None:  # no such route or method: still a problem body
            assert content_type == PROBLEM, content_type
            self._validate("/components/schemas/Problem", json.loads(body))
            return
        operation = self.spec["paths"][template].get(method.lower())
        assert operation is not None, f"{method} {template} is not in openapi.yaml"
        response = operation["responses"].get(str(status))
        assert response is not None, f"{method} {template}: {status} is not in openapi.yaml"
        base = f"/paths/{_escape(template)}/{method.lower()}/responses/{status}"
        if "$ref" in response:
            base = response["$ref"].removeprefix("#")
            response = self.spec["components"]["responses"][base.rsplit("/", 1)[1]]
        assert content_type in response["content"], (
            f"{method} {template} {status}: {content_type} not in {list(response['content'])}"
        )
        self.seen.add((method, template, status))
        if "json" in content_type:
            self._validate(f"{base}/content/{_escape(content_type)}/schema", json.loads(body))


CONTRACT = Contract(SPEC_PATH)


# -- a daemon with its API --------------------------------------------------------------------


@dataclass
class Api:
    run: Serve
    session: aiohttp.ClientSession
    url: str
    token: str
    info: dict[str, Any]

    async def call(
        self,
        method: str,
        path: str,
        template: str | None = "",
        *,
        token: str | None = "",
        body: object = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, aiohttp.ClientResponse]:
        """One request, its answer validated against openapi.yaml; (status, JSON or text,
        response). `template` defaults to the path; None for routes the spec does not have."""
        sent = dict(headers or {})
        token = self.token if token == "" else token
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        async with self.session.request(method, self.url + path, data=data, headers=sent) as r:
            raw = await r.read()
        template = path.partition("?")[0] if template == "" else template
        CONTRACT.check(method, template, r.status, r.content_type, raw)
        parsed = json.loads(raw) if "json" in r.content_type else raw.decode()
        return r.status, parsed, r

    async def ready(self, attempt: int, nproc: int) -> None:
        """The attempt's ranks are up and the daemon runs it (a forked rank can print first)."""
        for rank in range(nproc):
            await self.run.stdout.expect(rf"ready a{attempt} r{rank} pid", timeout=60)
        await await_api_event(self.url, "attempt_started", token=self.token, attempt=attempt)


@contextlib.asynccontextmanager
async def api_of(run: Serve, token: str | None = None) -> AsyncIterator[Api]:
    await run.stderr.expect(r"API listening on (\S+)", timeout=60)
    info = json.loads((run.run_dir / "api.json").read_text())
    if token is None:
        token = Path(info["token_file"]).read_text().strip()
    async with aiohttp.ClientSession() as session:
        yield Api(run, session, info["url"], token, info)


async def stop(run: Serve) -> int:
    run.signal(signal.SIGTERM)
    return await run.wait()


# -- the command line -------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return python("-m", "ftd", *args, env=env)


def python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


async def until(
    api: Api, what: str, ready: Callable[[dict[str, Any]], bool], timeout: float = 120
) -> dict[str, Any]:
    """GET /v1/status until `ready` holds: for what grows with no event to wait on (steps,
    ages), polled."""
    deadline = time.monotonic() + timeout
    while True:
        _, status, _ = await api.call("GET", "/v1/status")
        if ready(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s: {status}")
        await asyncio.sleep(0.2)
