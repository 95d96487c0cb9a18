"""The list of doors (docs/security.md, "Every door, in one list") holds the code: every module
that reads from outside is named there (or among the reads that are no door), every fuzz
target and hostile test it names exists, and every message kind of the rank socket has its
row. A reader added without its row fails here (issue 39 item 8)."""

from __future__ import annotations

import re
from pathlib import Path

from ftd_client import wire

ROOT = Path(__file__).resolve().parents[1]
SECURITY = ROOT / "docs" / "security.md"
SCANNED = (ROOT / "ftd", ROOT / "client" / "ftd_client" / "checkpoint", ROOT / "client" /
           "ftd_client" / "inprocess")  # fmt: skip
"""The daemon, and the rank side's parts that read shared places (/dev/shm, persist
directories, the attempt's store); the rest of ftd_client reads its own daemon's replies."""
READS = re.compile(
    r"os\.open\(|(?<![\w.])open\(|\.read_bytes\(|\.read_text\(|json\.loads?\(|\.recv\(|recv_into"
    r"|sock_recv|os\.environ|getenv|scandir|\.readline\(|os\.read\(|pread\(|\.readexactly\("
    r"|await request\.|request\.headers|readlink\(|yaml\.safe_load|\.readinto\("
)


def table(marker: str) -> list[list[str]]:
    text = SECURITY.read_text()
    body = text[text.index(f"<!-- {marker} -->") : text.index(f"<!-- /{marker} -->")]
    rows = [line for line in body.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def named_modules() -> set[str]:
    named: set[str] = set()
    for row in table("doors"):
        named.update(re.findall(r"(?:ftd|client)/[\w/]+\.py", row[1]))
    for row in table("not-doors"):
        named.update(re.findall(r"(?:ftd|client)/[\w/]+\.py", row[0]))
    return named


def readers() -> set[str]:
    found = set()
    for top in SCANNED:
        for path in top.rglob("*.py"):
            code = "\n".join(
                line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
            )
            if READS.search(code):
                found.add(str(path.relative_to(ROOT)))
    return found


def test_every_reader_is_a_listed_door_or_said_to_be_none() -> None:
    missing = readers() - named_modules()
    assert not missing, (
        f"these modules read from outside but docs/security.md's list of doors does not name "
        f"them: {sorted(missing)} (give each a row: decoder, fuzz target, hostile test)"
    )


def test_every_named_module_exists() -> None:
    gone = {module for module in named_modules() if not (ROOT / module).is_file()}
    assert not gone, f"docs/security.md names modules that do not exist: {sorted(gone)}"


def test_every_fuzz_target_and_hostile_test_named_exists() -> None:
    targets = {
        name
        for path in (ROOT / "tests").rglob("test_*.py")
        for name in re.findall(r'fuzz_target\("([a-z_]+)"', path.read_text())
    }
    for door, _, target, hostile in table("doors"):
        if not target.startswith("—"):
            assert target in targets, f"{door}: no fuzz target {target!r}"
        assert hostile, f"{door}: no hostile test"
        for test in hostile.split(", "):
            file, _, name = test.partition("::")
            path = ROOT / file
            assert path.is_file(), f"{door}: no test file {file}"
            if name:
                assert re.search(rf"def {name}\(", path.read_text()), f"{door}: no test {test}"


def test_every_rank_message_kind_has_its_row() -> None:
    [rank_socket] = [row for row in table("doors") if row[0].startswith("rank socket messages")]
    listed = set(re.findall(r"`(\w+)`", rank_socket[0]))
    assert listed == set(wire.TYPES), set(wire.TYPES) ^ listed
