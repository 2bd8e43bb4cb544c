"""The Responses API's store end to end on a `sim` fleet: the `openai` client -> two gateways (one
Redis) -> prefill and decode worker processes. Each route stores a response, another gateway
retrieves and continues it, and a background response is polled to its end and deleted.
tests/test_responses_store.py covers each behaviour in detail with hand-played workers."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace

import openai
import pytest

from skyline.core.config import GatewayConfig, RedisConfig, SkylineConfig
from skyline.gateway.testing import GatewayThread
from tests.fleet import Fleet
from tests.procs import wait_until

MODEL = "skyline-sim"


def _workers(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
        return json.loads(resp.read()).get("workers", {})


@pytest.fixture(scope="module")
def gateways(redis_url, tmp_path_factory):
    prefix = "responses-fleet"
    fleet = Fleet(redis_url, prefix, "sim", tmp_path_factory.mktemp("fleet-logs"))
    gw = replace(GatewayConfig(), min_remote_prefill_tokens=0)
    cfg = SkylineConfig(redis=RedisConfig(url=redis_url), gateway=gw, key_prefix=prefix)
    try:
        fleet.start_worker("prefill-a", "prefill")
        fleet.start_worker("decode-a", "decode")
        with GatewayThread(cfg, None, MODEL, 2048) as a, GatewayThread(cfg, None, MODEL, 2048) as b:
            wait_until(lambda: all(_workers(g.url).get(role) for g in (a, b) for role in ("prefill", "decode")), 60,
                       lambda: f"both workers seen by both gateways\n{fleet.all_logs()}")
            yield [openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0, timeout=30) for g in (a, b)]
    finally:
        fleet.stop_all()


@pytest.mark.parametrize("route", ["colocated", "disagg"])
def test_a_conversation_continues_across_gateways(gateways, route):
    first, second = gateways
    headers = {"x-skyline-route": route}
    turn1 = first.responses.create(model=MODEL, input="Hello there", max_output_tokens=8, extra_headers=headers)
    assert turn1.status in ("completed", "incomplete") and turn1.output_text
    assert turn1.model_extra["skyline"]["route"] == route
    assert second.responses.retrieve(turn1.id).output_text == turn1.output_text
    turn2 = second.responses.create(model=MODEL, input="And then?", previous_response_id=turn1.id,
                                    max_output_tokens=8, extra_headers=headers)
    # Its prompt holds the first turn's input and output, then its own.
    assert turn2.usage.input_tokens > turn1.usage.input_tokens + turn1.usage.output_tokens
    assert turn2.previous_response_id == turn1.id
    assert [i.content[0].text for i in first.responses.input_items.list(turn2.id).data] == ["And then?"]


def test_a_background_response_completes_and_is_deleted(gateways):
    first, second = gateways
    queued = first.responses.create(model=MODEL, input="Tell me", max_output_tokens=16, background=True)
    assert queued.status in ("queued", "in_progress")
    done = wait_until(lambda: (r := second.responses.retrieve(queued.id)).status not in ("queued", "in_progress")
                      and r, 30, "the background response ended")
    assert done.status in ("completed", "incomplete") and done.output_text and done.usage.output_tokens == 16
    second.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        first.responses.retrieve(queued.id)
