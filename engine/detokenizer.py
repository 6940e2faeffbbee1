"""Token ids -> text, incrementally, with stop strings.

`update` returns the text that is safe to show so far: it holds back an incomplete UTF-8 character
(a trailing U+FFFD) and the tail that could still turn into a stop string, so that text shown to a
streaming client is always a prefix of the final text.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def update(self, token_ids: Sequence[int], final: bool = False) -> tuple[str, str | None]:
        """(text safe to show, the stop string that ended generation or None). `final`: this is the
        last token, so nothing is held back."""
        text = self._decode(token_ids)
        for stop in self.stop:
            idx = text.find(stop)
            if idx >= 0:
                return text[:idx], stop
        if final:
            return text, None
        if text.endswith(REPLACEMENT_CHAR):
            text = text.rstrip(REPLACEMENT_CHAR)
        return text[:max(0, len(text) - self._hold)], None
