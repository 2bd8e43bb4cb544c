"""Decode room by TPOT: claim new work only while the streams already running keep their pace.

Every sequence a decode engine takes on makes each of its steps longer, and
a prompt it computes itself (colocated route) puts prefill chunks into the
steps of every stream it runs. The KV watermark bounds memory, not time: a
worker holding as many streams as its cache fits can run each far slower than
its TPOT target and miss nearly every SLO. So a
decode worker also stops claiming while the recent time per token of its
streams is above `headroom` x the tightest TPOT target among them. The
backlog then waits in Redis, where admission control sees it and sheds
(429) what cannot be served in time, and any other decode worker can take it.

"Recent" is a 10 s window on purpose: TPOT targets bound an answer's mean
time per token, which a prompt prefilled alongside raises only while its
chunks run (a few steps, even for a long RAG prompt); a short window would
stop claims at every long prompt and leave the chats behind it waiting in the
stream. Sustained overload (a batch too large for the targets) shows in a 10 s
mean; a burst of chunks does not.

The rule holds a request back no longer than its latest start (`paced_claim_due`,
scheduler/edf.py `start_by_ms`): past it, a request left waiting misses its TTFT
target for certain, while the streams it would join may still keep theirs. With
every engine of a fleet paced out (the mixed chat + RAG benchmark at 0.8 req/s on
two one-core elastic engines), the queue otherwise waited for a stream to finish
and RAG prompts 4-12 s past their start: attainment 27% with the rule as it was,
47% without the rule at all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class TokenPaceMeter:
    """Seconds per output token over the streams of one worker, in a sliding time window."""

    window_s: float = 10.0
    _gaps: deque[tuple[float, float, int]] = field(default_factory=deque)  # (at_s, seconds, tokens)
    _seconds: float = 0.0  # running sums over _gaps: asked on every claim, so O(1)
    _tokens: int = 0

    def record(self, at_s: float, gap_s: float, tokens: int) -> None:
        """A chunk of `tokens` tokens arrived `gap_s` after the same stream's previous one."""
        if tokens > 0 and gap_s >= 0:
            self._gaps.append((at_s, gap_s, tokens))
            self._seconds += gap_s
            self._tokens += tokens
            if len(self._gaps) > 256:  # reads expire the window; this bounds a meter nobody reads
                self._expire(at_s)

    def seconds_per_token(self, now_s: float) -> float | None:
        """Token-weighted mean over the window; None when no stream produced tokens in it."""
        self._expire(now_s)
        return self._seconds / self._tokens if self._tokens else None

    def _expire(self, now_s: float) -> None:
        gaps = self._gaps
        while gaps and gaps[0][0] < now_s - self.window_s:
            _at, g, n = gaps.popleft()
            self._seconds -= g
            self._tokens -= n
        if not gaps:
            self._seconds, self._tokens = 0.0, 0  # no float drift carried across idle periods


def pace_allows(seconds_per_token: float | None, tightest_tpot_ms: float | None, headroom: float) -> bool:
    """The pace rule's verdict for a worker holding two requests or more: its streams' recent time per
    token under `headroom` x the tightest TPOT target it holds. `headroom` <= 0 disables the check;
    no measurement or no target: allowed. (The claim rule, scheduler/claiming.py, lets a worker holding
    fewer than two requests claim whatever this says.)"""
    if headroom <= 0 or seconds_per_token is None or tightest_tpot_ms is None:
        return True
    return seconds_per_token * 1000.0 < headroom * tightest_tpot_ms


def tpot_room(seconds_per_token: float | None, tightest_tpot_ms: float | None, headroom: float, held: int) -> bool:
    """May a worker holding `held` requests whose streams run at `seconds_per_token` claim more?

    A worker holding fewer than two requests always may: a lone stream slower than its target is the
    engine's speed, not company it could refuse, and refusing would only serialise the requests behind
    it. Otherwise `pace_allows`."""
    return held < 2 or pace_allows(seconds_per_token, tightest_tpot_ms, headroom)


def tightest_target_ms(held: Iterable[tuple[int, bool]]) -> int | None:
    """The TPOT target the pace rule holds a worker's streams to, of (tpot_ms, best_effort) per request it
    holds: the tightest of those that asked for an SLO; None when none did. A request that asked for none
    carries its tier's TPOT only as a default: holding the engine's pace to it would leave prefill capacity
    idle while prompts wait, where `vllm serve` takes them."""
    return min((tpot for tpot, best_effort in held if not best_effort), default=None)


def paced_claim_due(start_by_ms: int, now_ms: int) -> bool:
    """May a worker the pace rule holds back (`pace_allows` False, every other limit open) claim a head that
    must start by `start_by_ms` to meet its TTFT deadline? Only once that time has come."""
    return start_by_ms <= now_ms
