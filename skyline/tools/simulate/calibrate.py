"""Per-phase timings of a measured `skyline bench` run, against an engine profile.

    python -m skyline.tools.simulate.calibrate benchmarks/2026-11-30-quick/results.json \
        --system skyline-disagg --profile skyline/tools/simulate/profiles/cpu-1core-nixl.json

Every completed Skyline request of a bench run carries its worker timings
(`skyline.timings`: queue_ms, prefill_ms, decode_queue_ms, first_token_ms,
decode_ms, e2e_ms; all from the gateway's arrival). From them, per request:

  prefill    disaggregated: the prefill worker's prefill_ms (claim -> handle);
             colocated: claim -> first token on the decode worker;
  hand-off   first_token_ms - queue_ms - prefill_ms - decode_queue_ms: decode
             claim -> first token (KV pull, scheduling, the step that samples);
  decode     (e2e_ms - first_token_ms) / (output tokens - 1): one decode step.

A phase is compared with the profile only when it ran alone (no other
request of the run was in the same phase at the same time), so the ratio
measures the engine under the run's conditions (the load generator, gateway
and Redis on the same cores, the neighbour engine), not queueing. The medians
per role are what `skyline simulate --slowdown prefill=X,decode=Y` takes, and
the median hand-off less one decode step at that slowdown is its
`--handoff-ms`. Figures fitted on a run describe that run's conditions:
`--rate` fits on one rate of the sweep so another can be predicted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from skyline.tools.simulate.perf_profile import ProfileModel
from skyline.tools.simulate.workload import measured_cache_hit


def prompt_s(model: ProfileModel, tokens: int, cached: int = 0) -> float:
    """The profile's time to compute a prompt's uncached tokens alone, in the engine's chunked steps."""
    total, done = 0.0, cached
    while done < tokens:
        n = min(model.max_step_tokens, tokens - done)
        total += model.prefill_step_s([(done, n)]) / model.slowdown
        done += n
    return total


def _solo(intervals: list[tuple[float, float]], i: int) -> bool:
    s, e = intervals[i]
    return all(j == i or e2 <= s or s2 >= e for j, (s2, e2) in enumerate(intervals))


def phases(results: dict, system: str, model: ProfileModel, rate: float | None = None) -> dict:
    """Per-request phase times of `system` (at `rate`, or every rate) and their medians against the profile."""
    rows = [r for r in results["records"] if r["system"] == system and r["outcome"] == "ok"
            and (r.get("skyline") or {}).get("timings") and (rate is None or r["rate"] == rate)]
    if not rows:
        raise ValueError(f"no completed requests with Skyline timings for {system!r}")
    out = []
    for r in rows:
        t, kv = r["skyline"]["timings"], r["skyline"].get("kv_transfer") or {}
        t0 = r["rate"] * 1e6 + r["send_at"] * 1000  # runs of different rates never overlap
        remote = bool(kv.get("remote_prefill"))
        start = t0 + t["queue_ms"]
        prefill_ms = t["prefill_ms"] if remote else t["first_token_ms"] - t["queue_ms"]
        handoff = t["first_token_ms"] - t["queue_ms"] - t["prefill_ms"] - t["decode_queue_ms"] if remote else None
        cached = measured_cache_hit(r)
        out.append({"rate": r["rate"], "send_at": r["send_at"], "prompt_tokens": r["prompt_tokens"],
                    "cached_tokens": cached, "output_tokens": r["output_tokens"], "remote": remote,
                    "prefill": (start, start + prefill_ms), "handoff_ms": handoff,
                    "decode": (t0 + t["first_token_ms"], t0 + t["e2e_ms"]),
                    "profile_prefill_ms": 1000 * prompt_s(model, r["prompt_tokens"], cached),
                    "decode_step_ms": (t["e2e_ms"] - t["first_token_ms"]) / max(1, r["output_tokens"] - 1)})
    pre, dec = [o["prefill"] for o in out], [o["decode"] for o in out]
    for i, o in enumerate(out):
        o["prefill_alone"], o["decode_alone"] = _solo(pre, i), _solo(dec, i)
        ctx = o["prompt_tokens"] + o["output_tokens"] // 2
        o["profile_step_ms"] = 1000 * model.decode_step_s(1, ctx) / model.decode_slowdown
    solo_prefill = [(o["prefill"][1] - o["prefill"][0]) / o["profile_prefill_ms"] for o in out if o["prefill_alone"]]
    solo_decode = [o["decode_step_ms"] / o["profile_step_ms"] for o in out if o["decode_alone"]]
    handoffs = [o["handoff_ms"] for o in out if o["handoff_ms"] is not None]
    med = lambda xs: round(statistics.median(xs), 3) if xs else None
    decode_ratio = med(solo_decode) or 1.0
    pulls = [o["handoff_ms"] - decode_ratio * o["profile_step_ms"] for o in out if o["handoff_ms"] is not None]
    return {
        "system": system, "requests": len(out),
        "prefill_ratio": {"median": med(solo_prefill), "n": len(solo_prefill),
                          "values": [round(x, 2) for x in solo_prefill]},
        "decode_ratio": {"median": med(solo_decode), "n": len(solo_decode),
                         "values": [round(x, 2) for x in solo_decode]},
        "slowdown": med(solo_prefill + solo_decode),
        "handoff_ms": {"median": med(handoffs), "n": len(handoffs), "values": sorted(handoffs)},
        "pull_ms": med(pulls),  # hand-off beyond one decode step at the decode slowdown: --handoff-ms
        "per_request": out,
    }


def prefill_step_factor(engine_steps: dict, model: ProfileModel) -> float:
    """A fleet's prefill steps against the profile's: each worker's mean prefill-only step (the
    `engine_steps` a Skyline system's results carry: steps, mean ms, mean prompt tokens) over the
    profile's time for a step of that many prompt tokens, averaged over the workers. What the host
    (gateway, Redis, load generator on the same cores) did to the engine's steps in that run, read
    from the engines themselves rather than fitted to the run's latencies: `--slowdown prefill=X`."""
    ratios = [s["prefill"]["mean_ms"] / 1000 / model.prefill_step_s([(0, round(s["prefill"]["prompt_tokens"]))])
              for s in engine_steps.values() if s.get("prefill", {}).get("steps")]
    if not ratios:
        raise ValueError("no prefill-only steps in these engine steps")
    return sum(ratios) / len(ratios)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a `skyline bench` results.json")
    ap.add_argument("--system", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--rate", type=float, help="only the requests of this rate (default: every rate)")
    args = ap.parse_args(argv)
    model = ProfileModel.load(args.profile, slowdown=1.0)
    p = phases(json.loads(Path(args.results).read_text()), args.system, model, args.rate)
    print(f"{p['system']}: {p['requests']} completed requests with timings; profile {args.profile}")
    steps = json.loads(Path(args.results).read_text())["systems"].get(args.system, {}).get("engine_steps")
    if steps:
        print(f"prefill-only engine steps measured / profile: {prefill_step_factor(steps, model):.2f}")
    print("rate  send_s  prompt  cached  prefill ms (profile)  alone  hand-off ms  decode step ms (profile)  alone")
    for o in p["per_request"]:
        pre = o["prefill"][1] - o["prefill"][0]
        ho = f"{o['handoff_ms']:11.0f}" if o["handoff_ms"] is not None else f"{'-':>11}"
        print(f"{o['rate']:4g} {o['send_at']:7.2f} {o['prompt_tokens']:7d} {o['cached_tokens']:7d} {pre:8.0f} "
              f"({o['profile_prefill_ms']:6.0f})  {'yes' if o['prefill_alone'] else 'no ':>5} {ho} "
              f"{o['decode_step_ms']:10.1f} ({o['profile_step_ms']:5.1f})        {'yes' if o['decode_alone'] else 'no'}")
    print(f"measured / profile, phases that ran alone: prefill {p['prefill_ratio']['median']} "
          f"(n={p['prefill_ratio']['n']}), decode step {p['decode_ratio']['median']} (n={p['decode_ratio']['n']}); "
          f"both {p['slowdown']}")
    print(f"hand-off (decode claim -> first token), median {p['handoff_ms']['median']} ms over "
          f"{p['handoff_ms']['n']}: {p['handoff_ms']['values']}")
    args_sd = f"prefill={p['prefill_ratio']['median']},decode={p['decode_ratio']['median']}"
    if p["pull_ms"] is not None:
        print(f"replay under these conditions: --slowdown {args_sd} --handoff-ms {p['pull_ms']:.0f}")
    else:
        print(f"replay under these conditions: --slowdown {p['slowdown']}")


if __name__ == "__main__":
    main()
