"""Command-line options of `skyline profile` and `skyline simulate` (argparse only: cheap to import).

Workload options have the names and meanings of `skyline bench run`'s, so a
measured sweep and a simulated one are described by the same flags.
"""

from __future__ import annotations


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure a real engine (prefill, decode step, KV size) into a JSON profile "
                                       "for `skyline simulate`")
    from skyline.tools.simulate.profiler import add_arguments

    add_arguments(p)


def add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a fleet (virtual clock, real scheduler policy): a rate sweep like "
                                        "`skyline bench run`, or --search for the cheapest fleet")
    perf = p.add_argument_group("engine performance model (one of)")
    perf.add_argument("--profile", help="a JSON profile written by `skyline profile` (e.g. "
                                        "skyline/tools/simulate/profiles/cpu-1core-nixl.json)")
    perf.add_argument("--slowdown",
                      help="with --profile: engine steps cost this multiple of the profiled time: one factor, or "
                           "per role (prefill=2.6,decode=1.4; a colocated engine: prompt chunks at the first, decode "
                           "tokens at the second); default the profile's own `slowdown`, else 1. "
                           "`python -m skyline.tools.simulate.calibrate` derives it from a measured run")
    perf.add_argument("--handoff-ms", type=float,
                      help="with --profile: fixed cost of a KV hand-off beyond the first decode step (default: "
                           "the profile's kv_transfer, measured by `skyline profile --handoff`)")
    perf.add_argument("--gpu", help="analytical roofline model of this GPU: H100, H200, A100")
    perf.add_argument("--model", default="llama-3-8b",
                      help="with --gpu: model shape preset (smollm2-135m, llama-3-8b, opt-13b); default llama-3-8b")
    perf.add_argument("--tp", type=int, default=1, help="with --gpu: tensor parallelism of every engine")
    perf.add_argument("--prefill-tp", type=int, help="with --gpu: tensor parallelism of prefill engines (default --tp)")
    perf.add_argument("--decode-tp", type=int, help="with --gpu: tensor parallelism of decode engines (default --tp)")
    perf.add_argument("--mfu", type=float, help="with --gpu: model FLOP utilisation (default 0.55)")
    perf.add_argument("--mbu", type=float, help="with --gpu: memory bandwidth utilisation (default 0.75)")

    p.add_argument("--no-native", dest="native", action="store_false",
                   help="run the simulator's Python modules even when a compiled build of them matches the sources "
                        "(`make sim-native`; the same results, ~3x slower)")
    fleet = p.add_argument_group("fleet")
    fleet.add_argument("--mode", default="both", choices=["disagg", "colocated", "both"],
                       help="which fleet(s) to simulate; both = colocated then disagg (default)")
    fleet.add_argument("--prefill", type=int, default=1, help="prefill workers (disagg)")
    fleet.add_argument("--decode", type=int, default=1, help="decode workers")
    fleet.add_argument("--colocated-workers", type=int,
                       help="workers of the colocated fleet (default: the same devices as the disagg fleet)")
    fleet.add_argument("--elastic-workers", type=int, default=0, metavar="N",
                       help="also simulate a fleet of N elastic workers (sim-elastic: every engine takes either "
                            "phase, as `skyline worker elastic`; the colocated engine model; docs/simulator.md)")
    fleet.add_argument("--shared-host", nargs="?", const="profile", metavar="FACTOR",
                       help="disagg: prefill worker i and decode worker i share one host's cores (as `skyline up` "
                            "on a 2-core machine); a step of either costs FACTOR times more while the other is busy "
                            "(default: the profile's handoff.neighbour_slowdown, measured by skyline profile --handoff)")
    fleet.add_argument("--config", help="Skyline TOML config: tiers, admission, worker limits (deploy/skyline.toml)")
    fleet.add_argument("--no-admission", dest="admission", action="store_false", default=None)
    fleet.add_argument("--no-preemption", dest="preemption", action="store_false", default=None)
    fleet.add_argument("--min-remote-prefill-tokens", type=int,
                       help="disagg: prompts shorter than this are prefilled on the decode worker (default: the config's)")
    fleet.add_argument("--max-running", type=int, help="requests a worker holds at once")
    fleet.add_argument("--tpot-headroom", type=float,
                       help="decode workers claim only while their streams' time per token is under this fraction "
                            "of the tightest TPOT target (default: the config's; 0 = no such rule)")
    fleet.add_argument("--affinity", default="on", choices=["on", "off", "both"],
                       help="prefix affinity for requests with shared prefixes (--workload multiturn, a multi-turn "
                            "trace): on (the config's [gateway] affinity options), off (the shared queue only), or "
                            "both: each fleet twice, named -affinity / -no-affinity, to show what it buys. Engines "
                            "model their prefix caches either way")
    fleet.add_argument("--step-tokens", type=int, help="tokens per engine step (chunked prefill); default: the "
                                                       "profile's, or 8192 on GPUs")

    wl = p.add_argument_group("workload (as `skyline bench run`)")
    wl.add_argument("--workload", default="mixed", choices=["mixed", "multiturn"],
                    help="mixed: independent requests (default); multiturn: the bench's sessions (conversations over "
                         "a shared system prompt, RAG questions over shared documents; rates are sessions/s), with "
                         "prefix caches and affinity (docs/simulator.md)")
    wl.add_argument("--turns", default="3-5", help="multiturn: turns per conversation LO-HI (default 3-5)")
    wl.add_argument("--think-s", type=float, default=1.5,
                    help="multiturn: mean think time (s, exponential) between an answer and the next turn")
    wl.add_argument("--rag-docs", type=int, default=3, help="multiturn: shared documents of the RAG questions")
    wl.add_argument("--max-prompt-tokens", type=int, default=1800,
                    help="multiturn: a conversation ends before a prompt longer than this")
    wl.add_argument("--rates", help="comma-separated request rates (req/s)")
    wl.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    wl.add_argument("--num-requests", type=int, help="requests per rate (instead of --duration)")
    wl.add_argument("--drain", type=float, help="seconds after the last arrival before unfinished requests count "
                                                "as cancelled")
    wl.add_argument("--mix", type=float, default=0.8, help="fraction of chat requests")
    wl.add_argument("--chat-prompt")
    wl.add_argument("--rag-prompt")
    wl.add_argument("--chat-output")
    wl.add_argument("--rag-output")
    wl.add_argument("--lengths", default="bench", choices=["bench", "sharegpt"],
                    help="length distributions: bench's uniform ranges, or ShareGPT-like (see docs/simulator.md)")
    wl.add_argument("--chat-tier", default="interactive", choices=["interactive", "standard", "batch"])
    wl.add_argument("--rag-tier", default="standard", choices=["interactive", "standard", "batch"])
    wl.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    wl.add_argument("--burstiness", type=float, default=1.0)
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--quick", action="store_true", help="bench's --quick preset of rates, durations and lengths")
    wl.add_argument("--trace", help="replay a trace instead: a `skyline bench` results.json (its requests, "
                                    "one system's), or JSON lines {send_at, prompt_tokens, max_tokens, cls, tier}")
    wl.add_argument("--trace-system", help="with a results.json trace: whose requests to replay (default: the first)")
    wl.add_argument("--trace-cache-hits", action="store_true",
                    help="with --trace: engines skip each request's measured prefix-cache hit (a results.json's "
                         "num_cached_tokens, a JSON-lines trace's \"cached_tokens\"); off by default: the CPU "
                         "calibration holds without it (docs/simulator.md)")

    slo = p.add_argument_group("SLO targets (as `skyline bench run`)")
    slo.add_argument("--slo-ttft-ms", help="one number for every class, or chat=MS,rag=MS")
    slo.add_argument("--slo-tpot-ms", help="one number for every class, or chat=MS,rag=MS")
    slo.add_argument("--slo-scale", type=float, default=5.0,
                     help="targets not given = this multiple of each class's simulated unloaded median")
    slo.add_argument("--slo-from", help="take the targets of a `skyline bench` results.json")
    slo.add_argument("--allow-demotion", action="store_true")

    se = p.add_argument_group("search mode")
    se.add_argument("--search", action="store_true",
                    help="find the cheapest prefill:decode split (and colocated count) meeting --target-rate")
    se.add_argument("--target-rate", type=float, help="req/s the fleet must serve at >= 90%% SLO attainment")
    se.add_argument("--max-devices", type=int, default=64, help="largest fleet the search considers (GPUs)")

    p.add_argument("--overlay", help="a `skyline bench` results.json whose measured runs join the report and plots")
    p.add_argument("--out", help="output folder (default sim-results/<time>)")
    p.add_argument("--log-level", default="WARNING")
