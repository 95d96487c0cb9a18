"""`GET /v1/ranks/{global_rank}/stacks` and `/stderr`: the cause of a failure one click away.

Privileged reads: what a rank wrote may hold a secret it printed (`HF_TOKEN=...`), so these
routes need the bearer token on loopback too, or the admin socket (they are not among
`ftd.api.middlewares.LOOPBACK_READS`), while the failure's exception type and message stay in
the public `/v1/status`. The rank is a decimal number looked up in this node's status; the path
comes from the daemon's own records (its run directory, the attempt, the rank's local number),
never from the request. The answer is the file's last bytes (at most 64 KiB), decoded leniently
and escaped (ftd.text), as `text/plain` that no browser sniffs or keeps.
"""

from __future__ import annotations

import asyncio
import functools
import re

from aiohttp import web

from ftd.api.control import RankFileName
from ftd.api.middlewares import CONTROL
from ftd.errors import InvalidRequest, NotFound
from ftd.ranks.error_file import RankError, read_error_file, read_tail
from ftd.text import escape

MAX_TAIL_BYTES = 64 * 1024
DEFAULT_STDERR_BYTES = 16 * 1024
MAX_RANK = 2**31 - 1
_DECIMAL = re.compile(r"[0-9]{1,10}")
TEXT_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; sandbox",
    "Cache-Control": "no-store",
}


@functools.lru_cache(maxsize=16)
def root_exception(error_file: str, timestamp: float) -> str | None:
    """The exception a failed rank's error.json names (`RuntimeError: ...`), escaped; None
    without one. Read once per failure (`timestamp` tells failures apart), bounded by the
    decoder (ftd.ranks.error_file)."""
    decoded = read_error_file(error_file)
    if not isinstance(decoded, RankError) or not decoded.message:
        return None
    return escape(decoded.message, limit=4096, lines=True)


def _number(raw: str, name: str, low: int, high: int) -> int:
    if not _DECIMAL.fullmatch(raw):
        raise InvalidRequest(f"{name}: expected a decimal integer, got {raw[:40]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise InvalidRequest(f"{name}: must be between {low} and {high}, got {value}")
    return value


def _query(request: web.Request, name: str, default: int | None, high: int) -> int | None:
    given = request.query.getall(name, [])
    if not given:
        return default
    if len(given) > 1:
        raise InvalidRequest(f"{name}: given {len(given)} times")
    return _number(given[0], name, 0 if name == "attempt" else 1, high)


async def _answer(request: web.Request, name: RankFileName, max_bytes: int) -> web.Response:
    rank = _number(request.match_info["global_rank"], "global_rank", 0, MAX_RANK)
    attempt = _query(request, "attempt", None, MAX_RANK)
    path = request.app[CONTROL].rank_file(rank, attempt, name)
    data = await asyncio.to_thread(read_tail, str(path), max_bytes)
    if data is None:
        raise NotFound(f"rank {rank} has no {name} in {path.parent.parent.name}")
    return web.Response(
        text=escape(data.decode("utf-8", "replace"), lines=True),
        content_type="text/plain",
        charset="utf-8",
        headers=TEXT_HEADERS,
    )


async def get_stacks(request: web.Request) -> web.Response:
    return await _answer(request, "stacks.txt", MAX_TAIL_BYTES)


async def get_stderr(request: web.Request) -> web.Response:
    tail = _query(request, "tail_bytes", DEFAULT_STDERR_BYTES, MAX_TAIL_BYTES)
    assert tail is not None
    return await _answer(request, "stderr.log", tail)


def add_rank_file_routes(app: web.Application) -> None:
    app.router.add_get("/v1/ranks/{global_rank}/stacks", get_stacks, allow_head=False)
    app.router.add_get("/v1/ranks/{global_rank}/stderr", get_stderr, allow_head=False)
