"""The multi-turn workload: conversations and RAG questions that share prefixes (pure; no I/O).

A *session* is what one user does:
  chat  a conversation of several turns (`MultiturnSpec.turns`). Every turn's prompt is the
        previous turn's prompt + the answer actually received + a new user message, sent a think
        time (exponential, mean `think_s`) after that answer arrived;
  rag   one question over one of a few shared documents (`rag_docs`): the document + a new question.
Every session starts with the same system prompt. So the prefixes an engine can reuse are: the
system prompt (every request), a document (every question about it) and a conversation's history
(its later turns): what prefix affinity is for, and what round-robin placement wastes.

Sessions start open-loop (Poisson or gamma at the rate, like the mixed workload's requests); turns
within a session are closed-loop (the driver waits for the answer, then the think time). A
conversation ends early rather than send a prompt over `max_prompt_tokens` (the model's context is
2048), and when a turn failed (a user who got no answer does not follow up).

Determinism: sessions (system prompt, documents, user messages, lengths, start and think times)
depend only on (seed, rate), so every system gets the same ones. A later turn's prompt also holds
the answers, which are the same on systems serving one model greedily. Each rate has its own
system prompt (its first line is a date) and documents, so no rate finds the previous rate's
prefixes cached.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from skyline.tools.bench.corpus import QUESTIONS, SYSTEM_PROMPT
from skyline.tools.bench.prompts import PromptBuilder
from skyline.tools.bench.workload import BenchRequest, WorkloadSpec, arrival_offsets, class_sequence

QUESTION_ROOM = 80  # tokens a document leaves for the question after it ("\n\nQuestion: ..." in bytes, sim)
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


@dataclass(frozen=True)
class MultiturnSpec:
    turns: tuple[int, int] = (3, 5)  # turns per conversation, uniform in [lo, hi]
    think_s: float = 1.5  # mean think time between a turn's answer and the next turn (exponential)
    rag_docs: int = 3  # shared documents the RAG questions are about
    max_prompt_tokens: int = 1800  # a conversation stops before a prompt longer than this


@dataclass(frozen=True)
class Session:
    index: int
    cls: str  # "chat" (a conversation) | "rag" (one question over a shared document)
    tier: str
    start_at: float  # seconds after the start of the run at this rate
    system: str  # the system prompt
    users: tuple[str, ...]  # the user message of each turn
    max_tokens: tuple[int, ...]  # output tokens of each turn
    think_s: tuple[float, ...]  # think time before each turn after the first


def system_prompt(rng: random.Random) -> str:
    """The shared system prompt, dated (as assistants' system prompts are): one per rate."""
    return f"Today is {rng.choice(_DAYS)}, {rng.randint(1, 28)} {rng.choice(_MONTHS)}.\n{SYSTEM_PROMPT}"


def documents(spec: WorkloadSpec, mt: MultiturnSpec, builder: PromptBuilder, rng: random.Random,
              system: str) -> list[str]:
    """The shared documents: each one sized so that system prompt + document + question is a
    `spec.rag_prompt` length, within the prompt bound."""
    room = builder.count_messages([{"role": "system", "content": system}]) + QUESTION_ROOM
    out = []
    for _ in range(mt.rag_docs):
        target = min(rng.randint(*spec.rag_prompt), mt.max_prompt_tokens)
        if target - room < QUESTION_ROOM:
            raise ValueError(f"RAG prompts of {target} tokens leave no room for a document after the system "
                             f"prompt and a question ({room} tokens): raise the RAG prompt lengths")
        out.append(builder.document(target - room, rng))
    return out


def make_sessions(spec: WorkloadSpec, mt: MultiturnSpec, builder: PromptBuilder, n: int,
                  rate: float) -> list[Session]:
    """The first `n` sessions of the workload, with start times for `rate` (sessions/s).

    Chat/RAG shares follow `spec.mix` (spread evenly, as in the mixed workload); user messages are
    `spec.chat_prompt` tokens each (as a one-message chat), answers `spec.chat_output` /
    `spec.rag_output` tokens.
    """
    if mt.rag_docs < 1 and spec.mix < 1:
        raise ValueError("RAG questions need at least one document (rag_docs >= 1)")
    rng = random.Random(f"{spec.seed}:multiturn:{rate:g}")
    times = arrival_offsets(n, rate, random.Random(f"{spec.seed}:arrivals:{rate:g}"), spec.arrival,
                            spec.burstiness)
    system = system_prompt(rng)
    docs = documents(spec, mt, builder, rng, system) if spec.mix < 1 else []
    out = []
    for i, cls in enumerate(class_sequence(n, spec.mix, rng.random())):
        if cls == "chat":
            turns = rng.randint(*mt.turns)
            users = tuple(builder.chat(rng.randint(*spec.chat_prompt), rng)[0] for _ in range(turns))
            outputs = tuple(rng.randint(*spec.chat_output) for _ in range(turns))
        else:
            users = (f"{rng.choice(docs)}\n\nQuestion: {rng.choice(QUESTIONS)}",)
            outputs = (rng.randint(*spec.rag_output),)
        think = tuple(rng.expovariate(1 / mt.think_s) if mt.think_s > 0 else 0.0 for _ in users[1:])
        out.append(Session(i, cls, spec.tier_of(cls), times[i], system, users, outputs, think))
    return out


def first_messages(session: Session) -> list[dict]:
    return [{"role": "system", "content": session.system}, {"role": "user", "content": session.users[0]}]


def next_messages(messages: list[dict], answer: str, user: str) -> list[dict]:
    """The next turn's conversation: this turn's, its answer as received, the new user message."""
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": user}]


def turn_request(session: Session, turn: int, messages: list[dict], builder: PromptBuilder, mt: MultiturnSpec,
                 index: int, send_at: float) -> BenchRequest | None:
    """Turn `turn` of `session` as a request (`index`: its place in the send order), or None when its
    prompt would exceed the bound: the conversation ends there."""
    tokens = builder.count_messages(messages)
    if tokens > mt.max_prompt_tokens:
        return None
    return BenchRequest(index, session.cls, session.tier, send_at, messages[-1]["content"], tokens,
                        session.max_tokens[turn], tuple(messages), session.index, turn)
