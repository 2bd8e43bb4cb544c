"""Batch jobs end to end on a sim fleet: the `openai` client's batch calls, limits, load, and a killed runner.

Real processes: Redis, the gateway, a prefill and a decode worker on `sim`
engines, and `skyline batch-runner` (an RQ worker). Runner timings are
shortened (lease 3 s, maintenance every 2 s) so a killed runner's job is
picked up within seconds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections import Counter

import openai
import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.registry import FinishedJobRegistry

from skyline.core import messages
from skyline.core.keys import Keys
from skyline.tools.bench.driver import Target, run_rate
from skyline.tools.bench.metrics import summarize
from skyline.tools.bench.prompts import PromptBuilder
from skyline.tools.bench.tokenizer import SimTokenizer
from skyline.tools.bench.workload import WorkloadSpec, make_requests
from tests.fleet import Fleet
from tests.procs import wait_until

MODEL = "skyline-sim"
# Decode steps slow down with every running sequence (5 ms each): a batch that fills the decode
# worker's 32 slots pushes interactive TPOT near its 250 ms target, so pacing has work to do
# (measured: unpaced, 32 batch requests in flight, interactive attainment fell from 100% to 79%).
CONFIG = """
[engine]
sim_prefill_base_s = 0.005
sim_prefill_per_token_s = 0.0001
sim_decode_base_s = 0.02
sim_decode_per_seq_s = 0.005
[batch]
max_file_bytes = 200000
max_lines = 1000
pacing_interval_s = 0.25
lease_s = 3
heartbeat_s = 1
maintenance_interval_s = 2
"""


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("batch-logs")
    cfg = logs / "batch.toml"
    cfg.write_text(CONFIG)
    f = Fleet(redis_url, f"e2e-batch-{uuid.uuid4().hex[:6]}", "sim", logs, ["--config", str(cfg)])
    with f.running({"prefill-b": ("prefill",), "decode-b": ("decode",)}, timeout_s=60):
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout_s=60)


def start_runner(fleet: Fleet, name: str):
    return fleet.start(name, ["batch-runner", *fleet._common(), "--gateway-url", fleet.url, "--name", name])


@pytest.fixture
def runner(fleet):
    start_runner(fleet, "runner")
    yield "runner"
    if "runner" in fleet.procs:
        fleet.stop("runner")


def chat_line(cid: str, words: int = 20, max_tokens: int = 8) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": f"{cid}: " + "word " * words}]}})


def submit(client, tmp_path, lines: list[str], name: str = "in.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    with path.open("rb") as fh:
        uploaded = client.files.create(file=fh, purpose="batch")
    return uploaded, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h", metadata={"suite": "e2e"})


def wait_done(client, batch_id: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s}s: {batch.request_counts}")


def jsonl_of(client, file_id: str) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_openai_client_round_trip_with_a_bad_line(client, fleet, runner, tmp_path):
    lines = [chat_line(f"req-{i}") for i in range(5)]
    lines.insert(2, "{this is not json")
    uploaded, batch = submit(client, tmp_path, lines)
    assert uploaded.purpose == "batch" and uploaded.bytes == len(("\n".join(lines) + "\n").encode())
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert batch.status == "validating" and batch.metadata == {"suite": "e2e"}
    assert batch.request_counts.total == 6

    done = wait_done(client, batch.id, 30)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = jsonl_of(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(5)]  # input order, one line each
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["skyline"]["tier"] == "batch" and o["response"]["request_id"] == body["id"]
    errors = jsonl_of(client, done.error_file_id)
    assert len(errors) == 1 and errors[0]["custom_id"] is None and errors[0]["response"] is None
    assert errors[0]["error"]["code"] == "invalid_json_line" and "line 3" in errors[0]["error"]["message"]
    assert done.usage.output_tokens == 5 * 8

    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    # Without API keys everyone is one anonymous tenant: every file is listed, the batch's outputs too.
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch", limit=100).data]
    outputs = [f.id for f in client.files.list(purpose="batch_output", limit=100).data]
    assert done.output_file_id in outputs and done.error_file_id in outputs
    conn = redis.Redis.from_url(fleet.redis_url)
    queue_name = Keys(fleet.key_prefix).batch_queue()
    assert batch.id in FinishedJobRegistry(queue_name, connection=conn).get_job_ids()  # what `rq info` counts
    assert Job.fetch(batch.id, connection=conn).return_value()["status"] == "completed"


def test_a_batch_that_cannot_start_says_why_and_limits_are_enforced(client, tmp_path):
    _, batch = submit(client, tmp_path, [chat_line("a"), chat_line("b"), chat_line("a")])
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 3)]

    too_big = tmp_path / "big.jsonl"
    too_big.write_text(chat_line("x", words=50_000) + "\n")
    with pytest.raises(openai.APIStatusError) as exc, too_big.open("rb") as fh:
        client.files.create(file=fh, purpose="batch")
    assert exc.value.status_code == 413 and exc.value.body["code"] == "file_too_large"

    too_many = tmp_path / "many.jsonl"
    too_many.write_text("{}\n" * 1001)
    with pytest.raises(openai.BadRequestError) as exc, too_many.open("rb") as fh:
        client.files.create(file=fh, purpose="batch")
    assert exc.value.body["code"] == "too_many_lines"

    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")


def test_cancelling_a_queued_batch_ends_it_with_one_line_per_request(client, tmp_path):
    # No runner in this test: the job waits in RQ, so the gateway ends it.
    _, batch = submit(client, tmp_path, [chat_line(f"c{i}") for i in range(3)] + ["[]"])
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelling_at and cancelled.cancelled_at
    errors = jsonl_of(client, cancelled.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("c0", "batch_cancelled"), ("c1", "batch_cancelled"), ("c2", "batch_cancelled"), (None, "invalid_json_line")]
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling twice is harmless
    _, failed = submit(client, tmp_path, ["{}"], "bad.jsonl")
    assert failed.status == "failed"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(failed.id)  # an ended batch cannot be cancelled


def interactive_attainment(fleet: Fleet, n: int, rate: float) -> dict:
    spec = WorkloadSpec(mix=1.0, chat_prompt=(40, 200), chat_output=(8, 24), seed=7)
    requests = make_requests(spec, PromptBuilder(SimTokenizer()), n, rate)
    target = Target("sim", fleet.url, MODEL, "skyline", lambda _cls: (1000.0, 250.0))
    records, duration = asyncio.run(run_rate(target, rate, requests, drain_s=30))
    return summarize(records, duration)["by_tier"]["interactive"]


def test_a_batch_fills_in_beside_interactive_load_without_costing_it_its_slo(client, fleet, runner, tmp_path):
    n, rate = 80, 10.0
    alone = interactive_attainment(fleet, n, rate)

    _, batch = submit(client, tmp_path, [chat_line(f"bulk-{i}", words=40, max_tokens=8) for i in range(300)])
    beside = interactive_attainment(fleet, n, rate)
    during = client.batches.retrieve(batch.id).request_counts.completed
    done = wait_done(client, batch.id, 60)

    assert done.status == "completed" and done.request_counts.completed == 300
    assert len(jsonl_of(client, done.output_file_id)) == 300 and done.error_file_id is None
    assert during > 0, "the batch made no progress while interactive load ran"
    print(f"\ninteractive attainment: alone {alone['attainment']:.3f}, beside the batch {beside['attainment']:.3f}; "
          f"batch lines done while the load ran: {during}/300")
    assert beside["attainment"] >= alone["attainment"] - 0.02, (alone, beside)


class FinishedFrames:
    """Counts Finished frames per request id on every token channel of the fleet (engine-side completions)."""

    def __init__(self, redis_url: str, prefix: str):
        self.counts: Counter[str] = Counter()
        self._pubsub = redis.Redis.from_url(redis_url).pubsub()
        self._pubsub.psubscribe(Keys(prefix).tokens("*"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self._pubsub.get_message(timeout=0.2)
            if msg and msg["type"] == "pmessage":
                frame = messages.decode(msg["data"])
                if isinstance(frame, messages.Finished):
                    self.counts[frame.request_id] += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pubsub.close()


def test_a_runner_killed_mid_batch_is_replaced_and_no_request_runs_twice(client, fleet, tmp_path):
    frames = FinishedFrames(fleet.redis_url, fleet.key_prefix)
    try:
        start_runner(fleet, "runner-a")
        _, batch = submit(client, tmp_path, [chat_line(f"k{i}", words=30, max_tokens=12) for i in range(200)])
        deadline = time.monotonic() + 30
        while client.batches.retrieve(batch.id).request_counts.completed < 40:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.1)
        fleet.stop("runner-a", signal.SIGKILL)
        at_kill = client.batches.retrieve(batch.id).request_counts.completed
        assert at_kill < 200, "the batch finished before the runner was killed; make it longer"

        start_runner(fleet, "runner-b")
        done = wait_done(client, batch.id, 60)
        assert done.status == "completed" and done.request_counts.completed == 200
        out = jsonl_of(client, done.output_file_id)
        answered = Counter(o["response"]["request_id"] for o in out)
        wait_until(lambda: set(answered) <= set(frames.counts), 10,
                   lambda: f"the Finished frames of {len(set(answered) - set(frames.counts))} answered lines "
                           "to reach the listener")
    finally:
        frames.close()
        for name in ("runner-a", "runner-b"):
            if name in fleet.procs:
                fleet.stop(name)

    assert sorted(o["custom_id"] for o in out) == sorted(f"k{i}" for i in range(200))
    # Every line was computed by the fleet exactly once: one Finished frame per output line, no other.
    assert set(frames.counts) == set(answered) and set(frames.counts.values()) == {1}
    job = Job.fetch(batch.id, connection=redis.Redis.from_url(fleet.redis_url))
    assert job.get_status() == "finished" and job.retries_left == 2  # one abandonment, retried by RQ
    assert "already done" in fleet.logs("runner-b")
    assert Queue(Keys(fleet.key_prefix).batch_queue(), connection=job.connection).count == 0
