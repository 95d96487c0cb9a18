"""A lost message never kills a healthy rank: the real client's sender and the daemon's
monitor over a lossy channel model, on a fake clock.

The channel holds messages back (the daemon did not read) and drops what does not fit (the
rank's queue was full), delivers connections' queues in any order (reordering across
reconnects), and ends connections (a reconnect). After a drop the rank's resync thread retries
its state every RETRY_S once there is room. For every such history:
- a verdict names a section the rank really had open for at least its timeout;
- a rank that really hangs in a section is judged by its deadline plus one retry of its state.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field

from ftd_client import wire
from ftd_client.messages import Fault, SectionEnd, SectionStart
from ftd_client.rank_sender import Sender
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from ftd.config.ft import RankTimeouts
from ftd.health.links import Link
from ftd.health.messages import deliver
from ftd.health.monitor import Monitor
from ftd.health.verdict import Verdict
from tests.support.clock import FakeClock

TIMEOUTS = {"a": 1.0, "b": 2.0, "step": 3.0}
NAMES = sorted(TIMEOUTS)
PID = 4242
RETRY_S = 0.1


@dataclass
class Channel:
    """Every connection's queue as the kernel holds it."""

    capacity: int
    queues: dict[int, list[bytes | None]] = field(default_factory=dict)
    """Link id -> packets not read yet (None: the connection ended)."""
    overflowed: bool = False
    """A send found the queue full since the daemon last read it."""


class FakeSocket:
    def __init__(self, channel: Channel, link_id: int) -> None:
        self.channel, self.link_id = channel, link_id

    def send(self, data: bytes, flags: int = 0) -> int:
        queue = self.channel.queues[self.link_id]
        if len(queue) >= self.channel.capacity:
            self.channel.overflowed = True
            raise BlockingIOError(errno.EAGAIN, "the queue is full")
        queue.append(data)
        return len(data)


class World:
    def __init__(self, capacity: int) -> None:
        self.clock = FakeClock()
        self.channel = Channel(capacity)
        self.verdicts: list[Verdict] = []
        timeouts = RankTimeouts(
            initial_rank_heartbeat_timeout=None,
            rank_heartbeat_timeout=None,
            rank_section_timeouts=TIMEOUTS,
            rank_out_of_section_timeout=None,
        )
        self.monitor = Monitor(timeouts, self.verdicts.append, self.clock, self.drain)
        self.monitor.attach([(0, 0, PID)])
        rank = self.monitor.rank_of(PID)
        assert rank is not None
        self.rank = rank
        self.monitor.on_hello(rank, None, 0.0)
        self.links: dict[int, Link] = {}
        self.sender = Sender(clock_ns=lambda: int(self.clock.now() * 1e9))
        self.sender._want_retry = self.want_retry  # type: ignore[method-assign]
        self.retry_due = False
        self.true_open: dict[str, float] = {}
        self.connect()

    def connect(self) -> None:
        if self.links:
            self.channel.queues[max(self.links)].append(None)  # the old connection ends
        link = Link(len(self.links) + 1, PID)
        self.links[link.id] = link
        self.channel.queues[link.id] = []
        self.sender.attach(FakeSocket(self.channel, link.id))  # type: ignore[arg-type]

    def read(self, link_id: int) -> None:
        """The daemon reads one connection's queue to its end."""
        queue = self.channel.queues[link_id]
        while queue:
            packet = queue.pop(0)
            now = self.clock.now()
            if packet is None:
                self.monitor.on_state(self.rank, link_id, [], now, fresh=False)
                continue
            envelope = wire.decode(packet)
            deliver(self.monitor, self.rank, self.links[link_id], envelope, now)

    def read_all(self, order: list[int] | None = None) -> None:
        """The daemon reads the queues; one it finds full is a backlog (ipc: BACKLOG_MESSAGES)."""
        if self.channel.overflowed:
            self.monitor.on_backlog(self.rank, self.clock.now())
            self.channel.overflowed = False
        for link_id in order or list(self.channel.queues):
            self.read(link_id)

    def drain(self) -> None:
        """The daemon's drain before a verdict."""
        self.read_all()

    def want_retry(self) -> None:
        """The rank's resync thread: it tries every RETRY_S until its state gets through."""
        if not self.retry_due:
            self.retry_due = True
            self.clock.call_later(RETRY_S, self._retry, self.rank)

    def _retry(self, _: object) -> None:
        self.retry_due = False
        if self.sender.retry_once():
            self.want_retry()

    # -- the rank, as RankClient drives its sender --------------------------------------------

    def open(self, name: str) -> None:
        self.sender.open_sections.append(name)
        self.true_open[name] = self.clock.now()
        self.sender.section(SectionStart, name)

    def close(self, name: str) -> None:
        self.sender.open_sections.remove(name)
        del self.true_open[name]
        self.sender.section(SectionEnd, name)

    def check_verdicts(self) -> None:
        """No verdict on a section the rank had not really had open for its timeout."""
        for verdict in self.verdicts:
            deadline = verdict.first.deadline
            assert deadline.kind == "section", deadline
            assert deadline.section in self.true_open, (deadline, self.true_open)
            opened = self.true_open[deadline.section]
            # The rank stamps its messages in whole nanoseconds, truncated (the section may
            # count from up to 1 ns before it opened), and the floats round on top of that.
            assert verdict.at - opened >= TIMEOUTS[deadline.section] - 2e-9, (verdict, opened)


action = st.one_of(
    st.tuples(st.just("open"), st.sampled_from(NAMES)),
    st.tuples(st.just("close"), st.sampled_from(NAMES)),
    st.tuples(st.just("heartbeat"), st.none()),
    st.tuples(st.just("wait"), st.floats(0.0, 2.5)),
    st.tuples(st.just("read"), st.permutations(list(range(1, 4)))),
    st.tuples(st.just("reconnect"), st.none()),
)


def run(world: World, steps: list[tuple[str, object]]) -> None:
    for kind, arg in steps:
        if world.verdicts:
            return
        note(f"t={world.clock.now():.3f} {kind} {arg}")
        if kind == "open" and arg not in world.true_open:
            world.open(str(arg))
        elif kind == "close" and arg in world.true_open:
            world.close(str(arg))
        elif kind == "heartbeat":
            world.sender.heartbeat()
        elif kind == "wait":
            assert isinstance(arg, float)
            world.clock.advance_to(world.clock.now() + arg)
        elif kind == "read":
            assert isinstance(arg, list)
            world.read_all([i for i in arg if i in world.channel.queues])
        elif kind == "reconnect" and len(world.links) < 3:
            world.connect()
        world.check_verdicts()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(action, max_size=40), capacity=st.integers(1, 6))
# The daemon read `a` open; the rank's queue filled and its end of `a` did not fit; the
# daemon's drain at a's deadline made room, and the rank's state follows RETRY_S later.
@example(
    steps=[("open", "a"), ("read", [1]), ("heartbeat", None), ("close", "a"), ("wait", 1.5)],
    capacity=1,
)
# The same across a reconnect: the old connection's end of `a` was lost with it.
@example(
    steps=[("open", "a"), ("read", [1]), ("close", "a"), ("reconnect", None), ("wait", 1.5)],
    capacity=1,
)
def test_no_verdict_on_a_section_the_rank_had_closed(
    steps: list[tuple[str, object]], capacity: int
) -> None:
    world = World(capacity)
    run(world, steps)
    world.clock.advance_to(world.clock.now() + 10.0)  # everything still open falls due
    world.check_verdicts()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(action, max_size=40),
    capacity=st.integers(1, 6),
    hang_in=st.sampled_from(NAMES),
)
# Found by hypothesis: `a` opened at 3 x 1.2 s, which the rank's nanosecond stamp truncates.
@example(steps=[("wait", 1.2), ("wait", 1.2), ("wait", 1.2)], capacity=1, hang_in="a")
def test_a_real_hang_is_judged_within_its_deadline_and_one_retry(
    steps: list[tuple[str, object]], capacity: int, hang_in: str
) -> None:
    world = World(capacity)
    run(world, steps)
    if world.verdicts:
        return  # the rank was judged already, rightly (checked on the way)
    # The rank enters `hang_in` (that very message may not fit) and never speaks again but
    # for its resync thread; the daemon, no longer behind, reads what comes.
    if hang_in in world.true_open:
        world.close(hang_in)
    world.open(hang_in)
    hung_at = world.clock.now()
    world.read_all()
    world.clock.advance_to(hung_at + RETRY_S)
    world.read_all()
    world.clock.advance_to(hung_at + TIMEOUTS[hang_in] + RETRY_S + 1e-6)
    assert world.verdicts, f"rank in {hang_in!r} since {hung_at} not judged"
    world.check_verdicts()


def test_a_fault_announced_from_a_signal_handler_mid_send_is_sent() -> None:
    """A simulated fault's handler runs in the main thread, which the signal may have caught
    inside a send, holding the sender's lock (seen: the rank hung without its `fault` message,
    judged by its heartbeat instead). The handler's message waits briefly, then goes."""
    import os
    import signal
    import socket

    sender = Sender()
    ours, daemons = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender.attach(ours)
    announced: list[bool] = []

    def handler(signum: int, frame: object) -> None:
        announced.append(sender.message(Fault("hang"), from_signal_handler=True))

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        with sender._lock:  # the main thread is inside a send
            os.kill(os.getpid(), signal.SIGUSR2)  # the handler runs here, before the next line
            assert announced == [True]
    finally:
        signal.signal(signal.SIGUSR2, previous)
        sender.detach()
    message = wire.decode(daemons.recv(65536)).message
    assert isinstance(message, Fault) and message.kind == "hang"
    ours.close()
    daemons.close()
