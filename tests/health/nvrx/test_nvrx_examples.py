"""NVIDIA's own fault-tolerance examples of nvidia-resiliency-ext 0.7.0, unmodified
(tests/third_party/nvrx_0_7_0_examples, from NVIDIA's repository), on 2 ranks of a live
`ftd serve` with NVRx 0.7.0's own rank client (its wheel: tests/health/nvrx/releases.py), each
under both start methods, configured as ft_launcher's users configure them (`--ft-cfg-path` and
the example's YAML): iterations of heartbeats or sections, the timeouts the client calculates
learned by the daemon, and, once per example, a rank stopped by the example's own
`--simulated_fault rank_hung` (a SIGSTOP) caught as a hang, the job restarted, resumed from the
example's checkpoint, and every rank finishing with 0.

The simulated fault fires a random 0-4 s after the example arms it (at the end of an epoch: the
heartbeats example arms it once its calculated timeouts are valid, after its second epoch; the
sections example after its first) and is cancelled once training ends, so the epoch after the
arming must outlast 4 s: each example's `train_samples` makes an epoch about 6-7 s here (2 CPU
cores, 3-4 ms an iteration); a slower machine only makes it longer. The restarted attempt resumes
in the last epoch, where the fault it arms again is cancelled before it can fire.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, Serve, ServeFactory
from tests.health.nvrx import releases

EXAMPLES = ROOT / "tests" / "third_party" / "nvrx_0_7_0_examples"
VERSION = "0.7.0"
FLAGS = ("--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-min_learned_timeout=5")
"""The timeouts the examples calculate are 5 times the longest stretch seen, some milliseconds
here, so ftd's floor holds them: at its default 1 s, a busy machine's slower checkpoint or data
loader start, later, is taken for a hang (an extra restart, in the docs' run by hand)."""
OUT_OF_SECTION = ("--ft-rank-out-of-section-timeout", "10")
"""The command line overrides the YAML's 30 s: a rank stopped between two sections (in the data
loader) is caught in 10 s. The longest legitimate stretch out of a section, the validation
loader's workers starting, takes under a second."""


@dataclass(frozen=True)
class Example:
    """One of NVIDIA's examples: its script, its YAML, the verdict a hang of its rank gets,
    and for a run with the simulated hang, the epochs it needs, the training samples of an
    epoch (of 2 ranks, batch 8) and its arguments."""

    script: str
    config: str
    verdict: str
    hang_epochs: int
    train_samples: int
    hang_args: tuple[str, ...]
    flags: tuple[str, ...] = ()


EXAMPLE = {
    "heartbeats": Example(
        "train_ddp_heartbeats_api.py",
        "fault_tol_cfg_heartbeats.yaml",
        verdict="sent no heartbeat within rank_heartbeat_timeout",
        hang_epochs=3,  # armed after epoch 1: epoch 2 is where it fires
        train_samples=40000,  # 2500 iterations, about 7 s
        # Checkpoints every 250 iterations: the restart resumes where the hang came, in the epoch.
        hang_args=("--save_interval", "250"),
    ),
    "sections": Example(
        "train_ddp_sections_api.py",
        "fault_tol_cfg_sections.yaml",
        verdict="stayed (in section '(step|checkpoint)'|out of any section) past",
        hang_epochs=2,  # armed after epoch 0
        train_samples=24000,  # 1500 iterations (two messages each), about 6 s
        hang_args=(),
        flags=OUT_OF_SECTION,
    ),
}
RUNS = {
    ("heartbeats", "zygote"): True,
    ("heartbeats", "spawn"): False,
    ("sections", "zygote"): False,
    ("sections", "spawn"): True,
}
"""Whether the run hangs a rank: once per example."""


@pytest.fixture(scope="module")
def client_env() -> dict[str, str]:
    """NVRx 0.7.0's own client first on the ranks' PYTHONPATH, or the tests skipped, saying why."""
    try:
        paths = releases.release_paths(VERSION)
    except releases.Unavailable as why:
        pytest.skip(f"nvidia-resiliency-ext {VERSION} unavailable: {why}")
    return {"PYTHONPATH": releases.python_path(paths)}


def example_args(example: Example, hang: bool, out: Path) -> tuple[str, ...]:
    args = ["--device", "cpu", "--hidden", "64", "--batch", "8", "--val_dataset_size", "160"]
    args += ["--logging_interval", "250", "--output_dir", str(out)]
    if hang:
        args += ["--epochs", str(example.hang_epochs)]
        args += ["--train_dataset_size", str(example.train_samples), *example.hang_args]
        args += ["--simulated_fault", "rank_hung,0"]
    else:
        args += ["--epochs", "2", "--train_dataset_size", "2000"]
    return tuple(args)


def last_attempt_exits(run: Serve, attempt: int) -> dict[int, tuple[str, int]]:
    return {
        e["global_rank"]: (e["state"], e["exit_code"])
        for e in run.event_data("rank_exited")
        if e["attempt"] == attempt
    }


def learned_timeouts(run: Serve) -> list[dict[str, Any]]:
    changes = run.event_data("timeouts_changed")
    return [e["timeouts"] for e in changes if "NVRx client" in e["by"] and e["learned"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "start_method"), sorted(RUNS))
async def test_nvidia_s_example_runs_unmodified_under_ftd_serve(
    serve: ServeFactory, client_env: dict[str, str], tmp_path: Path, name: str, start_method: str
) -> None:
    example, hang = EXAMPLE[name], RUNS[name, start_method]
    out = tmp_path / "example"
    flags = [*FLAGS, "--start-method", start_method, *example.flags]
    flags += ["--ft-cfg-path", str(EXAMPLES / example.config)]
    script_args = example_args(example, hang, out)
    script = EXAMPLES / example.script
    run = await serve(*flags, script=script, script_args=script_args, env=client_env)
    assert await run.wait(timeout=110) == 0, run.stderr.text[-4000:]

    last = 1 if hang else 0
    assert last_attempt_exits(run, last) == {0: ("succeeded", 0), 1: ("succeeded", 0)}
    assert not run.attempt_dir(last + 1).exists()
    # The example's own log (rank 0's, appended across attempts): every epoch trained and
    # validated, and its clean end.
    log = (out / "train_log.log").read_text()
    epochs = example.hang_epochs if hang else 2
    assert {int(e) for e in re.findall(r"CHECK VAL SUMMARY: epoch: +(\d+)", log)} == set(
        range(epochs)
    )
    assert log.count("CHECK TRAIN epoch:") >= epochs and "Leaving main, ret_code=0" in log

    learned = learned_timeouts(run)
    assert learned, "the client's calculated timeouts never reached the daemon"
    if name == "heartbeats":
        # Never below ftd's floor (FLAGS), whatever the client calculated.
        assert all(t["rank_heartbeat_timeout"] >= 5.0 for t in learned), learned
    else:  # `step` and `checkpoint` learned: the YAML's 10 and 30 s replaced
        sections = learned[-1]["rank_section_timeouts"]
        assert sections["step"] != 10.0 and sections["checkpoint"] != 30.0, learned
    assert_hang(run, example, hang)
    ipc: dict[str, Any] = run.status()["ipc"]  # type: ignore[assignment]
    assert not [cause for cause in ipc["dropped"] if cause.startswith("nvrx_")], ipc


def assert_hang(run: Serve, example: Example, hang: bool) -> None:
    hangs = run.event_data("rank_hung")
    stopped = re.findall(r"Simulating fault: rank_hung; rank to fail: (\d)", run.stderr.text)
    if not hang:
        assert not hangs and not stopped, hangs
        return
    assert stopped, (
        "the simulated fault never fired: the epoch after its arming ended within its 0-4 s "
        "delay (a faster machine: raise train_samples)"
    )
    [rank] = stopped
    [verdict] = hangs
    assert verdict["global_rank"] == int(rank), verdict
    assert re.search(example.verdict, verdict["reason"]), verdict
    [failed] = run.event_data("attempt_failed")
    assert failed["attempt"] == 0 and failed["failure"]["kind"] == "hang"
    assert "the rank was stopped (SIGSTOP/SIGTSTP)" in failed["failure"]["reason"]
