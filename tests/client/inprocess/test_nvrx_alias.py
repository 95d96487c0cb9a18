"""`nvidia_resiliency_ext.inprocess` as ftd's in-process restart (client/ftd_client/inprocess/
nvrx_alias.py), in a fresh interpreter each: what a script written for NVRx gets, and the
refusal that names what ftd has no counterpart for."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nvidia_resiliency_ext") is None, reason="needs nvidia-resiliency-ext"
)

PROBE = """
from ftd_client import rank_start
rank_start.install_from_env()
import sys
from nvidia_resiliency_ext import inprocess
import nvidia_resiliency_ext.inprocess.rank_assignment as assignment
import ftd_client.inprocess as ftd
print("same", inprocess.Wrapper is ftd.Wrapper, assignment is ftd.rank_assignment)
print("abort", inprocess.abort.AbortTorchDistributed.__module__)
try:
    inprocess.nested_restarter
except AttributeError as error:
    print("attribute", error)
try:
    import nvidia_resiliency_ext.inprocess.monitor_process
except ImportError as error:
    print("import", error)
print("torch", "torch" in sys.modules)
"""


def probe(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FTD_")}
    return subprocess.run(
        [sys.executable, "-c", PROBE], env={**environ, **env}, capture_output=True, text=True
    )


def test_an_nvrx_script_gets_ftds_modules_and_a_refusal_for_the_rest() -> None:
    proc = probe(FTD_RESTART_MODE="inprocess")
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["same"] == "True True"
    assert lines["abort"] == "ftd_client.inprocess.abort"
    for kind, module in (("attribute", "nested_restarter"), ("import", "monitor_process")):
        assert lines[kind].startswith(f"nvidia_resiliency_ext.inprocess.{module}: ftd's in-proc")
        assert "FTD_NVRX_INPROCESS=nvrx" in lines[kind]
    assert lines["torch"] == "False"  # nothing imports torch before the script's Wrapper runs
    assert proc.stderr.count("is ftd's in-process restart (ftd_client.inprocess)") == 1


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"FTD_RESTART_MODE": "process"},
        {"FTD_RESTART_MODE": "inprocess", "FTD_NVRX_INPROCESS": "nvrx"},
    ],
)
def test_nvrx_stays_nvrx_elsewhere(env: dict[str, str]) -> None:
    proc = probe(**env)
    assert "same False False" in proc.stdout, proc.stderr[-2000:]
    assert "ftd_client.inprocess" not in proc.stderr
