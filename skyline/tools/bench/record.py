"""One benchmark request as the report keeps it: what was sent, what came back, and its verdict.

Metric definitions follow `vllm bench serve` (so numbers compare with it):
  TTFT     first streamed content chunk - send time
  latency  last byte of the response - send time (end-to-end)
  TPOT     (latency - TTFT) / (output tokens - 1); 0 for a 1-token output
  ITL      gaps between consecutive content chunks (a chunk may carry more
           than one token when a server batches its stream frames)
Output tokens are the server's own count (usage, stream_options.include_usage).

Outcomes, counted separately: ok; rejected (HTTP 429, admission control
shedding); error (any other HTTP status, transport error, or error frame);
cancelled (still running when the run's drain deadline passed). Only an ok
request can attain its SLO: a request attains when TTFT <= its TTFT target
and TPOT <= its TPOT target (DistServe's definition).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from skyline.tools.bench.client import RequestRecord
from skyline.tools.bench.verdict import attains, tpot
from skyline.tools.bench.workload import BenchRequest

OUTCOMES = ("ok", "rejected", "error", "cancelled")


@dataclass
class BenchRecord:
    system: str
    rate: float
    index: int
    cls: str
    tier: str
    prompt_tokens: int  # as built (chat template included)
    max_tokens: int
    send_at: float  # scheduled send time, s after the run started
    sent_s: float = 0.0  # actual send time, s after the run started
    outcome: str = "error"
    http_status: int = 0
    error: str = ""
    server_prompt_tokens: int = 0  # the server's usage.prompt_tokens
    output_tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    ttft_target_ms: float = 0.0
    tpot_target_ms: float = 0.0
    attained: bool = False
    skyline: dict = field(default_factory=dict)  # the gateway's response extension, when present
    # Prompt tokens served from the prefix cache, as the server says (Skyline: skyline.kv_transfer.
    # num_cached_tokens; vLLM: usage.prompt_tokens_details.cached_tokens); None: it does not say.
    cached_tokens: int | None = None
    oracle_cached_tokens: int | None = None  # what one infinite cache would have served (oracle.py)
    session: int = -1  # the multi-turn workload's session and turn (skyline.tools.bench.multiturn)
    turn: int = 0
    adapter: str = ""  # the LoRA adapter it named (the lora workload); "" = the base model

    def to_dict(self) -> dict:
        return asdict(self)


def outcome_of(rec: RequestRecord) -> str:
    if rec.status == 429:
        return "rejected"
    if rec.ok and not rec.error:
        return "ok"
    return "error"


def itls(chunk_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def build_record(system: str, rate: float, req: BenchRequest, sent_s: float, rec: RequestRecord | None,
                 targets_ms: tuple[float, float]) -> BenchRecord:
    """Join what was sent with what came back; `rec` None means cancelled at the drain deadline."""
    out = BenchRecord(system, rate, req.index, req.cls, req.tier, req.prompt_tokens, req.max_tokens, req.send_at,
                      sent_s=sent_s, ttft_target_ms=targets_ms[0], tpot_target_ms=targets_ms[1],
                      session=req.session, turn=req.turn, adapter=req.adapter)
    if rec is None:
        out.outcome, out.error = "cancelled", "still running at the drain deadline"
        return out
    out.outcome, out.http_status, out.error = outcome_of(rec), rec.status, rec.error
    out.skyline = rec.skyline
    if out.outcome == "ok" and not rec.chunk_times:
        # A 200 with no content streamed has no TTFT; counting it as instant would flatter the server.
        out.outcome, out.error = "error", "response streamed no content"
    if out.outcome == "ok":
        out.server_prompt_tokens, out.output_tokens = rec.prompt_tokens, rec.output_tokens
        out.ttft_s, out.latency_s = rec.ttft_s, rec.latency_s
        out.tpot_s = tpot(rec.latency_s, rec.ttft_s, rec.output_tokens)
        out.itl_s = itls(rec.chunk_times)
        out.attained = attains(out.outcome, out.ttft_s, out.tpot_s, *targets_ms)
        out.cached_tokens = cached_tokens(rec)
    return out


def cached_tokens(rec: RequestRecord) -> int | None:
    """Prompt tokens the server's prefix cache served: Skyline's extension, else OpenAI usage details.
    None for a prompt a prefill worker computed: the decode engine counts the KV it pulled as cached,
    and the response does not say what the prefill engine's cache served."""
    kv = rec.skyline.get("kv_transfer") or {}
    if kv.get("remote_prefill"):
        return None
    if kv.get("num_cached_tokens") is not None:
        return int(kv["num_cached_tokens"])
    return rec.cached_tokens
