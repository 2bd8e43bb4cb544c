"""A worker's HTTP endpoint: Prometheus metrics and the probes an orchestrator asks.

  GET /metrics  Prometheus text: held requests, queue inside the engine, KV cache
                usage, prefill throughput, request outcomes (labels role, worker), and the
                request events' metrics (workers/observe.py); every series also has `model`,
                the served name of the model the worker serves (a worker serves one)
  GET /ready    200 once the engine is up and the worker claims work; 503 before
                that and while it drains (SIGTERM: stops claiming, finishes its work)
  GET /health   200 while the process runs

Served by a thread rather than the worker's event loop: a vLLM engine blocks
the loop for its whole start-up (minutes for a large model) and the probes
must still be answered then. The numbers are read from
the runtime's heartbeat snapshot (`runtime.info`, refreshed every
`heartbeat_s`) and its counters; plain reads of ints and floats, no locking.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("skyline.worker.endpoint")

# name -> (help, attribute of runtime.info). KEDA's Prometheus trigger for decode
# scale-out reads skyline_worker_kv_usage (deploy/kubernetes/*/keda.yaml).
GAUGES = {
    "skyline_worker_running": ("Requests this worker holds (claimed, not finished)", "running"),
    "skyline_worker_waiting": ("Requests waiting inside the engine", "waiting"),
    "skyline_worker_kv_usage": ("KV cache usage of the engine, 0..1", "kv_usage"),
    "skyline_worker_prompt_tokens_in_flight": ("Prompt tokens held by the engine (a prefill worker: all it holds; others: prompts being computed)", "running_tokens"),
    "skyline_worker_prefill_tokens_per_second": ("Prefill: measured throughput (0 = not measured yet)",
                                                 "tokens_per_s"),
}
REQUESTS_COUNTER = "skyline_worker_requests"  # exported as skyline_worker_requests_total{outcome=...}
READY_GAUGE = "skyline_worker_ready"


class _RuntimeCollector:
    """Reads the runtime at scrape time: nothing to keep in sync."""

    def __init__(self, endpoint: WorkerEndpoint):
        self.endpoint = endpoint

    def collect(self):
        rt = self.endpoint.runtime
        labels = ["role", "worker"]
        values = [rt.role, rt.worker_id]
        for name, (doc, attr) in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(getattr(rt.info, attr, 0) or 0))
            yield g
        ready = GaugeMetricFamily(READY_GAUGE, "1 while the worker claims work", labels=labels)
        ready.add_metric(values, 1.0 if self.endpoint.ready else 0.0)
        yield ready
        outcomes = CounterMetricFamily(REQUESTS_COUNTER, "Requests by outcome", labels=[*labels, "outcome"])
        for outcome, n in dict(rt.counters).items():
            outcomes.add_metric([*values, outcome], float(n))
        yield outcomes


class _WithLabel:
    """A registry's metrics with one more label on every series: a worker serves one model, so each of
    its series is that model's, as the gateway's per-request series are (label `model`)."""

    def __init__(self, registry: CollectorRegistry, name: str, value: Any):
        self.registry, self.name, self.value = registry, name, value

    def collect(self):
        value = self.value() if callable(self.value) else self.value
        for family in self.registry.collect():  # fresh objects each scrape: changed in place
            family.samples = [s._replace(labels={**s.labels, self.name: value}) for s in family.samples]
            yield family


class WorkerEndpoint:
    """The HTTP endpoint of one worker (see the module docstring)."""

    def __init__(self, runtime: Any, host: str, port: int = 0):
        self.runtime = runtime
        self.host = host
        self.port = port
        self._started = False
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RuntimeCollector(self))
        self._server: ThreadingHTTPServer | None = None

    @property
    def ready(self) -> bool:
        stopping = getattr(self.runtime, "stopping", None)
        return self._started and not (stopping is not None and stopping.is_set())

    def mark_ready(self) -> None:
        """Called once the engine is up and the worker starts claiming."""
        self._started = True

    def start(self) -> int:
        """Listen on host:port (0 = a free port) in a daemon thread; returns the port."""
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    labelled = _WithLabel(endpoint.registry, "model", lambda: getattr(endpoint.runtime.info, "model", ""))
                    self._reply(200, generate_latest(labelled), CONTENT_TYPE_LATEST)
                elif path == "/ready":
                    ok = endpoint.ready
                    self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                elif path == "/health":
                    self._reply(200, b"ok\n")
                else:
                    self._reply(404, b"not found: /metrics, /ready, /health\n")

            def _reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:  # probes every few seconds: not worth a log line
                pass

        server_cls = ThreadingHTTPServer
        if ":" in self.host:  # an IPv6 address
            server_cls = type("ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        self._server = server_cls((self.host.strip("[]"), self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="worker-endpoint", daemon=True).start()
        log.info("worker endpoint on http://%s:%d (/metrics /ready /health)", self.host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
