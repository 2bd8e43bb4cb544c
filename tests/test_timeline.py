"""Per-request timelines: the recorder against a real Redis, the waterfall, and the logs."""

import asyncio
import hashlib
import json
import logging

import redis.asyncio as aioredis

from skyline.core.keys import Keys
from skyline.core.logs import JsonFormatter
from skyline.core.timeline import EVENTS, Timeline, TimelineEvent, key_digest, read_timeline, requester_of
from skyline.core.timeline import phase_durations
from skyline.tools.trace import render


async def test_events_of_one_loop_turn_go_in_one_round_trip_and_read_back_in_time_order(redis_url, key_prefix):
    r = aioredis.from_url(redis_url)
    keys = Keys(key_prefix)
    tl = Timeline(r, keys, who="gateway-1", ttl_s=120, max_events=50)
    sent = []
    original = r.pipeline

    def counting_pipeline(*a, **kw):
        sent.append(1)
        return original(*a, **kw)

    r.pipeline = counting_pipeline
    tl.emit("req-1", "arrived", t_ms=1000, prompt_tokens=37)
    tl.emit("req-1", "enqueued", t_ms=1003, stage="prefill", tier="standard")
    tl.emit("req-1", "admitted", t_ms=1001, decision="admit", predicted_ttft_ms=150.0)
    await tl.flush()
    assert len(sent) == 1
    events = await read_timeline(r, keys, "req-1")
    assert [e.event for e in events] == ["arrived", "admitted", "enqueued"]
    assert events[1].fields == {"decision": "admit", "predicted_ttft_ms": 150.0} and events[0].who == "gateway-1"
    assert 0 < await r.ttl(keys.timeline("req-1")) <= 120
    assert await read_timeline(r, keys, "unknown") == []
    await r.aclose()


async def test_length_is_bounded_keeping_the_newest(redis_url, key_prefix):
    r = aioredis.from_url(redis_url)
    keys = Keys(key_prefix)
    tl = Timeline(r, keys, who="w", max_events=5)
    for i in range(12):
        tl.emit("req", "requeued", t_ms=i, n=i)
    await tl.flush()
    assert [e.fields["n"] for e in await read_timeline(r, keys, "req")] == [7, 8, 9, 10, 11]
    await r.aclose()


async def test_a_dead_redis_never_fails_the_caller_and_is_counted(caplog):
    r = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)  # nothing listens on port 1
    tl = Timeline(r, Keys("x"), who="w")
    seen = []
    tl.listeners.append(lambda event, fields: seen.append(event))
    with caplog.at_level(logging.WARNING, logger="skyline.core.batchwrite"):
        await tl.record("req", "arrived")  # returns normally
        tl.emit("req", "first_token")
        await tl.flush()
    assert tl.errors == 2 and seen == ["arrived", "first_token"]
    assert sum("dropped" in rec.message for rec in caplog.records) == 1  # logged once, not per event
    await r.aclose()


async def test_requester_digest_and_disabled_timeline(redis_url, key_prefix):
    r = aioredis.from_url(redis_url)
    keys = Keys(key_prefix)
    tl = Timeline(r, keys, who="gw")
    digest = key_digest("secret-key", b"fleet-secret")
    tl.set_requester("req", digest)
    await tl.flush()
    assert await requester_of(r, keys, "req") == digest
    # Keyed: another secret gives another digest, and it is not the key's plain SHA-256 (which
    # anyone reading Redis could check a guessed key against).
    assert digest not in ("secret-key", key_digest("secret-key", b"other"), hashlib.sha256(b"secret-key").hexdigest())
    off = Timeline(r, keys, who="gw", enabled=False)
    await off.record("req-off", "arrived")
    assert await r.exists(keys.timeline("req-off")) == 0
    await r.aclose()


def test_event_log_lines_are_structured(caplog):
    tl = Timeline(None, Keys(), who="decode-0", enabled=False)
    with caplog.at_level(logging.INFO, logger="skyline.events"):
        asyncio.run(tl.record("req-9", "decode_claimed", tier="standard"))
    rec = caplog.records[-1]
    assert rec.getMessage() == "decode_claimed request_id=req-9 worker=decode-0 tier=standard"
    line = json.loads(JsonFormatter().format(rec))
    assert line["event"] == "decode_claimed" and line["request_id"] == "req-9" and line["worker"] == "decode-0"
    assert line["tier"] == "standard" and line["level"] == "INFO"


def _ev(name, t, who="w", **fields):
    return TimelineEvent(name, t, who, fields)


def test_waterfall_shows_offsets_gaps_workers_and_phases():
    events = [
        _ev("arrived", 1000, "gateway-1", prompt_tokens=37), _ev("enqueued", 1002, "gateway-1", stage="prefill"),
        _ev("prefill_claimed", 1010, "prefill-0"), _ev("prefill_started", 1011, "prefill-0"),
        _ev("prefill_finished", 1271, "prefill-0"), _ev("kv_handle_published", 1272, "prefill-0"),
        _ev("decode_claimed", 1275, "decode-0"), _ev("kv_transfer", 1287, "decode-0", ms=12),
        _ev("first_token", 1400, "decode-0"), _ev("finished", 2000, "decode-0", reason="length"),
        _ev("responded", 2001, "gateway-1", status=200),
    ]
    text = render("req-1", events)
    lines = text.splitlines()
    assert lines[0] == "request req-1: 11 events over 1,001 ms"
    row = next(line for line in lines if " prefill_finished " in line)
    assert row.split()[:2] == ["271", "260"] and "prefill-0" in row  # offset, time since the previous event
    assert "reason=length" in next(line for line in lines if " finished " in line)
    phases = {p["phase"]: p for p in phase_durations(events)}
    assert phases["prefill"]["ms"] == 260 and phases["prefill"]["who"] == ["prefill-0"]
    assert phases["time to first token"]["ms"] == 400 and phases["end to end"]["ms"] == 1001
    assert phases["queued for prefill"]["ms"] == 8
    assert max(len(line) for line in lines) <= 140
    assert "no timeline" in render("nope", [])


def test_preempted_prefill_counts_every_attempt():
    events = [_ev("enqueued", 0, stage="prefill"), _ev("prefill_claimed", 5), _ev("prefill_started", 5),
              _ev("preempted", 100), _ev("requeued", 101, stage="prefill"), _ev("prefill_claimed", 300),
              _ev("prefill_started", 300), _ev("prefill_finished", 500)]
    phases = {p["phase"]: p for p in phase_durations(events)}
    assert phases["queued for prefill"] == {"phase": "queued for prefill", "ms": 5 + 199, "count": 2, "who": ["w"]}
    assert phases["prefill"]["ms"] == 200 and phases["prefill"]["count"] == 1


def test_event_names_are_unique_and_snake_case():
    assert len(set(EVENTS)) == len(EVENTS) and all(e.replace("_", "").isalpha() and e.islower() for e in EVENTS)


def test_the_log_handler_writes_to_stderr_as_it_is_when_a_line_comes(monkeypatch):
    """A stderr replaced and closed after logging was set up (pytest does so per test) takes no line and
    raises nothing: the next stderr gets it."""
    import io
    import logging
    import sys

    from skyline.core.logs import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging("INFO")
        logging.getLogger("skyline.test").info("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("skyline.test").info("two")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    assert second.getvalue().endswith("INFO skyline.test: two\n")
