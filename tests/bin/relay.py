"""Forward every datagram received on argv[1] to the daemon's FTD_SOCKET, from this process.

Started by a rank, so the daemon accepts what it sends as that rank's messages: the fuzz test
speaks to the daemon as a real rank would, without being one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

listen = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
listen.bind(sys.argv[1])
forward = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
forward.connect(os.environ["FTD_SOCKET"])
forward.setblocking(False)
print("relay ready", flush=True)
while True:
    data = listen.recv(1 << 20)
    with contextlib.suppress(OSError):  # the daemon's queue is full: the fuzz goes on
        forward.send(data)
    with contextlib.suppress(OSError):  # drop the daemon's replies
        while forward.recv(1 << 17):
            pass
