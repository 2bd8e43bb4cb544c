"""How one benchmark request is phrased for each kind of server (pure).

Every system gets the same chat completion (same messages, same max_tokens,
greedy, ignore_eos so the output length is exactly max_tokens). What differs
is how the request's importance is conveyed:
  plain     nothing: the server sees a FCFS stream (baseline vLLM);
  priority  vLLM's `priority` body field (lower runs first), from the tier;
  skyline   Skyline's `x-slo-tier` header plus the class's targets as
            `x-slo-ttft-ms` / `x-slo-tpot-ms`, so the gateway schedules for
            the same SLO the benchmark judges it by (the gateway only ever
            tightens its tier defaults with them).
"""

from __future__ import annotations

import math

from skyline.tools.bench.workload import BenchRequest

FLAVORS = ("plain", "priority", "skyline")
# vLLM's priority scheduler runs lower values first.
TIER_PRIORITY = {"interactive": 0, "standard": 1, "batch": 2}


def shape(flavor: str, req: BenchRequest, model: str, targets_ms: tuple[float, float],
          allow_demotion: bool = False) -> tuple[dict, dict]:
    """(JSON body, extra headers) of `req` for a server of this flavor.

    `allow_demotion` (skyline only): accept a looser tier instead of a 429
    when the gateway predicts the request's tier cannot be met.
    """
    body = {
        "model": req.adapter or model,
        "messages": list(req.messages) or [{"role": "user", "content": req.content}],
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    headers: dict[str, str] = {}
    if flavor == "priority":
        body["priority"] = TIER_PRIORITY[req.tier]
    elif flavor == "skyline":
        headers = {"x-slo-tier": req.tier}
        # Targets are unknown (infinite) during warm-up and the unloaded probe: the tier's defaults apply.
        for name, value in (("x-slo-ttft-ms", targets_ms[0]), ("x-slo-tpot-ms", targets_ms[1])):
            if math.isfinite(value):
                headers[name] = str(max(1, round(value)))
        if allow_demotion:
            headers["x-slo-allow-demotion"] = "true"
    elif flavor != "plain":
        raise ValueError(f"unknown request flavor {flavor!r}; expected one of {FLAVORS}")
    return body, headers
