"""One simulated request: what was sent, its Skyline SLO, and what happened to it.

Its result attributes carry the names of `skyline.tools.bench.record.BenchRecord`
(outcome, ttft_s, tpot_s, latency_s, itl_s, attained, ...), so
`skyline.tools.bench.metrics.summarize` reads simulated requests as it reads
measured ones: one definition of every metric for both.
"""

from __future__ import annotations

from skyline.tools.bench.record import BenchRecord
from skyline.tools.bench.verdict import attains, tpot


class SimRequest:
    __slots__ = (
        # what was sent (as a BenchRequest)
        "index", "cls", "send_at", "prompt_tokens", "max_tokens", "ttft_target_ms", "tpot_target_ms",
        # prompt tokens the engine finds in its prefix cache (a replayed trace's measured hits; else 0)
        "cached_tokens",
        "oracle_cached_tokens",  # as BenchRecord's (bench/oracle.py): a replayed trace's, else None
        # Its prefix identity (None: a prompt that shares nothing, the single-turn workloads): the block
        # chain (scheduler/prefix.py) of its prompt followed by its answer, and how many of those blocks
        # are the prompt's; a multi-turn session's next turn (sent a think time after this one ends).
        "chain", "prompt_blocks", "session", "turn", "next_turn", "think_s",
        # prompt tokens the gateway counted as left to compute (admission's backlog), and the worker it
        # placed the request for (None: the shared queue) with the bound of that wait (virtual ms)
        "backlog_tokens", "placed_for", "until_ms",
        # Skyline's view: tier after SLO resolution (and demotion), deadline, route
        "tier", "rank", "priority", "deadline", "route", "preemptions", "decision", "model_ttft_ms", "tpot_ms",
        # the worker whose engine computed its prompt, when it handed the KV on ("" otherwise)
        "prefilled_by",
        # timeline (virtual seconds)
        "prefill_start", "prefill_end", "first_t", "done_t", "itl_s",
        # verdict, named as in BenchRecord
        "outcome", "output_tokens", "ttft_s", "tpot_s", "latency_s", "attained", "server_prompt_tokens",
        "requested_tier",
    )

    def __init__(self, index: int, cls: str, tier: str, send_at: float, prompt_tokens: int, max_tokens: int,
                 ttft_target_ms: float, tpot_target_ms: float):
        self.index, self.cls, self.requested_tier, self.send_at = index, cls, tier, send_at
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.ttft_target_ms, self.tpot_target_ms = ttft_target_ms, tpot_target_ms
        self.tier, self.rank, self.priority, self.deadline = tier, 0, 0, 0.0
        self.route, self.preemptions, self.decision = "", 0, ""
        self.model_ttft_ms: float | None = 0.0
        self.tpot_ms = 0  # the resolved SLO's TPOT target (what the live request carries)
        self.prefill_start = self.prefill_end = self.first_t = self.done_t = 0.0
        self.itl_s: list[float] | tuple = ()  # gaps between tokens, filled only when the run records them
        self.outcome, self.output_tokens, self.attained = "cancelled", 0, False
        self.ttft_s = self.tpot_s = self.latency_s = 0.0
        self.server_prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.oracle_cached_tokens: int | None = None
        self.chain: tuple[str, ...] | None = None
        self.prompt_blocks = 0
        self.session: int | None = None
        self.turn: int | None = None
        self.next_turn: SimRequest | None = None
        self.think_s = 0.0
        self.backlog_tokens = prompt_tokens
        self.prefilled_by = ""
        self.placed_for: str | None = None
        self.until_ms = 0

    def resent(self) -> SimRequest:
        """The same request, not yet served (to replay one trace on several fleets)."""
        req = SimRequest(self.index, self.cls, self.requested_tier, self.send_at, self.prompt_tokens, self.max_tokens,
                         self.ttft_target_ms, self.tpot_target_ms)
        req.cached_tokens = self.cached_tokens
        req.oracle_cached_tokens = self.oracle_cached_tokens
        req.chain, req.prompt_blocks, req.session, req.turn = self.chain, self.prompt_blocks, self.session, self.turn
        req.think_s = self.think_s
        req.next_turn = self.next_turn.resent() if self.next_turn is not None else None
        return req

    @property
    def skyline(self) -> dict:
        """The part of a bench record's `skyline` block the bench's summary reads (`metrics.routes`)."""
        return {"route": self.route}

    def finish(self, overhead_s: float) -> None:
        """Verdict once the last token is out; `overhead_s` is the fleet's own hops (gateway, Redis, pub/sub)."""
        self.outcome = "ok"
        self.output_tokens = self.max_tokens  # ignore_eos, as the benchmark sends
        self.ttft_s = self.first_t - self.send_at + overhead_s
        self.latency_s = self.done_t - self.send_at + overhead_s
        self.tpot_s = tpot(self.latency_s, self.ttft_s, self.output_tokens)
        self.attained = attains("ok", self.ttft_s, self.tpot_s, self.ttft_target_ms, self.tpot_target_ms)

    def to_record(self, system: str, rate: float) -> BenchRecord:
        rec = BenchRecord(system, rate, self.index, self.cls, self.requested_tier, self.prompt_tokens, self.max_tokens,
                          self.send_at, sent_s=self.send_at, outcome=self.outcome,
                          http_status={"ok": 200, "rejected": 429}.get(self.outcome, 0),
                          ttft_target_ms=self.ttft_target_ms, tpot_target_ms=self.tpot_target_ms,
                          cached_tokens=self.cached_tokens, oracle_cached_tokens=self.oracle_cached_tokens,
                          session=-1 if self.session is None else self.session, turn=self.turn or 0)
        if self.outcome == "rejected":
            rec.error = f"simulated 429: {self.decision}"
        elif self.outcome == "cancelled":
            rec.error = "still running at the drain deadline"
        if self.outcome == "ok":
            rec.server_prompt_tokens, rec.output_tokens = self.prompt_tokens, self.output_tokens
            rec.ttft_s, rec.tpot_s, rec.latency_s, rec.itl_s = self.ttft_s, self.tpot_s, self.latency_s, list(self.itl_s)
            rec.attained = self.attained
        rec.skyline = {"tier": self.tier, "route": self.route, "preemptions": self.preemptions,
                       "admission": self.decision or "admit",
                       "timings": {"queue_ms": round((self.prefill_start - self.send_at) * 1000, 1),
                                   "prefill_ms": round((self.prefill_end - self.prefill_start) * 1000, 1)}}
        return rec
