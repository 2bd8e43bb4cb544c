"""The load driver: open-loop requests (`run_rate`), open-loop sessions of closed-loop turns
(`run_sessions`), and one request at a time (`run_sequential`).

A closed loop (N clients, each waiting for its last answer) slows down with
the server and hides queueing; real users arrive regardless, so requests go
out on a fixed schedule and a slow server shows up as growing TTFT. After the
last send the driver waits up to `drain_s` for stragglers, then cancels them
(the client disconnects, so the server aborts them) and counts them as
`cancelled`: an overloaded rate cannot stall the whole sweep.

The multi-turn workload (skyline.tools.bench.multiturn) keeps the open loop for
sessions, which start on a fixed schedule; within one, a user sends the next
turn only after the answer to the last (and a think time), because the next
prompt holds that answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import httpx

from skyline.tools.bench import multiturn
from skyline.tools.bench.client import RequestRecord, stream_completion
from skyline.tools.bench.multiturn import Session
from skyline.tools.bench.record import BenchRecord, build_record
from skyline.tools.bench.shaping import shape
from skyline.tools.bench.workload import BenchRequest

CHAT_PATH = "/v1/chat/completions"


class Target:
    """Where and how to send: base URL, served model, request flavor and per-class SLO targets."""

    def __init__(self, system: str, url: str, model: str, flavor: str, targets: Callable[[str], tuple[float, float]],
                 allow_demotion: bool = False):
        self.system, self.url, self.model, self.flavor, self.targets = system, url, model, flavor, targets
        self.allow_demotion = allow_demotion

    def shape(self, req: BenchRequest) -> tuple[dict, dict]:
        return shape(self.flavor, req, self.model, self.targets(req.cls), self.allow_demotion)


def _client(n: int) -> httpx.AsyncClient:
    # One connection per in-flight request: a pool limit would queue requests
    # client-side and turn the open loop into a closed one.
    limits = httpx.Limits(max_connections=max(n, 1) + 8, max_keepalive_connections=max(n, 1) + 8)
    return httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits)


async def run_rate(target: Target, rate: float, requests: list[BenchRequest], drain_s: float,
                   on_done: Callable[[BenchRecord], None] = lambda r: None) -> tuple[list[BenchRecord], float]:
    """Send `requests` on their schedule; returns (records in request order, duration s)."""
    sent_at: dict[int, float] = {}
    results: dict[int, RequestRecord] = {}
    async with _client(len(requests)) as client:
        url = target.url + CHAT_PATH

        async def one(req: BenchRequest) -> None:
            rec = results[req.index] = await _send(client, url, target, req)
            on_done(build_record(target.system, rate, req, sent_at[req.index], rec, target.targets(req.cls)))

        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            delay = t0 + req.send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at[req.index] = time.perf_counter() - t0
            tasks.append(asyncio.create_task(one(req)))
        _done, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = _duration(t0, sent_at, results, cut=bool(pending))
    records = []
    for req in requests:
        rec = results.get(req.index)
        record = build_record(target.system, rate, req, sent_at[req.index], rec, target.targets(req.cls))
        if rec is None:
            on_done(record)
        records.append(record)
    return records, duration


async def _send(client: httpx.AsyncClient, url: str, target: Target, req: BenchRequest) -> RequestRecord:
    body, headers = target.shape(req)
    try:
        return await stream_completion(client, url, body, headers)
    except Exception as exc:  # noqa: BLE001 - a malformed response is that request's error, not the run's
        return RequestRecord(error=f"{type(exc).__name__}: {exc}")


def _duration(t0: float, sent_at: dict[int, float], results: dict[int, RequestRecord], cut: bool) -> float:
    """First send to last completion (vLLM's benchmark duration); to now when stragglers were cut."""
    if cut or not results:
        return time.perf_counter() - t0
    return max(sent_at[i] + r.latency_s for i, r in results.items() if r.ok) if any(r.ok for r in results.values()) \
        else time.perf_counter() - t0


async def run_sequential(target: Target, requests: list[BenchRequest]) -> list[BenchRecord]:
    """One request at a time (warm-up, unloaded probe): nothing queues behind anything."""
    out = []
    async with _client(1) as client:
        for req in requests:
            body, headers = target.shape(req)
            rec = await stream_completion(client, target.url + CHAT_PATH, body, headers)
            out.append(build_record(target.system, 0.0, req, 0.0, rec, target.targets(req.cls)))
    return out


# Builds turn `turn` of a session from its conversation so far: (session, turn, messages, index, send_at)
# -> the request, or None when the conversation ends there (skyline.tools.bench.multiturn.turn_request).
TurnBuilder = Callable[[Session, int, list[dict], int, float], BenchRequest | None]
Transcript = tuple[list[dict], str]  # a request's messages and the answer it got


async def run_sessions(target: Target, rate: float, sessions: list[Session], build: TurnBuilder, drain_s: float,
                       on_done: Callable[[BenchRecord], None] = lambda r: None,
                       ) -> tuple[list[BenchRecord], float, list[Transcript]]:
    """Start `sessions` on their schedule, each turn after the last one's answer and think time;
    returns (records in send order, duration s, each record's transcript). At the drain deadline the
    turns in flight are cancelled and the turns not yet sent never are."""
    sent: list[tuple[BenchRequest, float]] = []
    results: dict[int, RequestRecord] = {}
    async with _client(len(sessions)) as client:
        url = target.url + CHAT_PATH
        t0 = time.perf_counter()

        async def converse(session: Session) -> None:
            messages, answer = multiturn.first_messages(session), ""
            for turn in range(len(session.users)):
                if turn:
                    await asyncio.sleep(session.think_s[turn - 1])
                    messages = multiturn.next_messages(messages, answer, session.users[turn])
                req = build(session, turn, messages, len(sent), time.perf_counter() - t0)
                if req is None:
                    return
                at = time.perf_counter() - t0  # after the prompt was counted: the lag shows in send_lag_ms_max
                sent.append((req, at))
                rec = results[req.index] = await _send(client, url, target, req)
                record = build_record(target.system, rate, req, at, rec, target.targets(req.cls))
                on_done(record)
                if record.outcome != "ok":
                    return  # a user who got no answer does not follow up
                answer = rec.text

        tasks = []
        for session in sessions:
            delay = t0 + session.start_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(converse(session)))
        _done, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = _duration(t0, {req.index: at for req, at in sent}, results, cut=bool(pending))
    records = []
    for req, at in sent:
        rec = results.get(req.index)
        records.append(build_record(target.system, rate, req, at, rec, target.targets(req.cls)))
        if rec is None:
            on_done(records[-1])
    transcripts = [(list(req.messages), results[req.index].text if req.index in results else "") for req, _ in sent]
    return records, duration, transcripts
