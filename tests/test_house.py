"""The house keeps its shape (issue 24): small modules, few at ftd/'s top, the status written
by its board alone. The layers themselves are import-linter's (`make lint`)."""

from __future__ import annotations

import ast

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
