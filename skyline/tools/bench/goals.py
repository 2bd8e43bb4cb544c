"""The benchmark issue's goals, computed from one run's results (pure: no I/O).

Every goal is a ratio between systems measured in the same run, never an
absolute figure: the machines are shared and noisy, ratios travel better.
The baseline is the run's first system (plain vLLM, FCFS); "vLLM" is every
system whose name starts with `vllm-`; the others are the contenders.

- goodput: contender goodput / the better vLLM goodput (goal >= 1.5x);
- interactive p99 TTFT at the baseline's goodput rate (the highest swept
  rate at or below it): contender / baseline (goal <= 0.5x);
- output tok/s at saturation (the best rate of each system): contender /
  baseline (goal >= 0.9x);
- the SLO issue's goal, at the first swept rate where the baseline's
  attainment drops below 90%: the contender's interactive attainment
  (goal >= 95%) and output tok/s against the baseline's there (>= 0.9x).

The multi-LoRA workload (`--workload lora`) has its own goals instead (issue 34), at every rate, for
each adapter-aware system: the fewest adapter loads and the highest SLO attainment of the run's
systems, at no less than 0.95x plain vLLM's output tok/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyline.core.stats import percentile
from skyline.tools.bench.metrics import SLO_GOAL, format_goodput


@dataclass(frozen=True)
class Goal:
    name: str
    system: str
    value: float | None  # the ratio (or share); None when the run cannot tell
    target: str  # e.g. ">= 1.5x"
    met: bool | None  # None: not measurable in this run
    detail: str  # how it was computed, with the figures behind it


def _rate_summary(results: dict, system: str, rate: float) -> dict | None:
    for run in results["runs"]:
        if run["system"] == system and run["rate"] == rate:
            return run["summary"]
    return None


def _rates(results: dict, system: str) -> list[float]:
    return sorted(run["rate"] for run in results["runs"] if run["system"] == system)


def tier_ttft_p99_ms(results: dict, system: str, rate: float, tier: str) -> float | None:
    """p99 TTFT (ms) of the completed requests of one tier at one rate."""
    values = [r["ttft_s"] * 1000 for r in results["records"]
              if r["system"] == system and r["rate"] == rate and r["tier"] == tier and r["outcome"] == "ok"]
    return percentile(values, 99) if values else None


def _goodput_ratio(results: dict, system: str, vllm: list[str]) -> Goal:
    target = ">= 1.5x"
    mine = results["goodput"].get(system, {})
    theirs = [(results["goodput"].get(v, {}), v) for v in vllm]
    best, best_name = max(theirs, key=lambda g: g[0].get("rps") or 0.0, default=({}, ""))
    if mine.get("rps") is None or not best.get("rps"):
        detail = (f"{system} {format_goodput(mine) if mine else 'no data'} req/s, "
                  f"{best_name or 'vLLM'} {format_goodput(best) if best else 'no data'} req/s")
        return Goal("goodput vs the better vLLM", system, None, target, None, detail)
    ratio = mine["rps"] / best["rps"]
    # A goodput that met the goal at every swept rate is a lower bound ("at_least").
    if mine["bound"] == "at_least" and best["bound"] == "at_least":
        return Goal("goodput vs the better vLLM", system, None, target, None,
                    f"both met the goal at every rate (>= {mine['rps']:.2f} and >= {best['rps']:.2f} req/s): sweep higher")
    ratio = round(ratio, 9)  # 0.65 / 0.4333 is 1.5 up to float error
    lower_bound = mine["bound"] == "at_least"
    upper_bound = best["bound"] == "at_least"
    # A bound decides the goal only on its own side of the target.
    if lower_bound:
        met = True if ratio >= 1.5 else None
    elif upper_bound:
        met = False if ratio < 1.5 else None
    else:
        met = ratio >= 1.5
    detail = (f"{system} {'>= ' if lower_bound else ''}{mine['rps']:.2f} req/s vs {best_name} "
              f"{'>= ' if upper_bound else ''}{best['rps']:.2f} req/s")
    return Goal("goodput vs the better vLLM", system, ratio, target, met, detail)


def _interactive_ttft_ratio(results: dict, system: str, baseline: str, tier: str) -> Goal:
    name, target = f"{tier} p99 TTFT at the baseline's goodput rate", "<= 0.5x"
    g = results["goodput"].get(baseline, {})
    rates = [r for r in _rates(results, baseline) if g.get("rps") is not None and r <= g["rps"] + 1e-9]
    if not rates:
        return Goal(name, system, None, target, None, f"{baseline} met the goal at no swept rate")
    rate = rates[-1]
    mine, theirs = tier_ttft_p99_ms(results, system, rate, tier), tier_ttft_p99_ms(results, baseline, rate, tier)
    if mine is None or not theirs:
        return Goal(name, system, None, target, None, f"no completed {tier} requests at {rate:g} req/s")
    ratio = mine / theirs
    return Goal(name, system, ratio, target, ratio <= 0.5,
                f"at {rate:g} req/s: {mine:.0f} ms vs {baseline} {theirs:.0f} ms")


def _best_output(results: dict, system: str) -> tuple[float, float] | None:
    """(output tok/s, rate) at the system's best rate."""
    points = [(run["summary"]["output_throughput"], run["rate"]) for run in results["runs"] if run["system"] == system]
    return max(points) if points else None


def _saturation_ratio(results: dict, system: str, baseline: str) -> Goal:
    name, target = "output tok/s at saturation", ">= 0.9x"
    mine, theirs = _best_output(results, system), _best_output(results, baseline)
    if not mine or not theirs or not theirs[0]:
        return Goal(name, system, None, target, None, "no throughput measured")
    ratio = mine[0] / theirs[0]
    return Goal(name, system, ratio, target, ratio >= 0.9,
                f"best {mine[0]:.1f} tok/s (at {mine[1]:g} req/s) vs {baseline} {theirs[0]:.1f} (at {theirs[1]:g})")


def _knee_goals(results: dict, system: str, baseline: str, tier: str) -> list[Goal]:
    """The SLO issue's goals at the first rate where the baseline drops below the attainment goal."""
    knee = next((r for r in _rates(results, baseline)
                 if _rate_summary(results, baseline, r)["attainment"] < SLO_GOAL), None)
    names = (f"{tier} attainment where {baseline} < {SLO_GOAL:.0%}", f"output tok/s where {baseline} < {SLO_GOAL:.0%}")
    if knee is None:
        why = f"{baseline} stayed >= {SLO_GOAL:.0%} at every rate: sweep higher"
        return [Goal(names[0], system, None, ">= 95%", None, why), Goal(names[1], system, None, ">= 0.9x", None, why)]
    mine, theirs = _rate_summary(results, system, knee), _rate_summary(results, baseline, knee)
    if mine is None:
        why = f"{system} did not run {knee:g} req/s"
        return [Goal(names[0], system, None, ">= 95%", None, why), Goal(names[1], system, None, ">= 0.9x", None, why)]
    share = mine["by_tier"].get(tier, {}).get("attainment")
    base_share = theirs["by_tier"].get(tier, {}).get("attainment")
    out = [Goal(names[0], system, share, ">= 95%", None if share is None else share >= 0.95,
                f"at {knee:g} req/s: {share:.0%} vs {baseline} {base_share:.0%}" if share is not None
                else f"no {tier} requests at {knee:g} req/s")]
    ratio = mine["output_throughput"] / theirs["output_throughput"] if theirs["output_throughput"] else None
    out.append(Goal(names[1], system, ratio, ">= 0.9x", None if ratio is None else ratio >= 0.9,
                    f"at {knee:g} req/s: {mine['output_throughput']:.1f} vs {theirs['output_throughput']:.1f} tok/s"))
    return out


def _lora_goals(results: dict, system: str, others: list[str], vllm: list[str]) -> list[Goal]:
    """The multi-LoRA goals of an adapter-aware system at each rate (the module docstring)."""
    out = []
    for rate in _rates(results, system):
        mine = _rate_summary(results, system, rate)
        theirs = {o: s for o in others if (s := _rate_summary(results, o, rate)) is not None}
        at = f"at {rate:g} req/s"
        loads = {o: s.get("adapters", {}).get("loads") for o, s in theirs.items()}
        mine_loads = mine.get("adapters", {}).get("loads")
        if mine_loads is None or not loads or None in loads.values():
            out.append(Goal(f"fewest adapter loads {at}", system, None, "fewest", None, "loads not counted"))
        else:
            least = min(loads.values())
            out.append(Goal(f"fewest adapter loads {at}", system, mine_loads / least if least else None, "fewest",
                            mine_loads <= least, f"{mine_loads} vs " + ", ".join(f"{o} {n}" for o, n in loads.items())))
        best = max((s["attainment"] for s in theirs.values()), default=None)
        out.append(Goal(f"highest SLO attainment {at}", system, mine["attainment"], ">= the others' %",
                        None if best is None else mine["attainment"] >= best,
                        ", ".join(f"{o} {s['attainment']:.0%}" for o, s in theirs.items()) or "no other system"))
        plain = next((_rate_summary(results, v, rate) for v in vllm if _rate_summary(results, v, rate)), None)
        ratio = mine["output_throughput"] / plain["output_throughput"] if plain and plain["output_throughput"] else None
        out.append(Goal(f"output tok/s vs plain vLLM {at}", system, ratio, ">= 0.95x",
                        None if ratio is None else ratio >= 0.95,
                        f"{mine['output_throughput']:.1f} vs {plain['output_throughput']:.1f} tok/s" if plain
                        else "no plain vLLM in the run"))
    return out


def goals(results: dict) -> list[Goal]:
    """Every goal for every contender (non-vLLM system) of the run."""
    systems = [s for s in results["config"]["systems"] if any(run["system"] == s for run in results["runs"])]
    if not systems:
        return []
    baseline = systems[0]
    vllm = [s for s in systems if s.startswith("vllm-")] or [baseline]
    if results["config"]["workload"].get("kind") == "lora":
        return [g for s in systems if s.endswith("-lora-aware")
                for g in _lora_goals(results, s, [o for o in systems if o != s],
                                     [v for v in systems if v.startswith("vllm-")])]
    tier = results["config"]["workload"]["chat_tier"]
    out: list[Goal] = []
    for system in systems:
        if system in vllm or system == baseline:
            continue
        out.append(_goodput_ratio(results, system, vllm))
        out.append(_interactive_ttft_ratio(results, system, baseline, tier))
        out.append(_saturation_ratio(results, system, baseline))
        out.extend(_knee_goals(results, system, baseline, tier))
    return out
