"""Token ids -> text, incrementally, with stop strings.

`update` returns the text that is safe to show so far: it holds back the tokens of an incomplete
UTF-8 character and the tail that could still turn into a stop string, so that text shown to a
streaming client is always a prefix of the final text. An answer that ends inside a character ends
before it.

Each new token costs a decode of a few tokens, never of the whole output: decoding everything again
at every token made a step's host work grow with the answer's length (for a long answer, more than a
decode step replayed on a GPU).
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"
# A character's bytes span at most four byte tokens: tokens pending longer than this (a model writing invalid
# bytes, or tokens without text) are taken as they decode, so that the window stays short.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """`min_tokens`: a stop string ends generation only once that many tokens are out, and only where
    it ends after the text of the ones before the last of them (vLLM's rule: a stop string is looked
    for in each token's new text, from the `min_tokens`-th token on). `include_stop`: the stop string
    stays at the text's end. `skip_special_tokens`: special tokens have no text.

    The text grows by windows (vLLM's incremental detokenizing): the tokens after `_read_offset` are
    decoded together with the last committed window before them (`_prefix_offset ..
    _read_offset`), and what they add to that window's text is appended. The window gives the new
    tokens their context: a SentencePiece token's leading space is dropped only at the start of a
    decode, and the bytes of one character may be split over several tokens. Until the new tokens
    add text that does not end in an incomplete character, they stay pending and are decoded again
    with the next one (at most `MAX_PENDING_TOKENS`). Skipped special tokens are left out of the
    windows: a run of them would otherwise stay pending, adding no text."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0, *, include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._stops_after: int | None = 0 if min_tokens <= 1 else None  # text before min_tokens - 1 tokens
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ())) if skip_special_tokens else frozenset()
        self._token_ids: list[int] = []  # the tokens given so far, less skipped special tokens
        self._given = 0            # tokens given so far
        self._text = ""            # the text of _token_ids before _read_offset
        self._prefix_offset = 0    # first token of the window decoded again as context
        self._read_offset = 0      # tokens before this one are in _text
        self._searched = 0         # stop strings were looked for in _text[:_searched]
        self._backend_decode = _backend_decode(tokenizer)

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)

    def _read(self, token_ids: Sequence[int], final: bool) -> None:
        """Append the text of the tokens after `_read_offset`, unless they end inside a character
        (then they wait for the next token) or add no text yet; `final` appends whatever they add."""
        self._token_ids += [t for t in token_ids[self._given:] if t not in self._special_ids]
        self._given = len(token_ids)
        ids, pending = self._token_ids, len(self._token_ids) - self._read_offset
        if pending <= 0:
            return
        window_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        complete = len(new_text) > len(window_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if not (final or complete or pending > MAX_PENDING_TOKENS):
            return
        added = new_text[len(window_text):]
        if final and pending <= MAX_PENDING_TOKENS:
            # an answer cut inside a character (by max_tokens, say): no byte will complete it, so it is left out
            # (as vLLM does) rather than shown as a replacement character
            added = added.rstrip(REPLACEMENT_CHAR)
        self._text += added
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def update(self, token_ids: Sequence[int], final: bool = False) -> tuple[str, str | None]:
        """(text safe to show, the stop string that ended generation or None). `token_ids`: every
        token so far (the tokens given before, then the new ones). `final`: this is the last token, so
        nothing is held back."""
        self._read(token_ids, final)
        text = self._text
        if len(token_ids) >= self.min_tokens:
            if self._stops_after is None:
                self._stops_after = len(self._decode(token_ids[:self.min_tokens - 1]))
            # text before _searched held no stop string: only its last len(stop) - 1 characters
            # can begin one that the new text completes
            for stop in self.stop:
                start = max(0, self._stops_after - len(stop) + 1, self._searched - len(stop) + 1)
                idx = text.find(stop, start)
                if idx >= 0:
                    return text[:idx + len(stop) if self.include_stop else idx], stop
            self._searched = len(text)
        if final:
            return text, None
        return text[:max(0, len(text) - self._hold)], None


def _backend_decode(tokenizer):
    """The `tokenizers` library's decode behind a transformers fast tokenizer, where transformers' own decode
    would add nothing to it (no clean-up of spaces): transformers' checks of its arguments cost four times
    the decode of a few tokens, twice per token of every answer. None: use the tokenizer's `decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)) \
            or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode
