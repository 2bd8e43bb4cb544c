"""Which streams a new decode worker can continue exactly, and which it must refuse.

A migrated stream (its decode worker died mid-stream) continues on another
engine that prefills prompt + the tokens already sent and generates the rest.
That is the same stream only when nothing about the next token depends on
engine state that does not survive the move. What does not (vLLM 0.32):
- sampling (temperature > 0): the continuation would be another draw; with a
  `seed` the random stream cannot be resumed at its position either;
- several choices (`n` > 1): their outputs would all have to move at once;
- a grammar (structured outputs): its state is built from the output, which the
  new engine sees as prompt, so it would start the grammar afresh;
- presence/frequency penalties and bad words: they look at output tokens only;
- stop strings: a stop string spanning the tokens before and after the move
  would not be seen.
What does survive: greedy decoding, logprobs (of the new tokens), the
repetition penalty (prompt and output alike), min/max tokens (counted on),
logit bias, and everything the gateway parses (tool calls, reasoning), whose
state is in the gateway's serving layer, not in the worker.
"""

from __future__ import annotations

from typing import Any

GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature


def resume_refusal(temperature: float, seed: int | None, n: int, params: dict[str, Any] | None) -> str | None:
    """Why a stream with these sampling settings cannot continue on another engine; None if it can."""
    p = params or {}
    if temperature >= GREEDY_BELOW:
        if seed is not None:
            return "a request with a `seed` is not resumed on another engine (its random stream cannot be continued)"
        return "a sampled request (temperature > 0) is not resumed on another engine (it would be another draw)"
    if n > 1:
        return "a request with n > 1 is not resumed on another engine (its choices cannot move one by one)"
    if p.get("structured_outputs"):
        return "a request with structured outputs is not resumed on another engine (the grammar's state is lost)"
    if p.get("presence_penalty") or p.get("frequency_penalty"):
        return "a request with presence/frequency penalties is not resumed on another engine (they count output tokens)"
    if p.get("bad_words"):
        return "a request with bad_words is not resumed on another engine (they look at output tokens only)"
    if p.get("stop"):
        return "a request with stop strings is not resumed on another engine (one could span the move)"
    return None


def remaining(params: dict[str, Any] | None, produced: int) -> dict[str, Any] | None:
    """The sampling parameters of the continuation after `produced` tokens were sent."""
    if params is None:
        return None
    out = dict(params)
    if out.get("min_tokens"):
        out["min_tokens"] = max(0, int(out["min_tokens"]) - produced)
    out.pop("prompt_logprobs", None)  # sent with the first frame already
    return out
