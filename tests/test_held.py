"""The worker's record of a held request (workers/held.py) and the role rules (workers/roles.py): pure."""

import asyncio

from skyline.core import messages
from skyline.core.streams import Claimed
from skyline.scheduler.claiming import ClaimRoom
from skyline.workers.held import Exit, HeldRequest, HeldTable, Phase
from skyline.workers.roles import DECODE, PREFILL, rules_of


def _req(rid: str, prompt: int = 10, tier: str = "standard") -> messages.GenerateRequest:
    return messages.GenerateRequest(rid, "m", [1] * prompt, messages.SamplingSpec(max_tokens=4), tier, 0, 1000, 1000, 0)


def _held(msg, rules=PREFILL) -> HeldRequest:
    return HeldRequest.of(Claimed("s", "0-1", "standard", msg), rules.first_phase(msg))


class _Task:
    cancelled = 0

    def cancel(self):
        self.cancelled += 1


def test_a_request_is_unwrapped_once_from_decode_work():
    req = _req("a")
    held = _held(messages.DecodeWork(req, kv_handle={"kv": 1}), DECODE)
    assert held.request is req and held.request_id == "a" and held.prompt_tokens == 10


def test_the_first_phase_is_the_roles():
    req = _req("a")
    assert PREFILL.first_phase(req) is Phase.COMPUTING
    assert DECODE.first_phase(messages.DecodeWork(req)) is Phase.COMPUTING  # no handle: computed here
    assert DECODE.first_phase(messages.DecodeWork(req, kv_handle={"kv": 1})) is Phase.DECODING


def test_phases_move_forward_and_a_finished_prompt_is_no_longer_computing():
    held = _held(_req("a"))
    assert held.computing
    held.prompt_computed()
    assert held.phase is Phase.HANDING_OFF and not held.computing
    local = _held(messages.DecodeWork(_req("b")), DECODE)
    local.first_token()
    assert local.phase is Phase.DECODING and not local.computing


def test_the_strongest_reason_to_leave_wins_whatever_came_first():
    held = _held(_req("a"))
    held.task = _Task()  # type: ignore[assignment]
    held.end_early(Exit.CANCELLED)
    assert held.leaving is Exit.CANCELLED and held.cancel_pending and not held.returning_to_queue
    held.end_early(Exit.PREEMPTED)
    held.end_early(Exit.HANDED_BACK)
    assert held.leaving is Exit.PREEMPTED and held.returning_to_queue
    assert held.task.cancelled == 3
    held.cancel_delivered = True
    assert not held.cancel_pending


def test_a_preempted_prompt_is_no_victim_but_still_takes_its_budget_until_it_unwinds():
    table = HeldTable()
    a, b = _held(_req("a", 100)), _held(_req("b", 30))
    table.add(a)
    table.add(b)
    a.end_early(Exit.PREEMPTED)
    assert [h.request_id for h in table.computing()] == ["b"]
    assert table.computing_tokens() == 130 and table.prompt_tokens == 130


def test_a_request_claimed_again_before_its_old_task_unwound_keeps_its_new_record():
    table = HeldTable()
    old, new = _held(_req("a", 100)), _held(_req("a", 100))
    table.add(old)
    table.add(new)  # requeued and claimed again under the same id
    assert len(table) == 1 and table.prompt_tokens == 200  # both prompts are in the engine until released
    table.release(old)
    assert table.get("a") is new and table.prompt_tokens == 100
    table.release(new)
    assert len(table) == 0 and table.prompt_tokens == 0


def test_room_is_asked_of_the_role_rules():
    room = ClaimRoom(max_running=2, prefill_token_budget=100, kv_watermark=0.9)
    table = HeldTable()
    table.add(_held(_req("a", 60)))
    assert PREFILL.has_room(room, table, lambda: 0.0, lambda: True)
    table.add(_held(_req("b", 50)))
    assert not PREFILL.has_room(room, table, lambda: 0.0, lambda: True)  # two held, 110 tokens
    streams = HeldTable()
    streams.add(_held(messages.DecodeWork(_req("c", 500), kv_handle={"kv": 1}), DECODE))
    assert DECODE.has_room(room, streams, lambda: 0.5, lambda: False)  # a pulled prompt takes no step budget
    assert not DECODE.has_room(room, streams, lambda: 0.95, lambda: True)  # over the KV watermark
    assert PREFILL.running_tokens(table) == 110 and DECODE.running_tokens(streams) == 0


def test_an_unknown_role_is_refused():
    try:
        rules_of("both")
    except ValueError as exc:
        assert "unknown worker role" in str(exc)
    else:
        raise AssertionError("an unknown role was accepted")


async def test_a_tombstone_check_is_awaited_through_the_record():
    held = _held(_req("a"))
    seen = []

    async def check():
        seen.append(1)

    held.tombstone = asyncio.create_task(check())
    await held.tombstone_checked()
    assert seen == [1]
