"""Incremental detokenizing with stop strings: one token per character, then real tokenizers."""
from __future__ import annotations

import pytest

from kvstrata.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer


@pytest.fixture(scope="module")
def real_tokenizer(embedded_model_fp32):
    return embedded_model_fp32.tokenizer  # the model is loaded once for the whole run


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


class CountingTokenizer:
    """A real tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_tokens = 0

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        self.decoded_tokens += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def stream(tokenizer, token_ids: list[int], stop: list[str] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    return [detok.update(token_ids[:n], final=n == len(token_ids))[0] for n in range(1, len(token_ids) + 1)]


def test_streamed_text_ends_as_the_whole_decode_and_only_grows(real_tokenizer):
    import pydoc_data.topics

    tokenizer = real_tokenizer
    # characters of several UTF-8 bytes, which byte-level tokens split, beside plain English
    text = pydoc_data.topics.topics["types"][:3000] + " 東京の天気は晴れ 🙂🚀 naïve café — done"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    shown = stream(tokenizer, token_ids)
    assert shown[-1] == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))
    assert not any("\ufffd" in s for s in shown)  # half a character is never shown


def test_each_token_decodes_a_few_tokens_not_the_whole_answer(real_tokenizer):
    import pydoc_data.topics

    counting = CountingTokenizer(real_tokenizer)
    token_ids = real_tokenizer.encode(pydoc_data.topics.topics["types"][:8000], add_special_tokens=False)
    shown = stream(counting, token_ids, stop=["never in the text"])
    assert shown[-1] == real_tokenizer.decode(token_ids)
    # decoding everything again at each token would be about n^2 / 2 tokens
    assert counting.decoded_tokens < 8 * len(token_ids)


def test_tokens_without_text_or_with_broken_bytes_neither_stall_the_text_nor_grow_the_work(real_tokenizer):
    tokenizer = real_tokenizer
    words = tokenizer.encode(" one two three four five six seven eight nine ten", add_special_tokens=False)
    lone_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")  # 0x80-ish
    token_ids = words + [tokenizer.eos_token_id] * 300 + words + [lone_byte] * 300 + words
    counting = CountingTokenizer(tokenizer)
    shown = stream(counting, token_ids)
    assert shown[-1] == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))
    # a bounded window per token (pending ones decoded again up to MAX_PENDING_TOKENS times), where a
    # window growing over the 300 broken bytes would decode about 300^2 tokens
    assert counting.decoded_tokens < 4 * MAX_PENDING_TOKENS * len(token_ids)
    # the words after the special tokens show as soon as they are complete
    assert shown[len(words) + 300 + len(words) - 1] == tokenizer.decode(words + words)
    # with special tokens kept, their text is part of the answer
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert kept.update(words + [tokenizer.eos_token_id], final=True)[0] == tokenizer.decode(
        words + [tokenizer.eos_token_id], skip_special_tokens=False)


def test_an_answer_cut_inside_a_character_ends_before_it(real_tokenizer):
    token_ids = real_tokenizer.encode("Party 🎉🎉", add_special_tokens=False)
    whole = real_tokenizer.decode(token_ids)
    cut = next(n for n in range(len(token_ids), 0, -1) if real_tokenizer.decode(token_ids[:n]).endswith("\ufffd"))
    shown = stream(real_tokenizer, token_ids[:cut])
    assert shown[-1] == real_tokenizer.decode(token_ids[:cut]).rstrip("\ufffd")
    assert whole.startswith(shown[-1]) and shown[-1].endswith("🎉")  # the whole characters before the cut stay
    # a lone invalid byte inside the answer is still shown: only the cut at the end is left out
    lone_byte = next(i for i in range(real_tokenizer.vocab_size) if real_tokenizer.decode([i]) == "\ufffd")
    words = real_tokenizer.encode(" one two", add_special_tokens=False)
    assert stream(real_tokenizer, words + [lone_byte] * (MAX_PENDING_TOKENS + 2) + words)[-1].count("\ufffd") > 0


def word_tokenizer(**options):
    """SentencePiece-style words ("▁world": the word and the space before it) and punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁.": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **options)


def test_a_word_piece_keeps_its_leading_space_when_decoded_on_its_own():
    # SentencePiece-style tokens ("▁world") lose their leading space at the start of a decode: the new
    # token is decoded after the one before it, never alone
    tokenizer = word_tokenizer()
    assert tokenizer.decode([2]) == "world"
    assert stream(tokenizer, [1, 2, 2, 3, 1]) == ["hello", "hello world", "hello world world", "hello world world!",
                                                  "hello world world! hello"]


def test_a_tokenizer_that_cleans_up_spaces_streams_its_cleaned_text():
    # transformers' clean-up joins " ." to the word before it: its own decode is used, not the library's
    tokenizer = word_tokenizer(clean_up_tokenization_spaces=True)
    assert tokenizer.decode([1, 4, 2]) == "hello. world"
    assert stream(tokenizer, [1, 4, 2]) == ["hello", "hello.", "hello. world"]
