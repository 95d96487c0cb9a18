"""Fuzz targets for the decoders of outside input this file covers: a rank's error file
(ftd.ranks.error_file), the scheduler's variables (ftd.config.scheduler: Slurm host lists,
Kubernetes and PET_*), ftd serve's own variables (FTD_ZYGOTE_WARM_AFTER_S), and the terminal
escaping of job text (ftd.text). Each input must give a value or the decoder's refusal, never
another exception, within a per-input CPU budget.

A short pass runs with the tests; the long one: `make fuzz-long` (docs/security.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from ftd.config.scheduler import MAX_HOSTS, SchedulerError, detect, expand_hostlist, first_host
from ftd.ranks.error_file import MAX_FILE_BYTES, RankError, Unreadable, decode_error_json
from ftd.ranks.spawn.zygote_process import WARM_AFTER_ENV, WARM_AFTER_S, warm_after_s
from ftd.text import escape
from tests.support.fuzzing import budget, fuzz_target

# -- error.json --------------------------------------------------------------------------------

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40))
_json = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_torch_like = st.fixed_dictionaries(
    {
        "message": st.one_of(
            st.text(max_size=60),
            _json,
            st.fixed_dictionaries(
                {
                    "message": st.one_of(st.text(max_size=60), _json),
                    "extraInfo": st.one_of(
                        _json,
                        st.fixed_dictionaries(
                            {"py_callstack": st.one_of(st.text(), _json), "timestamp": _json}
                        ),
                    ),
                    "errorCode": _json,
                }
            ),
        )
    }
)


def _mangled(data: bytes, cut: int, junk: bytes) -> bytes:
    return data[: cut % (len(data) + 1)] + junk


_error_bytes = st.one_of(
    st.binary(max_size=512),
    _json.map(lambda v: json.dumps(v).encode()),
    _torch_like.map(lambda v: json.dumps(v).encode()),
    st.builds(
        _mangled,
        _torch_like.map(lambda v: json.dumps(v).encode()),
        st.integers(0, 10_000),
        st.binary(max_size=8),
    ),
    st.builds(
        lambda opener, depth, tail: opener * depth + tail,
        st.sampled_from([b"[", b"{", b'{"a":', b'{"message":[']),
        st.integers(0, 200_000),
        st.binary(max_size=4),
    ),
    st.builds(lambda n: b'"' + b"\\" * n, st.integers(0, 100_000)),
    st.builds(lambda n: b"9" * n, st.integers(4000, MAX_FILE_BYTES + 10)),
)


@fuzz_target("error_file", 150)
@given(_error_bytes)
def test_fuzz_error_json(data: bytes) -> None:
    with budget():
        decoded = decode_error_json(data)
    assert isinstance(decoded, RankError | Unreadable)
    if isinstance(decoded, RankError):
        assert len(decoded.message) <= 4096 and len(decoded.traceback) <= 40_000
        assert decoded.timestamp is None or 0 <= decoded.timestamp <= 1 << 33
        assert decoded.shown
    else:
        assert decoded.reason and "\n" not in decoded.reason


# -- the scheduler's variables ---------------------------------------------------------------

_host_chars = st.sampled_from([*"abn01-9_.,[]- :", "[1]", "[0-3]", "[01-99]", ","])
_hostlist = st.one_of(
    st.text(max_size=200),
    st.lists(_host_chars, max_size=300).map("".join),
    st.builds(
        lambda n, part: "n" + part * n,
        st.integers(0, 2000),
        st.sampled_from(["[1]", "[", "]", "[1-2]"]),
    ),
)


@fuzz_target("scheduler", 150)
@given(_hostlist)
def test_fuzz_slurm_hostlists(text: str) -> None:
    with budget():
        try:
            first = first_host(text)
            hosts = expand_hostlist(text, limit=1000) if len(text) < 400 else [first]
        except ValueError as error:
            assert "\n" not in str(error) and len(str(error)) < 400
            return
    assert 0 < len(hosts) <= MAX_HOSTS and hosts[0] == first


_VARIABLES = [
    "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_GPUS_ON_NODE",
    "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
    "SLURM_NODEID", "KUBERNETES_SERVICE_HOST", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE",
    "RANK", "JOB_COMPLETION_INDEX", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE",
    "PET_NODE_RANK", "PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_RDZV_BACKEND", "PET_RDZV_CONF",
    "PET_MAX_RESTARTS", "PET_STANDALONE", "PET_MASTER_ADDR", "PET_MASTER_PORT",
]  # fmt: skip
_values = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["1", "0", "2:4", "4:2", "auto", "host:1", "[::1]:2", "99999999999999"]),
    st.builds(lambda n: "n" + "[1]" * n, st.integers(0, 1500)),
    st.builds(lambda n, c: c * n, st.integers(0, 5000), st.sampled_from(["9", "[", ":", "a"])),
)


@fuzz_target("scheduler", 150)
@given(st.dictionaries(st.sampled_from(_VARIABLES), _values, max_size=10))
def test_fuzz_scheduler_environment(env: dict[str, str]) -> None:
    with budget():
        try:
            detected = detect(env)
        except SchedulerError as error:
            message = str(error)
            assert "\n" not in message and len(message) < 500
            assert message.split(":", 1)[0] in _VARIABLES, message
            return
    assert detected.scheduler in ("slurm", "kubernetes", "torchrun", "none")
    for setting in detected.settings.values():
        assert len(str(setting.value)) <= 4096 + 6


# -- ftd serve's own variables ---------------------------------------------------------------


@fuzz_target("serve_environment", 150)
@given(
    st.one_of(
        st.text(max_size=40),
        st.integers(-(10**6), 10**7).map(str),
        st.builds(lambda n: "9" * n, st.integers(0, 5000)),
    )
)
def test_fuzz_zygote_warm_after(value: str) -> None:
    with budget():
        seconds = warm_after_s({WARM_AFTER_ENV: value})
    assert isinstance(seconds, int) and 0 <= seconds <= 86400
    if not (value.isascii() and value.isdigit() and len(value) <= 5 and int(value) <= 86400):
        assert seconds == WARM_AFTER_S


# -- terminal escaping ----------------------------------------------------------------------


def _unsafe(char: str) -> bool:
    import unicodedata

    return unicodedata.category(char) in ("Cc", "Cs", "Zl", "Zp") or char in "\u202e\u2066"


@fuzz_target("text", 150)
@given(st.text(), st.booleans(), st.one_of(st.none(), st.integers(1, 200)))
def test_fuzz_escape(text: str, lines: bool, limit: int | None) -> None:
    check: Callable[[str], bool] = (lambda c: c not in "\n\t" and _unsafe(c)) if lines else _unsafe
    with budget():
        shown = escape(text, limit, lines)
    assert not any(check(c) for c in shown)
    assert limit is None or len(shown) <= limit
    if limit is None and not lines:
        assert "\n" not in shown


# -- a finished run's files, as `ftd status --run-dir` reads them ------------------------------


@fuzz_target("run_files", 150)
@given(
    st.one_of(st.binary(max_size=300), _json.map(lambda value: json.dumps(value).encode())),
    st.lists(st.one_of(st.binary(max_size=80), _json.map(json.dumps).map(str.encode)), max_size=8),
)
def test_a_run_dirs_files_are_read_or_refused(status: bytes, events: list[bytes]) -> None:
    """status.json and events.jsonl are outside input to the CLI (a rank can write the run
    directory): a record or the CLI's one-line refusal, never another exception."""
    import tempfile
    from pathlib import Path

    from ftd.cli.admin import format_status
    from ftd.cli.run_files import RunDirError, read_run

    with tempfile.TemporaryDirectory() as directory:
        run_dir = Path(directory)
        run_dir.chmod(0o700)
        (run_dir / "status.json").write_bytes(status)
        (run_dir / "events.jsonl").write_bytes(b"\n".join(events))
        with budget():
            try:
                record = read_run(run_dir)
            except RunDirError:
                return
            format_status(record.status, record.cluster, record.ending)
