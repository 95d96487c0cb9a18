"""The monitoring ftd ships (monitoring/grafana-dashboard.json, monitoring/alerts.yaml) names
only metrics a live daemon exports; both files are well formed; the metrics that the panels
and alerts need and that only the event log knows (hangs by rank, back-off waited, nodes lost,
files not written) count what happened. With promtool on the PATH (or $PROMTOOL), every
expression is parsed by Prometheus itself and the alerts' unit tests run."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ftd.api.metrics import ApiMetrics
from tests.conftest import BIN, ROOT, ServeFactory, await_api_event
from tests.support.api_local import (
    LocalControl,
    private_registry,  # noqa: F401 (an autouse fixture)
)

MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERTS = MONITORING / "alerts.yaml"
ALERT_TESTS = MONITORING / "alerts-tests.yaml"

# -- reading the names out of PromQL -----------------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_COMMENT = re.compile(r"#[^\n]*")
_NAME = re.compile(r"(?<![\w:$])ftd_[A-Za-z0-9_:]*")
_NAME_IN_PROSE = re.compile(r"(?<![\w:$/.-])ftd_[a-z0-9_]*[a-z0-9]")
"""A metric named in a description or a comment (where a colon after it is punctuation)."""
# Grafana's variables, replaced by something PromQL accepts (for promtool).
_GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
}


def metric_names(expr: str) -> set[str]:
    """The `ftd_` series names an expression reads: identifiers outside string literals (a
    label value such as job="ftd_x" is no metric) and comments."""
    bare = _COMMENT.sub("", _STRINGS.sub('""', expr))
    return set(_NAME.findall(bare))


def exported_series(exposition: str) -> tuple[set[str], set[str]]:
    """Every series name the exposition has or may have (each family's samples, and for a
    family without samples yet, such as a labelled counter nothing incremented, the names its
    type gives), and the family names."""
    names: set[str] = set()
    families: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        families.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names, families


# -- the two files ----------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels_of(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    found: list[dict[str, Any]] = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panels_of(panel) if "panels" in panel else [])
    return found


def dashboard_exprs() -> dict[str, str]:
    """Every PromQL expression of the dashboard (targets, variables, annotations), by where."""
    board = dashboard()
    exprs: dict[str, str] = {}
    for panel in panels_of(board):
        for target in panel.get("targets", []):
            exprs[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            exprs[f"variable {variable['name']}"] = variable["definition"]
    for annotation in board["annotations"]["list"]:
        if "expr" in annotation:
            exprs[f"annotation {annotation['name']}"] = annotation["expr"]
    return exprs


def named_metrics() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each `ftd_` series name the dashboard and the rules query, with where; and each `ftd_`
    name their prose mentions (a description that names a metric names it for the operator: a
    histogram's family name will do there)."""
    queried: dict[str, set[str]] = {}
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            queried.setdefault(name, set()).add(f"alert {rule['alert']}")
    for place, expr in dashboard_exprs().items():
        for name in metric_names(expr):
            queried.setdefault(name, set()).add(place)
    mentioned: dict[str, set[str]] = {}
    for path in (ALERTS, DASHBOARD):
        for name in _NAME_IN_PROSE.findall(path.read_text()):
            mentioned.setdefault(name, set()).add(path.name)
    return queried, mentioned


def test_the_extractor_reads_names_and_skips_strings() -> None:
    expr = (
        'sum by (le) (rate(ftd_made_up_seconds_bucket{job="ftd_not_a_metric", x=~"a|b"}[5m]))'
        " / on (instance) group_left (node_id) ftd_info # ftd_in_a_comment"
    )
    assert metric_names(expr) == {"ftd_made_up_seconds_bucket", "ftd_info"}
    exposition = (
        "# HELP ftd_a_seconds h\n# TYPE ftd_a_seconds histogram\n"
        "# HELP ftd_b_total h\n# TYPE ftd_b_total counter\n"
        '# HELP ftd_c h\n# TYPE ftd_c gauge\nftd_c{x="1"} 2.0\n'
    )
    exported, families = exported_series(exposition)
    assert {"ftd_a_seconds_bucket", "ftd_a_seconds_count", "ftd_b_total", "ftd_c"} <= exported
    assert families == {"ftd_a_seconds", "ftd_b", "ftd_c"}
    # A made-up name, a counter without its _total and a histogram's bare name are caught.
    used = metric_names(expr) | {"ftd_b", "ftd_a_seconds", "ftd_c"}
    assert used - exported == {"ftd_made_up_seconds_bucket", "ftd_info", "ftd_b", "ftd_a_seconds"}


def test_every_alert_rule_is_complete() -> None:
    rules = alert_rules()
    assert len(rules) >= 8
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), names
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        notes = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(notes), rule["alert"]
        assert metric_names(rule["expr"]) or "up{" in rule["expr"], rule["alert"]
        # The description says what the metric means, the runbook where to look.
        assert any(name in notes["description"] for name in metric_names(rule["expr"])) or (
            rule["alert"] == "FtdDaemonDown"
        ), rule["alert"]
        assert re.search(r"ftd (status|events)|dashboard|/v1/", notes["runbook"]), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    covered = " ".join(rule["expr"] for rule in rules)
    for metric in (
        "ftd_restarts_total",
        "ftd_restart_backoff_waited_seconds_total",
        "ftd_rank_hangs_total",
        "ftd_nodes_lost_total",
        "ftd_node_exclusions_total",
        "ftd_persist_failing_files",
        "ftd_api_event_streams_dropped_total",
        "ftd_input_refused_total",
        "ftd_node_steps_per_second",
        "ftd_rank_straggler",
        'up{job="ftd"}',
    ):
        assert metric in covered, metric


def test_the_dashboard_is_complete() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "node", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["definition"].startswith("label_values(")
    panels = panels_of(board)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    titles = [panel["title"] for panel in panels]
    for wanted in (
        "State per node",
        "Restarts",
        "Restart rate",
        "Hangs by rank",
        "Back-off",
        "Nodes lost and excluded",
        "Persist failures",
        "Recovery stages, median over the range",
        "Event streams",
        "Input refused by source and cause",
        "Rank heartbeat age",
        "Steps by rank",
        "Step time by rank",
        "Stragglers",
    ):
        assert wanted in titles, wanted
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert metric_names(target["expr"]) or "up{" in target["expr"], panel["title"]
            assert 'job=~"$job"' in target["expr"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    taken: dict[tuple[int, int], str] = {}  # no panel drawn over another
    for panel in board["panels"]:
        grid = panel["gridPos"]
        for cell in itertools.product(
            range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        ):
            assert cell not in taken, f"{panel['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = panel["title"]
    quantiles = [
        expr
        for expr in dashboard_exprs().values()
        if "histogram_quantile" in expr and "ftd_recovery_stage_seconds_bucket" in expr
    ]
    assert len(quantiles) >= 2


# -- a live daemon exports every one of them --------------------------------------------------


async def test_every_metric_they_name_is_exported_by_a_live_daemon(serve: ServeFactory) -> None:
    """A real daemon whose rank 1 stops its heartbeats: hung, restarted, recovered. Its
    /metrics then has every family, the recovery histogram with samples, and the hang counted
    for local rank 1."""
    run = await serve(
        "--preload", "none",  # the ranks never import torch
        "--nproc-per-node", "2", "--max-restarts", "1", "--ft-param-rank_heartbeat_timeout=0.5",
        script=BIN / "health_worker.py",
        script_args=("--mode", "stop-heartbeats", "--beats", "100000", "--interval", "0.05"),
    )  # fmt: skip
    await run.stderr.expect(r"API listening on (\S+)")
    info = json.loads((run.run_dir / "api.json").read_text())
    url = info["url"]
    await await_api_event(url, "recovery", timeout=90)
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        assert response.status == 200
        exposition = await response.text()
    exported, families = exported_series(exposition)
    queried, mentioned = named_metrics()
    missing = {name: sorted(where) for name, where in queried.items() if name not in exported}
    assert not missing, f"queried by the monitoring but not exported: {missing}"
    unknown = {name for name in mentioned if name not in exported | families}
    assert not unknown, f"named in the monitoring's text but not exported: {sorted(unknown)}"
    assert len(queried) >= 25, sorted(queried)
    assert "ftd_made_up_total" not in exported  # the check can fail
    lines = exposition.splitlines()
    assert 'ftd_rank_hangs_total{local_rank="1"} 1.0' in lines
    assert 'ftd_rank_hangs_total{local_rank="0"} 0.0' in lines
    assert "ftd_round_nodes 1.0" in lines
    assert "ftd_persist_failing_files 0.0" in lines
    assert any(line.startswith("ftd_recovery_stage_seconds_bucket{") for line in lines)
    run.signal(signal.SIGTERM)
    await run.wait()


# -- the event log's metrics ------------------------------------------------------------------


def test_the_event_log_metrics_count_what_happened(tmp_path: Path) -> None:
    control = LocalControl(tmp_path)
    metrics = ApiMetrics(control)  # type: ignore[arg-type]
    events = control.events

    def scrape() -> set[str]:
        return set(generate_latest(metrics.registry).decode().splitlines())

    before = scrape()
    assert "ftd_persist_failing_files 0.0" in before
    assert not any(line.startswith("ftd_round_nodes ") for line in before)  # no round yet
    events.emit("round_closed", round=0, members=["a", "b", "c"], group_rank=0)
    events.emit("persist_failed", path="/r/status.json", cause="enospc", detail="full")
    events.emit("persist_failed", path="/r/events.jsonl", cause="enospc", detail="full")
    events.emit("restart_backoff", attempt=0, delay_s=1.0, fast_failures=1)
    events.emit("restart_backoff", attempt=1, delay_s=2.0, fast_failures=2)
    events.emit("rank_hung", local_rank=0, global_rank=4, pid=1, reason="heartbeat")
    events.emit("rank_hung", local_rank=7, global_rank=11, pid=2, reason="beyond nproc")
    first = scrape()
    assert {
        "ftd_round_nodes 3.0",
        "ftd_persist_failures_total 2.0",
        "ftd_persist_failing_files 2.0",
        "ftd_restart_backoff_waited_seconds_total 3.0",
        'ftd_rank_hangs_total{local_rank="0"} 1.0',
        "ftd_hangs_total 2.0",
    } <= first
    assert not any('local_rank="7"' in line for line in first)  # bounded by --nproc-per-node
    events.emit("persist_recovered", path="/r/status.json")
    events.emit("node_lost", node_id="b", reason="keep-alive expired")
    events.emit("node_excluded", node_id="c", reason="flaky", by="test")
    events.emit("round_closed", round=1, members=["a"], group_rank=0)
    assert {
        "ftd_round_nodes 1.0",
        "ftd_persist_failures_total 2.0",
        "ftd_persist_failing_files 1.0",
        "ftd_nodes_lost_total 1.0",
        "ftd_node_exclusions_total 1.0",
    } <= scrape()


# -- promtool, where it is installed ----------------------------------------------------------


def promtool() -> str:
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian: the prometheus package; or $PROMTOOL)")
    return found


def test_promtool_accepts_the_rules_and_their_unit_tests() -> None:
    tool = promtool()
    checked = subprocess.run(
        [tool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [tool, "test", "rules", ALERT_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=MONITORING,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    """Each expression, Grafana's variables put in, as a recording rule promtool checks."""
    tool = promtool()
    rules = []
    for number, expr in enumerate(dashboard_exprs().values()):
        if expr.startswith("label_values("):
            selector = expr.removeprefix("label_values(").rsplit(",", 1)[0]
            expr = selector if "{" in selector else f"{selector}{{}}"
        for variable, value in _GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        expr = re.sub(r"\$\w+", ".*", expr)
        rules.append({"record": f"ftd_dashboard:expr{number}", "expr": expr})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(
        [tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
