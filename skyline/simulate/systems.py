"""From command-line options to what is simulated: performance models, fleets, the config.

A simulated system is a fleet (colocated or disaggregated, N workers) with a
performance model per role. Its name says what it is, so a report that
overlays measured runs keeps them apart: `sim-colocated`, `sim-disagg`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from skyline.config import SkylineConfig, load_config
from skyline.simulate.fleet import FleetSpec, with_overrides
from skyline.simulate.perf import PerfModel
from skyline.simulate.perf_profile import ProfileModel
from skyline.simulate.roofline import roofline

GPU_STEP_TOKENS = 8192  # vLLM's max_num_batched_tokens on GPUs unless configured


@dataclass
class SimSystem:
    name: str
    fleet: FleetSpec
    perf_prefill: PerfModel
    perf_decode: PerfModel

    @property
    def devices(self) -> int:
        return self.fleet.devices(self.perf_prefill, self.perf_decode)


def perf_models(args: argparse.Namespace) -> tuple[PerfModel, PerfModel, PerfModel]:
    """(prefill model, decode model, colocated model)."""
    if bool(args.profile) == bool(args.gpu):
        raise SystemExit("give exactly one performance model: --profile FILE or --gpu NAME")
    if args.profile:
        model = ProfileModel.load(args.profile)
        if args.step_tokens:
            model.max_step_tokens = args.step_tokens
        return model, model, model
    step = args.step_tokens or GPU_STEP_TOKENS
    make = lambda tp: roofline(args.gpu, args.model, tp, args.mfu, args.mbu, step)
    return make(args.prefill_tp or args.tp), make(args.decode_tp or args.tp), make(args.tp)


def fleet_config(args: argparse.Namespace) -> SkylineConfig:
    cfg = load_config(args.config)
    cfg = with_overrides(cfg, args.admission, args.preemption, args.max_running)
    return cfg


def systems(args: argparse.Namespace, prefill: PerfModel, decode: PerfModel, colocated: PerfModel) -> list[SimSystem]:
    disagg = SimSystem("sim-disagg", FleetSpec("disagg", args.prefill, args.decode), prefill, decode)
    n = args.colocated_workers or max(1, disagg.devices // colocated.devices)
    out = []
    if args.mode in ("colocated", "both"):
        out.append(SimSystem("sim-colocated", FleetSpec("colocated", 0, n), colocated, colocated))
    if args.mode in ("disagg", "both"):
        out.append(disagg)
    return out


def resized(system: SimSystem, prefill: int, decode: int) -> SimSystem:
    return replace(system, fleet=FleetSpec(system.fleet.mode, prefill, decode))
