"""The coordinator's read-only status page, `/api/status` (JSON) and `/metrics` (Prometheus text).

Each request copies the coordinator's view under its lock (`Coordinator.page_status`) and
serializes and writes it after the lock is released, so a slow or stalled browser never
delays membership. The page is static files shipped with the package (no scripts from
elsewhere: it works offline) under a strict Content-Security-Policy; its script builds the
DOM with `textContent`, so whatever a node sends is shown as text, never as markup.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prime_mesh.errors import MeshError
from prime_mesh.progress import PROGRESS_FIELDS

log = logging.getLogger("prime_mesh.status")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_STATIC = {
    "/": ("status.html", "text/html; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}
# progress field -> (Prometheus name, help)
_GAUGES = {
    name: (
        f"prime_mesh_node_{'tokens_per_second' if name == 'tokens_per_s' else name}",
        f"last reported {what}",
    )
    for name, (what, _) in PROGRESS_FIELDS.items()
}


def require_status_extra() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise MeshError(
            "the status page needs prometheus-client: pip install 'prime-mesh[status]'"
        ) from None
    return prometheus_client


class _Collector:
    """One scrape's metrics, from one copy of the coordinator's view."""

    def __init__(self, page: dict) -> None:
        self.page = page

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        page = self.page
        yield GaugeMetricFamily("prime_mesh_epoch", "current membership epoch", value=page["epoch"])
        yield GaugeMetricFamily(
            "prime_mesh_members", "nodes in the current epoch", value=len(page["members"])
        )
        states = GaugeMetricFamily("prime_mesh_nodes", "known nodes by state", labels=["state"])
        for state in ("member", "joining", "registering", "evicted", "left"):
            states.add_metric([state], sum(n["state"] == state for n in page["nodes"]))
        yield states
        events = CounterMetricFamily(
            "prime_mesh_membership_events", "membership events kept in history", labels=["kind"]
        )
        for kind in ("formed", "joined", "left", "evicted", "rebuilt"):
            events.add_metric([kind], sum(e["kind"] == kind for e in page["events"]))
        yield events
        live = [n for n in page["nodes"] if n["state"] not in ("evicted", "left")]
        age = GaugeMetricFamily(
            "prime_mesh_node_heartbeat_age_seconds",
            "seconds since the node's oldest local rank last beat",
            labels=["node_id"],
        )
        for n in live:
            if n["last_heartbeat_age"] is not None:
                age.add_metric([n["node_id"]], n["last_heartbeat_age"])
        yield age
        for field, (name, help_text) in _GAUGES.items():
            gauge = GaugeMetricFamily(name, help_text, labels=["node_id"])
            for n in live:
                if field in n["progress"]:
                    gauge.add_metric([n["node_id"]], n["progress"][field])
            yield gauge


def render_metrics(page: dict) -> tuple[bytes, str]:
    """`page` (a `Coordinator.page_status()`) in the Prometheus text format, and its type."""
    prom = require_status_extra()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(page))
    return prom.generate_latest(registry), prom.CONTENT_TYPE_LATEST


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "prime-mesh"
    sys_version = ""

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path in _STATIC:
            name, ctype = _STATIC[path]
            data = (resources.files("prime_mesh") / "static" / name).read_bytes()
        elif path == "/api/status":
            data, ctype = json.dumps(self.server.page()).encode(), "application/json"
        elif path == "/metrics":
            data, ctype = render_metrics(self.server.page())
        else:
            self.send_error(404, "not found: try /, /api/status or /metrics")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    page: Any


class _Server6(_Server):
    address_family = socket.AF_INET6


class StatusServer:
    """Serves one coordinator's status page; `Coordinator.serve_status()` starts one."""

    def __init__(self, coordinator: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        require_status_extra()  # a clear error now rather than on the first scrape
        self.host, self.port = host, port
        self._coordinator = coordinator
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> StatusServer:
        server_class = _Server6 if ":" in self.host else _Server
        try:
            httpd = server_class((self.host, self.port), _Handler)
        except OSError as e:
            raise OSError(
                f"cannot serve the status page on {self.host}:{self.port} ({e.strerror}); "
                "pick another status port"
            ) from None
        httpd.page = self._coordinator.page_status
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._thread = threading.Thread(target=httpd.serve_forever, name="mesh-status", daemon=True)
        self._thread.start()
        log.info("status page at %s", self.url)
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
