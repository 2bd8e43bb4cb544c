"""The mixed workload: which requests are sent, and when (pure; no I/O).

Two request classes:
  chat  short prompts (tens to a few hundred tokens), the `interactive` tier;
  rag   long retrieval-style prompts close to the model context, `standard`
        (or `batch`) tier.
Arrivals are open-loop: send times are fixed in advance (Poisson, or gamma
with a burstiness factor as in `vllm bench serve`: shape = burstiness,
mean gap = 1/rate; burstiness 1 is Poisson, < 1 burstier, > 1 smoother), and
a request is sent at its time whether or not earlier ones have finished.

Determinism: requests and send times depend only on (seed, rate), so every
system sees the same requests, in the same order, at the same offsets. Each
rate draws fresh prompts: replaying one rate's prompts at the next would let
the server's prefix cache skip most of their prefill.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

CLASSES = ("chat", "rag")


@dataclass(frozen=True)
class WorkloadSpec:
    mix: float = 0.8  # fraction of chat requests
    chat_prompt: tuple[int, int] = (30, 300)  # prompt tokens, uniform in [lo, hi]
    rag_prompt: tuple[int, int] = (1200, 1800)
    chat_output: tuple[int, int] = (16, 64)  # output tokens (ignore_eos: exactly this many)
    rag_output: tuple[int, int] = (16, 64)
    chat_tier: str = "interactive"
    rag_tier: str = "standard"
    arrival: str = "poisson"  # or "gamma"
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    seed: int = 0

    def tier_of(self, cls: str) -> str:
        return self.chat_tier if cls == "chat" else self.rag_tier


@dataclass(frozen=True)
class BenchRequest:
    index: int  # position in the workload's request sequence
    cls: str  # "chat" | "rag"
    tier: str
    send_at: float  # seconds after the start of the run at this rate
    content: str  # the user message
    prompt_tokens: int  # after the chat template, in the served model's tokens
    max_tokens: int
    # The multi-turn workload (skyline.tools.bench.multiturn): the whole conversation sent (system
    # prompt, earlier turns and their answers, then `content`), its session and turn; () = `content` alone.
    messages: tuple[dict, ...] = ()
    session: int = -1
    turn: int = 0
    adapter: str = ""  # the LoRA adapter it names as its model (skyline.tools.bench.lora); "" = the base model


class Builder(Protocol):
    def chat(self, target_tokens: int, rng: random.Random) -> tuple[str, int]: ...
    def rag(self, target_tokens: int, rng: random.Random) -> tuple[str, int]: ...


def arrival_offsets(n: int, rate: float, rng: random.Random, arrival: str = "poisson",
                    burstiness: float = 1.0) -> list[float]:
    """Send times (s) of `n` requests at `rate` req/s; the first goes at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if arrival == "poisson":
        shape = 1.0
    elif arrival == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {burstiness}")
        shape = burstiness
    else:
        raise ValueError(f"unknown arrival process {arrival!r}; expected poisson or gamma")
    scale = 1.0 / (rate * shape)  # mean gap = shape * scale = 1/rate
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(shape, scale)
        out.append(t)
    return out


def requests_for(rate: float, duration_s: float | None, num_requests: int | None) -> int:
    """How many requests one rate sends: a fixed count, or rate x duration (at least 1)."""
    if num_requests:
        return num_requests
    if not duration_s:
        raise ValueError("give a duration or a number of requests per rate")
    return max(1, round(rate * duration_s))


def class_sequence(n: int, mix: float, phase: float) -> list[str]:
    """`n` request classes whose every prefix holds the chat fraction `mix` to within one request.

    Independent coin flips can put 17 chats in a row before the first RAG
    prompt, and a short (--quick) run would then never see a long prompt.
    Spreading the RAG requests evenly (error diffusion, with a random phase
    so the first request is not always the same class) keeps the mix exact
    in short runs; the arrival times stay random.
    """
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be within [0, 1], got {mix}")
    r = 1.0 - mix
    return ["rag" if math.floor((i + 1) * r + phase) > math.floor(i * r + phase) else "chat" for i in range(n)]


def make_requests(spec: WorkloadSpec, builder: Builder, n: int, rate: float) -> list[BenchRequest]:
    """The first `n` requests of the workload, with send times for `rate`."""
    content_rng = random.Random(f"{spec.seed}:content:{rate:g}")
    times = arrival_offsets(n, rate, random.Random(f"{spec.seed}:arrivals:{rate:g}"), spec.arrival, spec.burstiness)
    classes = class_sequence(n, spec.mix, content_rng.random())
    out = []
    for i, cls in enumerate(classes):
        lo, hi = spec.chat_prompt if cls == "chat" else spec.rag_prompt
        target = content_rng.randint(lo, hi)
        olo, ohi = spec.chat_output if cls == "chat" else spec.rag_output
        max_tokens = content_rng.randint(olo, ohi)
        content, real = getattr(builder, cls)(target, content_rng)
        out.append(BenchRequest(i, cls, spec.tier_of(cls), times[i], content, real, max_tokens))
    return out


def probe_requests(spec: WorkloadSpec, builder: Builder, per_class: int, stream: str = "probe") -> list[BenchRequest]:
    """Requests of each class for measuring unloaded latency (sent one at a time).

    Drawn from the same length distributions as the workload but with their
    own random stream (`stream`), so probing does not shift the workload's requests.
    """
    rng = random.Random(f"{spec.seed}:{stream}")
    out = []
    for cls in CLASSES:
        lo, hi = spec.chat_prompt if cls == "chat" else spec.rag_prompt
        olo, ohi = spec.chat_output if cls == "chat" else spec.rag_output
        for _ in range(per_class):
            content, real = getattr(builder, cls)(rng.randint(lo, hi), rng)
            out.append(BenchRequest(len(out), cls, spec.tier_of(cls), 0.0, content, real, rng.randint(olo, ohi)))
    return out
