"""The rank protocol's wire format (ftd_client.protocol): round trips and the refusals."""

from __future__ import annotations

import json

import pytest
from ftd_client import protocol
from ftd_client.protocol import ProtocolError


def test_protocol_round_trip_and_rejections() -> None:
    assert protocol.decode(protocol.HEARTBEAT_BYTES) == {"v": 1, "t": "hb"}
    assert protocol.decode(protocol.section_bytes("ss", "step"))["n"] == "step"
    cases = {
        b"\xff": "malformed",
        b"[]": "malformed",
        b'{"v":2,"t":"hb"}': "unknown_version",
        b'{"v":1,"t":"??"}': "unknown_type",
        b'{"v":1,"t":"ss","n":""}': "bad_section_name",
        b'{"v":1,"t":"wc","a":"CONTINUE"}': "missing_id",
        b'{"v":1,"t":"wc","a":"NOPE","id":1}': "bad_action",
        b"x" * (protocol.MAX_MESSAGE_BYTES + 1): "oversized",
    }
    for data, cause in cases.items():
        with pytest.raises(ProtocolError) as raised:
            protocol.decode(data)
        assert raised.value.cause == cause
    with pytest.raises(ProtocolError):
        protocol.encode({"t": "ss", "n": "x" * protocol.MAX_MESSAGE_BYTES})
    assert json.loads(protocol.encode({"t": "hb"})) == {"v": 1, "t": "hb"}
