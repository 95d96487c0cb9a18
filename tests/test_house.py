"""The house keeps its shape (issue 24): small modules, few at ftd/'s top, the status written
by its board alone. The layers themselves are import-linter's (`make lint`)."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

MAX_LINES = 400
SOURCES = sorted([*(ROOT / "ftd").rglob("*.py"), *(ROOT / "client").rglob("*.py")])


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in SOURCES
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_cap_is_met_by_seams_not_by_line_golf() -> None:
    """No `# fmt: skip` in ftd/ or client/: the formatter's lines are the ones counted."""
    skips = [str(path.relative_to(ROOT)) for path in SOURCES if "fmt: skip" in path.read_text()]
    assert skips == []


def test_ftd_keeps_at_most_8_modules_at_its_top() -> None:
    assert len(list((ROOT / "ftd").glob("*.py"))) <= 8


def _status_fields() -> set[str]:
    tree = ast.parse((ROOT / "ftd" / "status" / "model.py").read_text())
    [node_status] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NodeStatus"]
    return {
        n.target.id
        for n in node_status.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def test_only_the_board_writes_the_node_status() -> None:
    """No `status.<field> = ...` (or `self.status.<field>`) outside status/board.py."""
    fields = _status_fields()
    assert {"state", "attempt", "restart_count"} <= fields
    writes = []
    for path in SOURCES:
        if path == ROOT / "ftd" / "status" / "board.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in fields
                    and _names_status(target.value)
                ):
                    writes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert writes == []


def _names_status(value: ast.expr) -> bool:
    if isinstance(value, ast.Name):
        return value.id == "status"
    return isinstance(value, ast.Attribute) and value.attr in ("status", "_status")


def _cycles(package: str) -> list[list[str]]:
    """The import cycles among `package`'s modules (every import counts: at the top, in a
    function, under TYPE_CHECKING), each as its strongly connected modules (Tarjan)."""
    import grimp

    graph = grimp.build_graph(package)
    modules = graph.modules
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module) & modules:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            part = []
            while (member := stack.pop()) != module:
                part.append(member)
            if part:
                found.append(sorted([module, *part]))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles_in_ftd_or_ftd_client() -> None:
    assert _cycles("ftd") == []
    assert _cycles("ftd_client") == []


def test_the_daemon_never_uses_asyncio_wait_for() -> None:
    """Python 3.11's `asyncio.wait_for` runs the awaited coroutine in a task of its own; when
    the waiter is cancelled as that task fails, the failure is never retrieved (a replica push
    cut by a broken pipe at teardown logged "Task exception was never retrieved"). ftd.tasks'
    `within` awaits in the caller's own task, under `asyncio.timeout`."""
    uses = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in SOURCES
        if path.is_relative_to(ROOT / "ftd")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "wait_for"
        and isinstance(node.value, ast.Name)
        and node.value.id == "asyncio"
    ]
    assert uses == []


def _js_strings(path: str, name: str) -> list[str]:
    """The strings of `const NAME = [...]` (or `new Set([...])`) in a dashboard script."""
    text = (ROOT / "ftd" / "api" / "dashboard" / "static" / path).read_text()
    found = re.search(rf"const {name} = (?:new Set\()?\[([^\]]*)\]", text)
    assert found is not None, f"{path} has no {name}"
    return re.findall(r'"([^"]*)"', found.group(1))


def test_the_dashboard_names_the_recovery_stages_as_the_daemon_does() -> None:
    from ftd.status.recovery_stages import AFTER_RESTORE, STAGES

    assert _js_strings("core.js", "STAGES") == list(STAGES)
    assert set(_js_strings("events.js", "AFTER_RESTORE")) == AFTER_RESTORE


DOOR = [
    ROOT / "client" / "ftd_client" / name
    for name in ("wire.py", "messages.py", "checkpoint_messages.py", "wire_fields.py")
] + [
    ROOT / "ftd" / path
    for path in (
        "health/inbox.py",
        "health/socket.py",
        "health/service.py",
        "health/messages.py",
        "health/calculate.py",
        "health/progress.py",
        "checkpoint/holder.py",
    )
]
"""The rank messages' door and the parts its inbox hands records to."""


def test_no_untyped_message_passes_the_door() -> None:
    """No parameter in the door's or its handlers' modules is `Any` or a `dict[str, Any]`: a
    rank's message travels as its record (ftd_client.messages), never as decoded JSON."""
    found = []
    for path in DOOR:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                for argument in arguments:
                    annotation = ast.unparse(argument.annotation) if argument.annotation else ""
                    if "Any" in annotation:
                        found.append(f"{path.name}:{node.lineno} {node.name}({argument.arg})")
    assert not found, found


PARTS = {
    "board", "checkpoints", "control", "coordinator", "group", "guard", "hangs", "health",
    "holder", "ledger", "monitor", "nvrx", "progress", "replication", "running", "server",
    "spawner", "supervisor", "tools",
}  # fmt: skip
"""Names the daemon's parts go by where another part holds them."""
GROWING = {"append", "extend", "insert", "add", "update", "setdefault"}


def _reached(node: ast.expr) -> str | None:
    """The part an attribute or call reaches into: `part.x` or `self.part.x`."""
    if isinstance(node, ast.Name) and node.id in PARTS:
        return node.id
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr.lstrip("_") in PARTS
    ):
        return node.attr
    return None


def test_no_part_writes_into_another() -> None:
    """Parts are built whole and change through their own methods: no `part.x = ...`, no
    `self.part.x = ...`, no `part.items.append(...)` from outside the part (issue 42)."""
    found = []
    for path in (ROOT / "ftd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            written: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                written = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                written = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                grown = node.func.value
                growing = node.func.attr in GROWING and isinstance(grown, ast.Attribute)
                if growing and _reached(grown.value):  # type: ignore[attr-defined]
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
            for target in written:
                if isinstance(target, ast.Attribute) and _reached(target.value):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(target)} = ...")
    assert not found, found


def test_no_getattr_around_a_part() -> None:
    """What a part offers is in its class or protocol: no `getattr(part, "name", ...)` that
    would run a backend without it silently (issue 42: `codec`, `hosting` were read so)."""
    found = []
    for path in (ROOT / "ftd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and (reached := _reached(node.args[0])) is not None
                and not reached.startswith("_")  # aiohttp's site holds its asyncio `_server`
            ):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


HEALTH_PARTS = (
    "server", "nvrx", "hangs", "first_steps", "monitor", "inbox", "timeouts_keeper", "losses",
    "budgets", "progress",
)  # fmt: skip


def test_nothing_reaches_through_the_health_service() -> None:
    """The health service is asked by intent (`messages_held()`, `rank_sockets()`); its parts
    are its own: no `health.server.pause()` from outside ftd/health (issue 42)."""
    reach = re.compile(rf"\bhealth\.({'|'.join(HEALTH_PARTS)})\b")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "ftd").rglob("*.py")
        if "health" not in path.relative_to(ROOT / "ftd").parts[:1]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if reach.search(line) and "ftd.health." not in line
    ]
    assert not found, found
