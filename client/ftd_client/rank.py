"""RankClient: heartbeats, sections and requests from a rank to its node daemon.

Every call is cheap and never blocks training: a heartbeat or a section event is one
non-blocking packet send; if the daemon is away (stopped, slow, gone) the message is dropped
and counted. Every message carries a sequence number and section events carry the sections
open after them, and the first message after a drop carries the whole state, so a lost
message never leaves the daemon timing a section this rank has closed (protocol.py). Only
explicit requests (workload control, timeout calculation) wait for an answer, bounded by
`request_timeout_s`. Outside `ftd serve` every call is a no-op (one warning).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import socket
import time
import warnings
from types import TracebackType
from typing import IO, Any, Literal

from ftd_client import faults, protocol
from ftd_client.messages import (
    CalculateTimeouts,
    Fault,
    Goodbye,
    Hello,
    Resumed,
    SectionEnd,
    SectionStart,
    SetTimeouts,
    WorkloadControl,
)
from ftd_client.protocol import WorkloadAction
from ftd_client.rank_sender import Sender
from ftd_client.rank_setup import register_stack_dump, size_send_buffer, unregister_stack_dump
from ftd_client.wire import Message

log = logging.getLogger("ftd_client")

RECONNECT_INTERVAL_S = 1.0
_warned_unsupervised = False


class _Section:
    __slots__ = ("_client", "_name")

    def __init__(self, client: RankClient, name: str) -> None:
        self._client, self._name = client, name

    def __enter__(self) -> None:
        self._client.start_section(self._name)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._client.end_section(self._name)


class RankClient:
    """A rank's connection to its `ftd serve` daemon, configured from the FTD_* environment."""

    def __init__(self, socket_path: str | None = None, request_timeout_s: float = 5.0) -> None:
        self.request_timeout_s = request_timeout_s
        self.connect_failures = 0
        """Connection attempts that failed (the daemon was away); a retry is rate-limited."""
        self.timeouts: dict[str, Any] = {}
        """The timeouts in force, as the daemon last announced them."""
        self.learned: frozenset[str] = frozenset()
        """Which of them were calculated (`rank_heartbeat_timeout`, `section:step`, ...)."""
        self._generations: dict[tuple[str, str], int] = {}
        self.last_error = ""
        """Why the last request was not answered with timeouts."""
        self._path = socket_path if socket_path is not None else os.environ.get("FTD_SOCKET")
        self._sock: socket.socket | None = None
        self._sender = Sender()
        self._heartbeat = self._sender.heartbeat
        self._open_sections = self._sender.open_sections
        self._ids = itertools.count(1)
        self.refused_sections = 0
        """Sections not opened: MAX_OPEN_SECTIONS were open already (a leak in the caller)."""
        self._next_reconnect = 0.0
        self._stack_file: IO[str] | None = None
        self._stack_signal: int | None = None
        self._hello_id: int | None = None
        if not self._path:
            _warn_unsupervised()
            return
        self._stack_file, self._stack_signal = register_stack_dump()
        self._connect()
        faults.arm_from_env(self._announce_fault)

    @property
    def is_supervised(self) -> bool:
        return self._sock is not None

    @property
    def dropped(self) -> int:
        """Messages that could not be handed to the daemon (it was away or overloaded)."""
        return self._sender.dropped

    # -- the hot path ------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Tell the daemon this rank is alive."""
        if not self._heartbeat():
            self._reconnect()

    def resumed(self) -> None:
        """Tell the daemon this rank is training again (say, after its first collective of a
        new attempt): the end of a restart's `init` (or `restore`) stage. A heartbeat or a
        section start counts too; this says it where neither fits."""
        self._send_message(Resumed())

    def start_section(self, name: str) -> None:
        """Open section `name` (timed against its `rank_section_timeouts` entry)."""
        if len(self._open_sections) >= protocol.MAX_OPEN_SECTIONS:
            self.refused_sections += 1
            if self.refused_sections == 1:
                log.warning(
                    "ftd: %d sections are open (is end_section missing?); section %r and "
                    "further ones beyond that are not timed",
                    protocol.MAX_OPEN_SECTIONS,
                    name[:64],
                )
            return
        self._open_sections.append(name)
        if not self._sender.section(SectionStart, name):
            self._reconnect()

    def end_section(self, name: str) -> None:
        if name in self._open_sections:
            self._open_sections.remove(name)
        if not self._sender.section(SectionEnd, name):
            self._reconnect()

    def end_all_sections(self) -> None:
        for name in reversed(self._open_sections):
            self.end_section(name)

    def section(self, name: str) -> _Section:
        """`with client.section("step"): ...`"""
        return _Section(self, name)

    # -- requests ----------------------------------------------------------------------------

    def send(self, message: Message) -> dict[str, Any] | None:
        """Any message record (ftd_client.messages, .checkpoint_messages): a kind the daemon
        answers (its `ANSWERED`) waits for the reply, None without one (`last_error`); any
        other is sent and None returned. The named requests below are this with a record
        (heartbeats and sections keep their faster path), so a new kind needs no method here."""
        if message.ANSWERED:
            return self._request(message)
        self._send_message(message)
        return None

    def send_workload_control(self, action: WorkloadAction, description: str = "") -> bool:
        """Ask the supervisor to act (exclude this node, shut the workload down, continue);
        whether it acknowledged."""
        reply = self.send(WorkloadControl(action, description[: protocol.MAX_DESCRIPTION]))
        return bool(reply and reply.get("ok"))

    def calculate_and_set_timeouts(
        self,
        sections: list[str] | None = None,
        out_of_section: bool = True,
        *,
        rule: Literal["ftd", "nvrx"] = "ftd",
        kind: Literal["all", "hb", "sections"] = "all",
    ) -> dict[str, Any] | None:
        """Ask the daemon to learn timeouts from what it observed; the new timeouts, or None
        (`last_error` says why). Every rank's n-th call of a rule and kind is one generation:
        the daemon starts them all from the same timeouts, so the result does not depend on
        which rank called last. `rule="nvrx"` learns `kind` "hb" or "sections" by NVRx's rule."""
        generation = self._generations[rule, kind] = self._generations.get((rule, kind), 0) + 1
        names = None if sections is None else tuple(sections)
        reply = self._request(CalculateTimeouts(names, out_of_section, rule, kind, generation))
        return self._apply_timeouts(reply)

    def state_dict(self) -> dict[str, Any]:
        """The timeouts in force, for a checkpoint, and which of them were calculated."""
        self._drain_replies()
        return {"timeouts": dict(self.timeouts), "learned": sorted(self.learned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply timeouts saved by `state_dict` (e.g. from a checkpoint); those it lists as
        `learned` stay learned ones."""
        timeouts = state.get("timeouts")
        learned = state.get("learned", [])
        if isinstance(timeouts, dict) and timeouts:
            names = tuple(str(name) for name in learned) if isinstance(learned, list) else ()
            self._apply_timeouts(self._request(SetTimeouts(timeouts, names)))

    def wait_for_handshake(self) -> dict[str, Any]:
        """Block (up to request_timeout_s) for the daemon's answer to the handshake; the
        timeouts in force. For initialisation code that wants them before the first step."""
        if self._sock is None or self._hello_id is None:
            return self.timeouts
        deadline = time.monotonic() + self.request_timeout_s
        while not self.timeouts and (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self._sock], [], [], remaining)
            if not readable:
                break
            self._receive()
        return self.timeouts

    def _announce_fault(self, kind: str) -> None:
        sections = list(self._open_sections)  # what the daemon should charge the hang to
        message = Fault(kind, tuple(sections))
        # Called in a signal handler of the main thread, which may have been interrupted in
        # the middle of a send, holding the sender's lock.
        if not self._sender.message(message, from_signal_handler=True):
            self._reconnect()

    def close(self) -> None:
        if self._sock is not None:
            self._send_message(Goodbye())
            self._sender.detach()
            self._sock.close()
            self._sock = None
        self._path = None
        if self._stack_file is not None:
            unregister_stack_dump(self._stack_file)
            self._stack_file = None

    def __enter__(self) -> RankClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _send_message(self, message: Message, request_id: int | None = None) -> None:
        if not self._sender.message(message, request_id):
            self._reconnect()

    def _reconnect(self) -> None:
        """The daemon went away; it may come back on its path (at most once a second)."""
        now = time.monotonic()
        if now >= self._next_reconnect:
            self._next_reconnect = now + RECONNECT_INTERVAL_S
            self._connect()

    def _connect(self) -> None:
        """(Re)connect and send the handshake; a daemon that is away costs one failed try."""
        if not self._path:
            return
        self._sender.detach()
        if self._sock is not None:
            self._sock.close()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.setblocking(False)
        size_send_buffer(self._sock)
        # Numbered from 1, the handshake carrying the state; unconnected, a send fails
        # (ENOTCONN) and the next call retries the connection.
        self._sender.attach(self._sock)
        try:
            self._sock.connect(self._path)
        except OSError:
            self.connect_failures += 1
            return
        self._hello_id = next(self._ids)
        self._send_message(Hello(self._stack_signal), self._hello_id)

    def _request(self, message: Message) -> dict[str, Any] | None:
        self.last_error = ""
        if self._sock is None:
            return None
        request_id = next(self._ids)
        self._send_message(message, request_id)
        deadline = time.monotonic() + self.request_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self._sock], [], [], remaining)
            if not readable:
                break
            for reply in self._receive():
                if reply.get("id") == request_id:
                    return reply
        log.warning("ftd: no answer to %s within %.1fs", message.KIND, self.request_timeout_s)
        return None

    def _receive(self) -> list[dict[str, Any]]:
        assert self._sock is not None
        replies: list[dict[str, Any]] = []
        while True:
            try:
                data = self._sock.recv(protocol.MAX_MESSAGE_BYTES)
            except (BlockingIOError, InterruptedError):
                return replies
            except OSError:
                return replies
            if not data:  # the daemon closed the connection
                return replies
            try:
                reply = json.loads(data)
            except ValueError:
                continue
            if isinstance(reply, dict) and reply.get("t") == protocol.REPLY:
                if reply.get("id") == self._hello_id:
                    self._apply_timeouts(reply)
                replies.append(reply)

    def _drain_replies(self) -> None:
        if self._sock is not None:
            self._receive()

    def _apply_timeouts(self, reply: dict[str, Any] | None) -> dict[str, Any] | None:
        if not reply or not reply.get("ok") or not isinstance(reply.get("timeouts"), dict):
            self.last_error = str(reply.get("error", "")) if reply else "no answer"
            return None
        self.timeouts = reply["timeouts"]
        learned = reply.get("learned")
        if isinstance(learned, list):
            self.learned = frozenset(str(name) for name in learned)
        return self.timeouts


def _warn_unsupervised() -> None:
    global _warned_unsupervised
    if not _warned_unsupervised:
        _warned_unsupervised = True
        warnings.warn(
            "ftd_client: not running under `ftd serve` (FTD_SOCKET is unset); "
            "heartbeats and sections are no-ops",
            RuntimeWarning,
            stacklevel=3,
        )
