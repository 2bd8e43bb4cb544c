"""The ledger under churn: workers killed every few seconds, Redis restarted once.

What a client of the fleet notices: every request it sent ends either with exactly the text it
asked for (the sim engine's known output: no gap, no duplicate) or with an error it was told,
whose cause the faults explain; none is lost (silence, or a wrong or truncated output without an
error). With Redis persistence on, no failure is one that could have continued: the only ones
left are 503 refusals at the door while Redis is away. This is `skyline bench churn`, smaller.
"""

from __future__ import annotations

import pytest

from skyline.tools.bench.churn import ChurnOptions, Fault, Sent, classify, reference, run
from skyline.tools.bench.client import RequestRecord

pytestmark = pytest.mark.faults

EXPLAINED = {"refused_at_door", "state_lost"}


def test_with_aof_every_request_completes_exactly_or_is_refused_while_redis_is_away(tmp_path):
    opts = ChurnOptions(requests=50, rate=4.0, kill_every_s=2.5, prefill=2, decode=2, max_tokens=48,
                        persistence="aof", seed=1)
    churn = run(opts, tmp_path)
    led = churn.ledger
    assert led.sent == len(churn.requests) == 50
    assert any(f.kind == "redis_restart" for f in churn.faults), led.events
    for s in churn.requests:
        if not s.rec.error_source:  # the client saw no error: its text is the reference, whole and once
            assert s.rec.text == reference(s.i, opts.max_tokens), f"#{s.i}"
        else:  # told, not left hanging or cut short
            assert s.rec.error_source in ("status", "frame"), f"#{s.i}: {s.rec.error}"
    assert led.lost == 0, led.lost_examples
    assert led.completed + led.failed == led.sent
    for f in led.failures:  # each failure has a cause the faults explain
        assert f.fault != "no fault" and f.verdict in EXPLAINED, f
    assert led.could_have_continued == 0, [f for f in led.failures if f.verdict == "could_have_continued"]
    assert led.migrated >= 1, led.events  # a decode worker died mid-stream at least once and the stream moved


# ---- the verdicts, on made-up records (no fleet) ----------------------------------------

RESTART = Fault("redis_restart", at_s=10.0, up_s=11.0, ready_s=11.5)
KILL = Fault("kill", at_s=4.0, what="decode-0 (started decode-r1)")


def _done(i: int, text: str | None = None) -> RequestRecord:
    return RequestRecord(ok=True, status=200, text=reference(i, 8) if text is None else text)


def _failed(status: int, source: str, error: str, code: str = "") -> RequestRecord:
    return RequestRecord(status=status, error=error, error_source=source, error_code=code)


STATE_LOST_FRAME = _failed(200, "frame", "Redis lost its data while the gateway was reconnecting (restarted without "
                                         "persistence?): this request's output cannot be completed; retry the request")
DOOR = _failed(503, "status", '{"error":{"message":"the gateway cannot reach Redis","code":"redis_unavailable"}}',
               "redis_unavailable")


@pytest.mark.parametrize("persistence, verdict", [("none", "state_lost"), ("aof", "could_have_continued")])
def test_state_lost_in_a_restart_is_explained_only_without_persistence(persistence, verdict):
    sent = [Sent(0, 9.0, 11.6, STATE_LOST_FRAME), Sent(1, 10.3, 10.31, DOOR), Sent(2, 12.0, 13.0, _done(2))]
    led = classify(sent, 8, [KILL, RESTART], persistence)
    assert (led.completed, led.failed, led.lost) == (1, 2, 0)
    assert led.by_cause == {"redis_state_lost": 1, "redis_unavailable": 1}
    assert [(f.cause, f.fault, f.verdict) for f in led.failures] == [
        ("redis_state_lost", "after redis restart", verdict), ("redis_unavailable", "redis down", "refused_at_door")]
    assert led.refused_at_door == 1 and led.could_have_continued == (persistence == "aof")


def test_failures_no_fault_explains_could_have_continued_and_silent_damage_is_lost():
    sent = [
        Sent(0, 5.0, 30.0, _failed(502, "frame", "the gateway lost its Redis pub/sub connection (x) and it was not "
                                                 "back within 10 s")),  # no restart near it
        Sent(1, 3.0, 9.0, _failed(200, "frame", "the decode worker serving this request died mid-stream, and ...")),
        Sent(2, 3.0, 9.0, _failed(500, "frame", "request failed on 3 workers in a row; it went to the dead-letter")),
        Sent(3, 1.0, 2.0, _done(3, text=reference(3, 8)[:-1])),  # cut short without an error
        Sent(4, 1.0, 2.0, _failed(0, "transport", "ReadTimeout: ")),  # never answered
    ]
    led = classify(sent, 8, [KILL], "aof")
    assert [(f.cause, f.fault, f.verdict) for f in led.failures] == [
        ("relay_disconnected", "no fault", "could_have_continued"),
        ("migration_refused", "kill -9 decode", "could_have_continued"),
        ("poison_request", "kill -9 decode", "state_lost")]
    assert led.could_have_continued == 2 and led.lost == 2
