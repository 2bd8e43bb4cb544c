"""A performance model for simulator tests whose every figure is a hand-checkable constant."""

from __future__ import annotations

from skyline.tools.simulate.perf import PerfModel


class HandModel(PerfModel):
    """Prefill at `prefill_tokens_per_s` in steps of up to `max_step_tokens`; a decode step costs
    `step_s` + `s_per_context_token` x the batch's KV tokens; a mixed step is the sum of the two;
    KV transfer is free."""

    kv_capacity_tokens = 1_000_000

    def __init__(self, name: str, prefill_tokens_per_s: float, max_step_tokens: int = 100_000, step_s: float = 0.1,
                 s_per_context_token: float = 0.0):
        self.name, self.prefill_tokens_per_s, self.max_step_tokens = name, prefill_tokens_per_s, max_step_tokens
        self.step_s, self.s_per_context_token = step_s, s_per_context_token

    def prefill_step_s(self, chunks):
        return sum(n for _, n in chunks) / self.prefill_tokens_per_s

    def decode_coeffs(self, batch, context):
        return self.step_s, self.s_per_context_token

    def mixed_step_s(self, chunks, batch, context):
        return self.prefill_step_s(chunks) + self.decode_step_s(batch, context)

    def kv_transfer_s(self, tokens):
        return 0.0
