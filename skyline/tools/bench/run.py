"""`skyline bench run`: start each system, warm it up, sweep the rates, stop it; then report.

Order of events, per system (one system at a time, so each has the cores
to itself):
  1. start it (processes; Redis too for Skyline fleets) and wait until ready;
  2. warm-up requests, not measured (first requests pay one-off costs);
  3. on the first system that starts (the baseline), if any SLO target is
     to be derived: the unloaded probe (requests one at a time), giving the
     per-class targets used for every system (sent to Skyline as headers; a Skyline system
     started after them has its tiers set to them: `config_for`);
  4. for each rate: the open-loop run (--workload multiturn: open-loop sessions of closed-loop
     turns, then the oracle's prefix-cache hits for what was sent; --workload lora: the adapter
     loads the system made meanwhile); then the next rate;
  5. stop it.
A system that fails to start or crashes is reported as failed and the
sweep goes on with the next one.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

import redis
from tqdm import tqdm

from skyline.core.config import load_config
from skyline.tools.bench import driver, engine_steps, lora, metrics, report
from skyline.tools.bench.config_file import with_changes
from skyline.tools.bench.multiturn import MultiturnSpec, make_sessions, turn_request
from skyline.tools.bench.options import DEFAULT_SYSTEMS, parse_per_class, parse_range, preset
from skyline.tools.bench.oracle import oracle_cached_tokens
from skyline.tools.bench.prompts import PromptBuilder
from skyline.tools.bench.slo import SloTargets, derive_targets, explicit_targets, fleet_tiers
from skyline.tools.bench.systems import SYSTEMS, SystemSpec, cache_block_size, engine_cores, start
from skyline.tools.bench.workload import CLASSES, WorkloadSpec, make_requests, probe_requests, requests_for

NO_TARGET = (math.inf, math.inf)  # before targets are known (warm-up, probe): nothing to judge against


def _loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "-"


def _clean(x):
    """NaN -> None, so results.json is strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


class Bench:
    def __init__(self, args: argparse.Namespace, command: str = ""):
        p = preset(args)
        self.args, self.command = args, command or "(called from Python)"
        self.rates = [float(r) for r in str(p["rates"]).split(",") if r.strip()]
        self.duration_s, self.num_requests, self.drain_s = p["duration"], args.num_requests, p["drain"]
        config = getattr(args, "skyline_config", None)  # (absent from other commands' argument sets)
        self.skyline_config = str(Path(config).resolve()) if config else ""
        self.probe_n, self.warmup_n = p["probe_requests"], p["warmup"]
        # What the system being run was sent before the rate being measured (warm-up, probe, earlier
        # rates): the oracle's history, so that it stays an upper bound (multiturn only).
        self.sent_before: list[tuple[list[int], list[int]]] = []
        self.workload = WorkloadSpec(
            mix=args.mix, chat_prompt=parse_range(p["chat_prompt"]), rag_prompt=parse_range(p["rag_prompt"]),
            chat_output=parse_range(p["chat_output"]), rag_output=parse_range(p["rag_output"]),
            chat_tier=args.chat_tier, rag_tier=args.rag_tier, arrival=args.arrival, burstiness=args.burstiness,
            seed=args.seed)
        # (getattr: argument sets built before the multi-turn workload, e.g. tests', lack its options)
        self.workload_kind = getattr(args, "workload", "mixed")
        self.multiturn = MultiturnSpec(turns=parse_range(getattr(args, "turns", "3-5")),
                                       think_s=getattr(args, "think_s", 1.5), rag_docs=getattr(args, "rag_docs", 3),
                                       max_prompt_tokens=getattr(args, "max_prompt_tokens", 1800))
        self.lora = lora.LoraSpec(getattr(args, "adapters", 8), getattr(args, "zipf", 1.0))
        self._adapters: dict[str, list[tuple[str, str]]] = {}  # engine kind -> the adapters made for it
        self.explicit_ttft, self.explicit_tpot = parse_per_class(args.slo_ttft_ms), parse_per_class(args.slo_tpot_ms)
        if args.endpoint:
            self.systems = [SystemSpec("endpoint", "endpoint", args.endpoint_flavor)]
        else:
            self.systems = self._systems(args.systems or DEFAULT_SYSTEMS[self.workload_kind],
                                         getattr(args, "engines", None), getattr(args, "block_size", 0))
        if self.workload_kind == "lora" and self.lora.adapters < 1:
            raise SystemExit(f"--adapters must be at least 1, got {self.lora.adapters}")
        mismatched = [s.name for s in self.systems if s.kind != "endpoint" and s.lora != (self.workload_kind == "lora")]
        if mismatched:  # a LoRA system serves the lora workload's adapters, and only it names them
            raise SystemExit(f"system(s) {', '.join(mismatched)} do not run the {self.workload_kind} workload: "
                             "the lora workload takes the *-lora-* systems, and they take only it")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.out = Path(args.out or f"bench-results/{stamp}")
        self.targets: SloTargets | None = None
        if all(c in self.explicit_ttft and c in self.explicit_tpot for c in CLASSES):
            self.targets = explicit_targets(self.explicit_ttft, self.explicit_tpot)
        self._builders: dict[str, PromptBuilder] = {}
        self.engine_profile: dict | None = None  # --profile-engine: the profile taken after the systems ran

    @staticmethod
    def _systems(names_csv: str, engines: int | None, block_size: int = 0) -> list[SystemSpec]:
        """The named systems; `engines` (--engines) sets the engine count of the N-engine ones,
        `block_size` (--block-size) the KV block of every vLLM engine (0: vLLM's default)."""
        names = [s.strip() for s in names_csv.split(",") if s.strip()]
        unknown = [n for n in names if n not in SYSTEMS]
        if unknown:
            raise SystemExit(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
        if engines is not None and engines < 1:
            raise SystemExit(f"--engines must be at least 1, got {engines}")
        if block_size < 0:
            raise SystemExit(f"--block-size must be 0 (vLLM's default) or positive, got {block_size}")
        specs = [replace(SYSTEMS[n], engines=engines) if engines and SYSTEMS[n].engines > 1 else SYSTEMS[n]
                 for n in names]
        return [replace(s, block_size=block_size) if s.engine == "vllm" else s for s in specs]

    # -- workload -------------------------------------------------------------------------------

    def builder(self, spec: SystemSpec) -> PromptBuilder:
        """Prompt lengths are counted in the tokens of the model each system serves."""
        kind = "bytes" if spec.engine == "sim" or (spec.kind == "endpoint" and self.args.tokenizer == "bytes") else (
            self.args.tokenizer if spec.kind == "endpoint" else "default")
        if kind not in self._builders:
            from skyline.tools.bench.tokenizer import load_tokenizer

            if kind == "bytes":
                self._builders[kind] = PromptBuilder(load_tokenizer("sim", ""))
            else:
                from skyline.tools.model import resolve_model

                self._builders[kind] = PromptBuilder(load_tokenizer("vllm", resolve_model(kind)))
        return self._builders[kind]

    def adapted(self, requests: list, stream: str) -> list:
        """The lora workload: each request naming an adapter (the others' unchanged)."""
        return lora.assign(requests, self.lora, self.workload.seed, stream) if self.workload_kind == "lora" else requests

    def adapters_for(self, spec: SystemSpec) -> list[tuple[str, str]]:
        """The adapters a LoRA system serves, made once per engine kind, under <out>/adapters/."""
        if not spec.lora:
            return []
        if spec.engine not in self._adapters:
            self._adapters[spec.engine] = lora.write_adapters(self.out / "adapters", self.lora, spec.engine)
        return self._adapters[spec.engine]

    def load_counter(self, spec: SystemSpec, running) -> tuple[Callable[[], int], Callable[[], None]]:
        """(the adapter loads a LoRA system made so far, what to call when done): opens of the adapters'
        weights for real engines, what its workers advertise for sim engines (skyline.tools.bench.lora)."""
        if spec.engine == "sim":
            return lambda: lora.fleet_loads(running.redis_url, running.key_prefix), lambda: None
        opens = lora.WeightOpens([path for _name, path in running.adapters])
        return opens.read, opens.close

    def n_for(self, rate: float) -> int:
        return requests_for(rate, self.duration_s, self.num_requests)

    def config_for(self, spec: SystemSpec) -> str:
        """The config file a Skyline system's processes read: the user's (--skyline-config), with the tiers
        the workload's classes are sent in set to the benchmark's targets once they are known (measured on
        an earlier system or given): the fleet schedules and admits for what it is judged against."""
        if spec.kind != "skyline" or self.targets is None:
            return self.skyline_config
        tiers = fleet_tiers(load_config(self.skyline_config or None).tiers, self.targets, self.workload.tier_of)
        path = self.out / "logs" / f"{spec.name}-skyline.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        return with_changes(self.skyline_config, {"tiers": tiers}, path)

    def _targets_of(self, cls: str) -> tuple[float, float]:
        return self.targets.for_class(cls) if self.targets else NO_TARGET

    # -- one system -----------------------------------------------------------------------------

    def bench_system(self, spec: SystemSpec, bar: tqdm, records: list, runs: list, probe_out: list) -> dict:
        t0 = time.monotonic()
        bar.write(f"[{spec.name}] starting ...")
        running = start(spec, self.out / "logs", self.args.start_timeout, self.args.endpoint or "",
                        self.args.model or "", self.config_for(spec), self.adapters_for(spec))
        info = {"status": "ok", "startup_s": round(time.monotonic() - t0, 1), "url": running.url,
                "model": running.model}
        bar.write(f"[{spec.name}] ready in {info['startup_s']} s at {running.url}")
        try:
            target = driver.Target(spec.name, running.url, running.model, spec.flavor, self._targets_of,
                                   self.args.allow_demotion)
            builder = self.builder(spec)
            self.sent_before = []  # a new system: new, empty caches
            self._warm_up(spec, running, builder)
            if self.targets is None:
                bar.write(f"[{spec.name}] unloaded probe: {self.probe_n} requests per class, one at a time")
                probing = self.adapted(probe_requests(self.workload, builder, self.probe_n), "probe")
                probe = asyncio.run(driver.run_sequential(target, probing))
                self._seen(builder, probing)
                probe_out.extend(r.to_dict() for r in probe)
                self.targets = derive_targets(probe, self.args.slo_scale, spec.name, self.explicit_ttft,
                                              self.explicit_tpot)
                bar.write(f"[{spec.name}] SLO targets: TTFT {self.targets.ttft_ms} ms, TPOT {self.targets.tpot_ms} ms")
            block_size = cache_block_size(spec, self.args.tokenizer)  # the oracle's unit: the engine's block
            loads, done_counting = self.load_counter(spec, running) if spec.lora else (None, lambda: None)
            for rate in self.rates:
                bar.set_postfix_str(f"{spec.name} @ {rate:g} req/s")
                running.check_alive()
                if self.workload_kind == "multiturn":
                    recs, duration = self._run_sessions(target, builder, rate, block_size, bar)
                else:
                    reqs = self.adapted(make_requests(self.workload, builder, self.n_for(rate), rate), f"{rate:g}")
                    progress = lambda _r: bar.update(1)
                    before = loads() if loads else 0
                    recs, duration = asyncio.run(driver.run_rate(target, rate, reqs, self.drain_s, progress))
                running.check_alive()  # a crash mid-run would otherwise look like a slow server
                summary = metrics.summarize(recs, duration)
                if loads:
                    made = loads() - before
                    summary["adapters"] = {"loads": made, "loads_per_min": made / duration * 60 if duration else None,
                                           "counted": "workers" if spec.engine == "sim" else "weight-file opens"}
                if self.workload_kind == "multiturn":
                    summary["prefix_cache"]["block_size"] = block_size
                summary["send_lag_ms_max"] = max((r.sent_s - r.send_at) * 1000 for r in recs)  # load-generator health
                runs.append({"system": spec.name, "rate": rate, "summary": summary})
                records.extend(r.to_dict() for r in recs)
                bar.write(f"[{spec.name}] {rate:g} req/s: {summary['ok']}/{summary['sent']} ok, "
                          f"{summary['rejected']} rejected, attainment {summary['attainment']:.0%}"
                          + _cache_line(summary["prefix_cache"]) + _loads_line(summary.get("adapters")))
            done_counting()
            if running.redis_url:
                self._engine_steps(spec, running, info, bar)
        finally:
            running.stop()
        return info

    def _run_sessions(self, target: driver.Target, builder: PromptBuilder, rate: float, block_size: int,
                      bar: tqdm) -> tuple[list, float]:
        """One rate of the multi-turn workload; each completed request gets the oracle's cached tokens.
        The bar counts sessions (at their first answer): how many turns follow depends on the answers."""
        mt = self.multiturn
        sessions = make_sessions(self.workload, mt, builder, self.n_for(rate), rate)

        def build(session, turn, messages, index, send_at):
            return turn_request(session, turn, messages, builder, mt, index, send_at)

        progress = lambda r: bar.update(1) if r.turn == 0 else None
        recs, duration, transcripts = asyncio.run(
            driver.run_sessions(target, rate, sessions, build, self.drain_s, progress))
        done = [(r, t) for r, t in zip(recs, transcripts) if r.outcome == "ok"]
        tok = builder.tok
        sent = [(tok.apply_chat_template(msgs), tok.encode_answer(answer)) for _, (msgs, answer) in done]
        # Against everything the system was sent before too (warm-up, probe, earlier rates): its caches
        # hold blocks of those (every chat prompt starts with the same template tokens, at least).
        windows = [(-1.0, -1.0)] * len(self.sent_before) + [(r.sent_s, r.sent_s + r.ttft_s) for r, _ in done]
        hits = oracle_cached_tokens(self.sent_before + sent, block_size, windows)[len(self.sent_before):]
        self.sent_before += sent
        for (rec, _), hit in zip(done, hits):
            rec.oracle_cached_tokens = hit
        return recs, duration

    def _seen(self, builder: PromptBuilder, requests) -> None:
        """Requests sent before the measured ones, for the oracle (their answers are not kept)."""
        if self.workload_kind == "multiturn":
            tok = builder.tok
            self.sent_before += [(tok.apply_chat_template(list(r.messages) or [{"role": "user", "content": r.content}]),
                                  []) for r in requests]

    def _engine_steps(self, spec: SystemSpec, running, info: dict, bar: tqdm) -> None:
        """The engine steps the system's workers ran (warm-up and probe included), kept with its results."""
        try:
            steps = engine_steps.scrape(running.redis_url, running.key_prefix)
        except (OSError, ValueError, redis.RedisError) as exc:  # a missing figure must not lose the run
            bar.write(f"[{spec.name}] engine steps not read: {exc}")
            return
        if steps:
            info["engine_steps"] = steps
            bar.write(f"[{spec.name}] engine steps: {engine_steps.describe(steps)}")

    def _warm_up(self, spec: SystemSpec, running, builder: PromptBuilder) -> None:
        """One RAG and (warmup - 1) chat requests, one at a time, not measured."""
        warm = self.adapted(probe_requests(self.workload, builder, 1, stream="warmup"), "warmup")
        warm = [r for r in warm if r.cls == "rag"] + [r for r in warm if r.cls == "chat"] * max(1, self.warmup_n - 1)
        # No SLO targets in warm-up (the tier's defaults apply): it must not be shed, only run.
        untargeted = driver.Target(spec.name, running.url, running.model, spec.flavor, lambda _c: NO_TARGET)
        recs = asyncio.run(driver.run_sequential(untargeted, warm))
        self._seen(builder, warm)
        failed = [r for r in recs if r.outcome == "error"]
        if len(failed) == len(recs):
            raise RuntimeError(f"every warm-up request failed: {failed[0].error}")

    # -- the whole run --------------------------------------------------------------------------

    def run(self) -> tuple[dict, list[Path]]:
        self.out.mkdir(parents=True, exist_ok=True)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        load_start = _loadavg()
        records: list[dict] = []
        runs: list[dict] = []
        probe: list[dict] = []
        systems: dict[str, dict] = {}
        total = len(self.systems) * sum(self.n_for(r) for r in self.rates)
        with tqdm(total=total, unit="req", desc="skyline bench", dynamic_ncols=True) as bar:
            for spec in self.systems:
                t0 = time.monotonic()
                try:
                    systems[spec.name] = self.bench_system(spec, bar, records, runs, probe)
                except Exception as exc:  # noqa: BLE001 - one broken system must not lose the others' results
                    systems[spec.name] = {"status": "failed", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    bar.write(f"[{spec.name}] FAILED: {exc}")
                    done = sum(1 for r in runs if r["system"] == spec.name)
                    bar.update(sum(self.n_for(r) for r in self.rates[done:]))
                systems[spec.name]["wall_s"] = round(time.monotonic() - t0, 1)
                # Written after every system, so a long run stopped halfway keeps what it measured.
                partial = self._results(started, load_start, systems, runs, probe, records, complete=False)
                report.write(partial, self.out)
        if getattr(self.args, "profile_engine", False) and not self.args.endpoint:
            self.engine_profile = self.profile_engine()
        results = self._results(started, load_start, systems, runs, probe, records, complete=True)
        return results, report.write(results, self.out)

    def _workload_config(self) -> dict:
        """The workload as results.json keeps it; the mixed one exactly as before (merge compares them)."""
        if self.workload_kind == "mixed":
            return asdict(self.workload)
        if self.workload_kind == "lora":
            return {**asdict(self.workload), "kind": "lora", "lora": asdict(self.lora)}
        return {**asdict(self.workload), "kind": self.workload_kind, "multiturn": asdict(self.multiturn)}

    def profile_argv(self, path: Path) -> list[str]:
        """`skyline profile` of the engine as the colocated systems run it: every core, no KV connector."""
        return [sys.executable, "-m", "skyline.cli", "profile", "--cpu-bind", engine_cores(), "--no-kv-transfer",
                "--out", str(path)]

    def profile_engine(self) -> dict:
        """Profile the engine right after the systems ran, on the same host: the simulator replays a run
        within its calibration bounds only on a profile of the same hour (the machine's speed drifts
        over hours: docs/simulator.md)."""
        path, log = self.out / "engine-profile.json", self.out / "logs" / "engine-profile.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print("[engine-profile] profiling the engine (~2 min) ...", flush=True)
        with log.open("w") as f:
            rc = subprocess.run(self.profile_argv(path), stdout=f, stderr=subprocess.STDOUT, check=False).returncode
        if rc != 0 or not path.exists():
            print(f"[engine-profile] FAILED (exit {rc}): see {log}", flush=True)
            return {"status": "failed", "log": str(log.relative_to(self.out))}
        print(f"[engine-profile] written to {path}", flush=True)
        return {"status": "ok", "file": path.name, "command": " ".join(["skyline", *self.profile_argv(path)[3:]])}

    def _results(self, started: str, load_start: str, systems: dict, runs: list, probe: list, records: list,
                 complete: bool) -> dict:
        goodput = {}
        for name in systems:
            points = [(r["rate"], r["summary"]["attainment"]) for r in runs if r["system"] == name]
            if points:
                goodput[name] = metrics.goodput(points)
        return _clean({
            "benchmark": "skyline bench run",
            "command": self.command,
            "complete": complete,
            "started": started, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_start": load_start,
                        "loadavg_end": _loadavg()},
            "config": {"systems": [s.name for s in self.systems], "rates": self.rates, "duration_s": self.duration_s,
                       "num_requests": self.num_requests, "drain_s": self.drain_s, "quick": self.args.quick,
                       "probe_requests": self.probe_n, "warmup": self.warmup_n,
                       "allow_demotion": self.args.allow_demotion,
                       "skyline_config": self.skyline_config,
                       "workload": self._workload_config()},
            "definitions": report.DEFINITIONS,
            "slo": self.targets.to_dict() if self.targets else {"ttft_ms": {}, "tpot_ms": {}, "source": "not measured"},
            "systems": systems, "goodput": goodput, "runs": runs, "probe": probe, "records": records,
            **({"engine_profile": self.engine_profile} if self.engine_profile else {}),
        })


def _cache_line(pc: dict) -> str:
    """', prefix cache 41% (oracle 63%)' for the progress line; nothing when the server said nothing."""
    if pc["hit_rate"] is None or math.isnan(pc["hit_rate"]):
        return ""
    oracle = pc["oracle_hit_rate"]
    return f", prefix cache {pc['hit_rate']:.0%}" + ("" if math.isnan(oracle) else f" (oracle {oracle:.0%})")


def _loads_line(adapters: dict | None) -> str:
    """', 12 adapter loads (3.1/min)' for the progress line of the lora workload."""
    if not adapters:
        return ""
    per_min = adapters["loads_per_min"]
    return f", {adapters['loads']} adapter loads" + (f" ({per_min:.1f}/min)" if per_min is not None else "")


def main(args: argparse.Namespace) -> None:
    results, files = Bench(args, " ".join(shlex.quote(a) for a in ["skyline", *sys.argv[1:]])).run()
    print(files[1].read_text())  # report.md
    print("files:\n" + "\n".join(f"  {f}" for f in files))
    if any(s["status"] != "ok" for s in results["systems"].values()):
        sys.exit(1)

