"""A request's TPOT and SLO verdict: the two rules every bench record and simulated request applies.

A module of its own so that the compiled simulator (skyline/tools/simulate/native.py) compiles
them with the request that calls them once per request, rather than calling into Python.
"""

from __future__ import annotations


def tpot(latency_s: float, ttft_s: float, output_tokens: int) -> float:
    """vLLM's TPOT: decode time spread over the tokens after the first."""
    return (latency_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else 0.0


def attains(outcome: str, ttft_s: float, tpot_s: float, ttft_target_ms: float, tpot_target_ms: float) -> bool:
    return outcome == "ok" and ttft_s * 1000 <= ttft_target_ms and tpot_s * 1000 <= tpot_target_ms
