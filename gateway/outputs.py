"""From the fleet's frames to vLLM `RequestOutput`s, in the output kind vLLM's serving code asked for.

Workers always stream deltas (each frame: one choice's new tokens, text and
logprobs). vLLM's serving layer asks its engine for `DELTA` outputs when it
streams and `FINAL_ONLY` when it answers once (`CUMULATIVE` is the third kind);
`OutputAssembler` keeps each choice's output so far and answers in that kind,
as vLLM's own output processor would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyline.core import logprobs, messages


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What the next DELTA output carries (reset once sent).
    new_text: str = ""
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list | None = None
    changed: bool = False


class OutputAssembler:
    """One sub-request's frames -> `RequestOutput`s (`add` returns None when there is nothing to send yet)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int, output_kind: Any,
                 want_logprobs: bool):
        from vllm.sampling_params import RequestOutputKind

        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.choices = [_Choice(logprobs=[] if want_logprobs else None) for _ in range(n)]
        self.want_logprobs = want_logprobs
        self.kind = RequestOutputKind(output_kind)
        self.prompt_logprobs: list | None = None
        self._prompt_logprobs_sent = False
        self.finished = False
        self.num_cached_tokens: int | None = None
        self.tokens = 0

    def add(self, frames: list[messages.Message]) -> Any | None:
        for f in frames:
            if isinstance(f, messages.TokenDelta):
                self._delta(f)
            elif isinstance(f, messages.Finished):
                self.finished = True
                self.num_cached_tokens = f.kv_transfer.get("num_cached_tokens") if f.kv_transfer else None
                for c in self.choices:  # a choice the worker did not close (n=1: the final frame closes it)
                    if c.finish_reason is None:
                        c.finish_reason, c.changed = f.finish_reason, True
        return self._output()

    def _delta(self, f: messages.TokenDelta) -> None:
        if not 0 <= f.choice < len(self.choices):
            raise ValueError(f"frame for choice {f.choice} of a request with {len(self.choices)}")
        c = self.choices[f.choice]
        c.text += f.text
        c.token_ids += f.token_ids
        c.new_text += f.text
        c.new_ids += f.token_ids
        self.tokens += len(f.token_ids)
        if self.want_logprobs and f.logprobs is not None:
            lps = logprobs.from_wire(f.logprobs) or []
            c.logprobs = (c.logprobs or []) + lps
            c.new_logprobs = (c.new_logprobs or []) + lps
        if f.cumulative_logprob is not None:
            c.cumulative_logprob = f.cumulative_logprob
        if f.finish_reason is not None:
            c.finish_reason, c.stop_reason = f.finish_reason, f.stop_reason
        if f.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = logprobs.from_wire(f.prompt_logprobs)
        c.changed = True

    def _output(self) -> Any | None:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        if self.kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        delta = self.kind == RequestOutputKind.DELTA
        outs = []
        for i, c in enumerate(self.choices):
            if delta and not c.changed:
                continue
            outs.append(CompletionOutput(
                index=i, text=c.new_text if delta else c.text,
                token_ids=list(c.new_ids if delta else c.token_ids),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=(c.new_logprobs or [] if delta else c.logprobs) if self.want_logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            ))
            c.new_text, c.new_ids, c.new_logprobs, c.changed = "", [], None, False
        if not outs and not self.finished:
            return None
        prompt_logprobs = self.prompt_logprobs
        if delta:  # vLLM sends the prompt's logprobs once, with the first delta
            prompt_logprobs = None if self._prompt_logprobs_sent else self.prompt_logprobs
            self._prompt_logprobs_sent = self._prompt_logprobs_sent or self.prompt_logprobs is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_logprobs, outs,
                             self.finished, num_cached_tokens=self.num_cached_tokens)
