"""A rank that attacks NVRx's rank-monitor socket, then proves the daemon still serves it.

Each hostile message goes on its own connection (the daemon closes a connection after a bad
message: a stream cannot be resynchronised). Then a well-formed exchange (AuthkeyMsg, InitMsg,
HeartbeatMsg), built by reference to NVRx's class names, must be answered with OkMsg. The
socket path is printed, and the rank waits for --go before leaving, so that the test can try
the socket as a stranger meanwhile.

--mode bomb (issue 23 row 4): rank 0 sends one frame of memo-shared nested tuples and goes on
heartbeating; rank 1 heartbeats once and goes silent. On attempt 1 rank 0 sends the bomb again
and both heartbeat until stopped.
--mode stopped (issue 28 item 4): NVIDIA's own RankMonitorClient (or, where NVRx is not
installed, the same frames by hand) heartbeats and opens/closes a section in a loop until --go,
printing every call that took over 0.5 s: the test stops the daemon meanwhile.
--mode build (row 5): a frame whose BUILD rewrites `SectionAction._value2member_map_` (every
value to CLOSE_ALL), then an ordinary section open of "step", and the rank hangs in it.
"""

import argparse
import os
import pickle
import socket
import struct
import time
from pathlib import Path

from ftd.health.nvrx import wire as wire

parser = argparse.ArgumentParser()
parser.add_argument("--go", type=Path)
parser.add_argument("--mode", choices=["classic", "bomb", "build", "stopped"], default="classic")
args = parser.parse_args()
path = os.environ["FT_RANK_MONITOR_IPC_SOCKET"]
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
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


def send_only(payload: bytes) -> socket.socket:
    """The frame sent, its connection kept (the daemon's answer is not waited for)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(wire.frame(payload))
    return sock


def connect() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    rank_info = wire.Ref(
        wire.DATA_MODULE,
        "RankInfo",
        {"global_rank": str(rank), "local_rank": rank, "host": "h", "pid": os.getpid()},
    )
    call(sock, wire.Ref(wire.DATA_MODULE, "AuthkeyMsg", {"authkey": b"k" * 32}))
    call(sock, wire.Ref(wire.DATA_MODULE, "InitMsg", {"rank_info": rank_info}))
    return sock


def call(sock: socket.socket, message: object) -> bool:
    sock.sendall(wire.frame(wire.dumps(message)))
    size = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))[0]
    reply = sock.recv(size, socket.MSG_WAITALL)
    return b"OkMsg" in reply and b"ErrorMsg" not in reply


def heartbeat(sock: socket.socket) -> bool:
    return call(sock, wire.Ref(wire.DATA_MODULE, "HeartbeatMsg", {"rank": str(rank), "state": {}}))


def bomb() -> bytes:
    """A HeartbeatMsg whose rank is 60 levels of (t, t): 2^60 to hash or print, 333 bytes."""
    nested: tuple = ()
    for _ in range(60):
        nested = (nested, nested)
    body = pickle.dumps(nested, protocol=4)[2:-1]  # no PROTO, no STOP
    if body[0] == 0x95:
        body = body[9:]  # nor FRAME

    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value)]) + value.encode()

    head = b"\x80\x04" + text(wire.DATA_MODULE) + text("HeartbeatMsg") + b"\x93)\x81}"
    return head + text("rank") + body + b"sb."


def section_action_rewrite() -> bytes:
    """BUILD on the class, (None, slotstate): setattr(SectionAction, '_value2member_map_',
    {1: CLOSE_ALL, 2: CLOSE_ALL}), as pickle.Unpickler did."""
    cls = b"c" + wire.DATA_MODULE.encode() + b"\nSectionAction\n"
    close_all = cls + b"K\x03\x85R"
    name = b"_value2member_map_"
    state = b"}\x8c" + bytes([len(name)]) + name
    state += b"}K\x01" + close_all + b"sK\x02" + close_all + b"ss"
    return b"\x80\x04" + cls + b"N" + state + b"\x86b."


if args.mode == "bomb":
    sock = connect()
    heartbeat(sock)
    if rank == 0:
        kept = send_only(bomb())
        print(f"bomb sent a{attempt}", flush=True)
    if rank == 1 and attempt == 0:
        print(f"silent from {time.time():.3f}", flush=True)
        time.sleep(3600)
    while True:
        ok = heartbeat(sock)
        print(f"heartbeat a{attempt} r{rank} {ok}", flush=True)
        time.sleep(0.2)

if args.mode == "stopped":
    try:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    except ImportError:
        RankMonitorClient = None
    if RankMonitorClient is not None:
        client = RankMonitorClient()
        client.init_workload_monitoring()
        calls = [client.send_heartbeat, lambda: client.start_section("step")]
        calls.append(lambda: client.end_section("step"))
    else:
        sock = connect()
        calls = [lambda: heartbeat(sock)]
    print(f"ready ({'NVRx' if RankMonitorClient else 'frames'})", flush=True)
    took: list[float] = []
    while not args.go.exists():
        for each in calls:
            start = time.monotonic()
            each()
            took.append(time.monotonic() - start)
            if took[-1] > 0.5:
                print(f"slow call {took[-1]:.3f} s", flush=True)
            if len(took) == 300:
                print("300 calls made", flush=True)
        time.sleep(0.01)
    took.sort()
    p50, p99 = (took[int(len(took) * q)] * 1e3 for q in (0.5, 0.99))
    print(f"calls {len(took)}: p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {took[-1]:.3f} s")
    raise SystemExit(0)

if args.mode == "build":
    sock = send_only(section_action_rewrite())
    print(f"build reply {len(sock.recv(100))} bytes", flush=True)
    sock = connect()
    heartbeat(sock)
    opened = call(
        sock,
        wire.Ref(
            wire.DATA_MODULE,
            "SectionMsg",
            {
                "rank": str(rank),
                "section": "step",
                "action": wire.EnumRef(wire.DATA_MODULE, "SectionAction", 1),
            },
        ),
    )
    print(f"in step since {time.time():.3f} (opened: {opened})", flush=True)
    time.sleep(3600)

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
