"""Incremental detokenizing with stop strings (no model: one token per character)."""
from __future__ import annotations

from kvstrata.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """One token per character; "#" is a special token (its text is left out when skipped)."""

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if not (skip_special_tokens and chr(t) == "#"))


def run(text: str, stop: list[str], min_tokens: int = 0, **options) -> tuple[list[str], str | None]:
    """Feed `text` one character (token) at a time; the text shown after each, and the stop hit."""
    detok = IncrementalDetokenizer(CharTokenizer(), stop, min_tokens, **options)
    shown = []
    ids = [ord(c) for c in text]
    for n in range(1, len(ids) + 1):
        visible, hit = detok.update(ids[:n], final=n == len(ids))
        shown.append(visible)
        if hit is not None:
            return shown, hit
    return shown, None


def test_a_stop_string_ends_the_text_before_it_and_nothing_shown_is_taken_back():
    shown, hit = run("say ok. then more", ["ok."])
    assert hit == "ok." and shown[-1] == "say "
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))


def test_with_min_tokens_a_stop_string_counts_only_where_it_ends_after_the_first_min_tokens_minus_one():
    # "ab" ends at the 2nd token: with min_tokens 4 it does not count; the one ending at the 6th does
    shown, hit = run("abxxabyy", ["ab"], min_tokens=4)
    assert hit == "ab" and shown[-1] == "abxx"
    # a stop ending at the min_tokens-th token counts, though it starts before it
    shown, hit = run("xabyy", ["ab"], min_tokens=3)
    assert hit == "ab" and shown[-1] == "x"
    shown, hit = run("abab", ["ab"], min_tokens=5)  # never enough tokens: no stop
    assert hit is None and shown[-1] == "abab"
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))


def test_a_stop_string_asked_for_in_the_output_stays_at_its_end():
    shown, hit = run("say ok. then more", ["ok."], include_stop=True)
    assert hit == "ok." and shown[-1] == "say ok."
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))


def test_special_tokens_text_is_shown_only_when_not_skipped():
    assert run("a#b", [])[0][-1] == "ab"
    assert run("a#b", [], skip_special_tokens=False)[0][-1] == "a#b"
