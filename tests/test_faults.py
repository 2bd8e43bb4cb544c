"""Fault injection: workers killed (-9) or stopped mid-request, poison requests.

Real processes (gateway + workers on the `sim` engine) against the real Redis;
each test kills what it says and asserts what the client sees, within a stated
time bound. The sim engine's output is a deterministic function of the
context (like a greedy model), so "no gap, no duplicate" is checked by
comparing the streamed text with an undisturbed run of the same request.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
import redis

from skyline.core.keys import Keys
from tests.fleet import Fleet
from tests.procs import wait_until

pytestmark = pytest.mark.faults

MODEL = "skyline-sim"
RECLAIM_AFTER_S = 1.5

# Slow enough to kill a worker mid-request, fast enough for a test.
CONFIG = f"""
[engine]
sim_prefill_base_s = 0.005
sim_prefill_per_token_s = 0.004
sim_decode_base_s = 0.04
sim_decode_per_seq_s = 0.0

[worker]
heartbeat_s = 0.25
reclaim_after_s = {RECLAIM_AFTER_S}
reclaim_interval_s = 0.25
max_deliveries = 2
drain_timeout_s = 1.0
"""

PROMPT = "Tell me about the skyline of a city at night, with its lights and towers. " * 4  # ~300 tokens


@pytest.fixture
def make_fleet(redis_url, key_prefix, tmp_path):
    (tmp_path / "faults.toml").write_text(CONFIG)
    fleets = []

    def make(workers: dict[str, tuple[str, ...]]):
        f = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "faults.toml")])
        fleets.append(f)
        return f.running(workers, timeout_s=60)

    yield make


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def holder(r: redis.Redis, keys: Keys, stage: str, timeout_s: float = 10.0) -> str:
    """The consumer (worker id) holding the only pending entry of a stage."""
    deadline = time.monotonic() + timeout_s
    tiers = ("interactive", "standard", "batch")
    while time.monotonic() < deadline:
        placed = [keys.affinity_lane(stage, t, w.decode()) for w in r.smembers(keys.affinity_lanes(stage)) for t in tiers
                  if r.exists(keys.affinity_lane(stage, t, w.decode()))]
        for key in [key for _tier, key in keys.lanes(stage, tiers)] + placed:
            for p in r.xpending_range(key, Keys.group(stage), "-", "+", 10):
                return p["consumer"].decode()
        time.sleep(0.02)
    raise TimeoutError(f"no pending {stage} entry")


def kill9(fleet: Fleet, name: str) -> None:
    proc = fleet.procs.pop(name)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stream_text(client: openai.OpenAI, max_tokens: int, on_chunk=None, **extra) -> tuple[str, dict, float]:
    """Stream a completion; returns (text, final `skyline` extension, seconds of the longest gap)."""
    text, ext, gap, last = "", {}, 0.0, time.monotonic()
    extra = {"temperature": 0, **extra}
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True, **extra)
    for i, chunk in enumerate(stream):
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        if chunk.choices:
            text += chunk.choices[0].text
        ext = (chunk.model_extra or {}).get("skyline") or ext
        if on_chunk:
            on_chunk(i)
    return text, ext, gap


def kill_decode_holder_at(fleet: Fleet, r: redis.Redis, key_prefix: str, chunk: int, then=None):
    """(the killed worker ids, an `on_chunk` hook for stream_text): at chunk `chunk` the worker holding the
    decode entry is killed -9, and `then()` runs after."""
    killed: list[str] = []

    def hook(i: int) -> None:
        if i == chunk and not killed:
            killed.append(holder(r, Keys(key_prefix), "decode"))
            kill9(fleet, killed[0])
            if then is not None:
                then()

    return killed, hook


def reference(client: openai.OpenAI, max_tokens: int) -> str:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return resp.choices[0].text


def test_decode_worker_killed_mid_stream_migrates_without_gap_or_duplicate(make_fleet, r, key_prefix):
    workers = {"prefill-1": ("prefill",), "decode-a": ("decode",), "decode-b": ("decode",)}
    with make_fleet(workers) as fleet:
        client = fleet.client(timeout_s=60)
        want = reference(client, 60)
        killed, kill_holder = kill_decode_holder_at(fleet, r, key_prefix, 10)
        t0 = time.monotonic()
        text, ext, gap = stream_text(client, 60, on_chunk=kill_holder)
        elapsed = time.monotonic() - t0

        def written_to_the_end() -> dict | None:
            """The request's timeline, once it has the last event of each process that writes it (each
            batches its writes every few ms): the decode worker's `finished`, the gateway's `responded`."""
            got = httpx.get(f"{fleet.url}/v1/requests/{ext['request_id']}/timeline", timeout=5).json()
            return got if {"finished", "responded"} <= {e["event"] for e in got["events"]} else None

        timeline = wait_until(written_to_the_end, 10, "the timeline's `finished` and `responded` events")

    assert killed, "the stream ended before the kill"
    assert text == want  # every token once, in order
    assert ext["decode_worker"] != killed[0] and ext["decode_attempts"] == 2
    assert ext["resumed_at_token"] >= 10
    # The timeline tells the story, in order, each event from the process that saw it.
    events = [(e["event"], e["who"]) for e in timeline["events"]]
    story = ["arrived", "enqueued", "prefill_started", "kv_handle_published", "decode_claimed", "first_token",
             "reclaimed", "decode_claimed", "migrated", "finished", "responded"]
    it = iter(name for name, _ in events)
    assert all(any(n == e for e in it) for n in story), events
    assert ("reclaimed", ext["decode_worker"]) in events and ("migrated", ext["decode_worker"]) in events
    # Bound: the takeover waits for the silence to exceed reclaim_after_s, then re-prefills.
    assert gap < RECLAIM_AFTER_S + 3.0, gap
    assert elapsed < 60 * 0.04 + RECLAIM_AFTER_S + 5.0


def test_a_worker_restarted_under_the_same_id_resumes_what_its_predecessor_held(make_fleet, r, key_prefix):
    """The only decode worker is killed mid-stream and started again under the same id (a container
    restarted in its pod keeps its host name and pid, hence its default id). Nobody else would take
    the entry: the id heartbeats again. The new process takes what is pending under its own id at
    start, and the stream resumes where it was."""
    workers = {"prefill-1": ("prefill",), "decode-a": ("decode",)}
    with make_fleet(workers) as fleet:
        client = fleet.client(timeout_s=60)
        want = reference(client, 60)
        killed, restart_holder = kill_decode_holder_at(fleet, r, key_prefix, 10,
                                                       then=lambda: fleet.start_worker("decode-a", "decode"))
        text, ext, _gap = stream_text(client, 60, on_chunk=restart_holder)

    assert killed == ["decode-a"], "the stream ended before the kill"
    assert text == want  # every token once, in order
    assert ext["decode_worker"] == "decode-a" and ext["decode_attempts"] == 2
    assert ext["resumed_at_token"] >= 10


def test_seeded_request_is_not_migrated_but_fails_explicitly(make_fleet, r, key_prefix):
    workers = {"prefill-1": ("prefill",), "decode-a": ("decode",), "decode-b": ("decode",)}
    with make_fleet(workers) as fleet:
        client = fleet.client(timeout_s=60)
        _killed, kill_holder = kill_decode_holder_at(fleet, r, key_prefix, 5)
        with pytest.raises(openai.APIError) as err:
            stream_text(client, 60, on_chunk=kill_holder, seed=7, temperature=0.8)  # seeded sampling
    assert "seed" in str(err.value)


def test_prefill_worker_killed_mid_prefill_is_prefilled_elsewhere(make_fleet, r, key_prefix):
    workers = {"prefill-a": ("prefill",), "prefill-b": ("prefill",), "decode-1": ("decode",)}
    with make_fleet(workers) as fleet:
        client = fleet.client(timeout_s=60)
        want = reference(client, 20)
        result = {}
        t = threading.Thread(target=lambda: result.update(out=stream_text(client, 20)))
        t0 = time.monotonic()
        t.start()
        victim = holder(r, Keys(key_prefix), "prefill")
        kill9(fleet, victim)
        t.join(timeout=30)
        elapsed = time.monotonic() - t0
    text, ext, _gap = result["out"]
    assert text == want
    assert ext["prefill_worker"] != victim
    assert elapsed < RECLAIM_AFTER_S + 2 * 1.3 + 3.0  # silence + two ~1.2 s prefills + decode


def test_prefill_worker_killed_after_hand_off_decode_prefills_locally(make_fleet, r, key_prefix):
    # One decode slot, busy with a long request, so the second request's handle
    # waits on the decode stream while its prefill worker dies.
    workers = {"prefill-a": ("prefill",), "prefill-b": ("prefill",), "decode-1": ("decode", "--max-running", "1")}
    with make_fleet(workers) as fleet:
        client = fleet.client(timeout_s=60)
        want = reference(client, 10)
        long = threading.Thread(target=lambda: stream_text(client, 120))
        long.start()
        holder(r, Keys(key_prefix), "decode")
        result = {}
        second = threading.Thread(target=lambda: result.update(out=stream_text(client, 10)))
        second.start()
        keys = Keys(key_prefix)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and r.xlen(keys.stream("decode", "standard")) < 3:  # ref, long, second
            time.sleep(0.02)
        handed = r.xrevrange(keys.stream("decode", "standard"), count=1)[0][1][b"id"].decode()
        prefill_worker = r.hget(keys.run(handed), "handoff").decode()
        kill9(fleet, prefill_worker)
        long.join(timeout=30)
        second.join(timeout=30)
    text, ext, _gap = result["out"]
    assert text == want
    assert ext["kv_transfer"]["local_prefill"] == "prefill_worker_gone"


def test_poison_request_is_dead_lettered_with_an_error(make_fleet, r, key_prefix):
    # max_deliveries = 2: the request's holder is killed twice, the third claim dead-letters it.
    workers = {"prefill-a": ("prefill",), "prefill-b": ("prefill",), "decode-1": ("decode",)}
    keys = Keys(key_prefix)
    with make_fleet(workers) as fleet:
        client = fleet.client(timeout_s=60)
        errors = []

        def call():
            try:
                stream_text(client, 10)
            except openai.APIError as exc:
                errors.append(exc)

        t = threading.Thread(target=call)
        t.start()
        kill9(fleet, holder(r, keys, "prefill"))
        fleet.start_worker("prefill-c", "prefill")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait for the takeover, then kill the new holder too
            p = r.xpending_range(keys.stream("prefill", "standard"), "prefill", "-", "+", 1)
            if p and p[0]["times_delivered"] >= 2:
                break
            time.sleep(0.05)
        kill9(fleet, p[0]["consumer"].decode())
        t.join(timeout=30)
    assert errors and "dead-letter" in str(errors[0])
    dead = r.xrange(keys.dead)
    assert len(dead) == 1 and dead[0][1][b"stage"] == b"prefill"
    assert not r.xpending_range(keys.stream("prefill", "standard"), "prefill", "-", "+", 10)


def test_sigterm_hands_back_what_does_not_finish_in_time(make_fleet, r, key_prefix):
    # drain_timeout_s = 1: a 100-token stream (4 s) cannot finish; it is handed back and resumed.
    workers = {"prefill-1": ("prefill",), "decode-a": ("decode",), "decode-b": ("decode",)}
    keys = Keys(key_prefix)
    with make_fleet(workers) as fleet:
        client = fleet.client(timeout_s=60)
        want = reference(client, 100)
        stopped, stopper = [], []

        def stop_holder(i: int) -> None:
            if i == 10 and not stopped:
                stopped.append(holder(r, keys, "decode"))
                stopper.append(threading.Thread(target=lambda: stopped.append(fleet.stop(stopped[0], signal.SIGTERM))))
                stopper[0].start()

        text, ext, gap = stream_text(client, 100, on_chunk=stop_holder)
        assert stopper, "the stream ended before the stop"
        stopper[0].join(timeout=35)  # fleet.stop waits 30 s for the exit, then kills
        assert not stopper[0].is_alive(), f"{stopped[0]} did not exit after its SIGTERM"
    assert text == want
    assert ext["decode_worker"] != stopped[0] and ext["decode_attempts"] == 2
    assert stopped[1] == 0  # clean exit
    assert gap < 3.0  # handed back at once: no waiting for reclaim_after_s
    for tier in ("interactive", "standard", "batch"):
        consumers = {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(keys.stream("decode", tier), "decode")}
        assert consumers.get(stopped[0], 0) == 0
