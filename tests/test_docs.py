"""The docs tell the truth about themselves and the run directory (issue 27, row 14): every
relative link and its anchor resolves, and every file a live daemon keeps in its run directory
is in README's layout."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from tests.conftest import ROOT, ServeFactory

DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "tests" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "bench").glob("*.md"),
    ]
)
LINK = re.compile(r"\]\(([^()\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, each
    space a `-` (so `--flag` in a heading keeps both dashes)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for line in text.splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        base = slug(match[1])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_the_slug_is_github_s() -> None:
    heading = "Several nodes (`--nnodes MIN:MAX` with MAX > 1, not `--standalone`)"
    assert slug(heading) == "several-nodes---nnodes-minmax-with-max--1-not---standalone"


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            path = (doc.parent / name).resolve() if name else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def _kept(run_dir: Path) -> set[str]:
    """What the run directory holds beside the attempts, without the moment's atomic-write
    temporaries (`.status.json.<pid>.<n>.tmp`, renamed over their file at once)."""
    return {
        p.name
        for p in run_dir.iterdir()
        if not p.name.startswith("attempt_") and not p.name.startswith(".")
    }


def _layout_names() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<run dir>/\n") : readme.index("```", readme.index("<run dir>/"))]
    return set(
        re.findall(r"^  (?:[\w.-]+, )?([\w.-]+\.(?:jsonl|json|token|sock))\b", block, re.M)
    ) | set(re.findall(r"^  ([\w.-]+\.sock), ", block, re.M))


async def test_the_run_directory_holds_what_readme_says(serve: ServeFactory) -> None:
    """While a daemon runs (one node: cluster.json too) and after it ended."""
    names = _layout_names()
    assert {"api.sock", "api.json", "cluster.json", "status.json", "events.jsonl"} <= names
    run = await serve("--nproc-per-node", "1", script_args=("--hang",))
    await run.stderr.expect(r"API listening on ")
    await run.stderr.expect(r"attempt 0: started local ranks")
    await run.stdout.expect(r"ready a0")
    running = _kept(run.run_dir)
    assert running <= names, running - names
    assert {"api.sock", "api.json", "cluster.json"} <= running
    run.signal(signal.SIGTERM)
    await run.wait()
    ended = _kept(run.run_dir)
    assert ended <= names and "api.sock" not in ended and "api.json" not in ended
