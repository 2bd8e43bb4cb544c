"""The fleet's frames as vLLM RequestOutputs (gateway/outputs.py): the kinds vLLM's serving code asks for."""

from __future__ import annotations

import math

import pytest
from vllm.sampling_params import RequestOutputKind as Kind

from skyline.core import logprobs, messages as m
from skyline.gateway.outputs import OutputAssembler

DELTA, CUMULATIVE, FINAL = Kind.DELTA, Kind.CUMULATIVE, Kind.FINAL_ONLY


def delta(seq, choice, ids, text, **kw):
    return m.TokenDelta("r", seq, 0, ids, text, choice=choice, **kw)


def final(reason="length"):
    return m.Finished("r", 9, reason, 3, 4, kv_transfer={"num_cached_tokens": 2})


def test_delta_outputs_carry_only_what_is_new_per_choice():
    a = OutputAssembler("r", "p", [1, 2, 3], n=2, output_kind=DELTA, want_logprobs=False)
    out = a.add([delta(0, 0, [5], "a"), delta(1, 1, [6], "b")])
    assert [(o.index, o.text, list(o.token_ids)) for o in out.outputs] == [(0, "a", [5]), (1, "b", [6])]
    out = a.add([delta(2, 1, [7], "c", finish_reason="stop", stop_reason="c")])
    assert [(o.index, o.text, o.finish_reason, o.stop_reason) for o in out.outputs] == [(1, "c", "stop", "c")]
    assert not out.finished
    out = a.add([delta(3, 0, [8], "d"), final()])
    assert out.finished and [(o.index, o.text, o.finish_reason) for o in out.outputs] == [(0, "d", "length")]
    assert out.num_cached_tokens == 2 and out.prompt_token_ids == [1, 2, 3] and out.prompt == "p"


def test_final_only_answers_once_with_everything():
    a = OutputAssembler("r", None, [1], n=1, output_kind=FINAL, want_logprobs=False)
    assert a.add([delta(0, 0, [5], "he")]) is None
    out = a.add([delta(1, 0, [6], "llo"), final("stop")])
    assert out.finished and out.outputs[0].text == "hello" and list(out.outputs[0].token_ids) == [5, 6]
    assert out.outputs[0].finish_reason == "stop"


def test_cumulative_outputs_grow():
    a = OutputAssembler("r", None, [1], n=1, output_kind=CUMULATIVE, want_logprobs=False)
    a.add([delta(0, 0, [5], "he")])
    assert a.add([delta(1, 0, [6], "llo")]).outputs[0].text == "hello"


def test_logprobs_and_prompt_logprobs_round_trip_the_wire():
    from vllm.logprobs import Logprob

    sampled = [{5: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "z")}]
    prompt = [None, {2: Logprob(-math.inf, 7, "x")}]
    wire = logprobs.to_wire(sampled)
    assert wire == [[[5, -0.5, 1, "a"], [9, -1.5, 2, "z"]]]
    a = OutputAssembler("r", None, [1, 2], n=1, output_kind=DELTA, want_logprobs=True)
    out = a.add([delta(0, 0, [5], "a", logprobs=wire, cumulative_logprob=-0.5,
                       prompt_logprobs=logprobs.to_wire(prompt))])
    assert out.outputs[0].logprobs == sampled and out.outputs[0].cumulative_logprob == -0.5
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1][2].logprob == -math.inf
    out = a.add([delta(1, 0, [6], "b", logprobs=[[[6, -0.1, 1, "b"]]]), final()])
    assert out.prompt_logprobs is None  # sent once, with the first delta, as vLLM does
    assert out.outputs[0].logprobs[0][6].decoded_token == "b"


def test_a_frame_for_a_choice_that_does_not_exist_is_refused():
    a = OutputAssembler("r", None, [1], n=1, output_kind=DELTA, want_logprobs=False)
    with pytest.raises(ValueError):
        a.add([delta(0, 3, [5], "a")])
