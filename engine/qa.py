"""Long-document QA from the terminal: `kvstrata ask --doc FILE "question" ...`.

Each question becomes one chat prompt with the document first and the question after it, so every
question shares the document as its prefix: the first question computes the document's KV blocks,
the later ones find them in the cache (and a later run finds them in the disk tier). Answers stream
to stdout as they are generated, each followed by its measured TTFT, the tiers that served the
document, and its cache receipt (where the TTFT went, engine/receipt.py):

    Q: Who wrote the report?
    A: The report was written by ...
       [ttft 0.21 s · cached 2032/2061 tokens: device 0, cpu 2032, disk 0]
       [ttft 209.3 ms = queue 0.1 + lookup 0.4 + load 11.8 (cpu 11.8) + prefill 197.0 · prefill saved ≈ 3.90 s (estimate)]

With `--choice` (repeatable), each question is a multiple choice instead: every choice is scored as
the answer by its log-likelihood given the document and the question (the sum of its tokens'
log-probabilities, as evaluation harnesses score answers), and printed best first by that sum per
token (a longer answer has more tokens to lose probability on; lm-evaluation-harness's `acc_norm`
normalises likewise, by characters). The document is computed once: the choices of a question are
scored at once, and the later questions find the document's blocks and their log-probabilities in
the cache.

    Q: When is the finally clause executed?
         -41.07  (-2.57 a token)  On the way out of the try statement, whether or not an exception occurred.   <- best
         -19.22  (-2.75 a token)  Only when an exception is raised.
         -10.84  (-5.42 a token)  Never.
       [3 choices in 0.68 s · cached 6032/6136 prompt tokens: device 6032, cpu 0, disk 0, remote 0]
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

from tqdm import tqdm

from kvstrata.engine.config import Config
from kvstrata.engine.llm import LLM, RequestOutput
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.prompts import document_messages
from kvstrata.engine.receipt import CacheReceipt
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import SamplingParams

def ask(config: Config, doc_path: str | Path, questions: Sequence[str], max_tokens: int = 256,
        out: TextIO | None = None) -> list[RequestOutput]:
    """Answer each question about the document (greedy), printing as it goes; returns the answers.

    The LLM is loaded once for all questions and closed at the end, which writes the document's
    blocks down to the disk tier for the next run.
    """
    check_texts("questions", questions)
    out = out or sys.stdout
    document = read_document(doc_path)
    with LLM(config) as llm:
        answers = []
        for question in questions:
            prompt_token_ids = _document_prompt(llm.engine, document, question, max_tokens, Path(doc_path))
            answers.append(_answer(llm.engine, f"ask-{len(answers)}", question, prompt_token_ids, max_tokens, out))
        return answers


@dataclass
class ScoredChoice:
    choice: str
    logprob: float      # the sum of its tokens' log-probabilities given the document and the question
    num_tokens: int

    @property
    def per_token(self) -> float:
        return self.logprob / max(self.num_tokens, 1)


def score_choices(config: Config, doc_path: str | Path, questions: Sequence[str], choices: Sequence[str],
                  out: TextIO | None = None) -> list[list[ScoredChoice]]:
    """Score every choice as the answer to each question about the document, printing each question's
    choices best first (by log-likelihood per token); returns them in the order given, per question."""
    check_texts("questions", questions)
    check_texts("choices", choices)
    out = out or sys.stdout
    document = read_document(doc_path)
    with LLM(config) as llm:
        scored = []
        for question in questions:
            context = _document_prompt(llm.engine, document, question, 0, Path(doc_path))
            answers = [llm.tokenizer(c, add_special_tokens=False)["input_ids"] for c in choices]
            started = time.perf_counter()
            outs = llm.generate([context + a for a in answers],
                                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
            seconds = time.perf_counter() - started
            # entry k is prompt token k+1's: an answer's are those after the context's last
            scored.append([ScoredChoice(c, sum(e.logprob for e in o.prompt_logprobs[len(context) - 1:]), len(a))
                           for c, a, o in zip(choices, answers, outs)])
            _print_choices(question, scored[-1], outs, seconds, out)
        return scored


def _print_choices(question: str, scored: list[ScoredChoice], outs: list[RequestOutput], seconds: float,
                   out: TextIO) -> None:
    out.write(f"Q: {question.strip()}\n")
    ranked = sorted(scored, key=lambda s: s.per_token, reverse=True)
    for rank, s in enumerate(ranked):
        best = "   <- best" if rank == 0 else ""
        out.write(f"   {s.logprob:8.2f}  ({s.per_token:.2f} a token)  {s.choice.strip()}{best}\n")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = {tier: sum(o.cached_tokens_by_tier[tier] for o in outs) for tier in outs[0].cached_tokens_by_tier}
    by_tier = ", ".join(f"{tier} {n}" for tier, n in cached.items())
    out.write(f"   [{len(scored)} choices in {seconds:.2f} s · cached {sum(cached.values())}/{prompt_tokens} "
              f"prompt tokens: {by_tier}]\n\n")
    out.flush()


def check_texts(name: str, texts: Sequence[str]) -> None:
    """`texts` (the questions, the choices) is a non-empty list of non-empty strings. A bare string is
    refused, not taken as one item: iterated, it would be a list of one-character texts."""
    if not isinstance(texts, (list, tuple)):
        hint = " (put a single one in a list)" if isinstance(texts, str) else ""
        raise TypeError(f"{name} must be a list of strings{hint}, got {type(texts).__name__}")
    if not texts:
        raise ValueError(f"{name}: give at least one")
    for k, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name}[{k}] must be a non-empty string, got {text!r:.40}")


def read_document(doc_path: str | Path) -> str:
    path = Path(doc_path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--doc: no such file {str(path)!r}") from None
    except IsADirectoryError:
        raise ValueError(f"--doc: {str(path)!r} is a directory, not a text file") from None
    except UnicodeDecodeError:
        raise ValueError(f"--doc: {str(path)!r} is not UTF-8 text") from None
    except OSError as exc:
        raise ValueError(f"--doc: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not text.strip():
        raise ValueError(f"--doc: {str(path)!r} is empty")
    return text


def _document_prompt(engine: LLMEngine, document: str, question: str, max_tokens: int, path: Path) -> list[int]:
    token_ids = engine.apply_chat_template(document_messages(document, question))
    if len(token_ids) + max_tokens > engine.max_model_len:
        raise ValueError(f"--doc: {path.name} with the question is {len(token_ids)} tokens; with --max-tokens "
                         f"{max_tokens} that exceeds the context of {engine.max_model_len} tokens: cut the document, "
                         f"lower --max-tokens, or raise model.max_model_len if the model allows more")
    return token_ids


def _answer(engine: LLMEngine, request_id: str, question: str, prompt_token_ids: list[int], max_tokens: int,
            out: TextIO) -> RequestOutput:
    """Generate one answer, streaming its text to `out` as the engine produces it."""
    request = engine.add_request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    out.write(f"Q: {question.strip()}\nA: ")
    out.flush()
    shown = 0
    progress = None
    try:
        while not request.is_finished:
            engine.step()
            progress = prefill_progress(progress, request)
            out.write(request.output_text[shown:])  # the text only grows: print what is new
            shown = len(request.output_text)
            out.flush()
    except BaseException:
        engine.abort_request(request_id)
        raise
    finally:
        if progress is not None:
            progress.close()
        engine.release(request_id)
    answer = RequestOutput.from_request(request)
    out.write(f"\n   {cache_summary(answer)}\n")
    if answer.receipt is not None:
        out.write(f"   {receipt_summary(answer.receipt)}\n")
    out.write("\n")
    out.flush()
    return answer


def prefill_progress(bar: tqdm | None, request: Request) -> tqdm | None:
    """A progress bar on stderr while a long prompt is prefilled in several chunks (one engine step
    each); it starts at the tokens served from the cache and closes at the first token."""
    if request.first_token_time is not None:
        if bar is not None:
            bar.close()
        return None
    if bar is None:
        bar = tqdm(total=request.num_prompt_tokens, initial=request.num_cached_tokens, desc="prefill",
                   unit="tok", leave=False, file=sys.stderr, dynamic_ncols=True)
    bar.update(request.num_computed_tokens - bar.n)
    return bar


def cache_summary(answer: RequestOutput) -> str:
    """`[ttft 0.21 s · cached 2032/2061 tokens: device 0, cpu 2032, disk 0]`"""
    ttft = "ttft n/a" if answer.ttft_s is None else f"ttft {answer.ttft_s:.2f} s"
    by_tier = ", ".join(f"{tier} {n}" for tier, n in answer.cached_tokens_by_tier.items())
    return f"[{ttft} · cached {answer.cached_tokens}/{len(answer.prompt_token_ids)} tokens: {by_tier}]"


def receipt_summary(receipt: CacheReceipt) -> str:
    """`[ttft 209.3 ms = queue 0.1 + lookup 0.4 + load 11.8 (cpu 11.8) + prefill 197.0 · prefill saved ≈ 3.90 s
    (estimate)]`: the load's tiers are those it read from."""
    tiers = ", ".join(f"{tier} {ms:.1f}" for tier, ms in receipt.load_ms_by_tier.items() if ms > 0)
    load = f"load {receipt.load_ms:.1f}" + (f" ({tiers})" if tiers else "")
    return (f"[ttft {receipt.ttft_ms:.1f} ms = queue {receipt.queue_ms:.1f} + lookup {receipt.lookup_ms:.1f} + {load} "
            f"+ prefill {receipt.prefill_ms:.1f} · prefill saved ≈ {receipt.prefill_saved_ms_estimate / 1e3:.2f} s "
            f"(estimate)]")
