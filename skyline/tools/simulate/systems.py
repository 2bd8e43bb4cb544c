"""From command-line options to what is simulated: performance models, fleets, the config.

A simulated system is a fleet (colocated or disaggregated, N workers) with a
performance model per role. Its name says what it is, so a report that
overlays measured runs keeps them apart: `sim-colocated`, `sim-disagg`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from skyline.core.config import SkylineConfig, load_config
from skyline.tools.simulate.fleet import FleetSpec, with_overrides
from skyline.tools.simulate.perf import PerfModel
from skyline.tools.simulate.perf_profile import ProfileModel
from skyline.tools.simulate.roofline import roofline

GPU_STEP_TOKENS = 8192  # vLLM's max_num_batched_tokens on GPUs unless configured


@dataclass
class SimSystem:
    name: str
    fleet: FleetSpec
    perf_prefill: PerfModel
    perf_decode: PerfModel
    neighbour_slowdown: float = 1.0  # != 1: prefill and decode worker i share a host (Simulation)
    affinity: bool = True  # the gateway places requests by prefix (off: `[gateway] prefix_affinity = false`)

    @property
    def devices(self) -> int:
        return self.fleet.devices(self.perf_prefill, self.perf_decode)


def perf_models(args: argparse.Namespace) -> tuple[PerfModel, PerfModel, PerfModel]:
    """(prefill model, decode model, colocated model)."""
    if bool(args.profile) == bool(args.gpu):
        raise SystemExit("give exactly one performance model: --profile FILE or --gpu NAME (a --trace recorded with "
                         "`skyline bench run --profile-engine` brings its own)")
    if args.profile:
        handoff_s = None if args.handoff_ms is None else args.handoff_ms / 1000
        slow = role_slowdowns(args.slowdown)
        models = {}
        # Per role: a prefill engine's steps, a decode engine's; a colocated engine computes both in
        # its steps, its prompt chunks at the prefill factor and its decode tokens at the decode one.
        for key, (prompt_f, decode_f) in (("prefill", (slow["prefill"], slow["prefill"])),
                                          ("decode", (slow["decode"], slow["decode"])),
                                          ("colocated", (slow["prefill"], slow["decode"]))):
            models[key] = ProfileModel.load(args.profile, slowdown=prompt_f, handoff_s=handoff_s,
                                            decode_slowdown=decode_f)
            if args.step_tokens:
                models[key].max_step_tokens = args.step_tokens
        return models["prefill"], models["decode"], models["colocated"]
    if args.slowdown is not None or args.handoff_ms is not None:
        raise SystemExit("--slowdown and --handoff-ms apply to a measured --profile, not to --gpu")
    step = args.step_tokens or GPU_STEP_TOKENS
    make = lambda tp: roofline(args.gpu, args.model, tp, args.mfu, args.mbu, step)
    return make(args.prefill_tp or args.tp), make(args.decode_tp or args.tp), make(args.tp)


def role_slowdowns(text: str | None) -> dict[str, float | None]:
    """`--slowdown`: one factor for every engine ("1.4") or per role ("prefill=2.6,decode=1.4"; a
    colocated engine prices prompt chunks at the prefill factor, decode tokens at the decode one);
    None = the profile's own."""
    if not text:
        return {"prefill": None, "decode": None}
    if "=" not in text:
        return {"prefill": float(text), "decode": float(text)}
    out: dict[str, float | None] = {"prefill": None, "decode": None}
    for part in text.split(","):
        role, _, value = part.partition("=")
        if role.strip() not in out:
            raise SystemExit(f"--slowdown: unknown role {role!r} (prefill or decode)")
        out[role.strip()] = float(value)
    return out


def fleet_config(args: argparse.Namespace) -> SkylineConfig:
    cfg = load_config(args.config)
    cfg = with_overrides(cfg, args.admission, args.preemption, args.max_running, args.min_remote_prefill_tokens,
                         args.tpot_headroom)
    return cfg


def neighbour_slowdown(args: argparse.Namespace, prefill: PerfModel) -> float:
    """The --shared-host factor: given, or the one the profile measured (`skyline profile --handoff`)."""
    if args.shared_host is None:
        return 1.0
    if args.shared_host != "profile":
        return float(args.shared_host)
    measured = getattr(prefill, "profile", {}).get("handoff", {}).get("neighbour_slowdown")
    if not measured:
        raise SystemExit("--shared-host: the profile has no measured handoff.neighbour_slowdown "
                         "(run skyline profile --handoff) and no factor was given")
    return float(measured)


def systems(args: argparse.Namespace, prefill: PerfModel, decode: PerfModel, colocated: PerfModel) -> list[SimSystem]:
    disagg = SimSystem("sim-disagg", FleetSpec("disagg", args.prefill, args.decode), prefill, decode,
                       neighbour_slowdown(args, prefill))
    n = args.colocated_workers or max(1, disagg.devices // colocated.devices)
    out = []
    if args.mode in ("colocated", "both"):
        out.append(SimSystem("sim-colocated", FleetSpec("colocated", 0, n), colocated, colocated))
    if args.mode in ("disagg", "both"):
        out.append(disagg)
    if getattr(args, "elastic_workers", None):  # beside the fixed pools: every engine takes either phase
        out.append(SimSystem("sim-elastic", FleetSpec("elastic", 0, args.elastic_workers), colocated, colocated))
    choice = getattr(args, "affinity", "on")
    if choice == "off":
        out = [replace(s, affinity=False) for s in out]
    elif choice == "both":
        out = [replace(s, name=f"{s.name}-{tag}", affinity=on) for s in out
               for tag, on in (("affinity", True), ("no-affinity", False))]
    return out


def resized(system: SimSystem, prefill: int, decode: int) -> SimSystem:
    return replace(system, fleet=FleetSpec(system.fleet.mode, prefill, decode))
