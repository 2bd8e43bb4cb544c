"""`skyline bench run --workload lora`: the adapters each request names, the loads counted, and a run
end to end on two sim fleets (adapter-blind and adapter-aware placement), real processes and Redis."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from skyline.cli import build_parser
from skyline.tools.bench import lora
from skyline.tools.bench.run import Bench
from skyline.tools.bench.workload import BenchRequest

SYSTEMS = ["sim-lora-blind", "sim-lora-aware"]


def _requests(n: int) -> list[BenchRequest]:
    return [BenchRequest(i, "chat", "interactive", i * 0.1, f"q{i}", 10, 4) for i in range(n)]


def test_requests_name_adapters_by_zipf_popularity_the_same_for_every_system():
    spec = lora.LoraSpec(adapters=8, zipf=1.0)
    weights = lora.zipf_weights(8, 1.0)
    assert sum(weights) == pytest.approx(1.0) and weights == sorted(weights, reverse=True)
    assert weights[0] / weights[1] == pytest.approx(2.0) and lora.zipf_weights(4, 0.0) == [0.25] * 4
    reqs = _requests(4000)
    named = lora.assign(reqs, spec, seed=0, stream="1")
    assert named == lora.assign(reqs, spec, seed=0, stream="1")  # seeded: every system gets the same
    assert [r.adapter for r in named] != [r.adapter for r in lora.assign(reqs, spec, seed=0, stream="2")]
    assert [(r.index, r.content, r.send_at) for r in named] == [(r.index, r.content, r.send_at) for r in reqs]
    counts = Counter(r.adapter for r in named)
    for name, w in zip(lora.adapter_names(8), weights):
        assert counts[name] / len(named) == pytest.approx(w, abs=0.03), name


def test_weight_opens_count_each_open_of_an_adapters_weights_by_any_process(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
        (d / lora.WEIGHTS).write_bytes(b"w")
        (d / "adapter_config.json").write_text("{}")
    opens = lora.WeightOpens([str(d) for d in dirs])
    try:
        assert opens.read() == 0
        for d in (dirs[0], dirs[1], dirs[0]):
            (d / lora.WEIGHTS).read_bytes()
        (dirs[0] / "adapter_config.json").read_text()  # a config read is no load
        assert opens.read() == 3
        (dirs[1] / lora.WEIGHTS).read_bytes()
        assert opens.read() == 4
    finally:
        opens.close()


def test_the_lora_workload_takes_the_lora_systems_only(tmp_path):
    def bench(*argv):
        return Bench(build_parser().parse_args(["bench", "run", *argv, "--out", str(tmp_path)]))

    with pytest.raises(SystemExit, match="sim-colocated"):
        bench("--workload", "lora", "--systems", "sim-colocated,sim-lora-aware")
    with pytest.raises(SystemExit, match="sim-lora-aware"):
        bench("--systems", "sim-lora-aware")
    assert [s.name for s in bench("--workload", "lora").systems] == ["vllm-lora-rr", "skyline-lora-blind",
                                                                     "skyline-lora-aware"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-lora")
    args = build_parser().parse_args([
        "bench", "run", "--workload", "lora", "--systems", ",".join(SYSTEMS), "--rates", "4", "--duration", "4",
        "--drain", "20", "--mix", "0.75", "--warmup", "1", "--chat-prompt", "40-200", "--rag-prompt", "600-1000",
        "--chat-output", "4-12", "--rag-output", "4-12", "--slo-ttft-ms", "chat=3000,rag=8000", "--slo-tpot-ms",
        "1000", "--out", str(out), "--start-timeout", "180"])
    return Bench(args).run(), out


def test_a_lora_run_serves_every_adapter_request_and_reports_the_loads(bench_run):
    (results, files), out = bench_run
    assert {s: v["status"] for s, v in results["systems"].items()} == {s: "ok" for s in SYSTEMS}
    assert results["config"]["workload"]["kind"] == "lora"
    assert results["config"]["workload"]["lora"] == {"adapters": 8, "zipf": 1.0}
    names = set(lora.adapter_names(8))
    by_system = {s: [r for r in results["records"] if r["system"] == s] for s in SYSTEMS}
    assert [r["adapter"] for r in by_system[SYSTEMS[0]]] == [r["adapter"] for r in by_system[SYSTEMS[1]]]
    for system, records in by_system.items():
        assert len(records) == 16 and {r["adapter"] for r in records} <= names
        assert all(r["outcome"] == "ok" for r in records), [r["error"] for r in records if r["outcome"] != "ok"]
    for run in results["runs"]:
        loads = run["summary"]["adapters"]
        assert loads["counted"] == "workers" and loads["loads"] >= 1  # 2 slots per engine, 8 adapters
        assert loads["loads_per_min"] == pytest.approx(loads["loads"] / run["summary"]["duration_s"] * 60)
    report = (out / "report.md").read_text()
    assert "adapter loads | loads/min |" in report and "Each request names one of 8 LoRA adapters" in report
    # The goals, judged for the adapter-aware system against the others at each rate.
    assert "| fewest adapter loads at 4 req/s | sim-lora-aware |" in report
    assert "| highest SLO attainment at 4 req/s | sim-lora-aware |" in report
    assert "| output tok/s vs plain vLLM at 4 req/s | sim-lora-aware | - | >= 0.95x | can't tell |" in report
    assert sorted(p.name for p in (out / "adapters" / "sim").iterdir()) == sorted(names)
    assert json.loads((out / "adapters" / "sim" / "lora-0" / "adapter_config.json").read_text())["r"] == 8
