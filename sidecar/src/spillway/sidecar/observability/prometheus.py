"""The Prometheus endpoint: the live metric rows rendered straight to the text format.

Not through the OTel SDK's Prometheus reader: that one caps each instrument at 2,000 attribute
sets (past it a busy sidecar's jobs fold into ``otel_metric_overflow``), keeps the series of
ended jobs for ever, adds ``otel_scope_*`` labels to every series, and took 8 s per scrape at
10,000 jobs. Here a scrape reads the live state once: a series exists while its job does, and
a scrape of 10,000 jobs takes a fraction of a second (docs/OBSERVABILITY.md).
"""

from __future__ import annotations

import gc
import gzip
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spillway.sidecar.observability.telemetry import (
    METRICS,
    PER_JOB,
    VERDICT_DURATION,
    Telemetry,
    prometheus_name,
)

log = logging.getLogger("spillway.sidecar.observability.prometheus")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _num(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def render(tel: Telemetry) -> str:
    """The exposition text of every metric (docs/OBSERVABILITY.md lists them).

    The cyclic GC is paused meanwhile: a scrape allocates a few objects per series (hundreds
    of thousands at 10,000 jobs) and would otherwise set off full collections over the whole
    heap (the jobs' state) several times per scrape; nothing it allocates forms a cycle.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _render(tel)
    finally:
        if was_enabled:
            gc.enable()


def _render(tel: Telemetry) -> str:
    by = tel.rows_by_name()
    out: list[str] = []
    labels_of: dict[int, str] = {}   # id(attrs) -> rendered labels: rows share their attrs
    for kip, (name, kind, unit, desc) in METRICS.items():
        rows = by.get(kip) or []
        if not rows and kip in PER_JOB:
            continue  # no live job: no series (a sidecar-wide series is shown even at zero)
        prom = prometheus_name(name, kind, unit)
        out.append(f"# HELP {prom} {_escape(desc)}\n# TYPE {prom} {kind}\n")
        for attrs, value in rows:
            lab = labels_of.get(id(attrs))
            if lab is None:
                lab = labels_of[id(attrs)] = "{" + ",".join(
                    f'{k}="{_escape(str(v))}"' for k, v in sorted(attrs.items())) + "}" \
                    if attrs else ""
            out.append(f"{prom}{lab} {_num(value)}\n")
    name, unit, desc = VERDICT_DURATION
    prom = prometheus_name(name, "histogram", unit)
    out.append(f"# HELP {prom} {_escape(desc)}\n# TYPE {prom} histogram\n")
    counts, total = tel.durations.snapshot()
    cum = 0
    for bound, n in zip(tel.durations.boundaries, counts, strict=False):
        cum += n
        out.append(f'{prom}_bucket{{le="{bound!r}"}} {cum}\n')
    out.append(f'{prom}_bucket{{le="+Inf"}} {sum(counts)}\n{prom}_count {sum(counts)}\n'
               f"{prom}_sum {_num(total)}\n")
    return "".join(out)


def serve(tel: Telemetry, host: str, port: int) -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` (and ``/``) on host:port in a daemon thread; `shutdown()` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body = render(tel).encode()
            except Exception:
                log.exception("rendering the metrics failed")
                self.send_error(500, "rendering the metrics failed (see the sidecar log)")
                return
            gz = "gzip" in self.headers.get("Accept-Encoding", "")
            if gz:
                body = gzip.compress(body, compresslevel=1)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            if gz:
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:  # scrapes are not log lines
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="spillway-metrics", daemon=True).start()
    return server
