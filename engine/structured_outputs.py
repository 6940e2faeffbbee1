"""Structured outputs: answers held to a JSON schema, or to any JSON object (OpenAI's `response_format`,
vLLM's `structured_outputs`), by masking at each step every token that would break it.

xgrammar does the grammar work (the mechanism vLLM and SGLang use): a schema is compiled once per
tokenizer into a grammar whose token masks are precomputed, a request keeps a matcher that follows
its tokens, and before each sampling the matcher fills the row's mask of allowed tokens. The mask is
applied after the sampling adjustments (temperature, penalties, bias), so sampling, top-k/p and
seeds work as ever within what the grammar allows; reported log-probabilities stay the model's raw
ones. A request ends ("stop") as soon as its JSON is complete: the grammar allows nothing after it.

Whitespace between JSON tokens is fixed (`", "` and `": "`, as Python's json.dumps writes it): a
grammar that allowed any would let a small model spend its tokens on blank lines.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # the server's request schemas import this module: it must not pay for torch
    import torch

ANY_OBJECT = '{"type": "object"}'
# How xgrammar's messages start ("[12:00:00] /project/cpp/json_schema_converter.cc:4944: "): not the user's business.
_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
# Compiled grammars kept for reuse (a service asks with the same few schemas): at most this many bytes.
GRAMMAR_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What an answer must be: JSON that `json` (a JSON schema, as a dict or its JSON text) accepts,
    or with `json_object=True`, any JSON object. Exactly one of the two."""

    json: str | dict | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs: json_object must be true or false, got {self.json_object!r}")
        if (self.json is None) == (not self.json_object):
            raise ValueError("structured_outputs: give a JSON schema (json) or json_object=True, exactly one")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))


def _schema_text(schema: str | dict) -> str:
    """The schema as compact JSON text, its keys in their order (the answer's fields come in the order
    of the schema's properties); ValueError (one line) if it is not a JSON object."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs: the JSON schema is not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs: a JSON schema is a JSON object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs: the JSON schema cannot be written as JSON ({exc})") from None


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary, compiled on first use and cached. Thread-safe: the
    server compiles a request's grammar when it validates it, the engine thread reuses it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    def _xgrammar_compiler(self):
        with self._lock:  # built on first use: most servers never see a structured request
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                          cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (cached); ValueError, in one line, for a schema it cannot follow."""
        compiler = self._xgrammar_compiler()
        try:
            if params.json_object:  # any object (not any JSON value, as OpenAI's json_object), in the same style
                return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False, strict_mode=False)
            return compiler.compile_json_schema(params.json, any_whitespace=False)
        except (RuntimeError, ValueError) as exc:  # xgrammar's words for a schema it cannot compile
            problem = _SOURCE_LOCATION.sub("", " ".join(str(exc).split()))[:300]
            raise ValueError(f"structured_outputs: the JSON schema cannot be followed: {problem}") from None

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        import xgrammar

        return GrammarMatcher(xgrammar.GrammarMatcher(self.compile(params), terminate_without_stop_token=True))


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any):
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Follow a sampled token; False if the grammar does not allow it (nothing changes then)."""
        return bool(self._matcher.accept_token(token_id))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows next into `bitmask`'s row `row`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def complete(self) -> bool:
        """The answer is a whole JSON value of the grammar: nothing may follow."""
        return bool(self._matcher.is_terminated())


def mask_logits(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None], raw: torch.Tensor) -> torch.Tensor:
    """`logits` with each row's tokens its grammar does not allow next set to -inf (rows with no
    matcher are left alone): a copy when any row has a grammar, the caller's tensors left as they
    are. One bitmask for the batch, filled row by row, applied at once. A row that the sampling
    adjustments and its grammar leave without any token (stop_token_ids held back by min_tokens that
    the grammar asks for) takes the grammar's tokens at the model's `raw` logits instead: a grammar
    is never broken, and nothing is drawn from nothing."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill(bitmask, i)
    bitmask = bitmask.to(logits.device)
    masked = logits.float().clone()
    xgrammar.apply_token_bitmask_inplace(masked, bitmask, indices=rows)
    none_left = masked[rows].isneginf().all(dim=-1).tolist()
    dead = [i for i, empty in zip(rows, none_left) if empty]
    if dead:
        masked[dead] = raw[dead].float()
        xgrammar.apply_token_bitmask_inplace(masked, bitmask, indices=dead)
    return masked

