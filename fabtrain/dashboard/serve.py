"""`fab dashboard`: the collector in the background, the app under waitress."""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import sys

from fabtrain.errors import UserError

DEFAULT_PORT = 8265
MAX_POINTS = 300  # a chart series keeps 300-600 points over the whole run (stride doubling)
TOKEN_ENV = "FABTRAIN_DASHBOARD_TOKEN"


def make_token() -> str:
    """$FABTRAIN_DASHBOARD_TOKEN, else 48 random hex digits (as Jupyter does)."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        if len(token) < 16:
            raise UserError(f"{TOKEN_ENV} is too short: use at least 16 characters (or unset it for a random one)")
        return token
    return secrets.token_hex(24)


def allowed_hosts(host: str, port: int) -> set[str]:
    """The Host header values a browser sends to this dashboard: only ours (DNS rebinding defence)."""
    names = {host}
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_loopback:
        names |= {"127.0.0.1", "localhost", "[::1]"}
    if ip is not None and ip.is_unspecified:
        # Bound to every interface: accept this machine's names and addresses, nothing else.
        names |= {"127.0.0.1", "localhost", "[::1]", socket.gethostname(), socket.getfqdn()}
        try:
            import psutil

            for addrs in psutil.net_if_addrs().values():
                for a in addrs:
                    if a.family == socket.AF_INET:
                        names.add(a.address)
                    elif a.family == socket.AF_INET6:
                        names.add(f"[{a.address.split('%')[0]}]")
        except Exception:
            pass
    if ip is not None and ip.version == 6 and not host.startswith("["):
        names.add(f"[{host}]")
    out = set()
    for n in names:
        out.add(f"{n}:{port}".lower())
        if port == 80:
            out.add(n.lower())
    return out


def _port(value) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise UserError(f"--port must be a number, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise UserError(f"--port must be between 1 and 65535, got {port}")
    return port


def _interval(value) -> float:
    try:
        interval = float(value)
    except (TypeError, ValueError):
        raise UserError(f"--interval must be a number of seconds, got {value!r}") from None
    if not 0.1 <= interval <= 3600:
        raise UserError(f"--interval must be between 0.1 and 3600 seconds, got {interval:g}")
    return interval


def url_for(host: str, port: int, token: str) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/?token={token}"


def build(session, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None,
          refresh_ms: int = 1000, job_id: str | None = None):
    """(app, collector) for a session; the collector is not started yet."""
    from . import create_app
    from fabtrain.controller.streaming import StreamingCollector

    collector = StreamingCollector(session, job_id=job_id, max_points=MAX_POINTS)
    app = create_app({
        "COLLECTOR": collector,
        "DASHBOARD_TOKEN": token or make_token(),
        "ALLOWED_HOSTS": allowed_hosts(host, port),
        "REFRESH_MS": refresh_ms,
    })
    return app, collector


def make_server(app, host: str, port: int, threads: int = 8):
    """The app under waitress, as `fab dashboard` runs it (tests use this too)."""
    import waitress

    # waitress reads a whole body before the app sees the request (spooling past 512 KiB to a
    # temp file); given the app's cap, it answers 413 from the Content-Length header instead.
    # (waitress refuses a body of exactly max_request_body_size; the app allows up to its cap.)
    return waitress.create_server(app, host=host, port=port, threads=threads, ident="fabtrain",
                                  max_request_body_size=app.config["MAX_CONTENT_LENGTH"] + 1)


def serve(session, host: str = "127.0.0.1", port: int = DEFAULT_PORT, interval: float = 1.0,
          job_id: str | None = None, threads: int = 8, out=None) -> None:
    """Run until interrupted. Prints the URL with the token."""
    out = out or sys.stdout
    port, interval = _port(port), _interval(interval)
    token = make_token()
    app, collector = build(session, host, port, token, job_id=job_id)
    try:
        server = make_server(app, host, port, threads)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e} (pick another with --port)") from None
    except ValueError:  # waitress: a host it cannot resolve or parse
        raise UserError(f"--host {host!r}: not an address or host name of this machine") from None
    collector.start(interval)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: the dashboard listens on {host}, not only this machine; anyone who can reach "
              f"port {port} and has the token can kill the job. Prefer an SSH tunnel to 127.0.0.1.", file=out)
    print(f"fabtrain dashboard for cluster {session.cluster.name} ({len(session.cluster.nodes)} nodes), "
          f"polling every {interval:g} s", file=out)
    print(f"    {url_for(host, port, token)}", file=out)
    print("Ctrl+C stops the dashboard (the job goes on).", file=out, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        collector.stop()
        server.close()
