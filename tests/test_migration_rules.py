"""Which streams another decode engine may continue exactly (scheduler/migration.py)."""

from __future__ import annotations

import pytest

from skyline.scheduler.migration import remaining, resume_refusal


def test_greedy_plain_requests_resume():
    assert resume_refusal(0.0, None, 1, None) is None
    assert resume_refusal(0.0, 7, 1, {"logprobs": 3, "repetition_penalty": 1.2, "logit_bias": {1: 2.0}}) is None


@pytest.mark.parametrize("temperature,seed,n,params,word", [
    (0.7, None, 1, None, "sampled"),
    (0.7, 7, 1, None, "seed"),
    (0.0, None, 2, None, "n > 1"),
    (0.0, None, 1, {"structured_outputs": {"json": {}}}, "structured"),
    (0.0, None, 1, {"presence_penalty": 0.5}, "penalties"),
    (0.0, None, 1, {"frequency_penalty": -0.5}, "penalties"),
    (0.0, None, 1, {"bad_words": ["x"]}, "bad_words"),
    (0.0, None, 1, {"stop": ["\n"]}, "stop strings"),
])
def test_what_cannot_continue_exactly_is_refused_with_the_reason(temperature, seed, n, params, word):
    assert word in resume_refusal(temperature, seed, n, params)


def test_the_continuation_counts_min_tokens_on_and_sends_no_prompt_logprobs_again():
    assert remaining({"min_tokens": 10, "prompt_logprobs": 2, "max_tokens": 30}, 4) == {"min_tokens": 6,
                                                                                       "max_tokens": 30}
    assert remaining({"min_tokens": 3}, 9) == {"min_tokens": 0}
    assert remaining(None, 3) is None
