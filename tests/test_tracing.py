"""OpenTelemetry traces across the fleet's processes (skyline/core/tracing.py).

A sim fleet of processes (gateway, one prefill and one decode worker, every prompt computed on the
prefill worker) started with `--otlp-traces-endpoint` pointing at a real OTLP receiver (OpenTelemetry's
gRPC trace service, skyline/tools/otlp_receiver.py): one request, sent by the `openai` client with a W3C
`traceparent`, makes one trace across the three processes, joined to the client's span. Then the
span rules themselves, on OpenTelemetry's in-memory exporter: a worker's stay that fails, is re-queued
or is handed on, an elastic worker's stay, and the bound on what a process remembers.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from tests.fleet import Fleet
from skyline.tools.otlp_receiver import OtlpReceiver

MODEL = "skyline-sim"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(redis_url, tmp_path_factory):
    # Spans leave each process every 200 ms (the batch processor's default is 5 s).
    with OtlpReceiver() as rx, mock.patch.dict(os.environ, {"OTEL_BSP_SCHEDULE_DELAY": "200"}):
        f = Fleet(redis_url, "traced", "sim", tmp_path_factory.mktemp("tracing-logs"),
                  extra=["--otlp-traces-endpoint", rx.endpoint])
        with f.running({"prefill-0": ("prefill",), "decode-0": ("decode",)}, timeout_s=120):
            yield rx, f


def _complete(spans) -> bool:
    names = [s.name for s in spans]
    return (any(n.startswith("chat ") for n in names) and names.count("skyline.worker") == 2
            and "skyline.prefill.compute" in names)


def test_one_request_is_one_trace_across_the_gateway_and_both_workers(traced):
    rx, fleet = traced
    out = fleet.client(timeout_s=60).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=8, temperature=0,
        extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert out.usage.completion_tokens == 8
    spans = rx.wait_for(CLIENT_TRACE, _complete, timeout_s=60)
    assert _complete(spans), [(s.name, s.service) for s in spans]

    root = next(s for s in spans if s.name == f"chat {MODEL}")
    assert root.service == "skyline-gateway" and root.parent_id == CLIENT_SPAN  # joined to the client's span
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.usage.output_tokens"] == 8
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["skyline.route"] == "disagg" and root.attributes["skyline.slo_met"] in (True, False)
    assert {"admitted", "enqueued"} <= {e[0] for e in root.events}

    stays = {s.attributes["skyline.stage"]: s for s in spans if s.name == "skyline.worker"}
    prefill, decode = stays["prefill"], stays["decode"]
    assert prefill.attributes["skyline.worker.id"] == "prefill-0" and prefill.service == "skyline-worker"
    assert decode.attributes["skyline.worker.id"] == "decode-0"
    assert prefill.parent_id == decode.parent_id == root.span_id
    assert prefill.attributes["skyline.left"] == "kv_handle_published"
    assert decode.attributes["skyline.left"] == "finished" and decode.attributes["gen_ai.usage.output_tokens"] == 8
    assert "first_token" in {e[0] for e in decode.events}
    compute = next(s for s in spans if s.name == "skyline.prefill.compute")
    assert compute.parent_id == prefill.span_id
    queues = {s.attributes["skyline.stage"]: s for s in spans if s.name == "skyline.queue"}
    assert set(queues) == {"prefill", "decode"} and all(q.parent_id == root.span_id for q in queues.values())

    # In order, inside the root (the events' times are milliseconds: a millisecond of slack).
    ms = 1_000_000
    assert root.start_ns - ms <= queues["prefill"].start_ns <= queues["prefill"].end_ns <= prefill.start_ns + ms
    assert prefill.start_ns <= compute.start_ns <= compute.end_ns <= prefill.end_ns
    assert prefill.end_ns - ms <= queues["decode"].start_ns <= decode.start_ns + ms
    assert decode.end_ns <= root.end_ns + ms
    assert len({s.trace_id for s in spans}) == 1 and all(s.status != 2 for s in spans)


def test_a_request_without_trace_context_starts_a_trace_of_its_own(traced):
    rx, fleet = traced
    before = {s.trace_id for s in rx.spans}
    fleet.client(timeout_s=60).completions.create(model=MODEL, prompt="no context", max_tokens=4)
    found: list = []

    def new_root(_spans) -> bool:
        found[:] = [s for s in rx.spans if s.trace_id not in before and s.name == f"text_completion {MODEL}"]
        return bool(found)

    rx.wait_for("", new_root, timeout_s=60)
    assert len(found) == 1 and found[0].parent_id == ""
    assert found[0].attributes["gen_ai.operation.name"] == "text_completion"
    spans = rx.wait_for(found[0].trace_id, lambda s: sum(x.name == "skyline.worker" for x in s) == 2, timeout_s=60)
    assert sum(s.name == "skyline.worker" for s in spans) == 2


def test_a_batch_is_one_trace_its_lines_requests_under_the_runners_span(traced, tmp_path):
    import json
    import time

    rx, fleet = traced
    fleet.start("runner", ["batch-runner", *fleet._common(), "--gateway-url", fleet.url, "--name", "traced-runner"])
    client = fleet.client(timeout_s=60)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": MODEL, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": f"line {i}"}]}}) + "\n"
                            for i in range(3)))
    with path.open("rb") as fh:
        uploaded = client.files.create(file=fh, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 90
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    found: list = []

    def batch_span(_spans) -> bool:
        found[:] = [s for s in rx.spans if s.name == "skyline.batch" and s.attributes["skyline.batch.id"] == batch.id]
        return bool(found)

    rx.wait_for("", batch_span, timeout_s=60)
    assert len(found) == 1 and found[0].service == "skyline-batch-runner", [s.name for s in rx.spans]
    job = found[0]
    assert job.attributes["skyline.batch.status"] == "completed" and job.attributes["skyline.batch.sent"] == 3
    spans = rx.wait_for(job.trace_id, lambda s: sum(x.name == f"chat {MODEL}" for x in s) == 3, timeout_s=60)
    roots = [s for s in spans if s.name == f"chat {MODEL}"]
    assert len(roots) == 3 and all(s.parent_id == job.span_id for s in roots)
    assert all(s.attributes["skyline.tier"] == "batch" for s in roots)
    fleet.stop("runner")


# -- the span rules, on OpenTelemetry's in-memory exporter ----------------------------------------


@pytest.fixture
def memory():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def _gateway_context(tracer) -> dict[str, str]:
    from skyline.core.tracing import RequestTraces

    return RequestTraces(tracer, "gateway").start("r1", "chat m", 1000.0, None, {"gen_ai.request.model": "m"})


def test_a_stay_that_fails_is_an_error_and_a_requeued_one_ends_where_it_left(memory):
    from skyline.core.tracing import RequestTraces

    tracer, exporter = memory
    carrier = _gateway_context(tracer)
    worker = RequestTraces(tracer, "decode-0")
    worker.adopt("r1", carrier)
    worker.on_event("r1", "decode_claimed", 1010.0, {"tier": "standard", "wait_ms": 10})
    worker.on_event("r1", "preempted", 1020.0, {"for_tier": "interactive"})
    worker.on_event("r1", "requeued", 1030.0, {"stage": "decode", "reason": "preempted"})
    worker.on_event("r1", "first_token", 1040.0, {})  # after it left: no span of this worker has it
    worker.adopt("r1", carrier)  # claimed again
    worker.on_event("r1", "decode_claimed", 1050.0, {"tier": "standard", "wait_ms": 20})
    worker.on_event("r1", "failed", 1060.0, {"reason": "engine_dead", "status": 500})
    stays = [s for s in exporter.get_finished_spans() if s.name == "skyline.worker"]
    assert [(s.start_time, s.end_time) for s in stays] == [(1010 * 10**6, 1030 * 10**6), (1050 * 10**6, 1060 * 10**6)]
    assert stays[0].attributes["skyline.left"] == "requeued" and [e.name for e in stays[0].events] == ["preempted"]
    assert stays[0].status.is_ok and stays[1].status.status_code.name == "ERROR"
    queues = [s for s in exporter.get_finished_spans() if s.name == "skyline.queue"]
    assert [(s.start_time, s.end_time) for s in queues] == [(1000 * 10**6, 1010 * 10**6), (1030 * 10**6, 1050 * 10**6)]
    assert worker.carrier("r1") is None  # nothing of it is open here


def test_an_elastic_stay_computes_pulls_and_decodes_under_one_span(memory):
    from skyline.core.tracing import RequestTraces

    tracer, exporter = memory
    worker = RequestTraces(tracer, "elastic-0")
    worker.adopt("r1", _gateway_context(tracer))
    worker.on_event("r1", "prefill_claimed", 1010.0, {"tier": "standard", "wait_ms": 0})
    worker.on_event("r1", "decode_placed", 1010.5, {"on": "elastic-0", "why": "fewest_streams_here"})
    inside = worker.carrier("r1")
    worker.on_event("r1", "kv_transfer", 1030.0, {"ms": 15, "tokens": 300})
    worker.on_event("r1", "first_token", 1030.0, {"ttft_ms": 30})
    worker.on_event("r1", "finished", 1090.0, {"completion_tokens": 6})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    stay, pull = spans["skyline.worker"], spans["skyline.kv_transfer"]
    assert pull.parent.span_id == stay.context.span_id and pull.start_time == 1015 * 10**6
    assert [e.name for e in stay.events] == ["decode_placed", "first_token"]
    assert stay.attributes["gen_ai.usage.output_tokens"] == 6
    assert f"{stay.context.span_id:016x}" in inside["traceparent"]  # what its engine's span joins


def test_a_process_remembers_a_bounded_number_of_requests(memory, monkeypatch):
    from skyline.core import tracing

    tracer, exporter = memory
    monkeypatch.setattr(tracing, "MAX_TRACKED", 3)
    worker = tracing.RequestTraces(tracer, "decode-0")
    carrier = _gateway_context(tracer)
    for i in range(5):
        worker.adopt(f"r{i}", carrier)
        worker.on_event(f"r{i}", "decode_claimed", 1000.0 + i, {"wait_ms": 0})
    assert len(worker._context) == 3 and worker.carrier("r0") is None and worker.carrier("r4") is not None
    assert sum(s.name == "skyline.worker" for s in exporter.get_finished_spans()) == 2  # the forgotten ones ended
