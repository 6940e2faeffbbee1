"""`kvstrata ask`: long-document QA from the terminal."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from server_process import DEFAULT_CONFIG, REPO, server_env

DOCUMENT = (
    "The Harbor Street library opened in 1921 and was designed by the architect Mara Velde. "
    "It holds 42,000 books and a collection of old maps of the river delta. In 1987 a fire destroyed "
    "the east wing, which was rebuilt two years later with a glass roof. The head librarian, Tomas Reyl, "
    "started a Saturday reading club for children in 2004.\n"
)
SUMMARY = re.compile(r"\[ttft (\d+\.\d+) s · cached (\d+)/(\d+) tokens: device (\d+), cpu (\d+), disk (\d+), remote (\d+)\]")
RECEIPT = re.compile(r"\[ttft (\S+) ms = queue (\S+) \+ lookup (\S+) \+ load (\S+)(?: \([^)]*\))? \+ prefill (\S+) "
                     r"· prefill saved ≈ (\S+) s \(estimate\)\]")


def ask(*args: str, tmp_path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvstrata", "ask", "--config", str(DEFAULT_CONFIG),
               "--set", "model.dtype=float32", "--set", "cache.tiers.device.size=64",
               "--set", f"cache.tiers.disk.path={tmp_path / 'kvstore'}", *args]
    return subprocess.run(command, capture_output=True, text=True, env=server_env(), cwd=REPO, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ask_answers_each_question_and_the_second_reuses_the_cached_document(tmp_path):
    doc = tmp_path / "library.txt"
    doc.write_text(DOCUMENT)
    result = ask("--doc", str(doc), "--max-tokens", "6", "Who designed the library?", "When was the fire?",
                 tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("Q: ") == 2 and out.count("A: ") == 2
    assert out.index("Who designed the library?") < out.index("When was the fire?")
    summaries = [tuple(map(float, m.groups())) for m in SUMMARY.finditer(out)]
    assert len(summaries) == 2
    (_, cached_1, prompt_1, *_), (_, cached_2, prompt_2, device, cpu, disk, remote) = summaries
    assert prompt_1 > 64 and prompt_2 > 64
    assert cached_2 >= prompt_2 / 2  # the document, shared by both questions
    assert device + cpu + disk + remote == cached_2
    receipts = [tuple(map(float, m.groups())) for m in RECEIPT.finditer(out)]
    assert len(receipts) == 2
    for ttft, queue, lookup, load, prefill, _ in receipts:
        assert abs(queue + lookup + load + prefill - ttft) <= 0.05 * ttft
    assert receipts[0][-1] == 0 and receipts[1][-1] > 0  # the second question's cached document saved prefill
    answers = re.findall(r"^A: (.*)$", out, re.MULTILINE)
    assert all(answer.strip() for answer in answers)


CHOICES_SUMMARY = re.compile(r"\[3 choices in \S+ s · cached (\d+)/(\d+) prompt tokens: device (\d+), cpu (\d+), "
                             r"disk (\d+), remote (\d+)\]")
CHOICE_LINE = re.compile(r"^ +(-?\d+\.\d+)  \((-?\d+\.\d+) a token\)  (.*?)(   <- best)?$", re.MULTILINE)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ask_with_choices_ranks_them_and_scores_the_document_once(tmp_path):
    doc = tmp_path / "library.txt"
    doc.write_text(DOCUMENT)
    choices = ["In 1987.", "In 2004.", "Mara Velde."]
    result = ask("--doc", str(doc), "When was the fire?", "Who designed the library?",
                 *(arg for c in choices for arg in ("--choice", c)), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("Q: ") == 2 and "A: " not in out
    lines = CHOICE_LINE.findall(out)
    assert len(lines) == 6
    for question in (lines[:3], lines[3:]):
        per_token = [float(mean) for _, mean, *_ in question]
        assert per_token == sorted(per_token, reverse=True) and all(float(t) < 0 for t, *_ in question)  # best first
        assert sorted(text for *_, text, _ in question) == sorted(choices)
        assert [bool(best) for *_, best in question] == [True, False, False]
    (first_cached, first_prompt, *_), (second_cached, second_prompt, *_) = [
        tuple(map(int, m.groups())) for m in CHOICES_SUMMARY.finditer(out)]
    # one choice computes the document and the others wait for it: two of the three prompts mostly cached;
    # the second question finds it cached for all three
    assert first_cached >= first_prompt // 3 and second_cached > first_cached


def test_ask_about_a_missing_file_is_one_line_error_and_exit_2(tmp_path):
    result = ask("--doc", str(tmp_path / "missing.txt"), "Anything?", tmp_path=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvstrata: error: --doc: no such file {str(tmp_path / 'missing.txt')!r}"]
    assert result.stdout == ""


class _ShortContextEngine:
    """Just what the prompt check reads from an engine: the chat template and the context length."""

    max_model_len = 100

    def apply_chat_template(self, messages) -> list[int]:
        return [0] * sum(len(m["content"].split()) for m in messages)


def test_document_too_long_for_the_context_is_one_line_error_suggesting_what_to_change():
    from pathlib import Path

    from kvstrata.engine.qa import _document_prompt

    with pytest.raises(ValueError) as error:
        _document_prompt(_ShortContextEngine(), "word " * 200, "Why?", 16, Path("big.txt"))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--doc: big.txt with the question is ")
    assert "exceeds the context of 100 tokens" in message
    assert "cut the document" in message and "model.max_model_len" in message


@pytest.mark.parametrize("content,problem", [(b"", "is empty"), (b"  \n", "is empty"),
                                             (b"\xff\xfe\x00bad", "is not UTF-8 text")])
def test_unusable_document_is_one_line_error(tmp_path, content, problem):
    from kvstrata.engine.qa import read_document

    doc = tmp_path / "doc.txt"
    doc.write_bytes(content)
    with pytest.raises(ValueError, match=f"^--doc: .* {problem}$"):
        read_document(doc)


def test_document_that_is_a_directory_is_one_line_error(tmp_path):
    from kvstrata.engine.qa import read_document

    with pytest.raises(ValueError, match="is a directory, not a text file$"):
        read_document(tmp_path)


def test_long_prefill_shows_progress_from_the_cached_tokens_until_the_first_token(capsys):
    from kvstrata.engine.qa import prefill_progress
    from kvstrata.engine.request import Request
    from kvstrata.engine.sampling import SamplingParams

    request = Request("r", list(range(1000)), SamplingParams(max_tokens=4))
    request.cached_tokens_by_tier = {"device": 0, "cpu": 256, "disk": 0, "remote": 0}
    request.num_computed_tokens = 256 + 300  # one 300-token chunk computed after the cached prefix
    bar = prefill_progress(None, request)
    assert bar is not None and (bar.n, bar.total) == (556, 1000)
    request.num_computed_tokens = 856
    assert prefill_progress(bar, request) is bar and bar.n == 856
    request.first_token_time = request.arrival_time + 1.0
    assert prefill_progress(bar, request) is None
    assert "prefill" in capsys.readouterr().err


def _no_model(*_args, **_kwargs):
    raise AssertionError("a bad argument must be refused before the model is loaded")


@pytest.mark.parametrize("questions, choices, error, message", [
    ("Why?", None, TypeError, r"^questions must be a list of strings \(put a single one in a list\), got str$"),
    ([], None, ValueError, r"^questions: give at least one$"),
    ([None], None, ValueError, r"^questions\[0\] must be a non-empty string, got None$"),
    (["Why?", "  "], None, ValueError, r"^questions\[1\] must be a non-empty string, got '  '$"),
    (["Why?"], "disk", TypeError, r"^choices must be a list of strings \(put a single one in a list\), got str$"),
    (["Why?"], [], ValueError, r"^choices: give at least one$"),
    (["Why?"], ["disk", 5], ValueError, r"^choices\[1\] must be a non-empty string, got 5$"),
])
def test_ask_and_score_choices_refuse_a_bare_string_or_a_bad_item_naming_it_before_loading(
        tmp_path, monkeypatch, questions, choices, error, message):
    from kvstrata.engine import qa
    from kvstrata.engine.config import load_config

    monkeypatch.setattr(qa, "LLM", _no_model)
    doc = tmp_path / "doc.txt"
    doc.write_text(DOCUMENT)
    with pytest.raises(error, match=message):
        if choices is None:
            qa.ask(load_config(), doc, questions, max_tokens=2)
        else:
            qa.score_choices(load_config(), doc, questions, choices)
