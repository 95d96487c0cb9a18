"""Progress observed inside a rank without changing the script (ftd_client/progress.py): real
torch in this process (a tiny model, SGD, DDP on a one-rank gloo group), a fake clock for the
sampler's decisions, a subprocess where torch must stay unimported."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ftd_client import progress, protocol, wire
from ftd_client._progress_torch import LEARN_CALLS, LEARN_STEPS
from ftd_client.messages import ProgressReport
from ftd_client.progress import Observer, Progress
from ftd_client.progress_link import ProgressLink, install_from_env
from ftd_client.protocol import ProtocolError

from tests.conftest import ROOT
from tests.support.wire import fields, read


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def train(model: torch.nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = torch.nn.MSELoss()
    for _ in range(steps):
        optimizer.zero_grad()
        loss(model(torch.randn(4, 8)), torch.randn(4, 2)).backward()
        optimizer.step()


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_optimizer_steps_and_forward_time_are_seen(observer: Observer) -> None:
    train(mlp(), LEARN_STEPS + 5)
    record = observer.sample()
    assert record.steps == LEARN_STEPS + 5
    assert record.last_step_age_s is not None and record.last_step_age_s >= 0
    assert record.forward_median_s is not None and record.forward_median_s > 0
    # Learned, then moved off the global hooks onto the outermost classes (the model, the loss).
    assert not observer.counters.learning
    assert set(observer.counters.roots) == {torch.nn.Sequential, torch.nn.MSELoss}
    assert ours(torch.nn.Sequential.forward)
    assert not ours(torch.nn.MSELoss.forward)  # no parameters: not worth timing
    assert len(observer.counters.forward_window) == LEARN_STEPS + 5


def test_only_the_outermost_call_is_timed(observer: Observer) -> None:
    outer = torch.nn.Sequential(mlp(), torch.nn.ReLU())  # Sequential inside Sequential
    train(outer, LEARN_STEPS + 1)
    calls: list[int] = []
    original = torch.nn.Sequential.forward

    def spy(module: torch.nn.Module, x: torch.Tensor) -> Any:
        calls.append(observer.counters.depth)
        return original(module, x)

    torch.nn.Sequential.forward = spy  # type: ignore[method-assign]
    try:
        outer(torch.randn(1, 8))
    finally:
        torch.nn.Sequential.forward = original  # type: ignore[method-assign]
    assert calls == [0, 1]  # the inner one passed through, untimed
    assert observer.counters.depth == 0
    assert observer.counters.forward_ns > 0


def test_collectives_entered_include_ddp_s_own(observer: Observer, world: None) -> None:
    before = observer.sample().collectives_entered
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    train(model, 4)
    dist.all_reduce(torch.ones(1))
    record = observer.sample()
    assert before is not None and record.collectives_entered is not None
    # One Python call; DDP's construction and its reducer's allreduce per step (from C++).
    assert (record.collectives_called, record.collectives_returned) == (1, 1)
    assert record.collectives_entered - before >= 4 + 1 + 1
    assert torch.nn.parallel.DistributedDataParallel in observer.counters.roots


def test_a_collective_that_raises_still_returns(observer: Observer, world: None) -> None:
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        dist.all_reduce("not a tensor")  # type: ignore[arg-type]
    record = observer.sample()
    assert (record.collectives_called, record.collectives_returned) == (1, 1)
    assert dist.all_reduce.__name__ == "all_reduce"


def test_no_group_no_entered_count(observer: Observer) -> None:
    assert observer.sample().collectives_entered is None


class Spying(io.BytesIO):
    """A file that samples the observer while torch.save writes into it."""

    def __init__(self, observer: Observer) -> None:
        super().__init__()
        self.observer = observer
        self.seen: list[tuple[str, ...]] = []

    def write(self, data: Any) -> int:
        self.seen.append(tuple(name for name, _ in self.observer.sample().auto_sections))
        return super().write(data)


def test_torch_save_is_an_automatic_section(observer: Observer) -> None:
    target = Spying(observer)
    torch.save({"w": torch.ones(3)}, target)
    assert target.seen and all(seen == ("auto:torch.save",) for seen in target.seen)
    assert observer.sample().auto_sections == ()


def test_dataloader_iterator_creation_is_an_automatic_section(observer: Observer) -> None:
    seen: list[tuple[str, ...]] = []

    class Batches(torch.utils.data.Sampler[list[int]]):
        """Asked for its iterator when the DataLoader's iterator is created."""

        def __iter__(self) -> Iterator[list[int]]:
            seen.append(tuple(name for name, _ in observer.sample().auto_sections))
            return iter([[0, 1], [2, 3]])

        def __len__(self) -> int:
            return 2

    loader = torch.utils.data.DataLoader(list(range(4)), batch_sampler=Batches())
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    assert seen == [("auto:DataLoader.iter",)]
    assert observer.sample().auto_sections == ()


def test_an_epochs_first_and_last_batch_are_an_automatic_section(observer: Observer) -> None:
    """Where a DataLoader's workers start (the first batch) and stop (the call that ends the
    epoch); the batches between are no section."""
    seen: list[tuple[str, ...]] = []

    class Items(torch.utils.data.Dataset[int]):
        def __getitem__(self, index: int) -> int:
            seen.append(tuple(name for name, _ in observer.sample().auto_sections))
            return index

        def __len__(self) -> int:
            return 3

    assert [int(b) for b in torch.utils.data.DataLoader(Items(), batch_size=1)] == [0, 1, 2]
    assert seen == [("auto:DataLoader.epoch",), (), ()]
    assert observer.sample().auto_sections == ()


def ours(function: Any) -> bool:
    """Wrapped by ftd_client (torch's own decorators wrap some of these functions too)."""
    return bool(function.__code__.co_filename.endswith("_progress_torch.py"))


def test_checkpoint_functions_are_wrapped_and_restored() -> None:
    import torch.distributed.checkpoint as dcp

    originals = (dcp.save, dcp.load, dcp.async_save, dist.all_reduce)
    progress.install(lambda record: None, start=False)
    try:
        assert all(ours(f) for f in (dcp.save, dcp.load, dcp.async_save, torch.save))
        assert ours(dist.all_reduce) and ours(torch.utils.data.DataLoader.__iter__)
    finally:
        progress.uninstall()
    assert (dcp.save, dcp.load, dcp.async_save, dist.all_reduce) == originals
    assert not ours(torch.save) and not ours(torch.utils.data.DataLoader.__iter__)


def test_torch_is_left_alone_until_the_script_imports_it() -> None:
    script = """
import sys
from ftd_client import progress
records = []
observer = progress.install(records.append, start=False)
observer.tick()
assert "torch" not in sys.modules, "install imported torch"
assert records[0].steps == 0 and records[0].collectives_entered is None
import torch
ours = lambda f: f.__code__.co_filename.endswith("_progress_torch.py")
assert ours(torch.save), "torch was not hooked after its import"
import torch.distributed.checkpoint as dcp
assert ours(dcp.save), "dcp was not hooked after its import"
assert not any(type(f).__name__ == "_Watcher" for f in sys.meta_path), "watcher left behind"
print("ok")
"""
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'client'}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * 1e9)


def test_the_sampler_sends_on_change_and_as_a_keepalive() -> None:
    sent: list[Progress] = []
    clock = Clock()
    observer = Observer(sent.append, interval_s=0.5, keepalive_s=5.0, clock_ns=clock)
    assert observer.tick() is not None  # the first sample
    for _ in range(9):
        clock.advance(0.5)
        assert observer.tick() is None  # nothing moved
    clock.advance(0.5)  # 5 s since the last send
    assert observer.tick() is not None
    clock.advance(0.5)
    observer.counters.steps += 1
    observer.counters.last_step_ns = clock.ns
    record = observer.tick()
    assert record is not None and record.steps == 1 and record.last_step_age_s == 0
    clock.advance(0.5)
    observer.counters.called += 1  # entered a collective: that is news too
    assert observer.tick() is not None
    clock.advance(0.5)
    observer.counters.auto.append(("auto:torch.save", clock.ns))
    opened = observer.tick()
    assert opened is not None and opened.auto_sections == (("auto:torch.save", 0.0),)
    clock.advance(0.5)
    assert observer.tick() is None  # still open: only its age changed
    assert len(sent) == observer.sent == 5


def test_a_send_that_raises_is_contained() -> None:
    attempts = threading.Semaphore(0)

    def send(record: Progress) -> None:
        attempts.release()
        raise OSError("the daemon went away")

    clock = Clock()
    observer = Observer(send, keepalive_s=0.05, clock_ns=clock)
    assert observer.tick() is None
    assert observer.failures == 1
    observer.keepalive_s = observer.interval_s = 0.05
    observer.start()
    try:
        for _ in range(3):  # the thread goes on after each failure
            clock.advance(1)
            assert attempts.acquire(timeout=30)
    finally:
        observer.stop()
    assert observer.failures >= 3 and observer.sent == 0


def test_install_is_once_per_process() -> None:
    first = progress.install(lambda record: None, start=False)
    try:
        assert progress.install(lambda record: None) is first
        assert first._thread is None
    finally:
        progress.uninstall()


def test_the_record_on_the_wire_is_what_the_decoder_accepts() -> None:
    record = Progress(
        sampled_ns=123,
        steps=7,
        last_step_age_s=0.25,
        collectives_entered=40,
        collectives_called=3,
        collectives_returned=2,
        forward_median_s=0.0123,
        auto_sections=(("auto:torch.save", 1.5),),
    )
    envelope = wire.decode(wire.encode(record.message(), seq=1, sent_ns=record.sampled_ns))
    assert fields(envelope) == {
        "v": 1, "t": "pg", "m": 123, "s": 1, "steps": 7, "age_ms": 250, "entered": 40,
        "called": 3, "returned": 2, "fwd_us": 12300, "auto": {"auto:torch.save": 1500},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "cause"),
    [
        ({"steps": -1}, "bad_progress"),
        ({"entered": 2**60}, "bad_progress"),
        ({"fwd_us": 1.5}, "bad_progress"),
        ({"called": True}, "bad_progress"),
        ({"auto": ["auto:torch.save"]}, "bad_progress"),
        ({"auto": {"": 1}}, "bad_section_name"),
        ({"auto": {"x" * 129: 1}}, "bad_section_name"),
        ({"auto": {"auto:torch.save": "1"}}, "bad_progress"),
        ({"auto": {f"s{i}": 1 for i in range(protocol.MAX_OPEN_SECTIONS + 1)}}, "bad_progress"),
    ],
)
def test_bad_progress_fields_are_refused(fields: dict[str, Any], cause: str) -> None:
    counts = {"steps": 0, "called": 0, "returned": 0}
    with pytest.raises(ProtocolError) as refused:
        read({"t": protocol.PROGRESS, **counts, **fields})
    assert refused.value.cause == cause


@pytest.mark.parametrize("missing", sorted(ProgressReport.REQUIRED))
def test_a_progress_report_without_its_counts_is_refused_at_the_door(missing: str) -> None:
    """Issue 39 row 10: `{"v":1,"t":"pg"}` passed the decoder and raised KeyError in the
    daemon's progress watch; the decoder now refuses what its consumer cannot use."""
    counts = {"steps": 0, "called": 0, "returned": 0}
    del counts[missing]
    for message in ({"t": protocol.PROGRESS}, {"t": protocol.PROGRESS, **counts}):
        with pytest.raises(ProtocolError) as refused:
            read(message)
        assert refused.value.cause == "bad_progress"


def test_the_link_sends_records_the_daemon_can_decode(tmp_path: Path) -> None:
    path = str(tmp_path / "rank.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    link = ProgressLink(path)
    record = Observer(lambda record: None).sample()
    try:
        link(record)
        daemon_side, _ = listener.accept()
        with daemon_side:
            daemon_side.settimeout(30)
            envelope = wire.decode(daemon_side.recv(protocol.MAX_MESSAGE_BYTES))
        assert isinstance(envelope.message, ProgressReport) and envelope.message.steps == 0
        assert envelope.seq is None and envelope.open is None  # no sequence, no section state
    finally:
        link.close()
        listener.close()
    assert link.dropped == 0


def test_a_link_to_no_daemon_drops(tmp_path: Path) -> None:
    link = ProgressLink(str(tmp_path / "nobody.sock"))
    link(Observer(lambda record: None).sample())
    assert link.dropped == 1


def test_progress_is_off_unless_asked_for() -> None:
    assert install_from_env({"FTD_SOCKET": "/nonexistent"}) is None
    assert install_from_env({"FTD_PROGRESS": "1"}) is None  # not under ftd serve


def test_evaluation_is_not_forward_time(observer: Observer) -> None:
    model = mlp()
    train(model, LEARN_STEPS)
    observer.counters.forward_ns = 0
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert observer.counters.forward_ns == 0
    model(torch.randn(4, 8))
    assert observer.counters.forward_ns > 0


def test_the_sampler_reports_while_the_main_thread_runs_python() -> None:
    reported = threading.Semaphore(0)
    observer = Observer(lambda record: reported.release(), interval_s=0.05, keepalive_s=0.05)
    observer.start()
    try:
        counted = 0
        while counted < 3:  # a busy Python loop that never waits, never sleeps
            counted += reported.acquire(blocking=False)
    finally:
        observer.stop()


def test_inference_alone_moves_off_the_global_hooks(observer: Observer) -> None:
    model = mlp()
    with torch.no_grad():
        for _ in range(LEARN_CALLS + 1):
            model(torch.randn(1, 8))
    assert not observer.counters.learning and observer.counters.depth == 0
    assert ours(torch.nn.Sequential.forward)
    assert not torch.nn.modules.module._global_forward_hooks  # every module call is fast again
