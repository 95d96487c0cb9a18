"""NVIDIA's nvidia-resiliency-ext releases 0.5 to 0.7, as their ranks would import them: each
wheel fetched once with pip (hash-checked) into a cache that outlives the test session, its
pure-Python package unpacked beside its metadata, and put first on the ranks' PYTHONPATH.

Those releases ship only CPython 3.12+ manylinux_2_39 wheels; their fault_tolerance package is
pure Python and runs on 3.11. Nothing of theirs is changed: the compiled CUPTI module is left
in the wheel (fault_tolerance never imports it), and where this Python has no httpx, an empty
module stands in for it (0.6 and later import it at package import, in shared_utils.health_check,
for an attribution service the rank client never calls).

The cache is FTD_TEST_CACHE or ~/.cache/ftd-tests, `nvrx/<version>/`; pytest-xdist's workers
share it under an flock. Where the index cannot be reached (or no pip is found), that is
remembered for ten minutes and the tests that need a release are skipped with the reason.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RELEASES = {
    "0.5.0": "eb720cd25feabef07f971d4051c7bcac2f9ec73642a9031953d2663307950cb9",
    "0.6.0": "7d5ac6567841aef0173af3bcc0c2044971d2b225918028b99af6e4eb7e6e2f5d",
    "0.7.0": "e0c646ccae211de81a4c2b5bb5cff96a5e12af1373fb0eb818a40716eef685ad",
}
"""Each release's cp312 manylinux_2_39_x86_64 wheel, by its sha256 on PyPI."""
CACHE = Path(os.environ.get("FTD_TEST_CACHE", Path.home() / ".cache" / "ftd-tests")) / "nvrx"
UNREACHABLE_FOR_S = 600.0
PIP_TIMEOUT_S = 180.0
HTTPX_STUB = (
    '"""Stands in for httpx: NVRx imports it at package import, its rank client never."""\n'
)


class Unavailable(Exception):
    """Why a release cannot be had here (the tests that need it are skipped with it)."""


@contextmanager
def _locked() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pip() -> list[str]:
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    # The project's venv has no pip of its own (Makefile); any pip downloads for any platform.
    for name in ("pip3", "pip"):
        if (found := shutil.which(name)) is not None:
            return [found]
    raise Unavailable("no pip to download nvidia-resiliency-ext's wheels with")


def _download(version: str, into: Path) -> Path:
    requirement = into / "requirement.txt"
    requirement.write_text(f"nvidia-resiliency-ext=={version} --hash=sha256:{RELEASES[version]}\n")
    command = [
        *_pip(),
        "download",
        "--disable-pip-version-check",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_39_x86_64",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--require-hashes",
        "--retries",
        "1",
        "--timeout",
        "20",
        "-r",
        str(requirement),
        "-d",
        str(into),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"pip download of nvidia-resiliency-ext {version} timed out") from None
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"pip could not download nvidia-resiliency-ext {version}: {tail[0]}")
    return wheels[0]


def _unpack(wheel: Path, into: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            parts = Path(member).parts
            if member.startswith("/") or ".." in parts or member.endswith(".so"):
                continue
            if parts[0] == "nvidia_resiliency_ext" or parts[0].endswith(".dist-info"):
                archive.extract(member, into)


def _fetch(version: str) -> Path:
    home = CACHE / version
    if (home / "READY").exists():
        return home
    unreachable = CACHE / "unreachable"
    if unreachable.exists() and time.time() - unreachable.stat().st_mtime < UNREACHABLE_FOR_S:
        raise Unavailable(f"a try in the last 10 minutes failed: {unreachable.read_text().strip()}")
    shutil.rmtree(home, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        try:
            wheel = _download(version, Path(scratch))
        except Unavailable as why:
            unreachable.write_text(f"{why}\n")
            raise
        _unpack(wheel, Path(scratch) / "site")
        (Path(scratch) / "site").rename(home)
    (home / "READY").write_text(f"{RELEASES[version]}\n")
    return home


def _stubs() -> Path | None:
    if importlib.util.find_spec("httpx") is not None:
        return None
    stubs = CACHE / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    (stubs / "httpx.py").write_text(HTTPX_STUB)
    return stubs


def release_paths(version: str) -> list[Path]:
    """What goes first on a rank's PYTHONPATH for `version`; Unavailable if it cannot be had."""
    with _locked():
        home = _fetch(version)
        stubs = _stubs()
    return [home] if stubs is None else [home, stubs]


def python_path(paths: list[Path]) -> str:
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*map(str, paths), *([inherited] if inherited else [])])
