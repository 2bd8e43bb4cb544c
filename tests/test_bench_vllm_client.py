"""`skyline bench vllm-client`: vLLM's own client against each system, and issue 21's goals.

The pure parts without engines: the client's command line is the issue's run, vLLM's result file
reads into the figures the report shows, each goal is judged both ways. Then the whole subcommand
once against a sim fleet (vLLM's client as a real subprocess; no model weights, only the default
model's tokenizer), asserting what its reader relies on: every request counted, a report written.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from skyline import cli
from skyline.tools.bench import vllm_client
from skyline.tools.bench.vllm_client import Load, client_argv, client_flags, report, summarize, verdicts


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_the_client_is_the_issues_run_by_default(tmp_path):
    args = cli.build_parser().parse_args(["bench", "vllm-client"])
    assert args.systems == vllm_client.DEFAULT_SYSTEMS
    load = Load(args.input_len, args.output_len, args.num_prompts, args.rate, args.seed, args.ignore_eos,
                args.endpoint, tuple(args.header or ()))
    assert load == Load()  # the CLI's defaults are the module's: 128 in, 32 out, 24 prompts at 2 req/s
    flags = client_flags("http://127.0.0.1:9", "SmolLM2-135M-Instruct", "/models/smol", load, tmp_path, "vllm-fcfs")
    assert _flag(flags, "--backend") == "openai" and _flag(flags, "--endpoint") == "/v1/completions"
    assert _flag(flags, "--base-url") == "http://127.0.0.1:9"
    assert _flag(flags, "--model") == "SmolLM2-135M-Instruct" and _flag(flags, "--tokenizer") == "/models/smol"
    assert _flag(flags, "--dataset-name") == "random"
    assert (_flag(flags, "--random-input-len"), _flag(flags, "--random-output-len")) == ("128", "32")
    assert (_flag(flags, "--num-prompts"), _flag(flags, "--request-rate"), _flag(flags, "--seed")) == ("24", "2.0", "0")
    assert _flag(flags, "--metric-percentiles") == "50,99" and "ttft" in _flag(flags, "--percentile-metrics")
    assert _flag(flags, "--result-dir") == str(tmp_path) and _flag(flags, "--result-filename") == "vllm-fcfs.json"
    assert "--save-result" in flags and "--ignore-eos" in flags
    assert "--ignore-eos" not in client_flags("u", "m", "t", Load(ignore_eos=False), tmp_path, "s")
    argv = client_argv(flags)
    assert argv[:2] == [sys.executable, "-c"] and argv[3:] == flags


def test_a_run_without_out_writes_to_an_ignored_folder():
    """The default folder is under bench-results/, which .gitignore names: a run stays out of the tracked tree."""
    from datetime import date

    assert vllm_client.default_out(date(2026, 12, 5)) == Path("bench-results/2026-12-05-vllm-client")
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().split()
    assert f"{vllm_client.default_out().parts[0]}/" in ignored


def test_the_client_parses_as_vllm_bench_serve(tmp_path):
    # The flags must be the names this vLLM version's `vllm bench serve` knows (a rename fails here, not
    # minutes into a run with the engines up).
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    ns = p.parse_args(client_flags("http://127.0.0.1:9", "m", "t", Load(num_prompts=6, rate=3), tmp_path, "x"))
    assert (ns.random_input_len, ns.random_output_len, ns.num_prompts, ns.request_rate) == (128, 32, 6, 3.0)
    assert ns.ignore_eos and ns.save_result and ns.metric_percentiles == "50,99"
    chat = Load(endpoint="chat", headers=("x-skyline-route=colocated", "x-slo-tier=interactive"))
    ns = p.parse_args(client_flags("http://127.0.0.1:9", "m", "t", chat, tmp_path, "x"))
    assert (ns.backend, ns.endpoint) == ("openai-chat", "/v1/chat/completions")
    assert ns.header == ["x-skyline-route=colocated", "x-slo-tier=interactive"]


def test_a_header_without_a_value_is_refused_before_anything_starts(tmp_path):
    args = cli.build_parser().parse_args(["bench", "vllm-client", "--header", "x-slo-tier", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        vllm_client.main(args)


def _raw(completed=24, failed=0, ttft=(1700.0, 2600.0), tok_s=40.0, errors=None) -> dict:
    """A result file as vllm/benchmarks/serve.py writes it (--save-result --save-detailed), trimmed."""
    return {
        "date": "20261202-101500", "endpoint_type": "openai", "backend": "openai", "label": None,
        "model_id": "SmolLM2-135M-Instruct", "tokenizer_id": "/models/smol", "num_prompts": 24,
        "request_rate": 2.0, "burstiness": 1.0, "max_concurrency": None,
        "duration": 13.2, "completed": completed, "failed": failed, "total_input_tokens": 128 * completed,
        "total_output_tokens": 32 * completed, "request_throughput": completed / 13.2, "request_goodput": None,
        "output_throughput": tok_s, "total_token_throughput": tok_s * 5,
        "errors": errors if errors is not None else [""] * 24,
        "mean_ttft_ms": ttft[0] * 1.1, "median_ttft_ms": ttft[0], "std_ttft_ms": 300.0,
        "p50_ttft_ms": ttft[0], "p99_ttft_ms": ttft[1],
        "mean_tpot_ms": 95.0, "median_tpot_ms": 90.0, "std_tpot_ms": 10.0, "p50_tpot_ms": 90.0, "p99_tpot_ms": 130.0,
        "mean_itl_ms": 92.0, "median_itl_ms": 88.0, "std_itl_ms": 20.0, "p50_itl_ms": 88.0, "p99_itl_ms": 200.0,
        "mean_e2el_ms": 4700.0, "median_e2el_ms": 4500.0, "std_e2el_ms": 500.0, "p50_e2el_ms": 4500.0,
        "p99_e2el_ms": 6100.0,
    }


def test_a_vllm_result_reads_into_the_summary():
    errs = [""] * 21 + ["Traceback ...\naiohttp.ClientResponseError: 503, message='Service Unavailable'"] * 2 + [
        "Bad Request"]
    s = summarize(_raw(completed=21, failed=3, errors=errs))
    assert (s["num_prompts"], s["completed"], s["failed"]) == (24, 21, 3)
    assert (s["ttft_p50_ms"], s["ttft_p99_ms"], s["tpot_p50_ms"]) == (1700.0, 2600.0, 90.0)
    assert (s["output_tok_s"], s["duration_s"], s["e2el_p50_ms"]) == (40.0, 13.2, 4500.0)
    assert s["errors"] == [{"error": "aiohttp.ClientResponseError: 503, message='Service Unavailable'", "count": 2},
                           {"error": "Bad Request", "count": 1}]
    # Without --save-detailed vLLM drops the per-request errors; the counts stay.
    raw = _raw()
    del raw["errors"]
    assert summarize(raw)["errors"] == [] and summarize(raw)["failed"] == 0


def test_the_goals_are_met_when_the_fleet_matches_vllm():
    vllm, fleet = summarize(_raw()), summarize(_raw(ttft=(1500.0, 2600.0), tok_s=38.0))  # 0.95x exactly
    got = {v.goal: v.met for v in verdicts(vllm, fleet)}
    assert got == {"served every request vLLM served": True, "TTFT p50 <= vLLM's": True,
                   "TTFT p99 <= vLLM's": True, "output tok/s >= 0.95x vLLM's": True}


def test_the_goals_are_not_met_when_the_fleet_falls_behind():
    vllm = summarize(_raw())
    fleet = summarize(_raw(completed=23, failed=1, ttft=(1800.0, 9000.0), tok_s=30.0))
    got = {v.goal: v for v in verdicts(vllm, fleet)}
    assert not any(v.met for v in got.values())
    assert "23 completed, 1 failed; vLLM 24, 0" in got["served every request vLLM served"].detail
    assert "(3.46x)" in got["TTFT p99 <= vLLM's"].detail and "(0.75x)" in got["output tok/s >= 0.95x vLLM's"].detail
    # Every request served, yet one failed where vLLM failed none: not met either.
    assert not verdicts(vllm, summarize(_raw(completed=24, failed=1)))[0].met
    # Where vLLM failed some too, the fleet only has to complete as many.
    assert verdicts(summarize(_raw(completed=22, failed=2)), summarize(_raw(completed=22, failed=2)))[0].met


def _results(**systems) -> dict:
    return {"started": "2026-12-02T10:15:00+00:00", "load": asdict(Load()), "cores": "0-1",
            "command": "vllm bench serve --backend openai", "systems": systems}


def test_the_report_has_each_system_the_ratios_and_the_verdicts():
    text = report(_results(**{"vllm-fcfs": summarize(_raw()),
                              "skyline-disagg": summarize(_raw(ttft=(1900.0, 2000.0), tok_s=39.0))}))
    assert "| vllm-fcfs | 24 of 24 | 0 | 1,700 | 2,600 |" in text
    assert "| skyline-disagg | 24 of 24 | 0 | 1,900 | 2,000 |" in text
    assert "## skyline-disagg against vllm-fcfs" in text and "| ratio | 1.12x | 0.77x | 1.00x | 0.97x |" in text
    assert "- TTFT p50 <= vLLM's: **NOT met** (1,900 vs 1,700 ms (1.12x))" in text
    assert "- TTFT p99 <= vLLM's: **met**" in text and "- output tok/s >= 0.95x vLLM's: **met**" in text
    assert "vllm bench serve --backend openai" in text


def test_the_report_says_when_a_system_did_not_run():
    text = report(_results(**{"vllm-fcfs": {"error": "TimeoutError: vllm-fcfs not ready after 600s"},
                              "skyline-disagg": summarize(_raw())}))
    assert "| vllm-fcfs | did not run |" in text and "TimeoutError: vllm-fcfs not ready" in text
    assert "No ratios or goals: the baseline, vllm-fcfs, did not run." in text and "met**" not in text


def test_unknown_systems_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit, match="unknown vllm-fcfz"):
        cli.main(["bench", "vllm-client", "--systems", "vllm-fcfz", "--out", str(tmp_path)])


def test_end_to_end_on_a_sim_fleet(tmp_path, capsys):
    """The subcommand as a user runs it, against the disaggregated fleet on the sim engine."""
    out = tmp_path / "run"
    cli.main(["bench", "vllm-client", "--systems", "sim-disagg", "--num-prompts", "4", "--rate", "8",
              "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    s = results["systems"]["sim-disagg"]
    assert "error" not in s, s.get("error")
    assert (s["completed"], s["failed"], s["errors"]) == (4, 0, [])
    assert s["ttft_p50_ms"] > 0 and s["output_tok_s"] > 0
    raw = json.loads((out / "sim-disagg.json").read_text())  # vLLM's own file, kept beside
    assert raw["completed"] == 4 and raw["num_prompts"] == 4
    report_md = (out / "report.md").read_text()
    assert "| sim-disagg | 4 of 4 | 0 |" in report_md
    assert "| sim-disagg | 4 of 4 | 0 |" in capsys.readouterr().out  # printed as well
    assert Path(out / "logs" / "sim-disagg-client.log").exists()


def test_aiperf_sends_the_same_load_and_its_summary_reads_into_the_same_figures(tmp_path):
    from skyline.tools.bench import aiperf_client

    load = Load(input_len=1024, output_len=64, num_prompts=32, rate=1.0, seed=7, endpoint="chat",
                headers=("x-skyline-route=colocated",))
    flags = aiperf_client.flags("http://127.0.0.1:9", "m", "/models/smol", load, tmp_path / "a")
    assert flags[0] == "profile" and _flag(flags, "--endpoint-type") == "chat" and "--streaming" in flags
    assert (_flag(flags, "--isl"), _flag(flags, "--isl-stddev"), _flag(flags, "--osl")) == ("1024", "0", "64")
    assert (_flag(flags, "--request-rate"), _flag(flags, "--request-count"), _flag(flags, "--random-seed")) == \
        ("1.0", "32", "7")
    assert _flag(flags, "--arrival-pattern") == "poisson" and _flag(flags, "--extra-inputs") == "ignore_eos:true"
    assert _flag(flags, "--header") == "x-skyline-route:colocated"
    assert _flag(aiperf_client.flags("u", "m", "t", Load(), tmp_path), "--endpoint-type") == "completions"
    # A summary aiperf 0.13 wrote (a sim fleet, 8 requests; trimmed to the keys read).
    raw = json.loads((Path(__file__).parent / "data" / "aiperf-0.13-summary.json").read_text())
    s = aiperf_client.summarize(raw, 10)
    assert (s["completed"], s["failed"], s["errors"]) == (8, 2, [])
    assert s["ttft_p50_ms"] == raw["time_to_first_token"]["p50"] and s["ttft_p99_ms"] == raw["time_to_first_token"]["p99"]
    assert s["tpot_p50_ms"] == raw["inter_token_latency"]["p50"]
    assert s["output_tok_s"] == raw["output_token_throughput"]["avg"]
    assert verdicts(s, s)[0].met  # the same keys the verdicts read
    failed = dict(raw, completed_request_count={"avg": 6.0},
                  error_summary=[{"error_details": {"code": 429, "message": "queue full"}, "count": 2}])
    assert aiperf_client.summarize(failed, 8)["errors"] == [{"error": '{"code": 429, "message": "queue full"}',
                                                            "count": 2}]
    assert aiperf_client.read(tmp_path / "missing", 8) is None
    with pytest.raises(SystemExit, match="aiperf"):
        aiperf_client.executable(str(tmp_path / "no-such-aiperf"))
