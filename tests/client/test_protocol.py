"""The rank protocol's wire format (ftd_client.wire): round trips and the refusals."""

from __future__ import annotations

import json

import pytest
from ftd_client import protocol, wire
from ftd_client.messages import Heartbeat, SectionStart
from ftd_client.protocol import ProtocolError
from ftd_client.wire import Envelope


def test_protocol_round_trip_and_rejections() -> None:
    assert wire.decode(protocol.HEARTBEAT_BYTES) == Envelope(Heartbeat())
    assert wire.decode(wire.encode(SectionStart("step"))).message == SectionStart("step")
    cases = {
        b"\xff": "malformed",
        b"[]": "malformed",
        b'{"v":2,"t":"hb"}': "unknown_version",
        b'{"v":true,"t":"hb"}': "unknown_version",
        b'{"v":1,"t":"??"}': "unknown_type",
        b'{"v":1,"t":"ss","n":""}': "bad_section_name",
        b'{"v":1,"t":"wc","a":"CONTINUE"}': "missing_id",
        b'{"v":1,"t":"wc","a":"CONTINUE","id":true}': "missing_id",
        b'{"v":1,"t":"wc","a":"NOPE","id":1}': "bad_action",
        b"x" * (protocol.MAX_MESSAGE_BYTES + 1): "oversized",
    }
    for data, cause in cases.items():
        with pytest.raises(ProtocolError) as raised:
            wire.decode(data)
        assert raised.value.cause == cause
    with pytest.raises(ProtocolError):
        wire.encode(SectionStart("x" * protocol.MAX_MESSAGE_BYTES))
    assert json.loads(wire.encode(Heartbeat())) == {"v": 1, "t": "hb"}


def test_every_record_survives_the_wire() -> None:
    """What a rank encodes, the daemon's door reads back as the same record and envelope."""
    from ftd_client.checkpoint_messages import CheckpointBegin, CheckpointSeen
    from ftd_client.messages import CalculateTimeouts, Fault, Hello, ProgressReport, SetTimeouts

    for record in (
        Hello(10),
        CalculateTimeouts(("step",), False, "nvrx", "sections", 3),
        SetTimeouts({"rank_heartbeat_timeout": 5.0, "rank_section_timeouts": {"s": 1.0}}, ("x",)),
        Fault("hang", ("step",)),
        ProgressReport(1, 2, 3, 4, 5, 6, 7, (("auto:torch.save", 8),), 10),
        CheckpointBegin(1, 2, 3, 4),
        CheckpointSeen(5, restored=True),
    ):
        sent = Envelope(record, 7 if record.KIND in wire.ANSWERED else None, 3, ("a",), 1, 9)
        assert wire.decode(wire.encode(record, **_around(sent))) == sent, record


def _around(envelope: Envelope) -> dict[str, object]:
    return {
        "id": envelope.id,
        "seq": envelope.seq,
        "open": envelope.open,
        "dropped": envelope.dropped,
        "sent_ns": envelope.sent_ns,
    }
