"""Fleet-level preemption: abort a running low-tier prefill for a request that would be late.

vLLM's own priority scheduling (`--scheduling-policy priority`) does not help
a waiting high-priority prompt while lower-priority prompts already hold the
step's token budget: it waits until they are done. So the prefill worker holds
few prompts at a time, and when the head of a stricter tier would miss its
deadline waiting for them, the least urgent ones are aborted and re-queued with
their original arrival times (same deadlines: EDF brings them back in turn).

Starvation is bounded twice: a request is preempted at most
`max_preemptions` times, and its deadline keeps its place in EDF order.

A prompt past its own latest start (its deadline less its whole prompt at the
worker's rate, scheduler/edf.py `start_by_ms`) is not aborted: recomputed from
the queue it would miss its deadline for certain, and the work done on it would
be lost; kept, it may still make it. Measured on the mixed chat + RAG benchmark
at 0.8 req/s (two one-core elastic engines): 23 aborts, every one of a RAG
prompt for a chat, and the RAG prompts aborted were the ones that waited 2-13 s
and missed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from skyline.scheduler.edf import start_by_ms


@dataclass(frozen=True)
class Running:
    request_id: str
    tier_rank: int  # 0 = strictest tier
    deadline_ms: int
    remaining_tokens: int  # prompt tokens still to prefill (estimate)
    preemptions: int  # times this request was already preempted


@dataclass(frozen=True)
class Waiting:
    tier_rank: int
    deadline_ms: int
    prompt_tokens: int


@dataclass(frozen=True)
class PreemptionPolicy:
    enabled: bool = True
    max_preemptions: int = 2
    # The engine's step shape (vLLM max_num_batched_tokens and long_prefill_token_threshold);
    # 0 = unknown: every running prompt then delays the head by all of its remaining work.
    step_tokens: int = 0
    prefill_cap: int = 0
    # Prompt tokens of a step that holds only looser-tier prompts (scheduler/step_budget.py); 0 = full steps.
    background_tokens: int = 0
    # The engine holds looser-tier prompts back while a strictest-tier prompt computes
    # (scheduler/step_budget.py): in the engine, such a request waits only for the step in
    # progress, which no abort shortens, so aborting for it buys nothing but a recompute.
    holds_background: bool = False


def tokens_until_done(ahead: list[int], head_tokens: int, step_tokens: int = 0, cap: int = 0,
                      in_progress: int = 0) -> int:
    """Prompt tokens the engine computes until a waiting prompt of `head_tokens` is done,
    behind running prompts with `ahead` tokens left, stepping as vLLM does: each step
    gives its `step_tokens` budget to the running prompts first, in order, then to the
    newcomer, each taking at most `cap` tokens while more than one is left (vLLM lifts the
    cap for a request alone). Without a cap that is all of `ahead` plus the head; with
    one the head shares the steps (e.g. 128 + 128 of a 256-token step) after the step in
    progress, which the running prompts fill (counted as a whole one: the head joins only when
    it ends). `in_progress`: the prompt tokens of that step when it is shorter than
    `step_tokens` (a background step).
    """
    total = sum(ahead) + head_tokens
    if cap <= 0 or step_tokens <= 0 or not ahead:
        return total
    first = in_progress if 0 < in_progress < step_tokens else step_tokens
    left, computed = [n for n in ahead if n > 0], min(first, sum(ahead))
    for _ in range(4096):  # enough for any real prompt; a degenerate cap falls back to the bound
        budget = step_tokens
        c = cap if left else step_tokens
        for i, n in enumerate(left):
            t = min(n, c, budget)
            left[i] -= t
            budget -= t
            computed += t
        t = min(head_tokens, c, budget)
        head_tokens -= t
        computed += t
        if head_tokens <= 0:
            return computed
        left = [n for n in left if n > 0]
    return total


def choose_victims(
    policy: PreemptionPolicy, running: list[Running], head: Waiting, now_ms: int, tokens_per_s: float,
    head_claimed: bool = True,
) -> list[str]:
    """The requests to abort so that `head` can meet its deadline, least urgent first.

    vLLM keeps giving each step's token budget to requests already running
    before it looks at a waiting one, whatever their priorities, so every
    running prompt delays `head` by all of its remaining work, or, with a
    per-request cap, by its share of each step until `head` is done
    (`tokens_until_done`). Preempt only
    when `head` would miss its deadline waiting for them, and then abort
    looser-tier requests (loosest tier, then latest deadline, then most
    remaining work: the least sunk cost) until what is left fits before the
    deadline. Requests of `head`'s tier or stricter, requests that have
    used up their preemptions, and requests past their latest start (their
    `remaining_tokens` recomputed from now would end after their own deadline)
    are never chosen.

    `head_claimed`: the worker has taken `head` and gives it to its engine now; False
    when it is still queued because the worker is full, where only an abort makes
    room for it. A claimed strictest-tier head on an engine that holds looser
    prompts back for it (`holds_background`) needs no victims.
    """
    if not policy.enabled or not running or tokens_per_s <= 0:
        return []
    if policy.holds_background and head_claimed and head.tier_rank == 0:
        return []
    budget_tokens = (head.deadline_ms - now_ms) * tokens_per_s / 1000.0
    # The step in progress holds every running prompt, victims included (an abort lands after it):
    # a background step unless one of them is of the strictest tier.
    in_progress = policy.background_tokens if all(r.tier_rank > 0 for r in running) else 0

    def fits(kept: list[Running]) -> bool:
        work = tokens_until_done([r.remaining_tokens for r in kept], head.prompt_tokens,
                                 policy.step_tokens, policy.prefill_cap, in_progress)
        return work <= budget_tokens

    if fits(running):
        return []
    candidates = sorted(
        (r for r in running if r.tier_rank > head.tier_rank and r.preemptions < policy.max_preemptions
         and start_by_ms(r.deadline_ms, r.remaining_tokens, tokens_per_s) >= now_ms),
        key=lambda r: (r.tier_rank, r.deadline_ms, r.remaining_tokens),
        reverse=True,
    )
    kept, victims = list(running), []
    for r in candidates:
        victims.append(r.request_id)
        kept.remove(r)
        if fits(kept):
            break
    return victims


def victims(policy: PreemptionPolicy, computing: Sequence[tuple[int, int, int, int]], head: Waiting, now_ms: int,
            tokens_per_s: Callable[[], float], head_claimed: bool = True) -> list[int]:
    """What a worker preempts for `head`: indices into `computing`, in the order to abort them.

    `computing`: (tier rank, deadline ms, prompt tokens, preemptions so far) of each prompt the
    worker's engine computes and may abort, in the worker's order (a prefill worker's prompts, or the
    prompts a decode worker computes itself; never a stream in progress). The whole prompt counts as
    its remaining work (the worker does not see the engine's progress). `tokens_per_s`: asked for the
    worker's prefill rate (`scheduler.throughput.rate_or_prior`) only when there is something to decide.
    Both the live worker and the simulated ones call this; `choose_victims` decides.
    """
    if not policy.enabled or not computing:
        return []
    rank, cap = head.tier_rank, policy.max_preemptions
    if not any(c[0] > rank and c[3] < cap for c in computing):
        return []  # nothing it may abort (choose_victims would find no candidate): the common case
    running = [Running(str(i), c[0], c[1], c[2], c[3]) for i, c in enumerate(computing)]
    return [int(rid) for rid in choose_victims(policy, running, head, now_ms, tokens_per_s(), head_claimed)]


@dataclass(frozen=True)
class Shield:
    """What a worker that just preempted for a request of tier rank `rank` owes it.

    With a per-request step cap the engine shares each step between every prompt
    it holds, so victims re-queued and claimed straight back (the worker has room
    again) would take half of every step from the request they were aborted for,
    and the abort would buy nothing. So the worker claims only tiers of rank <=
    `rank` until that tier's work is done here and none is waiting on its streams,
    or `until_ms` (the protected request's deadline) has passed; the victims wait
    on their streams meanwhile, where any other worker may take them.
    """

    rank: int
    until_ms: int

    def merged(self, other: Shield | None) -> Shield:
        """Protect both: the looser of the two ranks, the later of the two deadlines."""
        if other is None:
            return self
        return Shield(max(self.rank, other.rank), max(self.until_ms, other.until_ms))

    def limit(self, now_ms: int) -> int | None:
        """The loosest tier rank the worker may claim now; None once the shield has expired."""
        return self.rank if now_ms < self.until_ms else None

    def lifts(self, computing_ranks) -> bool:
        """Asked when a claim limited to its tiers found nothing: lifted unless one of them computes here."""
        return not any(r <= self.rank for r in computing_ranks)
