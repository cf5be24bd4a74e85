"""The plan pages in a real browser: Debian's headless Chromium driven by Playwright (which
never downloads a browser here: it launches the system's ``chromium``).

A live ``pipeplan serve`` with an API token: log in through the form, load the list, open a
plan and count the Gantt chart's boxes (one per action), compare two plans, and check that a
model and a layer name holding ``<script>`` render as text.  Each page leaves a screenshot in
``$PIPEPLAN_TEST_ARTIFACTS`` (default: pytest's temporary folder; the path is printed).

Skipped, saying why, where no Chromium is installed (``.ci/run`` installs Debian's
``chromium`` when it can).
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_testlib import LiveServer, variant

TOKEN = "browser-s3cret"
EVIL = "<script>alert('x')</script>"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def find_chromium() -> str | None:
    for candidate in (os.environ.get("PIPEPLAN_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip(
            "no Chromium here (looked for $PIPEPLAN_CHROMIUM, /usr/bin/chromium, chromium, chromium-browser, "
            "google-chrome): install Debian's chromium (apt-get install chromium; .ci/run does when it can) "
            "to run the browser tests"
        )
    return path


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("PIPEPLAN_TEST_ARTIFACTS")
    out = Path(folder) / "screenshots" if folder else tmp_path_factory.mktemp("screenshots")
    out.mkdir(parents=True, exist_ok=True)
    print(f"browser screenshots in {out}")
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("browser")
    live = LiveServer(tmp / "plans.db", tmp / "server.log", PIPEPLAN_API_TOKEN=TOKEN)
    live.start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def plans(server: LiveServer, tiny_profile_module: dict[str, Any]) -> dict[str, str]:
    """Three stored plans: a base one, one on fewer devices, one with markup in its names."""
    base = {
        "profile": tiny_profile_module,
        "cluster": {"devices": 4, "memory": "16GiB"},
        "training": {"global_batch_size": 8},
        "options": {"time_limit_s": 1.0},
    }
    fewer = variant(base, 1)
    fewer["cluster"] = {"devices": 2, "memory": "16GiB"}
    evil = copy.deepcopy(base)
    evil["profile"]["model"] = f"gpt {EVIL}"
    evil["profile"]["layers"][0]["name"] = f"embed{EVIL}"
    ids = {}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        for name, body in (("base", base), ("fewer", fewer), ("evil", evil)):
            r = c.post("/v1/plans", json=body)
            assert r.status_code == 201, r.text
            ids[name] = r.json()["id"]
    return ids


@pytest.fixture(scope="module")
def tiny_profile_module() -> dict[str, Any]:
    import json

    from api_testlib import ROOT

    data: dict[str, Any] = json.loads((ROOT / "examples" / "profiles" / "tiny.json").read_text())
    return data


@pytest.fixture(scope="module")
def page(chromium_path: str, server: LiveServer, plans: dict[str, str]) -> Iterator[Any]:
    """A signed-in browser page (logged in once, through the form)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        tab = context.new_page()
        tab.set_default_timeout(30_000)
        dialogs: list[str] = []
        tab.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        tab.goto(f"{server.url}/plans")
        assert "/login?next=" in tab.url  # no session yet: the login form
        tab.fill("#token", TOKEN)
        tab.click("#login")
        tab.wait_for_url(f"{server.url}/plans")
        assert TOKEN not in tab.url
        yield tab
        assert dialogs == [], f"a script ran: {dialogs}"
        context.close()
        browser.close()


def test_list(page: Any, server: LiveServer, plans: dict[str, str], artifacts: Path) -> None:
    page.goto(f"{server.url}/plans")
    rows = page.locator("table#plans tr.plan")
    assert rows.count() == 3
    ids = [rows.nth(i).locator("a.id").inner_text() for i in range(3)]
    assert ids == [plans["evil"], plans["fewer"], plans["base"]]  # newest first
    page.screenshot(path=str(artifacts / "plans.png"), full_page=True)
    page.select_option("#model", "tiny-gpt")
    page.click("#filter button")
    page.wait_for_url("**/plans?model=tiny-gpt")
    assert page.locator("table#plans tr.plan").count() == 2


def test_plan_page_draws_one_box_per_action(page: Any, server: LiveServer, plans: dict[str, str], artifacts: Path) -> None:
    plan_id = plans["base"]
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        plan = c.get(f"{server.url}/v1/plans/{plan_id}").json()["plan"]
    page.goto(f"{server.url}/plans/{plan_id}")
    assert page.locator("table#stages tbody tr").count() == len(plan["stages"])
    page.wait_for_function(
        "() => { const d = document.querySelector('object#gantt').contentDocument;"
        " return d && d.querySelector('[id^=actions-rank]') !== null; }"
    )
    page.wait_for_function("() => { const d = document.querySelector('object#memory').contentDocument;"
                           " return d && d.querySelector('svg') !== null; }")
    boxes = page.evaluate(
        """() => {
            const doc = document.querySelector('object#gantt').contentDocument;
            return Array.from(doc.querySelectorAll('g[id^=actions-rank]'))
                .sort((a, b) => a.id.localeCompare(b.id, 'en', {numeric: true}))
                .map(g => g.querySelectorAll('use').length || g.querySelectorAll('path').length);
        }"""
    )
    assert boxes == [len(a.split()) for a in plan["actions"]]
    assert sum(boxes) > 0
    assert page.locator("#commands").inner_text().startswith("pipeplan export")
    page.screenshot(path=str(artifacts / "plan.png"), full_page=True)


def test_compare(page: Any, server: LiveServer, plans: dict[str, str], artifacts: Path) -> None:
    page.goto(f"{server.url}/plans/{plans['base']}/vs/{plans['fewer']}")
    changed = page.locator("table#compare tr.diff th").all_inner_texts()
    assert "devices" in changed and "pipeline (P)" in changed and "split (layers per stage)" in changed
    assert "model" not in changed
    highlighted = page.locator("table#compare tr.diff td").first.evaluate("e => getComputedStyle(e).backgroundColor")
    plain = page.locator("table#compare tr:not(.diff) td").first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert highlighted != plain
    page.screenshot(path=str(artifacts / "compare.png"), full_page=True)


def test_markup_in_names_renders_as_text(page: Any, server: LiveServer, plans: dict[str, str], artifacts: Path) -> None:
    page.goto(f"{server.url}/plans/{plans['evil']}")
    assert page.locator("#title").inner_text().startswith(f"gpt {EVIL}")
    assert page.locator("table#stages td.layer").first.inner_text() == f"embed{EVIL}"
    assert page.evaluate("document.querySelectorAll('script').length") == 0
    page.screenshot(path=str(artifacts / "plan-markup.png"), full_page=True)
    page.goto(f"{server.url}/plans")
    assert page.locator("table#plans td.model").first.inner_text() == f"gpt {EVIL}"
    assert page.evaluate("document.querySelectorAll('script').length") == 0
