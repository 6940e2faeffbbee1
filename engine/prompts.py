"""Prompts to token ids: plain text, and chat messages through the model's chat template.

The one place that renders prompts: the LLM API, `kvstrata ask`, the HTTP server (on its own
tokenizer threads) and the benchmarks all call these, so one prompt gives the same tokens (and the
same cached prefix) whichever way it arrives. Each function takes the tokenizer to use, because a
fast tokenizer must not be used by two threads at once: every thread passes its own.
"""
from __future__ import annotations

from typing import Any, Sequence


def tokenize_text(tokenizer, text: str, field: str = "prompt") -> list[int]:
    """Token ids of `text`, with the tokenizer's special tokens (e.g. BOS) as the model expects."""
    check_text(text, field)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def render_chat(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation rendered by the model's chat template, ending with the prompt
    for the assistant's reply. `messages`: `{"role": str, "content": str}` objects."""
    validate_messages(messages)
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


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
