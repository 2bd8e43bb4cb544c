"""One copy of every rule: the live fleet's decision code and the simulator's, fed the same events, decide the same.

Each test runs a small simulated fleet and, at every decision its workers (or its gateway) make, asks the
live code the same question in the same state, and compares the answers:

  - the live side is the real code: `WorkerRuntime` (its claim-room check, the tiers a shield lets it claim
    and the shield's lift, the preemption victims it picks and their order, its measured-rate-or-prior,
    how long it waits before a claim: `_claim_defer`, with the peers as the heartbeats said: `see_peers`),
    `TierQueues` (the retry lane's tie, EDF over the heads), `DecodeHandler._plan` (the KV handle's expiry),
    the vLLM scheduler hook (the step shape and its held-steps counter), and the gateway's
    `apply_admission` and `learn` (admission, demotion, the calibration hook). No Redis and no engine: its
    state follows the simulated worker's (claims, finished prompts, the engine's KV usage, the streams'
    pace samples), copied by hooks on the simulator, on the simulator's clock;
  - the simulator side runs its own code path; the hooks only watch it.

A rule re-implemented on either side shows up as a different decision at some event of these runs, and each
run is checked to exercise its rules (victims chosen, a shield that holds and one that lifts, refusals by
each room limit, held steps, demotions, ...).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest

from skyline.core import messages
from skyline.core.config import SkylineConfig
from skyline.core.streams import Claimed, Head
from skyline.gateway.admission import apply_admission, learn
from skyline.gateway.errors import ApiError
from skyline.scheduler.admission import handoff_wait_ms, prefill_is_faster, stage_of
from skyline.scheduler.disagg import route
from skyline.scheduler.edf import pick_tier
from skyline.tools.simulate import decode_worker as sim_decode
from skyline.tools.simulate import prefill_worker as sim_prefill
from skyline.tools.simulate.fleet import FleetSpec, Simulation
from skyline.tools.simulate.preempt import measured_rate
from skyline.tools.simulate.request import SimRequest
from skyline.workers import runtime as live_runtime
from skyline.workers.decode import DecodeHandler
from skyline.workers.held import HeldRequest
from skyline.workers.runs import RunClaim
from skyline.workers.runtime import WorkerRuntime
from tests.simmodels import HandModel


class _SmallKv(HandModel):
    kv_capacity_tokens = 4_000  # the KV watermark (0.9) binds at 3,600 tokens

    def kv_transfer_s(self, tokens):
        return 0.05  # claimed requests wait for their KV a while (they count as held meanwhile)


class _Engine:
    """The live worker's engine as its decisions see it: its kind and its KV usage (the simulated engine's)."""

    kind = "vllm"  # vLLM's step shape (cap, background steps, holding): what the simulator models

    def __init__(self, kv_usage=lambda: 0.0):
        self.kv_usage, self.on_step = kv_usage, None

    def stats(self):
        return SimpleNamespace(kv_usage=self.kv_usage(), waiting=0)

    def computed_tokens(self, request_id):
        return None  # vLLM does not report a prompt's progress: the claim defer estimates it, as simulated


def _config(role: str, admission: bool = False, **worker) -> SkylineConfig:
    cfg = SkylineConfig()
    # heartbeat_s 0: the simulated worker re-reads its meter at every decision, as the live one does (in a
    # simulated fleet it reads it once per heartbeat, as the fleet view sees it: a modelled staleness). The
    # live worker's id is the simulated one's: it finds itself among the heartbeats both read.
    return replace(cfg, worker=replace(cfg.worker, role=role, worker_id=f"{role}-0", heartbeat_s=0.0, **worker),
                   gateway=replace(cfg.gateway, admission=admission, min_remote_prefill_tokens=0),
                   observability=replace(cfg.observability, timeline=False, log_events=False))


def _request(i: int, tier: str, at: float, prompt: int, out: int = 4, ttft_ms: float = math.inf,
             tpot_ms: float = math.inf) -> SimRequest:
    return SimRequest(i, "chat", tier, at, prompt, out, ttft_ms, tpot_ms)


def _rid(req: SimRequest) -> str:
    return f"r{req.index}"


def _generate_request(req: SimRequest, arrival_ms: int, deadline_ms: int, ttft_ms: int) -> messages.GenerateRequest:
    return messages.GenerateRequest(
        request_id=_rid(req), model="m", prompt_token_ids=[1] * req.prompt_tokens,
        sampling=messages.SamplingSpec(max_tokens=req.max_tokens), tier=req.tier, arrival_ms=arrival_ms,
        deadline_ms=deadline_ms, ttft_ms=ttft_ms, tpot_ms=req.tpot_ms, priority=req.priority, route=req.route,
        preemptions=req.preemptions)


def _fields(item: tuple) -> dict:
    """A simulated entry as the live streams hold it: its deadline, its prompt, and the prompt tokens its
    claimer computes (none for decode work with a KV handle)."""
    req = item[0]
    return {b"deadline_ms": int(req.deadline * 1000), b"prompt_tokens": req.prompt_tokens,
            b"prefill_tokens": req.backlog_tokens if item[1] is None else 0}


class _Task:
    """Stands for the asyncio task of a request the live worker holds (only its identity matters)."""


@dataclass
class LiveTwin:
    """A live `WorkerRuntime` holding what a simulated worker holds, on the simulator's clock."""

    rt: WorkerRuntime
    sim: Simulation
    q: object  # the simulated stage's queues: the live worker's streams hold the same entries
    held: dict = field(default_factory=dict)  # request id -> the live worker's record of it
    claimed_ms: dict = field(default_factory=dict)

    def hold(self, req: SimRequest, kv: bool = False) -> None:
        gen = _generate_request(req, int(req.send_at * 1000), int(req.deadline * 1000), 0)
        msg = gen if self.rt.role == "prefill" else messages.DecodeWork(gen, kv_handle={"kv": 1} if kv else None)
        claimed = Claimed("stream", "0-1", req.tier, msg)
        held = HeldRequest.of(claimed, self.rt.rules.first_phase(msg))
        self.rt.hold(held, _Task())
        self.held[_rid(req)] = held
        self.claimed_ms[_rid(req)] = int(self.sim.loop.now * 1000)

    def release(self, rid: str) -> None:
        self.rt.held.release(self.held.pop(rid))  # what the request's task does as it ends

    def victims(self, req: SimRequest, claimed: bool) -> list[str]:
        """`_preempt_for`'s decision; the victims' tasks are cancelled and re-queued, and so released."""
        chosen = self.rt.victims_for(req.tier, int(req.deadline * 1000), req.prompt_tokens, claimed)
        for rid in chosen:
            self.release(rid)
        return chosen

    def _heads(self):
        """The heads of the live worker's streams as `TierQueues` reads them (each tier: stream or retry lane)."""
        keys, stage, entries, owner = self.rt.keys, self.rt.stages[0], [], {}
        for tier in self.q.tier_order:
            for lane, key in ((self.q.queues[tier], keys.stream(stage, tier)),
                              (self.q.retry[tier], keys.retry_stream(stage, tier))):
                if lane:
                    head = lane[0][0]
                    entries.append((key, _fields(lane[0])))
                    owner[key] = head
        return self.rt.queues.heads_of(entries), owner

    def pick(self) -> SimRequest | None:
        """What the live claim loop takes: EDF among the tiers the shield allows; when none of those waits,
        the shield's lift (then it claims again at once) or nothing."""
        heads, owner = self._heads()
        while True:
            tiers = self.rt._claimable_tiers()
            tier = self.rt.queues.pick(heads, tiers, self.rt.tokens_per_s())
            if tier is not None:
                return owner[heads[tier].stream]
            if tiers is None or not self.rt.claims.found_nothing(self.rt.computing_ranks()):
                return None

    def head(self) -> SimRequest | None:
        """The head `_maybe_preempt` checks while the worker is full."""
        heads, owner = self._heads()
        tier = pick_tier({t: h.deadline_ms for t, h in heads.items()}, self.rt.tiers_by_rank)
        return owner[heads[tier].stream] if tier else None


def _live(cfg: SkylineConfig, sim: Simulation, q, monkeypatch, kv_usage=lambda: 0.0) -> LiveTwin:
    monkeypatch.setattr(live_runtime, "now_ms", lambda: int(sim.loop.now * 1000))
    monkeypatch.setattr(live_runtime, "time", SimpleNamespace(monotonic=lambda: sim.loop.now, time=lambda: sim.loop.now))
    twin = LiveTwin(WorkerRuntime(cfg, _Engine(kv_usage), "m"), sim, q)
    real_refresh = sim._refresh

    def refresh(arg=None):
        real_refresh(arg)
        twin.rt.see_peers(sim.peers)  # the live worker reads the heartbeats the simulated ones read

    sim._refresh = refresh  # (the refresh re-arms itself through the attribute)
    return twin


def _peer_of(sim: Simulation, role: str, loads: list[tuple[float, int]]) -> None:
    """A peer of the twin's stage in the heartbeats both read (no simulated worker behind it: it claims
    nothing), whose engine has `tokens` prompt tokens left at every beat from each `(time, tokens)` on (it
    keeps being given prompts): the claim defer weighs the twin's tokens left against it."""

    class Beat(SimpleNamespace):
        @property
        def last_seen(self) -> float:
            return sim.loop.now  # it beats whenever it is read

    beat = Beat(worker_id=f"{role}-peer", role=role, running=0, max_running=sim.worker_cfg.max_running,
                kv_usage=0.0, kv_watermark=0.0, running_tokens=0, tokens_per_s=0.0, left_tokens=0, computes_long=0)
    sim.peers.append(beat)

    def load(_arg, n: int) -> None:
        beat.running_tokens = beat.left_tokens = n

    for at, tokens in loads:
        sim.loop.at(at, lambda arg, n=tokens: load(arg, n))


def _watch_claims(module, worker, twin: LiveTwin, log: list, monkeypatch) -> None:
    """Every claim the simulated worker makes (`claim_for`), every wait before a claim it weighs
    (`claim_defer`) and every preemption it decides (`victims_for`) is asked of the live worker in the same
    state; the live worker then holds what the simulated one holds."""
    real_claim, real_victims, real_defer = module.claim_for, module.victims_for, module.claim_defer

    def claim_for(w, q, held):
        if w is not worker:
            return real_claim(w, q, held)
        live = twin.pick()
        item = real_claim(w, q, held)
        sim = item[0] if item else None
        assert sim is live, (f"claims differ at {w.sim.loop.now:.3f} s: simulated {sim and _rid(sim)}, "
                             f"live {live and _rid(live)}")
        log.append(("claim", _rid(live) if live else None))
        # Decode work with a KV handle: no prompt to compute here (no handle in these runs is old enough to expire).
        if item is not None and item[1] is not None:
            twin.hold(item[0], kv=True)
        return item

    def victims_for(w, held, head, claimed=True):
        if w is not worker:
            return real_victims(w, held, head, claimed)
        if not claimed:
            assert twin.head() is head, "the head checked by a full worker differs"
        live = twin.victims(head, claimed)
        out = real_victims(w, held, head, claimed)
        sim = [_rid(h.req) for h in out]
        assert sim == live, f"victims differ at {w.sim.loop.now:.3f} s: simulated {sim}, live {live}"
        log.append(("victims", tuple(live)))
        if claimed:
            twin.hold(head)  # the live worker starts the request after its preemption check
        return out

    def claim_defer(w, q, item, held):
        got = real_defer(w, q, item, held)
        if w is not worker:
            return got
        req = item[0]
        # The head as the live worker's peek reads it: no prompt to compute for decode work with a KV handle.
        head = Head(req.tier, int(req.deadline * 1000), req.prompt_tokens, request_id=_rid(req),
                    prefill_tokens=0 if item[1] is not None else req.backlog_tokens, stage=q.stage)
        live = twin.rt._claim_defer(head)
        assert got == live, (f"claim defers differ at {w.sim.loop.now:.3f} s for {_rid(req)}: "
                             f"simulated {got}, live {live}")
        log.append(("defer", live))
        rt = twin.rt
        computing = rt.held.computing_prompts()
        if (not live and computing and head.prefill_tokens and rt.freest.free_s(rt.worker_id, q.stage, w.sim.loop.now) is not None
                and rt.tier_rank[req.tier] >= min(rt.tier_rank[h.request.tier] for h in computing)):
            log.append(("no_freer_peer", _rid(req)))  # computing, a peer of the stage, yet no wait: it frees later
        return got

    monkeypatch.setattr(module, "claim_for", claim_for)
    monkeypatch.setattr(module, "victims_for", victims_for)
    monkeypatch.setattr(module, "claim_defer", claim_defer)


def _watch_room(worker, twin: LiveTwin, log: list) -> None:
    real = worker.has_room

    def has_room():
        sim, live = real(), twin.rt.has_room()
        assert sim == live, f"room differs at {worker.sim.loop.now:.3f} s: simulated {sim}, live {live}"
        log.append(("room", live))
        return sim

    worker.has_room = has_room
    real_paced = getattr(worker, "paced_due", None)
    if real_paced is None:
        return

    def paced_due():
        """A worker full by the pace rule alone claims the head that must start now (live: `paced_out` and the
        claim's `due_by_ms`): the same verdict and the same head."""
        q = real_paced()
        now_ms = int(worker.sim.loop.now * 1000)
        if q is not None:
            assert twin.rt.paced_out(), f"the live worker is not paced out at {worker.sim.loop.now:.3f} s"
            heads, owner = twin._heads()
            tier = twin.rt.queues.pick(heads, twin.rt._claimable_tiers(), twin.rt.tokens_per_s(), due_by_ms=now_ms)
            assert tier is not None, f"no head is due for the live worker at {worker.sim.loop.now:.3f} s"
            log.append(("paced_claim", _rid(owner[heads[tier].stream])))
        return q

    worker.paced_due = paced_due


# -- the prefill worker: room, preemption, shield, the measured rate -----------------------------------------


def test_the_prefill_worker_decides_as_the_live_one(monkeypatch):
    cfg = _config("prefill", max_running=4, prefill_token_budget=2048)
    sim = Simulation(cfg, FleetSpec("disagg", 1, 1), HandModel("p", 1_000.0, max_step_tokens=256),
                     HandModel("d", 1_000.0, max_step_tokens=256, step_s=0.01))
    twin = _live(cfg, sim, sim.prefill_q, monkeypatch)
    w = sim.prefill_workers[0]
    assert twin.rt.preemption == w.preemption  # one config, one preemption policy (the engine's step shape)
    log: list = []
    _watch_claims(sim_prefill, w, twin, log, monkeypatch)
    _watch_room(w, twin, log)
    real_finish = w._finish

    def finish(h, now):
        rid = _rid(h.req)
        # PrefillHandler: the prompt's busy time into the meter, and the request is done here.
        twin.rt.meter.record(twin.claimed_ms[rid], int(now * 1000), h.req.prompt_tokens)
        twin.release(rid)
        real_finish(h, now)
        assert twin.rt.tokens_per_s() == measured_rate(w), (list(twin.rt.meter._samples), list(w.meter._samples))
        log.append(("rate", measured_rate(w)))

    w._finish = finish
    # A peer computing nothing, then 0.3 s of prompts (as its heartbeats say): the twin waits for it, less, or not.
    _peer_of(sim, "prefill", [(0.0, 0), (2.5, 300)])
    reqs = [
        # Each claim after the first waits out the claim defer (0.25 s: the prompts computing take longer).
        _request(0, "batch", 0.000, 1200), _request(1, "batch", 0.001, 800), _request(2, "standard", 0.002, 300),
        _request(3, "interactive", 0.6, 200),  # the worker is full by then (2,300 tokens): preempts, shields
        _request(4, "standard", 0.601, 100),  # shielded: waits while the interactive prompt computes
        _request(5, "interactive", 3.0, 120), _request(6, "batch", 3.001, 1900), _request(7, "standard", 3.002, 150),
        _request(8, "interactive", 3.003, 400), _request(9, "interactive", 3.004, 300),
        _request(10, "batch", 3.005, 50),
        _request(11, "standard", 3.006, 1000), _request(12, "interactive", 3.007, 600, ttft_ms=700),
        _request(13, "standard", 3.3, 900), _request(14, "batch", 3.301, 700), _request(15, "interactive", 3.302, 500),
    ]
    sim.run(reqs, 120.0)
    assert all(r.outcome == "ok" for r in reqs)
    assert [v for k, v in log if k == "victims" and len(v) > 1], "no preemption of two prompts at once"
    assert ("claim", None) in log  # a shield held a claim back ...
    assert sim.counters["preempted"] >= 3
    assert ("room", False) in log and ("room", True) in log
    assert len({v for k, v in log if k == "rate"}) > 2  # measured rates, not only the prior
    defers = {v for k, v in log if k == "defer"}
    assert 0.0 in defers and cfg.worker.claim_defer_max_s in defers, defers  # a stricter tier at once; capped
    assert any(0 < d < cfg.worker.claim_defer_max_s for d in defers), defers  # the engine's time for its prompts
    assert any(k == "no_freer_peer" for k, _v in log)  # the peer busier: claimed at once


# -- the decode worker: room (budget, KV, pace), local prompts' preemption, step shape -----------------------


def _decode_scenario(monkeypatch, steps: bool):
    # (tpot_headroom 1.2: paced out now and then, with room between for claims that weigh a peer)
    cfg = _config("decode", max_running=8, prefill_token_budget=700, tpot_headroom=1.2)
    cfg = replace(cfg, engine=replace(cfg.engine, max_num_batched_tokens=256))
    sim = Simulation(cfg, FleetSpec("disagg", 1, 1), HandModel("p", 2_000.0, max_step_tokens=256),
                     _SmallKv("d", 1_000.0, max_step_tokens=256, step_s=0.04, s_per_context_token=2e-6))
    w = sim.decode_workers[0]
    twin = _live(cfg, sim, sim.decode_q, monkeypatch, kv_usage=lambda: (w.C + w.reserved) / w.kv_capacity)
    assert twin.rt.preemption == w.preemption
    twin.rt.pace = w.pace  # the streams' pace samples: the live meter reads what the simulated one was fed
    monkeypatch.setattr(sim_decode, "PACE_READ_S", 0.0)  # the simulated verdict is re-read at every event
    log: list = []
    _watch_claims(sim_decode, w, twin, log, monkeypatch)
    _watch_room(w, twin, log)
    real_join, real_done = w._join, sim.on_done

    def join(req, produced=0):
        if produced:  # a prompt computed here has its first token (DecodeHandler._prefilled_here)
            rid = _rid(req)
            twin.rt.meter.record(twin.claimed_ms[rid], int(sim.loop.now * 1000), req.prompt_tokens)
            twin.held[rid].first_token()
        real_join(req, produced)

    def on_done(req):
        if _rid(req) in twin.held:  # (requests of the prefill pool's own decode worker only)
            twin.release(_rid(req))
        real_done(req)

    w._join, sim.on_done = join, on_done
    if steps:
        _watch_steps(w, log, monkeypatch)
    _peer_of(sim, "decode", [(0.0, 0), (1.5, 300), (19.0, 0)])  # computing nothing, then 0.3 s, then nothing
    rag, chat = dict(ttft_ms=5_000, tpot_ms=300), dict(ttft_ms=900, tpot_ms=120)
    reqs = [
        _request(0, "standard", 0.0, 600, out=30, **rag), _request(1, "interactive", 0.05, 400, out=40, **chat),
        _request(2, "interactive", 0.9, 450, out=60, **chat), _request(3, "standard", 0.07, 1_500, out=20, **rag),
        _request(4, "batch", 0.08, 1_800, out=10), _request(5, "interactive", 0.3, 200, out=50, **chat),
        _request(6, "standard", 0.35, 300, out=80, **rag), _request(7, "interactive", 0.4, 60, out=30, **chat),
        _request(8, "batch", 1.0, 500, out=5), _request(9, "interactive", 1.1, 100, out=20, **chat),
        _request(10, "standard", 1.2, 1_500, out=10, **rag), _request(11, "interactive", 1.25, 80, out=10, **chat),
        _request(12, "standard", 1.3, 400, out=100, **rag), _request(13, "interactive", 1.35, 150, out=20, **chat),
        _request(14, "batch", 2.0, 650, out=40), _request(15, "interactive", 2.05, 300, out=20, **chat),
        _request(16, "interactive", 2.06, 350, out=20, **chat), _request(17, "standard", 2.5, 2_000, out=30, **rag),
        # The fleet idle again: a batch prompt computing, two chats (the second finds the worker full: the
        # batch prompt is preempted and the chats' tier shielded), then a standard request the shield holds back.
        _request(18, "batch", 20.0, 650, out=5), _request(19, "interactive", 20.01, 100, out=5, **chat),
        _request(20, "interactive", 20.02, 300, out=5, **chat), _request(21, "standard", 20.03, 50, out=5, **rag),
        # A chat computing while a looser prompt waits in the engine, not started: nothing is held back.
        _request(22, "interactive", 40.0, 500, out=5, **chat), _request(23, "batch", 40.01, 150, out=5),
        # Many chats whose KV is on its way at once (every prompt prefilled remotely from 59 s; transfers take
        # 50 ms): the worker fills up with them.
        *(_request(24 + i, "interactive", 60.0 + 0.002 * i, 100, out=40, **chat) for i in range(12)),
    ]
    sim.disagg = replace(sim.disagg, min_remote_prefill_tokens=1_000)  # shorter prompts: computed by the decode worker
    sim.loop.at(59.0, lambda _: setattr(sim, "disagg", replace(sim.disagg, min_remote_prefill_tokens=0)))
    sim.run(reqs, 300.0)
    assert all(r.outcome == "ok" for r in reqs)
    return log, sim


def _watch_steps(w, log: list, monkeypatch) -> None:
    """Every step the simulated decode engine shapes is shaped by the live vLLM scheduler hook too: the same
    prompts (started ones running, the others waiting) and decodes, on the same clock; the decode-only steps
    the simulator runs in closed form in between are shown to the hook as one step with decodes only."""
    from skyline.workers.engines import vllm_scheduler
    monkeypatch.setattr(vllm_scheduler, "time", SimpleNamespace(monotonic=lambda: w.sim.loop.now))
    hook, last = _live_hook(vllm_scheduler, w), {"k": None}
    real = sim_decode.shape_step

    def req_of(name, priority, prompt, computed):
        return SimpleNamespace(name=name, priority=priority, num_prompt_tokens=prompt, num_computed_tokens=computed,
                               status=None, sampling_params=None)  # None: a request with targets

    def shape_step(shaper, order, decoding, sim):
        decodes = [req_of(f"d{i}", 0, 1, 2) for i in range(decoding)]
        if last["k"] is not None and w.k > last["k"] + 1 and decoding:
            hook.running, hook.waiting = list(decodes), []
            hook.schedule()  # closed-form decode-only steps ran since the last mixed one
        last["k"] = w.k
        started = [h for h in order if h.done > h.req.cached_tokens]
        hook.running = [req_of(_rid(h.req), h.req.priority, h.req.prompt_tokens, h.done) for h in started] + decodes
        hook.waiting = [req_of(_rid(h.req), h.req.priority, h.req.prompt_tokens, 0) for h in order if h not in started]
        hook.schedule()
        running, tokens, cap = hook.seen
        kept, shape = real(shaper, order, decoding, sim)
        assert (shape.tokens, shape.prefill_cap) == (tokens, cap), "step shapes differ"
        held_live = {_rid(h.req) for h in started} - set(running)
        held_sim = {_rid(h.req) for h in started if h not in kept}
        assert held_sim == held_live and shaper.held == hook._shaper.held, "held prompts differ"
        log.append(("step", tokens, cap, tuple(sorted(held_live)), hook._shaper.held))
        return kept, shape

    monkeypatch.setattr(sim_decode, "shape_step", shape_step)


def _live_hook(vllm_scheduler, w):
    """The live vLLM scheduler hook, configured as the simulated decode engine `w`, in front of a stand-in
    for vLLM's schedule() that records what it was handed: the running requests, the budget and the cap."""

    class StandIn:
        def schedule(self):
            self.seen = ([r.name for r in self.running], self.max_num_scheduled_tokens,
                         self.scheduler_config.long_prefill_token_threshold)

    class Hook(vllm_scheduler._StepShaping, StandIn):
        def __init__(self):
            sim = w.sim
            self.vllm_config = SimpleNamespace(additional_config={vllm_scheduler.CONFIG_KEY: {
                "background_tokens": sim.decode_background, "max_held_steps": sim.max_held_steps,
                "urgent_priority": sim.urgent_priority}})
            self.max_num_scheduled_tokens = w.perf.max_step_tokens
            self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=sim.decode_cap)
            self.lora_config = None  # no LoRA (vLLM's attribute: None unless --enable-lora)
            self._init_step_shaping()

    return Hook()


def test_a_prompt_the_prefill_engine_has_finished_is_no_preemption_victim():
    """The simulated prefill worker hands a finished prompt off at its step's end; the live one takes a
    Redis round trip to, and aborting the prompt then frees no step budget: it is no victim from the
    moment its engine finished it (nor does it keep a shield up)."""
    rt = WorkerRuntime(_config("prefill"), _Engine(), "m")
    now = live_runtime.now_ms()
    rag = messages.GenerateRequest(request_id="rag", model="m", prompt_token_ids=[1] * 1500,
                                   sampling=messages.SamplingSpec(max_tokens=4), tier="batch", arrival_ms=now,
                                   deadline_ms=now + 600_000, ttft_ms=0, tpot_ms=0)
    claimed = Claimed("stream", "0-1", "batch", rag)
    held = HeldRequest.of(claimed, rt.rules.first_phase(rag))
    rt.hold(held, _Task())
    # The chat is queued behind it (the worker full): computing, the RAG prompt is in its way.
    assert rt.victims_for("interactive", now + 50, 30, claimed=False) == ["rag"]
    held.prompt_computed()
    assert rt.victims_for("interactive", now + 50, 30, claimed=False) == [] and list(rt.computing_ranks()) == []


def test_the_decode_worker_decides_as_the_live_one(monkeypatch):
    log, sim = _decode_scenario(monkeypatch, steps=False)
    rooms = [v for k, v in log if k == "room"]
    assert True in rooms and False in rooms
    assert [v for k, v in log if k == "victims" and v], "no local prompt was preempted"
    assert ("claim", None) in log  # a shield held a claim back
    defers = {v for k, v in log if k == "defer"}
    assert 0.0 in defers and any(d > 0 for d in defers), defers  # waits before a claim, and none
    assert any(k == "no_freer_peer" for k, _v in log)  # the peer busier: claimed at once
    assert any(k == "paced_claim" for k, _v in log)  # paced out, a head that had to start now was claimed


def test_the_decode_engine_shapes_its_steps_as_the_live_scheduler_hook(monkeypatch):
    log, _sim = _decode_scenario(monkeypatch, steps=True)
    steps = [e for e in log if e[0] == "step"]
    assert any(e[3] for e in steps), "no step held a prompt back"
    assert any(e[4] > 1 for e in steps), "never two held steps in a row"


def test_a_decode_only_step_ends_a_run_of_held_steps_as_in_the_live_hook(monkeypatch):
    """The simulator computes decode-only steps in closed form, without the step hook; the live hook sees each
    of them, and a step that holds nothing back ends the run of held steps. The simulated engine, leaving its
    stepped mode with streams still decoding, does the same."""
    from skyline.workers.engines import vllm_scheduler
    cfg = _config("decode")
    sim = Simulation(cfg, FleetSpec("colocated", 0, 1), HandModel("p", 1_000.0),
                     HandModel("d", 1_000.0, max_step_tokens=256, step_s=0.02))
    w = sim.decode_workers[0]
    real = sim_decode.shape_step

    def shape_step(shaper, order, decoding, sim):
        kept, shape = real(shaper, order, decoding, sim)
        shaper.held = 3  # as if this step had held started prompts back, the third in a row
        return kept, shape

    monkeypatch.setattr(sim_decode, "shape_step", shape_step)
    ends = []
    real_reschedule = w._reschedule

    def reschedule():
        if not w.stepping and w.B:
            ends.append(w.shaper.held)  # stepped mode over, streams decoding on
        real_reschedule()

    w._reschedule = reschedule
    sim.run([_request(0, "standard", 0.0, 50, out=200), _request(1, "interactive", 0.5, 100, out=5)], 60.0)
    live = _live_hook(vllm_scheduler, w)
    live._shaper.held = 3
    live.running = [SimpleNamespace(name="d", priority=1, num_prompt_tokens=50, num_computed_tokens=60,
                                    sampling_params=None)]
    live.waiting = []
    live.schedule()  # a step with one stream decoding, nothing else
    assert ends and set(ends) == {live._shaper.held} == {0}


# -- the gateway: admission, demotion, the calibration hook --------------------------------------------------


@dataclass
class _Prep:
    """The fields of a prepared request that admission reads and returns."""

    request: messages.GenerateRequest
    slo: object
    route: str
    allow_demotion: bool = True
    admission: str = "admit"
    predicted_ttft_ms: float | None = None
    model_ttft_ms: float | None = None

    @property
    def prefill_tokens(self) -> int:  # nothing of it cached, as in the simulator
        return len(self.request.prompt_token_ids)


@pytest.mark.parametrize("demotion", [True, False])
def test_the_simulated_gateway_admits_demotes_and_learns_as_the_live_one(demotion):
    cfg = _config("decode", admission=True)
    cfg = replace(cfg, gateway=replace(cfg.gateway, first_token_overhead_ms=20.0, max_queued_tokens=30_000))
    sim = Simulation(cfg, FleetSpec("disagg", 1, 1), HandModel("p", 3_000.0, max_step_tokens=512),
                     HandModel("d", 3_000.0, max_step_tokens=512, step_s=0.01), allow_demotion=demotion)
    live_cal, preps = type(sim.calibration)(), {}
    metrics = SimpleNamespace(admission=SimpleNamespace(labels=lambda *a: SimpleNamespace(inc=lambda: None)))
    policy = sim.admission
    outcomes = Counter()
    real_arrive, real_done = sim.arrive, sim.on_done

    def arrive(req):
        now_ms = int(sim.loop.now * 1000)
        slo = replace(sim._slo(req), arrival_ms=now_ms)
        backlogs = {"prefill": dict(sim.prefill_q.backlog), "decode": dict(sim.decode_q.backlog)}
        path = route(sim.disagg, req.prompt_tokens, sim.seen_prefill_backlog,
                     lambda: prefill_is_faster(policy, cfg.tiers, slo.tier, req.prompt_tokens, req.prompt_tokens,
                                               backlogs, sim.seen_rate, live_cal))
        backlog = dict((sim.prefill_q if stage_of(path) == "prefill" else sim.decode_q).backlog)
        gen = messages.GenerateRequest(_rid(req), "m", [1] * req.prompt_tokens, messages.SamplingSpec(max_tokens=1),
                                       slo.tier, now_ms, slo.deadline_ms, slo.ttft_ms, slo.tpot_ms, slo.priority, path)
        try:
            handoff = handoff_wait_ms(policy, cfg.tiers, slo.tier, backlogs["decode"],
                                      sim.seen_rate["decode"]) if path == "disagg" else 0.0
            prep = apply_admission(cfg, policy, SimpleNamespace(workers=sim._view.workers),
                                   _Prep(gen, slo, path, allow_demotion=demotion), backlog, metrics, live_cal,
                                   handoff)
            live = ("demote" if prep.admission == "demote" else "admit", prep.request.tier, prep.request.priority,
                    prep.request.deadline_ms - now_ms, prep.request.tpot_ms, prep.model_ttft_ms)
            preps[_rid(req)] = prep
        except ApiError as exc:
            live = ({429: "rejected", 503: "error"}[exc.status],)
        real_arrive(req)
        if req.outcome in ("rejected", "error"):
            simulated = (req.outcome,)
        else:
            simulated = ("demote" if req.decision == "demote" else "admit", req.tier, req.priority,
                         round((req.deadline - sim.loop.now) * 1000), req.tpot_ms, req.model_ttft_ms)
        assert simulated == live, f"admission differs for {_rid(req)}: simulated {simulated}, live {live}"
        outcomes[live[0]] += 1

    def on_done(req):
        real_done(req)
        prep = preps.get(_rid(req))
        if prep is not None:
            learn(live_cal, SimpleNamespace(prep=prep, ttft_s=lambda: req.ttft_s), 200, object())
        for stage in ("prefill", "decode"):
            for tier in ("interactive", "standard", "batch"):
                assert live_cal.scale((stage, tier)) == sim.calibration.scale((stage, tier))

    sim.arrive, sim.on_done = arrive, on_done
    reqs = []
    for i in range(160):
        tier, prompt = [("interactive", 300), ("standard", 2_500), ("interactive", 80), ("batch", 1_200)][i % 4]
        reqs.append(_request(i, tier, i * 0.01, prompt, out=3, ttft_ms=150 if tier == "interactive" else math.inf))
    sim.run(reqs, 60.0)
    assert outcomes["admit"] and outcomes["demote" if demotion else "rejected"] and outcomes["error"], outcomes
    assert live_cal._scale and any(s < 1.0 for s in live_cal._scale.values())  # it learnt something


# -- the streams: the retry lane's tie; the decode worker: the KV handle's expiry ----------------------------


def test_the_retry_lane_and_its_tie_as_the_live_streams(monkeypatch):
    cfg = _config("prefill")
    sim = Simulation(cfg, FleetSpec("disagg", 1, 1), HandModel("p", 1_000.0), HandModel("d", 1_000.0))
    twin = _live(cfg, sim, sim.prefill_q, monkeypatch)
    q = sim.prefill_q
    cases = [(5.0, 5.0), (5.0002, 5.0007), (5.0007, 5.0002), (5.0, 5.001), (5.001, 5.0), (4.9996, 5.0004)]
    for i, (stream_deadline, retry_deadline) in enumerate(cases):
        a, b = _request(2 * i, "standard", 0, 10), _request(2 * i + 1, "standard", 0, 10)
        a.deadline, b.deadline = stream_deadline, retry_deadline
        q.push(a, (a, None))
        q.push_retry(b, (b, None))
        live, simulated = twin.pick(), q.head()[0]
        assert simulated is live, (stream_deadline, retry_deadline)
        q.claim()
        q.claim()


async def test_a_kv_handle_expires_as_the_live_decode_worker_sees_it(monkeypatch):
    cfg = _config("decode")
    lease = cfg.engine.kv_lease_s
    sim = Simulation(cfg, FleetSpec("disagg", 1, 1), HandModel("p", 1_000.0), HandModel("d", 1_000.0))
    twin = _live(cfg, sim, sim.decode_q, monkeypatch)
    handler = DecodeHandler(twin.rt.port)
    monkeypatch.setattr("skyline.workers.decode.now_ms", lambda: int(sim.loop.now * 1000))
    w = sim.decode_workers[0]
    sim.loop.now = 1_000.0
    seen = []
    for i, age_s in enumerate([0.0, 0.8 * lease - 0.001, 0.8 * lease, 0.8 * lease + 0.001, 2 * lease]):
        req = _request(i, "standard", 0.0, 10)
        req.deadline, req.tier, req.rank = sim.loop.now + 5, "standard", 1
        finished_ms = int((sim.loop.now - age_s) * 1000)
        work = messages.DecodeWork(_generate_request(req, 0, 0, 5_000), kv_handle={"kv": 1}, prefill_worker="",
                                   prefill_finished_ms=finished_ms)
        _ereq, handle, why = await handler._plan(work, RunClaim(attempt=1, done=False, frames=0, output=[]))
        arriving = w.arriving
        sim.decode_q.push(req, (req, finished_ms / 1000))
        w.claim_while_room(1)
        assert (w.arriving > arriving) == (handle is not None), age_s
        seen.append(why)
    assert seen == ["", "", "", "handle_expired", "handle_expired"]


# -- prefix affinity: the gateway's placement and the lane rule ----------------------------------------------


def test_placement_and_the_lane_rule_decide_as_the_live_gateway_and_streams(monkeypatch):
    """A multi-turn workload on three colocated workers with prefix caches: at every request the simulated
    gateway places, the live gateway (`gateway.affinity`: the cache view's replies parsed, `placement` with
    its own in-flight count) is asked in the same state; at every claim a simulated worker makes while
    work is placed, the live consumer's `TierQueues.heads_of` and `pick` (the lane rule, `may_claim`)."""
    from skyline.core import streams as live_streams
    from skyline.core.fleet import WorkerInfo
    from skyline.core.keys import Keys
    from skyline.gateway import affinity as live_affinity
    from skyline.scheduler import prefix
    from skyline.tools.bench.multiturn import MultiturnSpec
    from skyline.tools.bench.workload import WorkloadSpec
    from skyline.tools.simulate import fleet as sim_fleet
    from skyline.tools.simulate import queues as sim_queues
    from skyline.tools.simulate import sessions

    cfg = _config("decode", max_running=4)
    cfg = replace(cfg, gateway=replace(cfg.gateway, mode="colocated", affinity_max_wait_ms=400))
    model = HandModel("c", 2_000.0, max_step_tokens=512, step_s=0.02)
    model.block_size = 16
    sim = Simulation(cfg, FleetSpec("colocated", 0, 3), model, model, prefix_cache=True)
    clock = lambda: int(sim.loop.now * 1000)
    monkeypatch.setattr(live_affinity, "now_ms", clock)
    monkeypatch.setattr(live_streams, "now_ms", clock)
    keys = Keys("twin")
    live_placed = prefix.PlacedInFlight()
    log: list = []

    real_choose = sim_fleet.choose

    def choose(policy, match, stage, request_id, now_ms, deadline_ms, in_flight=None, stage_rate=None):
        req = next(r for r in pending if f"r{r.index}" == request_id)
        workers = [WorkerInfo(b.worker_id, b.role, "sim", "m", "h", 0, b.running, 0, b.kv_usage, 0.0, 0.0,
                              max_running=b.max_running, cache_block_size=16,
                              kv_watermark=b.kv_watermark) for b in match.workers]
        chain = req.chain[:req.prompt_blocks]
        look = live_affinity.LookUp(req.prompt_tokens, 16, chain, tuple(workers))
        # The cache view's ZMSCORE replies: a score for each block the worker's engine holds.
        replies = [[1 if h in sim.workers[w.worker_id].cache.blocks else None for h in chain] for w in workers]
        live_match = look.result(replies)
        gen = messages.GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1] * req.prompt_tokens,
                                       sampling=messages.SamplingSpec(max_tokens=req.max_tokens), tier=req.tier,
                                       arrival_ms=now_ms, deadline_ms=deadline_ms, ttft_ms=0, tpot_ms=0)
        live = live_affinity.placement(policy, live_match, stage, gen, live_placed, stage_rate)
        got = real_choose(policy, match, stage, request_id, now_ms, deadline_ms, in_flight, stage_rate)
        assert (got and (got.worker, got.until_ms, got.matched_blocks)) == \
            (live and (live.worker, live.until_ms, live.matched_blocks)), f"placements differ for {request_id}"
        assert dict(match.matched) == {w: n for w, n in live_match.matched.items() if n}  # (0: not listed)
        for w in [None] + [b.worker_id for b in match.workers]:
            assert match.uncached_tokens(w) == live_match.uncached_tokens(w)
        assert match.best_uncached(stage) == live_match.best_uncached(stage)
        log.append(("placed", got.worker if got else None))
        return got

    real_on_done = sim.on_done

    def on_done(req):  # the live gateway's session closes: its placement no longer loads the worker
        real_on_done(req)
        live_placed.done(f"r{req.index}")
        assert live_placed.count == sim.placed.count

    sim.on_done = on_done
    monkeypatch.setattr(sim_fleet, "choose", choose)

    real_claim_as = sim_queues.StageQueues.claim_as

    def claim_as(q, me, now_ms, max_rank=None, rate=0.0, skip=None):
        assert skip is None  # colocated workers leave no head to their peers (only elastic ones do)
        tq = live_streams.TierQueues(None, keys, q.stage, cfg.tiers, me)
        tq.live = set(sim.workers)
        entries, owner = [], {}
        lanes = [(t, key, lane) for t in q.tier_order
                 for key, lane in ((keys.stream(q.stage, t), q.queues[t]), (keys.retry_stream(q.stage, t), q.retry[t]))]
        for w, by_tier in q.placed.items():
            for t, lane in by_tier.items():
                key = keys.affinity_lane(q.stage, t, w)
                tq.holder_of[key], tq.tier_of[key] = w, t
                lanes.append((t, key, lane))
        for _t, key, lane in lanes:
            if lane:
                head = lane[0][0]
                fields = _fields(lane[0])
                if key in tq.holder_of:
                    fields[b"until_ms"] = head.until_ms
                entries.append((key, fields))
                owner[key] = head
        heads = tq.heads_of(entries)
        tier = tq.pick(heads, None, rate)
        live = owner[heads[tier].stream] if tier else None
        item = real_claim_as(q, me, now_ms, max_rank, rate, skip)
        got = item[0] if item else None
        assert got is live, (f"claims differ at {now_ms} ms for {me}: simulated {got and _rid(got)}, "
                             f"live {live and _rid(live)}")
        kind = None if got is None else "shared" if got.placed_for is None else "own" if got.placed_for == me else "other"
        log.append(("claim", kind))
        return item

    monkeypatch.setattr(sim_queues.StageQueues, "claim_as", claim_as)

    spec = WorkloadSpec(mix=0.8, chat_prompt=(30, 200), rag_prompt=(600, 900), chat_output=(8, 24),
                        rag_output=(8, 24))
    first = sessions.synthetic(spec, MultiturnSpec(turns=(3, 5), think_s=0.3, rag_docs=2, max_prompt_tokens=1200),
                               6.0, 60, lambda c: (1500, 1e9), 16)
    pending = [r for q in first for r in _turns(q)]
    reqs = list(first)
    sim.run(reqs, 60.0)
    assert len(reqs) > len(first) and all(r.outcome == "ok" for r in reqs)
    placed = [w for k, w in log if k == "placed"]
    assert len({w for w in placed if w}) == 3 and None in placed, "placements on every worker, and the shared queue"
    claims = [k for kind, k in log if kind == "claim"]
    assert {"own", "shared", "other", None} <= set(claims), Counter(claims)  # incl. past a bound, and a deferral
    assert sum(r.cached_tokens for r in reqs) > 0


def _turns(req):
    while req is not None:
        yield req
        req = req.next_turn
