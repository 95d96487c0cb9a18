"""Inside a rank just forked from the zygote: become `python -u script.py args` (or `-m mod`).

What a fresh interpreter would have, the rank gets: its own session (set while forking), the
parent-death signal, default signal handlers and faulthandler state, its environment, working
directory, `sys.argv`, `sys.path[0]`, stdio on the attempt's log files, fresh random seeds, its
own thread count for OpenMP/MKL/OpenBLAS, and a fresh `__main__` module to run the script in.
It ends as python ends a script (exit codes from SystemExit, tracebacks, non-daemon threads
joined, atexit handlers run, the script's globals collected, files and stdio flushed), then
leaves with os._exit: nothing of the zygote's runs twice, and the modules it preloaded are not
torn down page by page (see `_finalize`).

Standard library only (see zygote_server).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import faulthandler
import gc
import importlib
import io
import os
import signal
import sys
import threading
import time
import types
import zipfile
from typing import Any, NoReturn

from ftd.text import is_decimal

PR_SET_PDEATHSIG = 1
RANK_START_WANTED = (("FTD_PROGRESS", "1"), ("FTD_RESTART_MODE", "inprocess"))  # rank_start's
REPARENT_TIMEOUT_S = 10.0

INITIAL_PATH0: str | None = None
"""sys.path[0] of the zygote as `python -m` set it (its working directory)."""

ZYGOTE_ENV: dict[str, str] = dict(os.environ)
"""The zygote's environment at exec: what the preloaded libraries initialised from."""

DAEMON_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Caught by the daemon while its ranks run; exec resets a caught signal to the default."""

INHERITED_SIGNALS: dict[int, Any] = {}
"""The zygote's dispositions at exec, before it changed any: what a rank exec'd by the daemon
would start with (a signal ignored by whoever started the daemon stays ignored, as across exec)."""


def inherited_signals() -> dict[int, Any]:
    """This interpreter's current dispositions, for the signals a rank can be handed, with those
    the daemon catches at what exec gives them (SIGINT: KeyboardInterrupt, as Python sets it)."""
    fresh = (signal.SIG_IGN, signal.SIG_DFL, signal.default_int_handler)
    dispositions: dict[int, Any] = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        dispositions[sig] = handler if handler in fresh else signal.SIG_DFL
    for sig in DAEMON_HANDLED_SIGNALS:
        dispositions[sig] = signal.SIG_DFL
    dispositions[signal.SIGINT] = signal.default_int_handler
    return dispositions


def become_rank(request: dict[str, Any]) -> NoReturn:
    """Turn this forked process into the rank and run the script; never returns."""
    try:
        _reset_signals()
        _await_reparenting(request["_intermediate"], request["_parent"])
        _install_stdio(request["_fds"])
        _reset_process_state(request)
    except BaseException as error:  # the script has not started: report and leave
        os.write(2, f"ftd zygote: could not start the rank: {error!r}\n".encode())
        os._exit(1)
    if any(os.environ.get(name) == value for name, value in RANK_START_WANTED):
        try:  # progress observation, NVRx's in-process restart as ftd's
            importlib.import_module("ftd_client.rank_start").install_from_env()
        except Exception as error:  # the script runs all the same
            os.write(2, f"ftd: progress is not observed in this rank: {error!r}\n".encode())
    _run_main(request)


def _reset_signals() -> None:
    """A fresh interpreter's dispositions: those the zygote was exec'd with (SIGINT raises
    KeyboardInterrupt unless it was ignored, SIGPIPE and SIGXFSZ are ignored, the rest as
    inherited); nothing blocked, no wakeup fd."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    signal.set_wakeup_fd(-1)
    for sig, handler in (INHERITED_SIGNALS or inherited_signals()).items():
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError, RuntimeError):
            continue


def _await_reparenting(intermediate: int, daemon: int) -> None:
    """Wait (briefly) for the intermediate to exit, then die with the daemon.

    PR_SET_PDEATHSIG fires when the parent *thread* exits: set while the intermediate is the
    parent, it would fire at once. Once re-parented, the parent is the daemon's main thread
    (the kernel picks the subreaper's first live thread), so it fires when the daemon dies.
    """
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() == intermediate:
        if time.monotonic() > deadline:
            raise TimeoutError("the intermediate process did not exit")
        time.sleep(0.0002)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != daemon:  # the daemon died before we could watch it
        os._exit(1)


def _install_stdio(fds: list[int]) -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        # As -u sets them up: write-through, line-buffered only on a terminal.
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=stream.isatty(), write_through=True)


def _reset_process_state(request: dict[str, Any]) -> None:
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    sys.orig_argv = list(request["orig_argv"])
    _set_path0(request)
    importlib.invalidate_caches()
    _reset_faulthandler(env)
    _reseed()
    _apply_thread_counts(env)
    with contextlib.suppress(OSError, ValueError, IndexError):
        _show_in_proc(request["orig_argv"], env, first=request["own_env"])


def _show_in_proc(argv: list[str], env: dict[str, str], first: list[str]) -> None:
    """/proc/<pid>/cmdline and /proc/<pid>/environ show what exec gave the zygote: rewrite
    those areas in place, in the room the zygote was launched with (zygote_process.ARGV_ROOM),
    so ps and pgrep see the rank's command, and the orphan guard's sweep by FTD_DAEMON_ID finds
    the rank's forked descendants. The rank's own variables go first, in case room runs out.
    os.environ no longer points there (clear() and update() re-created every variable)."""
    with open("/proc/self/stat", "rb") as stat_file:
        stat = stat_file.read()
    fields = stat[stat.rindex(b")") + 2 :].split()  # field 3 onwards
    arg_start, arg_end, env_start, env_end = (int(fields[n - 3]) for n in (48, 49, 50, 51))
    ordered = [*first, *(key for key in env if key not in first)]
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        _fill(mem, arg_start, arg_end, [arg.encode() for arg in argv])
        _fill(mem, env_start, env_end, [f"{key}={env[key]}".encode() for key in ordered])


def _fill(mem: Any, start: int, end: int, items: list[bytes]) -> None:
    area = bytearray()
    for item in items:
        if len(area) + len(item) + 1 > end - start:
            break
        area += item + b"\0"
    mem.seek(start)
    mem.write(bytes(area.ljust(end - start, b"\0")))


def _set_path0(request: dict[str, Any]) -> None:
    """sys.path[0] as python sets it: the script's real directory, the working directory for
    -m, the directory or zip file itself when that is what runs; nothing with -P."""
    if sys.flags.safe_path:
        return
    target: str = request["target"]
    if request["module"]:
        path0 = os.getcwd()
    elif _runs_as_package(target):
        path0 = os.path.abspath(target)
    else:
        path0 = os.path.dirname(os.path.realpath(target))
    if sys.path and INITIAL_PATH0 is not None and sys.path[0] == INITIAL_PATH0:
        sys.path[0] = path0
    else:
        sys.path.insert(0, path0)


def _runs_as_package(target: str) -> bool:
    return os.path.isdir(target) or (os.path.isfile(target) and zipfile.is_zipfile(target))


def _reset_faulthandler(env: dict[str, str]) -> None:
    faulthandler.cancel_dump_traceback_later()
    faulthandler.disable()
    if env.get("PYTHONFAULTHANDLER") or "faulthandler" in sys._xoptions:
        faulthandler.enable()


def _reseed() -> None:
    import random

    random.seed()  # os.fork reseeds it too; a second time costs nothing
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()  # the legacy global RandomState, seeded from the OS as at import
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.current_process().authkey = os.urandom(32)


def _apply_thread_counts(env: dict[str, str]) -> None:
    """OpenMP, MKL and OpenBLAS read their thread counts from the environment when they load,
    which for preloaded libraries was in the zygote: give them the rank's counts."""
    torch = sys.modules.get("torch")
    omp = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    if torch is not None and omp and omp != ZYGOTE_ENV.get("OMP_NUM_THREADS"):
        with contextlib.suppress(ValueError, RuntimeError):
            torch.set_num_threads(int(omp))
    _set_openblas_threads(env)


def _set_openblas_threads(env: dict[str, str]) -> None:
    """The zygote loads OpenBLAS (numpy's) with one thread, so that it starts no thread pool;
    a fresh process would have had OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, else one per
    CPU it may run on."""
    cpus = len(os.sched_getaffinity(0))
    wanted = cpus
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        value = env.get(name, "")
        if is_decimal(value) and int(value) > 0:
            wanted = min(int(value), cpus)
            break
    if wanted <= 1:
        return
    for setter in _openblas_setters():
        setter(wanted)


def _openblas_setters() -> list[Any]:
    setters = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    names = (
        "openblas_set_num_threads",
        "openblas_set_num_threads64_",
        "scipy_openblas_set_num_threads64_",
        "scipy_openblas_set_num_threads",
    )
    for path in sorted(paths):
        if not path.startswith("/"):
            continue
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        for name in names:
            if hasattr(lib, name):
                setters.append(getattr(lib, name))
                break
    return setters


def _fresh_main_module() -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    return main


def _run_main(request: dict[str, Any]) -> NoReturn:
    """Run the script as `__main__`, then leave as the interpreter would (see `_finalize`).
    An uncaught exception is printed as python prints it (without this frame): exit code 1."""
    import runpy

    main = _fresh_main_module()
    target: str = request["target"]
    if not request["module"]:
        target = os.path.abspath(target)  # as python makes it (3.9+): __file__, tracebacks
    interrupted = False
    try:
        if request["module"]:
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        elif _runs_as_package(target):
            runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        else:
            code = _compile_script(target)
            from importlib.machinery import SourceFileLoader

            main.__dict__.update(
                __file__=target, __cached__=None, __loader__=SourceFileLoader("__main__", target)
            )
            exec(code, main.__dict__)
        status = 0
    except SystemExit as exit_request:
        status = _exit_status(exit_request)
    except BaseException as error:
        tb = error.__traceback__
        error.with_traceback(tb.tb_next if tb is not None else None)
        sys.excepthook(type(error), error, error.__traceback__)
        if isinstance(error, Exception):
            _record_uncaught(error)
        interrupted = isinstance(error, KeyboardInterrupt)
        status = 1
    del main
    status = _finalize(status)
    if interrupted:  # python ends by SIGINT after an uncaught KeyboardInterrupt (bpo-1054041)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 130
    os._exit(status)


def _record_uncaught(error: Exception) -> None:
    """torchelastic's error file for an exception the script did not record itself (it died
    before reaching its @record: at import, say), so that the failure summary shows it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:  # torch is already imported in a forked rank (the zygote preloaded it)
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)
    except Exception as failure:  # the error is on stderr already; this is a convenience
        print(f"ftd: could not write the error file {path}: {failure}", file=sys.stderr)


def _exit_status(exit_request: SystemExit) -> int:
    """What python exits with for this SystemExit (Python/pythonrun.c handle_system_exit)."""
    code = exit_request.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _finalize(status: int) -> int:
    """The interpreter's exit, less tearing down the modules the zygote preloaded.

    Py_FinalizeEx would join non-daemon threads, run atexit handlers, collect the modules and
    flush stdio. Collecting torch's thousand modules in a forked rank writes to every page the
    zygote shares with it (about 0.4 s per rank here) and changes nothing anyone can see; so
    only what the rank made itself is collected: the script's globals, then any object still
    holding a buffered file is flushed. os._exit then skips the rest (and runs nothing of the
    zygote's)."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    if main is not None:
        _clear_module(main)
    gc.collect()  # the rank's own objects: the zygote's are frozen (gc.freeze) and not visited
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase) and obj not in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            status = 120  # as python, when flushing stdout fails at exit
    return status


def _clear_module(module: types.ModuleType) -> None:
    """As CPython clears a module at shutdown: `_names` first, then the rest, builtins last."""
    namespace = module.__dict__
    for underscore in (True, False):
        for name in list(namespace):
            if name.startswith("_") == underscore and name != "__builtins__":
                with contextlib.suppress(Exception):
                    namespace[name] = None


def _compile_script(target: str) -> types.CodeType:
    try:
        with open(target, "rb") as script:
            source = script.read()
    except OSError as error:
        print(
            f"{sys.executable}: can't open file {os.path.abspath(target)!r}: "
            f"[Errno {error.errno}] {error.strerror}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return compile(source, target, "exec", dont_inherit=True)
