"""The dashboard's routes: the page, the JSON API and /metrics.

Who may call them is checked before any of them runs: see guard.py (Host,
the token in a header, body size). GET never changes state.
"""
from __future__ import annotations

import gzip
import re
import time
from functools import lru_cache
from pathlib import Path

from flask import (Blueprint, Response, current_app, jsonify, make_response, render_template,
                   request, send_file)
from werkzeug.exceptions import HTTPException

from fabtrain.backends.results import Stopped
from fabtrain.contract import jobid
from fabtrain.errors import UserError
from fabtrain.remote.transport import NodeError

from . import api, prometheus

bp = Blueprint("dashboard", __name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
GZIP_MIN = 1400  # bytes; smaller replies are not worth compressing
# What the Kill button's answer says of each process a node stopped (contract.opreplies.Killed), where given.
KILLED_SHOWN = ("job_id", "name", "pid", "child", "orphan", "signal")


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _wants_json() -> bool:
    return request.path.startswith("/api/") or request.path == "/metrics"


def _error(status: int, message: str):
    if _wants_json():
        response = jsonify(error=message, status=status)
    else:
        response = make_response(render_template("error.html", status=status, message=message), status)
    response.status_code = status
    return response


def register_error_handlers(app) -> None:
    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        return _error(e.status, e.message)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        message = {404: f"no such endpoint: {request.method} {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(e.code, e.description)
        response = _error(e.code or 500, message)
        if e.code == 405 and getattr(e, "valid_methods", None):
            response.headers["Allow"] = ", ".join(e.valid_methods)
        return response

    @app.errorhandler(Exception)
    def crash(e: Exception):  # never a traceback in a reply
        current_app.logger.exception("dashboard error on %s", request.path)
        return _error(500, f"internal error: {type(e).__name__}")


@bp.after_app_request
def headers(response: Response) -> Response:
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    response.headers.setdefault("X-Frame-Options", "DENY")  # no clickjacking of the kill button
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
    if request.path.startswith("/api/") or request.path in ("/", "/metrics"):
        response.headers["Cache-Control"] = "no-store"
    return _maybe_gzip(response)


def _maybe_gzip(response: Response) -> Response:
    if (response.direct_passthrough or response.status_code != 200 or "Content-Encoding" in response.headers
            or "gzip" not in request.headers.get("Accept-Encoding", "").lower()
            or not (response.mimetype.startswith("application/json") or response.mimetype.startswith("text/"))):
        return response
    data = response.get_data()
    if len(data) < GZIP_MIN:
        return response
    # Level 1 for the big ones (a page load's full metrics): 3x faster than 5, 1/4 bigger.
    response.set_data(gzip.compress(data, compresslevel=1 if len(data) > 65536 else 5))
    response.headers["Content-Encoding"] = "gzip"
    response.headers["Vary"] = "Accept-Encoding"
    return response


# -- parameters ---------------------------------------------------------------------------


def _int_arg(name: str, default: int, lo: int, hi: int) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be an integer, got {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise ApiError(400, f"parameter {name!r} must be between {lo} and {hi}, got {value}")
    return value


def _float_arg(name: str) -> float | None:
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be a number, got {raw[:40]!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ApiError(400, f"parameter {name!r} must be a finite number")
    return value


def _no_unknown_args(*known: str) -> None:
    unknown = sorted(set(request.args) - set(known) - {"token"})
    if unknown:
        raise ApiError(400, f"unknown parameter {unknown[0]!r}; this endpoint takes: {', '.join(known) or 'none'}")


def _collector():
    return current_app.config["COLLECTOR"]


# -- the page and its assets ------------------------------------------------------------------


@bp.get("/")
def index():
    # The page is code, no data: the token (from ?token= once, then sessionStorage) fetches the data.
    return render_template("index.html", refresh_ms=int(current_app.config["REFRESH_MS"]))


@lru_cache(maxsize=1)
def _plotly_path() -> Path:
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


@lru_cache(maxsize=1)
def _plotly_gzip() -> bytes:
    return gzip.compress(_plotly_path().read_bytes(), compresslevel=6)


@bp.get("/static/plotly.min.js")
def plotly_js():
    """plotly.js from the installed plotly package: never a CDN (clusters are often offline)."""
    try:
        path = _plotly_path()
    except (ImportError, FileNotFoundError):
        raise ApiError(404, "plotly.min.js not found: pip install plotly") from None
    if "gzip" in request.headers.get("Accept-Encoding", "").lower():
        response = make_response(_plotly_gzip())
        response.headers["Content-Encoding"] = "gzip"
        response.headers["Vary"] = "Accept-Encoding"
        response.mimetype = "text/javascript"
    else:
        response = send_file(path, mimetype="text/javascript", conditional=True)
    response.headers["Cache-Control"] = "public, max-age=86400"
    return response


# -- JSON API ---------------------------------------------------------------------------------


@bp.get("/api/cluster")
def api_cluster():
    _no_unknown_args()
    return jsonify(api.cluster_view(_collector().snapshot()))


@bp.get("/api/job")
def api_job():
    _no_unknown_args()
    cfg = current_app.config
    snap = _collector().snapshot()
    view = api.job_view(snap, float(cfg["STALE_AFTER"]), current_app.extensions["fabtrain_ended"])
    view["scheduler"] = cfg["SCHEDULER_LINE"](snap) if cfg.get("SCHEDULER_LINE") else None  # Slurm's own state
    return jsonify(view)


@bp.get("/api/metrics")
def api_metrics():
    _no_unknown_args("since")
    since = request.args.get("since")
    if since is not None and not re.fullmatch(r"[0-9a-f]{1,16}-[0-9]{1,12}", since):
        raise ApiError(400, "parameter 'since' must be the 'cursor' of a previous /api/metrics reply")
    text = current_app.extensions["fabtrain_cursor"].export_json(_collector(), since)
    return Response(text, mimetype="application/json")


@bp.get("/api/events")
def api_events():
    _no_unknown_args("limit", "since")
    limit = _int_arg("limit", int(current_app.config["EVENTS_LIMIT"]), 1, 10000)
    return jsonify(api.events_view(_collector().snapshot(), limit, _float_arg("since")))


@bp.get("/api/logs/<node>/<process>")
def api_logs(node: str, process: str):
    _no_unknown_args("offset")
    collector = _collector()
    snap = collector.snapshot()
    seen = snap.node(node)
    if seen is None:
        raise ApiError(404, f"unknown node {node!r}; nodes: {', '.join(n.name for n in snap.nodes)}")
    if not NAME_RE.match(process):
        raise ApiError(400, f"bad process name {process!r}")
    known = [p["name"] for p in seen.processes]
    if process not in known:
        raise ApiError(404, f"no process {process!r} on node {node!r}"
                            + (f"; processes: {', '.join(known)}" if known else " (no job seen there yet)"))
    since = _int_arg("offset", -1, -1, 1 << 62)
    tail = collector.follow_log(node, process)
    unchanged = tail.offset is not None and since == tail.offset
    return jsonify(node=node, process=process, offset=tail.offset, unchanged=unchanged,
                   lines=[] if unchanged else tail.lines)


@bp.get("/api/stacks/<node>")
def api_stacks(node: str):
    """Every thread's stack of each process of `node`, as saved before a hang's teardown (the files
    `fab logs --stacks` prints), asked of the node when the page expands a hang event."""
    _no_unknown_args()
    collector = _collector()
    snap = collector.snapshot()
    seen = snap.node(node)
    if seen is None:
        raise ApiError(404, f"unknown node {node!r}; nodes: {', '.join(n.name for n in snap.nodes)}")
    job_id = seen.job_id or snap.verdict.job_id
    if job_id is None:
        raise ApiError(404, f"no job seen on node {node!r} yet")
    from fabtrain.controller import lifecycle  # as the Kill button's kill_all: only when asked

    try:
        found = lifecycle.stacks(collector.session, node, job_id)
    except NodeError as e:
        raise ApiError(502, str(e)) from None
    return jsonify(node=node, job_id=job_id, stacks=found)


def _history():
    """The run history (fabtrain.controller.history.History): config HISTORY, else over the collector's session."""
    history = current_app.config.get("HISTORY")
    if history is None:
        from fabtrain.controller.history import History

        history = current_app.config["HISTORY"] = History(_collector().session)
    return history


@bp.get("/api/jobs")
def api_jobs():
    _no_unknown_args()
    return jsonify(_history().jobs())


@bp.get("/api/jobs/<job_id>")
def api_job_history(job_id: str):
    _no_unknown_args()
    why = jobid.problem(job_id)
    if why:
        raise ApiError(400, why)
    detail = _history().job(job_id)
    if detail is None:
        raise ApiError(404, f"no node has a job {job_id!r}")
    return jsonify(detail)


@bp.post("/api/kill")
def api_kill():
    _no_unknown_args()
    grace = float(current_app.config["KILL_GRACE"])
    if request.content_length:
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object, e.g. {\"grace\": 5}")
        unknown = sorted(set(body) - {"grace"})
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r}; the body takes: grace")
        if "grace" in body:
            g = body["grace"]
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= 600:
                raise ApiError(400, "'grace' must be a number of seconds between 0 and 600")
            grace = float(g)
    started = time.time()
    current_app.logger.warning("kill requested from %s (grace %.1f s)", request.remote_addr, grace)
    try:
        stopped = current_app.config["KILL"](grace)
    except UserError as e:  # the place could not be told (Slurm's scancel, its login node): its one line
        raise ApiError(502, str(e)) from None
    if isinstance(stopped, list):  # a KILL that gives only the nodes' replies
        stopped = Stopped.of_nodes(stopped)
    nodes = []
    for r in stopped.replies:
        if not r.ok:
            nodes.append({"node": r.node, "ok": False, "error": r.error})
            continue
        nodes.append({"node": r.node, "ok": True, "left": r.value.left,
                      "killed": [{name: getattr(k, name) for name in KILLED_SHOWN if getattr(k, name) is not None}
                                 for k in r.value.killed]})
    # place: the place's own word where it stopped the job (Slurm's state of each job it cancelled)
    return jsonify(ok=stopped.clean, seconds=round(time.time() - started, 2), nodes=nodes, place=stopped.place,
                   problem=stopped.problem)


# -- Prometheus ---------------------------------------------------------------------------------


@bp.get("/metrics")
def metrics():
    _no_unknown_args()
    text = prometheus.render(_collector().snapshot(), time.time())
    return Response(text, mimetype="text/plain", content_type="text/plain; version=0.0.4; charset=utf-8")
