"""Plan pages for people: server-rendered HTML (Jinja2 templates in ``api/templates``), no
JavaScript at all.

* ``GET /plans``: the stored plans, newest first (model, devices, predicted step, memory
  headroom), filtered by model with ``?model=``;
* ``GET /plans/{id}``: the summary, the stage table with memory parts, the Gantt and memory
  charts (the SVGs of :mod:`api.charts`), the notes, and the commands that export or run it;
* ``GET /plans/{a}/vs/{b}``: two plans side by side, what differs highlighted.

When the server has an API token, the pages want a session: ``/login`` takes the token in a
form (never in a URL) and sets an HMAC-signed, HttpOnly cookie that expires; changing the
server's token ends every session.  Everything a request supplied (model and layer names,
notes, ids) is escaped: the templates are rendered with autoescape on, and the pages forbid
scripts (``Content-Security-Policy: script-src 'none'``).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, StrictUndefined
from starlette.concurrency import run_in_threadpool

from api.charts import ChartKind, ChartRenderer
from api.deps import SettingsDep, StoreDep
from api.settings import ApiSettings
from api.store import PlanStore, StoredPlan
from planner.schema import Plan

router = APIRouter(include_in_schema=False)

SESSION_COOKIE = "pipeplan_session"
SESSION_TTL_S = 12 * 3600
#: plans listed on /plans
LIST_LIMIT = 100
GIB = float(1 << 30)
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; object-src 'self'; frame-src 'self'; "
    "form-action 'self'; frame-ancestors 'self'; base-uri 'none'"
)


def templates() -> Environment:
    """The pages' Jinja2 environment (one per app: :func:`api.app.create_app` keeps it)."""
    env = Environment(
        loader=PackageLoader("api", "templates"),
        autoescape=True,  # every template, whatever its name: model and layer names are user input
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["gib"] = lambda b: f"{b / GIB:,.2f}"
    env.filters["ms"] = lambda v: f"{v:,.2f}"
    env.filters["pct"] = lambda v: f"{v:.1%}"
    return env


# --------------------------------------------------------------------------- sessions


def _session_key(token: str) -> bytes:
    return hmac.new(token.encode(), b"pipeplan plan pages session v1", hashlib.sha256).digest()


def make_session(token: str, *, now: float) -> str:
    """A cookie value: the issue time and its HMAC under a key derived from the token."""
    issued = str(int(now))
    return f"{issued}.{hmac.new(_session_key(token), issued.encode(), hashlib.sha256).hexdigest()}"


def session_valid(value: str | None, token: str, *, now: float, ttl_s: float = SESSION_TTL_S) -> bool:
    if not value or "." not in value:
        return False
    issued, _, signature = value.partition(".")
    if not issued.isdigit() or not now - ttl_s <= int(issued) <= now + 60:
        return False
    expected = hmac.new(_session_key(token), issued.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature.encode(), expected.encode())


def _signed_in(request: Request, settings: ApiSettings) -> bool:
    if settings.api_token is None:
        return True
    return session_valid(
        request.cookies.get(SESSION_COOKIE), settings.api_token.get_secret_value(), now=time.time()
    )


def _local_path(value: str) -> str:
    """Where to go after login: a path on this server only (no open redirect)."""
    if not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/plans"
    return value


def _to_login(request: Request) -> RedirectResponse:
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(here, safe='')}", status_code=303)


def _page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    env: Environment = request.app.state.templates
    settings: ApiSettings = request.app.state.settings
    html = env.get_template(name).render(auth=settings.api_token is not None, **context)
    return HTMLResponse(
        html,
        status_code=status,
        headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"},
    )


@router.get("/login")
async def login_form(request: Request, next: str = "/plans") -> HTMLResponse:
    return _page(request, "login.html", next=_local_path(next), error="")


@router.post("/login")
async def login(request: Request, settings: SettingsDep) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    token = (form.get("token") or [""])[0]
    target = _local_path((form.get("next") or ["/plans"])[0])
    if settings.api_token is None:
        return RedirectResponse(target, status_code=303)
    expected = settings.api_token.get_secret_value()
    if not hmac.compare_digest(token.encode(), expected.encode()):
        return _page(
            request, "login.html", 401, next=target,
            error="wrong token: give the server's PIPEPLAN_API_TOKEN",
        )
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        make_session(expected, now=time.time()),
        max_age=SESSION_TTL_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return response


@router.post("/logout")
async def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/plans", status_code=307)


# --------------------------------------------------------------------------- views of a plan


@dataclass(frozen=True)
class StageRow:
    index: int
    layers: str
    first: str
    last: str
    devices: str
    recompute: str
    forward_ms: float
    backward_ms: float
    memory_bytes: int
    limit_bytes: int
    parts: dict[str, int]
    headroom: float


@dataclass(frozen=True)
class PlanView:
    """What the pages show of a stored plan."""

    id: str
    model: str
    created: str
    plan: Plan
    devices: int
    device_names: str
    step_ms: float
    throughput: float
    bubble: float
    peak_bytes: int
    headroom: float  # the smallest (limit - predicted) / limit over the stages
    axes: dict[str, str]
    split: list[str]
    stages: list[StageRow]

    @staticmethod
    def of(stored: StoredPlan) -> PlanView:
        plan = Plan.model_validate_json(stored.plan_json)
        rows = []
        for s in plan.stages:
            parts = s.memory_parts.model_dump() if s.memory_parts is not None else {}
            limit = s.memory_limit_bytes
            rows.append(
                StageRow(
                    index=s.index,
                    layers=f"{s.start}:{s.stop}",
                    first=s.layer_names[0] if s.layer_names else "",
                    last=s.layer_names[-1] if s.layer_names else "",
                    devices=", ".join(str(d) for d in s.devices[:16]) + (" ..." if len(s.devices) > 16 else ""),
                    recompute=(
                        "no" if not s.recompute else
                        ("all" if s.recompute_layers is None else f"{s.recompute_layers} layers")
                    ),
                    forward_ms=s.forward_ms,
                    backward_ms=s.backward_ms,
                    memory_bytes=s.memory_bytes,
                    limit_bytes=limit,
                    parts={k: int(v) for k, v in parts.items() if isinstance(v, int) and v},
                    headroom=(limit - s.memory_bytes) / limit if limit else 0.0,
                )
            )
        names = sorted({d.name or "device" for d in plan.cluster.devices})
        axes = {
            "schedule": plan.schedule,
            "pipeline (P)": str(plan.pipeline_degree),
            "virtual stages (V)": str(plan.virtual_stages),
            "data parallel (D)": str(plan.data_parallel_degree),
            "tensor parallel (T)": str(plan.tensor_parallel_degree),
            "context parallel (C)": str(plan.context_parallel_degree),
            "expert parallel (E)": str(plan.expert_parallel_degree),
            "ZeRO stage": str(plan.zero_stage),
            "micro-batches (M)": str(plan.num_microbatches),
            "micro-batch size": str(plan.microbatch_size),
            "global batch": str(plan.global_batch_size),
        }
        return PlanView(
            id=stored.id,
            model=plan.model,
            created=stored.created_at.strftime("%Y-%m-%d %H:%M:%S UTC"),
            plan=plan,
            devices=plan.cluster.num_devices,
            device_names=", ".join(names[:4]),
            step_ms=plan.predicted.step_time_ms,
            throughput=plan.predicted.throughput_samples_per_s,
            bubble=plan.predicted.bubble_fraction,
            peak_bytes=max(s.memory_bytes for s in plan.stages),
            headroom=min(r.headroom for r in rows),
            axes=axes,
            split=[r.layers for r in rows],
            stages=rows,
        )


async def _view(store: PlanStore, plan_id: str) -> PlanView:
    stored = await run_in_threadpool(store.get, plan_id)
    if stored is None:
        raise HTTPException(
            status_code=404,
            detail=f"no plan with id {plan_id!r} on this server: see /plans for the stored plans",
        )
    return await run_in_threadpool(PlanView.of, stored)


def _list_views(store: PlanStore, model: str | None) -> tuple[list[PlanView], list[str]]:
    return [PlanView.of(p) for p in store.recent(limit=LIST_LIMIT, model=model)], store.models()


@router.get("/plans")
async def plan_list(request: Request, settings: SettingsDep, store: StoreDep, model: str = "") -> Response:
    if not _signed_in(request, settings):
        return _to_login(request)
    views, models = await run_in_threadpool(_list_views, store, model or None)
    return _page(request, "plans.html", plans=views, models=models, model=model, limit=LIST_LIMIT)


@router.get("/plans/{plan_id}")
async def plan_page(request: Request, plan_id: str, settings: SettingsDep, store: StoreDep) -> Response:
    if not _signed_in(request, settings):
        return _to_login(request)
    view = await _view(store, plan_id)
    base = str(request.base_url).rstrip("/")
    actions = sum(len(a.split()) for a in view.plan.actions or [])
    return _page(request, "plan.html", p=view, base=base, actions=actions)


@router.get("/plans/{plan_id}/plan.json")
async def plan_json(request: Request, plan_id: str, settings: SettingsDep, store: StoreDep) -> Response:
    """The plan document alone (what ``pipeplan export`` and ``pipeplan run`` read)."""
    if not _signed_in(request, settings):
        return _to_login(request)
    stored = await run_in_threadpool(store.get, plan_id)
    if stored is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r} on this server: see /plans")
    return Response(
        stored.plan_json,
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="plan-{stored.id}.json"'},
    )


async def _chart_page(request: Request, plan_id: str, kind: ChartKind, settings: ApiSettings, store: PlanStore) -> Response:
    if not _signed_in(request, settings):
        return _to_login(request)
    stored = await run_in_threadpool(store.get, plan_id)
    if stored is None:
        raise HTTPException(status_code=404, detail=f"no plan with id {plan_id!r} on this server: see /plans")
    charts: ChartRenderer = request.app.state.charts
    svg = await run_in_threadpool(charts.svg, kind, stored.id, stored.plan_json)
    return Response(svg, media_type="image/svg+xml", headers={"Content-Security-Policy": CSP})


@router.get("/plans/{plan_id}/gantt.svg")
async def gantt_page(request: Request, plan_id: str, settings: SettingsDep, store: StoreDep) -> Response:
    return await _chart_page(request, plan_id, "gantt", settings, store)


@router.get("/plans/{plan_id}/memory.svg")
async def memory_page(request: Request, plan_id: str, settings: SettingsDep, store: StoreDep) -> Response:
    return await _chart_page(request, plan_id, "memory", settings, store)


@dataclass(frozen=True)
class Difference:
    what: str
    a: str
    b: str

    @property
    def differs(self) -> bool:
        return self.a != self.b


def differences(a: PlanView, b: PlanView) -> list[Difference]:
    """The rows of the comparison: axes, split, step and memory, each of both plans."""
    rows = [
        Difference("model", a.model, b.model),
        Difference("devices", f"{a.devices} {a.device_names}", f"{b.devices} {b.device_names}"),
    ]
    rows += [Difference(k, a.axes[k], b.axes.get(k, "")) for k in a.axes]
    rows += [
        Difference("split (layers per stage)", " | ".join(a.split), " | ".join(b.split)),
        Difference("predicted step (ms)", f"{a.step_ms:,.2f}", f"{b.step_ms:,.2f}"),
        Difference("throughput (samples/s)", f"{a.throughput:,.1f}", f"{b.throughput:,.1f}"),
        Difference("bubble", f"{a.bubble:.1%}", f"{b.bubble:.1%}"),
        Difference("peak memory (GiB)", f"{a.peak_bytes / GIB:,.2f}", f"{b.peak_bytes / GIB:,.2f}"),
        Difference("memory headroom", f"{a.headroom:.1%}", f"{b.headroom:.1%}"),
    ]
    return rows


@router.get("/plans/{a}/vs/{b}")
async def compare_page(request: Request, a: str, b: str, settings: SettingsDep, store: StoreDep) -> Response:
    if not _signed_in(request, settings):
        return _to_login(request)
    va, vb = await _view(store, a), await _view(store, b)
    rows = differences(va, vb)
    faster = (vb.step_ms - va.step_ms) / va.step_ms if va.step_ms else 0.0
    return _page(request, "compare.html", a=va, b=vb, rows=rows, changed=sum(r.differs for r in rows), faster=faster)
