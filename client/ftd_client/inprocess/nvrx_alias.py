"""NVRx's in-process restart, unmodified, gets ftd's: `nvidia_resiliency_ext.inprocess` as
ftd_client.inprocess.

Under `ftd serve --restart-mode inprocess` a rank's start (`install_from_env`) puts a finder
first on `sys.meta_path`: the script's `from nvidia_resiliency_ext import inprocess` (and
`import nvidia_resiliency_ext.inprocess.<sub>` for each submodule ftd_client.inprocess has
too: abort, compose, exception, finalize, health_check, initialize, rank_assignment, state,
wrap) then gets ftd's modules, whose Wrapper takes NVRx's arguments. NVRx's own Wrapper would
restart too, but through its own store and timeouts, blind to the daemon (10 s where ftd's
takes 0.2).

What has no counterpart cannot be faked: NVRx's own monitor process, nested restarter,
completion and termination modules, its fault-injection tools. The script is told at once, not
left to restart silently without the daemon: importing one, or reading one from the package,
raises ImportError / AttributeError naming it and the way out (`FTD_NVRX_INPROCESS=nvrx`
keeps NVRx's own in-process restart for the whole script). One stderr line says when the alias
is used. Standard library only until the script imports the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

NVRX = "nvidia_resiliency_ext.inprocess"
FTD = "ftd_client.inprocess"
OPT_OUT_ENV = "FTD_NVRX_INPROCESS"
"""`nvrx`: NVRx's in-process restart stays NVRx's own."""
SHARED = frozenset(
    {
        "abort",
        "compose",
        "exception",
        "finalize",
        "health_check",
        "initialize",
        "rank_assignment",
        "state",
        "wrap",
    }
)
WAY_OUT = (
    f"ftd's in-process restart (ftd serve --restart-mode inprocess) stands in for {NVRX} "
    f"and has no counterpart for it; import ftd_client.inprocess instead, or set "
    f"{OPT_OUT_ENV}=nvrx to keep NVRx's own in-process restart (without the daemon's help)"
)


class NvrxAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `nvidia_resiliency_ext.inprocess[.<sub>]` as ftd_client.inprocess's modules."""

    def __init__(self) -> None:
        self.announced = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != NVRX and not fullname.startswith(NVRX + "."):
            return None
        sub = fullname[len(NVRX) + 1 :]
        if sub and sub.split(".")[0] not in SHARED:
            raise ImportError(f"{fullname}: {WAY_OUT}", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=not sub)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        target = importlib.import_module(FTD + name[len(NVRX) :])
        if name == NVRX:
            target = _package(target)
            if not self.announced:
                self.announced = True
                print(f"ftd: {NVRX} is ftd's in-process restart ({FTD})", file=sys.stderr)
        # importlib takes what the loader left under the name: the script gets ftd's module.
        sys.modules[name] = target


def _package(ftd: types.ModuleType) -> types.ModuleType:
    """NVRx's package: ftd's names, and a clear refusal for NVRx's own."""
    package = types.ModuleType(NVRX, ftd.__doc__)
    package.__dict__.update({k: v for k, v in vars(ftd).items() if not k.startswith("__")})
    package.__path__ = []  # a package: its submodules come through the finder
    package.__package__ = NVRX

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{NVRX}.{name}: {WAY_OUT}")

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    return package


def install_from_env(environ: Mapping[str, str] = os.environ) -> NvrxAliasFinder | None:
    """The alias, in a rank of `ftd serve --restart-mode inprocess` (unless opted out)."""
    if environ.get("FTD_RESTART_MODE") != "inprocess" or environ.get(OPT_OUT_ENV) == "nvrx":
        return None
    for name in [n for n in sys.modules if n == NVRX or n.startswith(NVRX + ".")]:
        del sys.modules[name]  # preloaded by a zygote: this rank gets ftd's instead
    finder = NvrxAliasFinder()
    sys.meta_path.insert(0, finder)
    return finder
