"""Build chat and RAG prompts of a target length, in the served model's tokens.

Lengths are counted the way the server counts them: the whole chat
conversation after the model's chat template, so "a 1,800-token RAG prompt"
is 1,800 tokens of prefill work, not 1,800 tokens of user text. Text comes
from `skyline.tools.bench.corpus` (real prose that ships with Skyline).
"""

from __future__ import annotations

import random

from skyline.tools.bench.corpus import PASSAGES, QUESTIONS
from skyline.tools.bench.tokenizer import Tokenizer

RAG_INSTRUCTION = "Answer the question using only the numbered passages below. Cite the passage numbers you used."


class PromptBuilder:
    """Turns (class, target length, rng) into the text of one user message."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer

    def count(self, content: str) -> int:
        """Prompt tokens of a one-message chat with this content, template included."""
        return self.count_messages([{"role": "user", "content": content}])

    def count_messages(self, messages: list[dict]) -> int:
        """Prompt tokens of a whole conversation, template included (the multi-turn workload's turns)."""
        return len(self.tok.apply_chat_template(messages))

    def chat(self, target_tokens: int, rng: random.Random) -> tuple[str, int]:
        """A question, preceded by background text when the target is longer than the question."""
        question = rng.choice(QUESTIONS)
        background = " ".join(rng.sample(PASSAGES, k=3))
        return self._fit(f"Some background first. {background}", f"\n\n{question}", target_tokens)

    def rag(self, target_tokens: int, rng: random.Random) -> tuple[str, int]:
        """Numbered retrieved passages + a question, cut to the target length.

        Passages are shuffled (and reused in a new order once exhausted) so
        consecutive prompts do not share a long common prefix: a prefix cache
        would otherwise turn the "long prompt" into a short one.
        """
        question = rng.choice(QUESTIONS)
        order: list[str] = []
        while len(order) * 80 < target_tokens:  # ~130 tokens a passage; 80 leaves a margin for the cut
            order += rng.sample(PASSAGES, k=len(PASSAGES))
        passages = "\n\n".join(f"[{i + 1}] {p}" for i, p in enumerate(order))
        return self._fit(f"{RAG_INSTRUCTION}\n\n{passages}", f"\n\nQuestion: {question}", target_tokens)

    def document(self, target_tokens: int, rng: random.Random) -> str:
        """A shared document for the multi-turn workload's RAG questions: the RAG instruction and
        numbered passages (a shuffled order, so two documents differ from their first passage), cut to
        about `target_tokens` as a one-message chat. Questions are appended to it unchanged, so every
        question over one document shares this text as a prefix."""
        passages = "\n\n".join(f"[{i + 1}] {p}" for i, p in enumerate(rng.sample(PASSAGES, k=len(PASSAGES))))
        return self._fit(f"{RAG_INSTRUCTION}\n\n{passages}", "", target_tokens)[0]

    def _fit(self, filler: str, suffix: str, target_tokens: int) -> tuple[str, int]:
        """`filler` cut so that filler + suffix is about `target_tokens`; returns (content, real length).

        Cutting in token space then decoding can merge or split a token at
        the cut, so the result is re-counted and trimmed until it fits.
        """
        base = self.count(suffix.strip())
        budget = target_tokens - base
        if budget <= 0:
            return suffix.strip(), base
        ids = self.tok.encode(filler)
        while True:
            content = self.tok.decode(ids[:budget]).rstrip() + suffix
            n = self.count(content)
            if n <= target_tokens or budget <= 1:
                return content, n
            budget -= max(1, n - target_tokens)
