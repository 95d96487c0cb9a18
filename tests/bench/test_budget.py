"""The performance budget (bench/budget.py, `make bench-check`) fails when a ratio is past its
budget: its judgement on injected samples, the command's exit status on a recorded run, and a
live `ftd serve` slowed down through FTD_INTERNAL_DELAY (ftd/containment.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import budget

BUDGET = ROOT / "bench" / "budget.py"


def samples_at(share: float, **broken: float) -> dict[str, dict[str, list[float]]]:
    """Samples whose ftd/peer ratio is `share` of each budget's limit (`broken[key]` for key)."""
    return {
        b.key: {
            "ftd": [100.0 * b.limit * broken.get(b.key, share) * k for k in (0.9, 1.0, 1.1)],
            "peer": [90.0, 100.0, 130.0],
        }
        for b in budget.BUDGETS
    }


def test_ratios_within_their_budgets_pass() -> None:
    verdicts = budget.judge(samples_at(0.5))
    assert all(v.passed for v in verdicts)
    assert [round(v.ratio / v.budget.limit, 6) for v in verdicts] == [0.5] * len(verdicts)


def test_each_broken_budget_fails_alone() -> None:
    for b in budget.BUDGETS:
        verdicts = budget.judge(samples_at(0.5, **{b.key: 1.2}))
        assert [v.budget.key for v in verdicts if not v.passed] == [b.key]


def test_a_missing_figure_or_a_zero_peer_fails() -> None:
    samples = samples_at(0.5)
    del samples["restart"]
    samples["pss"]["peer"] = [0.0, 0.0, 0.0]
    samples["spawn"]["ftd"] = []
    failed = {v.budget.key for v in budget.judge(samples) if not v.passed}
    assert failed == {"restart", "pss", "spawn"}


@given(
    peer=st.lists(st.floats(1e-3, 1e4), min_size=1, max_size=9),
    ftd=st.lists(st.floats(1e-3, 1e4), min_size=1, max_size=9),
    slower=st.floats(1.0, 100.0),
)
def test_a_slower_ftd_never_turns_a_failure_into_a_pass(
    peer: list[float], ftd: list[float], slower: float
) -> None:
    before = budget.judge({b.key: {"ftd": ftd, "peer": peer} for b in budget.BUDGETS})
    after = budget.judge(
        {b.key: {"ftd": [x * slower for x in ftd], "peer": peer} for b in budget.BUDGETS}
    )
    for was, now in zip(before, after, strict=True):
        assert now.ratio >= was.ratio
        assert was.passed or not now.passed


def judge_recorded(tmp_path: Path, samples: dict[str, dict[str, list[float]]]) -> tuple[int, str]:
    recorded = tmp_path / "run.json"
    recorded.write_text(json.dumps({"samples": samples}))
    verdicts = tmp_path / "verdicts.json"
    done = subprocess.run(
        [sys.executable, str(BUDGET), "--measurements", str(recorded), "--json", str(verdicts)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert json.loads(verdicts.read_text())["verdicts"].keys() == {b.key for b in budget.BUDGETS}
    return done.returncode, done.stdout


def test_the_command_exits_1_when_a_budget_is_broken(tmp_path: Path) -> None:
    code, out = judge_recorded(tmp_path, samples_at(0.5))
    assert code == 0, out
    assert "FAIL" not in out

    code, out = judge_recorded(tmp_path, samples_at(0.5, restart=3.0, idle_cpu=1.01))
    assert code == 1, out
    assert out.count("FAIL") == 2
    assert "budget broken: restart, idle_cpu" in out


TORCHRUN_MS = {"restart": [2615.0], "spawn": [304.0], "startup": [3528.0]}
"""torchrun's medians in the recorded run of bench/BENCHMARKS.md ("Performance budget"): a
torchrun run would double this test's time, and a delay of seconds needs no fresh peer."""


def test_a_daemon_slow_to_react_to_a_crash_breaks_the_restart_budgets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The supervisor's "attempt" boundary runs once the attempt's first outcome (the crash) is in.
    monkeypatch.setenv("FTD_INTERNAL_DELAY", "attempt:1500")
    figures = budget.restart_run("ftd")
    assert figures["spawn"] >= 1500 and figures["restart"] >= 1500, figures
    assert figures["ftd_exit_seen"] < 1500 <= figures["ftd_attempt_started"], figures
    samples = {key: {"ftd": [figures[key]], "peer": peer} for key, peer in TORCHRUN_MS.items()}
    failed = {v.budget.key for v in budget.judge(samples) if not v.passed}
    assert {"restart", "spawn"} <= failed
