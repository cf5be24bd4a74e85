"""The plan pages over HTTP (no browser): the list, a plan, a comparison, the charts with one
box per action, escaping of user input, and the login session that stands for the token.
The same pages in a real browser: test_api_browser.py."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from api_testlib import variant
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.routers.pages import SESSION_COOKIE, make_session, session_valid

EVIL = "<script>alert('x')</script>"


def _post(c: TestClient, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    r = c.post("/v1/plans", json=body, headers=headers or {})
    assert r.status_code in (200, 201), r.text
    plan_id: str = r.json()["id"]
    return plan_id


def evil_body(plan_body: dict[str, Any]) -> dict[str, Any]:
    """A request whose model and layer names hold markup."""
    body = copy.deepcopy(plan_body)
    body["profile"]["model"] = f"gpt {EVIL}"
    body["profile"]["layers"][0]["name"] = f"embed{EVIL}"
    return body


def test_list_plan_and_compare(client: TestClient, plan_body: dict[str, Any]) -> None:
    first = _post(client, plan_body)
    time.sleep(0.002)
    other = variant(plan_body, 3)
    other["cluster"] = {"devices": 2, "memory": "16GiB"}
    second = _post(client, other)
    r = client.get("/plans")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src" not in r.headers["content-security-policy"]  # default-src 'none': no scripts
    ids = re.findall(r'href="/plans/([0-9a-f]{24})"', r.text)
    assert ids == [second, first]  # newest first
    assert f'href="/plans/{second}/vs/{first}"' in r.text

    page = client.get(f"/plans/{first}")
    assert page.status_code == 200
    assert 'id="stages"' in page.text and page.text.count("<tr>") >= 4  # one row per stage (4 here)
    assert f'data="/plans/{first}/gantt.svg"' in page.text and f'data="/plans/{first}/memory.svg"' in page.text
    assert f"pipeplan run --plan http://testserver/v1/plans/{first}" in page.text
    assert f"/plans/{first}/plan.json" in page.text
    plan_json = client.get(f"/plans/{first}/plan.json")
    assert plan_json.json() == client.get(f"/v1/plans/{first}").json()["plan"]

    vs = client.get(f"/plans/{first}/vs/{second}")
    assert vs.status_code == 200
    diff_rows = re.findall(r'<tr class="diff"><th>([^<]+)</th>', vs.text)
    assert "devices" in diff_rows and "pipeline (P)" in diff_rows and "split (layers per stage)" in diff_rows
    assert "global batch" in diff_rows and "model" not in diff_rows


def test_model_filter(client: TestClient, plan_body: dict[str, Any]) -> None:
    _post(client, plan_body)
    other = variant(plan_body, 1)
    other["profile"]["model"] = "another-model"
    other_id = _post(client, other)
    r = client.get("/plans", params={"model": "another-model"})
    assert re.findall(r'href="/plans/([0-9a-f]{24})"', r.text) == [other_id]
    assert '<option value="another-model" selected>' in r.text


def test_gantt_has_one_box_per_action(client: TestClient, plan_body: dict[str, Any]) -> None:
    plan_id = _post(client, plan_body)
    plan = client.get(f"/v1/plans/{plan_id}").json()["plan"]
    svg = client.get(f"/plans/{plan_id}/gantt.svg")
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
    api_svg = client.get(f"/v1/plans/{plan_id}/gantt.svg").text
    groups = re.findall(r'<g id="(actions-rank\d+)">', svg.text)
    assert groups == re.findall(r'<g id="(actions-rank\d+)">', api_svg)  # the API's chart: the same code
    assert len(svg.text) == pytest.approx(len(api_svg), rel=0.01)
    per_rank = [len(a.split()) for a in plan["actions"]]
    counted = _boxes_per_rank(svg.text, len(per_rank))
    assert counted == per_rank


def _boxes_per_rank(svg: str, ranks: int) -> list[int]:
    """Shapes (``<path>``, or ``<use>`` of a shared path) inside each ``actions-rank{r}`` group."""
    from xml.etree import ElementTree

    root = ElementTree.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    counts = []
    for r in range(ranks):
        group = root.find(f".//{ns}g[@id='actions-rank{r}']")
        assert group is not None, f"no actions group for rank {r}"
        uses = group.findall(f".//{ns}use")
        counts.append(len(uses) if uses else len(group.findall(f".//{ns}path")))
    return counts


def test_user_input_is_escaped(client: TestClient, plan_body: dict[str, Any]) -> None:
    plan_id = _post(client, evil_body(plan_body))
    for path in ("/plans", f"/plans/{plan_id}", f"/plans/{plan_id}/vs/{plan_id}"):
        text = client.get(path).text
        assert "<script>" not in text, path
        assert "&lt;script&gt;" in text, path
    unknown = client.get(f"/plans/{EVIL}")
    assert unknown.status_code == 404 and unknown.headers["content-type"].startswith("application/json")


def test_unknown_plan_is_404(client: TestClient) -> None:
    r = client.get("/plans/nope")
    assert r.status_code == 404 and "see /plans" in r.json()["message"]
    assert client.get("/plans/nope/vs/nada").status_code == 404


@pytest.fixture()
def token_client(make_app: Callable[..., FastAPI]) -> TestClient:
    return TestClient(make_app(api_token="s3cret"), follow_redirects=False)


def test_pages_need_a_session_when_the_server_has_a_token(token_client: TestClient, plan_body: dict[str, Any]) -> None:
    with token_client as c:
        plan_id = _post(c, plan_body, {"Authorization": "Bearer s3cret"})
        for path in ("/plans", f"/plans/{plan_id}", f"/plans/{plan_id}/gantt.svg", f"/plans/{plan_id}/plan.json"):
            r = c.get(path)
            assert r.status_code == 303 and r.headers["location"].startswith("/login?next=%2Fplans"), path
        assert c.get(f"/plans/{plan_id}", headers={"Authorization": "Bearer s3cret"}).status_code == 303
        form = c.get("/login?next=/plans")
        assert 'type="password" name="token"' in form.text and 'method="post"' in form.text

        wrong = c.post("/login", data={"token": "nope", "next": f"/plans/{plan_id}"})
        assert wrong.status_code == 401 and "wrong token" in wrong.text and SESSION_COOKIE not in wrong.cookies

        ok = c.post("/login", data={"token": "s3cret", "next": f"/plans/{plan_id}"})
        assert ok.status_code == 303 and ok.headers["location"] == f"/plans/{plan_id}"
        assert "s3cret" not in ok.headers["location"]
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "s3cret" not in cookie
        assert c.get(f"/plans/{plan_id}").status_code == 200
        assert c.get("/plans").status_code == 200
        assert c.get("/v1/plans/" + plan_id).status_code == 401  # the API still wants the bearer token

        out = c.post("/logout")
        assert out.status_code == 303
        assert c.get("/plans").status_code == 303


def test_login_redirects_only_to_this_server(token_client: TestClient) -> None:
    with token_client as c:
        for target in ("https://evil.example/", "//evil.example/", "/\\evil.example"):
            r = c.post("/login", data={"token": "s3cret", "next": target})
            assert r.headers["location"] == "/plans", target


def test_session_cookie_is_signed_and_expires() -> None:
    now = 1_800_000_000.0
    value = make_session("tok", now=now)
    assert session_valid(value, "tok", now=now + 10)
    assert not session_valid(value, "other-token", now=now + 10)  # a new server token ends sessions
    assert not session_valid(value, "tok", now=now + 13 * 3600)  # expired
    issued, sig = value.split(".")
    assert not session_valid(f"{int(issued) + 1}.{sig}", "tok", now=now + 10)  # tampered
    assert not session_valid("", "tok", now=now) and not session_valid("garbage", "tok", now=now)
