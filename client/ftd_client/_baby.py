"""The baby process behind `ProcessGroupBaby`: the real group, in a child that can be killed.

One duplex pipe per baby; torch.multiprocessing's picklers send tensors as shared-memory (or
CUDA IPC) handles, so the baby works on the caller's own pages and only ids travel back.

    parent -> baby   (op_id, op, payload)    op: allreduce | allgather | broadcast | barrier
    baby -> parent   ("ready", pid) once, or ("failed", -1, text) if the group cannot be built;
                     then ("done", op_id) | ("failed", op_id, text) per collective

The baby exits when its pipe closes (the parent died or dropped it). Pipe EOF on the parent
side means the baby is gone: every pending collective fails with `BabyDiedError` at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing

log = logging.getLogger("ftd_client.process_group")

EXIT_JOIN_S = 5.0
_LIVE: weakref.WeakSet[BabyChild] = weakref.WeakSet()


@atexit.register
def _kill_babies_at_exit() -> None:
    """Runs before multiprocessing's own exit hook (atexit is LIFO), so babies stopped at exit
    are logged as stopped, not as deaths."""
    for child in list(_LIVE):
        child.kill("was stopped at exit")


class BabyDiedError(RuntimeError):
    """The baby process holding the real group is gone; `configure()` starts a fresh one."""

    def __init__(self, pid: int | None, exitcode: int | None, reason: str) -> None:
        self.pid = pid
        self.exitcode = exitcode
        self.reason = reason
        super().__init__(
            f"baby process {pid} {reason} (exit code {exitcode}); "
            "call configure() to start a fresh group"
        )


class CollectiveError(RuntimeError):
    """A collective failed inside the baby process; the text is the baby's error."""

    def __init__(self, op: str, text: str) -> None:
        self.op = op
        self.text = text
        super().__init__(f"{op} failed in the baby process: {text}")


class Outcome:
    """The completion of one collective: set once (None or an error), waited on by Works."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.error: Exception | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def set(self, error: Exception | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)

    def is_set(self) -> bool:
        return self._event.is_set()

    def result(self) -> None:
        if self.error is not None:
            raise self.error


BABY_PRELOAD = ["torch", "torch.distributed", __name__]


def _babies_context() -> Any:
    """Babies fork from multiprocessing's fork server, which imported torch once: a group
    rebuilt after a fault starts in milliseconds, not in the seconds `import torch` takes (a
    fresh interpreter per baby). The server is a fresh interpreter that never touches CUDA,
    so a baby may (as it may under spawn); one the script started earlier keeps its own
    preload, and that costs only time."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(BABY_PRELOAD)
    return ctx


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class BabyChild:
    """The parent's handle on one baby process: submit collectives, read completions, kill."""

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self._process = process
        self._conn = conn
        self._lock = threading.Lock()
        self._pending: dict[int, Outcome] = {}
        self._next_id = 0
        self._kill_reason: str | None = None
        self._death: BabyDiedError | None = None
        self._reader = threading.Thread(
            target=self._read, name=f"ftd-baby-reader-{process.pid}", daemon=True
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @classmethod
    def start(
        cls, backend: str, store_addr: str, rank: int, world_size: int, timeout_s: float
    ) -> BabyChild:
        """Spawn a baby and wait (up to `timeout_s`) until its group exists on every member."""
        ctx = _babies_context()
        conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=baby_main,
            args=(child_conn, backend, store_addr, rank, world_size, timeout_s),
            name=f"ftd-baby-{backend}-{rank}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        child = cls(process, conn)
        try:
            child._await_ready(backend, timeout_s)
        except BaseException:
            child.kill("failed to configure")
            raise
        child._reader.start()
        _LIVE.add(child)
        log.info(
            "baby process %d holds the %s group (rank %d of %d)",
            process.pid,
            backend,
            rank,
            world_size,
        )
        return child

    def _await_ready(self, backend: str, timeout_s: float) -> None:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(
                f"baby process {self.pid} did not build its {backend} group within {timeout_s:g} s"
            )
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(EXIT_JOIN_S)
            raise BabyDiedError(
                self.pid, self._process.exitcode, "exited during configure"
            ) from None
        if message[0] != "ready":
            raise RuntimeError(f"baby process could not build its {backend} group: {message[2]}")

    def submit(self, op: str, payload: tuple[Any, ...]) -> Outcome:
        """Hand a collective to the baby; raises BabyDiedError if it is already gone."""
        outcome = Outcome(op)
        with self._lock:
            if self._death is not None:
                death = self._death
                raise BabyDiedError(death.pid, death.exitcode, death.reason)
            op_id = self._next_id
            self._next_id += 1
            self._pending[op_id] = outcome
            try:
                self._conn.send((op_id, op, payload))
            except (OSError, ValueError) as e:
                del self._pending[op_id]
                raise BabyDiedError(self.pid, self._process.exitcode, "cannot be reached") from e
        return outcome

    def _read(self) -> None:
        while True:
            try:
                kind, op_id, *rest = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                outcome = self._pending.pop(op_id, None)
            if outcome is not None:
                outcome.set(None if kind == "done" else CollectiveError(outcome.op, rest[0]))
        self._process.join(EXIT_JOIN_S)
        self._fail_all()
        self._conn.close()

    def _fail_all(self) -> None:
        with self._lock:
            if self._death is None:
                reason = self._kill_reason or "died"
                self._death = BabyDiedError(self.pid, self._process.exitcode, reason)
                log.log(logging.INFO if self._kill_reason else logging.WARNING, "%s", self._death)
            death = self._death
            pending, self._pending = self._pending, {}
        for outcome in pending.values():
            outcome.set(BabyDiedError(death.pid, death.exitcode, death.reason))

    def kill(self, reason: str) -> None:
        """SIGKILL the baby (its peers' collectives then fail within about 0.5 s) and fail
        every pending collective with `reason`."""
        with self._lock:
            if self._kill_reason is None:
                self._kill_reason = reason
        if self._process.is_alive():
            self._process.kill()
        self._process.join(EXIT_JOIN_S)
        _LIVE.discard(self)
        self._fail_all()


# --- the baby's side ---------------------------------------------------------------------------


def _issue(pg: Any, op: str, payload: tuple[Any, ...]) -> Any:
    from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions

    if op == "allreduce":
        tensors, reduce_op = payload
        reduce_opts = AllreduceOptions()
        reduce_opts.reduceOp = reduce_op
        return pg.allreduce(tensors, reduce_opts)
    if op == "allgather":
        outputs, inputs = payload
        return pg.allgather(outputs, inputs)
    if op == "broadcast":
        tensors, root = payload
        broadcast_opts = BroadcastOptions()
        broadcast_opts.rootRank = root
        return pg.broadcast(tensors, broadcast_opts)
    if op == "barrier":
        return pg.barrier()
    raise ValueError(f"unknown collective {op!r}")


def baby_main(
    conn: Connection, backend: str, store_addr: str, rank: int, world_size: int, timeout_s: float
) -> None:
    """Entry point of the baby process: build the group, then serve collectives until EOF."""
    import torch

    from ftd_client._c10d import create_store_client, new_gloo_group, new_nccl_group

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which kills us
    timeout = timedelta(seconds=timeout_s)
    try:
        store = create_store_client(store_addr, timeout)
        build = new_nccl_group if backend == "nccl" else new_gloo_group
        pg = build(store, rank, world_size, timeout)
    except Exception as e:
        conn.send(("failed", -1, _describe(e)))
        os._exit(1)
    conn.send(("ready", os.getpid()))

    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    works: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()

    def finish() -> None:
        while True:
            op_id, work = works.get()
            try:
                work.wait()
                if backend == "nccl":
                    torch.cuda.synchronize()
            except Exception as e:
                send(("failed", op_id, _describe(e)))
            else:
                send(("done", op_id))

    threading.Thread(target=finish, name="ftd-baby-waiter", daemon=True).start()
    while True:
        try:
            op_id, op, payload = conn.recv()
        except (EOFError, OSError):
            break
        try:
            works.put((op_id, _issue(pg, op, payload)))
        except Exception as e:
            send(("failed", op_id, _describe(e)))
    os._exit(0)  # threads may be stuck in the group; nothing here needs an orderly exit
