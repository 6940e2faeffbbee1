"""Token ids -> text, incrementally, with stop strings.

`update` returns the text that is safe to show so far: it holds back an incomplete UTF-8 character
(a trailing U+FFFD) and the tail that could still turn into a stop string, so that text shown to a
streaming client is always a prefix of the final text.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """`min_tokens`: a stop string ends generation only once that many tokens are out, and only where
    it ends after the text of the ones before the last of them (vLLM's rule: a stop string is looked
    for in each token's new text, from the `min_tokens`-th token on). `include_stop`: the stop string
    stays at the text's end. `skip_special_tokens`: special tokens have no text."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0, *, include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._stops_after: int | None = 0 if min_tokens <= 1 else None  # text before min_tokens - 1 tokens

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids: Sequence[int], final: bool = False) -> tuple[str, str | None]:
        """(text safe to show, the stop string that ended generation or None). `final`: this is the
        last token, so nothing is held back."""
        text = self._decode(token_ids)
        if len(token_ids) >= self.min_tokens:
            if self._stops_after is None:
                self._stops_after = len(self._decode(token_ids[:self.min_tokens - 1]))
            for stop in self.stop:
                idx = text.find(stop, max(0, self._stops_after - len(stop) + 1))
                if idx >= 0:
                    return text[:idx + len(stop) if self.include_stop else idx], stop
        if final:
            return text, None
        if text.endswith(REPLACEMENT_CHAR):
            text = text.rstrip(REPLACEMENT_CHAR)
        return text[:max(0, len(text) - self._hold)], None
