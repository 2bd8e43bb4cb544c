"""Engine steps: the worker's step metrics, and the bench's summary of them."""

from __future__ import annotations

from prometheus_client import generate_latest

from skyline.tools.bench.engine_steps import describe, summarize
from skyline.workers.observe import WorkerMetrics


def test_a_workers_steps_are_summarised_by_kind_from_its_metrics_text():
    m = WorkerMetrics()
    for prompt, decode, seconds in ((256, 0, 0.25), (224, 2, 0.27), (0, 3, 0.04), (0, 3, 0.05), (0, 1, 0.03)):
        m.engine_stepped(prompt, decode, seconds)
    steps = summarize(generate_latest(m.registry).decode())
    assert steps["prefill"] == {"steps": 1, "mean_ms": 250.0, "prompt_tokens": 256.0, "decode_tokens": 0.0}
    assert steps["mixed"] == {"steps": 1, "mean_ms": 270.0, "prompt_tokens": 224.0, "decode_tokens": 2.0}
    assert steps["decode"] == {"steps": 3, "mean_ms": 40.0, "prompt_tokens": 0.0, "decode_tokens": 2.33}
    assert describe({"decode-0": steps}) == ("decode-0: prefill 1 x 250.0 ms (256+0 tokens), "
                                             "mixed 1 x 270.0 ms (224+2 tokens), decode 3 x 40.0 ms (0+2.33 tokens)")


def test_an_engine_that_does_not_time_its_steps_reports_nothing():
    assert summarize(generate_latest(WorkerMetrics().registry).decode()) == {}
