"""A rank that attacks NVRx's rank-monitor socket, then proves the daemon still serves it.

Each hostile message goes on its own connection (the daemon closes a connection after a bad
message: a stream cannot be resynchronised). Then a well-formed exchange (AuthkeyMsg, InitMsg,
HeartbeatMsg), built by reference to NVRx's class names, must be answered with OkMsg. The
socket path is printed, and the rank waits for --go before leaving, so that the test can try
the socket as a stranger meanwhile.
"""

import argparse
import os
import pickle
import socket
import struct
import time
from pathlib import Path

from ftd import nvrx_wire as wire

parser = argparse.ArgumentParser()
parser.add_argument("--go", type=Path, required=True)
args = parser.parse_args()
path = os.environ["FT_RANK_MONITOR_IPC_SOCKET"]
print(f"rank socket {path}", flush=True)


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ftd-nvrx-pwned",))


class Unknown:
    pass


def exchange(payload: bytes, framed: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(wire.frame(payload) if framed else payload)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
        return b"".join(chunks)


attacks = {
    "os.system": pickle.dumps(Evil()),
    "builtins.eval": b"\x80\x04cbuiltins\neval\n\x8c\x0bprint('hi')\x85R.",
    "unknown class": pickle.dumps(Unknown()),
    "nvrx class, bad field": wire.dumps(
        wire.Ref(wire.DATA_MODULE, "SectionMsg", {"rank": 0, "section": 7, "action": None})
    ),
    "not a pickle": b"\x00\x01garbage",
}
for name, payload in attacks.items():
    reply = exchange(payload)
    print(f"attack {name}: reply {len(reply)} bytes", flush=True)
print(f"attack oversized: reply {len(exchange(struct.pack('>I', 10**8) + b'x', framed=False))}")
print(f"attack truncated: reply {len(exchange(struct.pack('>I', 100) + b'x' * 10, framed=False))}")

with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(10)
    sock.connect(path)
    rank_info = wire.Ref(
        wire.DATA_MODULE,
        "RankInfo",
        {"global_rank": os.environ["RANK"], "local_rank": 0, "host": "h", "pid": os.getpid()},
    )
    for message in (
        wire.Ref(wire.DATA_MODULE, "AuthkeyMsg", {"authkey": b"k" * 32}),
        wire.Ref(wire.DATA_MODULE, "InitMsg", {"rank_info": rank_info}),
        wire.Ref(wire.DATA_MODULE, "HeartbeatMsg", {"rank": 0, "state": {}}),
    ):
        sock.sendall(wire.frame(wire.dumps(message)))
        size = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))[0]
        reply = sock.recv(size, socket.MSG_WAITALL)
        print(f"good exchange: {b'OkMsg' in reply and b'ErrorMsg' not in reply}", flush=True)
    while not args.go.exists():
        time.sleep(0.05)
print("rank done", flush=True)
