"""What ftd's rank start installs in a rank before its script runs (the zygote's rank_main,
the spawn start method's script_boot), each part on its own: progress observation
(FTD_PROGRESS=1, progress_link.py) and NVRx's in-process restart as ftd's
(FTD_RESTART_MODE=inprocess, inprocess/nvrx_alias.py). A part that fails is one stderr line;
the script runs all the same."""

from __future__ import annotations

import os
from collections.abc import Mapping

WANTED = (("FTD_PROGRESS", "1"), ("FTD_RESTART_MODE", "inprocess"))
"""A rank start installs anything only where one of these is set so."""


def wanted(environ: Mapping[str, str]) -> bool:
    return any(environ.get(name) == value for name, value in WANTED)


def install_from_env() -> None:
    if os.environ.get("FTD_PROGRESS") == "1":
        try:
            from ftd_client import progress_link

            progress_link.install_from_env()
        except Exception as error:
            os.write(2, f"ftd: progress is not observed in this rank: {error!r}\n".encode())
    if os.environ.get("FTD_RESTART_MODE") == "inprocess":  # its package costs 60 ms to import
        try:
            from ftd_client.inprocess import nvrx_alias

            nvrx_alias.install_from_env()
        except Exception as error:
            os.write(2, f"ftd: NVRx's in-process restart is not ftd's here: {error!r}\n".encode())
