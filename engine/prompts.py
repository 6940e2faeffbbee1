"""Prompts to token ids: plain text, and chat messages through the model's chat template.

The one place that renders prompts: the LLM API, `kvstrata ask`, the HTTP server (on its own
tokenizer threads) and the benchmarks all call these, so one prompt gives the same tokens (and the
same cached prefix) whichever way it arrives. Each function takes the tokenizer to use, because a
fast tokenizer must not be used by two threads at once: every thread passes its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# The system prompt of long-document QA (`kvstrata ask`, and documents preloaded from files).
QA_SYSTEM_PROMPT = "Answer the question using only the document. Be brief."
# Text a question may append to a document's last message. A byte-level BPE tokenizer can merge
# the document's last characters with what follows ("\n\n" is one token alone, two before
# "Question"), so a document's reusable prefix is what stays the same whatever of these follows.
_CONTINUATION_PROBES = ("Question", " question", "\n", ".", "1", "-", "\u00e9")


def tokenize_text(tokenizer, text: str, field: str = "prompt") -> list[int]:
    """Token ids of `text`, with the tokenizer's special tokens (e.g. BOS) as the model expects."""
    check_text(text, field)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# Names a chat template's extra variables (vLLM's `chat_template_kwargs`) may not take: they are the
# rendering call's own parameters, which a request sets by their own fields or not at all.
RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def render_chat(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template, by default ending with the
    prompt for the assistant's reply. `messages`: `{"role": str, "content": str}` objects.
    `continue_final_message` (vLLM's and transformers', without the reply's prompt): the last message
    is left open for the model to continue it, as a cached document is rendered. `template_kwargs`:
    more variables for the template (such as a model's switch for its thinking)."""
    validate_messages(messages)
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message: leaves the last message open, so it cannot be used with "
                         "add_generation_prompt: true (set that to false)")
    extra = dict(template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(extra))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is not a template variable this server lets a "
                         f"request set")
    if continue_final_message:
        extra["continue_final_message"] = True
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                            tokenize=True, **extra)
    except (TemplateError, TypeError, ValueError) as exc:  # a template that refuses these messages or variables
        raise ValueError(f"messages: the model's chat template cannot render them: {exc}") from None
    return _token_list(ids)


@dataclass(frozen=True)
class RenderedDocument:
    """A document rendered as the open start of the prompts that will extend it."""

    token_ids: list[int]
    # How many leading tokens every extension of the document starts with (<= len(token_ids)).
    num_stable_tokens: int


def render_document(tokenizer, *, messages: Sequence[dict] | None = None,
                    prompt: str | None = None) -> RenderedDocument:
    """A document as the start of later prompts: `messages` rendered as an open conversation (the chat
    template's `continue_final_message`: no end of turn, no generation prompt), so a chat request
    whose last message extends the document's last message starts with the same tokens; or a plain
    `prompt` that completions will extend."""
    if (messages is None) == (prompt is None):
        raise ValueError("give the document as messages or as a prompt (one of them)")
    if messages is not None:
        validate_messages(messages)
        if not messages[-1]["content"].strip():
            raise ValueError(f"messages[{len(messages) - 1}].content is empty: it is the document's open end")

    def render(tail: str) -> list[int]:
        """The document followed by `tail` (appended to its last message)."""
        if prompt is not None:
            return tokenize_text(tokenizer, prompt + tail)
        extended = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + tail}]
        return _token_list(tokenizer.apply_chat_template(extended, continue_final_message=True, tokenize=True))

    token_ids = render("")
    stable = len(token_ids)
    for tail in _CONTINUATION_PROBES:
        stable = min(stable, _common_prefix_len(token_ids, render(tail)))
    return RenderedDocument(token_ids, stable)


def document_prefix_messages(document: str) -> list[dict]:
    """The open start of every question about `document` in long-document QA."""
    return [{"role": "system", "content": QA_SYSTEM_PROMPT},
            {"role": "user", "content": f"Document:\n{document.strip()}\n\n"}]


def document_messages(document: str, question: str) -> list[dict]:
    """The chat for one question. The document comes before the question, so that the prompts of
    all questions about one document share it as their prefix (and hit the cache)."""
    messages = document_prefix_messages(document)
    messages[-1]["content"] += f"Question: {question.strip()}"
    return messages


def _token_list(ids) -> list[int]:
    """A chat template's token ids (newer transformers return a BatchEncoding)."""
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        for key in ("role", "content"):
            check_text(m[key], f"messages[{i}].{key}")


def check_text(text: str, field: str) -> None:
    """ValueError naming `field` unless `text` is valid Unicode."""
    problem = unicode_problem(text)
    if problem is not None:
        raise ValueError(f"{field} is not valid Unicode text: {problem}")


def unicode_problem(text: str) -> str | None:
    """What makes `text` invalid Unicode, or None. JSON can carry a lone surrogate such as \\ud800,
    which no tokenizer (and no UTF-8 encoder) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate {text[exc.start]!r} at character {exc.start}"
    return None
