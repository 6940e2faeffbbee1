"""The long-document QA workload of the TTFT benchmark: documents, questions, orders, working set.

A prompt is one chat message `document + question`, document first, so that every question on a
document shares the document as its prefix. Documents are sections of the Python language reference
(`pydoc_data.topics`), cut to a token budget; questions come from `benchmarks/data/longdoc_qa_dev.jsonl`.

Two request orders, both interleaved so that the working set (every document at once) exceeds the
device tier:

- round robin: question 0 of every document, then question 1 of every document, ...: each document
  comes back only after all the others, the worst case for an LRU device tier;
- Zipf: documents drawn with probability ~ 1 / rank**s (a few hot documents, a long tail), seeded.

Nothing here loads a model: tokenizing and rendering are passed in as functions, so the builder is
tested with a toy tokenizer.
"""
from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

ROUND_ROBIN = "round_robin"
ZIPF = "zipf"
DOC_PREFIX = "pydoc_data.topics:"
DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data" / "longdoc_qa_dev.jsonl"  # the development set

# (document index, question index) in the order the requests are sent
Order = list[tuple[int, int]]
# The Zipf pass comes back to questions the round-robin pass asked: it asks them in other words, so
# that every request brings a suffix no earlier request had (as different users would), and a hit
# always computes the question, whatever tier served the document.
REPHRASINGS = ("In one sentence: {question}", "According to the document, {question}",
               "Briefly: {question}", "Quote the relevant passage: {question}")


@dataclass(frozen=True)
class QAPrompt:
    """One request of the workload; `token_ids` is the chat-templated prompt every system is given."""

    phase: str                  # ROUND_ROBIN | ZIPF
    doc: str                    # "pydoc_data.topics:try"
    doc_index: int
    question_index: int
    question: str
    content: str                # the user message: document, then question
    token_ids: tuple[int, ...]
    repeat: bool                # the document was asked about earlier in the workload


def load_questions(path: str | Path) -> "OrderedDict[str, list[str]]":
    """Questions per document, documents in the order the file first names them."""
    by_doc: OrderedDict[str, list[str]] = OrderedDict()
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("doc"), str) or not isinstance(row.get("question"), str):
                raise ValueError(f"{path}:{line_number}: each line needs string 'doc' and 'question'")
            by_doc.setdefault(row["doc"], []).append(row["question"])
    return by_doc


def load_document(doc: str) -> str:
    """The text of `pydoc_data.topics:NAME`, shipped with CPython (nothing is downloaded)."""
    if not doc.startswith(DOC_PREFIX):
        raise ValueError(f"document {doc!r}: only {DOC_PREFIX}NAME documents are known")
    from pydoc_data.topics import topics

    name = doc[len(DOC_PREFIX):]
    if name not in topics:
        raise ValueError(f"document {doc!r}: pydoc_data.topics has no section {name!r}")
    return topics[name]


def cut_document(text: str, max_tokens: int, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str]) -> str:
    """The document's first `max_tokens` tokens, as text (the whole text when it is shorter)."""
    if max_tokens < 1:
        raise ValueError(f"doc tokens must be >= 1, got {max_tokens}")
    ids = encode(text)
    return text if len(ids) <= max_tokens else decode(ids[:max_tokens])


def qa_content(document: str, question: str) -> str:
    """The user message of a question on a document: the document first, so that it is the shared prefix."""
    return f"{document}\n\nQuestion: {question}"


def rephrased(question: str, round_: int) -> str:
    """`question` asked again in other words (round 1, 2, ...), so that its prompt is new; round 0 is itself."""
    return question if round_ == 0 else REPHRASINGS[(round_ - 1) % len(REPHRASINGS)].format(question=question)


def round_robin_order(num_docs: int, num_questions: int) -> Order:
    """Every document's question 0, then every document's question 1, ..."""
    return [(d, q) for q in range(num_questions) for d in range(num_docs)]


def zipf_order(num_docs: int, num_questions: int, num_requests: int, exponent: float, seed: int) -> Order:
    """`num_requests` documents drawn with P(rank k) ~ 1 / k**exponent (document 0 hottest);
    each draw asks the document's next question, cycling. The same seed gives the same order."""
    if num_docs < 1 or num_questions < 1:
        raise ValueError("zipf order needs at least one document and one question")
    rng = random.Random(seed)
    weights = [1.0 / (rank ** exponent) for rank in range(1, num_docs + 1)]
    asked = [0] * num_docs
    order: Order = []
    for d in rng.choices(range(num_docs), weights=weights, k=num_requests):
        order.append((d, asked[d] % num_questions))
        asked[d] += 1
    return order


def working_set_blocks(token_id_lists: Sequence[Sequence[int]], block_size: int) -> int:
    """Distinct full KV blocks across the prompts: a block is named by its whole prefix, as the
    engine's chain hash names it, so the blocks of a shared document are counted once."""
    seen: set[int] = set()
    for ids in token_id_lists:
        parent = 0
        for start in range(0, len(ids) - block_size + 1, block_size):
            parent = hash((parent, tuple(ids[start:start + block_size])))
            seen.add(parent)
    return len(seen)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Device blocks a request of `num_tokens` tokens occupies (the last one may be partial)."""
    return -(-num_tokens // block_size)


def build_workload(documents: "OrderedDict[str, str]", questions: "OrderedDict[str, list[str]]",
                   num_questions: int, zipf_requests: int, zipf_exponent: float, seed: int,
                   render: Callable[[str], list[int]]) -> list[QAPrompt]:
    """The round-robin pass over every (document, question), then `zipf_requests` Zipf draws whose
    questions are rephrased (`REPHRASINGS`), so that no two requests send the same prompt.

    `documents`: name -> (already cut) text, in popularity order for the Zipf draws;
    `render`: user message -> chat-templated token ids.
    """
    names = list(documents)
    for name in names:
        if len(questions.get(name, [])) < num_questions:
            raise ValueError(f"document {name!r} has {len(questions.get(name, []))} questions, "
                             f"fewer than the {num_questions} asked for")
    phases = [(ROUND_ROBIN, round_robin_order(len(names), num_questions)),
              (ZIPF, zipf_order(len(names), num_questions, zipf_requests, zipf_exponent, seed))]
    seen_docs: set[int] = set()
    zipf_draws = [0] * len(names)
    prompts = []
    for phase, order in phases:
        for d, q in order:
            question = questions[names[d]][q]
            if phase == ZIPF:
                question = rephrased(question, zipf_draws[d] // num_questions + 1)
                zipf_draws[d] += 1
            content = qa_content(documents[names[d]], question)
            prompts.append(QAPrompt(phase, names[d], d, q, question, content, tuple(render(content)),
                                    repeat=d in seen_docs))
            seen_docs.add(d)
    return prompts
