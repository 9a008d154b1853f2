"""Who may talk to the dashboard, checked before any view runs (and before any body is read).

In order, on every request:
1. Host: the Host header must be one this dashboard serves (ALLOWED_HOSTS),
   else 403 — a DNS-rebinding page cannot talk to it under another name.
2. Public: /static/ files, and the page `/` itself, which is code and holds
   no data. `/?token=<token>` (the URL `fab dashboard` prints) must carry the
   right token (403 otherwise); the page keeps it in sessionStorage, removes
   it from the address bar, and sends it as a header from then on.
3. Everything else needs the token in a header: `Authorization: Bearer
   <token>` (or `X-Fabtrain-Token: <token>`), compared in constant time. No
   cookie is set or read: cookies ignore ports, so one for 127.0.0.1 would go
   to every other web app on this machine; sessionStorage is per origin,
   port included. A header is also what a cross-site form cannot send (the
   CSRF defence), and a POST from another Origin is refused outright.
4. A body larger than MAX_CONTENT_LENGTH is refused with 413, after the token
   check (an unauthenticated request gets its 401 without a byte of its body
   read). `fab dashboard` gives waitress the same cap, so waitress answers
   413 from the headers alone instead of spooling the body to a temp file.
GET never changes state.
"""
from __future__ import annotations

import hmac

from flask import current_app, request

# The only request body the dashboard takes is /api/kill's {"grace": 5}.
MAX_BODY_BYTES = 16 * 1024
TOKEN_HEADER = "X-Fabtrain-Token"
PUBLIC_ENDPOINTS = frozenset({"static", "dashboard.plotly_js"})
PAGE_ENDPOINT = "dashboard.index"


class GuardError(Exception):
    """A refused request: status and a one-line reason (views' error handlers render it)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def install(app, error=GuardError) -> None:
    """Run `guard` before every request of app; `error(status, message)` is raised to refuse."""
    app.config.setdefault("MAX_CONTENT_LENGTH", MAX_BODY_BYTES)

    @app.before_request
    def _guard():
        return guard(error)


def token_matches(candidate: str | None) -> bool:
    if not candidate:
        return False
    expected = current_app.config["DASHBOARD_TOKEN"]
    return hmac.compare_digest(candidate.encode("utf-8", "replace"), expected.encode("utf-8"))


def header_token() -> str | None:
    """The token from `Authorization: Bearer <token>` or `X-Fabtrain-Token: <token>`."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get(TOKEN_HEADER, "").strip() or None


def guard(error=GuardError):
    host = (request.headers.get("Host") or "").lower()
    if host not in current_app.config["ALLOWED_HOSTS"]:
        raise error(403, f"Host {host!r} is not served here (DNS rebinding protection); "
                         f"use the URL that fab dashboard printed")
    endpoint = request.endpoint
    if endpoint in PUBLIC_ENDPOINTS or endpoint is None:  # None: a 404 follows
        return _size_ok(error)
    if endpoint == PAGE_ENDPOINT and request.method in ("GET", "HEAD"):
        given = request.args.get("token")
        if given is not None and not token_matches(given):
            raise error(403, "wrong token in the URL (from an earlier dashboard?): "
                             "open the URL that fab dashboard printed")
        return _size_ok(error)
    if request.method not in ("GET", "HEAD", "OPTIONS"):  # anything that may change state
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() != f"{request.scheme}://{host}":
            raise error(403, f"cross-origin request from {origin[:100]!r} refused")
    token = header_token()
    if token is None:
        raise error(401, "token required: send 'Authorization: Bearer <token>' "
                         "(the page does so itself once opened with the URL that fab dashboard printed)")
    if not token_matches(token):
        raise error(403, "wrong token")
    return _size_ok(error)


def _size_ok(error):
    limit = current_app.config.get("MAX_CONTENT_LENGTH")
    length = request.content_length
    if limit is not None and length is not None and length > limit:
        raise error(413, f"request body of {length} bytes refused: at most {limit}")
    return None
