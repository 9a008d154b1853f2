"""fabtrain's dashboard: one page for a multi-node training job.

`create_app(config)` is the application factory (as in Flask's tutorial); the
routes live in the `views` blueprint, the page in templates/ and static/.
The app reads a Collector (fabtrain.controller.collector) only through
`snapshot()`, `series_since(cursor)` and `follow_log(node, process)` (and its
`session`, whose backend the Kill button and the header's place line go
through: fabtrain.backends), so tests can inject one over a real job or
over fabricated node files. `serve` runs it under waitress for `fab dashboard`.
Who may call what: guard.py.
"""
from __future__ import annotations

from typing import Any, Callable

from flask import Flask

from fabtrain.contract.states import STOP_GRACE

from .guard import MAX_BODY_BYTES

KILLED_BY = "the dashboard's Kill button"  # of contract.states.KILLERS: what the job's events and state name

DEFAULTS: dict[str, Any] = {
    "DASHBOARD_TOKEN": None,  # required: every request but the page and static files carries it in a header
    "ALLOWED_HOSTS": ("127.0.0.1", "localhost"),  # Host header values served (DNS rebinding defence)
    "MAX_CONTENT_LENGTH": MAX_BODY_BYTES,  # bigger bodies: 413 (serve gives waitress the same cap)
    "REFRESH_MS": 1000,  # how often the page polls the JSON API
    "STALE_AFTER": 15.0,  # seconds without a metrics record before a running trainer is stale
    "EVENTS_LIMIT": 200,  # default number of events /api/events returns
    "KILL_GRACE": STOP_GRACE,  # seconds between SIGTERM and SIGKILL for the kill button
}


def create_app(config: dict | None = None) -> Flask:
    """Build the dashboard app.

    config keys (besides Flask's own):
      COLLECTOR        the Collector (required)
      DASHBOARD_TOKEN  the secret token (required)
      ALLOWED_HOSTS    Host header values accepted, e.g. ("127.0.0.1:8265", "localhost:8265")
      KILL             callable(grace) -> a fabtrain.backends.results.Stopped (or only its node replies: a list
                       of fabtrain.remote.transport.Reply, each answered one's value a contract.opreplies.Kill);
                       default: the kill_all of the collector's session's backend, by the dashboard's Kill button
      SCHEDULER_LINE   callable(snapshot) -> str or None: the place's own line on the job; default: the one the
                       cluster's backend's `watch` gives (Slurm's state of the job), else none
      HISTORY          the run history for /api/jobs (fabtrain.controller.history.History); default:
                       one over the collector's session, made on first use
      REFRESH_MS, STALE_AFTER, EVENTS_LIMIT, KILL_GRACE, MAX_CONTENT_LENGTH: see DEFAULTS
    """
    app = Flask(__name__, static_folder="static", template_folder="templates")
    app.config.update(DEFAULTS)
    app.config.update(config or {})
    if app.config.get("COLLECTOR") is None:
        raise ValueError("create_app: config['COLLECTOR'] is required (an fabtrain.controller.collector.Collector)")
    token = app.config.get("DASHBOARD_TOKEN")
    if not token or not isinstance(token, str):
        raise ValueError("create_app: config['DASHBOARD_TOKEN'] must be a non-empty string")
    app.config["ALLOWED_HOSTS"] = frozenset(h.lower() for h in app.config["ALLOWED_HOSTS"])
    if app.config.get("KILL") is None:
        app.config["KILL"] = _default_kill(app.config["COLLECTOR"])
    if "SCHEDULER_LINE" not in app.config:
        app.config["SCHEDULER_LINE"] = _default_scheduler_line(app.config["COLLECTOR"])
    # JSON as small as it gets: the page polls it every second.
    app.json.compact = True
    app.json.sort_keys = False

    from . import guard, views
    from .api import MetricsCursor

    app.extensions["fabtrain_cursor"] = MetricsCursor()
    app.extensions["fabtrain_ended"] = {}
    guard.install(app, views.ApiError)  # before the blueprint: refuse before any view or body is touched
    app.register_blueprint(views.bp)
    views.register_error_handlers(app)
    return app


def _default_scheduler_line(collector) -> Callable | None:
    session = getattr(collector, "session", None)
    if session is None:
        return None
    from fabtrain.backends import backend_for
    from fabtrain.errors import UserError

    try:
        return backend_for(session.cluster).watch(session).place_line
    except UserError:  # a place fab cannot follow (pods): the page has the nodes' word only
        return None


def _default_kill(collector) -> Callable:
    def kill(grace: float):
        from fabtrain.backends import backend_for

        return backend_for(collector.session.cluster).kill_all(collector.session, grace=grace, by=KILLED_BY)
    return kill
