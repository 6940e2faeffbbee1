"""The README and docs/ point at things that exist: every relative link resolves (a file, and a heading
where the link names one), and every dotted config key they name is a key of the config schema."""
from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from kvstrata.engine.config.schema import Config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _prose(text: str) -> str:
    """The text without fenced code blocks, where a `](` or a dotted name is code, not a reference."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M)}


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every dotted key of the schema, sections included (`cache.tiers`, `cache.tiers.cpu.size`)."""
    keys = set()
    for name, field in model.model_fields.items():
        key = prefix + name
        keys.add(key)
        for section in _models_in(field.annotation):
            keys |= _keys(section, key + ".")
    return keys


def _models_in(annotation) -> list[type[BaseModel]]:
    """The sections inside a field's type: `X`, `X | None`, `tuple[X, ...]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


SCHEMA_KEYS = _keys(Config)
SECTIONS = sorted(Config.model_fields)
DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.\w+)+)(?![\w/])" % "|".join(SECTIONS))
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".txt", ".png")


def _named_keys(text: str) -> set[str]:
    """The dotted config keys a page names in its inline code (`cache.tiers.cpu.size`, `--set model.dtype=...`)."""
    found = set()
    for span in CODE_SPAN.findall(_prose(text)):
        if "unknown key" in span:
            continue  # an error message quoting a misspelt key, shown as the user would see it
        for key in DOTTED.findall(span):
            if not key.endswith(FILE_SUFFIXES):
                found.add(key)
    return found


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_config_keys_exist(page):
    unknown = sorted(_named_keys(page.read_text()) - SCHEMA_KEYS)
    assert not unknown, f"{page.name} names keys the config schema lacks: {unknown}"


def test_the_checks_catch_what_they_look_for(tmp_path):
    # A misspelt key and a link to a missing heading are what these tests exist to catch.
    assert _named_keys("set `cache.tiers.cpu.sise` and `cache.tiers.cpu.size`") == {
        "cache.tiers.cpu.sise", "cache.tiers.cpu.size"}
    assert "cache.tiers.cpu.size" in SCHEMA_KEYS and "cache.tiers.cpu.sise" not in SCHEMA_KEYS
    assert _named_keys("see `engine/config/schema.py` and `events.py`") == set()
    assert _named_keys("fails with `cache.tiers.dsk: unknown key`") == set()
    page = tmp_path / "page.md"
    page.write_text("# Some heading\n\n```\n# not a heading\n```\n")
    assert _anchors(page) == {"some-heading"}


def test_readme_stays_short():
    # The README is the five-minute introduction; the reference lives in docs/.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
