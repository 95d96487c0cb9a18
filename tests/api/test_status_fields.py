"""A status field or a timeout is defined once and shown everywhere (issue 42 item 6): the
contract (openapi.yaml) names every field the views name, and a field or timeout the views do
not know is still shown by `ftd status` and the dashboard (in a real headless Chromium against
a stub API), and tunable from the page."""

from __future__ import annotations

import re
from typing import Any

import yaml

from ftd.cli.status_view import LEFT_OUT, SHOWN_FIELDS, format_status
from ftd.config.ft import RankTimeouts
from ftd.status.model import NodeStatus
from tests.conftest import ROOT
from tests.support.truth_page import Stub, browser, in_chromium, open_page, stub_server, stub_status

STATIC = ROOT / "ftd" / "api" / "dashboard" / "static"


def contract_fields() -> set[str]:
    schemas = yaml.safe_load((ROOT / "openapi.yaml").read_text())["components"]["schemas"]
    names = set(schemas["NodeStatus"]["properties"])
    for part in schemas["Status"]["allOf"]:
        names |= set(part.get("properties", {}))
    return names


def page_fields() -> set[str]:
    source = (STATIC / "node.js").read_text()
    listed = re.search(r"const SHOWN_FIELDS = new Set\(\[(.*?)\]\);", source, re.S)
    assert listed is not None
    return set(re.findall(r'"(\w+)"', listed.group(1)))


def test_the_views_name_only_fields_of_the_contract_and_the_model_none_outside_it() -> None:
    contract = contract_fields()
    assert set(NodeStatus("n", "r").to_dict()) <= contract
    cli_fields = SHOWN_FIELDS | LEFT_OUT
    assert cli_fields <= contract, cli_fields - contract
    assert page_fields() <= contract, page_fields() - contract
    timeouts = yaml.safe_load((ROOT / "openapi.yaml").read_text())["components"]["schemas"]
    assert set(timeouts["Timeouts"]["properties"]) == set(RankTimeouts.model_fields)
    assert set(timeouts["TimeoutsPatch"]["properties"]) == set(RankTimeouts.model_fields)


def test_the_page_names_no_timeout_but_where_a_rank_cell_reads_its_deadline() -> None:
    """Its labels and its form's inputs come from the timeouts the daemon reports."""
    node = (STATIC / "node.js").read_text()
    deadline = re.search(r"\nfunction deadlineOf\(.*?\n}\n", node, re.S)
    assert deadline is not None
    pages = {
        "index.html": (STATIC / "index.html").read_text(),
        "app.js": (STATIC / "app.js").read_text(),
        "node.js": node.replace(deadline.group(0), ""),
    }
    for name in RankTimeouts.model_fields:
        assert not [page for page, text in pages.items() if name in text], name


def with_new_parts() -> dict[str, Any]:
    status = stub_status(
        unhealthy="the health check failed: /scratch is not mounted",
        standby={"round": 4, "members": 2, "since": 0, "reason": "standby: round 4 is full"},
        queue_depth=7,
    )
    status["timeouts"] = {**status["timeouts"], "rank_step_timeout": 30.0}
    return status


def test_ftd_status_shows_a_field_it_does_not_know() -> None:
    text = format_status(with_new_parts(), {})
    assert "queue depth: 7" in text
    assert "unhealthy, sitting out of the rendezvous: the health check failed" in text
    assert "standby: round 4 is full" in text
    assert "rank_step_timeout=30" in text


@in_chromium
async def test_the_page_shows_a_field_and_tunes_a_timeout_it_does_not_know() -> None:
    async with stub_server(Stub(with_new_parts())) as url, browser() as chromium:
        page, errors = await open_page(chromium, url)
        facts = page.locator("#facts")
        await facts.filter(has_text="queue depth 7").wait_for()
        text = await facts.inner_text()
        assert "unhealthy the health check failed: /scratch is not mounted" in text, text
        assert "standby: round 4 is full" in text, text
        assert "timeouts" not in text and "ipc" not in text, text
        await page.locator("#timeouts", has_text="step 30").wait_for()
        label = page.locator("#timeouts-form label", has_text="step")
        assert await label.locator("input#t-rank_step_timeout").input_value() == "30"
        assert await page.locator("#t-rank_section_timeouts").get_attribute("placeholder")
        await page.fill("#t-rank_step_timeout", "45")
        await page.fill("#t-rank_heartbeat_timeout", "off")
        patch = await page.evaluate("timeoutsPatch()")
        assert patch == {"rank_step_timeout": 45, "rank_heartbeat_timeout": None}, patch
        assert errors == []
