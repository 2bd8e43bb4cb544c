"""Elastic workers in the simulator (skyline/tools/simulate/elastic_worker.py): every engine takes either
phase, placing each prompt's decode with scheduler/elastic.py's `decoder_for`, as the live fleet does.

The load shifts halfway from long prompts with short answers to short prompts with long answers, so
any fixed prefill:decode split is wrong for one half of it. Small fleets (2 and 4 engines, H100
roofline, Llama-3-8B), no admission control: every request is admitted and must be served.
"""

from __future__ import annotations

from collections import Counter

import pytest

from skyline.core.config import load_config
from skyline.tools.bench import metrics
from skyline.tools.bench.workload import WorkloadSpec
from skyline.tools.simulate.fleet import FleetSpec, Simulation, with_overrides
from skyline.tools.simulate.request import SimRequest
from skyline.tools.simulate.roofline import roofline
from skyline.tools.simulate.workload import synthetic

CFG = with_overrides(load_config(None), admission=False)
MODEL = roofline("H100", "llama-3-8b", tp=1)
PROMPT_HEAVY = WorkloadSpec(mix=0.5, chat_prompt=(200, 600), rag_prompt=(2000, 4000), chat_output=(8, 32),
                            rag_output=(8, 32))
DECODE_HEAVY = WorkloadSpec(mix=0.8, chat_prompt=(30, 300), rag_prompt=(400, 1000), chat_output=(200, 600),
                            rag_output=(200, 600))
# req/s of each half per engine: past what one engine of the wrong pool serves, within the whole fleet's.
RATES = (10.0, 5.0)
PROBE_S = 0.002  # how often the idle check looks (simulated seconds)


def _targets(cls: str) -> tuple[float, float]:
    return (300.0, 30.0) if cls == "chat" else (1200.0, 30.0)


def _shifting_load(engines: int) -> list[SimRequest]:
    """Prompt-heavy requests, then decode-heavy ones: chat (interactive) and RAG (standard) in both."""
    n = 200 * engines
    first = synthetic(PROMPT_HEAVY, RATES[0] * engines, n, _targets)
    second = synthetic(DECODE_HEAVY, RATES[1] * engines, n, _targets)
    start = first[-1].send_at
    for i, r in enumerate(second):
        r.send_at += start
        r.index = n + i
    return first + second


def _run(fleet: FleetSpec, probe=None) -> tuple[Simulation, list[SimRequest], dict]:
    reqs = _shifting_load(fleet.prefill + fleet.decode)
    sim = Simulation(CFG, fleet, MODEL, MODEL)
    if probe is not None:
        end = reqs[-1].send_at + 60.0
        for i in range(int(end / PROBE_S)):
            sim.loop.at(i * PROBE_S, probe, sim)
    return sim, reqs, metrics.summarize(reqs, sim.run(reqs, 60.0))


@pytest.mark.parametrize("engines", [2, 4])
def test_every_request_is_served_exactly_once_and_every_engine_takes_both_phases(engines):
    reqs = _shifting_load(engines)
    sim = Simulation(CFG, FleetSpec("elastic", 0, engines), MODEL, MODEL)
    served: Counter[int] = Counter()
    prompts: Counter[str] = Counter()  # prompts each engine computed
    done = sim.on_done

    def on_done(req: SimRequest) -> None:
        served[req.index] += 1
        done(req)

    sim.on_done = on_done  # type: ignore[method-assign]
    for w in sim.decode_workers:
        def computed(h, now, w=w, inner=w._prompt_done):
            prompts[w.name] += 1
            inner(h, now)
        w._prompt_done = computed  # type: ignore[method-assign]
    sim.run(reqs, 60.0)
    assert len(reqs) == 400 * engines and all(r.outcome == "ok" for r in reqs), Counter(r.outcome for r in reqs)
    assert served == Counter({r.index: 1 for r in reqs})
    assert all(r.output_tokens == r.max_tokens for r in reqs)
    # Both placements happened: decodes handed to a peer (its KV pulled there) and prompts served whole.
    handed = [r for r in reqs if r.prefilled_by]
    assert handed and sum(sim.counters.get(why, 0) for why in ("peer_decodes_fewer", "prompts_queued",
                                                                "long_prompts_here")) == len(handed)
    assert sim.counters["fewest_streams_here"] + sim.counters.get("no_peer_with_room", 0) > 0
    assert {r.route for r in reqs} == {"disagg", "colocated"}  # long prompts to the prefill stage, short ones not
    # Every engine computed prompts and decoded streams.
    assert set(prompts) == {w.name for w in sim.decode_workers}
    assert all(w.tokens_out > 0 for w in sim.decode_workers)
    # Nothing is left behind: queues empty, backlogs back to zero, no KV reserved.
    assert sim.prefill_q.size == sim.decode_q.size == 0
    assert not any(sim.prefill_q.backlog.values()) and not any(sim.decode_q.backlog.values())
    assert all(w.reserved == 0 and not w.local and w.B == 0 for w in sim.decode_workers)


def _idle_engine(w) -> bool:
    """Its engine computes nothing, decodes nothing and waits for no KV."""
    held = getattr(w, "held", None)
    if held is not None:  # a prefill worker
        return not held and not w.stepping
    return not w.busy() and not w.arriving and not w.joining and not w.local


def _may_take(sim: Simulation, w, q) -> bool:
    return q.due_for(w.name, int(sim.loop.now * 1000)) is not None


@pytest.mark.parametrize("engines", [2, 4])
def test_no_elastic_engine_idles_while_work_it_could_take_waits(engines):
    """Measured on the simulation's own state every 2 simulated ms: an engine that computes and decodes
    nothing while an entry it may claim (either stage; not a hand-off held for a peer) is queued. The
    fixed pools of the same size show the check sees such waits: their engines idle while the other
    stage's work queues. A worker waiting out its claim defer (scheduler/claiming.py `claim_defer_s`) is
    no exception: it claims as soon as its engine's prompts are done (live: `HeldTable.freed`)."""
    idle_s: Counter[str] = Counter()

    def probe(sim: Simulation) -> None:
        for w in sim.prefill_workers + sim.decode_workers:
            if _idle_engine(w) and (_may_take(sim, w, sim.prefill_q) or _may_take(sim, w, sim.decode_q)):
                idle_s[sim.fleet.mode] += PROBE_S

    sim, reqs, summary = _run(FleetSpec("elastic", 0, engines), probe)
    assert summary["ok"] == len(reqs)
    assert idle_s["elastic"] == 0, idle_s
    _run(FleetSpec("disagg", engines // 2, engines - engines // 2), probe)
    assert idle_s["disagg"] > 1.0, idle_s  # engine-seconds idle beside queued work of the other stage


@pytest.mark.parametrize("engines", [2, 4])
def test_elastic_attains_at_least_the_best_fixed_split_when_the_load_shifts(engines):
    fixed = {f"{p}P+{engines - p}D": _run(FleetSpec("disagg", p, engines - p))[2]["attainment"]
             for p in range(1, engines)}
    elastic = _run(FleetSpec("elastic", 0, engines))[2]["attainment"]
    assert elastic >= max(fixed.values()), (elastic, fixed)
    assert max(fixed.values()) < 0.9, fixed  # the case is one no fixed split of these engines serves
