"""Prometheus metrics of one gateway: requests by outcome, latency histograms by tier, the queues.

Each app gets its own registry so several gateways (tests) can live in one
process; `/metrics` renders it. Latencies are the gateway's own measurements
(arrival to first token, mean time per output token after the first, gaps
between output frames, arrival to the final frame), the numbers SLO
attainment is judged by. Every request with a tier ends as `slo_met` or
`slo_missed` (a refused, failed or abandoned request missed), so
met / (met + missed) is the attainment `skyline bench` reports.

Every series is a model's (label `model`: the served name of the base model a request named, a LoRA
request's base model's; the default model's too, so one-model dashboards read the same): with
several models through one gateway, each has its own queues, latencies, admissions and refusals. A
request refused before its model was known (401, a body that is not JSON) counts under `model=""`.

The `skyline_queue_*` and `skyline_fleet_*` gauges describe the whole fleet, each model's queues and
workers, read from Redis at scrape time (one pipelined round trip per model): with several
gateways each exports the same values (aggregate with max, not sum).
Workers export their own metrics on their own port (workers/endpoint.py, workers/observe.py).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from skyline.core.keys import Keys
from skyline.core.queues import read_streams
from skyline.core.timeline import TimelineErrors
from skyline.scheduler.elastic import ROLES

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "skyline_gateway_requests", "Requests answered, by tier, route and HTTP status",
            ("model", "tier", "route", "status"), registry=self.registry)
        self.ttft = Histogram(
            "skyline_gateway_ttft_seconds", "Time from arrival to the first output token",
            ("model", "tier"), buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            "skyline_gateway_tpot_seconds", "Mean time per output token after the first",
            ("model", "tier"), buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            "skyline_gateway_e2e_seconds", "Time from arrival to the final frame",
            ("model", "tier"), buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.slo_met = Counter(
            "skyline_gateway_slo_met", "Finished requests that met both their TTFT and TPOT targets",
            ("model", "tier"), registry=self.registry)
        self.admission = Counter(
            "skyline_gateway_admission", "Admission decisions (admit, demote, reject, overloaded) by requested tier",
            ("model", "tier", "decision"), registry=self.registry)
        self.prediction_error = Histogram(
            "skyline_gateway_ttft_prediction_error_seconds",
            "Measured TTFT minus admission control's predicted TTFT (positive = slower than predicted)",
            ("model", "tier"), buckets=(-10, -5, -2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 5, 10),
            registry=self.registry)
        self.in_flight = Gauge(
            "skyline_gateway_in_flight", "Requests waiting for or streaming output", ("model",),
            registry=self.registry)
        self.itl = Histogram(
            "skyline_gateway_itl_seconds", "Gaps between consecutive output frames of a request",
            ("model", "tier"), buckets=_TPOT_BUCKETS, registry=self.registry)
        self.slo_missed = Counter(
            "skyline_gateway_slo_missed",
            "Requests that missed their TTFT or TPOT target, or were refused, failed or abandoned",
            ("model", "tier"), registry=self.registry)
        self.queue_waiting = Gauge(
            "skyline_queue_waiting", "Entries of a work stream no worker has claimed yet (the queue depth)",
            ("model", "stage", "tier"), registry=self.registry)
        self.queue_length = Gauge(
            "skyline_queue_length", "Entries in a work stream, acked ones included until MAXLEN trims them",
            ("model", "stage", "tier"), registry=self.registry)
        self.queue_pending = Gauge(
            "skyline_queue_pending", "Entries claimed by a worker and not yet acknowledged",
            ("model", "stage", "tier"), registry=self.registry)
        self.queue_backlog_tokens = Gauge(
            "skyline_queue_backlog_tokens", "Prompt tokens admitted to a stage and not yet prefilled",
            ("model", "stage", "tier"), registry=self.registry)
        self.dead_letters = Gauge(
            "skyline_dead_letter_length", "Entries in the dead-letter stream", registry=self.registry)
        self.workers = Gauge(
            "skyline_fleet_workers", "Live workers by role (heartbeats)", ("model", "role"),
            registry=self.registry)

    def watch_timeline(self, dropped: Callable[[], int]) -> None:
        """Export the recorder's lost-write count (call once, when it exists)."""
        self.registry.register(TimelineErrors(dropped))

    async def refresh_fleet(self, r, models: list[tuple[str, Keys, dict[str, int]]], tiers: tuple[str, ...]) -> None:
        """Set the queue and fleet gauges from Redis (called at scrape time): `models` is each served
        model's (name, its queues' keys, its live workers by role)."""
        for model, keys, roles in models:
            for s in await read_streams(r, keys, tiers):
                self.queue_waiting.labels(model, s.stage, s.tier).set(s.waiting)
                self.queue_length.labels(model, s.stage, s.tier).set(s.length)
                self.queue_pending.labels(model, s.stage, s.tier).set(s.pending)
                self.queue_backlog_tokens.labels(model, s.stage, s.tier).set(s.backlog_tokens)
            for role in ROLES:
                self.workers.labels(model, role).set(roles.get(role, 0))
        if models:
            self.dead_letters.set(await r.xlen(models[0][1].dead))  # one for the fleet (a shared key)

    def finished(self, tier: str, ttft_s: float | None, tpot_s: float | None, e2e_s: float, slo_met: bool,
                 model: str = "") -> None:
        if ttft_s is not None:
            self.ttft.labels(model, tier).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(model, tier).observe(tpot_s)
        self.e2e.labels(model, tier).observe(e2e_s)

    def verdict(self, tier: str, slo_met: bool, model: str = "") -> None:
        """Once per request with a tier: met, or missed (late, refused, failed, abandoned)."""
        (self.slo_met if slo_met else self.slo_missed).labels(model, tier).inc()

    def count(self, tier: str, route: str, status: int, model: str = "") -> None:
        self.requests.labels(model, tier, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
