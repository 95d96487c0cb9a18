"""A store call that times out is the store lost, said in one line, whatever the error says: an
asyncio timeout says nothing, and its empty message once raised IndexError out of a join (seen
at 1,024 virtual nodes on a saturated machine: bench/scale.py)."""

from __future__ import annotations

import asyncio

import pytest

from ftd.coordination import CoordinationError
from ftd.coordination.c10d.connections import StoreConnections
from ftd.coordination.records import RecordCodec
from ftd.tcpstore.client import StoreGone


@pytest.mark.parametrize(
    "error", [TimeoutError(), TimeoutError("slow\nsecond line"), StoreGone("")]
)
async def test_a_call_that_fails_silently_is_the_store_lost(error: BaseException) -> None:
    said: list[str] = []

    def lost(reason: str) -> CoordinationError:
        said.append(reason)
        return CoordinationError(f"store lost: {reason}", "store_lost")

    connections = StoreConnections(("127.0.0.1", 1), "p", RecordCodec("job", None), lost)

    async def failing() -> None:
        raise error

    with pytest.raises(CoordinationError, match="store lost"):
        await connections._guard(failing(), 5.0)
    assert said == [f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"]
    await asyncio.sleep(0)
