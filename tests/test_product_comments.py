"""Product code states why, not what was measured where: no comment or docstring under engine/, tiers/,
kernels/ or kvstrata/ holds a timing figure, a machine's name or a path into benchmarks/results/. Those
belong with the run that measured them (the reports, benchmarks/results/history.md, the commit message);
a figure that is behaviour (a default, a constant, an error message) lives in code and configs, where
this test does not look."""
from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "tiers", "kernels", "kvstrata")

_NUMBER = r"(?<![\w.])~?\d+(?:[.,]\d+)?k?"
_RANGE = rf"{_NUMBER}(?:\s?(?:-|–|to)\s?\d+(?:\.\d+)?)?"
KINDS = {
    "results path": re.compile(r"benchmarks/results"),
    "machine name": re.compile(
        r"\b(?:[ABHV]100|H200|GH200|B200|A10G?|L40S?|MI[23]\d\dX?|EPYC|Zen ?\d?|Xeon|Ryzen|Threadripper|Graviton\d?"
        r"|Skylake|Cascade Lake|Ice Lake|Sapphire Rapids|Apple M[1-4])\b"
        r"|\b\d+-(?:core|cpu|vcpu)\b|\b(?-i:VMs?)\b"
        r"|\bthis (?:machine|host|CPU|GPU|VM|box)\b|\bshared (?:machine|VM|box)\b",
        re.IGNORECASE),
    "timing figure": re.compile(
        rf"{_RANGE}\s?(?:ns|us|µs|μs|ms|s|secs?|seconds?|minutes?|mins?|hours?"
        rf"|[KMGT]i?B/s|[KMGT]bit/s|tok(?:en)?s?/s)\b"
        rf"|{_RANGE} (?:tokens|blocks|requests|steps|calls) (?:a|per) second\b"),
    "speed ratio": re.compile(
        rf"{_RANGE}[x×](?!\w)"
        rf"|{_RANGE} times (?:faster|slower|longer|shorter|as (?:fast|slow|long))\b"),
}


# A literal is an example of what a user writes or reads (`timeout: 50ms`, a log line), not a measurement:
# text in backticks or double quotes, and a docstring's example blocks (after a blank line, indented 4 more).
LITERAL = re.compile(r'`[^`]*`|"[^"\n]*"')


def prose(text: str) -> str:
    """`text` with its literals blanked out, line breaks kept (so that line numbers hold)."""
    lines = text.split("\n")
    indents = [len(line) - len(line.lstrip()) for line in lines]
    body = min((indent for indent, line in zip(indents[1:], lines[1:]) if line.strip()), default=0)
    in_example = False
    for i in range(1, len(lines)):
        if lines[i].strip():
            in_example = indents[i] >= body + 4 and (in_example or not lines[i - 1].strip())
            if in_example:
                lines[i] = ""
    return LITERAL.sub(lambda match: re.sub(r"[^\n]", " ", match.group(0)), "\n".join(lines))


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line offset within `text`, kind, matched text) for each figure, name or path in one comment."""
    text = prose(text)
    return [(text.count("\n", 0, match.start()), kind, match.group(0))
            for kind, pattern in KINDS.items() for match in pattern.finditer(text)]


def python_comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment and every docstring (a string standing alone as a statement:
    modules', classes' and functions' docstrings, and those written under an attribute)."""
    texts = [(token.start[0], token.string)
             for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    texts += [(node.value.lineno, node.value.value)
              for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)]
    return texts


# A C comment, or a string or character literal, whichever starts first: a `//` inside a string is no comment.
C_TOKEN = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)


def c_comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every `//` and `/* */` comment."""
    return [(source.count("\n", 0, match.start()) + 1, match.group(0))
            for match in C_TOKEN.finditer(source) if match.group(0).startswith("/")]


def comment_findings(path: Path, source: str) -> list[tuple[str, str, str]]:
    """(`file:line`, kind, matched text) for each finding in the comments and docstrings of one source file."""
    texts = python_comments(source) if path.suffix == ".py" else c_comments(source)
    return sorted((f"{path}:{first + offset}", kind, found)
                  for first, text in texts for offset, kind, found in findings(text))


def product_sources() -> list[Path]:
    """Every .py, .c and .h file under the product's packages, relative to the repo; the links
    kvstrata/{engine,tiers,kernels} are not followed (their folders are listed themselves)."""
    paths = []
    for package in PACKAGES:
        for folder, _, names in os.walk(REPO / package):
            paths += [(Path(folder) / name).relative_to(REPO) for name in names
                      if name.endswith((".py", ".c", ".h"))]
    return sorted(paths)


def test_product_comments_hold_no_figures_machines_or_results_paths():
    sources = product_sources()
    assert len(sources) > 50, "the product's sources were not found"
    found = [f"{where}: {kind} {text!r}"
             for path in sources for where, kind, text in comment_findings(path, (REPO / path).read_text())]
    assert found == [], ("state the reason without the figure (history goes to benchmarks/results/history.md):\n"
                         + "\n".join(found))


PLANTED = {
    "results path": "see benchmarks/results/gpu.md",
    "machine name": "on one H200 this took longer",
    "timing figure": "the lookup took 2.4 ms",
    "speed ratio": "a frozen dataclass is built 2.5x slower",
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
@pytest.mark.parametrize("place", ["python comment", "python docstring", "python attribute docstring",
                                   "c line comment", "c block comment"])
def test_a_planted_figure_is_found_where_it_is_written(kind, place):
    text = PLANTED[kind]
    suffix, source, line = {
        "python comment": (".py", f"x = 1\ny = 2  # {text}\n", 2),
        "python docstring": (".py", f'def f():\n    """Why.\n\n    {text}."""\n', 4),
        "python attribute docstring": (".py", f'class C:\n    x: int = 1\n    """{text}."""\n', 3),
        "c line comment": (".c", f'const char *s = "// not a comment";\nint x; // {text}\n', 2),
        "c block comment": (".c", f"int x;\n/* Why.\n * {text}.\n */\n", 3),
    }[place]
    found = comment_findings(Path(f"kernels/planted{suffix}"), source)
    assert [(location, found_kind) for location, found_kind, _ in found] == [
        (f"kernels/planted{suffix}:{line}", kind)]


@pytest.mark.parametrize("kind, text", [
    ("machine name", "measured on a 2-core VM"),
    ("machine name", "on this machine it swung"),
    ("machine name", "an AMD EPYC (Zen 3)"),
    ("machine name", "one A100's memory rate"),
    ("timing figure", "~11 GB/s through numpy's memcpy"),
    ("timing figure", "it took 1.08 s of CPU"),
    ("timing figure", "27 us while quiet"),
    ("timing figure", "a load of 20-35 ms"),
    ("speed ratio", "15x longer at the median"),
    ("speed ratio", "6-9x"),
    ("speed ratio", "3 times faster"),
])
def test_each_way_of_writing_a_figure_is_found(kind, text):
    assert {found_kind for _, found_kind, _ in comment_findings(Path("engine/planted.py"), f"x = 1  # {text}\n")} \
        == {kind}


@pytest.mark.parametrize("text", [
    "a 5 x 16 tile of 49k x 576",          # shapes, not ratios
    "0x1F marks the header",               # hex
    "every `server.stats_interval` seconds",
    "on the host that runs the engine",
    "vm.max_map_count bounds the mappings",
    'durations ("50ms" or "0.2s")',        # what a user writes
])
def test_shapes_hex_literals_and_plain_words_are_not_figures(text):
    assert comment_findings(Path("engine/planted.py"), f"x = 1  # {text}\n") == []


def test_a_docstring_example_block_is_a_literal_but_an_indented_line_of_prose_is_not():
    source = ('def f():\n    """Prints its timing:\n\n        [ttft 0.21 s]\n\n    Measured on a\n'
              '        2-core machine."""\n')
    assert [(location, kind) for location, kind, _ in comment_findings(Path("engine/planted.py"), source)] == [
        ("engine/planted.py:7", "machine name")]


def test_code_and_strings_are_not_comments():
    source = 'TIMEOUT_S = 2.5  # seconds\nMESSAGE = "took 2.4 ms on the H200"\nRATIO = 10\n'
    assert comment_findings(Path("engine/planted.py"), source) == []
