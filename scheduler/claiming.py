"""What a worker may claim, and when it looks again: room, the shield after a preemption, the re-check.

A worker claims only what its engine can start soon; the rest stays in the
tier streams, in deadline order, where any worker that frees up can take it.
The live worker (workers/runtime.py) and the simulated ones
(skyline/tools/simulate/prefill_worker.py, decode_worker.py) ask these rules with
what they hold; neither has a copy of its own.

Room:

  - prefill worker: fewer than `max_running` prompts and fewer than
    `prefill_token_budget` prompt tokens held;
  - decode worker: fewer than `max_running` requests held, fewer than
    `prefill_token_budget` tokens of prompts it computes itself (they hold the
    step budget as a prefill worker's prompts do), KV usage under
    `kv_watermark`, and the pace rule (scheduler/decode_room.py): the recent
    time per token of its streams under `tpot_headroom` x the tightest TPOT
    target among them, unless it holds fewer than two requests.

Shield (`scheduler.preemption.Shield`): a worker that just preempted for a
request claims only that request's tier and stricter ones until the shield
expires, or until a claim limited to them finds nothing while none of them
computes here (then it claims any tier again at once). While they still compute
and only looser tiers wait, it looks again every `RECHECK_S`.

Who claims first (`claim_defer_s`): every worker blocked on the streams wakes
for a new entry at once, and whichever answers first takes it. A worker whose
engine already computes prompts waits before it claims one more prompt when a
live peer of the prompt's stage, as its last heartbeat said, would be free of
its own prompts sooner (`freest_peers`), for the difference of their times to
free (at most `CLAIM_DEFER_MAX_S`). Both sides count the same thing: the prompt
tokens the engine has left (`tokens_left`), and a peer's time to free runs
from its heartbeat, so that a view read a beat ago does not make a peer that
has since freed look busy (counting a peer's whole prompts, or its time from
the read, made busy engines take queued prompts while a peer went idle). So
an engine computing nothing, or less,
takes the prompt first: join the shortest queue, decided by the workers
themselves. Measured on the two-engine fleet (vllm bench serve, 128/32 at
2 req/s), without it the engine already computing won four prompts in a row
while its peer only decoded. A worker with no freer peer claims at once: when
every engine computes, waiting would only leave the prompt queued, and a fleet
whose every engine waits claims fewer prompts than arrive.
Its own time counts the tokens its engine has left (`tokens_left`: the
engine's count where it reports one, else an estimate from the claims'
times at the measured rate), and the worker stops waiting as soon as one of
its prompts gets its first token or leaves (the live claim loop wakes on an
event; the simulated worker the same). Work that needs no prompt computed (a
KV hand-off) is claimed at once. Work of a stricter tier than anything the engine
computes would take the steps first (and preempt if it must), so it waits here
only for the step in progress, but the engine's own prompts then wait for it:
a peer computing no prompt gets it first (`IDLE_PEER_ANSWER_S`, as long as an idle
peer takes to answer); with no such peer it is claimed at once. Measured on the
mixed chat + RAG benchmark: without this, a chat went to the engine computing a
1,800-token RAG prompt while its peer only decoded, and both missed their targets.

Who claims at all, until a head is due (`leaves_until_due`, elastic workers; off unless `[worker]
long_prompt_memory_s` is set, see below). Long prompts (those the gateway routed through the prefill
streams) gather on an engine once it computes one: for `long_prompt_memory_s` after its last
(`computes_long`), a peer where they do not gather leaves the next long prompt to it (while it has
room), and it leaves short prompts (the colocated route) to a live peer where they do not gather that
holds fewer requests; each only to a peer that is free of its own prompts by the head's latest start
(`scheduler.edf.start_by_ms`; the freest such peer's time to free, as in the claim defer above), and
each only until then: past it, waiting would only make the head late, and whoever looks first claims
it. So the engines find the disaggregated split under a load that needs it, and give it up when the
long prompts stop; where every engine computes long prompts (a fleet of long prompts only) nothing is
left, and the claim defer above decides alone. Measured on the mixed chat + RAG benchmark at 0.8 req/s:
chats whose streams shared 128-token steps with a RAG prompt's chunks ran 2-5x their TPOT target, and a
chat claimed beside a RAG prompt missed its TTFT; with long prompts given to the engine decoding fewer
streams they alternated between the two engines (a RAG's own decode stays where it was computed), so
that every engine ran chats beside RAG chunks; the fixed 1P + 1D split kept them apart. Without the two
bounds, the few engines where long prompts did not gather in a large fleet got every short prompt and
its stream (simulated, the DistServe check at 128 GPUs of elastic TP=2 engines: 4.45 req/s per GPU
against 7.14 without the rule; 7.14 with the bounds, docs/scheduling.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from skyline.scheduler.elastic import STAGES_OF_ROLE, PeerLoad, has_room
from skyline.scheduler.preemption import Shield
from skyline.scheduler.throughput import rate_or_prior

T = TypeVar("T")

# A full worker holding prompts re-checks the heads of its tier streams for a request that would be
# late (fleet-level preemption), and a shielded worker whose tiers have nothing waiting looks again,
# this often: 20 Hz.
RECHECK_S = 0.05

# The longest a worker computing prompts waits before claiming another, by default (`[worker]
# claim_defer_max_s`): a peer that is idle answers a new entry within milliseconds; past this, waiting
# longer would only delay the prompt where no engine is freer.
CLAIM_DEFER_MAX_S = 0.25

# How long a worker leaves a prompt to a peer computing none (a stricter tier's prompt while its engine
# computes looser ones; a long prompt while it decodes more streams than that peer): an idle peer's claim
# loop wakes on the new entry and takes it within a few tens of milliseconds (the mixed benchmark's median
# claim: under 25 ms); past this the peer is not coming, and the prompt is claimed here.
IDLE_PEER_ANSWER_S = 0.1

# How long an engine that computed a long prompt stays the one long prompts gather on and short prompts
# keep off (`leaves_until_due`), where the rule is on (`[worker] long_prompt_memory_s`, off by default):
# longer than the gaps between long prompts under a load that needs the split (the mixed benchmark's RAG
# prompts, 0.16/s at 0.8 req/s: 6 s apart on average), so that the engines do not swap roles between two
# of them, each swap leaving chats' streams on the engine that takes the next long prompt; short enough
# that an engine returns to short prompts soon after they stop.
LONG_PROMPT_MEMORY_S = 15.0


def claim_defer_s(prefill_tokens: int, rank: int, left_tokens: int, computing_ranks: Iterable[int],
                  tokens_per_s: float, peer_free_s: float | None, max_s: float = CLAIM_DEFER_MAX_S) -> float:
    """How long a worker waits before claiming a head of `prefill_tokens` prompt tokens to compute, of tier
    rank `rank`, while its engine has `left_tokens` tokens left to compute (`tokens_left`) of prompts of
    ranks `computing_ranks`, at `tokens_per_s`; `peer_free_s`: when the freest live peer that may claim the
    head is free of its own prompts, in seconds from now (`FreestPeers.free_s`; None: no peer).
    The difference of the two times to free, at most `max_s`; 0 = claim it now (no peer frees sooner)."""
    if max_s <= 0 or prefill_tokens <= 0 or left_tokens <= 0 or tokens_per_s <= 0 or peer_free_s is None:
        return 0.0
    if rank < min(computing_ranks, default=rank):
        # Stricter than anything computing here: its steps come before theirs (the holding rule,
        # scheduler/step_budget.py), so here it waits only for the step in progress; but every step it
        # holds, the looser prompts wait. A peer computing no prompt gives it steps no one else waits
        # for: leave it to that peer for as long as an idle peer takes to answer; else claim it now.
        return min(max_s, IDLE_PEER_ANSWER_S) if peer_free_s <= 0 else 0.0
    wait = left_tokens / tokens_per_s - peer_free_s
    return min(max_s, wait) if wait > 0 else 0.0


def long_prompt_defer_s(my_streams: int, peer_streams: int | None, max_s: float = CLAIM_DEFER_MAX_S) -> float:
    """How long an elastic worker whose engine computes no prompt and decodes `my_streams` streams waits before
    claiming a long prompt (one the gateway routed through the prefill streams): every step that computes it
    slows those streams. `peer_streams`: the fewest streams a live peer with room decodes while computing no
    prompt, as the heartbeats said (`FreestPeers.fewest_streams`; None: no such peer). A peer that decodes
    fewer takes it first, within the time an idle peer takes to answer: long prompts gather on the engines
    with the fewest streams and streams on the others, the disaggregated split, found prompt by prompt
    rather than fixed by process. 0: claim it now."""
    if max_s <= 0 or peer_streams is None or peer_streams >= my_streams:
        return 0.0
    return min(max_s, IDLE_PEER_ANSWER_S)


def tokens_left(prompts: Iterable[tuple[int, float, int | None]], tokens_per_s: float, now: float) -> int:
    """Prompt tokens an engine has yet to compute of `prompts`, each (its prompt tokens, when it was claimed,
    in seconds, the tokens its engine reports computed, None when it does not tell). Reported progress
    counts as it is; the rest is estimated as computed one prompt after another in claim order, each from
    its claim at the earliest, at `tokens_per_s` (the measured rate: claim to first token per busy
    second; vLLM gives the prompts it started their share of a step first). No rate: the whole prompts."""
    left = 0
    unknown: list[tuple[float, int]] = []
    for tokens, claimed_s, computed in prompts:
        if computed is not None:
            left += max(0, tokens - computed)
        else:
            unknown.append((claimed_s, tokens))
    if not unknown:
        return left
    if tokens_per_s <= 0:
        return left + sum(tokens for _s, tokens in unknown)
    unknown.sort(key=lambda p: p[0])  # (stable: claims of one instant keep their order)
    free_at = unknown[0][0]
    for claimed_s, tokens in unknown:
        free_at = max(free_at, claimed_s) + tokens / tokens_per_s
    return left + max(0, round((free_at - now) * tokens_per_s))


class PeerCompute(PeerLoad, Protocol):
    """A peer's heartbeat as placement reads it (`PeerLoad`: its `running_tokens` are every prompt a
    prefill worker holds), with how much of them it has left and the rate it computes them at."""

    tokens_per_s: float  # its measured prompt rate (0: not measured yet)
    left_tokens: int  # prompt tokens its engine had left to compute at the beat (`tokens_left`)
    computes_long: int  # 1: it computes a long prompt, or did within LONG_PROMPT_MEMORY_S (`computes_long`)
    last_seen: float  # when it beat, in the clock `freest_peers` and `FreestPeers.free_s` are given


@dataclass(frozen=True)
class FreestPeers:
    """For each stage, the two workers that may claim its prompts and are free of their own first, as their
    heartbeats said: (when it is free, worker id), freest first; and the two computing no prompt that hold
    the fewest requests (their streams): (requests, worker id). Two, so that every worker finds its peer
    other than itself in one look, however large the fleet."""

    by_stage: Mapping[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    idle_by_stage: Mapping[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    # Of the peers with room, (when it is free, worker id) of the two freest where long prompts gather, and
    # ((requests held, when it is free), worker id) of the two holding the fewest where they do not
    # (`computes_long`, `leaves_until_due`).
    long_by_stage: Mapping[str, tuple[tuple[float, str], ...]] = field(default_factory=dict)
    no_long_by_stage: Mapping[str, tuple[tuple[tuple[int, float], str], ...]] = field(default_factory=dict)

    def fewest_streams(self, me: str, stage: str) -> int | None:
        """The fewest requests a peer of worker `me` that may claim `stage`'s prompts holds while computing
        no prompt (None: no such peer)."""
        return _other(self.idle_by_stage.get(stage, ()), me)

    def free_at_with_long(self, me: str, stage: str) -> float | None:
        """When the freest peer of worker `me` with room that may claim `stage`'s prompts and where long
        prompts gather (`computes_long`) is free of its own prompts (None: no such peer)."""
        return _other(self.long_by_stage.get(stage, ()), me)

    def least_held_without_long(self, me: str, stage: str) -> tuple[int, float] | None:
        """(requests it holds, when it is free of its own prompts) of the peer of worker `me` with room that
        may claim `stage`'s prompts, where long prompts do not gather, holding the fewest requests (None: no
        such peer)."""
        return _other(self.no_long_by_stage.get(stage, ()), me)

    def free_s(self, me: str, stage: str, now: float) -> float | None:
        """In how many seconds from `now` the freest peer of worker `me` that may claim `stage`'s prompts is
        free (0: it should be already); None when it has no such peer."""
        free_at = _other(self.by_stage.get(stage, ()), me)
        return None if free_at is None else max(0.0, free_at - now)


NO_PEERS = FreestPeers()


def freest_peers(peers: Iterable[PeerCompute], prompt_budget: int, prior_tokens_per_s: float) -> FreestPeers:
    """Read the workers' heartbeats (`peers`, the live ones) once, for every claim until the next: for each
    stage, the two that free their engines of their prompts first (the tokens they had left at their beat,
    at their measured rate, or `prior_tokens_per_s` before any, from their beat), among those that would
    claim one more (`elastic.has_room`: the count, the prompt-token budget `prompt_budget`, the KV
    watermark)."""
    best: dict[str, list[tuple[float, str]]] = {}
    idle: dict[str, list[tuple[int, str]]] = {}
    long: dict[str, list[tuple[float, str]]] = {}
    no_long: dict[str, list[tuple[tuple[int, float], str]]] = {}
    for p in peers:
        if not has_room(p, prompt_budget):
            continue
        free_at = p.last_seen + p.left_tokens / rate_or_prior(p.tokens_per_s, prior_tokens_per_s)
        for stage in STAGES_OF_ROLE.get(p.role, ()):
            _keep_two(best.setdefault(stage, []), (free_at, p.worker_id))
            if p.left_tokens <= 0:
                _keep_two(idle.setdefault(stage, []), (p.running, p.worker_id))
            if p.computes_long > 0:
                _keep_two(long.setdefault(stage, []), (free_at, p.worker_id))
            else:
                _keep_two(no_long.setdefault(stage, []), ((p.running, free_at), p.worker_id))
    return FreestPeers(*({stage: tuple(two) for stage, two in by.items()}  # type: ignore[arg-type]
                         for by in (best, idle, long, no_long)))


def _other(two: tuple[tuple[T, str], ...], me: str) -> T | None:
    """The first of `two` ((value, worker id), best first) that is not worker `me`'s: its value (None: none)."""
    for value, worker_id in two:
        if worker_id != me:
            return value
    return None


def computes_long(last_long_s: float | None, now_s: float, memory_s: float) -> bool:
    """Is an engine that last computed a long prompt at `last_long_s` (None: never) one where long prompts
    gather, at `now_s`? While it computes one and for `memory_s` after (`[worker] long_prompt_memory_s`;
    0: never, the rule is off)."""
    return memory_s > 0 and last_long_s is not None and now_s - last_long_s < memory_s


def leaves_until_due(stage: str, prefill_tokens: int, start_by: float, *, long_here: bool, held_here: int,
                     free_at_with_long: float | None, without_long: tuple[int, float] | None,
                     due: bool = False, split: bool = False, idle_here: bool = False) -> bool:
    """Does an elastic worker leave a head of `stage` with `prefill_tokens` prompt tokens to compute, due
    to start by `start_by`, to its peers until then (see the module's docstring)? `long_here`: long
    prompts (those claimed from the prefill stage) gather on its engine (`computes_long`); it holds
    `held_here` requests (as its heartbeat counts them: prompts and streams); `free_at_with_long`: when the freest live peer with room where they gather
    is free of its own prompts (`FreestPeers.free_at_with_long`), `without_long`: (requests held, when
    free) of the one holding fewest where they do not (`least_held_without_long`); None: no such peer;
    times in the clock of `start_by`. A long prompt is left to a peer where they gather, a short prompt
    (it brings a stream) to one where they do not that holds fewer requests than this engine, each only
    to a peer free by the head's latest start: a peer that could not start it in time would make it wait
    for nothing, and one that holds more would gather every stream of a fleet of mostly long prompts on
    its few engines. A KV hand-off (no prompt to compute) is never left: its KV waits in another engine.
    A head that is `due` (its latest start has come) is claimed by whoever looks first, but under `split`.

    `split`: the long engines are the fleet's phase mix (`elastic.long_engines`), not each engine's
    memory. Then the split is a fixed fleet's: a long engine leaves every short prompt to a short engine
    with room, and a short engine every long prompt to a long engine with room, whatever their latest
    starts, each peer's time to free or what it holds. On the mixed
    benchmark, in one sitting (2026-12-08), the fixed 1 prefill + 1 decode fleet attained 92% at 0.4 req/s
    where the elastic fleet leaving heads only until their latest start attained 38%: each RAG prompt
    it computed past a chat's latest start, and each chat it claimed beside a RAG prompt, put the chats'
    streams beside its 256-token chunks, at several times their TPOT target.
    Under `split`, an engine that computes and decodes nothing (`idle_here`) leaves nothing: no stream of
    its own would run beside the head, and it finishes it first.
    """
    if prefill_tokens <= 0:
        return False
    if split:  # the phase mix: each engine leaves the other kind's prompts to a live peer of that kind with room
        if idle_here:
            return False
        return (without_long is not None) if stage == "decode" and long_here else \
            stage == "prefill" and not long_here and free_at_with_long is not None
    if stage == "decode":  # a short prompt, computed and decoded by whoever claims it
        return long_here and without_long is not None and not due and without_long[0] < held_here \
            and without_long[1] <= start_by
    return not due and not long_here and free_at_with_long is not None and free_at_with_long <= start_by


def _keep_two(two: list, item: tuple) -> None:
    two.append(item)
    two.sort()
    del two[2:]


@dataclass(frozen=True)
class ClaimRoom:
    """A worker's claim limits (the `[worker]` config: max_running, prefill_token_budget, kv_watermark)."""

    max_running: int
    prefill_token_budget: int
    kv_watermark: float = 1.0

    def prefill(self, held: int, prompt_tokens: int) -> bool:
        """May a prefill worker holding `held` prompts of `prompt_tokens` tokens in all claim one more?"""
        return held < self.max_running and prompt_tokens < self.prefill_token_budget

    def decode(self, held: int, local_prompt_tokens: int, kv_usage: float, pace_ok: bool) -> bool:
        """May a decode worker claim one more? `held`: requests it holds (streams, KV on its way, prompts it
        computes); `local_prompt_tokens`: tokens of the prompts it computes itself with no first token yet;
        `kv_usage`: the engine's KV cache usage (0-1); `pace_ok`: `decode_room.pace_allows` for its streams."""
        if held >= self.max_running or local_prompt_tokens >= self.prefill_token_budget:
            return False
        if kv_usage >= self.kv_watermark:
            return False
        return pace_ok or held < 2  # a lone stream slower than its target is the engine's speed


class ClaimShield:
    """A worker's shield state: which tiers its next claim may take from, after a preemption."""

    __slots__ = ("shield",)

    def __init__(self) -> None:
        self.shield: Shield | None = None

    def preempted_for(self, rank: int, until_ms: int) -> None:
        """The worker aborted prompts for a request of tier rank `rank` due at `until_ms`: protect it
        (merged with a shield already up: the looser rank, the later deadline)."""
        self.shield = Shield(rank, until_ms).merged(self.shield)

    def max_rank(self, now_ms: int) -> int | None:
        """The loosest tier rank the next claim may take (None: any tier); an expired shield is dropped."""
        shield = self.shield
        if shield is None:
            return None
        limit = shield.limit(now_ms)
        if limit is None:
            self.shield = None
        return limit

    def found_nothing(self, computing_ranks: Iterable[int]) -> bool:
        """A claim limited to the shielded tiers found nothing: True when the shield lifts (none of its tiers
        computes here, `computing_ranks`), so the worker claims any tier again at once; False when it holds
        (the worker looks again in `RECHECK_S`; meanwhile the looser tiers' entries wait for others)."""
        shield = self.shield
        if shield is None or shield.lifts(computing_ranks):
            self.shield = None
            return True
        return False
