"""`skyline simulate`: sweep rates over simulated fleets and report like `skyline bench run`.

Order of events, as in the benchmark: SLO targets first (explicit, from a
measured results.json, from the trace's records, or derived from an
unloaded probe of the first system: each class's requests alone, x
--slo-scale), then every system at every rate, each run on a fresh fleet.
results.json, report.md and the plots come from `skyline.tools.bench.report` and
`skyline.tools.bench.plots`, so `--overlay` can put measured runs in the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

from skyline.core.stats import percentile
from skyline.tools.bench import metrics, report
from skyline.tools.bench.options import FULL, QUICK, parse_per_class, parse_range
from skyline.tools.bench.slo import SloTargets, explicit_targets
from skyline.tools.bench.workload import CLASSES, WorkloadSpec, requests_for
from skyline.tools.bench.multiturn import MultiturnSpec
from skyline.tools.simulate import native, sessions
from skyline.tools.simulate import summary as fast_summary
from skyline.tools.simulate import systems as sysmod
from skyline.tools.simulate.fleet import Simulation
from skyline.tools.simulate.workload import load_trace, probe, synthetic

MAX_JSON_RECORDS = 20_000  # results.json keeps every record up to this many per run, else an even sample;
# summaries always use all
ITL_RECORD_LIMIT = 20_000  # per-token gaps are reconstructed for runs up to this many requests


@contextlib.contextmanager
def no_cyclic_gc():
    """Python's cycle collector off while a run is generated, simulated and summarised.

    A simulated hour holds millions of request objects; every full collection
    walks all of them and finds nothing (requests, events and batch members
    form no reference cycles).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _preset(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else FULL
    return {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in base.items()}


def workload_spec(args: argparse.Namespace, p: dict) -> WorkloadSpec:
    return WorkloadSpec(mix=args.mix, chat_prompt=parse_range(p["chat_prompt"]), rag_prompt=parse_range(p["rag_prompt"]),
                        chat_output=parse_range(p["chat_output"]), rag_output=parse_range(p["rag_output"]),
                        chat_tier=args.chat_tier, rag_tier=args.rag_tier, arrival=args.arrival,
                        burstiness=args.burstiness, seed=args.seed)


def simulate_one(cfg, system: sysmod.SimSystem, reqs, drain_s: float, allow_demotion: bool = False) -> tuple[dict, Simulation, float]:
    """Run one rate on a fresh fleet; returns (bench summary, the simulation, wall seconds). Later turns
    of sessions sent during the run are appended to `reqs`."""
    if not system.affinity:
        cfg = replace(cfg, gateway=replace(cfg.gateway, prefix_affinity=False))
    sim = Simulation(cfg, system.fleet, system.perf_prefill, system.perf_decode,
                     record_itl=len(reqs) <= ITL_RECORD_LIMIT, allow_demotion=allow_demotion,
                     neighbour_slowdown=system.neighbour_slowdown,
                     prefix_cache=bool(reqs) and reqs[0].chain is not None)  # requests with a prefix identity
    t0 = time.perf_counter()
    duration = sim.run(reqs, drain_s)
    wall = time.perf_counter() - t0
    if sim.caching:
        sessions.add_oracle(reqs, system.perf_decode.block_size)  # the report's "of oracle"
    summary = (fast_summary if len(reqs) > fast_summary.FAST_ABOVE else metrics).summarize(reqs, duration)
    summary["sim"] = {**sim.describe(), "wall_s": round(wall, 3), "events": sim.loop.fired,
                      "simulated_s": round(duration, 3)}
    return summary, sim, wall


def derive_targets(cfg, system, spec: WorkloadSpec, scale: float, lengths: str, per_class: int,
                   explicit_ttft: dict, explicit_tpot: dict) -> SloTargets:
    """The bench's derivation on a simulated fleet: each probe request alone, median per class x scale."""
    unloaded = {}
    for cls in CLASSES:
        ttfts, tpots = [], []
        for req in [r for r in probe(spec, per_class, lengths) if r.cls == cls]:
            req.send_at = 0.0
            simulate_one(cfg, system, [req], 600.0)
            if req.outcome == "ok":
                ttfts.append(req.ttft_s * 1000)
                tpots.append(req.tpot_s * 1000)
        unloaded[cls] = {"ttft_ms": percentile(ttfts, 50), "tpot_ms": percentile(tpots, 50)}
    ttft = {c: round(scale * u["ttft_ms"]) for c, u in unloaded.items()}
    tpot = {c: round(scale * u["tpot_ms"]) for c, u in unloaded.items()}
    ttft.update(explicit_ttft)
    tpot.update(explicit_tpot)
    return SloTargets(ttft, tpot, f"{scale:g}x the median simulated unloaded TTFT and TPOT of each class on "
                                  f"{system.name} (requests alone)", scale, unloaded)


def trace_profile(trace: str) -> str | None:
    """The engine profile a bench run recorded with its results (`skyline bench run --profile-engine`), if any."""
    try:
        results = json.loads(Path(trace).read_text())
    except (OSError, ValueError):  # JSON lines of requests: not a bench results.json
        return None
    info = results.get("engine_profile") if isinstance(results, dict) else None
    if not info or info.get("status") != "ok":
        return None
    path = Path(trace).parent / info["file"]
    return str(path) if path.exists() else None


def main(args: argparse.Namespace, argv: list[str]) -> None:
    command = " ".join(shlex.quote(a) for a in ["skyline", *argv])
    print(native.describe())
    if args.search and getattr(args, "workload", "mixed") == "multiturn":
        raise SystemExit("--search sizes fleets for the mixed workload; simulate a multi-turn plan with --rates")
    p = _preset(args)
    if args.trace and not args.profile and not args.gpu:
        args.profile = trace_profile(args.trace)
        if args.profile:
            print(f"engine model: {args.profile}, profiled with the trace's run (skyline bench run --profile-engine)")
    prefill, decode, colocated = sysmod.perf_models(args)
    cfg = sysmod.fleet_config(args)
    systems = sysmod.systems(args, prefill, decode, colocated)
    spec = workload_spec(args, p)
    drain = p["drain"]
    trace = meta = None
    block_size = systems[0].perf_decode.block_size  # the engines' KV block: the unit of prefix caches
    if args.trace:
        trace, meta = load_trace(args.trace, args.trace_system, args.trace_cache_hits, block_size)
        drain = args.drain if args.drain is not None else (meta.get("drain_s") or drain)
    ex_ttft, ex_tpot = parse_per_class(args.slo_ttft_ms), parse_per_class(args.slo_tpot_ms)
    if args.slo_from:
        slo = json.loads(Path(args.slo_from).read_text())["slo"]
        targets = SloTargets(slo["ttft_ms"], slo["tpot_ms"], f"taken from {args.slo_from}: {slo['source']}",
                             slo.get("scale"), slo.get("unloaded", {}))
    elif trace is not None and meta.get("slo"):
        slo = meta["slo"]
        targets = SloTargets(slo["ttft_ms"], slo["tpot_ms"], f"the trace's own ({meta['source']}): {slo['source']}",
                             slo.get("scale"), slo.get("unloaded", {}))
    elif all(c in ex_ttft and c in ex_tpot for c in CLASSES):
        targets = explicit_targets(ex_ttft, ex_tpot)
    else:
        targets = derive_targets(cfg, systems[0], spec, args.slo_scale, args.lengths, p["probe_requests"] * 5,
                                 ex_ttft, ex_tpot)
    out = Path(args.out or f"sim-results/{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    if args.search:
        from skyline.tools.simulate.search import main as search_main

        search_main(args, cfg, systems, spec, targets, p, drain, out, command)
        return

    if trace is not None:
        rates = sorted(trace)
        requests_of = lambda rate: [r.resent() for r in trace[rate]]
    elif getattr(args, "workload", "mixed") == "multiturn":
        rates = [float(r) for r in str(p["rates"]).split(",") if r.strip()]
        mt = MultiturnSpec(turns=parse_range(args.turns), think_s=args.think_s, rag_docs=args.rag_docs,
                           max_prompt_tokens=args.max_prompt_tokens)
        requests_of = lambda rate: sessions.synthetic(spec, mt, rate, requests_for(rate, p["duration"],
                                                                                   args.num_requests),
                                                      targets.for_class, block_size)
    else:
        rates = [float(r) for r in str(p["rates"]).split(",") if r.strip()]
        requests_of = lambda rate: synthetic(spec, rate, requests_for(rate, p["duration"], args.num_requests),
                                             targets.for_class, args.lengths)
    # The cycle collector is off to the end, report included: re-enabled, the report's allocations
    # would make it walk the millions of requests still held.
    with no_cyclic_gc():
        started = datetime.now(UTC).isoformat(timespec="seconds")
        runs, records, sim_info = [], [], {}
        t_all = time.perf_counter()
        for system in systems:
            for rate in rates:
                t0 = time.perf_counter()
                reqs = requests_of(rate)
                t1 = time.perf_counter()
                summary, sim, wall = simulate_one(cfg, system, reqs, drain, args.allow_demotion)
                t2 = time.perf_counter()
                runs.append({"system": system.name, "rate": rate, "summary": summary})
                keep = reqs if len(reqs) <= MAX_JSON_RECORDS else reqs[:: math.ceil(len(reqs) / MAX_JSON_RECORDS)]
                records.extend(dict(vars(r.to_record(system.name, rate))) for r in keep)  # asdict: a slow deep copy
                summary["sim"].update(generate_s=round(t1 - t0, 3), summarize_s=round(t2 - t1 - wall, 3))
                print(f"[{system.name}] {rate:g} req/s: {summary['ok']}/{summary['sent']} ok, {summary['rejected']} "
                      f"rejected, attainment {summary['attainment']:.0%}, TTFT p50 {summary['ttft_ms']['p50']:.0f} ms "
                      f"({sim.loop.fired} events in {wall:.2f} s; requests made in {t1 - t0:.2f} s, "
                      f"summarized in {t2 - t1 - wall:.2f} s)" + (_cache_line(summary) if sim.caching else ""),
                      flush=True)
            sim_info[system.name] = {"status": "ok", "fleet": system.fleet.label, "devices": system.devices,
                                     "neighbour_slowdown": system.neighbour_slowdown, "affinity": system.affinity,
                                     "prefill_model": system.perf_prefill.describe(),
                                     "decode_model": system.perf_decode.describe()}
        results = build_results(command, started, spec, rates, p, args, drain, targets, sim_info, runs, records,
                                time.perf_counter() - t_all, meta)
        if args.overlay:
            overlay(results, json.loads(Path(args.overlay).read_text()))
        t0 = time.perf_counter()
        files = write(results, out)
        print(files[1].read_text())
        print("files:\n" + "\n".join(f"  {f}" for f in files))
        print(f"written in {time.perf_counter() - t0:.2f} s; {time.perf_counter() - t_all:.2f} s in all", flush=True)
        if getattr(args, "exit_when_done", False):
            # Everything is written and closed. Freeing a big run's millions of request objects
            # one by one is slow and changes nothing: a command of its own exits now.
            sys.stderr.flush()
            os._exit(0)


def _cache_line(summary: dict) -> str:
    pc = summary.get("prefix_cache") or {}
    hit = pc.get("hit_rate")
    return "" if hit is None or hit != hit else f"; prefix-cache hit {hit:.0%}"  # (NaN: nothing said)


def build_results(command, started, spec, rates, p, args, drain, targets, sim_info, runs, records, wall_s, meta):
    goodput = {}
    for name in sim_info:
        points = [(r["rate"], r["summary"]["attainment"]) for r in runs if r["system"] == name]
        goodput[name] = metrics.goodput(points)
    return report_clean({
        "benchmark": "skyline simulate",
        "command": command,
        "started": started, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_start": "-", "loadavg_end": "-", "simulated": True},
        "config": {"systems": list(sim_info), "rates": rates, "duration_s": p["duration"],
                   "num_requests": args.num_requests, "drain_s": drain, "quick": args.quick,
                   "probe_requests": p["probe_requests"], "warmup": 0, "allow_demotion": args.allow_demotion,
                   "workload": _workload(spec, args), "lengths": args.lengths, "trace": meta},
        "definitions": report.DEFINITIONS,
        "slo": targets.to_dict(),
        "systems": sim_info, "goodput": goodput, "runs": runs, "probe": [], "records": records,
        "simulation": {"wall_s": round(wall_s, 2)},
    })


def _workload(spec: WorkloadSpec, args: argparse.Namespace) -> dict:
    """The workload as results.json describes it (the bench's keys: a multi-turn one says so)."""
    if getattr(args, "workload", "mixed") != "multiturn" or args.trace:
        return asdict(spec)
    mt = MultiturnSpec(turns=parse_range(args.turns), think_s=args.think_s, rag_docs=args.rag_docs,
                       max_prompt_tokens=args.max_prompt_tokens)
    return {**asdict(spec), "kind": "multiturn", "multiturn": asdict(mt)}


def report_clean(x):
    from skyline.tools.bench.run import _clean

    return _clean(x)


def overlay(results: dict, measured: dict) -> None:
    """Measured runs join the simulated ones (systems keep their names: sim-* vs the measured ones)."""
    for name, info in measured.get("systems", {}).items():
        if name in results["systems"]:
            continue
        results["systems"][name] = {**info, "measured": True}
        results["config"]["systems"].append(name)
        if name in measured.get("goodput", {}):
            results["goodput"][name] = measured["goodput"][name]
    results["runs"].extend(measured.get("runs", []))
    results["records"].extend(measured.get("records", []))
    results["overlay"] = {"source": measured.get("command"), "slo": measured.get("slo")}


def markdown_extra(results: dict) -> str:
    lines = ["", "## Simulation", ""]
    if results["config"].get("lengths") == "sharegpt":
        from skyline.tools.simulate.workload import SHAREGPT

        lines.append(f"Lengths: ShareGPT-like (lognormal: prompt median {SHAREGPT['prompt_median']}, output median "
                     f"{SHAREGPT['output_median']}, sigma {SHAREGPT['sigma']}), not the ranges of the workload line.")
        lines.append("")
    for name, info in results["systems"].items():
        if info.get("measured"):
            lines.append(f"- `{name}`: measured (overlaid from `{results['overlay']['source']}`).")
            continue
        lines.append(f"- `{name}`: {info['fleet']} ({info['devices']} devices); prefill model: "
                     f"{info['prefill_model']['name']}; decode model: {info['decode_model']['name']}.")
    lines += ["", "| system | rate | events | wall (s) | simulated (s) | admitted | 429 | preempted |",
              "|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        s = run["summary"].get("sim")
        if s:
            c = s["counters"]
            lines.append(f"| {run['system']} | {run['rate']:g} | {s['events']} | {s['wall_s']} | {s['simulated_s']} | "
                         f"{c['admitted']} | {c['rejected']} | {c['preempted']} |")
    lines.append("")
    return "\n".join(lines)


def write(results: dict, out: Path) -> list[Path]:
    files = report.write(results, out)
    md = files[1]
    text = md.read_text().replace("# skyline bench run", "# skyline simulate", 1)
    md.write_text(text + markdown_extra(results))
    return files
