"""NVIDIA's own rank client of nvidia-resiliency-ext 0.5.0, 0.6.0 and 0.7.0, unmodified (each
from its wheel: tests/health/nvrx/releases.py), against a live `ftd serve` under both start
methods: init, 400 iterations of heartbeats and a "step" section (0.6 and later send them
without reading a reply: ftd must write none, or their socket fills), a hang caught and the job
restarted (once per release), timeouts learned, workload control, shutdown, every rank
finishing. 0.6's monitor rules ride along: no out-of-section time before the first step
(`--slow-start`), a "warmup" timeout for the warm-up steps of a client that reports iterations
(`--megatron`). And the new fields' attacks, on a live daemon (tests/bin/nvrx_field_attack.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import BIN, Serve, ServeFactory
from tests.health.nvrx import releases

RANK = BIN / "nvrx_release.py"
ATTACK = BIN / "nvrx_field_attack.py"
TIMEOUTS = (
    "--ft-param-rank_section_timeouts=step:2,finish:None",
    "--ft-param-rank_out_of_section_timeout=3",
)
"""`finish` (no timeout) covers the rank's end: process group, learning, requests. The time out
of any section is timed only where it is the test's subject (`slow_start`)."""


@dataclass(frozen=True)
class Run:
    """What one release runs under one start method."""

    hang: bool = False
    slow_start: bool = False
    warmup: bool = False


RUNS = {
    ("0.5.0", "zygote"): Run(hang=True),
    ("0.5.0", "spawn"): Run(),
    ("0.6.0", "zygote"): Run(slow_start=True),
    ("0.6.0", "spawn"): Run(hang=True),
    ("0.7.0", "zygote"): Run(hang=True, slow_start=True),
    ("0.7.0", "spawn"): Run(warmup=True),
}


@pytest.fixture(scope="session")
def release_paths() -> dict[str, list[Path] | str]:
    """Every release's PYTHONPATH entries, or why it cannot be had: fetched once per session
    (and cached across sessions: releases.py)."""
    found: dict[str, list[Path] | str] = {}
    for version in releases.RELEASES:
        try:
            found[version] = releases.release_paths(version)
        except releases.Unavailable as why:
            found[version] = str(why)
    return found


def release_env(release_paths: dict[str, list[Path] | str], version: str) -> dict[str, str]:
    paths = release_paths[version]
    if isinstance(paths, str):
        pytest.skip(f"nvidia-resiliency-ext {version} unavailable: {paths}")
    return {"PYTHONPATH": releases.python_path(paths)}


def nvrx_drops(run: Serve) -> dict[str, int]:
    dropped = run.status()["ipc"]["dropped"]  # type: ignore[index]
    return {k: v for k, v in dropped.items() if k.startswith("nvrx_")}  # type: ignore[union-attr]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("version", "start_method"), sorted(RUNS))
async def test_each_release_runs_unmodified_under_ftd_serve(
    serve: ServeFactory,
    release_paths: dict[str, list[Path] | str],
    version: str,
    start_method: str,
) -> None:
    plan = RUNS[version, start_method]
    env = release_env(release_paths, version)
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--start-method", start_method]
    sections = "step:2,warmup:30,finish:None" if plan.warmup else "step:2,finish:None"
    flags += [f"--ft-param-rank_section_timeouts={sections}"]
    script_args = ["--last-attempt", "1" if plan.hang else "0"]
    if plan.hang:
        script_args += ["--hang-rank", "1", "--hang-at", "50"]
    if plan.slow_start:  # more than the 3 s out of any section, before the first step
        flags.append(TIMEOUTS[1])
        script_args += ["--slow-start", "3.5"]
    if plan.warmup:  # more than step's 2 s, in a warm-up step: timed by warmup's 30 s
        script_args += ["--megatron", "--slow-step", "2.5"]
    run = await serve(*flags, script=RANK, script_args=tuple(script_args), env=env)
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]

    last = 1 if plan.hang else 0
    out = run.stdout.text
    started = re.findall(r"rank (\d) attempt (\d) release (\S+) from (\S+) (.*)", out)
    assert {(rank, attempt) for rank, attempt, *_ in started} == {
        (str(rank), str(attempt)) for rank in (0, 1) for attempt in range(last + 1)
    }
    for _, _, release, path, config in started:
        assert release == version and path.startswith(str(releases.CACHE / version))
        # 0.5's requests and replies are 0.4's (indistinguishable); 0.6 and later's are not.
        skips = version != "0.5.0"
        assert config == f"skip_section_response={skips} install_exception_hook=False"
    for rank in (0, 1):
        assert f"rank {rank} attempt {last} done" in out
    hangs = run.event_data("rank_hung")
    if plan.hang:  # caught in its step, and the job restarted
        [hang] = hangs
        assert hang["global_rank"] == 1 and hang["section"] == "step"
        assert "rank 1 hanging in step 50" in out and run.attempt_dir(1).exists()
    else:
        assert not hangs, hangs
        assert not run.attempt_dir(1).exists()
    learned = [e for e in run.event_data("timeouts_changed") if "NVRx client" in e["by"]]
    assert learned and all(e["learned"] for e in learned)
    assert learned[-1]["timeouts"]["rank_section_timeouts"]["finish"] is None
    requests = [(e["action"], e["rank"]) for e in run.event_data("workload_control")]
    assert requests.count(("CONTINUE", 0)) == requests.count(("CONTINUE", 1)) == 1
    assert requests.count(("SHUTDOWN_WORKLOAD", 0)) == 1
    assert "NVRx socket: dropped" not in run.stderr.text
    assert nvrx_drops(run) == {}


@pytest.mark.timeout(60)
async def test_the_new_fields_attacks_are_refused_on_a_live_daemon(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await serve("--nproc-per-node", "1", *TIMEOUTS, script=ATTACK)
    assert await run.wait(timeout=50) == 0, run.stderr.text[-3000:]
    out = run.stdout.text
    attacks = re.findall(r"attack (.+): reply (\d+) bytes", out)
    assert len(attacks) >= 7 and all(reply == "0" for _, reply in attacks), attacks
    # A 0.6 client's exchange, with two fields of a release to come: answered where the
    # client reads, nothing written back to 300 heartbeats and sections.
    assert "init: skip_section_response=True" in out
    assert "after 300 heartbeats and sections: the update's reply, then nothing" in out
    drops = nvrx_drops(run)
    assert drops == {"nvrx_bad_state": 2, "nvrx_bad_field": 5, "nvrx_shared": 1}, drops
    assert "sends fields ftd does not know (ignored): InitMsg ['from_a_later', 'release']" in (
        run.stderr.text
    )
