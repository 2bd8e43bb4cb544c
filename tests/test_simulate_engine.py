"""The simulator's event engine, performance models and decode batch math, against hand-computed values."""

from __future__ import annotations

import json
import math

import pytest

from skyline.core.config import load_config
from skyline.tools.bench.workload import WorkloadSpec
from skyline.tools.simulate.events import EventLoop
from skyline.tools.simulate.fleet import FleetSpec, Simulation, with_overrides
from skyline.tools.simulate.perf import interp
from skyline.tools.simulate.perf_profile import ProfileModel
from skyline.tools.simulate.request import SimRequest
from skyline.tools.simulate.roofline import GPUS, MODELS, Efficiency, RooflineModel, roofline
from skyline.tools.simulate.workload import load_trace, measured_cache_hit, synthetic
from tests.simmodels import HandModel

# -- event engine ---------------------------------------------------------------------------------


def test_events_fire_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")  # same time as "a", scheduled later: fires after it
    loop.at(5.0, seen.append, "too late")
    loop.run(until=3.0)
    assert seen == ["a", "b", "c"]
    assert loop.now == 3.0 and loop.pending() == 1


def test_arrivals_merge_with_events_and_an_event_at_the_same_time_goes_first():
    loop, seen = EventLoop(), []
    loop.at(1.0, seen.append, "event@1")
    loop.run(until=10.0, arrivals=[(0.5, "arr@0.5"), (1.0, "arr@1"), (2.0, "arr@2")], on_arrival=seen.append)
    assert seen == ["arr@0.5", "event@1", "arr@1", "arr@2"]


def test_an_event_scheduled_in_the_past_runs_now():
    loop, seen = EventLoop(), []

    def first(_):
        loop.at(loop.now - 1.0, lambda _: seen.append(loop.now))

    loop.at(4.0, first)
    loop.run(until=9.0)
    assert seen == [4.0]



def test_the_compiled_loops_heap_pops_what_heapq_pops():
    """The compiled event loop's own push and pop (events._push/_pop) against heapq, on entries with
    many equal times (the sequence number decides) and interleaved pushes and pops."""
    import heapq
    import random

    from skyline.tools.simulate.events import _pop, _push

    rng = random.Random(7)
    ours, theirs, popped_ours, popped_theirs = [], [], [], []
    for seq in range(5_000):
        entry = (float(rng.randint(0, 200)) / 4, seq, None, seq)
        _push(ours, entry)
        heapq.heappush(theirs, entry)
        if rng.random() < 0.4:
            popped_ours.append(_pop(ours))
            popped_theirs.append(heapq.heappop(theirs))
    while theirs:
        popped_ours.append(_pop(ours))
        popped_theirs.append(heapq.heappop(theirs))
    assert popped_ours == popped_theirs and not ours
    assert len(popped_ours) == 5_000

# -- performance models -------------------------------------------------------------------------------


def test_interp_is_piecewise_linear_and_extends_beyond_the_ends():
    xs, ys = [0.0, 10.0, 20.0], [1.0, 2.0, 4.0]
    assert interp(xs, ys, 5.0) == pytest.approx(1.5)
    assert interp(xs, ys, 15.0) == pytest.approx(3.0)
    assert interp(xs, ys, 30.0) == pytest.approx(6.0)  # last slope continued
    assert interp(xs, ys, -10.0) == pytest.approx(0.0)


def test_roofline_decode_is_memory_bound_and_matches_the_hand_computation():
    # OPT-13B: weights 12.85e9 params x 2 bytes; one A100 at 70% of 2.039 TB/s; 2 ms step overhead.
    m = roofline("A100", "opt-13b")
    shape = MODELS["opt-13b"]
    assert shape.params == pytest.approx(12.85e9, rel=0.01)
    weights_s = shape.params * 2 / (2.039e12 * 0.7)
    kv_per_token_s = 2 * 40 * 40 * 128 * 2 / (2.039e12 * 0.7)  # 819,200 bytes per token of KV
    a, b = m.decode_coeffs(1, 1000)
    assert a == pytest.approx(weights_s + 0.002)
    assert b == pytest.approx(kv_per_token_s)
    assert m.decode_step_s(1, 1000) == pytest.approx(weights_s + 0.002 + 1000 * kv_per_token_s)


def test_roofline_prefill_is_compute_bound_and_matches_the_hand_computation():
    m = roofline("A100", "opt-13b")
    shape = MODELS["opt-13b"]
    n = 512
    flops = 2 * shape.matmul_params * n + 4 * 40 * 5120 * (n * (n + 1) / 2) + 2 * 5120 * 50272
    assert m.prefill_step_s([(0, n)]) == pytest.approx(flops / (312e12 * 0.6) + 0.002)
    # Close to the A100 profile DistServe published for OPT-13B (18.1 ms + 0.102 ms/token: 70 ms).
    assert 0.06 < m.prefill_step_s([(0, n)]) < 0.085


def test_roofline_tensor_parallelism_divides_work_and_adds_all_reduces():
    one, two = roofline("H100", "llama-3-8b", tp=1), roofline("H100", "llama-3-8b", tp=2)
    assert two.devices == 2
    t1, t2 = one.prefill_step_s([(0, 4096)]), two.prefill_step_s([(0, 4096)])
    allreduce = 32 * 2 * 4096 * 4096 * 2 * 2 * (1 / 2) / GPUS["H100"].nvlink_bytes_per_s
    assert t2 == pytest.approx((t1 - 0.002) / 2 + 0.002 + allreduce)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens  # the weights are paid once, the memory twice


def test_roofline_refuses_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        RooflineModel(GPUS["A100"], MODELS["opt-13b"], 1, Efficiency(memory_utilisation=0.3))


PROFILE = {
    "kind": "skyline-engine-profile", "max_step_tokens": 256, "kv_bytes_per_token": 1000,
    "kv_capacity_tokens": 10_000, "kv_transfer": {"latency_s": 0.01, "bytes_per_s": 1e6, "source": "test"},
    "prefill": [{"tokens": 100, "seqs": 1, "seconds": 0.3}, {"tokens": 300, "seqs": 1, "seconds": 0.7},
                {"tokens": 200, "seqs": 2, "seconds": 0.5}],
    "decode": [{"batch": 1, "context_tokens": 100, "step_s": 0.05}, {"batch": 1, "context_tokens": 1100, "step_s": 0.06},
               {"batch": 4, "context_tokens": 400, "step_s": 0.08}],
}


def test_profile_prefill_chunks_add_up_to_the_measured_prompt():
    m = ProfileModel(PROFILE)
    # F(N) = 0.1 + 0.002 N through the two single-prompt points; a0 = F(0) = 0.1
    assert m.a0 == pytest.approx(0.1)
    assert m.prefill_step_s([(0, 100)]) == pytest.approx(0.3)
    assert m.prefill_step_s([(0, 256)]) + m.prefill_step_s([(256, 44)]) == pytest.approx(0.7)
    # two prompts starting together share the fixed step cost once: 2 F(100) - a0
    assert m.prefill_step_s([(0, 100), (0, 100)]) == pytest.approx(0.5)
    assert m.batch_error() == pytest.approx(0.0)


def test_profile_decode_fits_context_per_batch_and_interpolates_batches():
    m = ProfileModel(PROFILE)
    assert m.decode_coeffs(1, 0) == pytest.approx((0.049, 1e-5))
    assert m.decode_step_s(4, 400) == pytest.approx(0.08)
    a, _b = m.decode_coeffs(2, 0)  # a third of the way from batch 1 to batch 4
    assert a == pytest.approx(0.049 + (0.08 - 0.049) / 3)
    assert m.kv_transfer_s(1000) == pytest.approx(0.01 + 1.0)


def test_profile_refuses_foreign_json():
    with pytest.raises(ValueError):
        ProfileModel({"kind": "something else"})


# -- the decode batch in closed form ------------------------------------------------------------------------


def _fleet(mode="disagg", **kw):
    cfg = with_overrides(load_config(None), admission=False, preemption=False, min_remote_prefill_tokens=0)
    # step = 10 ms + 1 us per context token; prefill = 1 ms per token; no transfer time
    m = HandModel("linear", prefill_tokens_per_s=1000, step_s=0.010, s_per_context_token=1e-6)
    return Simulation(cfg, FleetSpec(mode, 1 if mode == "disagg" else 0, 1), m, m, record_itl=True, overhead_s=0.0)


def test_one_request_token_times_in_closed_form():
    sim = _fleet()
    req = SimRequest(0, "chat", "interactive", 0.0, 100, 5, 1e9, 1e9)
    sim.run([req], drain_s=60)
    prefill = 0.1  # 100 tokens x 1 ms
    steps = [0.010 + 1e-6 * (100 + j) for j in range(5)]  # context grows by one token per step
    assert req.ttft_s == pytest.approx(prefill + steps[0])
    assert req.latency_s == pytest.approx(prefill + sum(steps))
    assert req.itl_s == pytest.approx(steps[1:])
    assert req.outcome == "ok" and req.output_tokens == 5


def test_a_request_joining_mid_step_waits_for_the_step_in_progress():
    sim = _fleet()
    a = SimRequest(0, "chat", "interactive", 0.0, 10, 50, 1e9, 1e9)  # decoding from t = 0.01
    b = SimRequest(1, "chat", "interactive", 0.1, 10, 3, 1e9, 1e9)  # prefilled by t = 0.11
    sim.run([a, b], drain_s=60)
    # a's steps: 10 ms + 1 us x (10 + j); b's KV arrives at 0.11, inside a's step; it joins at the next boundary.
    t, j = 0.01, 0
    while t <= 0.11:
        t += 0.010 + 1e-6 * (10 + j)
        j += 1
    first_b = t + 0.010 + 1e-6 * (10 + j + 10)  # both in the batch: context = a's + b's prompt
    assert b.ttft_s == pytest.approx(first_b - 0.1)
    assert a.itl_s[j - 1] == pytest.approx(first_b - t)  # a's step slowed by b's context


def test_each_batch_change_moves_the_next_completion_as_the_step_times_say():
    """b joins a's batch (a's next completion moves later), finishes first (an earlier completion than
    the one armed for a) and leaves (a's steps speed up again): all by the closed-form step times."""
    sim = _fleet()
    a = SimRequest(0, "chat", "interactive", 0.0, 10, 50, 1e9, 1e9)
    b = SimRequest(1, "chat", "interactive", 0.1, 10, 3, 1e9, 1e9)
    seen, on_done = {}, sim.on_done
    sim.on_done = lambda req: (seen.__setitem__(req.index, sim.loop.now), on_done(req))
    sim.run([a, b], drain_s=60)
    assert seen == {0: a.done_t, 1: b.done_t}  # the fleet learns of each completion when it happens
    step = lambda context: 0.010 + 1e-6 * context
    t, j = 0.01, 0  # a alone until the boundary after b's KV arrives at 0.11
    while t <= 0.11:
        t += step(10 + j)
        j += 1
    for i in range(3):  # together: b's three tokens
        t += step(10 + j + i + 10 + i)
    assert b.latency_s == pytest.approx(t - 0.1)
    for i in range(j + 3, 50):  # a alone again
        t += step(10 + i)
    assert a.latency_s == pytest.approx(t)


def test_a_preempted_request_comes_back_ahead_of_its_tiers_newer_entries():
    """The simulated stage queues mirror the live retry lanes (skyline/core/streams.py)."""
    from skyline.tools.simulate.queues import StageQueues

    q = StageQueues("prefill", ("interactive", "standard", "batch"))
    reqs = {}
    for name, tier, deadline in (("std-a", "standard", 0.1), ("std-b", "standard", 0.2), ("std-c", "standard", 0.3),
                                 ("inter", "interactive", 0.15)):
        reqs[name] = SimRequest(len(reqs), "chat", tier, 0.0, 10, 1, 1e9, 1e9)
        reqs[name].deadline = deadline
        q.push(reqs[name], (reqs[name], name))
    assert q.claim()[1] == "std-a"
    q.push_retry(reqs["std-a"], (reqs["std-a"], "std-a"))  # preempted
    assert q.head()[1] == "std-a" and q.claim(max_rank=0)[1] == "inter"  # a shield admits only interactive
    assert [q.claim()[1] for _ in range(3)] == ["std-a", "std-b", "std-c"]
    assert q.claim() is None and q.size == q.retry_size == 0


def test_colocated_requests_prefill_on_the_decode_worker():
    sim = _fleet("colocated")
    req = SimRequest(0, "chat", "interactive", 0.0, 200, 4, 1e9, 1e9)
    sim.run([req], drain_s=60)
    assert req.route == "colocated"
    assert req.ttft_s == pytest.approx(0.2)  # the prefill step samples the first token
    assert req.latency_s == pytest.approx(0.2 + sum(0.010 + 1e-6 * (201 + j) for j in range(3)))


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_prefix_cache_hit_is_not_computed_again(mode, tmp_path):
    """A replayed trace carries each request's measured prefix-cache hit; the engine computes only the
    rest. 600-token prompts at 1 ms per token: 400 cached -> 0.2 s of prefill, none cached -> 0.6 s."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"send_at": 0, "prompt_tokens": 600, "max_tokens": 1, "cached_tokens": 400}) + "\n"
                     + json.dumps({"send_at": 5, "prompt_tokens": 600, "max_tokens": 1}) + "\n")
    hit, miss = load_trace(trace, cache_hits=True)[0][0.0]
    sim = _fleet(mode)
    sim.run([hit, miss], drain_s=60)
    first_step = 0.0 if mode == "colocated" else 0.010 + 1e-6 * 600  # disagg: the decode step after the KV
    assert hit.ttft_s == pytest.approx(0.2 + first_step) and miss.ttft_s == pytest.approx(0.6 + first_step)
    assert [q.cached_tokens for q in load_trace(trace)[0][0.0]] == [0, 0]  # unless asked for


def test_a_measured_cache_hit_is_the_engine_that_computed_the_prompt():
    local = {"skyline": {"kv_transfer": {"remote_prefill": False, "num_cached_tokens": 128}}}
    remote = {"skyline": {"kv_transfer": {"remote_prefill": True, "num_cached_tokens": 600,  # the transferred KV
                                          "prefill_cached_tokens": 256}}}
    assert [measured_cache_hit(r) for r in (local, remote, {"skyline": None}, {"cached_tokens": 64})] == [128, 256, 0, 64]


def test_runs_are_deterministic_for_a_seed_and_differ_across_seeds():
    def run(seed):
        cfg = load_config(None)
        m = roofline("H100", "llama-3-8b")
        spec = WorkloadSpec(seed=seed)
        reqs = synthetic(spec, 40.0, 800, lambda c: (300.0, 50.0))
        Simulation(cfg, FleetSpec("disagg", 1, 2), m, m).run(reqs, drain_s=30)
        return [(r.outcome, r.ttft_s, r.latency_s) for r in reqs]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_synthetic_arrivals_are_the_benchmarks():
    import random

    from skyline.tools.bench.workload import arrival_offsets, class_sequence

    spec = WorkloadSpec(seed=3)
    reqs = synthetic(spec, 2.5, 50, lambda c: (1.0, 1.0))
    assert [r.send_at for r in reqs] == arrival_offsets(50, 2.5, random.Random("3:arrivals:2.5"))
    phase = random.Random("3:content:2.5").random()
    assert [r.cls for r in reqs] == class_sequence(50, spec.mix, phase)
    assert all(spec.chat_prompt[0] <= r.prompt_tokens <= spec.chat_prompt[1] for r in reqs if r.cls == "chat")
    assert math.isclose(sum(r.cls == "chat" for r in reqs) / 50, spec.mix, abs_tol=0.03)
