"""The rank side of the round protocol (keys.py): arrive, learn the members, announce faults.

Two modes, chosen from the environment:
- under `ftd serve --restart-mode inprocess` (FTD_RESTART_MODE=inprocess): the daemon's store
  (FTD_STORE_ADDR) and prefix (FTD_INPROCESS_PREFIX); the daemon decides each round's members,
  hosts its process group's store, announces dead ranks and kills those that miss a barrier;
- anywhere else (torchrun, a test): the store at MASTER_ADDR:MASTER_PORT; the ranks decide the
  members themselves (everyone arrived, or `barrier_timeout` passed) and the deciding rank hosts
  the round's store. A peer's crash is then seen only when a collective with it fails.

Every call here blocks (a TCPStore client); torch is imported when a client is made.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ftd_client.inprocess.exceptions import RestartError
from ftd_client.inprocess.keys import (
    COMPLETED,
    DAEMON,
    DEAD,
    ENV_PREFIX,
    ENV_RESTART_MODE,
    ENV_STORE_ADDR,
    FAULT,
    INPROCESS,
    Arrival,
    Fault,
    Forged,
    Keys,
    Members,
    Seal,
    claim_fault,
    valid_fault,
)
from ftd_client.store import tcp_store_client, tcp_store_server, wait_keys

log = logging.getLogger("ftd_client.inprocess")

IDLE_WAIT = timedelta(days=365)
"""Timeout of a watcher's wait for a fault: a healthy round may last the whole job."""


def connect(host: str, port: int, timeout_s: float) -> Any:
    """A TCPStore client (blocking; torch is imported here)."""
    return tcp_store_client(host, port, timeout_s)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    prefix: str
    daemon: bool
    """Whether an `ftd serve` daemon coordinates (else the ranks do)."""


def endpoint_from_env(call: int) -> Endpoint:
    """Where this process's rounds meet; `call` numbers the wrapped calls in this process."""
    env = os.environ
    daemon = env.get(ENV_RESTART_MODE) == INPROCESS
    if daemon:
        addr, prefix = env.get(ENV_STORE_ADDR, ""), env.get(ENV_PREFIX, "")
        if not addr or not prefix:
            raise RestartError(
                f"{ENV_RESTART_MODE}=inprocess without {ENV_STORE_ADDR}/{ENV_PREFIX}"
            )
    else:
        addr = env.get(ENV_STORE_ADDR, "")
        if not addr:
            if not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
                raise RestartError(
                    "ftd_client.inprocess.Wrapper needs a store: run under `ftd serve "
                    "--restart-mode inprocess`, torchrun, or set MASTER_ADDR and MASTER_PORT"
                )
            # The Wrapper rewrites MASTER_PORT for each round: remember the job's store.
            addr = env[ENV_STORE_ADDR] = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            warnings.warn(
                "ftd_client.inprocess: not under `ftd serve --restart-mode inprocess`; the "
                f"ranks coordinate through the store at {addr}, and a peer's crash is seen only "
                "when a collective with it fails",
                RuntimeWarning,
                stacklevel=4,
            )
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"ftd/inprocess/{run_id}/attempt_{attempt}"
    host, _, port = addr.rpartition(":")
    if call:
        prefix = f"{prefix}/call_{call}"
    return Endpoint(host.strip("[]"), int(port), prefix, daemon)


class Coordination:
    """The main thread's view of the rounds; the watcher and watchdog threads make their own
    clients (`client()`), since a blocked wait holds its connection."""

    def __init__(
        self,
        endpoint: Endpoint,
        slot: int,
        initial_world_size: int,
        barrier_timeout_s: float,
        hard_timeout_s: float,
    ) -> None:
        self.endpoint = endpoint
        self.keys = Keys(endpoint.prefix)
        self.slot = slot
        self.initial_world_size = initial_world_size
        self.barrier_timeout_s = barrier_timeout_s
        self.hard_timeout_s = hard_timeout_s
        self.seal = Seal.from_env() if endpoint.daemon else Seal()
        """Seals this attempt's records under a daemon whose job has a secret (keys.py)."""
        self._store = self.client(barrier_timeout_s)
        self._round_stores: list[Any] = []
        """Stores this rank hosts for rounds it decided (without a daemon)."""

    def client(self, timeout_s: float) -> Any:
        return connect(self.endpoint.host, self.endpoint.port, timeout_s)

    def assignment_store(self, timeout_s: float) -> Any:
        """A client whose keys live under this call's prefix: what rank assignments keep in
        the store (FilterCountGroupedByKey's counts, Tree's keys) is this attempt's alone."""
        from torch.distributed import PrefixStore

        return PrefixStore(f"{self.endpoint.prefix}/assignment", self.client(timeout_s))

    def first_round(self) -> int:
        """The round this process joins: the daemon's open one (a respawned rank joins late)."""
        if not self.endpoint.daemon:
            return 0
        return int(self._store.get(self.keys.open))

    def join(self, rnd: int, previous: Members | None) -> Members:
        """Arrive at round `rnd`'s barrier and return its members (this rank among them).

        RestartError when the round was decided without this rank.
        """
        store, keys = self._store, self.keys
        arrive = keys.arrive(rnd, self.slot)
        arrival = Arrival(os.getpid(), self.hard_timeout_s).encode()
        store.set(arrive, self.seal.seal(arrive, arrival))
        if self.endpoint.daemon:
            store.queue_push(keys.barrier, f"{rnd}:{self.slot}")
            members = self._wait_members(rnd)
            if members is None:
                raise RestartError(
                    f"round {rnd}: the daemon did not decide the members within "
                    f"{self.barrier_timeout_s:.0f}s (barrier_timeout)"
                )
            if members.rank_of(self.slot) is None:
                latest = int(store.get(keys.open))
                if latest > rnd:  # a respawned rank that arrived as its round closed
                    return self.join(latest, members)
        else:
            expected = len(previous.slots) if previous is not None else self.initial_world_size
            arrived = int(store.add(keys.count(rnd), 1))
            members = self._decide(rnd) if arrived >= expected else self._wait_members(rnd)
            if members is None:
                members = self._decide(rnd)
        if members.rank_of(self.slot) is None:
            raise RestartError(
                f"round {rnd} was decided without rank {self.slot} (it arrived late); "
                "it leaves the job"
            )
        return members

    def _wait_members(self, rnd: int) -> Members | None:
        key = self.keys.members(rnd)
        try:
            return Members.decode(self.seal.unseal(key, self._store.get(key)))
        except Forged as error:  # never a process group in a store someone else named
            raise RestartError(f"round {rnd}: refused the members record: {error}") from None
        except RuntimeError as error:  # DistStoreError: the barrier timed out
            if "timeout" not in str(error).lower():
                raise
            return None

    def _decide(self, rnd: int) -> Members:
        """Without a daemon: the ranks that arrived are the members; the first rank to get
        here hosts the round's store (first writer wins)."""

        arrived = [
            s
            for s in range(self.initial_world_size)
            if (value := self._check(self.keys.arrive(rnd, s))) and value != DEAD
        ]
        host = _local_address(self.endpoint.host, self.endpoint.port)
        server = tcp_store_server(host, 0, self.barrier_timeout_s)
        key = self.keys.members(rnd)
        mine = Members(tuple(arrived), host, int(server.port), f"rank {self.slot}").encode()
        stored = self._store.compare_set(key, "", self.seal.seal(key, mine))
        if stored == self.seal.seal(key, mine):
            self._round_stores = [server]  # the previous round's store is no longer needed
            log.info("ftd: round %d decided by this rank: ranks %s", rnd, arrived)
        return Members.decode(self.seal.unseal(key, stored))

    def _check(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        value: bytes = self._store.get(key)
        return value

    def announce(self, store: Any, rnd: int, fault: Fault, members: Members) -> Fault:
        """Write `fault` as round `rnd`'s fault unless one is there, and wake every watcher;
        the round's fault (the first written)."""
        stored = claim_fault(store, self.seal, self.keys.fault(rnd), fault)
        watchers: list[int | str] = [*members.slots, DAEMON]
        for who in watchers:
            store.set(self.keys.wake(rnd, who), FAULT)
        return stored

    def announce_here(self, rnd: int, fault: Fault, members: Members) -> Fault:
        return self.announce(self._store, rnd, fault, members)

    def complete(self, rnd: int, members: Members) -> Fault | None:
        """This member's function returned from round `rnd`: wait for the round's end. None
        when every member returned (the last to return says so); the round's fault when one
        came first, and this rank goes on to the next round with the others.

        Under a daemon the wait has no end of its own (the daemon announces a member that
        dies); without one, a member that never returns is given up on after barrier_timeout.
        """
        store, keys = self._store, self.keys
        if int(store.add(keys.done(rnd), 1)) >= len(members.slots):
            by = f"rank {self.slot}"
            ended = Fault.now(COMPLETED, self.slot, "every member returned", rnd, by)
            self.announce(store, rnd, ended, members)
        wake = keys.wake(rnd, self.slot)
        started = time.monotonic()
        fault: Fault | None = None
        while fault is None:
            while not wait_keys(store, [wake], self.barrier_timeout_s):
                if not self.endpoint.daemon:
                    log.warning(
                        "ftd: round %d: not every member returned within %.0fs "
                        "(barrier_timeout); this rank returns",
                        rnd,
                        time.monotonic() - started,
                    )
                    self.stop_watcher(rnd, self.slot)
                    return None
            fault = valid_fault(store, self.seal, keys.fault(rnd), wake)
        return None if fault.completed else fault

    def read_fault(self, rnd: int) -> Fault:
        key = self.keys.fault(rnd)
        try:
            return Fault.decode(self.seal.unseal(key, self._store.get(key)))
        except Forged as error:  # overwritten after a valid one ended the round
            return Fault.now("interrupted", -1, str(error), rnd, "unknown")

    def stop_watcher(self, rnd: int, who: int | str) -> bool:
        """Tell <who>'s watcher that round `rnd` ended well; False when a fault came first."""
        from ftd_client.inprocess.keys import STOP

        return bytes(self._store.compare_set(self.keys.wake(rnd, who), "", STOP)) == STOP

    def close(self) -> None:
        self._round_stores.clear()
        self._store = None


def _local_address(host: str, port: int) -> str:
    """This machine's address as seen on the way to host:port (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return socket.gethostname()
