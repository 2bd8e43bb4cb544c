"""`skyline bench merge`: one report from several runs of the same benchmark.

A sweep is extended without rerunning it: run the extra rates with the SLO
targets of the first run given explicitly (`--slo-ttft-ms`, `--slo-tpot-ms`),
then merge. Runs merge only when they measured the same thing: the same
workload (rates aside) and the same SLO targets; a (system, rate) measured
twice is refused rather than silently picked. `results.json:SYS1,SYS2` takes
only those systems of a run (e.g. the baselines of a first run, next to the
Skyline systems measured again after a change).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from skyline.tools.bench import metrics, report


class MergeError(ValueError):
    pass


def _comparable_workload(results: dict) -> dict:
    cfg = results["config"]
    return {**cfg["workload"], "duration_s": cfg["duration_s"], "num_requests": cfg["num_requests"]}


def _targets(results: dict) -> dict:
    # Rounded to the millisecond: a derived target printed in a report and given back explicitly is the same target.
    slo = results["slo"]
    return {k: {cls: round(v) for cls, v in slo[k].items()} for k in ("ttft_ms", "tpot_ms")}


def merge(parts: list[dict]) -> dict:
    """The results of `parts` as one run (pure); raises MergeError when they measured different things."""
    if not parts:
        raise MergeError("nothing to merge")
    first = parts[0]
    for i, part in enumerate(parts[1:], start=2):
        if _comparable_workload(part) != _comparable_workload(first):
            raise MergeError(f"run {i} has another workload than run 1: merge only runs of the same benchmark")
        if _targets(part) != _targets(first):
            raise MergeError(f"run {i} has SLO targets {_targets(part)}, run 1 {_targets(first)}: rerun it with "
                             "--slo-ttft-ms/--slo-tpot-ms set to run 1's targets")
    seen: set[tuple[str, float]] = set()
    runs, records, systems_order, systems = [], [], [], {}
    for part in parts:
        for run in part["runs"]:
            key = (run["system"], run["rate"])
            if key in seen:
                raise MergeError(f"{key[0]} at {key[1]:g} req/s is in more than one run")
            seen.add(key)
            runs.append(run)
        records += part["records"]
        for name in part["config"]["systems"]:
            if name not in systems_order:
                systems_order.append(name)
        for name, info in part["systems"].items():
            prev = systems.get(name)
            if prev is None:
                systems[name] = dict(info)
            else:
                prev["wall_s"] = round(prev.get("wall_s", 0) + info.get("wall_s", 0), 1)
                if info.get("status") != "ok":
                    prev["status"], prev["error"] = info["status"], info.get("error", "")
    order = {name: i for i, name in enumerate(systems_order)}
    runs.sort(key=lambda r: (order[r["system"]], r["rate"]))
    goodput = {name: metrics.goodput([(r["rate"], r["summary"]["attainment"]) for r in runs if r["system"] == name])
               for name in systems_order if any(r["system"] == name for r in runs)}
    rates = sorted({r["rate"] for r in runs})
    return {
        **first,
        "command": " && ".join(p["command"] for p in parts) + "  (merged: skyline bench merge)",
        "complete": all(p.get("complete", True) for p in parts),
        "finished": parts[-1]["finished"],
        "machine": {**first["machine"], "loadavg_end": parts[-1]["machine"].get("loadavg_end")},
        "config": {**first["config"], "systems": systems_order, "rates": rates},
        "systems": {name: systems[name] for name in systems_order if name in systems},
        "goodput": goodput, "runs": runs, "records": records,
    }


def select(results: dict, systems: list[str]) -> dict:
    """Only `systems` of a run (pure)."""
    missing = [s for s in systems if s not in results["config"]["systems"]]
    if missing:
        raise MergeError(f"no system {', '.join(missing)} in that run (it has {', '.join(results['config']['systems'])})")
    keep = set(systems)
    return {**results, "config": {**results["config"], "systems": [s for s in results["config"]["systems"] if s in keep]},
            "systems": {k: v for k, v in results["systems"].items() if k in keep},
            "runs": [r for r in results["runs"] if r["system"] in keep],
            "records": [r for r in results["records"] if r["system"] in keep]}


def _load(spec: str) -> dict:
    path, _, systems = spec.partition(".json:")
    results = json.loads(Path(path + ".json" if systems else spec).read_text())
    return select(results, systems.split(",")) if systems else results


def main(args: argparse.Namespace) -> None:
    try:
        parts = [_load(p) for p in args.results]
        merged = merge(parts)
    except MergeError as exc:
        raise SystemExit(f"skyline bench merge: {exc}") from None
    files = report.write(merged, Path(args.out))
    print("files:\n" + "\n".join(f"  {f}" for f in files))
