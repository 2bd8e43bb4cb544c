"""NVIDIA's `aiperf` as the load generator of `skyline bench vllm-client --client aiperf`.

Issue 33 asks for the default fleet measured with one more load generator nobody here wrote, beside
vLLM's own. aiperf runs from its own environment (its dependencies pin versions that vLLM's do not
accept): install it with `python -m venv ~/aiperf && ~/aiperf/bin/pip install aiperf==0.13.0` and
pass `--aiperf ~/aiperf/bin/aiperf` (default: `aiperf` on PATH).

The same load as vLLM's client: synthetic prompts of exactly `input_len` tokens (its standard
deviation 0), `output_len` tokens each with `ignore_eos` (so every system generates the same tokens),
Poisson arrivals at `rate`, `num_prompts` requests, one seed. aiperf tokenizes with the served
model's own tokenizer and counts output tokens from the text it received. Its figures keep aiperf's
definitions: TTFT, inter-token latency (reported in the TPOT column, as vLLM's TPOT is the mean gap
between a request's tokens), request latency, output token throughput.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

RESULT_FILE = "profile_export_aiperf.json"  # aiperf's summary, in its --output-artifact-dir


def executable(given: str | None) -> str:
    """The aiperf program to run: `given`, else the one on PATH; a clear error when there is none."""
    path = given or shutil.which("aiperf")
    if not path or not (shutil.which(path) or Path(path).is_file()):
        raise SystemExit(f"--client aiperf: no aiperf program {'at ' + given if given else 'on PATH'}; install it in a "
                         "venv of its own (python -m venv ~/aiperf && ~/aiperf/bin/pip install aiperf==0.13.0) "
                         "and pass --aiperf ~/aiperf/bin/aiperf")
    return path


def flags(url: str, model: str, tokenizer: str, load: Any, artifact_dir: Path) -> list[str]:
    """`aiperf profile`'s flags for one system (`load`: vllm_client.Load)."""
    out = [
        "profile", "--model", model, "--url", url, "--endpoint-type", "chat" if load.endpoint == "chat" else "completions",
        "--streaming", "--tokenizer", tokenizer,
        "--isl", str(load.input_len), "--isl-stddev", "0", "--osl", str(load.output_len), "--osl-stddev", "0",
        "--request-rate", str(load.rate), "--arrival-pattern", "poisson", "--request-count", str(load.num_prompts),
        "--random-seed", str(load.seed), "--output-artifact-dir", str(artifact_dir),
        # No TUI (the output goes to a log), no Prometheus scraping of the server, no GPU telemetry.
        "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
    ]
    if load.ignore_eos:
        out += ["--extra-inputs", "ignore_eos:true"]
    for h in load.headers:
        name, _, value = h.partition("=")
        out += ["--header", f"{name}:{value}"]
    return out


def _stat(raw: dict, key: str, field: str) -> float | None:
    value = (raw.get(key) or {}).get(field)
    return float(value) if value is not None else None


def summarize(raw: dict, num_prompts: int) -> dict:
    """One system's figures from aiperf's summary JSON, under the keys vllm_client.summarize uses."""
    completed = int(_stat(raw, "completed_request_count", "avg") or _stat(raw, "request_count", "avg") or 0)
    errors = []
    for e in raw.get("error_summary") or []:
        detail = e.get("error_details") if isinstance(e, dict) else None
        text = json.dumps(detail if detail is not None else e, sort_keys=True)[:300]
        errors.append({"error": text, "count": int(e.get("count", 1)) if isinstance(e, dict) else 1})
    return {
        "num_prompts": num_prompts,
        "completed": completed,
        "failed": num_prompts - completed,
        "errors": errors,
        "ttft_p50_ms": _stat(raw, "time_to_first_token", "p50"),
        "ttft_p99_ms": _stat(raw, "time_to_first_token", "p99"),
        "tpot_p50_ms": _stat(raw, "inter_token_latency", "p50"),
        "tpot_p99_ms": _stat(raw, "inter_token_latency", "p99"),
        "itl_p50_ms": _stat(raw, "inter_token_latency", "p50"),
        "e2el_p50_ms": _stat(raw, "request_latency", "p50"),
        "output_tok_s": _stat(raw, "output_token_throughput", "avg"),
        "request_s": _stat(raw, "request_throughput", "avg"),
        "total_output_tokens": _stat(raw, "total_output_tokens", "avg"),
        "duration_s": _stat(raw, "benchmark_duration", "avg"),
    }


def read(artifact_dir: Path, num_prompts: int) -> dict | None:
    path = artifact_dir / RESULT_FILE
    return summarize(json.loads(path.read_text()), num_prompts) if path.exists() else None
