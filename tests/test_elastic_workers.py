"""Elastic workers (scheduler/elastic.py): every engine takes either phase. Sim engines in-process
against a real redis-server; the test plays the gateway with redis-py, as tests/test_worker_flow.py."""

import asyncio

from skyline.core import messages as m
from skyline.core.keys import Keys
from skyline.core.timeline import read_timeline
from skyline.workers.engines.sim import SimTiming
from tests.inprocess import start_fleet, stop_fleet, wait_registered
from tests.test_worker_flow import gen_request, run_request

# A prompt token costs 1 ms, a decode step 20 ms: prompts and streams overlap as on a real engine.
TIMING = SimTiming(prefill_base_s=0.005, prefill_per_token_s=0.001, decode_base_s=0.02, decode_per_seq_s=0.0)


async def _serve_all(client, keys, reqs) -> list[list]:
    return await asyncio.gather(*(run_request(client, keys, r, timeout_s=30) for r in reqs))


def _tokens(frames) -> list[int]:
    return [t for f in frames if isinstance(f, m.TokenDelta) for t in f.token_ids]


async def test_two_elastic_workers_serve_both_routes_exactly_once_and_both_engines_work(redis_url, key_prefix):
    cfg, client, rts, tasks = await start_fleet(redis_url, key_prefix, TIMING, "t", roles=("elastic", "elastic"))
    keys = Keys(key_prefix)
    try:
        await wait_registered(client, key_prefix, 2)
        for rt in rts:  # each knows its peer before the first prompt is placed
            while len(rt.peers) < 2:
                await asyncio.sleep(0.05)
        reqs = [gen_request(f"long-{i}", list(range(1, 400)), 12) for i in range(6)]  # the prefill streams
        reqs += [gen_request(f"short-{i}", list(range(1, 30)), 12, route="colocated") for i in range(10)]
        results = await _serve_all(client, keys, reqs)
        for req, frames in zip(reqs, results):
            assert isinstance(frames[-1], m.Finished), (req.request_id, frames[-1])
            assert len(_tokens(frames)) == 12, req.request_id  # every token once, none twice
        finals = {r.request_id: f[-1] for r, f in zip(reqs, results)}
        decoders = {f.decode_worker for f in finals.values()}
        assert decoders == {rt.worker_id for rt in rts}, "one engine idled while requests waited"
        # Some prompt was computed on one engine and decoded on the other (its KV handed over)...
        split = [f for f in finals.values() if f.prefill_worker and f.prefill_worker != f.decode_worker]
        assert split, "no prompt's decode was handed to the peer"
        # ... and the rest of the long prompts were served whole where they were computed.
        for rid, f in finals.items():
            if rid.startswith("long") and not f.prefill_worker:
                assert f.kv_transfer.get("local_prefill", "") == "", f
        # Each placement is in the request's timeline, saying where and why.
        events = await read_timeline(client, keys, "long-0")
        placed = [e for e in events if e.event == "decode_placed"]
        assert placed and placed[0].fields["on"] in {rt.worker_id for rt in rts}
        # Nothing is left pending or queued.
        for rt in rts:
            assert len(rt.held) == 0
        for stage in ("prefill", "decode"):
            for tier in cfg.tier_names:
                for key in (keys.stream(stage, tier), keys.retry_stream(stage, tier)):
                    pending = await client.xpending(key, Keys.group(stage))
                    assert pending["pending"] == 0, (key, pending)
    finally:
        await stop_fleet(client, rts, tasks)
