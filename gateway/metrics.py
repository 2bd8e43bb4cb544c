"""Prometheus metrics of one gateway: requests by outcome, latency histograms by tier.

Each app gets its own registry so several gateways (tests) can live in one
process; `/metrics` renders it. Latencies are the gateway's own measurements
(arrival to first token, mean time per output token after the first, arrival
to the final frame), the numbers SLO attainment is judged by.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "skyline_gateway_requests", "Requests answered, by tier, route and HTTP status",
            ("tier", "route", "status"), registry=self.registry)
        self.ttft = Histogram(
            "skyline_gateway_ttft_seconds", "Time from arrival to the first output token",
            ("tier",), buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            "skyline_gateway_tpot_seconds", "Mean time per output token after the first",
            ("tier",), buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            "skyline_gateway_e2e_seconds", "Time from arrival to the final frame",
            ("tier",), buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.slo_met = Counter(
            "skyline_gateway_slo_met", "Finished requests that met both their TTFT and TPOT targets",
            ("tier",), registry=self.registry)
        self.admission = Counter(
            "skyline_gateway_admission", "Admission decisions (admit, demote, reject, overloaded) by requested tier",
            ("tier", "decision"), registry=self.registry)
        self.prediction_error = Histogram(
            "skyline_gateway_ttft_prediction_error_seconds",
            "Measured TTFT minus admission control's predicted TTFT (positive = slower than predicted)",
            ("tier",), buckets=(-10, -5, -2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 5, 10),
            registry=self.registry)
        self.in_flight = Gauge(
            "skyline_gateway_in_flight", "Requests waiting for or streaming output", registry=self.registry)

    def finished(self, tier: str, ttft_s: float | None, tpot_s: float | None, e2e_s: float, slo_met: bool) -> None:
        if ttft_s is not None:
            self.ttft.labels(tier).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(tier).observe(tpot_s)
        self.e2e.labels(tier).observe(e2e_s)
        if slo_met:
            self.slo_met.labels(tier).inc()

    def count(self, tier: str, route: str, status: int) -> None:
        self.requests.labels(tier, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
