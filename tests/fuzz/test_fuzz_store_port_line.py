"""Fuzz targets for the line a workers' store process writes on its pipe (ftd.ranks.store_process:
`read_port_line` then `decode_port_line`): any bytes, in any pieces, give a port in 1..65535 or
a reason of one escaped line (with the refusal's cause when the line was no port and no error
of the child's own), never an exception, within the per-input CPU budget.

A short pass runs with the tests; the long one: `make fuzz-long` (docs/security.md).
"""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from ftd.ranks.store_process import (
    PORT_LINE_MAX_BYTES,
    WHY_MAX_CHARS,
    PortLine,
    decode_port_line,
    read_port_line,
)
from ftd.refusals import MAX_CAUSE_LENGTH
from tests.support.fuzzing import budget, fuzz_target

CAUSES = {
    "store_process_line_too_long",
    "store_process_line_cut",
    "store_process_no_port",
    "store_process_port_out_of_range",
}
_digits = st.text("0123456789", min_size=1, max_size=8)
_line = st.one_of(
    st.binary(max_size=PORT_LINE_MAX_BYTES * 2),
    _digits.map(lambda d: d.encode() + b"\n"),
    st.integers(-(2**70), 2**70).map(lambda n: b"%d\n" % n),
    st.text(max_size=300).map(lambda t: b"error " + t.encode("utf-8", "surrogatepass") + b"\n"),
    st.tuples(_digits, st.binary(max_size=40)).map(lambda t: t[0].encode() + t[1]),
    st.binary(min_size=PORT_LINE_MAX_BYTES - 2, max_size=PORT_LINE_MAX_BYTES + 2).map(
        lambda b: b.replace(b"\n", b"0") + b"\n"
    ),
)


def assert_sound(said: PortLine) -> None:
    if said.port is not None:
        assert 1 <= said.port <= 65535 and said.refusal is None and not said.why
        return
    assert said.why and "\n" not in said.why and "\x1b" not in said.why
    assert len(said.why) <= WHY_MAX_CHARS + 60
    assert said.refusal is None or (
        said.refusal in CAUSES and len(said.refusal) <= MAX_CAUSE_LENGTH
    )


@fuzz_target("store_port_line", 300)
@given(_line)
def test_fuzz_any_line_is_a_port_or_one_line_of_why(data: bytes) -> None:
    with budget():
        said = decode_port_line(data)
    assert_sound(said)
    line, newline, _ = data.partition(b"\n")
    if said.port is not None:
        assert newline and line == str(said.port).encode()


@fuzz_target("store_port_line", 200)
@given(_line, st.lists(st.integers(1, 64), max_size=20))
def test_fuzz_any_pieces_read_the_same_bounded_line(data: bytes, cuts: list[int]) -> None:
    async def read() -> bytes:
        stream = asyncio.StreamReader()
        rest = data
        for cut in cuts:
            stream.feed_data(rest[:cut])
            rest = rest[cut:]
        stream.feed_data(rest)
        stream.feed_eof()
        return await read_port_line(stream)

    with budget():
        got = asyncio.run(read())
        said = decode_port_line(got)
    assert len(got) <= PORT_LINE_MAX_BYTES + 1
    assert got == data[: len(got)]
    assert said == decode_port_line(data[: PORT_LINE_MAX_BYTES + 1])
    assert_sound(said)
