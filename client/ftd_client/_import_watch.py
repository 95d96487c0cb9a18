"""Run a function right after a module is first imported, without importing it.

Progress observation must not import torch into a script that never does (torch costs seconds
and hundreds of MiB), yet must be in place before the script's first `torch.save` or
optimizer step. A finder at the front of `sys.meta_path` answers only for the watched names:
it asks the other finders for the real spec and wraps that one loader instance's
`exec_module`, so the callback runs once the module has executed completely (never on a
half-initialised module, and not at all when its import fails). Every other import costs one
set lookup. The wrapper is removed from the loader after the call, and the finder from
`sys.meta_path` once nothing is left to watch. This is the idea of wrapt's post-import hooks
(PEP 369, withdrawn), in 60 lines: polling `sys.modules` from a thread would see modules in the
middle of their import.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

log = logging.getLogger("ftd_client")

Callback = Callable[[ModuleType], None]


class _Watcher:
    """The finder: watched name -> callbacks; `find_spec` defers to the other finders."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.callbacks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            spec = _find_elsewhere(self, fullname, path, target)
        finally:
            self._busy.name = None
        loader: Any = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                original(module)
            finally:
                loader.__dict__.pop("exec_module", None)
            self.fire(fullname, module)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader with slots: let it import unwatched
            return spec
        return spec

    def fire(self, name: str, module: ModuleType) -> None:
        for callback in self.callbacks.pop(name, []):
            try:
                callback(module)
            except Exception:  # observation must never break the script's import
                log.debug("ftd: progress hook for %s failed", name, exc_info=True)
        if not self.callbacks:
            _remove(self)


def _find_elsewhere(
    watcher: _Watcher, name: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if finder is watcher or find is None:
            continue
        spec: ModuleSpec | None = find(name, path, target)
        if spec is not None:
            return spec
    return None


_watcher: _Watcher | None = None
_lock = threading.Lock()


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once `name` has been imported: now if it already is, else right
    after its import completes (in the importing thread). A callback's error is logged at
    debug level and swallowed."""
    global _watcher
    module = sys.modules.get(name)
    if module is not None:
        try:
            callback(module)
        except Exception:
            log.debug("ftd: progress hook for %s failed", name, exc_info=True)
        return
    with _lock:
        if _watcher is None:
            _watcher = _Watcher()
        _watcher.callbacks.setdefault(name, []).append(callback)
        if _watcher not in sys.meta_path:
            sys.meta_path.insert(0, _watcher)


def forget() -> None:
    """Stop watching (callbacks not yet called never will be)."""
    global _watcher
    with _lock:
        if _watcher is not None:
            _watcher.callbacks.clear()
            _remove(_watcher)
            _watcher = None


def _remove(watcher: _Watcher) -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(watcher)
