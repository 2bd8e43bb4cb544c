"""Metric values after a known sequence of requests: gateway /metrics, worker registries,
the rolling SLO record, `skyline status` — and they agree with `skyline.tools.bench.metrics`."""

import asyncio
import re
from dataclasses import replace

import httpx
import redis.asyncio as aioredis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from skyline.core.config import GatewayConfig, RedisConfig, SkylineConfig
from skyline.core.keys import Keys
from skyline.core.timeline import read_timeline
from skyline.gateway.testing import GatewayThread, announce_workers
from skyline.tools.bench.client import stream_completion
from skyline.tools.bench.metrics import summarize
from skyline.tools.bench.record import build_record
from skyline.tools.bench.workload import BenchRequest
from skyline.tools.status import WIDTH, render, snapshot
from skyline.workers.engines.sim import SimTiming
from tests.inprocess import start_fleet, stop_fleet, wait_registered

MODEL = "skyline-sim"
# 5 ms per decode step: a TPOT target of 1 ms can never be met, the tiers' own targets always are.
TIMING = SimTiming(prefill_base_s=0.002, prefill_per_token_s=0.0, decode_base_s=0.005, decode_per_seq_s=0.0)

# (tier header, extra headers, max_tokens, how many): 4 + 2 requests meet their SLO, 3 miss it.
SEQUENCE = [
    ("standard", {}, 8, 4),
    ("interactive", {"x-slo-tpot-ms": "1"}, 8, 3),
    ("batch", {}, 4, 2),
]


def samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted label items) -> value, from Prometheus text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(sm: dict, name: str, **labels) -> float:
    return sm.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_after_a_known_sequence_agree_with_the_bench_report(redis_url, key_prefix):
    cfg, r, runtimes, tasks = await start_fleet(redis_url, key_prefix, TIMING, "m")
    await wait_registered(r, key_prefix)
    prefill_rt, decode_rt = runtimes
    try:
        with GatewayThread(cfg, None, MODEL, 4096) as gw:
            records, index = [], 0
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                for tier, headers, max_tokens, n in SEQUENCE:
                    for _ in range(n):
                        rec = await stream_completion(http, "/v1/completions",
                                                      {"model": MODEL, "prompt": f"request {index} " * 8,
                                                       "max_tokens": max_tokens},
                                                      headers={"x-slo-tier": tier, **headers})
                        target = cfg.tier(tier)
                        tpot_ms = int(headers.get("x-slo-tpot-ms", target.tpot_ms))
                        req = BenchRequest(index, "chat", tier, 0.0, "", 0, max_tokens)
                        records.append(build_record("skyline", 1.0, req, 0.0, rec, (target.ttft_ms, tpot_ms)))
                        index += 1
                report = summarize(records, duration_s=1.0)
                assert report["ok"] == 9, [(r.outcome, r.http_status, r.error[:200]) for r in records if r.outcome != "ok"]
                await asyncio.sleep(0.1)  # the last request's SLO record is written right after its answer
                sm = samples((await http.get("/metrics")).text)
                dash = (await http.get("/dashboard/data")).json()

        # Requests, latency histograms and SLO verdicts by tier.
        for tier, _h, _m, n in SEQUENCE:
            attained = report["by_tier"][tier]["attained"]
            assert value(sm, "skyline_gateway_requests_total", model=MODEL, tier=tier, route="disagg", status="200") == n
            assert value(sm, "skyline_gateway_ttft_seconds_count", model=MODEL, tier=tier) == n
            assert value(sm, "skyline_gateway_ttft_seconds_bucket", model=MODEL, tier=tier, le="+Inf") == n
            assert value(sm, "skyline_gateway_ttft_seconds_bucket", model=MODEL, tier=tier, le="5.0") == n  # all well under 5 s
            assert value(sm, "skyline_gateway_ttft_seconds_bucket", model=MODEL, tier=tier, le="0.005") == 0  # none faster than that
            assert value(sm, "skyline_gateway_e2e_seconds_count", model=MODEL, tier=tier) == n
            assert value(sm, "skyline_gateway_tpot_seconds_count", model=MODEL, tier=tier) == n  # every output has > 1 token
            assert value(sm, "skyline_gateway_slo_met_total", model=MODEL, tier=tier) == attained
            assert value(sm, "skyline_gateway_slo_missed_total", model=MODEL, tier=tier) == n - attained
            assert dash["attainment_5m"][tier]["met"] == attained and dash["attainment_5m"][tier]["done"] == n, (dash["attainment_5m"], dash["minutes"][-2:])
        assert report["by_tier"]["standard"]["attained"] == 4 and report["by_tier"]["interactive"]["attained"] == 0
        assert report["attained"] == 6 == dash["attainment_5m"]["all"]["met"]
        # TPOT of the 5 ms decode steps lands between the 2.5 ms and 10 ms bucket bounds.
        assert value(sm, "skyline_gateway_tpot_seconds_bucket", model=MODEL, tier="standard", le="0.0025") == 0
        assert value(sm, "skyline_gateway_tpot_seconds_bucket", model=MODEL, tier="standard", le="0.025") == 4
        assert value(sm, "skyline_gateway_itl_seconds_count", model=MODEL, tier="standard") >= 4
        # Fleet gauges, read from Redis at scrape time: everything drained, both workers alive.
        assert ("skyline_queue_length", (("model", MODEL), ("stage", "prefill"), ("tier", "standard"))) in sm
        assert value(sm, "skyline_queue_pending", model=MODEL, stage="decode", tier="standard") == 0
        assert value(sm, "skyline_queue_waiting", model=MODEL, stage="prefill", tier="standard") == 0
        assert value(sm, "skyline_queue_backlog_tokens", model=MODEL, stage="prefill", tier="standard") == 0
        assert value(sm, "skyline_fleet_workers", model=MODEL, role="prefill") == 1
        assert value(sm, "skyline_fleet_workers", model=MODEL, role="decode") == 1
        assert value(sm, "skyline_timeline_write_errors_total") == 0

        # Worker registries: every request claimed once per stage, KV pulled for each, tokens counted.
        pre, dec = samples(generate_latest(prefill_rt.metrics.registry).decode()), \
            samples(generate_latest(decode_rt.metrics.registry).decode())
        for tier, _h, max_tokens, n in SEQUENCE:
            assert value(pre, "skyline_worker_queue_wait_seconds_count", stage="prefill", tier=tier) == n
            assert value(pre, "skyline_worker_prefill_seconds_count", tier=tier) == n
            assert value(dec, "skyline_worker_queue_wait_seconds_count", stage="decode", tier=tier) == n
        assert value(dec, "skyline_worker_kv_transfer_seconds_count") == 9
        assert value(dec, "skyline_worker_output_tokens_total") == sum(rec.output_tokens for rec in records) == 64
        assert value(pre, "skyline_worker_preemptions_total", tier="batch") == 0

        # The rolling record behind `skyline status` agrees too, and its view fits 100 columns.
        snap = await snapshot(r, cfg)
        for tier, _h, _m, n in SEQUENCE:
            assert snap["slo_attainment"]["15m"][tier]["met"] == report["by_tier"][tier]["attained"]
        text = render(snap)
        assert max(len(line) for line in text.splitlines()) <= WIDTH
        # The 15-minute column holds every request; the 1-minute one may not if a minute turned meanwhile.
        assert re.search(r"standard\b.*100\.0%\s+4/4\s*$", text, re.MULTILINE), text
        assert re.search(r"interactive\b.*\b0\.0%\s+0/3\s*$", text, re.MULTILINE), text
        assert "prefill-m" in text and "decode-m" in text and "prefill:standard" in text
        # The slowest list links each request to its timeline.
        assert dash["slowest"] and dash["slowest"][0]["timeline"].startswith("/v1/requests/")
        assert dash["slowest"][0]["e2e_ms"] >= dash["slowest"][-1]["e2e_ms"]
    finally:
        await stop_fleet(r, runtimes, tasks)


async def test_a_request_refused_after_parsing_counts_as_missed_and_is_traced(redis_url, key_prefix):
    cfg = SkylineConfig(redis=RedisConfig(url=redis_url), key_prefix=key_prefix,
                        gateway=replace(GatewayConfig(), worker_liveness_s=600, min_remote_prefill_tokens=0))
    # No prefill worker: a disagg request gets 503 after it was parsed and given a tier.
    await asyncio.to_thread(announce_workers, redis_url, Keys(key_prefix), "decode", model=MODEL)
    with GatewayThread(cfg, None, MODEL, 4096) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert resp.status_code == 503
            await asyncio.sleep(0.1)
            sm = samples((await http.get("/metrics")).text)
    assert value(sm, "skyline_gateway_slo_missed_total", model=MODEL, tier="standard") == 1
    assert value(sm, "skyline_gateway_slo_met_total", model=MODEL, tier="standard") == 0
    r = aioredis.from_url(redis_url)
    keys = Keys(key_prefix)
    recent = await r.lrange(keys.recent, 0, -1)
    ids = [k.decode().rsplit(":", 1)[1] for k in await r.keys(f"{key_prefix}:timeline:*")]
    assert len(ids) == 1 and recent == []  # refusals are counted per minute, not listed
    events = await read_timeline(r, keys, ids[0])
    assert [e.event for e in events] == ["arrived", "failed"]
    assert events[1].fields == {"status": 503, "reason": "no_workers"}
    await r.aclose()


async def test_queue_depth_counts_entries_nobody_claimed_yet(redis_url, key_prefix):
    from skyline.core import messages as m
    from skyline.core.queues import read_streams
    from skyline.core.streams import TierQueues, enqueue, ensure_groups

    cfg = SkylineConfig(key_prefix=key_prefix)
    keys = Keys(key_prefix)
    r = aioredis.from_url(redis_url)
    await ensure_groups(r, keys, cfg.tier_names)
    for i in range(3):
        req = m.GenerateRequest(f"q{i}", MODEL, [1] * 10, m.SamplingSpec(), "standard", 0, 5000, 5000, 500)
        await enqueue(r, keys, "prefill", req, 1000)
    queues = TierQueues(r, keys, "prefill", cfg.tiers, "worker-1")
    claimed = await queues.claim(block_ms=100)
    status = {(s.stage, s.tier): s for s in await read_streams(r, keys, cfg.tier_names)}
    st = status[("prefill", "standard")]
    assert (st.length, st.waiting, st.pending, st.backlog_tokens) == (3, 2, 1, 30)
    await queues.ack(claimed)
    st = {(s.stage, s.tier): s for s in await read_streams(r, keys, cfg.tier_names)}[("prefill", "standard")]
    assert (st.length, st.waiting, st.pending, st.backlog_tokens) == (3, 2, 0, 20)  # acked entries stay in XLEN
    # Work returned to the queue (its tier's retry lane) is waiting work of that tier.
    await enqueue(r, keys, "prefill", claimed.message, 1000, retry=True)
    st = {(s.stage, s.tier): s for s in await read_streams(r, keys, cfg.tier_names)}[("prefill", "standard")]
    assert (st.length, st.waiting, st.pending, st.backlog_tokens) == (4, 3, 0, 30)
    await r.aclose()


def test_kv_bytes_per_token_from_the_model_shape():
    from types import SimpleNamespace

    import torch

    from skyline.workers.engines.vllm_internals import kv_bytes_per_token

    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, float32 -> K and V = 2 * 30 * 3 * 64 * 4 bytes.
    mc = SimpleNamespace(dtype=torch.float32, get_num_layers=lambda pc: 30, get_num_kv_heads=lambda pc: 3,
                         get_head_size=lambda: 64)
    llm = SimpleNamespace(model_config=mc, vllm_config=SimpleNamespace(parallel_config=None))
    assert kv_bytes_per_token(llm) == 46_080
    assert kv_bytes_per_token(SimpleNamespace()) is None  # an API it does not know: no bytes, no crash


def test_minute_keys_are_whole_minutes_even_for_sub_millisecond_times():
    from skyline.core.slo_record import attainment, minute_of

    assert minute_of(1_796_083_046_778.123) == 29_934_717 == minute_of(1_796_083_046_778)
    assert Keys("s").slo_minute(minute_of(1_796_083_046_778.5)) == "s:slo:29934717"
    minutes = [{"minute": 1, "tiers": {"a": {"done": 3, "met": 2, "ttft_met": 3, "errors": 1}}},
               {"minute": 2, "tiers": {"a": {"done": 1, "met": 1, "ttft_met": 1, "errors": 0},
                                       "b": {"done": 2, "met": 0, "ttft_met": 0, "errors": 2}}}]
    assert attainment(minutes, "a") == {"done": 4, "met": 3, "ttft_met": 4, "errors": 1, "attainment": 0.75}
    assert attainment(minutes)["attainment"] == 0.5 and attainment([], "a")["attainment"] is None
