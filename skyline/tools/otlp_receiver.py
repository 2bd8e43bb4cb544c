"""A real OTLP trace receiver (for the tests and `skyline bench overhead --tracing`): OpenTelemetry's own
gRPC service definition (opentelemetry-proto), served by grpcio in a thread, keeping every span it is sent,
decoded.

    with OtlpReceiver() as rx:          # rx.endpoint: what --otlp-traces-endpoint takes
        ...
        spans = rx.wait_for(lambda spans: ..., timeout_s=30)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from skyline.core.net import free_port


@dataclass
class ReceivedSpan:
    name: str
    service: str  # the resource's service.name
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, time, attributes)
    status: int = 0  # OpenTelemetry's status code: 0 unset, 1 ok, 2 error


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the proto's name
                receiver._take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    def _take(self, request: Any) -> None:
        got = []
        for rs in request.resource_spans:
            service = str(_attrs(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        s.name, service, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.start_time_unix_nano, s.end_time_unix_nano, _attrs(s.attributes),
                        [(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events], s.status.code))
        with self._lock:
            self.spans.extend(got)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.stop(grace=None)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        """The spans of `trace_id` once `done` says they are all there (or what came by `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.of_trace(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)
