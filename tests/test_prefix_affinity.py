"""Prefix affinity: the block chain and the placement rule (pure), and a sim fleet whose
conversations are served where their history is cached, and elsewhere once that worker is
gone, within the bound."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
import urllib.request

import openai
import redis

from skyline.core.keys import Keys
from skyline.scheduler.prefix import (
    AffinityPolicy,
    CacheMatch,
    Holder,
    PlacedInFlight,
    block_chain,
    chain_from,
    choose,
    matched_blocks,
    may_claim,
    move_ms,
    overloaded,
    place,
    wait_bound_ms,
)
from tests.fleet import Fleet
from tests.procs import wait_until


def test_the_chain_keys_each_block_by_everything_before_it():
    tokens = list(range(100))
    chain = block_chain(tokens, 16, 100)
    assert len(chain) == 6 and len(set(chain)) == 6  # six full blocks; the 4 tokens after them are not a block
    assert block_chain(tokens[:96], 16, 100) == chain and block_chain(tokens, 16, 2) == chain[:2]
    assert chain_from(chain[1], tokens[32:64], 16) == chain[2:4]  # a worker extends what its engine stored
    changed = tokens[:]
    changed[20] = 999
    other = block_chain(changed, 16, 100)
    assert other[0] == chain[0] and not set(other[1:]) & set(chain)  # one token changes its block and all after
    assert block_chain(tokens, 16, 100, salt="tenant-a")[0] != chain[0]
    assert block_chain(tokens, 0, 100) == [] and block_chain(tokens[:15], 16, 100) == []


def test_a_prompt_at_the_context_limit_costs_a_bounded_chain():
    assert len(block_chain(list(range(1_000_000)), 16, 512)) == 512


def test_only_a_leading_run_counts():
    chain = ["a", "b", "c", "d"]
    assert matched_blocks(chain, {"a", "b", "d"}) == 2 and matched_blocks(chain, {"b", "c"}) == 0


def test_placement_waits_for_the_longest_holder_that_is_not_overloaded():
    policy = AffinityPolicy(min_blocks=2)
    w1, w2, w3 = Holder("w1", 5, False), Holder("w2", 9, True), Holder("w3", 7, False)
    assert place(policy, [w1, w2, w3]) == w3  # w2 holds more but is full
    assert place(policy, [Holder("w1", 1, False), Holder("w2", 0, False)]) is None  # not worth waiting for
    assert place(policy, [w3]) == w3  # alone of its stage (the gateway places only with two or more)
    assert place(AffinityPolicy(enabled=False), [w1, w3]) is None


def test_a_worker_is_full_where_its_own_claim_rule_stops():
    from types import SimpleNamespace

    def beat(running=0, kv=0.0, watermark=0.0):
        return SimpleNamespace(running=running, max_running=8, kv_usage=kv, kv_watermark=watermark)

    assert overloaded(beat(running=8)) and not overloaded(beat(running=7))
    # A decode worker claims nothing from its kv_watermark on: placement must not wait for it there.
    assert overloaded(beat(kv=0.9, watermark=0.9)) and not overloaded(beat(kv=0.89, watermark=0.9))
    # No watermark (a prefill worker): full only where its cache would evict.
    assert not overloaded(beat(kv=0.94)) and overloaded(beat(kv=0.95))
    assert overloaded(beat(kv=0.95, watermark=0.99))  # a watermark above that does not make it roomier


def test_a_match_places_as_place_does_over_its_holders():
    """`CacheMatch.place` (what the gateway and the simulator call, without a Holder per worker) is
    `place` over `CacheMatch.holders`: random fleets, loads, overloads and policies."""
    import random
    from types import SimpleNamespace

    rng = random.Random(7)
    for _ in range(2_000):
        n = rng.randint(0, 6)
        workers = tuple(SimpleNamespace(worker_id=f"w{rng.randint(0, 4)}", role=rng.choice(["decode", "prefill"]),
                                        running=rng.randint(0, 4), max_running=rng.choice([0, 3, 8]),
                                        kv_usage=rng.random(), kv_watermark=rng.choice([0.0, 0.9]))
                        for _ in range(n))
        matched = {f"w{i}": rng.randint(0, 6) for i in range(5) if rng.random() < 0.6}
        placed = {f"w{i}": rng.randint(0, 5) for i in range(5) if rng.random() < 0.3} or None
        policy = AffinityPolicy(min_blocks=rng.randint(0, 3), load_blocks=rng.choice([0.0, 0.5, 1.0, 2.0]))
        match = CacheMatch(100, 16, matched, workers)
        for stage in ("decode", "prefill"):
            assert match.place(policy, stage, placed) == place(policy, match.holders(stage, placed))


def test_what_every_worker_holds_is_left_to_the_shared_queue():
    # A system prompt all engines have cached, equal loads: no choice beats the shared queue.
    assert place(AffinityPolicy(), [Holder("w1", 17, False), Holder("w2", 17, False)]) is None
    assert place(AffinityPolicy(), [Holder("w1", 20, False), Holder("w2", 17, False)]).worker == "w1"
    assert place(AffinityPolicy(), [Holder("w1", 17, True), Holder("w2", 3, False)]).worker == "w2"  # w1 is full


def test_a_popular_prefix_does_not_draw_every_request_to_its_holder():
    # Only w1 holds the system prompt (2 blocks): it gets new sessions while its load does not
    # outweigh that, then the shared queue does (where the first worker with room takes them).
    policy = AffinityPolicy(load_blocks=1.0)
    assert place(policy, [Holder("w1", 2, False, load=0), Holder("w2", 0, False, load=0)]).worker == "w1"
    assert place(policy, [Holder("w1", 2, False, load=2), Holder("w2", 0, False, load=0)]) is None  # even
    assert place(policy, [Holder("w1", 2, False, load=3), Holder("w2", 0, False, load=0)]) is None
    # A conversation's long history outweighs a busier holder.
    assert place(policy, [Holder("w1", 12, False, load=6), Holder("w2", 0, False, load=0)]).worker == "w1"
    # Load alone, nothing cached anywhere: the shared queue, not a wait for the less loaded worker.
    assert place(policy, [Holder("w1", 0, False, load=4), Holder("w2", 0, False, load=1)]) is None
    assert place(policy, [Holder("w1", 1, False, load=4), Holder("w2", 3, False, load=1)]).worker == "w2"


def test_a_burst_counts_its_own_placements_before_any_heartbeat_does():
    placed = PlacedInFlight()
    policy = AffinityPolicy()
    picks = []
    for i in range(6):  # six at once, no heartbeat between them: every worker's says 0
        holders = [Holder(w, 3 if w == "w1" else 0, False, load=placed.count.get(w, 0)) for w in ("w1", "w2")]
        best = place(policy, holders)
        if best is not None:
            placed.add(f"r{i}", best.worker)
        picks.append(best.worker if best else "shared")
    # w1's 3 cached blocks are worth 3 requests of load; then the shared queue, which balances.
    assert picks == ["w1", "w1", "w1", "shared", "shared", "shared"], picks
    for i in range(6):
        placed.done(f"r{i}")
        placed.done(f"r{i}")  # idempotent: a refusal and a close may both say so
    assert placed.count == {} and placed.worker_of == {}


def test_the_wait_is_a_share_of_the_slack_and_never_past_it():
    policy = AffinityPolicy(slack_share=0.5, max_wait_ms=2_000)
    assert wait_bound_ms(policy, 1_000, 2_000) == 1_500  # half of 1 s of slack
    assert wait_bound_ms(policy, 1_000, 60_000) == 3_000  # capped
    assert wait_bound_ms(policy, 5_000, 4_000) == 5_000  # late already: nobody waits


def test_a_move_that_costs_more_than_the_share_waits_longer_but_never_past_the_slack():
    policy = AffinityPolicy(slack_share=0.5, max_wait_ms=2_000)
    assert wait_bound_ms(policy, 1_000, 2_000, move_ms=0.0) == 1_500  # nothing to lose by moving: the share
    assert wait_bound_ms(policy, 1_000, 2_000, move_ms=300.0) == 1_500  # moving is cheap: the share still
    assert wait_bound_ms(policy, 1_000, 2_000, move_ms=800.0) == 1_800  # waiting 800 ms is no worse than moving
    assert wait_bound_ms(policy, 1_000, 2_000, move_ms=9_000.0) == 2_000  # never past the slack
    assert wait_bound_ms(policy, 1_000, 60_000, move_ms=9_000.0) == 3_000  # nor past max_wait_ms
    assert wait_bound_ms(policy, 5_000, 4_000, move_ms=9_000.0) == 5_000  # late already: nobody waits


def test_a_move_costs_the_tokens_only_the_holder_has_at_one_workers_rate():
    assert move_ms(1_000, 2_000.0, 2) == 1_000.0  # two workers at 2,000 tok/s together: 1,000 each
    assert move_ms(1_000, None, 2) == 0.0  # no rate measured yet: the share alone bounds the wait
    assert move_ms(0, 2_000.0, 2) == 0.0


def test_the_bound_of_a_placement_counts_what_the_next_best_worker_holds():
    from types import SimpleNamespace

    workers = tuple(SimpleNamespace(worker_id=w, role="decode", running=0, max_running=8, kv_usage=0.1,
                                    kv_watermark=0.0) for w in ("w1", "w2"))
    policy = AffinityPolicy(slack_share=0.5, max_wait_ms=10_000)
    # 1,000 tokens; w1 holds 50 blocks of 16 (800 tokens), w2 the 10-block system prompt (160).
    match = CacheMatch(1_000, 16, {"w1": 50, "w2": 10}, workers)
    assert match.saved_tokens("decode", "w1") == 640 and match.saved_tokens("decode", "w2") == 0
    # 640 tokens at 1,000 tok/s (2,000 for the pair): 640 ms, more than half of 1 s of slack.
    c = choose(policy, match, "decode", "r1", 0, 1_000, stage_rate=2_000.0)
    assert c is not None and c.worker == "w1" and c.until_ms == 640
    assert choose(policy, match, "decode", "r2", 0, 1_000).until_ms == 500  # no rate: the share
    assert choose(policy, match, "decode", "r3", 0, 1_000, stage_rate=200.0).until_ms == 1_000  # the slack
    # Every block cached: the last token is computed anyway, so 999 tokens at most are saved.
    full = CacheMatch(1_000, 8, {"w1": 125}, workers)
    assert full.saved_tokens("decode", "w1") == 999


def test_others_may_claim_once_the_bound_passes_or_the_holder_is_gone():
    assert may_claim("w1", "w1", 0, 10_000, True)  # the holder, at once
    assert not may_claim("w2", "w1", 9_999, 10_000, True)
    assert may_claim("w2", "w1", 10_000, 10_000, True)  # no starvation: past the bound, anyone
    assert may_claim("w2", "w1", 0, 10_000, False)  # a dead holder waits for nobody


def _turns(client, history: str, question: str, max_tokens: int = 24):
    prompt = history + question
    r = client.completions.create(model="skyline-sim", prompt=prompt, max_tokens=max_tokens)
    return prompt + r.choices[0].text, r.model_extra["skyline"]


def _view_holds(r: redis.Redis, keys: Keys, worker: str, history: str) -> bool:
    """Whether `worker`'s cache view (in Redis, what the gateway places by) holds every full block of
    `history`, a prompt and its answer (the sim's tokens are the text's bytes; its engine stores both)."""
    block_size = int(r.hget(keys.worker(worker), "cache_block_size") or 0)
    chain = block_chain(list(history.encode()), block_size, 1_000_000) if block_size else []
    return bool(chain) and None not in r.zmscore(keys.kv_cache(worker), chain)


def _views_catch_up(r: redis.Redis, keys: Keys, held: list[tuple[str, str]]) -> None:
    """Until each worker's cache view holds its histories (`held`: (worker, history) pairs): workers
    mirror their engines' cache events every 50 ms."""
    wait_until(lambda: all(_view_holds(r, keys, w, h) for w, h in held), 10,
               lambda: "the workers' cache views to hold their conversations' histories (missing on "
                       f"{sorted(w for w, h in held if not _view_holds(r, keys, w, h))})")


def test_each_turn_of_a_conversation_is_served_where_its_history_is_cached(redis_url, key_prefix, tmp_path):
    (tmp_path / "cfg.toml").write_text('[gateway]\nmode = "colocated"\n')
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    r = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    with fleet.running({"decode-1": ("decode",), "decode-2": ("decode",)}, timeout_s=60):
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
        system = "You are a careful assistant. Answer briefly and cite the document. " * 4
        # Each conversation's own opening is 12+ blocks: more than a load of six requests can outweigh
        # (placement weighs `affinity_load_blocks` per request a worker holds, by a heartbeat that may be
        # a second old and still count all six first turns), so the holder is the cheapest worker.
        convs = {c: system + f"Conversation {c}: " + f"notes on topic {c}. " * 12 for c in range(6)}
        served: dict[int, list[str]] = {c: [] for c in convs}
        cached: list[tuple[int, int]] = []
        with concurrent.futures.ThreadPoolExecutor(len(convs)) as pool:  # first turns at once: nothing cached yet
            firsts = {c: pool.submit(_turns, client, convs[c], "\nUser: hello?\nAssistant:") for c in convs}
            for c, f in firsts.items():
                convs[c], ext = f.result()
                served[c].append(ext["decode_worker"])
        for turn in range(1, 3):
            # While the users read the answers, the workers' views catch up.
            _views_catch_up(r, keys, [(served[c][0], convs[c]) for c in convs])
            for c in convs:
                before = len(convs[c])
                convs[c], ext = _turns(client, convs[c], f"\nUser: question {turn} of {c}?\nAssistant:")
                served[c].append(ext["decode_worker"])
                cached.append((ext["kv_transfer"]["num_cached_tokens"], before))
                assert ext["placement"]["worker"] == served[c][0], ext
        for c, workers in served.items():
            assert len(set(workers)) == 1, served  # every turn where the first one was computed
        assert len({w[0] for w in served.values()}) == 2, served  # and both workers were used
        # A later turn finds at least its history's full blocks (bytes = tokens in the sim).
        assert all(n >= (before // 16) * 16 - 16 for n, before in cached), cached
        for w in ("decode-1", "decode-2"):
            assert r.zcard(keys.kv_cache(w)) > 0  # the view, in Redis
            assert 0 < r.ttl(keys.kv_cache(w)) <= 10  # expiring with the worker
        assert r.smembers(keys.affinity_lanes("decode")) == {b"decode-1", b"decode-2"}
        timeline = client.get(f"/requests/{ext['request_id']}/timeline", cast_to=object)
        placed = [e for e in timeline["events"] if e["event"] == "placed"]
        assert placed and placed[0]["fields"]["worker"] == served[5][0]
        metrics = fleet.worker_metrics(served[5][0])
        assert 'skyline_worker_prompt_tokens_total{model="skyline-sim",source="cached"}' in metrics

        # The holder dies: the next turn is served by the other worker, within the bound.
        holder = served[0][0]
        other = ({"decode-1", "decode-2"} - {holder}).pop()
        fleet.stop(holder, sig=signal.SIGKILL)
        t0 = time.monotonic()
        _, ext = _turns(client, convs[0], "\nUser: are you still there?\nAssistant:")
        assert ext["decode_worker"] == other
        bound_s = AffinityPolicy().max_wait_ms / 1000
        assert time.monotonic() - t0 < bound_s + 3, time.monotonic() - t0  # the bound, and a claim loop's turn


def test_the_gateway_bounds_a_placement_by_what_moving_it_would_cost_at_the_measured_rate(
        redis_url, key_prefix, tmp_path):
    """The live gateway passes the pool's measured prefill rate to the placement rule: with a share of
    the slack too small to matter, a turn whose history only its holder has waits about as long as
    the other worker would take to recompute that history (and never past its slack)."""
    (tmp_path / "cfg.toml").write_text(
        '[gateway]\nmode = "colocated"\naffinity_slack_share = 0.01\naffinity_max_wait_ms = 60000\n'
        '[engine]\nsim_prefill_per_token_s = 0.002\n')  # ~500 prompt tokens/s per worker
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, extra=["--config", str(tmp_path / "cfg.toml")])
    with fleet.running({"decode-1": ("decode",), "decode-2": ("decode",)}, timeout_s=60):
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
        history, first = _turns(client, "A conversation about tides and the moon that pulls them. " * 6,
                                "\nUser: why two a day?\nAssistant:", max_tokens=8)

        def gateway_sees_a_rate() -> float:
            """The holder's measured prefill rate in the gateway's view of the fleet (its /dashboard/data):
            a heartbeat carries it (every second), the gateway reads heartbeats every 0.5 s."""
            with urllib.request.urlopen(f"{fleet.url}/dashboard/data", timeout=5) as resp:
                workers = json.loads(resp.read())["workers"]
            return sum(w["tokens_per_s"] for w in workers if w["worker_id"] == first["decode_worker"])

        wait_until(gateway_sees_a_rate, 10, f"the gateway to see {first['decode_worker']}'s measured prefill rate")
        sent_ms = time.time() * 1000
        _, ext = _turns(client, history, "\nUser: and spring tides?\nAssistant:", max_tokens=8)
        placed = ext["placement"]
        assert placed and placed["worker"] == first["decode_worker"], ext
        waited_ms = placed["until_ms"] - sent_ms
        slack_ms = ext["slo_target"]["ttft_ms"]
        # The history (~350 tokens, held by one worker only) at ~500 tok/s: ~0.7 s; the share of the
        # slack alone (what the bound is without a rate) is 1% of it, under 0.1 s.
        assert 0.3 * 1000 <= waited_ms <= slack_ms + 100, (waited_ms, slack_ms, placed)


def test_a_turn_whose_decode_worker_holds_its_history_skips_the_prefill_pool(redis_url, key_prefix, tmp_path):
    """Conditional disaggregation counts the tokens left to compute: the next turn of a conversation,
    whose history the decode engine holds (it pulled the first turn's KV), is computed there; a new
    long prompt still goes to the prefill pool. The backlog admission reserved is what the workers
    take off again (nothing left over)."""
    fleet = Fleet(redis_url, key_prefix, "sim", tmp_path, gateway_args=("--min-remote-prefill-tokens", "64"))
    r = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    with fleet.running({"prefill-1": ("prefill",), "decode-1": ("decode",)}, timeout_s=60):
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0, timeout=60)
        history = "A long shared document about lighthouses and the keepers who tend them. " * 5
        history, first = _turns(client, history, "\nUser: who tends them?\nAssistant:")
        assert first["route"] == "disagg" and first["prefill_worker"] == "prefill-1"
        _views_catch_up(r, keys, [(first["decode_worker"], history)])  # it pulled the KV, then stored the answer's
        _, second = _turns(client, history, "\nUser: and at night?\nAssistant:")
        assert second["route"] == "colocated", second  # ~30 new tokens: under the 64 of the threshold
        assert second["kv_transfer"]["num_cached_tokens"] >= (len(history) // 16 - 1) * 16, second["kv_transfer"]
        _, fresh = _turns(client, "An unrelated question, long enough to be worth a prefill worker. " * 3, "?")
        assert fresh["route"] == "disagg"
        wait_until(lambda: all(int(v) == 0 for v in r.hgetall(keys.backlog).values()), 10,
                   lambda: f"the workers to take off the backlog admission reserved: {r.hgetall(keys.backlog)}")
        assert all(int(v) == 0 for v in r.hgetall(keys.backlog).values()), r.hgetall(keys.backlog)
