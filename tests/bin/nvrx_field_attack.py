"""A rank that attacks the fields NVRx 0.6 added (and those a later release may add), then
talks as a 0.6 client does, by hand (NVRx's class names by reference, as ftd's own writer).

Each hostile message goes on its own connection, which the daemon closes. Then one connection
carries AuthkeyMsg, an InitMsg of 0.6 with two unknown fields, 300 heartbeats and step sections
whose replies are never read (a 0.6 client reads none), and an UpdateConfigMsg whose reply
must be the first and only thing waiting on the socket.
"""

import os
import pickle
import socket
import struct

from ftd.health.nvrx import wire as wire

path = os.environ["FT_RANK_MONITOR_IPC_SOCKET"]
rank = int(os.environ["RANK"])


def ref(name: str, **state: object) -> wire.Ref:
    return wire.Ref(wire.DATA_MODULE, name, state)


def init(**fields: object) -> bytes:
    info = ref("RankInfo", global_rank=rank, local_rank=0, host="h", pid=os.getpid())
    return wire.dumps(ref("InitMsg", rank_info=info, **fields))


def section(action: int, **fields: object) -> wire.Ref:
    opened = wire.EnumRef(wire.DATA_MODULE, "SectionAction", action)
    return ref("SectionMsg", rank=rank, section="step", action=opened, **fields)


def bomb_field() -> bytes:
    """An InitMsg whose unknown field holds 60 levels of memo-shared (t, t)."""
    nested: tuple = ()
    for _ in range(60):
        nested = (nested, nested)
    body = pickle.dumps(nested, protocol=4)[2:-1]
    body = body[9:] if body[0] == 0x95 else body  # no FRAME

    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value)]) + value.encode()

    head = b"\x80\x04" + text(wire.DATA_MODULE) + text("InitMsg") + b"\x93)\x81}"
    return head + text("later") + body + b"sb."


def exchange(payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(wire.frame(payload))
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
        return b"".join(chunks)


attacks = {
    "nine unknown fields": init(iteration=1, **{f"later{n}": n for n in range(9)}),
    "a dunder field": init(iteration=1, __class__="x"),
    "a negative iteration": init(iteration=-1, num_warmup_iters=None),
    "an iteration as text": init(iteration="1", num_warmup_iters=None),
    "warm-up iterations as a float": init(iteration=None, num_warmup_iters=2.5),
    "a negative section iteration": wire.dumps(section(1, iteration=-5)),
    "a cycle as a bool": wire.dumps(ref("UpdateConfigMsg", current_cycle=True)),
    "a bomb in an unknown field": bomb_field(),
}
for name, payload in attacks.items():
    print(f"attack {name}: reply {len(exchange(payload))} bytes", flush=True)


def read_reply(sock: socket.socket) -> bytes:
    size = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))[0]
    return sock.recv(size, socket.MSG_WAITALL)


with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(wire.frame(wire.dumps(ref("AuthkeyMsg", authkey=b"k" * 32))))
    assert b"OkMsg" in read_reply(sock)
    later = {"from_a_later": "x" * 1000, "release": {"major": 0, "minor": 8}}
    sock.sendall(wire.frame(init(iteration=None, num_warmup_iters=None, **later)))
    reply = read_reply(sock)
    skips = b"skip_section_response\x88" in reply
    print(f"init: skip_section_response={skips}", flush=True)
    for _ in range(300):
        sock.sendall(wire.frame(wire.dumps(ref("HeartbeatMsg", rank=rank, state={}))))
        sock.sendall(wire.frame(wire.dumps(section(1, iteration=None))))
        sock.sendall(wire.frame(wire.dumps(section(2, iteration=None))))
    update = ref("UpdateConfigMsg", hb_timeouts=None, section_timeouts=None, current_cycle=None)
    sock.sendall(wire.frame(wire.dumps(update)))
    first = read_reply(sock)
    sock.setblocking(False)
    try:
        left = sock.recv(1, socket.MSG_DONTWAIT)
    except BlockingIOError:
        left = b""
    if b"OkMsg" in first and b"cfg" not in first and not left:
        print("after 300 heartbeats and sections: the update's reply, then nothing", flush=True)
print("rank done", flush=True)
