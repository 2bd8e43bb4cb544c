"""The phase mix (scheduler/elastic.py `long_engines`): which elastic engines keep the long prompts, and
what the claim rule and the decode placement do with the answer."""

from types import SimpleNamespace

from skyline.scheduler.claiming import leaves_until_due
from skyline.scheduler.elastic import MIX_WINDOW_S, MixWindow, decoder_for, handoff_step_tokens, long_engines


def _w(wid: str, long_tokens: int, short_tokens: int, role: str = "elastic"):
    return SimpleNamespace(worker_id=wid, role=role, long_tokens=long_tokens, short_tokens=short_tokens)


def test_a_load_of_one_kind_splits_nothing():
    assert long_engines([_w("a", 0, 900), _w("b", 0, 800)]) == frozenset()  # chats only (vllm bench 128/32)
    assert long_engines([_w("a", 3000, 0), _w("b", 4000, 0)]) == frozenset()  # long prompts only
    assert long_engines([_w("a", 3000, 500)]) == frozenset()  # one engine: nothing to split
    assert long_engines([_w("a", 3000, 0), _w("p", 0, 900, role="prefill")]) == frozenset()  # fixed pools


def test_the_engine_that_computed_the_most_long_prompt_tokens_keeps_them():
    # The mixed benchmark's share of long-prompt tokens (~70%) on two engines: one each way.
    assert long_engines([_w("a", 1500, 300), _w("b", 0, 400)]) == {"a"}
    assert long_engines([_w("a", 0, 300), _w("b", 1500, 400)]) == {"b"}
    # Equal: the first worker id, so every worker reading the same heartbeats finds the same engine.
    assert long_engines([_w("b", 1500, 0), _w("a", 1500, 700)]) == {"a"}
    # Among equals, the engines that keep them already: a tie does not swap the roles.
    assert long_engines([_w("a", 1500, 0), _w("b", 1500, 700)], current=frozenset({"b"})) == {"b"}
    # Never every engine: the streams need one.
    assert long_engines([_w("a", 9000, 0), _w("b", 9000, 10)]) == {"a"}


def test_how_many_engines_keep_long_prompts_follows_their_share_rounded_down():
    four = [_w("a", 4000, 0), _w("b", 3000, 0), _w("c", 100, 1000), _w("d", 0, 1900)]  # 70% long
    assert long_engines(four) == {"a", "b"}
    few = [_w("a", 500, 0), _w("b", 0, 3000), _w("c", 0, 3000), _w("d", 0, 3000)]  # 5% long: still one
    assert long_engines(few) == {"a"}


def test_the_window_counts_the_prompts_claimed_in_its_last_seconds():
    mix = MixWindow()
    mix.add(0.0, 1500, long=True)
    mix.add(1.0, 200, long=False)
    mix.add(2.0, 100, long=False)
    assert mix.totals(2.0) == (1500, 300)
    assert mix.totals(MIX_WINDOW_S + 0.5) == (0, 300)  # the long prompt left the window
    assert mix.totals(MIX_WINDOW_S + 2.0) == (0, 0)


def _peer(wid: str, running: int):
    return SimpleNamespace(worker_id=wid, role="elastic", running=running, max_running=8, kv_usage=0.0,
                           kv_watermark=0.9, running_tokens=0)


def test_a_long_engine_hands_every_decode_on_and_is_given_none():
    # It decodes no stream and its peer decodes five: without the mix the decode would stay here.
    assert decoder_for("a", 0, [_peer("b", 5)], False) == (None, "fewest_streams_here")
    assert decoder_for("a", 0, [_peer("b", 5)], False, long_here=frozenset({"a"})) == ("b", "long_prompts_here")
    # A short engine computing a long prompt (every long engine was busy) never hands it to a long engine.
    assert decoder_for("b", 5, [_peer("a", 0)], False, long_here=frozenset({"a"})) == (None, "no_peer_with_room")
    assert decoder_for("b", 5, [_peer("a", 0), _peer("c", 1)], False, long_here=frozenset({"a"})) == \
        ("c", "peer_decodes_fewer")
    # A peer whose own (short) prompts fill its next step still takes a long engine's hand-off: they are done
    # in a step or two, where the stream kept here would run beside the next long prompt's chunks.
    busy = SimpleNamespace(**{**vars(_peer("b", 5)), "running_tokens": 300})
    assert decoder_for("a", 0, [busy], False, step_tokens=256) == (None, "no_peer_with_room")
    assert decoder_for("a", 0, [busy], False, step_tokens=256, long_here=frozenset({"a"})) == \
        ("b", "long_prompts_here")
    assert handoff_step_tokens("long_prompts_here", 256) == 0 and handoff_step_tokens("prompts_queued", 256) == 256
    # A prompt too short to be worth its KV move stays where it was computed, long engine or not.
    assert decoder_for("a", 0, [_peer("b", 5)], False, prompt_tokens=100, min_move_tokens=256,
                       long_here=frozenset({"a"})) == (None, "too_short_to_move")


def test_with_a_split_each_engine_leaves_the_other_kinds_prompts_whenever_they_are_due():
    start_by = 20.0

    def short(*, due=False, split=True, held_here=3, without_long=(5, 25.0), idle=False):
        return leaves_until_due("decode", 150, start_by, long_here=True, held_here=held_here,
                                free_at_with_long=None, without_long=without_long, due=due, split=split,
                                idle_here=idle)

    # A long engine leaves a short prompt to a short engine with room, past its latest start too, however
    # busy that engine is and whatever it holds: the split of a fixed fleet.
    assert short() and short(due=True)
    assert not short(without_long=None)  # no short engine with room
    assert not short(idle=True)  # computing and decoding nothing: it finishes it first, beside no stream
    # The memory form (no split) keeps its bounds: only to a peer holding fewer, free in time, until due.
    assert not short(split=False) and not short(split=False, held_here=6, due=True)
    assert short(split=False, held_here=6, without_long=(5, 19.0))

    def long(*, due=False, free_at=25.0, long_here=False, idle=False):
        return leaves_until_due("prefill", 1500, start_by, long_here=long_here, held_here=3,
                                free_at_with_long=free_at, without_long=None, due=due, split=True, idle_here=idle)

    assert long() and long(due=True)  # a short engine leaves long prompts to a long engine with room
    assert not long(free_at=None)  # none with room
    assert not long(long_here=True)  # a long engine takes them
    assert not long(idle=True)
    assert not leaves_until_due("decode", 150, start_by, long_here=False, held_here=3, free_at_with_long=15.0,
                                without_long=(0, 1.0), split=True)  # a short engine takes short prompts
    assert not leaves_until_due("decode", 0, start_by, long_here=True, held_here=3, free_at_with_long=None,
                                without_long=(0, 1.0), split=True)  # a KV hand-off is never left
