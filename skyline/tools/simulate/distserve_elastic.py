"""The DistServe check at fleet scale: elastic workers beside fixed prefill/decode pools on the same GPUs.

The workload, targets and engines are the check's (distserve.py: OPT-13B on the A100 roofline,
ShareGPT-like lengths, TTFT 0.25 s / TPOT 0.1 s, no admission control, up to 256 sequences an engine);
here every fleet has `gpus` GPUs (512 by default), and goodput comes from a sweep of rates per GPU
with `duration_s` of arrivals at each, up to the first rate under 90% attainment. Fleets:

  colocated        one TP=1 engine per GPU (vLLM-like, 16,384-token steps);
  disagg 1:1       DistServe's placement in 1:1 units, prefill TP=2 + decode TP=1 (170P + 172D);
  disagg 1:2       the same engines, a quarter of the GPUs' worth more decode (128P + 256D);
  elastic TP=1     one elastic engine per GPU (elastic_worker.py), KV over NVLink between them;
  elastic TP=2     one elastic engine per 2 GPUs: prompts at prefill speed, streams on TP=2.

The fixed pools disaggregate every prompt, as the paper does; the elastic fleets route as the
live gateway does (prompts under `gateway.min_remote_prefill_tokens`, 256, stay on the decode stage).

  python -m skyline.tools.simulate.distserve_elastic [--gpus 512] [--duration 30]
"""

from __future__ import annotations

import argparse
import time

from skyline.core.config import load_config
from skyline.tools.simulate.distserve import VLLM_STEP_TOKENS, fleet_goodput
from skyline.tools.simulate.fleet import FleetSpec
from skyline.tools.simulate.roofline import roofline

PER_GPU_RATES = tuple(round(0.5 * 1.3 ** i, 3) for i in range(13))  # 0.5 to 11.6 req/s per GPU
# A sweep stops at its first rate under the 90% goal: at 512 GPUs every rate costs wall time in
# proportion to its requests, and the rates past the knee add nothing to the goodput.
STOP_BELOW = 0.9


def fleets(gpus: int) -> list[tuple[str, FleetSpec, object, object]]:
    colo = roofline("A100", "opt-13b", tp=1, max_step_tokens=VLLM_STEP_TOKENS)
    prefill = roofline("A100", "opt-13b", tp=2, kv_link="nvlink")
    decode = roofline("A100", "opt-13b", tp=1, kv_link="nvlink")
    elastic1 = roofline("A100", "opt-13b", tp=1, max_step_tokens=VLLM_STEP_TOKENS, kv_link="nvlink")
    elastic2 = roofline("A100", "opt-13b", tp=2, max_step_tokens=VLLM_STEP_TOKENS, kv_link="nvlink")
    units = gpus // 3
    return [
        ("colocated (vLLM-like, TP=1)", FleetSpec("colocated", 0, gpus), colo, colo),
        ("disagg 1:1 (prefill TP=2 + decode TP=1)", FleetSpec("disagg", units, gpus - 2 * units), prefill, decode),
        ("disagg 1:2 (prefill TP=2 + decode TP=1)", FleetSpec("disagg", gpus // 4, gpus // 2), prefill, decode),
        ("elastic TP=1", FleetSpec("elastic", 0, gpus), elastic1, elastic1),
        ("elastic TP=2", FleetSpec("elastic", 0, gpus // 2), elastic2, elastic2),
    ]


def compare(gpus: int = 512, duration_s: float = 30.0, seed: int = 0, sharegpt: dict | None = None,
            only: str | None = None) -> list[dict]:
    """Per-GPU goodput of every fleet (`only`: the fleets whose name contains it)."""
    min_remote = load_config(None).gateway.min_remote_prefill_tokens
    out = []
    for name, fleet, pp, dp in fleets(gpus):
        if only and only not in name:
            continue
        devices = fleet.devices(pp, dp)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        g, points = fleet_goodput(fleet, pp, dp, [round(r * devices, 3) for r in PER_GPU_RATES], 0, seed, sharegpt,
                                  min_remote if fleet.mode == "elastic" else 0, duration_s, STOP_BELOW)
        out.append({"name": name, "fleet": fleet.label, "gpus": devices, "goodput_rps": g["rps"] or 0.0,
                    "bound": g["bound"], "per_gpu_rps": (g["rps"] or 0.0) / devices,
                    "sweep": [(round(r / devices, 3), round(a, 4)) for r, a in points],
                    "wall_s": round(time.perf_counter() - t0, 1)})
        print(f"{name}: {out[-1]}", flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| fleet (OPT-13B, A100 roofline) | workers | GPUs | goodput (req/s) | per GPU (req/s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['fleet']} | {r['gpus']} | {r['goodput_rps']:.1f} | {r['per_gpu_rps']:.2f} |"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=512)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--sigma", type=float, help="the length distributions' sigma (default the check's 0.75)")
    ap.add_argument("--only", help="only the fleets whose name contains this")
    a = ap.parse_args()
    print(markdown(compare(a.gpus, a.duration, sharegpt={"sigma": a.sigma} if a.sigma else None, only=a.only)))
