"""Timelines of real requests: a gateway (uvicorn thread) and sim workers in this process, real Redis.

Every phase of a completed, a preempted and a cancelled request must be
present, in order, recorded by the process that saw it; the timeline route is
owner-only when API keys are on; `skyline trace` renders what the route returns.
"""

import asyncio
import sys
from dataclasses import replace

import httpx
import openai

from skyline.core.keys import Keys
from skyline.core.timeline import TimelineEvent, read_timeline
from skyline.gateway.testing import GatewayThread
from skyline.tools.trace import render
from skyline.workers.engines.sim import SimTiming
from tests.inprocess import start_fleet, stop_fleet, wait_registered

MODEL = "skyline-sim"
FAST = SimTiming(prefill_base_s=0.002, prefill_per_token_s=0.0, decode_base_s=0.005, decode_per_seq_s=0.0)
# As in test_slo_scheduling: 1 ms per prompt token, so a 1,500-token prompt holds the prefill engine 1.5 s.
SLOW_PREFILL = SimTiming(prefill_base_s=0.0, prefill_per_token_s=0.001, decode_base_s=0.005, decode_per_seq_s=0.0,
                         max_batch_tokens=256)

COMPLETED = ["arrived", "admitted", "enqueued", "prefill_claimed", "prefill_started", "prefill_finished",
             "kv_handle_published", "decode_claimed", "kv_transfer", "first_token", "finished", "responded"]


def in_order(events: list[TimelineEvent], names: list[str]) -> bool:
    """`names` occur in `events` as a subsequence (other events may sit between them)."""
    it = iter(e.event for e in events)
    return all(any(n == e for e in it) for n in names)


async def wait_for_event(r, keys, rid: str, name: str, timeout_s: float = 10) -> list[TimelineEvent]:
    for _ in range(int(timeout_s / 0.05)):
        events = await read_timeline(r, keys, rid)
        if any(e.event == name for e in events):
            return events
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {name} in the timeline of {rid}: {[e.event for e in events]}")


def gateway(cfg, **gw_options):
    return GatewayThread(replace(cfg, gateway=replace(cfg.gateway, **gw_options)), None, MODEL, 4096)


async def test_completed_request_has_every_phase_in_order_and_is_owner_only(redis_url, key_prefix):
    cfg, r, runtimes, tasks = await start_fleet(redis_url, key_prefix, FAST, "tl")
    await wait_registered(r, key_prefix)
    keys = Keys(key_prefix)
    try:
        with gateway(cfg, api_keys=("key-a", "key-b")) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="key-a", max_retries=0, timeout=20)
            resp = await client.completions.with_raw_response.create(model=MODEL, prompt="Hello " * 20, max_tokens=6)
            rid = resp.headers["x-skyline-request-id"]
            events = await wait_for_event(r, keys, rid, "responded")
            assert in_order(events, COMPLETED), " ".join(f"{e.event}@{e.t_ms % 100000}" for e in events)
            assert [e.t_ms for e in events] == sorted(e.t_ms for e in events)
            who = {e.event: e.who for e in events}
            assert who["prefill_started"] == "prefill-tl" and who["first_token"] == "decode-tl"
            assert who["arrived"].startswith("gateway-") and who["responded"] == who["arrived"]
            fields = {e.event: e.fields for e in events}
            assert fields["enqueued"]["stage"] == "prefill" and fields["admitted"]["decision"] == "admit"
            assert fields["finished"]["completion_tokens"] == 6 and fields["responded"]["status"] == 200

            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                url = f"/v1/requests/{rid}/timeline"
                mine = await http.get(url, headers={"Authorization": "Bearer key-a"})
                assert mine.status_code == 200
                body = mine.json()
                assert [e["event"] for e in body["events"]] == [e.event for e in events]
                assert {p["phase"] for p in body["phases"]} >= {"prefill", "time to first token", "end to end"}
                other = await http.get(url, headers={"Authorization": "Bearer key-b"})  # a valid key, not the sender
                assert other.status_code == 404 and other.json()["error"]["code"] == "timeline_not_found"
                assert (await http.get(url)).status_code == 401
                unknown = await http.get("/v1/requests/nope/timeline", headers={"Authorization": "Bearer key-a"})
                assert unknown.status_code == 404
            text = render(rid, [TimelineEvent(**e) for e in body["events"]])
            assert "prefill-tl" in text and "decode-tl" in text and "time to first token" in text
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "skyline.cli", "trace", rid, "--redis-url", redis_url, "--key-prefix", key_prefix,
                stdout=asyncio.subprocess.PIPE)
            out, _ = await cli.communicate()
            assert cli.returncode == 0 and out.decode().strip() == text  # `skyline trace` prints the same waterfall
    finally:
        await stop_fleet(r, runtimes, tasks)


async def test_preempted_request_shows_the_preemption_and_the_second_prefill(redis_url, key_prefix):
    cfg, r, runtimes, tasks = await start_fleet(redis_url, key_prefix, SLOW_PREFILL, "pre", preemption=True,
                                                prior_prefill_tokens_per_s=1000)
    await wait_registered(r, key_prefix)
    keys = Keys(key_prefix)
    try:
        with gateway(cfg, admission=False) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)

            async def send(tier: str, prompt: str):
                resp = await client.completions.with_raw_response.create(
                    model=MODEL, prompt=prompt, max_tokens=2, extra_headers={"x-slo-tier": tier})
                return resp.headers["x-skyline-request-id"]

            rag = [asyncio.create_task(send("batch", f"{i}" + "x" * 1499)) for i in range(3)]
            await asyncio.sleep(0.3)  # the prefill worker now holds RAG prompts
            chat = await send("interactive", "hi there")
            rids = await asyncio.gather(*rag)
            timelines = [await wait_for_event(r, keys, rid, "responded") for rid in rids]
            preempted = [t for t in timelines if any(e.event == "preempted" for e in t)]
            assert preempted, "no RAG request was preempted"
            for t in preempted:
                assert in_order(t, ["arrived", "enqueued", "prefill_claimed", "prefill_started", "preempted",
                                    "requeued", "prefill_claimed", "prefill_started", "prefill_finished",
                                    "kv_handle_published", "decode_claimed", "first_token", "finished", "responded"])
                p = next(e for e in t if e.event == "preempted")
                assert p.fields == {"tier": "batch", "for_tier": "interactive"} and p.who == "prefill-pre"
            chat_events = await wait_for_event(r, keys, chat, "responded")
            assert in_order(chat_events, COMPLETED[:1] + COMPLETED[2:])  # no `admitted`: admission is off
    finally:
        await stop_fleet(r, runtimes, tasks)


async def test_cancelled_request_records_both_sides_of_the_cancellation(redis_url, key_prefix):
    slow_decode = SimTiming(prefill_base_s=0.002, prefill_per_token_s=0.0, decode_base_s=0.05, decode_per_seq_s=0.0)
    cfg, r, runtimes, tasks = await start_fleet(redis_url, key_prefix, slow_decode, "cx")
    await wait_registered(r, key_prefix)
    keys = Keys(key_prefix)
    try:
        with gateway(cfg) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
                body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 400, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    rid = resp.headers["x-skyline-request-id"]
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and '"text"' in line:
                            break  # one token arrived; now walk away
            events = await wait_for_event(r, keys, rid, "cancelled")
            events = await wait_for_event(r, keys, rid, "responded")
            for _ in range(100):  # the decode worker notices the cancel broadcast a moment later
                if sum(e.event == "cancelled" for e in events) == 2:
                    break
                await asyncio.sleep(0.05)
                events = await read_timeline(r, keys, rid)
            assert in_order(events, ["arrived", "enqueued", "prefill_claimed", "prefill_finished", "decode_claimed",
                                     "first_token"])
            cancels = {e.who: e.fields for e in events if e.event == "cancelled"}
            assert cancels.get("decode-cx", {}).get("phase") == "decode", cancels
            gateway_side = [f for who, f in cancels.items() if who.startswith("gateway-")]
            assert gateway_side == [{"reason": "client_disconnected"}]
            assert next(e for e in events if e.event == "responded").fields["status"] == 499
            assert not any(e.event == "finished" for e in events)
    finally:
        await stop_fleet(r, runtimes, tasks)
