"""NVIDIA's node health check service (nvhcd) as one of the node's checks before a rendezvous.

NVRx's ft_launcher asks it with `--ft-node-health-check-endpoint PATH` (ftd also reads the
YAML's `node_health_check_endpoint`): gRPC over a unix socket, `RunHealthCheck(args)` with NVRx's
default arguments. The node is healthy when the answer says success and its `output` is JSON
with `fail_count` 0; a failure, or an output without `fail_count` or not JSON, is a reason.
As with NVRx, a call that gets no answer skips the check (a service that is down must not take
the node out of the job): a socket that is not there (the service is not deployed), an
endpoint that is no unix socket, a refused connection, an error status, a reset, an answer
ftd's decoder refuses (counted), no answer within `node_health_check_timeout`. ftd says so in
one warning line per new reason, and `skipped` holds the last one.

The wire (h2c, gRPC framing, protobuf) and its bounded decoder are nvhcd_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from ftd import containment
from ftd.ranks.error_file import MAX_DEPTH, nesting_within
from ftd.refusals import Refusals
from ftd.supervision.nvhcd_wire import (
    MAX_FRAME,
    AnswerReader,
    HealthCheckResponse,
    Unhealthy,
    request,
)
from ftd.tasks import within
from ftd.text import escape

log = logging.getLogger("ftd.supervision")

DEFAULT_ARGS = ("--no-slurm", "--group", "prolog", "epilog", "logs", "gpu")
"""NVRx's arguments for the service's script (`_DEFAULT_NODE_HEALTH_CHECK_ARGS`)."""
MAX_REASON = 300
MAX_NAMED = 10
"""Failed checks named in a reason; the count says how many there were."""


def socket_path(endpoint: str) -> str | None:
    """The unix socket an endpoint names (`/path`, `./path`, `unix:///path`), as NVRx reads
    it; None for anything else (NVRx skips it)."""
    if endpoint.startswith("unix://"):
        return endpoint.removeprefix("unix://") or None
    if endpoint.startswith(("/", "./")):
        return endpoint
    return None


class Nvhcd:
    """The service at one endpoint, asked once per `check()`."""

    def __init__(
        self, endpoint: str, timeout_s: float, args: tuple[str, ...] = DEFAULT_ARGS
    ) -> None:
        self.path = socket_path(endpoint)
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._args = args
        self.skipped: str | None = None
        """Why the last check was skipped (the service gave no answer), or None."""
        self.refused = Refusals("nvhcd")

    async def check(self) -> str | None:
        """Why the service finds this node unhealthy, or None: healthy, or no answer (the
        check skipped, as NVRx skips it)."""
        answer = None if self.path is None else await self._contained_ask(self.path)
        if isinstance(answer, HealthCheckResponse):
            self.skipped = None
            unhealthy = verdict(answer)
            if unhealthy is None:
                return None
            if unhealthy.cause:
                self.refused[unhealthy.cause] += 1
            return f"nvhcd at {self.path}: {unhealthy.reason}"
        if answer is None:
            why = "is no unix socket" if self.path is None else "does not exist"
        else:
            why = f"gave no answer ({answer.reason})"
            if answer.cause:
                self.refused[answer.cause] += 1
        if why != self.skipped:
            log.warning(
                "the node health check endpoint %s %s: its check is skipped, as NVRx does",
                escape(self._endpoint, limit=200),
                why,
            )
        self.skipped = why
        return None

    async def _contained_ask(self, path: str) -> HealthCheckResponse | Unhealthy | None:
        try:
            return await self.ask(path)
        except Exception as error:  # whatever the service did, the daemon goes on
            return Unhealthy(containment.record("node_health", error))

    async def ask(self, path: str) -> HealthCheckResponse | Unhealthy | None:
        """One call of RunHealthCheck, all of it within the timeout; None where the socket
        does not exist."""
        timeout_s = self._timeout_s
        reader = AnswerReader()
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(timeout_s):
                stream, writer = await asyncio.open_unix_connection(path, limit=2 * MAX_FRAME)
                writer.write(request(self._args, timeout_s))
                await writer.drain()
                while reader.outcome is None:
                    data = await stream.read(MAX_FRAME)
                    if not data:
                        return reader.ended()
                    replies = reader.feed(data)
                    if replies:
                        writer.write(replies)
                        await writer.drain()
        except TimeoutError:
            return Unhealthy(f"no answer within {timeout_s:g}s")
        except FileNotFoundError:
            return None
        except OSError as error:
            return Unhealthy(f"cannot ask it: {error.strerror or error}")
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await within(writer.wait_closed(), 1.0)
        return reader.ended()


def verdict(answer: HealthCheckResponse) -> Unhealthy | None:
    """NVRx's reading of an answer: None when healthy, else why not (escaped, bounded)."""
    if not answer.success:
        said = f": {escape(answer.error, limit=200)}" if answer.error else ""
        return Unhealthy(f"the health check failed (exit code {answer.exit_code}){said}")
    document = parse_output(answer.output)
    if isinstance(document, Unhealthy):
        return document
    fail_count = document.get("fail_count")
    if fail_count is None:
        return Unhealthy("its output has no fail_count")
    if isinstance(fail_count, int | float) and fail_count == 0:
        return None
    count = escape(json.dumps(fail_count)[:40], limit=40)
    said = f"{count} check(s) failed: {failed_checks(document.get('failed_checks'))}"
    return Unhealthy(said[:MAX_REASON])


def parse_output(output: str) -> dict[str, object] | Unhealthy:
    """The output's JSON object, or why it is none (not JSON, nested too deep, no object)."""
    if not nesting_within(output, MAX_DEPTH):
        deep = f"its output is not JSON (unbalanced or nested deeper than {MAX_DEPTH})"
        return Unhealthy(deep, "output_too_deep")
    try:
        document = json.loads(output)
    except (ValueError, RecursionError) as error:
        return Unhealthy(f"its output is not JSON ({escape(str(error), limit=120)})", "not_json")
    if not isinstance(document, dict):
        return Unhealthy(f"its output is a JSON {type(document).__name__}, not an object")
    return document


def failed_checks(named: object) -> str:
    """The failed checks' names, the first MAX_NAMED, each escaped and cut."""
    if not isinstance(named, list) or not named:
        return "(none named)"
    shown = [
        escape(item if isinstance(item, str) else json.dumps(item)[:80], limit=60)
        for item in named[:MAX_NAMED]
    ]
    more = f" and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else ""
    return ", ".join(shown) + more
