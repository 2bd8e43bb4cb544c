"""Write a benchmark's results: results.json (every record + summaries) and report.md.

The JSON is the source of truth; the Markdown table and the plots
(`skyline.tools.bench.plots`) are views of it, so they can be regenerated from the
JSON alone (`python -m skyline.tools.bench.report results.json`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from skyline.tools.bench.goals import goals
from skyline.tools.bench.metrics import SLO_GOAL, format_goodput

DEFINITIONS = (
    "Metric definitions match `vllm bench serve`: TTFT = first streamed content chunk - send; "
    "TPOT = (latency - TTFT) / (output tokens - 1); ITL = gaps between content chunks; latency (E2E) = "
    "send to end of stream; output tokens from the server's usage. Percentiles over completed requests. "
    "A request attains its SLO when it completed, TTFT <= its class's TTFT target and TPOT <= its TPOT target "
    f"(DistServe); attainment = attained / sent, so 429s, errors and cancellations count as missed. "
    f"Goodput = highest rate with attainment >= {SLO_GOAL:.0%}, linearly interpolated between the sweep's rates. "
    "Prefix-cache hit = sum(cached prompt tokens) / sum(prompt tokens) over completed requests, as the server "
    "reports them (Skyline: skyline.kv_transfer.num_cached_tokens, not for prompts a prefill worker computed, "
    "so a disaggregated fleet's hit counts only prompts that skipped the prefill pool, its oracle all of them; "
    "vLLM: usage.prompt_tokens_details.cached_tokens); oracle = what one infinite prefix cache would have hit "
    "for the same requests, in whole blocks of the engine's block size (each request's longest prefix shared "
    "with an earlier request's prompt + answer, the prompt's last token always computed); of oracle = hit / oracle "
    "over the requests whose hits were reported."
)


def _f(x: float, digits: int = 0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _pct(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def markdown(results: dict) -> str:
    slo = results["slo"]
    lines = [
        "# skyline bench run",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']['cpus']} CPUs ({results['machine']['platform']}); "
        f"load average at start {results['machine']['loadavg_start']}, "
        f"at end {results['machine'].get('loadavg_end', '-')}. "
        "Every system ran alone, on the same cores, one after the other; the load generator shares the machine.",
        "",
        "## SLO targets",
        "",
        f"Source: {slo['source']}.",
        "",
        "| class | tier | TTFT target (ms) | TPOT target (ms) | unloaded TTFT p50 (ms) | unloaded TPOT p50 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    tiers = results["config"]["workload"]
    for cls in sorted(slo["ttft_ms"]):
        u = slo.get("unloaded", {}).get(cls, {})
        tier = tiers["chat_tier"] if cls == "chat" else tiers["rag_tier"]
        lines.append(f"| {cls} | {tier} | {_f(slo['ttft_ms'][cls])} | {_f(slo['tpot_ms'][cls])} | "
                     f"{_f(u.get('ttft_ms'))} | {_f(u.get('tpot_ms'))} |")
    tier_names = sorted({t for run in results["runs"] for t in run["summary"]["by_tier"]})
    unit = "sessions/s" if results["config"]["workload"].get("kind") == "multiturn" else "req/s"
    caches = any(_known(run["summary"].get("prefix_cache", {}).get(k)) for run in results["runs"]
                 for k in ("hit_rate", "oracle_hit_rate"))
    loads = any("adapters" in run["summary"] for run in results["runs"])  # the lora workload
    lines += [
        "",
        "## Results per system and rate",
        "",
        f"| system | rate ({unit}) | sent | ok | 429 | err | cancelled | SLO attain | "
        + " | ".join(f"{t} attain" for t in tier_names)
        + " | TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) | ITL p50/p99 (ms) | E2E p50/p99 (ms)"
        " | out tok/s | total tok/s | req/s |" + (" prefix-cache hit | oracle hit | of oracle |" if caches else "")
        + (" adapter loads | loads/min |" if loads else ""),
        "|---|---|---|---|---|---|---|---|" + "---|" * len(tier_names) + "---|---|---|---|---|---|---|"
        + ("---|---|---|" if caches else "") + ("---|---|" if loads else ""),
    ]
    for run in results["runs"]:
        s = run["summary"]
        t, p, i, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2e_ms"]
        tier_cells = " | ".join(_pct(s["by_tier"].get(tn, {}).get("attainment")) for tn in tier_names)
        pc = s.get("prefix_cache", {})
        cache_cells = (f" {_pct(pc.get('hit_rate'))} | {_pct(pc.get('oracle_hit_rate'))} | "
                       f"{_pct(pc.get('of_oracle'))} |") if caches else ""
        ad = s.get("adapters", {})
        load_cells = f" {ad.get('loads', '-')} | {_f(ad.get('loads_per_min'), 1)} |" if loads else ""
        lines.append(
            f"| {run['system']} | {run['rate']:g} | {s['sent']} | {s['ok']} | {s['rejected']} | {s['error']} | "
            f"{s['cancelled']} | {_pct(s['attainment'])} | {tier_cells} | "
            f"{_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | {_f(p['p50'])} / {_f(p['p90'])} / {_f(p['p99'])} | "
            f"{_f(i['p50'])} / {_f(i['p99'])} | {_f(e['p50'])} / {_f(e['p99'])} | {_f(s['output_throughput'], 1)} | "
            f"{_f(s['total_token_throughput'], 1)} | {_f(s['request_throughput'], 2)} |{cache_cells}{load_cells}"
        )
    lines += _oracle_lines(results)
    lines += _route_lines(results)
    lines += ["", f"## Goodput (highest rate with SLO attainment >= {SLO_GOAL:.0%})", "",
              f"| system | goodput ({unit}) | status |", "|---|---|---|"]
    for name, info in results["systems"].items():
        g = results["goodput"].get(name)
        cell = format_goodput(g) if g else "n/a"
        lines.append(f"| {name} | {cell} | {info['status']}{': ' + info['error'] if info.get('error') else ''} |")
    lines += _goal_lines(results)
    lines += ["", "## Definitions", "", DEFINITIONS, "", "Workload: " + _workload_line(results["config"]), "",
              "Files: `results.json` (every request record + these summaries), `attainment_vs_rate.png`, "
              "`ttft_cdf_by_tier.png`, `throughput_vs_rate.png`, `logs/` (each process's output).", ""]
    return "\n".join(lines)


def _known(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _oracle_lines(results: dict) -> list[str]:
    """Which block size each system's oracle counted in (the engine's: the sim's 16, vLLM's 128 on CPU)."""
    sizes = {run["system"]: run["summary"]["prefix_cache"]["block_size"] for run in results["runs"]
             if "block_size" in run["summary"].get("prefix_cache", {})}
    if not sizes:
        return []
    by_size: dict[int, list[str]] = {}
    for name, size in sizes.items():
        by_size.setdefault(size, []).append(name)
    shown = "; ".join(f"{size} tokens ({', '.join(names)})" for size, names in sorted(by_size.items()))
    return ["", f"Oracle: one infinite prefix cache over the same requests, in blocks of {shown}. "
                "Prefix-cache hit rates are in prompt tokens."]


def _route_lines(results: dict) -> list[str]:
    """The disaggregated fleets' share of completed requests that skipped the prefill pool: what prefix
    caching buys them (their hit-rate column counts only those, the prefill worker's cache is not reported)."""
    disagg = {run["system"] for run in results["runs"] if run["summary"].get("routes", {}).get("disagg")}
    cells = []
    for run in results["runs"]:
        rt = run["summary"].get("routes", {})
        if run["system"] in disagg and rt:
            later = rt["later_turns"]
            cells.append(f"{run['system']} at {run['rate']:g}: {_pct(_share(rt))} / {_pct(_share(later))}")
    if not cells:
        return []
    return ["", "Skipped the prefill pool (route colocated), of completed requests / of later turns: "
            + "; ".join(cells) + "."]


def _share(counts: dict) -> float:
    n = counts["colocated"] + counts["disagg"]
    return counts["colocated"] / n if n else float("nan")


def _goal_lines(results: dict) -> list[str]:
    rows = goals(results)
    if not rows:
        return []
    lines = ["", "## Goals (ratios within this run; baseline: the first system)", "",
             "| goal | system | measured | target | met | from |", "|---|---|---|---|---|---|"]
    for g in rows:
        shown = "-" if g.value is None else (_pct(g.value) if g.target.endswith("%") else f"{g.value:.3f}x")
        met = {True: "yes", False: "**no**", None: "can't tell"}[g.met]
        lines.append(f"| {g.name} | {g.system} | {shown} | {g.target} | {met} | {g.detail} |")
    return lines


def _workload_line(cfg: dict) -> str:
    w = cfg["workload"]
    arrival = w["arrival"] + (f" (burstiness {w['burstiness']:g})" if w["arrival"] == "gamma" else "")
    if w.get("kind") == "multiturn":
        return _multiturn_line(cfg, arrival)
    n = f"{cfg['num_requests']} requests" if cfg.get("num_requests") else f"{cfg['duration_s']:g} s"
    lora = w.get("lora") if w.get("kind") == "lora" else None
    adapters = (f" Each request names one of {lora['adapters']} LoRA adapters as its model (Zipf popularity, "
                f"s = {lora['zipf']:g}); adapter loads are opens of the adapters' weight files (real engines) or "
                "what the workers advertise (sim engines).") if lora else ""
    return (f"{w['mix']:.0%} chat ({w['chat_prompt'][0]}-{w['chat_prompt'][1]} prompt tokens, "
            f"{w['chat_output'][0]}-{w['chat_output'][1]} output, tier {w['chat_tier']}) / "
            f"{1 - w['mix']:.0%} RAG ({w['rag_prompt'][0]}-{w['rag_prompt'][1]} prompt tokens, "
            f"{w['rag_output'][0]}-{w['rag_output'][1]} output, tier {w['rag_tier']}); {arrival} arrivals, "
            f"seed {w['seed']}; {n} per rate, drain limit {cfg['drain_s']:g} s; rates {cfg['rates']} req/s.{adapters}")


def _multiturn_line(cfg: dict, arrival: str) -> str:
    w, m = cfg["workload"], cfg["workload"]["multiturn"]
    n = f"{cfg['num_requests']} sessions" if cfg.get("num_requests") else f"{cfg['duration_s']:g} s of sessions"
    return (f"multi-turn: one shared system prompt; {w['mix']:.0%} of sessions are conversations of "
            f"{m['turns'][0]}-{m['turns'][1]} turns (user messages {w['chat_prompt'][0]}-{w['chat_prompt'][1]} tokens, "
            f"answers {w['chat_output'][0]}-{w['chat_output'][1]} tokens, think time exponential, mean {m['think_s']:g} s, "
            f"no prompt over {m['max_prompt_tokens']} tokens, tier {w['chat_tier']}), {1 - w['mix']:.0%} RAG questions "
            f"over {m['rag_docs']} shared documents ({w['rag_prompt'][0]}-{w['rag_prompt'][1]} prompt tokens, "
            f"{w['rag_output'][0]}-{w['rag_output'][1]} output, tier {w['rag_tier']}); sessions start open-loop "
            f"({arrival}; rates are sessions/s), turns closed-loop; seed {w['seed']}; {n} per rate, drain limit "
            f"{cfg['drain_s']:g} s; rates {cfg['rates']}.")


def write(results: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md and the plots; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=1, allow_nan=True))
    md_path = out_dir / "report.md"
    md_path.write_text(markdown(results))
    from skyline.tools.bench.plots import plot_all  # matplotlib import is slow; only when writing

    return [json_path, md_path, *plot_all(results, out_dir)]


if __name__ == "__main__":
    path = Path(sys.argv[1])
    for f in write(json.loads(path.read_text()), path.parent):
        print(f)
