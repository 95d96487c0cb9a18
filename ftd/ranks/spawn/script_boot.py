"""`python -u <this file> [-m] target args`: a subprocess rank whose environment has
FTD_PROGRESS=1, started in place of `python -u [-m] target args` (pcontext.rank_command).

It installs ftd_client's progress observer, then runs the target as that command would have:
`sys.argv`, `sys.orig_argv` and `sys.path[0]` as python sets them, a fresh `__main__` (its
`__file__`, `__loader__` and `__spec__` as python gives them, so that classes defined in the
script pickle), an uncaught exception printed without this file's frames and exit code 1,
SystemExit, atexit handlers and non-daemon threads left to the interpreter's own exit. Only
`/proc/<pid>/cmdline` still names this file.

Standard library only, and nothing of ftd: it runs by path in the ranks' interpreter
(PYTHON_EXEC), which may not have ftd installed. Where ftd_client cannot be imported or
installed, the script runs all the same, with one line on stderr.
"""

from __future__ import annotations

import builtins
import importlib
import os
import signal
import sys
import types
import zipfile
from typing import NoReturn

OWN_DIR = os.path.dirname(os.path.realpath(__file__))


def main() -> None:
    if not sys.flags.safe_path and sys.path and os.path.realpath(sys.path[0]) == OWN_DIR:
        del sys.path[0]  # python put this file's directory there; the target's goes instead
    own_index = len(sys.orig_argv) - len(sys.argv)
    sys.orig_argv = [*sys.orig_argv[:own_index], *sys.orig_argv[own_index + 1 :]]
    rest = sys.argv[1:]
    module = bool(rest) and rest[0] == "-m"
    if module:
        rest = rest[1:]
    if not rest:
        print(f"{sys.executable}: no target after {sys.argv[0]}", file=sys.stderr)
        raise SystemExit(2)
    target, args = rest[0], rest[1:]
    sys.argv = ["-m", *args] if module else [target, *args]  # as python has them at this point
    _observe()
    _set_path0(module, target)
    try:
        _run(module, target)
    except SystemExit:
        raise
    except BaseException as error:
        _print_uncaught(error)
        if isinstance(error, KeyboardInterrupt):
            _exit_by_sigint()
    else:
        return
    raise SystemExit(1)


def _observe() -> None:
    try:  # progress observation, NVRx's in-process restart as ftd's (ftd_client/rank_start.py)
        importlib.import_module("ftd_client.rank_start").install_from_env()
    except Exception as error:  # the script runs all the same
        os.write(2, f"ftd: progress is not observed in this rank: {error!r}\n".encode())


def _set_path0(module: bool, target: str) -> None:
    """sys.path[0] as python sets it: the working directory for -m, the directory or zip file
    itself when that is what runs, else the script's real directory; nothing with -P."""
    if sys.flags.safe_path:
        return
    if module:
        path0 = os.getcwd()
    elif _runs_as_package(target):
        path0 = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
    else:
        path0 = os.path.dirname(os.path.realpath(target))
    sys.path.insert(0, path0)


def _runs_as_package(target: str) -> bool:
    return os.path.isdir(target) or (os.path.isfile(target) and zipfile.is_zipfile(target))


def _run(module: bool, target: str) -> None:
    import runpy

    main = types.ModuleType("__main__")  # runpy runs -m targets in __main__'s namespace too
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    if module:
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        return
    if _runs_as_package(target):
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    path = os.path.abspath(target)  # as python makes it (3.9+): __file__, tracebacks
    code = _compile_script(path)
    from importlib.machinery import SourceFileLoader

    main.__dict__.update(
        __file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path)
    )
    exec(code, main.__dict__)


def _compile_script(path: str) -> types.CodeType:
    try:
        with open(path, "rb") as script:
            source = script.read()
    except OSError as error:
        print(
            f"{sys.executable}: can't open file {path!r}: [Errno {error.errno}] {error.strerror}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return compile(source, path, "exec", dont_inherit=True)


def _print_uncaught(error: BaseException) -> None:
    """As python prints an uncaught exception: through sys.excepthook, from the target's
    first frame (a SyntaxError in the script itself: with no traceback at all)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    error = error.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb
    sys.excepthook(type(error), error, tb)


def _exit_by_sigint() -> NoReturn:
    """Python ends by SIGINT after an uncaught KeyboardInterrupt (bpo-1054041), once it has
    finished as usual."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(130)


if __name__ == "__main__":
    main()
