"""`skyline bench run` end to end on two sim fleets: the report files are complete and consistent.

Real processes (Redis, gateway, workers on the `sim` engine), two rates of a
few seconds each. Asserts what a reader of the report relies on: every sent
request is in results.json exactly once with one outcome, the counts add up,
both systems saw the same requests at the same times, and the Markdown table
and the plots exist.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from skyline.cli import build_parser
from skyline.tools.bench.run import Bench

SYSTEMS = ["sim-colocated", "sim-disagg"]
RATES = [2.0, 4.0]
DURATION_S = 2.0


def _reject_nan(token: str):
    raise ValueError(f"results.json is not strict JSON: {token}")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    config = out / "skyline.toml"  # the Skyline systems' own config file: every process must read it
    config.write_text('[engine]\nserved_model_name = "bench-sim"\n')
    args = build_parser().parse_args([
        "bench", "run", "--systems", ",".join(SYSTEMS), "--rates", ",".join(map(str, RATES)),
        "--skyline-config", str(config),
        "--duration", str(DURATION_S), "--drain", "15", "--mix", "0.5", "--warmup", "1",
        "--chat-prompt", "40-200", "--rag-prompt", "600-1200", "--chat-output", "4-16", "--rag-output", "4-16",
        # Explicit targets: no unloaded probe needed, and loose enough for a busy test machine.
        "--slo-ttft-ms", "chat=3000,rag=8000", "--slo-tpot-ms", "1000", "--out", str(out), "--start-timeout", "60",
    ])
    results, files = Bench(args).run()
    return results, files, out


def test_report_files_are_written(bench_run):
    results, files, out = bench_run
    names = {f.name for f in files}
    assert names == {"results.json", "report.md", "attainment_vs_rate.png", "ttft_cdf_by_tier.png",
                     "throughput_vs_rate.png"}
    for f in files:
        assert f.parent == out and f.stat().st_size > 0
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads((out / "results.json").read_text(), parse_constant=_reject_nan)
    assert on_disk["runs"] == results["runs"]
    assert {s: v["status"] for s, v in results["systems"].items()} == {s: "ok" for s in SYSTEMS}
    assert {v["model"] for v in results["systems"].values()} == {"bench-sim"}  # --skyline-config reached them
    assert any((out / "logs").glob("sim-disagg-prefill-*.log"))


def test_every_request_is_accounted_for(bench_run):
    results, _, _ = bench_run
    records = results["records"]
    assert len(results["runs"]) == len(SYSTEMS) * len(RATES)
    for run in results["runs"]:
        s = run["summary"]
        mine = [r for r in records if r["system"] == run["system"] and r["rate"] == run["rate"]]
        assert s["sent"] == len(mine) == round(run["rate"] * DURATION_S)
        assert sorted(r["index"] for r in mine) == list(range(s["sent"]))  # each request exactly once
        by_outcome = Counter(r["outcome"] for r in mine)
        assert {k: s[k] for k in ("ok", "rejected", "error", "cancelled")} == {
            k: by_outcome.get(k, 0) for k in ("ok", "rejected", "error", "cancelled")}
        assert s["ok"] + s["rejected"] + s["error"] + s["cancelled"] == s["sent"]
        assert s["attained"] == sum(r["attained"] for r in mine) <= s["ok"]
        assert sum(t["sent"] for t in s["by_tier"].values()) == s["sent"]
        assert s["output_tokens"] == sum(r["output_tokens"] for r in mine if r["outcome"] == "ok")
        for r in mine:
            if r["outcome"] == "ok":
                assert r["output_tokens"] == r["max_tokens"]  # ignore_eos: exactly as asked
                assert r["ttft_s"] <= r["latency_s"] and len(r["itl_s"]) >= 1 and r["skyline"]
    assert sum(run["summary"]["ok"] for run in results["runs"]) > 0


def test_systems_saw_the_same_requests_at_the_same_times(bench_run):
    results, _, _ = bench_run
    for rate in RATES:
        seen = [[(r["index"], r["cls"], r["tier"], r["prompt_tokens"], r["max_tokens"], r["send_at"])
                 for r in results["records"] if r["system"] == s and r["rate"] == rate] for s in SYSTEMS]
        assert seen[0] == seen[1]
        assert {c for _, c, *_ in seen[0]} == {"chat", "rag"}


def test_markdown_table_has_a_row_per_run(bench_run):
    results, _, out = bench_run
    md = (out / "report.md").read_text()
    for run in results["runs"]:
        assert f"| {run['system']} | {run['rate']:g} | {run['summary']['sent']} |" in md
    assert "TPOT = (latency - TTFT) / (output tokens - 1)" in md and "vllm bench serve" in md
    assert "explicit options" in md and set(results["goodput"]) == set(SYSTEMS)
