"""The lossy path from a rank to its daemon: numbered packets that carry the rank's state.

A send never blocks training: when the daemon's queue is full the packet is dropped and
counted, and the next message carries the whole state (the sections open, the drops so far).
Until one gets through, a background thread retries a bare state message (`st`) every
RETRY_S: it is no sign of life, so a rank that hangs right after a drop is still judged, by
the section it is really in. One lock orders the numbering with the packets on the wire, so
the daemon sees them in the order they were numbered (protocol.py).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable

from ftd_client import protocol, wire
from ftd_client.messages import Heartbeat, SectionEnd, SectionStart, State
from ftd_client.rank_setup import keep_stack_signal_off_this_thread
from ftd_client.wire_fields import Names

_NO_SIGNAL = socket.MSG_NOSIGNAL  # a daemon that went away must not SIGPIPE the rank
MAX_TEMPLATES = 1024
RETRY_S = 0.005
RETRY_SLOW_S = 0.1
RETRY_FAST_FOR_S = 1.0
"""The retry runs every RETRY_S for this long, then every RETRY_SLOW_S (a daemon paused for
long is not polled at 200 Hz)."""
HEARTBEAT_TEMPLATE = protocol.HEARTBEAT_TEMPLATE

_senders: weakref.WeakSet[Sender] = weakref.WeakSet()


SIGNAL_LOCK_WAIT_S = 0.2
"""How long a message from a signal handler waits for the sender's lock (see Sender.message)."""


class Sender:
    """The sending half of a RankClient: its socket, sequence, section state and drops."""

    def __init__(self, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock_ns = clock_ns
        """CLOCK_MONOTONIC in ns, the daemon's clock too (a fake one in tests)."""
        self.sock: socket.socket | None = None
        self.dropped = 0
        """Messages that could not be handed to the daemon (it was away or overloaded)."""
        self.open_sections: list[str] = []
        self._seq = 0
        """The number of the last message tried on this connection (sent or dropped)."""
        self._resync = False
        """A message was dropped: the next one carries the whole state."""
        self._templates: dict[tuple[type[SectionStart | SectionEnd], str, Names], bytes] = {}
        self._reset_threads()
        _senders.add(self)

    def _reset_threads(self) -> None:
        self._lock = threading.Lock()
        self._acquire, self._release = self._lock.acquire, self._lock.release
        self._retry_wanted = threading.Event()
        self._retrier: threading.Thread | None = None

    def attach(self, sock: socket.socket) -> None:
        """A new connection: its numbers start at 1 and its first message carries the state."""
        with self._lock:
            self.sock = sock
            self._seq = 0
            self._resync = True

    def detach(self) -> socket.socket | None:
        with self._lock:
            sock, self.sock = self.sock, None
            self._retry_wanted.clear()
            return sock

    # -- sending: each returns False when the daemon went away (the owner reconnects) ---------

    def heartbeat(self) -> bool:
        # The hot path: the lock's bound methods (a third of `with`'s cost), _send inlined.
        self._acquire()
        try:
            sock = self.sock
            if sock is None:
                return True
            self._seq = seq = self._seq + 1
            if self._resync:
                return self._send(sock, self._state(Heartbeat()))
            try:
                sock.send(HEARTBEAT_TEMPLATE % seq, _NO_SIGNAL)
            except OSError as error:
                return self._dropped(error)
            return True
        finally:
            self._release()

    def section(self, event: type[SectionStart | SectionEnd], name: str) -> bool:
        """A section event with the sections open after it (`open_sections`, already changed
        by the caller) and its send time: a template per (event, state), so the hot path is
        one lookup, one %-format and one send."""
        key = (event, name, tuple(self.open_sections))
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.clear()
            template = self._templates[key] = wire.section_template(event(name), key[2])
        self._acquire()
        try:
            sock = self.sock
            if sock is None:
                return True
            self._seq = seq = self._seq + 1
            if self._resync:
                return self._send(sock, self._state(event(name)))
            return self._send(sock, template % (seq, self._clock_ns()))
        finally:
            self._release()

    def message(
        self,
        message: wire.Message,
        request_id: int | None = None,
        *,
        from_signal_handler: bool = False,
    ) -> bool:
        """Any other message, numbered (and with the state after a drop). From a signal
        handler that never returns to what it interrupted (a simulated fault), the lock may be
        held by that very code, in this thread: it is waited for at most SIGNAL_LOCK_WAIT_S (the
        retry thread's hold), then the message goes without it; the interrupted code never
        resumes to finish its own send."""
        held = self._lock.acquire(timeout=SIGNAL_LOCK_WAIT_S if from_signal_handler else -1)
        try:
            sock = self.sock
            if sock is None:
                return True
            self._seq += 1
            if self._resync:
                return self._send(sock, self._state(message, request_id))
            return self._send(sock, wire.encode(message, id=request_id, seq=self._seq))
        finally:
            if held:
                self._lock.release()

    # -- internals (under the lock) ---------------------------------------------------------

    def _state(self, message: wire.Message, request_id: int | None = None) -> bytes:
        return wire.encode(
            message,
            id=request_id,
            seq=self._seq,
            open=self.open_sections,
            dropped=self.dropped,
            sent_ns=self._clock_ns(),
        )

    def _send(self, sock: socket.socket, data: bytes) -> bool:
        try:
            sock.send(data, _NO_SIGNAL)
        except OSError as error:
            return self._dropped(error)
        self._resync = False  # while a resync is due every message carries the state
        return True

    def _dropped(self, error: OSError) -> bool:
        self.dropped += 1
        self._resync = True
        if error.errno in (errno.EAGAIN, errno.ENOBUFS):
            self._want_retry()
            return True
        return False

    def _want_retry(self) -> None:
        self._retry_wanted.set()
        if self._retrier is None or not self._retrier.is_alive():
            self._retrier = threading.Thread(
                target=_retry_loop,
                args=(weakref.ref(self), self._retry_wanted),
                name="ftd-resync",
                daemon=True,
            )
            self._retrier.start()

    def retry_once(self) -> bool:
        """Send the state if a resync is still due; whether to try again later."""
        with self._lock:
            sock = self.sock
            if not self._resync or sock is None:
                self._retry_wanted.clear()
                return False
            self._seq += 1
            if not self._send(sock, self._state(State())):
                self._retry_wanted.clear()  # the daemon is gone: the next call reconnects
                return False
            if not self._resync:
                self._retry_wanted.clear()
                return False
            return True


def _retry_loop(ref: weakref.ref[Sender], wanted: threading.Event) -> None:
    keep_stack_signal_off_this_thread()
    while True:
        if not wanted.wait(timeout=60.0):
            if ref() is None:
                return
            continue
        started = time.monotonic()
        while (sender := ref()) is not None and sender.retry_once():
            del sender
            fast = time.monotonic() - started < RETRY_FAST_FOR_S
            time.sleep(RETRY_S if fast else RETRY_SLOW_S)
        if ref() is None:
            return


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) has no retry thread, and a lock the parent's
    thread held would stay held forever."""
    for sender in list(_senders):
        sender._reset_threads()


os.register_at_fork(after_in_child=_after_fork_in_child)
